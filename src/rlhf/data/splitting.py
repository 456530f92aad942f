"""Splits: every prompt's split from a hash of its conversation's root.

Splits are made by a hash of the conversation's root (its first user turn), so one conversation, cut at any
turn, never reaches two splits, with one exception made on purpose: the pairs of the ``eval_prompts``
conversations are also ``rm_eval``'s and ``judge_eval``'s (:data:`HELD_OUT_PAIRS`; none of these splits trains
anything).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlhf.data.formats import Message, RowError, visible_text

SPLITS = (
    "sft",
    "rm_train",
    "rm_eval",
    "ppo_prompts",
    "ptx_text",
    "ptx_heldout",
    "eval_prompts",
    "judge_train",
    "judge_eval",
)
"""Files of data/processed and data/validated. ``data.fractions`` names every split but ``ptx_heldout``,
which is a share (``data.ptx_heldout_fraction``) of the ptx rows."""


HELD_OUT_PAIRS = {"eval_prompts": ("rm_eval", "judge_eval")}
"""Prompt splits whose whole pairs also go to splits that only measure. Evaluation reads only the prompts of
``eval_prompts`` (the policy and SFT answer them; the proxy and the judge score those answers), never their
chosen or rejected responses, and neither the reward model nor the judge trains on its eval split: measuring
both on these pairs too gives the gate and the judge more held-out pairs (the demo: rm_eval 382 prepared instead
of 214, judge_eval 297 instead of 129), and no split that trains sees them. ``ppo_prompts`` is not one: PPO
trains on its prompts."""


def prompt_key(prompt: Any) -> str:
    """Stable hex sha256 of a prompt's messages (or of any JSON value, e.g. a ptx row); the id of the prompt."""
    return hashlib.sha256(
        json.dumps(prompt, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
    ).hexdigest()


def conversation_root(messages: list[Message]) -> str:
    """The root of a conversation: its first user turn's visible content (:func:`rlhf.data.formats.visible_text`).

    Every cut of one conversation (HH holds the same dialogue cut at different
    turns) has the same root, so splitting by it keeps the cuts together.

    Raises:
        RowError: the messages hold no user turn.
    """
    for message in messages:
        if message["role"] == "user":
            return visible_text(message["content"])
    raise RowError("conversation has no user turn")


def unit_point(key: str, salt: str = "") -> float:
    """A uniform point in [0, 1) from sha256 of ``salt + key`` (first 60 bits)."""
    return int(hashlib.sha256((salt + key).encode("utf-8", "surrogatepass")).hexdigest()[:15], 16) / 16**15


def check_fractions(fractions: dict[str, float]) -> None:
    """Refuse ``data.fractions`` (split name -> share of the conversations) that are negative or do not sum to 1.

    Raises:
        ValueError: the first negative fraction, or a sum off 1 by more than 1e-6 (names ``data.fractions``).
    """
    negative = [name for name, fraction in fractions.items() if fraction < 0]
    if negative:
        raise ValueError(f"data.fractions.{negative[0]} must be >= 0, got {fractions[negative[0]]}")
    total = sum(fractions.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"data.fractions must sum to 1, got {total:.6g} (lower another split when you raise one)")


def dev_split(rows: list[dict[str, Any]], fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, dev)``: the development split, ``fraction`` of a training split's ``rows`` by a salted hash of the
    conversation root (whole conversations; independent of :func:`assign_split`'s hash). Every choice of
    settings, step counts, data amounts and the judge's recipe is made on it (``bench.reward_quality``), never on
    the test splits (``rm_eval``, ``judge_eval``) that the gates read and the reported figures come from.

    Raises:
        ValueError: ``fraction`` outside (0, 1).
    """
    if not 0 < fraction < 1:
        raise ValueError(f"the development fraction must be in (0, 1), got {fraction}")
    dev = [unit_point(conversation_root(row["prompt"]), salt="reward-dev") < fraction for row in rows]
    return [r for r, d in zip(rows, dev, strict=True) if not d], [r for r, d in zip(rows, dev, strict=True) if d]


def assign_split(prompt: list[Message], fractions: dict[str, float]) -> str:
    """Pick the split of a prompt from a hash of its conversation root (see :func:`conversation_root`).

    Args:
        prompt: the prompt's messages (at least one user turn).
        fractions: split name -> fraction, in order; fractions must sum to 1.

    Returns:
        The split name: the first whose cumulative fraction exceeds the root's hash point.

    Raises:
        ValueError: the fractions are negative or do not sum to 1 (1e-6).
        RowError: the prompt has no user turn.
    """
    check_fractions(fractions)
    point = unit_point(conversation_root(prompt))
    edge = 0.0
    for name, fraction in fractions.items():
        edge += fraction
        if point < edge:
            return name
    return name
