"""The pipeline's figures for a person: the line each stage ends with, the summary table the flow prints once and
publishes as a Prefect artifact, its loud warnings, and the verdict its final state is named after."""

from __future__ import annotations

import json
import os
import sys

from rich.console import Console
from rich.table import Table

from rlhf.data.kinds import kinds_in
from rlhf.evaluation.gate_rules import decision_parts
from rlhf.stats import chance_warning
from tasks.kit.outputs import timing_path
from tasks.kit.paths import POLICY_GATE, REWARD_GATE

SUMMARY = {
    "prepare": [],
    "base_model": [],
    "validate": ["validate/valid", "validate/quarantined"],
    "sft": ["sft/steps", "sft/loss_first", "sft/loss_last"],
    "reward": [
        "rm/accuracy",
        "rm/balanced_accuracy",
        "rm/pairs",
        "rm/ties",
        "rm/accuracy_chosen_shorter",
        "rm/accuracy_chosen_longer",
        "rm/length_baseline_accuracy",
        "rm/empty_beats_chosen",
        "rm/margin",
        "rm/ece",
    ],
    "gate": ["gate/passed", "gate/candidate_version", "gate/champion_version"],
    "ppo": [
        "ppo/reward_model_version",
        "ppo/policy_iterations",
        "ppo/value/pretrain_explained_variance",
        "ppo/shipped_iteration",
        "ppo/validation/reward",
        "ppo/validation/eos_rate",
        "ppo/validation/kl",
        "ppo/last/eos_rate",
        "ppo/last/value/explained_variance",
    ],
    "judge": ["judge/accuracy", "judge/balanced_accuracy", "judge/pairs"],
    "evaluate": [
        "eval/judge/win_rate",
        "eval/judge/lc_win_rate",
        "eval/judge/score_diff",
        "eval/proxy/win_rate",
        "eval/proxy/lc_win_rate",
        "eval/proxy/score_diff",
        "eval/policy/kl",
        "eval/policy/eos_rate",
        "eval/policy/length",
        "eval/policy/refusal_rate",
        "eval/policy/ptx_perplexity",
    ],
}


def figure(values: dict, key: str) -> str | None:
    """``key=value``, with ``[low, high]`` when the file holds ``<key>_low`` and ``<key>_high``; None if absent.

    A rate that is undefined (NaN, written as null) shows as ``n/a``; a whole number (a count, a version, a 0/1
    decision) without an interval as an integer.
    """
    if key not in values:
        return None
    value, low, high = values[key], values.get(f"{key}_low"), values.get(f"{key}_high")
    if not isinstance(value, (int, float)):
        return f"{key}=n/a" if value is None else None
    if isinstance(low, (int, float)) and isinstance(high, (int, float)):
        return f"{key}={value:.3f} [{low:.3f}, {high:.3f}]"
    return f"{key}={value:.0f}" if float(value).is_integer() else f"{key}={value:.3f}"


KIND_SUMMARY = {  # per kind of data (rlhf.data.kinds): prefix -> the figures the summary shows for each kind
    "rm": ("balanced_accuracy", "empty_beats_chosen"),
    "judge": ("balanced_accuracy",),
    "eval": ("judge_win_rate", "judge_lc_win_rate", "refusal_increase"),
}


def kind_keys(values: dict) -> list[str]:
    """The per-kind figures of :data:`KIND_SUMMARY` a stage's metrics hold (``<prefix>/kind/<kind>/<figure>``)."""
    return [
        f"{prefix}/kind/{kind}/{figure}"
        for prefix, figures in KIND_SUMMARY.items()
        for kind in kinds_in(values, prefix)
        for figure in figures
    ]


