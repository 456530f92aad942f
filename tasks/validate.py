"""Stage validate: the Great Expectations suite over the processed splits; writes the splits the trainers read.

Reads ``data/processed/`` and the base tokenizer (``models/base``); writes
``data/validated/{split}.jsonl`` for every split of ``rlhf.data.splitting.SPLITS`` (the PPO-ptx
``ptx_text`` and its held-out ``ptx_heldout`` included, both checked message by message),
``data/validated/quarantine.jsonl`` (rows with
the rules they broke), ``reports/validation.json`` (summary) and
``reports/validation_gx.json`` (the suite's full results, also an MLflow
artifact). Exits non-zero with one line per broken rule when a split that a stage reads is empty
or its quarantined share is above ``validate.max_quarantine_fraction``; the
previous validated data is then left as it was. The one split no stage may read is ``sft`` when ``sft.steps`` is
0 (the sft stage then copies the base model), so ``data.fractions.sft`` may be 0 there.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rlhf.data.reading import load_jsonl, write_jsonl
from rlhf.data.splitting import SPLITS
from rlhf.data.validation import EMPTY_HINT, ValidationConfig, split_kind, validate_split
from rlhf.files import write_json
from rlhf.models.loading import load_tokenizer
from tasks.kit import paths
from tasks.kit.common import cli
from tasks.kit.configs import config_from_params, derived_values
from tasks.kit.outputs import StagedOutputs, write_metrics
from tasks.kit.params import stage_params
from tasks.kit.runs import StageRun

IN_DIR, OUT_DIR, BASE = paths.PROCESSED, paths.VALIDATED, paths.BASE
REPORT, GX_REPORT = paths.VALIDATION_REPORT, paths.GX_REPORT


class ValidationFailed(Exception):
    """The suite's thresholds broke; the message has one line per broken rule."""


def unread_splits(stage_params) -> set[str]:
    """The splits no stage reads with these params, which may be empty: ``sft`` when ``sft.steps`` is 0 (the sft
    stage copies the base model and reads no row). ``stage_params(section)`` reads a section (profile applied)."""
    return {"sft"} if int(stage_params("sft")["steps"]) == 0 else set()


def run(params: dict[str, Any], outputs: StagedOutputs) -> tuple[dict[str, Any], list[str]]:
    """Validate every split and stage the outputs in ``outputs`` (written together when they commit).

    Returns:
        The summary written to ``reports/validation.json``, and the staged paths of the two reports.

    Raises:
        ValidationFailed: a split a stage reads is empty, or a split is above the quarantine threshold (nothing is
            written).
    """
    config = config_from_params(ValidationConfig, params, "validate", derived_values("validate", stage_params))
    tokenizer = load_tokenizer(BASE)
    unread, steps = unread_splits(stage_params), int(stage_params("sft")["steps"])
    hints = {"sft": f"sft.steps is {steps} and trains on it: give data.fractions.sft a share, or set sft.steps to 0"}
    results = {
        split: validate_split(
            os.path.join(IN_DIR, f"{split}.jsonl"),
            load_jsonl(os.path.join(IN_DIR, f"{split}.jsonl")),
            split_kind(split),
            tokenizer,
            config,
            may_be_empty=split in unread,
            empty_hint=hints.get(split, EMPTY_HINT),
        )
        for split in SPLITS
    }
    errors = [line for result in results.values() for line in result.errors]
    if errors:
        raise ValidationFailed("\n".join(errors))
    folder = outputs.folder(OUT_DIR)
    for split, result in results.items():
        with open(os.path.join(folder, f"{split}.jsonl"), "w", encoding="utf-8") as handle:
            write_jsonl(result.valid, handle)
    with open(os.path.join(folder, "quarantine.jsonl"), "w", encoding="utf-8") as handle:
        write_jsonl(
            [{"split": split, **row} for split, result in results.items() for row in result.quarantined], handle
        )
    summary = {
        split: {
            "rows_in": len(r.valid) + len(r.quarantined),
            "valid": len(r.valid),
            "quarantined": len(r.quarantined),
            "rules": r.rule_counts,
            "role_marker_rows": r.role_marker_rows,
        }
        for split, r in results.items()
    }
    reports = [outputs.file(REPORT), outputs.file(GX_REPORT)]
    write_json(
        reports[0],
        {
            "success": True,
            "max_quarantine_fraction": config.max_quarantine_fraction,
            "role_markers": config.role_markers,
            "control_tokens": config.control_tokens,
            "splits": summary,
        },
    )
    write_json(reports[1], {split: r.gx_result for split, r in results.items()})
    return summary, reports


def main() -> None:
    """DVC stage command."""
    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    params = stage_params("validate")
    with StageRun("validate", params) as stage, StagedOutputs() as outputs:
        try:
            summary, reports = run(params, outputs)
        except ValidationFailed as failure:
            print(f"[validate] FAILED:\n{failure}", file=sys.stderr)
            raise SystemExit(1) from None
        for report in reports:
            mlflow.log_artifact(report)
        totals = {key: sum(s[key] for s in summary.values()) for key in ("rows_in", "valid", "quarantined")}
        stage.log({f"validate/{k}": float(v) for k, v in totals.items()}, 0)
        write_metrics(outputs.file(paths.metrics("validate")), {f"validate/{k}": v for k, v in totals.items()}, stage)
    for split, s in summary.items():
        broken = {rule: n for rule, n in s["rules"].items() if n}
        print(
            f"[validate] {split}: {s['valid']}/{s['rows_in']} valid; quarantined by rule: {json.dumps(broken)}; "
            f"role markers in {s['role_marker_rows']} rows"
        )


if __name__ == "__main__":
    cli(main)
