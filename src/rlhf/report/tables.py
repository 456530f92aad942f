"""The report's tables: how a number, a count, an interval and a table are written on the page, and the rows
each stage's table shows (metric key and label). A missing or non-finite value shows as n/a.
"""

from __future__ import annotations

import math
from typing import Any

NA = "n/a"


def number(value: Any) -> float | None:
    """``value`` as a finite float; None for None, NaN, infinities, booleans and anything not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def fmt(value: Any, digits: int = 3) -> str:
    """A value for the page: a number with ``digits`` decimals, text as it is, n/a for None or non-finite."""
    if isinstance(value, str):
        return value
    found = number(value)
    return NA if found is None else f"{found:.{digits}f}"


def fmt_count(value: Any) -> str:
    """A count (rows, pairs, prompts) without decimals; n/a when absent."""
    found = number(value)
    return NA if found is None else f"{found:.0f}"


def fmt_interval(values: dict[str, Any], key: str) -> str:
    """``values[key]`` with its 95% interval from ``<key>_low``/``<key>_high``: ``0.589 [0.521, 0.653]``."""
    rate, low, high = (values.get(k) for k in (key, f"{key}_low", f"{key}_high"))
    if number(rate) is None:
        return NA
    return f"{fmt(rate)} [{fmt(low)}, {fmt(high)}]"


def table(caption: str, headers: list[str], rows: list[list[str]], classes: list[str] | None = None) -> dict:
    """A table of the page: ``caption``, ``headers``, and each row's cells with its CSS class (``fail``: a failed
    check, red; ``muted``: struck through, a verdict that means nothing; ``""``: plain)."""
    cells = [{"cells": r, "cls": c} for r, c in zip(rows, classes or [""] * len(rows), strict=True)]
    return {"caption": caption, "headers": headers, "rows": cells}


# the tables of one value per measure: (label, key ("{p}": the file's prefix), "count" | "interval" | "")
SFT_ROWS = (
    ("examples", "sft/examples", "count"),
    ("epochs over them (steps x batch / examples)", "sft/epochs", ""),
    ("steps", "sft/steps", "count"),
    ("loss, first step", "sft/loss_first", ""),
    ("loss, last step", "sft/loss_last", ""),
)


ACCURACY_ROWS = (
    ("accuracy on held-out pairs [95% Wilson]", "{p}/accuracy", "interval"),
    ("decisive pairs", "{p}/pairs", "count"),
    (
        "balanced accuracy: mean of chosen-shorter and chosen-longer [95% stratified]",
        "{p}/balanced_accuracy",
        "interval",
    ),
    ("length-only baseline: accuracy of 'prefer the shorter'", "{p}/length_baseline_accuracy", ""),
    ("ties", "{p}/ties", "count"),
    ("calibration error (ECE)", "{p}/ece", ""),
    ("accuracy, chosen response shorter", "{p}/accuracy_chosen_shorter", ""),
    ("pairs, chosen response shorter", "{p}/pairs_chosen_shorter", "count"),
    ("accuracy, chosen response longer", "{p}/accuracy_chosen_longer", ""),
    ("pairs, chosen response longer", "{p}/pairs_chosen_longer", "count"),
    ("correlation of score with length", "{p}/length_corr", ""),
    ("mean margin (chosen - rejected)", "{p}/margin", ""),
    ("share of pairs where an empty response beats the chosen one", "{p}/empty_beats_chosen", ""),
    ("share where a one-word reply beats the chosen one (mean over the replies)", "{p}/short_reply_beats_chosen", ""),
    ("share where the worst one-word reply beats the chosen one", "{p}/short_reply_beats_chosen_max", ""),
)


PPO_ROWS = (
    ("iterations", "ppo/iterations", "count"),
    ("iterations that updated the policy", "ppo/policy_iterations", "count"),
    ("shipped iteration", "ppo/shipped_iteration", "count"),
    ("rollbacks", "ppo/rollbacks", "count"),
    (
        "rollouts' mean reward: change per policy iteration [95%] (rising: the interval above 0)",
        "ppo/reward/slope",
        "interval",
    ),
    ("validation reward (shipped)", "ppo/validation/reward", ""),
    ("validation KL (shipped)", "ppo/validation/kl", ""),
    ("validation EOS rate (shipped)", "ppo/validation/eos_rate", ""),
    ("KL, last iteration", "ppo/last/kl", ""),
)


RESPONSE_ROWS = (
    ("length (tokens)", "length"),
    ("EOS rate", "eos_rate"),
    ("cut at max_new_tokens", "truncated_share"),
    ("distinct-1", "distinct_1"),
    ("distinct-2", "distinct_2"),
    ("refusal rate (a heuristic: refusal phrases at the start, quotes aside)", "refusal_rate"),
    ("ptx perplexity", "ptx_perplexity"),
)


def values_table(caption: str, m: dict[str, Any], spec: tuple, prefix: str = "") -> dict:
    """A two-column table (measure, value) of ``spec``'s rows (label, metric key with ``{p}`` for ``prefix``, and
    ``count``, ``interval`` or plain), each value read from the metrics ``m``; a missing one shows as n/a."""
    rows = []
    for label, key, kind in spec:
        key = key.format(p=prefix)
        rows.append(
            [label, {"count": fmt_count(m.get(key)), "interval": fmt_interval(m, key)}.get(kind, fmt(m.get(key)))]
        )
    return table(caption, ["measure", "value"], rows)
