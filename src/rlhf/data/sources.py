"""Sources to splits: parse every source's raw rows, quarantine the bad ones, split the rest.

A preference example is ``{"id", "source", "kind", "prompt", "chosen", "rejected"}`` where
``prompt``, ``chosen`` and ``rejected`` are lists of ``{"role", "content"}``
messages (the conversational format of transformers' chat templates). The
prompt ends with a user turn; each response is what follows it (usually one
assistant message). How a row reaches its split: :mod:`rlhf.data.splitting`; the ptx rows:
:mod:`rlhf.data.ptx`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rlhf.data.formats import RowError, to_examples
from rlhf.data.ptx import is_ptx_heldout, parse_ptx_row, ptx_key
from rlhf.data.splitting import HELD_OUT_PAIRS, SPLITS, assign_split, check_fractions, conversation_root, prompt_key


@dataclass
class SourceCount:
    """What one source gave: rows read, rows used (kept in a split), the first quarantine reason."""

    path: str
    role: str  # "preference" (data.source, data.more_sources) or "ptx" (data.ptx_source)
    name: str  # the name its rows carry (:func:`source_names`)
    rows_in: int = 0
    used: int = 0
    first_reason: str | None = None


@dataclass
class PreparedData:
    """The result of :func:`prepare_rows`: rows by split, quarantined rows and what each source gave."""

    splits: dict[str, list[dict[str, Any]]]
    quarantine: list[dict[str, Any]]
    rows_in: int
    sources: list[SourceCount] = field(default_factory=list)

    def unusable_sources(self) -> list[str]:
        """One line per source that gave no usable row (empty, or every row quarantined): such a source is
        an error of the run, never a silent loss (a gzip file read as text, a wrong format or mapping)."""
        lines = []
        for count in self.sources:
            if count.rows_in == 0:
                lines.append(f"{count.role} source {count.path}: no rows")
            elif count.used == 0:
                lines.append(
                    f"{count.role} source {count.path}: none of {count.rows_in} rows is usable; "
                    f"first reason: {count.first_reason}"
                )
        return lines


def source_name(path: str) -> str:
    """A source's default short name: its file name without the suffixes, or its folder's name when the file is
    called ``pairs`` (HH's layout: ``hh-rlhf/helpful-base/pairs.jsonl.gz`` is ``helpful-base``)."""
    parts = [p for p in path.split("?")[0].replace("\\", "/").split("/") if p]
    stem = parts[-1].split(".")[0] if parts else path
    return parts[-2] if stem == "pairs" and len(parts) > 1 else stem


@dataclass
class Source:
    """One input of the prepare stage: where it is, its rows, their format and key mapping, and what its rows
    are called: ``name`` (short, unique among the sources; default :func:`source_name`) and ``kind`` (the kind
    of data, e.g. ``helpful`` or ``harmless``: the figures and gates are per kind). Every row it gives
    carries both, never the path (:func:`source_names`)."""

    path: str
    rows: Iterator[tuple[int, Any]]
    format: str = "auto"
    mapping: dict[str, str] | None = None
    name: str | None = None
    kind: str = "general"


def prepare_rows(
    sources: list[Source],
    fractions: dict[str, float],
    ptx_sources: list[Source] | None = None,
    ptx_heldout_fraction: float = 0.2,
) -> PreparedData:
    """Parse raw rows, quarantine the unparseable ones and split the rest by conversation root.

    Output rows: ``sft``, ``rm_train``, ``rm_eval``, ``judge_train``, ``judge_eval`` hold whole pairs
    ``{"id", "source", "kind", "prompt", "chosen", "rejected"}`` (``source`` and ``kind``: the
    :class:`Source`'s name and kind); ``ppo_prompts`` and
    ``eval_prompts`` hold ``{"id", "source", "kind", "prompt"}`` (one row per distinct
    prompt). ``rm_eval`` and ``judge_eval`` hold their own shares' pairs and also every pair whose conversation
    is in ``eval_prompts`` (:data:`HELD_OUT_PAIRS`): the reward model and the judge are measured on them,
    evaluation reads only their prompts, and no split that trains (``sft``, ``rm_train``, ``judge_train``,
    ``ppo_prompts``, ``ptx_text``) shares a conversation root with any of them. The ptx share
    (``fractions["ptx_text"]``) of the preference data gives ``{"id", "source", "kind", "messages"}`` rows (prompt +
    chosen response); every row of ``ptx_sources`` (``{"messages"}`` or ``{"text"}``, see
    :func:`parse_ptx_row`) is added to them, unless its conversation root is in
    another split of the preference data (then it is quarantined: it would leak).
    Of all ptx rows, a hashed ``ptx_heldout_fraction`` (by :func:`ptx_key`) goes
    to ``ptx_heldout``, the rest to ``ptx_text``. Ids: pair and ptx rows
    ``<sha256[:16]>-<line>`` (``-<k>`` for the k-th pair of a ranking row,
    ``-s<i>`` for the i-th source after the first; an eval_prompts pair in rm_eval and judge_eval too), so they are
    unique; prompt rows ``<sha256[:16]>``.
    Quarantine rows are ``{"source", "file", "line", "reason", "row"}`` (the source's name and path).
    ``sources`` counts, per source, the rows read and used (see :meth:`PreparedData.unusable_sources`).

    Args:
        sources: the preference inputs, concatenated in order.
        fractions: split fractions (see :func:`assign_split`).
        ptx_sources: optional PPO-ptx corpora (``data.ptx_source``).
        ptx_heldout_fraction: share of the ptx rows held out, in (0, 1).

    Raises:
        ValueError: fractions that do not sum to 1, ``ptx_heldout_fraction`` outside (0, 1), two sources with
            one name, or an empty name or kind.
    """
    check_fractions(fractions)
    if not 0 < ptx_heldout_fraction < 1:
        raise ValueError(f"data.ptx_heldout_fraction must be in (0, 1), got {ptx_heldout_fraction}")
    names = iter(source_names([*sources, *(ptx_sources or [])]))
    splits: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLITS}
    quarantine: list[dict[str, Any]] = []
    seen_prompts: set[tuple[str, str]] = set()
    root_split: dict[str, str] = {}
    rows_in = 0

    def ptx(record: dict[str, Any]) -> None:
        splits["ptx_heldout" if is_ptx_heldout(record, ptx_heldout_fraction) else "ptx_text"].append(record)

    counts: list[SourceCount] = []

    def reject(source: Source, line: int, row: Any, reason: str) -> None:
        quarantine.append(
            {
                "source": counts[-1].name,
                "file": source.path,
                "line": line,
                "reason": reason,
                "row": None if isinstance(row, RowError) else row,
            }
        )
        counts[-1].first_reason = counts[-1].first_reason or reason

    for index, source in enumerate(sources):
        counts.append(SourceCount(source.path, "preference", next(names)))
        for line, row in source.rows:
            rows_in += 1
            counts[-1].rows_in += 1
            try:
                examples = to_examples(row, source.format, source.mapping)
            except RowError as err:
                reject(source, line, row, str(err))
                continue
            counts[-1].used += 1
            for number, example in enumerate(examples):
                key = prompt_key(example["prompt"])
                split = assign_split(example["prompt"], fractions)
                root_split[conversation_root(example["prompt"])] = split
                suffix = (f"-{number}" if len(examples) > 1 else "") + (f"-s{index}" if index else "")
                record = {"id": f"{key[:16]}-{line}{suffix}", "source": counts[-1].name, "kind": source.kind}
                if split in ("ppo_prompts", "eval_prompts"):
                    if (split, key) not in seen_prompts:
                        seen_prompts.add((split, key))
                        splits[split].append({**record, "id": key[:16], "prompt": example["prompt"]})
                    for held_out in HELD_OUT_PAIRS.get(split, ()):  # only its prompt is evaluated on: its pair
                        splits[held_out].append({**record, **example})  # measures the reward model and the judge
                elif split == "ptx_text":
                    # where the chosen answer starts: validate applies the pairs' rule to it (one assistant turn)
                    messages = example["prompt"] + example["chosen"]
                    ptx({**record, "messages": messages, "response_start": len(example["prompt"])})
                else:
                    splits[split].append({**record, **example})
    for index, source in enumerate(ptx_sources or []):
        counts.append(SourceCount(source.path, "ptx", next(names)))
        for line, row in source.rows:
            rows_in += 1
            counts[-1].rows_in += 1
            try:
                if isinstance(row, RowError):
                    raise row
                parsed = parse_ptx_row(row)
                other = root_split.get(ptx_key(parsed), "ptx_text") if "messages" in parsed else "ptx_text"
                if other != "ptx_text":
                    raise RowError(f"ptx conversation's first user turn is also in split '{other}' (it would leak)")
            except RowError as err:
                reject(source, line, row, str(err))
                continue
            key = prompt_key(parsed)
            row_id = f"{key[:16]}-{line}" + (f"-p{index}" if index else "")
            ptx({"id": row_id, "source": counts[-1].name, "kind": source.kind, **parsed})
            counts[-1].used += 1
    return PreparedData(splits=splits, quarantine=quarantine, rows_in=rows_in, sources=counts)


def source_names(sources: list[Source]) -> list[str]:
    """Each source's name: its own, or :func:`source_name` of its path; default names that two sources share
    get ``-<position>`` (the same file read twice), given ones must differ.

    Raises:
        ValueError: two sources given one name, or a name or kind that is empty or holds a ``/`` (both are parts
            of metric names).
    """
    defaults = [source_name(source.path) for source in sources]
    names = []
    for position, (source, default) in enumerate(zip(sources, defaults, strict=True)):
        name = source.name or (default if defaults.count(default) == 1 else f"{default}-{position}")
        for what, value in (("name", name), ("kind", source.kind)):
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(
                    f"source {source.path}: its {what} must be a non-empty string without '/', got {value!r}"
                )
        if name in names:
            other = sources[names.index(name)].path
            raise ValueError(f"sources {other} and {source.path} are both named {name!r}; give each its own name")
        names.append(name)
    return names
