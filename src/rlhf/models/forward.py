"""Forward passes over padded sequences: token and sequence scores of a scalar model, response logprobs
and target-token logprobs of a causal LM. Masks always come from the attention mask (never from comparing ids
to the pad id), and ``position_ids`` from the attention mask too.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from rlhf.likelihood import logprobs_from_logits
from rlhf.losses import last_token_index
from rlhf.models.kind_heads import head_kinds, head_scores, read_scores
from rlhf.models.trunk import TrunkEntry, last_hidden_state
from rlhf.runtime.sharding import is_sharded


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them.

    Args:
        attention_mask: ``(B, T)`` 0/1.

    Returns:
        ``(B, T)`` int64; pads get position 0.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_scores(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, entry: TrunkEntry | None = None
) -> torch.Tensor:
    """Scalar head output at every position: the value model's ``V(s_t)``.

    Args:
        model: a sequence-classification model: one output, or kind heads mixed (:func:`rlhf.models.kind_heads.mix`).
        input_ids: ``(B, T)`` int64.
        attention_mask: ``(B, T)`` 0/1.
        entry: the states entering ``model``'s first unshared block (:class:`rlhf.models.trunk.SharedTrunk`), or None.

    Returns:
        ``(B, T)`` float32.
    """
    hidden = last_hidden_state(model, input_ids, attention_mask, position_ids_from_mask(attention_mask), entry)
    return head_scores(model, hidden)


def sequence_scores(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    entry: TrunkEntry | None = None,
    kinds: list[str] | None = None,
) -> torch.Tensor:
    """Reward-model score ``r_psi(x, y)`` read at the last real token (found from the attention mask).

    The stored centring offset (``config.reward_offset``, the mean score of the
    demonstrations) is subtracted.

    Args:
        model: reward model (sequence-classification head: one output, or kind heads).
        input_ids: ``(B, T)`` int64, prompt + response, left- or right-padded.
        attention_mask: ``(B, T)`` 0/1.
        entry: as :func:`token_scores`.
        kinds: each row's kind of data, read with its own kind's score (:func:`rlhf.models.kind_heads.read_scores`);
            None: the kind gate's mix.

    Returns:
        ``(B,)`` float32.
    """
    hidden = last_hidden_state(model, input_ids, attention_mask, position_ids_from_mask(attention_mask), entry)
    last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(attention_mask)]
    return scores_from_states(model, last, kinds)


def scores_from_states(model: PreTrainedModel, states: torch.Tensor, kinds: list[str] | None = None) -> torch.Tensor:
    """Reward-model scores from the backbone's final (normed) states at each sequence's last token: the score
    head, each row read with its kind's score (:func:`rlhf.models.kind_heads.read_scores`; None: the kind gate's
    mix), less the stored centring offset (``config.reward_offset``).

    Args:
        model: reward model (sequence-classification head: one output, or kind heads).
        states: ``(B, H)``, any float dtype: cast to the head's (a bf16-stored model, ``device.frozen_bf16``, is
            read without autocast where the precision is fp32).
        kinds: each row's kind of data, or None.

    Returns:
        ``(B,)`` float32.
    """
    offset = float(getattr(model.config, "reward_offset", 0.0))
    outputs = model.score(states.to(model.score.weight.dtype)).float()
    return read_scores(outputs, head_kinds(model), kinds) - offset


def response_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    temperature: float = 1.0,
    with_logits: bool = False,
    entry: TrunkEntry | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of the response tokens ``input_ids[:, response_start:]`` under a causal LM.

    The logits at position ``t - 1`` predict token ``t``; they are divided by
    the sampling temperature so the logprobs are those of the distribution the
    rollout sampled from.

    Args:
        model: causal LM.
        input_ids: ``(B, T)`` int64, left-padded prompt then response.
        attention_mask: ``(B, T)`` 0/1.
        response_start: index of the first response token (the padded prompt length).
        temperature: sampling temperature (> 0).
        with_logits: also return the response logits.
        entry: the states entering ``model``'s first unshared block (:class:`rlhf.models.trunk.SharedTrunk`), or None.

    Returns:
        ``(logprobs (B, T - response_start) float32, logits (B, T - response_start, V) or None)``.
    """
    # only the positions that predict response tokens go through the LM head (logits_to_keep)
    keep, position_ids = input_ids.shape[1] - response_start + 1, position_ids_from_mask(attention_mask)
    if entry is None:
        output = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=keep
        )
        logits = output.logits[:, :-1]
    else:
        hidden = last_hidden_state(model, input_ids, attention_mask, position_ids, entry)
        logits = model.lm_head(hidden[:, -keep:])[:, :-1]
    logprobs = logprobs_from_logits(logits, input_ids[:, response_start:], temperature)
    return logprobs, (logits.float() / temperature if with_logits else None)


def target_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Logprobs of chosen tokens only, the LM head run on the positions that predict them and no other.

    The backbone runs over every token; of its hidden states only those at ``(rows[n], positions[n])`` go through
    the LM head (SmolLM2's head is ~20% of a forward's arithmetic, and a ``(B, T, V)`` float logit tensor is never
    built), each scoring the token after it, ``input_ids[rows[n], positions[n] + 1]``. The positions come from the
    host (the SFT step's encodings), so no data-dependent shape costs a host round trip. A sharded (FSDP) model
    runs its whole forward, which alone gathers its weights. Position ids come from the attention mask, so either
    padding side works. The result equals :func:`rlhf.likelihood.next_token_logprobs` of the full logits at those
    positions (``tests/test_levers.py``).

    Args:
        model: causal LM with an ``lm_head`` over its backbone's final hidden states.
        input_ids: ``(B, T)`` int64.
        attention_mask: ``(B, T)`` 0/1.
        rows, positions: ``(N,)`` int64 on the model's device, each ``positions[n] < T - 1``.

    Returns:
        ``(N,)`` float32.
    """
    position_ids = position_ids_from_mask(attention_mask)
    if is_sharded(model):  # FSDP gathers the weights in the whole model's forward only: every position's logits
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logits = logits[rows, positions]
    else:
        hidden = last_hidden_state(model, input_ids, attention_mask, position_ids)
        logits = model.lm_head(hidden[rows, positions])
    return logprobs_from_logits(logits[None], input_ids[rows, positions + 1][None])[0]
