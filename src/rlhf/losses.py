"""The equations of RLHF and PPO-max, one small pure function each.

References, cited through the package by their numbers:
- "tutorial Eq. N": the tutorial "Reinforcement Learning from Human Feedback (RLHF)" (InstructGPT's three stages,
  the Bradley-Terry reward model, the KL-penalised PPO objective and PPO-ptx), its numbered equations;
- "paper Eq. N" and "paper section N": Zheng et al., "Secrets of RLHF in Large Language Models Part I: PPO"
  (arXiv:2307.04964), the PPO-max recipe of its section 5 and appendices B and C.

Conventions: ``B`` is the batch, ``R`` the number of response tokens. Every
``mask`` is a ``(B, R)`` bool tensor that is ``True`` on real response tokens
(built from the attention mask, never from comparing ids to the pad id).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, count: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is True.

    Args:
        values: float tensor of any shape.
        mask: bool tensor broadcastable to ``values``.
        dim: reduce along this dimension; ``None`` reduces over all elements.
        count: the number of masked elements of the *whole batch* these values are a part of (a micro-batch,
            or one rank's rows: :mod:`rlhf.runtime.distributed`); the result is then this part's share of the whole
            batch's mean, and the shares of its parts sum to that mean. None: this tensor's own count.

    Returns:
        The masked mean (or share); 0 where a row has no valid element. Masked-out positions are
        filled with 0 before summing, so an inf or NaN there cannot reach the result.
    """
    mask = mask.bool().expand_as(values)
    filled = torch.where(mask, values, torch.zeros_like(values))
    total = filled.sum() if dim is None else filled.sum(dim)
    if count is None:
        count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return total / torch.as_tensor(count, dtype=values.dtype, device=values.device).clamp(min=1.0)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    across: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit (population) variance over the masked positions.

    Used for advantage normalisation (paper section 5.3.1, off in PPO-max by appendix B.1).

    Args:
        values: ``(B, R)`` float.
        mask: ``(B, R)`` bool.
        shift_mean: if False, the mean is added back (scale only).
        eps: added to the variance.
        across: sums a tensor over the parts of the batch held elsewhere (``Ranks.sum``: the
            statistics are then those of the whole batch across ranks); None: these values are the batch.

    Returns:
        ``(B, R)`` float, 0 outside the mask. With fewer than two valid elements
        the variance is 0 and the result stays finite (no NaN).
    """
    total = across or (lambda tensor: tensor)
    zeros = torch.zeros_like(values)
    count = total(mask.to(values.dtype).sum()).clamp(min=1.0)
    mean = total(torch.where(mask, values, zeros).sum()) / count
    var = total(torch.where(mask, (values - mean) ** 2, zeros).sum()) / count
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def bradley_terry_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: float = 0.0, count: int | None = None
) -> torch.Tensor:
    """Reward-model loss, ``-log sigmoid(r(x, y_w) - r(x, y_l) - margin)`` averaged over pairs.

    Source: tutorial Eq. 6 (paper Eq. 2 without its LM term). ``margin`` is the
    optional margin of Llama 2's reward model; 0 gives Eq. 6 exactly.

    Args:
        chosen_scores: ``(B,)`` float, scores of the preferred responses.
        rejected_scores: ``(B,)`` float, scores of the rejected responses.
        margin: non-negative float.
        count: pairs in the whole batch these are a part of (:func:`masked_mean`'s ``count``); None: ``B``.

    Returns:
        Scalar float loss (nats).
    """
    losses = -F.logsigmoid(chosen_scores - rejected_scores - margin)
    return losses.sum() / (count if count is not None else max(len(losses), 1))


LOG_RATIO_MAX = 80.0
"""The largest ``|log(pi / pi_ref)|`` or ``|log rho|`` whose exponential the losses take: ``e^80 = 5.5e34``
leaves float32 (max ``3.4e38``) room for an advantage or a sum over tokens. Past it the formula itself is inf
in float32 (``e^88.8``), so nothing the formula gives finitely is changed."""


def kl_k1(logratio: torch.Tensor) -> torch.Tensor:
    """k1 KL estimator per token: ``log pi(y_t|s_t) - log pi_ref(y_t|s_t)``.

    The estimator the token reward of tutorial Eq. 11 uses (unbiased, can be negative).

    Args:
        logratio: ``(B, R)`` float, policy minus reference logprobs of the sampled tokens.

    Returns:
        ``(B, R)`` float.
    """
    return logratio


def kl_k3(logratio: torch.Tensor) -> torch.Tensor:
    """k3 KL estimator per token: ``exp(-d) - 1 + d`` with ``d = log pi - log pi_ref``.

    Schulman's low-variance, always non-negative estimator of KL(pi || pi_ref)
    for samples drawn from pi; logged beside k1.

    ``d`` is clamped below at ``-LOG_RATIO_MAX`` (:data:`LOG_RATIO_MAX`) first: under it ``exp(-d)`` is past
    float32's range (the formula is inf there, at ``d = -88.8`` and below), so the estimate stays finite
    (at most ``e^80``) for every finite input; above it the value is the formula's.

    Args:
        logratio: ``(B, R)`` float.

    Returns:
        ``(B, R)`` float, >= 0 and finite for finite input.
    """
    logratio = logratio.clamp(min=-LOG_RATIO_MAX)
    return torch.expm1(-logratio) + logratio


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True position of each row of ``mask``.

    Works for left and right padding. A row with no True position gives 0.

    Args:
        mask: ``(B, T)`` bool or 0/1 tensor (an attention or response mask).

    Returns:
        ``(B,)`` int64.
    """
    mask = mask.to(torch.long)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return (positions * mask).max(dim=-1).values


def token_rewards(logratio: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token rewards with the KL penalty: ``r_t = -beta * log(pi/pi_ref) + [t = T] r_psi(x, y)``.

    Source: tutorial Eq. 11 (paper Eq. 3). The reward-model score is added on
    the last response token (the EOS if one was generated), never on a pad.

    Args:
        logratio: ``(B, R)`` float, policy minus reference logprobs (k1).
        scores: ``(B,)`` float, the reward-model score of each response (after
            any normalisation).
        mask: ``(B, R)`` bool, True on response tokens.
        beta: KL coefficient (>= 0).

    Returns:
        ``(B, R)`` float rewards, 0 outside the mask.
    """
    rewards = torch.where(mask, -beta * logratio, torch.zeros_like(logratio))
    last = last_token_index(mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    has_token = mask.any(dim=-1).to(scores.dtype)
    rewards[rows, last] += scores * has_token
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation and returns.

    ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)``, ``A_t = sum_l (gamma lam)^l delta_{t+l}``,
    ``R_t = A_t + V(s_t)``. The value after the last response token is 0.
    Source: paper Eq. 9 (section 3.2.2).

    Args:
        rewards: ``(B, R)`` float, token rewards (Eq. 11).
        values: ``(B, R)`` float, value-model predictions at rollout time.
        mask: ``(B, R)`` bool, True on response tokens (a prefix of each row).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, both ``(B, R)`` float, 0 outside the mask.
    """
    maskf = mask.to(values.dtype)
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    values = torch.where(mask, values, torch.zeros_like(values))
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * maskf[:, t]
        advantages[:, t] = running
        next_value = values[:, t]
    returns = (advantages + values) * maskf
    return advantages, returns


def sequence_returns(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each response's undiscounted return ``R_i = sum_t r_t``: its score less its KL penalty (tutorial Eq. 11).

    What a critic-free estimator (:func:`rloo_advantages`, :func:`grpo_advantages`) compares within a group:
    TRL's RLOO ``score - beta * sum(KL)``, a sequence-level return with no discount.

    Args:
        rewards: ``(B, R)`` float, token rewards (:func:`token_rewards`).
        mask: ``(B, R)`` bool, True on response tokens.

    Returns:
        ``(B,)`` float.
    """
    return torch.where(mask, rewards, torch.zeros_like(rewards)).sum(-1)


def _groups(returns: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(N,)`` returns as ``(N / k, k)`` groups of consecutive rows; raises ValueError when ``k`` does not fit."""
    if group_size < 2 or returns.ndim != 1 or returns.shape[0] % group_size:
        raise ValueError(
            f"a group-baseline estimator needs groups of k >= 2 samples of one prompt filling the batch: "
            f"{tuple(returns.shape)} returns in groups of {group_size}"
        )
    return returns.view(-1, group_size)


def rloo_advantages(returns: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: each sample's return less the mean return of the other ``k - 1`` samples.

    ``A_i = R_i - 1/(k-1) sum_{j != i} R_j`` over the ``k`` samples of one prompt, which equals
    ``k/(k-1) (R_i - mean_j R_j)``: an unbiased baseline that needs no critic.
    Source: Ahmadian et al. (2024), "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", section 3 (RLOO; Kool et al. 2019).

    Args:
        returns: ``(N,)`` float, one return per sample (:func:`sequence_returns`); the ``k`` samples of one
            prompt are consecutive rows.
        group_size: ``k`` >= 2, samples a prompt.

    Returns:
        ``(N,)`` float, the advantage of each sample, in the rows' order.

    Raises:
        ValueError: ``k`` < 2 or ``N`` not a multiple of ``k``.
    """
    groups = _groups(returns, group_size)
    others = (groups.sum(-1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).flatten()


def grpo_advantages(returns: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantage: each sample's return standardised within its prompt's ``k`` samples.

    ``A_i = (R_i - mean_j R_j) / (std_j R_j + eps)``, ``std`` the sample (``k - 1``) standard deviation, as TRL's
    GRPO trainer computes it; a group of equal returns has advantage 0 throughout.
    Source: Shao et al. (2024), "DeepSeekMath", section 4.1.2 (GRPO, outcome supervision).

    Args:
        returns: ``(N,)`` float, as :func:`rloo_advantages`.
        group_size: ``k`` >= 2.
        eps: added to the standard deviation.

    Returns:
        ``(N,)`` float.

    Raises:
        ValueError: ``k`` < 2 or ``N`` not a multiple of ``k``.
    """
    groups = _groups(returns, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    return (centred / (groups.std(-1, keepdim=True) + eps)).flatten()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy loss, the negative of ``E_t[min(rho A, clip(rho, 1-eps, 1+eps) A)]``.

    Source: tutorial Eq. 13 (paper Eq. 15).

    Args:
        logprobs: ``(B, R)`` float, current policy logprobs of the sampled tokens.
        old_logprobs: ``(B, R)`` float, logprobs cached at rollout time.
        advantages: ``(B, R)`` float.
        mask: ``(B, R)`` bool.
        clip: epsilon, e.g. 0.2.
        count: response tokens of the whole minibatch these rows are a part of (:func:`masked_mean`);
            the loss and the stats are then this part's shares. None: this batch's own tokens.

    Finite for every finite input (with advantages and token counts that float32 can multiply by ``e^80``).
    Where the clipped term is taken (``A > 0`` and ``rho > 1 + eps``, or ``A < 0`` and ``rho < 1 - eps``) the
    term is the constant ``-A clip(rho)`` with zero gradient, whatever ``rho`` is: the decision is made on
    ``log rho`` and ``exp`` never sees the log-ratio there, so an overflowing ``rho`` cannot turn the zero
    gradient into ``0 * inf = NaN``. Elsewhere ``log rho`` is clamped to ``+-LOG_RATIO_MAX``
    (:data:`LOG_RATIO_MAX`, 80) before ``exp``: past it the formula's value is inf in float32 (``rho =
    e^88.8``); the clamped term is ``-A e^80`` with zero gradient.

    Returns:
        ``(loss, stats)``: scalar loss; stats holds ``clipfrac`` (share of tokens
        where the clipped term was taken), ``approx_kl`` (Schulman's k2 estimator of old
        vs new, ``0.5 E[(log rho)^2]``, as TRL's PPO logs it) and ``ratio`` (mean rho, each clamped as above),
        all detached scalars.
    """
    # padded positions are filled before exp, so an inf there cannot make the loss NaN
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    bounds = math.log(1.0 - clip) if clip < 1.0 else -math.inf, math.log(1.0 + clip)
    taken = ((advantages > 0) & (log_ratio > bounds[1])) | ((advantages < 0) & (log_ratio < bounds[0]))
    ratio = torch.exp(torch.where(taken, 0.0, log_ratio).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX))
    clipped_ratio = torch.where(log_ratio > 0, 1.0 + clip, 1.0 - clip)  # the bound taken, where it is taken
    terms = torch.where(taken, -advantages * clipped_ratio, -advantages * ratio)
    loss = masked_mean(terms, mask, count=count)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(taken.to(log_ratio.dtype), mask, count=count),
            "approx_kl": masked_mean(0.5 * log_ratio**2, mask, count=count),
            "ratio": masked_mean(log_ratio.clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX).exp(), mask, count=count),
        }
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Value loss ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    Source: paper Eq. 16 (MSE critic loss), clipped as in paper section 5.3
    (PPO-max keeps value clipping on). ``old_values`` must be the values cached
    at rollout time. ``clip=None`` gives the plain ``0.5 (V - R)^2``.

    Args:
        values: ``(B, R)`` float, current value predictions.
        old_values: ``(B, R)`` float, predictions cached at rollout time.
        returns: ``(B, R)`` float, GAE returns.
        mask: ``(B, R)`` bool.
        clip: clip range in value units, or None for no clipping.
        count: response tokens of the whole minibatch these rows are a part of (:func:`masked_mean`);
            the loss and ``clipfrac`` are then this part's shares. None: this batch's own tokens.

    Returns:
        ``(loss, stats)``: scalar loss; stats holds ``clipfrac`` (share of tokens
        where the clipped error was the larger one).
    """
    # padded positions are filled before any arithmetic, so an inf there cannot make the loss NaN
    values, old_values, returns = (torch.where(mask, x, torch.zeros_like(x)) for x in (values, old_values, returns))
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * masked_mean(unclipped, mask, count=count), {"clipfrac": values.new_zeros(())}
    values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask, count=count)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).to(values.dtype), mask, count=count)}
    return loss, stats


def ppo_ptx_loss(policy_loss: torch.Tensor, ptx_lm_loss: torch.Tensor, ptx_coef: float) -> torch.Tensor:
    """PPO-ptx objective as a loss: ``L = L_policy + lambda_ptx * NLL_pretrain``.

    Source: tutorial Eq. 14 (maximise ``L^CLIP + eta E[log pi(x)]``; the paper's
    lambda_ptx, Eq. 17). ``ptx_lm_loss`` is the mean NLL (nats/token) of
    pretraining-style text from :func:`rlhf.likelihood.language_model_loss`.

    Args:
        policy_loss: scalar, the PPO-clip loss (plus any entropy term).
        ptx_lm_loss: scalar.
        ptx_coef: lambda_ptx >= 0.

    Returns:
        Scalar loss.
    """
    return policy_loss + ptx_coef * ptx_lm_loss


def normalize_and_clip(
    scores: torch.Tensor, mean: float, std: float, clip: float | None, eps: float = 1e-8
) -> torch.Tensor:
    """Reward normalisation and clipping: ``clip((r - mean) / std, -delta, delta)``.

    Source: paper Eq. 18 (section 5.3.1), with the running (historical) mean
    and std of the reward-model scores.

    Args:
        scores: ``(B,)`` float raw reward-model scores.
        mean: running mean.
        std: running (population) std.
        clip: delta, or None for no clipping.

    Returns:
        ``(B,)`` float.
    """
    normalized = (scores - mean) / (std + eps)
    return normalized.clamp(-clip, clip) if clip is not None else normalized


def adaptive_kl_coef(kl_coef: float, kl: float, target: float, horizon: int, steps: int) -> float:
    """Adaptive KL controller of Ziegler et al. (2019).

    ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * steps / horizon``.

    Args:
        kl_coef: current beta.
        kl: observed sequence-level KL (nats per response, mean over the rollout).
        target: KL target (nats per response).
        horizon: controller horizon in samples (Ziegler et al.: 10,000 at 512 samples a step, so beta moves
            by at most 0.2 x 512 / 10,000 = 1% a step; 160 gives the same at 8 samples).
        steps: samples since the last update (the rollout batch size).

    Returns:
        The new beta.
    """
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * steps / horizon)
