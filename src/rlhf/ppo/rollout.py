"""Experience: sample responses, score them, and turn them into token rewards, advantages and returns.

One rollout: sample from the policy (temperature only), score each response with the reward model where the
reward model learned to read (at the end-of-turn token; an unfinished or empty response is treated as
:class:`GenerationSettings` says), normalise the scores with running statistics (paper Eq. 18; per prompt kind:
:mod:`rlhf.ppo.moments`), add the KL penalty per token (tutorial Eq. 11), and run GAE against the value model's
predictions (paper Eq. 9), or compare the returns of several samples of one prompt (``rloo``, ``grpo``: no value
model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import likelihood, losses
from rlhf.models.forward import response_logprobs, token_scores
from rlhf.models.generation import GenerationSettings, ScoredRollout, sample_and_score
from rlhf.models.trunk import TrunkEntry
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.monitoring import COLUMNS, kind_reward_means, rollout_stats
from rlhf.ppo.types import PPOModels
from rlhf.runtime.device import PhaseTimer, Runtime
from rlhf.runtime.distributed import Ranks


def value_predictions(
    value_model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    entry: TrunkEntry | None = None,
) -> torch.Tensor:
    """``V(s_t)`` for each response token: the value head at the position that predicts token ``t``.

    The head's output is mapped by the model's calibration (``config.value_scale``,
    ``config.value_bias``; 1 and 0 unless :func:`calibrate_value_head` set them):
    ``V = head * scale + bias``.

    Args:
        input_ids, attention_mask: ``(B, T)``; response tokens start at ``response_start``.
        entry: the states entering the value model's first unshared block (:class:`rlhf.models.trunk.SharedTrunk`).

    Returns:
        ``(B, T - response_start)`` float32.
    """
    head = token_scores(value_model, input_ids, attention_mask, entry)[:, response_start - 1 : -1]
    scale = float(getattr(value_model.config, "value_scale", 1.0))
    bias = float(getattr(value_model.config, "value_bias", 0.0))
    return head * scale + bias


def calibrate_value_head(
    value_model: PreTrainedModel, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, ranks: Ranks
) -> torch.Tensor:
    """Put a value model initialised from the reward model on the scale of the returns it must predict.

    The reward model's head was trained at the end of a response only; what it reads mid-response has
    its own offset and spread. The first rollout's Monte Carlo returns ``G_t = sum_l gamma^l r_{t+l}``
    (the rewards PPO optimises: normalised score and KL penalty) are regressed on the current
    predictions by least squares over every response token of every rank, ``G ~ a V + b``, and the
    model's calibration becomes ``V' = a V + b``: the best affine predictor of this rollout's returns,
    so the critic starts with explained variance >= 0 where a fixed rescaling of the head can start far
    below (paper section 5.3.3 initialises the critic from the reward model; this puts it on the scale).

    Args:
        value_model: initialised from the reward model; its ``config.value_scale`` / ``value_bias`` are set.
        values: ``(B, R)`` float, its predictions under its current calibration.
        returns: ``(B, R)`` float, the rollout's Monte Carlo returns (:func:`rlhf.losses.gae` with ``lam`` 1 and
            zero values, over the token rewards of :func:`rlhf.losses.token_rewards`).
        mask: ``(B, R)`` bool, True on response tokens.
        ranks: the processes; each passes its share of the batch.

    Returns:
        ``(B, R)`` float32, the predictions after calibration (``a * values + b``).
    """
    x, y = values[mask].double(), returns[mask].double()
    n, sx, sy, sxx, sxy = ranks.sum(
        torch.stack([x.new_tensor(x.numel()), x.sum(), y.sum(), (x * x).sum(), (x * y).sum()])
    )
    var = sxx / n - (sx / n) ** 2
    slope = ((sxy / n - sx * sy / n**2) / var).item() if var > 0 else 0.0
    intercept = (sy / n - slope * sx / n).item()
    config = value_model.config
    config.value_scale = slope * float(getattr(config, "value_scale", 1.0))
    config.value_bias = slope * float(getattr(config, "value_bias", 0.0)) + intercept
    return (values * slope + intercept).float()


@dataclass
class Experience:
    """A scored buffer of rollouts. Shapes: ``B`` rollouts, ``T`` = prompt + response tokens, ``R`` response tokens."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    response_start: int
    mask: torch.Tensor  # (B, R) bool
    logprobs: torch.Tensor  # (B, R) float32, policy at rollout time (temperature-scaled)
    values: torch.Tensor  # (B, R) float32, value model at rollout time
    advantages: torch.Tensor  # (B, R) float32
    returns: torch.Tensor  # (B, R) float32
    raw_scores: torch.Tensor  # (B,) float32
    ended: torch.Tensor  # (B,) bool, an EOS was generated
    # the states entering the policy's / value model's first trained block: PPO's epochs run only the blocks
    # above (their frozen blocks cannot change within an iteration); None: the plain path (rlhf.models.trunk)
    policy_entry: TrunkEntry | None = None
    value_entry: TrunkEntry | None = None


