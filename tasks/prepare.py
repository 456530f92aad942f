"""Stage prepare: read ``data.source`` (and ``data.ptx_source``), parse it, split by conversation root.

Writes ``data/processed/{split}.jsonl`` for every split (``rlhf.data.splitting.SPLITS``, ``ptx_heldout``
included), ``data/processed/quarantine.jsonl`` (rows that do not parse, with the reason) and
``metrics/prepare.json`` (counts).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from rlhf.data.ptx import PTX_KIND
from rlhf.data.reading import read_jsonl, write_jsonl
from rlhf.data.sources import Source, prepare_rows
from rlhf.data.splitting import SPLITS
from tasks.kit import paths
from tasks.kit.common import cli
from tasks.kit.configs import config_from_params
from tasks.kit.outputs import StagedOutputs, write_metrics
from tasks.kit.params import stage_params
from tasks.kit.runs import StageRun

OUT_DIR = paths.PROCESSED


@dataclass
class SourceConfig:
    """One input: ``data.source`` itself or an entry of ``data.more_sources``. ``name`` (default: the file's,
    ``rlhf.data.sources.source_name``) and ``kind`` (e.g. ``helpful``, ``harmless``) travel with each of its rows."""

    source: str
    format: str = "auto"
    mapping: dict[str, str] | None = None
    max_rows: int | None = None
    storage_options: dict[str, Any] | None = None
    name: str | None = None
    kind: str = "general"


@dataclass
class DataConfig(SourceConfig):
    """The ``data`` section of params.yaml."""

    fractions: dict[str, float] = field(kw_only=True)  # split -> share of the conversations (params.yaml)
    kind: str = field(kw_only=True)  # params.yaml gives them: no defaults of their own
    max_rows: int | None = field(kw_only=True)
    more_sources: list[dict[str, Any]] = field(kw_only=True)
    ptx_source: str | None = None
    ptx_heldout_fraction: float = 0.2


def run(params: dict[str, Any], outputs: StagedOutputs) -> dict[str, Any]:
    """Run the stage with the ``data`` params; returns the counts it logged.

    The splits are staged in ``outputs`` (written when they commit).

    Reads ``data.source`` and every entry of ``data.more_sources`` (each
    ``{source, name, kind, format, mapping, max_rows, storage_options}``), concatenated, and
    ``data.ptx_source`` when set (rows ``{"messages"}`` or ``{"text"}``, read with
    ``data.storage_options``; ``max_rows`` does not apply to it).

    Every source is read whatever its name says about compression (``rlhf.data.reading.read_jsonl``
    sniffs gzip, bz2, xz and zstd from the first bytes).

    Raises:
        ValueError: a source (``data.source``, an entry of ``data.more_sources`` or
            ``data.ptx_source``) that gives no usable row (no rows, or every row
            quarantined; one line per such source, with the first reason), a bad fraction, or two sources with
            one name.
    """
    config = config_from_params(DataConfig, params, "data")
    more = [config_from_params(SourceConfig, spec, "data.more_sources") for spec in config.more_sources]
    inputs: list[SourceConfig] = [config, *more]
    sources = []
    for spec in inputs:
        rows = read_jsonl(paths.data_url(spec.source)[0], spec.storage_options)
        rows = islice(rows, spec.max_rows) if spec.max_rows else rows
        sources.append(Source(spec.source, rows, spec.format, spec.mapping, spec.name, spec.kind))
    ptx_rows = read_jsonl(paths.data_url(config.ptx_source)[0], config.storage_options) if config.ptx_source else None
    ptx = [Source(config.ptx_source, ptx_rows, kind=PTX_KIND)] if config.ptx_source else []
    prepared = prepare_rows(sources, config.fractions, ptx, config.ptx_heldout_fraction)
    unusable = prepared.unusable_sources()
    if unusable:
        raise ValueError("\n".join(unusable))
    folder = outputs.folder(OUT_DIR)
    for split in SPLITS:
        with open(os.path.join(folder, f"{split}.jsonl"), "w", encoding="utf-8") as handle:
            write_jsonl(prepared.splits[split], handle)
    with open(os.path.join(folder, "quarantine.jsonl"), "w", encoding="utf-8") as handle:
        write_jsonl(prepared.quarantine, handle)
    reasons = Counter(q["reason"] for q in prepared.quarantine)
    by_kind = Counter((s, row["kind"]) for s in SPLITS for row in prepared.splits[s])
    counts: dict[str, Any] = {
        "rows_in": prepared.rows_in,
        "quarantined": len(prepared.quarantine),
        **{f"split/{s}": len(prepared.splits[s]) for s in SPLITS},
        **{f"kind/{kind}/{s}": n for (s, kind), n in sorted(by_kind.items())},
    }
    for reason, n in reasons.most_common():
        print(f"[prepare] quarantined {n} rows: {reason}")
    print(
        f"[prepare] {prepared.rows_in} rows in, {len(prepared.quarantine)} quarantined "
        f"(source, line and reason in {OUT_DIR}/quarantine.jsonl); "
        + ", ".join(f"{s}={len(prepared.splits[s])}" for s in SPLITS)
    )
    for kind in sorted({kind for _, kind in by_kind}):
        print(f"[prepare] kind {kind}: " + ", ".join(f"{s}={by_kind[s, kind]}" for s in SPLITS if by_kind[s, kind]))
    return counts


def main() -> None:
    """DVC stage command."""
    params = stage_params("data")
    with StageRun("prepare", params) as stage, StagedOutputs() as outputs:
        counts = run(params, outputs)
        stage.log({f"prepare/{k}": float(v) for k, v in counts.items()}, 0)
        write_metrics(outputs.file(paths.metrics("prepare")), counts, stage)


if __name__ == "__main__":
    cli(main)
