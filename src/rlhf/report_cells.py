"""The report's cells: how a number, a count, an interval and a table are written on the page (:mod:`rlhf.report`).

A missing or non-finite value shows as n/a. Pure; imports nothing but the standard library.
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
