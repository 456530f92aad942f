"""Figures per kind of data and per source: the same figure on each part of a held-out split.

Every row carries the name of its ``source`` and its ``kind`` (:class:`rlhf.data.sources.Source`; in the HH mixture
``harmless`` for red-teaming prompts, ``helpful`` for the three helpful sets). A reward model can rank the whole
split better than chance while ranking one kind below it (trained on harmless data alone, it preferred the less
helpful answer on helpful pairs), so every held-out figure is also taken on each kind, and on each source of
a kind made of several sources when it has at least :data:`MIN_SOURCE_PAIRS` held-out pairs. A part's figures
are named ``<prefix>/kind/<kind>/<figure>`` and ``<prefix>/source/<name>/<figure>``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

DEFAULT_KIND = "general"
"""The kind of a row that names none (data prepared before kinds, or a file given to ``rlhf-model score-pairs``)."""

MIN_SOURCE_PAIRS = 100
"""A source's own figures are reported from this many held-out pairs (fewer: an interval of about +-0.1 or wider)."""


def kind_of(row: dict[str, Any]) -> str:
    """The row's ``kind``, or :data:`DEFAULT_KIND` when it has none."""
    return str(row.get("kind") or DEFAULT_KIND)


def parts(rows: Sequence[dict[str, Any]], min_source_rows: int = MIN_SOURCE_PAIRS) -> dict[str, list[int]]:
    """The parts a split's figures are taken on: ``kind/<kind>`` for every kind, and ``source/<name>`` for each
    source of a kind with several sources that holds at least ``min_source_rows`` rows (a kind's only source
    would repeat the kind's figures).

    Args:
        rows: the split's rows, each with ``kind`` and ``source`` (either may be absent: :func:`kind_of`; a row
            without a source counts for its kind only).
        min_source_rows: the fewest rows a source's own part needs.

    Returns:
        part name -> the indices of its rows in ``rows``, in order; kinds first (sorted), then sources (sorted).
    """
    kinds: dict[str, list[int]] = defaultdict(list)
    sources: dict[str, list[int]] = defaultdict(list)
    sources_of: dict[str, set[str]] = defaultdict(set)
    for index, row in enumerate(rows):
        kind = kind_of(row)
        kinds[kind].append(index)
        if row.get("source"):
            sources[str(row["source"])].append(index)
            sources_of[kind].add(str(row["source"]))
    shown = {name for names in sources_of.values() if len(names) > 1 for name in names}
    result = {f"kind/{kind}": kinds[kind] for kind in sorted(kinds)}
    result.update({f"source/{name}": sources[name] for name in sorted(shown) if len(sources[name]) >= min_source_rows})
    return result


def first_of_each_kind(rows: Sequence[dict[str, Any]], count: int) -> list[int]:
    """The indices of the first ``count`` rows of each kind, in the rows' order: a cheap measure (the empty and
    one-word replies) that still covers every kind.

    Raises:
        ValueError: ``count < 1``.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    taken: dict[str, int] = defaultdict(int)
    chosen = []
    for index, row in enumerate(rows):
        kind = kind_of(row)
        if taken[kind] < count:
            taken[kind] += 1
            chosen.append(index)
    return chosen


def named(figures: dict[str, float], prefix: str, part: str, keep: Sequence[str]) -> dict[str, float]:
    """``figures`` (``<prefix>/<figure>``) renamed ``<prefix>/<part>/<figure>``, only the figures in ``keep``."""
    return {f"{prefix}/{part}/{name}": figures[f"{prefix}/{name}"] for name in keep if f"{prefix}/{name}" in figures}


def kinds_in(metrics: dict[str, Any], prefix: str) -> list[str]:
    """The kinds whose figures ``metrics`` holds under ``<prefix>/kind/<kind>/...``, sorted."""
    head = f"{prefix}/kind/"
    return sorted({key[len(head) :].split("/", 1)[0] for key in metrics if key.startswith(head)})


def training_kinds(examples: Sequence[dict[str, Any]], wanted: bool) -> list[str]:
    """The kinds a new reward-model head gets (:mod:`rlhf.models.kind_heads`): the training pairs' kinds
    (:func:`kind_of`),
    sorted, when ``wanted`` and there are at least two; else ``[]`` (one output)."""
    kinds = sorted({kind_of(example) for example in examples})
    return kinds if wanted and len(kinds) > 1 else []
