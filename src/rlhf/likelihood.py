"""Token log-likelihoods of a causal LM: each token's logprob, the entropy of each position, and the mean
negative log-likelihood of target tokens (the SFT loss, the reward model's imitation term, the PPO-ptx term).

Conventions as :mod:`rlhf.losses`: ``B`` the batch, ``T`` the tokens of a row, ``V`` the vocabulary; a mask is a
bool tensor, True on the tokens to score.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.losses import masked_mean


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution of each position, in nats.

    Args:
        logits: ``(B, R, V)`` float.

    Returns:
        ``(B, R)`` float.
    """
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


LOGPROB_CHUNK = 512
"""Positions per chunk of :func:`logprobs_from_logits`: bounds its float32 working copy to 512 x vocab."""


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under the logits that predict it: ``z_token / T - logsumexp(z / T)``.

    Computed as gather minus logsumexp over chunks of :data:`LOGPROB_CHUNK`
    positions in float32 (whatever the logits' dtype), so no float32
    log-softmax over the whole ``(B, R, V)`` vocabulary is ever built beside the
    logits (TRL's ``selective_log_softmax`` does the same per row).

    Args:
        logits: ``(B, R, V)`` float (any float dtype), the logits *predicting* each token (already
            shifted: ``logits[:, t]`` predicts ``tokens[:, t]``).
        tokens: ``(B, R)`` int64.
        temperature: the sampling temperature the logits are divided by (> 0).

    Returns:
        ``(B, R)`` float32 log-probabilities (nats).
    """
    flat, targets = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
    parts = []
    for start in range(0, flat.shape[0], LOGPROB_CHUNK):
        chunk = flat[start : start + LOGPROB_CHUNK].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        chosen = chunk.gather(-1, targets[start : start + LOGPROB_CHUNK]).squeeze(-1)
        parts.append(chosen - torch.logsumexp(chunk, dim=-1))
    return (torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)).reshape(tokens.shape)


def next_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, token_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift a causal LM's outputs so position ``t`` of the result scores token ``t + 1``.

    Args:
        logits: ``(B, T, V)`` float, the model's outputs on ``input_ids``.
        input_ids: ``(B, T)`` int64.
        token_mask: ``(B, T)`` bool, True on the tokens to score (e.g. response tokens).

    Returns:
        ``(logprobs (B, T - 1) float32, mask (B, T - 1) bool)``: ``logprobs[:, t]``
        is ``log p(input_ids[:, t + 1] | input_ids[:, :t + 1])`` and ``mask`` is
        ``token_mask[:, 1:]``.
    """
    return logprobs_from_logits(logits[:, :-1], input_ids[:, 1:]), token_mask[:, 1:].bool()


def language_model_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, token_mask: torch.Tensor, count: torch.Tensor | int | None = None
) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens (nats/token).

    The SFT loss (response tokens only), the reward model's imitation term
    (paper Eq. 2) and the PPO-ptx term (tutorial Eq. 14, negated).

    Args:
        logits: ``(B, T, V)`` float.
        input_ids: ``(B, T)`` int64.
        token_mask: ``(B, T)`` bool, True on the target tokens.
        count: target tokens of the whole batch these rows are a part of (:func:`target_tokens` summed;
            :func:`masked_mean`'s ``count``); None: this batch's own.

    Returns:
        Scalar float.
    """
    logprobs, mask = next_token_logprobs(logits, input_ids, token_mask)
    return -masked_mean(logprobs, mask, count=count)


def target_nll(logprobs: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """Mean negative log-likelihood of target tokens given only their logprobs: ``-sum(logprobs) / count``.

    :func:`language_model_loss` when the LM head ran on the target positions alone
    (:func:`rlhf.models.forward.target_logprobs`): the SFT loss (tutorial stage 1).

    Args:
        logprobs: ``(N,)`` float, one per target token of this part of the batch.
        count: target tokens of the whole batch this part belongs to (:func:`target_tokens` summed); below 1
            counts as 1.

    Returns:
        Scalar float (nats/token): this part's share of the whole batch's mean.
    """
    total = torch.as_tensor(count, dtype=logprobs.dtype, device=logprobs.device).clamp(min=1.0)
    return -logprobs.sum() / total


def target_tokens(token_mask: list[bool] | list[int]) -> int:
    """The tokens :func:`language_model_loss` scores in one sequence: the masked ones after the first position
    (the first token has no logits predicting it)."""
    return int(sum(bool(flag) for flag in token_mask[1:]))