def summary_warnings(metrics: dict[str, dict]) -> list[str]:
    """Loud lines for the summary: the reward model's accuracy interval includes chance (or is below it, or
    undefined), and each ``GATE FAILED: criterion, value, bound`` line of the reward and the policy gate.

    Reads ``rm/accuracy``, ``rm/accuracy_low`` and ``rm/accuracy_high`` of the
    reward stage's metrics file (NaN is stored as null); the rule and wording
    are :func:`rlhf.stats.chance_warning`'s, as printed by the reward stage. The
    gates' lines come from ``reports/reward_gate.json`` and ``reports/policy_gate.json``.
    """
    lines = []
    for stage, prefix, split, what in (
        ("reward", "rm", "rm_eval", "the reward model has not learned to rank"),
        ("judge", "judge", "judge_eval", "the judge's win rates mean nothing"),
    ):
        values = metrics.get(stage, {})
        if f"{prefix}/balanced_accuracy_low" not in values:
            continue
        for part in ["", *(f"/kind/{kind}" for kind in kinds_in(values, prefix))]:
            warning = chance_warning(
                f"{split}{part.replace('/kind/', ' ')} balanced accuracy",
                *(values.get(f"{prefix}{part}/balanced_accuracy{s}") for s in ("", "_low", "_high")),
            )
            lines += [f"WARNING: {warning}: {what}"] if warning else []
    gate = metrics.get("gate", {})
    lines += [f"reward model {line}" for line in gate.get("lines", []) if line.startswith("GATE FAILED")]
    policy = metrics.get("evaluate", {})  # reports/policy_gate.json is one of evaluate's metrics files
    lines += [f"policy {line}" for line in policy.get("lines", []) if line.startswith("GATE FAILED")]
    held = gate.get("champion") if gate else None
    if gate and not held:
        lines.append("WARNING: no reward model holds the champion alias: ppo cannot run (rlhf-registry status)")
    elif gate and held.get("champion") is False:
        lines.append(
            f"WARNING: no reward model holds the champion alias: ppo trained against candidate version "
            f"{held['version']}, which {held.get('why', 'is not the champion')} (registry.without_champion)"
        )
    return lines


def stage_seconds(stage: str) -> float | None:
    """The wall time of the stage's last run, from ``timings/<stage>.json``; None when it has none.

    ``tasks.kit.outputs.write_metrics`` writes it there, apart from the metrics file: a time differs between two
    runs of the same inputs, so it is neither committed nor compared by ``dvc exp show``/``dvc metrics diff``.
    """
    path = timing_path(stage)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle).get("seconds")


def print_summary(
    metrics: dict[str, dict],
    timings: dict[str, float | None] | None = None,
    console: Console | None = None,
    warnings: bool = True,
) -> None:
    """Print the time of each stage and the headline figures (rates with their interval), then any warning.

    Args:
        metrics: stage -> its metrics file's content (as :func:`run_pipeline` returns them).
        timings: stage -> seconds of its last run; by default :func:`stage_seconds` of each stage.
        console: where to print (the terminal by default).
        warnings: print :func:`summary_warnings` after the table (the flow does not: each stage has shown its own).
    """
    table = Table(title="RLHF pipeline")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("figures")
    for stage, values in metrics.items():
        seconds = stage_seconds(stage) if timings is None else timings.get(stage)
        figures = ", ".join(f for f in (figure(values, k) for k in [*SUMMARY.get(stage, []), *kind_keys(values)]) if f)
        table.add_row(stage, f"{seconds:.0f}" if isinstance(seconds, (int, float)) else "-", figures)
    console = console or Console(width=None if sys.stdout.isatty() else 120)  # a log file: 120 columns, not 80
    console.print(table)
    for line in summary_warnings(metrics) if warnings else []:
        console.print(line, style="bold red", markup=False, highlight=False, soft_wrap=True)


def read_metrics(paths: list[str]) -> dict:
    """The content of the JSON files at ``paths`` that exist (a stage's :func:`flows.stages.figure_files`), merged."""
    values: dict = {}
    for path in paths:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                values.update(json.load(handle))
    return values


HEADLINE = {  # the figures of a stage's one end line; {kind} repeats the figure for each kind the metrics hold
    "validate": ["validate/valid", "validate/quarantined"],
    "sft": ["sft/steps", "sft/loss_last"],  # sft/steps=0: no SFT, models/sft is the base model
    "reward": ["rm/balanced_accuracy", "rm/kind/{kind}/balanced_accuracy"],
    "gate": ["gate/passed"],
    "judge": ["judge/balanced_accuracy", "judge/kind/{kind}/balanced_accuracy"],
    "ppo": ["ppo/shipped_iteration", "ppo/last/kl"],  # the figure dvc metrics show's ppo row calls "kl"
    "evaluate": ["eval/judge/win_rate", "eval/judge/lc_win_rate", "eval/policy/kl", "eval/policy/refusal_rate"],
}