@torch.no_grad()
def make_experience(
    models: PPOModels,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    config: PPOConfig,
    settings: GenerationSettings,
    moments: RewardMoments,
    kl_coef: float,
    runtime: Runtime,
    calibrate_value: bool = False,
    seeds: list[int] | None = None,
    kinds: list[str] | None = None,
) -> tuple[Experience, dict[str, float]]:
    """Roll out, score and turn a batch of prompts into advantages and returns.

    With several processes each rank passes its share of the batch (:meth:`rlhf.runtime.distributed.Ranks.shard`)
    and builds the experience of its prompts; what spans the batch is taken over all ranks: the running
    reward statistics fold in every rank's scores, and the stats describe the whole batch.

    Args:
        models: the four models, dropout off (no value model for ``rloo`` and ``grpo``).
        tokenizer: shared tokenizer.
        prompts: token lists (chat template with generation header).
        config: :class:`PPOConfig`; settings: :class:`GenerationSettings`.
        moments: running reward statistics (updated here when normalisation is on; per kind: ``kinds`` name the
            streams).
        kl_coef: the current beta.
        runtime: device and precision; every forward pass runs under ``runtime.autocast()``.
        calibrate_value: fit the value model's calibration to this rollout's returns
            (:func:`calibrate_value_head`) before the advantages are computed.
        seeds: one generator seed per prompt (:func:`rlhf.models.sampling.prompt_seed`), so the tokens a prompt gets
            do not depend on the rank or the rows beside it; None: torch's global generator.
        kinds: each prompt's kind of data (:func:`sample_and_score`); None: the reward model's kind gate.

    Returns:
        ``(experience, stats)``; stats are the iteration's monitoring signals and the seconds of each
        phase: ``ppo/time/{generation,reward,policy_logprobs,reference,values}``.
    """
    policy, reference, reward_model, value_model = models.as_tuple()
    timer = PhaseTimer(runtime)
    with runtime.autocast():
        scored = sample_and_score(
            policy, reward_model, tokenizer, prompts, settings, timer=timer, seeds=seeds, kinds=kinds
        )
        rollout, trunk = scored.rollout, scored.trunk
        ids, attn, start = rollout.input_ids, rollout.attention_mask, rollout.response_start
        with timer("policy_logprobs"):
            policy_entry = trunk.entry(policy)
            logprobs, logits = response_logprobs(
                policy, ids, attn, start, settings.temperature, with_logits=True, entry=policy_entry
            )
            entropy = likelihood.entropy_from_logits(logits)
            del logits
        with timer("reference"):
            ref_logprobs, _ = response_logprobs(
                reference, ids, attn, start, settings.temperature, entry=trunk.entry(reference)
            )
    mask, scores = rollout.response_mask, scored.scores
    every_kinds = gather_kinds(kinds, runtime.ranks)  # every rank's, in the order gather puts their rows
    if config.reward_normalize is not None:
        moments.update(runtime.ranks.gather(scores), every_kinds)
        scores = moments.normalize(scores, kinds, config.reward_clip)
    elif config.reward_clip is not None:
        scores = scores.clamp(-config.reward_clip, config.reward_clip)
    value_entry, values = None, torch.zeros_like(logprobs)  # no value model (rloo, grpo): V = 0
    if value_model is not None:
        with timer("values"), runtime.autocast():
            value_entry = trunk.entry(value_model)
            values = value_predictions(value_model, ids, attn, start, value_entry)
    logratio = torch.where(mask, logprobs - ref_logprobs, 0.0)
    rewards = losses.token_rewards(logratio, scores, mask, kl_coef)
    outcome = losses.gae(rewards, torch.zeros_like(rewards), mask, config.gamma, 1.0)[1]  # Monte Carlo returns
    if calibrate_value:
        values = calibrate_value_head(value_model, values, outcome, mask, runtime.ranks)
    if config.uses_critic:
        advantages, returns = losses.gae(rewards, values, mask, config.gamma, config.lam)
    else:
        advantages, returns = group_advantages(rewards, mask, config, runtime.ranks)
    experience = Experience(
        input_ids=ids,
        attention_mask=attn,
        response_start=start,
        mask=mask,
        logprobs=logprobs,
        values=values,
        advantages=advantages,
        returns=returns,
        raw_scores=scored.raw_scores,
        ended=rollout.ended,
        policy_entry=policy_entry,
        value_entry=value_entry,
    )
    table = runtime.ranks.gather(sequence_table(scored, scores, logprobs, logratio, entropy, experience, outcome))
    stats = {**rollout_stats(table), **kind_reward_means(table[:, COLUMNS.index("raw")], every_kinds)}
    stats |= {**moments.stats(), "ppo/kl_coef": kl_coef, **timer.stats("ppo/time")}
    if value_model is None:
        stats["ppo/value/explained_variance"] = math.nan  # no value model explains anything
        stats["ppo/value/explained_variance_outcome"] = math.nan
    return experience, stats


