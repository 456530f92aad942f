"""A reward model that knows the kind of request: a score head per kind of data, mixed by a learned kind gate.

Harmless raters mostly rewarded saying less and helpful raters saying more (docs/results.md): one score for both
kinds ranks one of them backwards. With ``reward.kind_heads`` (and ``judge.kind_heads``) the model's head has
``2K`` outputs for the ``K`` kinds of its training pairs: ``K`` scores ``s_k`` and ``K`` gate logits ``g_k``.
Training reads each pair's own kind's score (its Bradley-Terry term) and teaches the gate the kind (the
cross-entropy of the pair's kind on both responses: :func:`own_kind_scores`); everywhere else the reward is
``r = sum_k softmax(g)_k s_k`` (:func:`mix`), a function of the text alone, for text that does not say its kind;
a row that does (every held-out pair, PPO and evaluation prompt of the pipeline) is read with its own kind's score
(:func:`read_scores`), as training reads it. The kinds are kept in the model's config
(:data:`KINDS_KEY`), in the order of the outputs, and travel with the model.

Sources: a mixture of experts with a learned gate (Jacobs, Jordan, Nowlan & Hinton 1991, "Adaptive Mixtures of
Local Experts"); separate helpfulness and harmlessness rewards (Dai et al. 2024, "Safe RLHF", section 3).
Imports torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

KINDS_KEY = "rlhf_kinds"  # the model config's list of kinds, one score and one gate logit each


def head_kinds(model_or_config: Any) -> list[str]:
    """The kinds of a model's (or a config's, or a ``config.json``'s dict) score heads, in output order; ``[]`` for
    a one-output head."""
    config = getattr(model_or_config, "config", model_or_config)
    found = config.get(KINDS_KEY) if isinstance(config, dict) else getattr(config, KINDS_KEY, None)
    return list(found or [])


def output_count(kinds: Sequence[str]) -> int:
    """Outputs of the head for ``kinds``: ``2K`` (a score and a gate logit per kind), or 1 without kinds."""
    return 2 * len(kinds) if kinds else 1


def mix(outputs: torch.Tensor, kinds: int) -> torch.Tensor:
    """The reward from the head's outputs: ``sum_k softmax(g)_k s_k``, or the one output when ``kinds`` is 0.

    Args:
        outputs: ``(..., 2K)`` (scores first, then gate logits), or ``(..., 1)``; any float dtype.
        kinds: ``K`` (0: a one-output head).

    Returns:
        ``(...)`` in the outputs' dtype.
    """
    if kinds == 0:
        return outputs.squeeze(-1)
    return (outputs[..., :kinds] * torch.softmax(outputs[..., kinds:], dim=-1)).sum(-1)


def read_scores(outputs: torch.Tensor, model_kinds: Sequence[str], kinds: Sequence[str] | None = None) -> torch.Tensor:
    """The reward of each row from the head's outputs: its own kind's score ``s_k`` where ``kinds`` names one of
    the model's kinds (as training reads it: :func:`own_kind_scores`), else the gate's mix (:func:`mix`).

    Every row this pipeline scores knows its kind (a held-out pair, a PPO or evaluation prompt), and the gate
    that reads the response cannot be trusted with it: on the `long` run's harmless test pairs it picked the
    harmless head for 5% of chosen responses, ranking them with the helpful head (docs/results.md).

    Args:
        outputs: ``(N, 2K)`` float, or ``(N, 1)`` for a one-output head.
        model_kinds: the model's kinds in output order (:func:`head_kinds`); empty for one output.
        kinds: ``N`` kinds (a row's may be one the model lacks, e.g. ``general``: the mix), or None: all mixed.

    Returns:
        ``(N,)`` in the outputs' dtype.

    Raises:
        ValueError: ``kinds`` is not one per row.
    """
    mixed = mix(outputs, len(model_kinds))
    if not model_kinds or kinds is None:
        return mixed
    if len(kinds) != outputs.shape[0]:
        raise ValueError(f"{len(kinds)} kinds for {outputs.shape[0]} rows")
    index = torch.tensor([model_kinds.index(k) if k in model_kinds else -1 for k in kinds], device=outputs.device)
    own = outputs[:, : len(model_kinds)].gather(1, index.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(index >= 0, own, mixed)


def head_scores(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The reward (or value) at every position of ``hidden`` ``(..., H)``: ``(...)`` float32 (:func:`mix`)."""
    return mix(model.score(hidden).float(), len(head_kinds(model)))


def own_kind_scores(
    outputs: torch.Tensor, kind_index: torch.Tensor | None, kinds: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Training's reading of the head: each response's own kind's score and the gate's loss on that kind.

    Args:
        outputs: ``(N, 2K)`` float, or ``(N, 1)``.
        kind_index: ``(N,)`` int64, each response's kind (its position in the model's kinds); None when ``kinds``
            is 0.
        kinds: ``K`` (0: a one-output head).

    Returns:
        ``(scores (N,), gate_nll (N,) or None)``: ``s_{kind}`` and ``-log softmax(g)_{kind}`` (nats); the one
        output and None for a one-output head.
    """
    if kinds == 0:
        return outputs.squeeze(-1), None
    scores = outputs[:, :kinds].gather(1, kind_index[:, None]).squeeze(1)
    return scores, torch.nn.functional.cross_entropy(outputs[:, kinds:], kind_index, reduction="none")