def headline(stage: str, values: dict) -> str:
    """The :data:`HEADLINE` figures of ``stage`` in ``values`` (its metrics), e.g. ``rm/balanced_accuracy=0.553
    [0.500, 0.610], rm/kind/harmless/balanced_accuracy=0.494 [0.403, 0.579]``; "" when it has none."""
    keys = []
    for key in HEADLINE.get(stage, []):
        prefix = key.split("/", 1)[0]
        keys += [key.format(kind=kind) for kind in kinds_in(values, prefix)] if "{kind}" in key else [key]
    return ", ".join(f for f in (figure(values, key) for key in keys) if f)


def summary_markdown(metrics: dict[str, dict], timings: dict[str, float | None] | None = None) -> str:
    """:func:`print_summary`'s table and warnings as Markdown (the flow run's Prefect artifact)."""
    rows = ["| stage | seconds | figures |", "|---|---:|---|"]
    for stage, values in metrics.items():
        seconds = stage_seconds(stage) if timings is None else timings.get(stage)
        figures = ", ".join(f for f in (figure(values, k) for k in [*SUMMARY.get(stage, []), *kind_keys(values)]) if f)
        rows.append(f"| {stage} | {f'{seconds:.0f}' if isinstance(seconds, (int, float)) else '-'} | {figures} |")
    warnings = [f"- {line}" for line in summary_warnings(metrics)]
    return "\n".join([f"**{verdict(metrics)[1]}**", "", *rows, *([""] + warnings if warnings else [])])


COMPLETED, GATE_FAILED = "Completed", "Gate failed"  # the flow's final state names (flows.pipeline.rlhf_pipeline)


GATES = (("evaluate", "policy gate", POLICY_GATE), ("gate", "reward gate", REWARD_GATE))  # the deciding one first


def _deciding_gate(metrics: dict[str, dict]) -> tuple[str, list[str], str | None]:
    """``(head, why each failed check failed, its report or None when it passed)`` of the policy gate when evaluate
    ran, else of the reward gate (:func:`rlhf.evaluation.gate_rules.decision_parts`); ``("no gate ran", [], None)``."""
    for stage, what, report in GATES:
        parts = decision_parts(metrics.get(stage), what)
        if parts is not None:
            return parts[0], parts[1], None if metrics[stage]["decision"] == "pass" else report
    return "no gate ran", [], None


def verdict(metrics: dict[str, dict]) -> tuple[str, str]:
    """What the run decided, as ``(state name, one sentence)``: the policy gate's decision when evaluate ran, else
    the reward gate's, with the report that holds its figures when it failed; the flow's final state is named after
    it (Prefect's run list shows it) and carries the sentence; the console ends with it as :func:`verdict_lines`.

    e.g. ``("Gate failed", "policy gate failed 2 of 9 checks: EOS rate of the policy's responses; helpful
    prompts: refusal rate increase over SFT, upper 95% bound (...) (reports/policy_gate.json)")``,
    ``("Completed", "policy gate passed all 9 checks")``.
    """
    head, reasons, report = _deciding_gate(metrics)
    if report is None:
        return COMPLETED, head
    return GATE_FAILED, f"{head}: {'; '.join(reasons)} ({report})"


def verdict_lines(metrics: dict[str, dict]) -> list[str]:
    """:func:`verdict` as the console's last lines and its Prefect log's: ``[flow]`` and its head (with the report
    that holds its figures when a gate failed), then a ``  - why`` line for each failed check, e.g. ``["[flow]
    policy gate failed 2 of 9 checks (reports/policy_gate.json):", "  - too many of the policy's answers were cut
    off before they ended (30% ended, at least 50% must)", ...]``; the console wraps each at 120 columns
    (:func:`flows.console.fit`)."""
    head, reasons, report = _deciding_gate(metrics)
    if report is None:
        return [f"[flow] {head}"]
    return [f"[flow] {head} ({report}):", *(f"  - {why}" for why in reasons)]