def gather_kinds(kinds: list[str] | None, ranks: Ranks) -> list[str] | None:
    """Every rank's prompt kinds in the global order, as :meth:`rlhf.runtime.distributed.Ranks.gather` puts their
    scores.

    Args:
        kinds: this rank's prompts' kinds, one per row of its share of the batch; None: no prompt names its kind.
        ranks: the processes; with several, each passes its own share.

    Returns:
        Every rank's kinds, rank 0's rows first (one list for the whole batch), or None when ``kinds`` is None.
    """
    if kinds is None or ranks.world_size == 1:
        return kinds
    names = ranks.union(kinds)
    every = ranks.gather(torch.tensor([names.index(k) for k in kinds]))
    return [names[i] for i in every.tolist()]


def group_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, config: PPOConfig, ranks: Ranks
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic-free advantages of ``config.advantage_estimator`` (``rloo`` or ``grpo``) and the returns.

    Each response's return is its score less its KL penalty (:func:`rlhf.losses.sequence_returns`); it is compared
    with the returns of the other samples of its prompt (:func:`rlhf.losses.rloo_advantages`,
    :func:`rlhf.losses.grpo_advantages`: the ``samples_per_prompt`` samples of one prompt are consecutive rows of
    the global batch, which the ranks share out row by row, so every rank's returns are gathered first), and the
    advantage is that of every token of the response (TRL's RLOO and GRPO).

    Args:
        rewards: ``(B, R)`` float, this rank's token rewards (:func:`rlhf.losses.token_rewards`).
        mask: ``(B, R)`` bool, True on response tokens.
        config: :class:`PPOConfig` with ``advantage_estimator`` rloo or grpo.
        ranks: the processes (:meth:`rlhf.runtime.distributed.Ranks.shard` shares the batch).

    Returns:
        ``(advantages, returns)``, both ``(B, R)`` float, the sequence's figure on each of its tokens, 0 outside
        the mask.

    Raises:
        ValueError: the global batch is not whole groups of ``samples_per_prompt``
            (:func:`rlhf.losses.rloo_advantages`).
    """
    returns = losses.sequence_returns(rewards, mask)
    every = ranks.gather(returns)
    estimator = losses.rloo_advantages if config.advantage_estimator == "rloo" else losses.grpo_advantages
    mine = estimator(every, config.samples_per_prompt)[ranks.shard(list(range(every.shape[0])))].to(rewards.device)
    maskf = mask.to(rewards.dtype)
    return mine[:, None] * maskf, returns[:, None] * maskf


@torch.no_grad()
def validation_stats(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    reward_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    settings: GenerationSettings,
    runtime: Runtime,
    kinds: list[str] | None = None,
) -> dict[str, float]:
    """Greedy responses on held-out prompts, scored as in training: what the best policy is kept by (``kinds``:
    each prompt's kind of data, :func:`sample_and_score`).

    Every forward pass runs under ``runtime.autocast()``. With several processes each rank passes all the
    prompts, answers its share (:meth:`rlhf.runtime.distributed.Ranks.shard`), and every rank returns the means over
    all.

    Returns:
        ``ppo/validation/reward`` (mean score after the unfinished-response rule),
        ``ppo/validation/eos_rate``, ``ppo/validation/length`` (tokens) and
        ``ppo/validation/kl`` (sequence k1 to the reference, nats/response).
    """
    ranks = runtime.ranks
    mine = ranks.shard(prompts)
    my_kinds = ranks.shard(kinds) if kinds is not None else None
    with runtime.autocast():
        scored = sample_and_score(policy, reward_model, tokenizer, mine, settings, greedy=True, kinds=my_kinds)
        rollout, trunk = scored.rollout, scored.trunk
        ids, attn, start = rollout.input_ids, rollout.attention_mask, rollout.response_start
        logprobs, _ = response_logprobs(policy, ids, attn, start, settings.temperature, entry=trunk.entry(policy))
        ref_logprobs, _ = response_logprobs(
            reference, ids, attn, start, settings.temperature, entry=trunk.entry(reference)
        )
    mask = rollout.response_mask
    kl = torch.where(mask, logprobs - ref_logprobs, 0.0).sum(-1)
    rows = torch.stack([scored.scores, rollout.ended, mask.sum(-1), kl], dim=1).double()
    reward, eos_rate, length, kl = ranks.gather(rows).mean(0).tolist()
    return {
        "ppo/validation/reward": reward,
        "ppo/validation/eos_rate": eos_rate,
        "ppo/validation/length": length,
        "ppo/validation/kl": kl,
    }


def sequence_table(
    scored: ScoredRollout,
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    logratio: torch.Tensor,
    entropy: torch.Tensor,
    experience: Experience,
    outcome: torch.Tensor,
) -> torch.Tensor:
    """One row of :data:`COLUMNS` per response, float64: what :func:`rollout_stats` needs, in a form
    that the ranks' rows simply concatenate into, on the responses' device
    (:meth:`rlhf.runtime.distributed.Ranks.gather`). ``outcome``: ``(B, R)`` the Monte Carlo returns
    ``G_t = sum_l gamma^l r_{t+l}`` (GAE with ``lambda = 1`` and no values), what the values are read against
    besides the GAE returns."""
    mask = experience.mask

    def masked(values: torch.Tensor) -> torch.Tensor:  # float64, 0 outside the response
        return torch.where(mask, values.double(), 0.0)

    residual, outcome_residual = experience.returns - experience.values, outcome - experience.values
    columns = {
        "raw": scored.raw_scores,
        "scored": scored.scores,
        "normalized": scores,
        "length": mask.sum(-1),
        "ended": scored.rollout.ended,
        "empty": scored.empty,
        "unfinished": scored.unfinished,
        "kl": masked(losses.kl_k1(logratio)).sum(-1),
        "kl_k3": masked(losses.kl_k3(logratio)).sum(-1),
        "logprobs": masked(logprobs).sum(-1),
        "entropy": masked(entropy).sum(-1),
        "advantages": masked(experience.advantages).sum(-1),
        "returns": masked(experience.returns).sum(-1),
        "returns_sq": masked(experience.returns**2).sum(-1),
        "residual": masked(residual).sum(-1),
        "residual_sq": masked(residual**2).sum(-1),
        "outcome": masked(outcome).sum(-1),
        "outcome_sq": masked(outcome**2).sum(-1),
        "outcome_residual": masked(outcome_residual).sum(-1),
        "outcome_residual_sq": masked(outcome_residual**2).sum(-1),
    }
    return torch.stack([columns[name].double() for name in COLUMNS], dim=1)
