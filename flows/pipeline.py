"""The pipeline as a Prefect flow: each DVC stage is a Prefect task running ``dvc repro --single-item <stage>``.

What is stale, cached and versioned stays DVC's (``dvc.yaml`` is the only DAG);
Prefect adds retries, logs and an id that groups the stage runs of one
pipeline run in MLflow. Runs on Prefect's ephemeral API unless
``PREFECT_API_URL`` names a server.

Usage: ``python -m flows.pipeline [--stage NAME ...]``.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import networkx as nx
import typer
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed
from rich.console import Console
from rich.table import Table

from flows.approval import await_approval, awaiting
from flows.deployments import clean_revision, run_on_pool, stage_pool
from flows.pools import pool_limits
from flows.stages import (
    StageRefused,
    dvc_stages,
    dvc_status,
    entry_paths,
    run_in_order,
    run_stage,
    stage_graph,
    stage_order,
    stale_reasons,
    stale_stages,
)
from rlhf.kinds import kinds_in
from rlhf.stats import chance_warning
from tasks.kit import paths
from tasks.kit.common import one_line
from tasks.kit.outputs import load_json, timing_path
from tasks.kit.params import read_params, stage_params
from tasks.kit.runs import StageRun

SUMMARY = {
    "prepare": [],
    "base_model": [],
    "validate": ["validate/valid", "validate/quarantined"],
    "sft": ["sft/loss_first", "sft/loss_last"],
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


@flow(name="rlhf-pipeline", log_prints=False)
def rlhf_pipeline(stages: list[str] | None = None, pools: bool = False) -> Any:
    """:func:`run_pipeline` as a Prefect flow: its log and its final state's message carry the summary table
    (:func:`summary_text`); a failure logs ``FAILED: <reason>`` and the failed state's message is that reason.

    Returns:
        a Completed state with the metrics as data (a caller of the flow gets the metrics).
    """
    logger = get_run_logger()
    try:
        metrics = run_pipeline(stages, pools)
    except Exception as err:
        logger.error("FAILED: %s", first_line(err))
        raise
    text = summary_text(metrics)
    logger.info("summary\n%s", text)
    return Completed(message=text, data=metrics)


def first_line(err: BaseException) -> str:
    """The first line of an error's message (:func:`tasks.kit.common.one_line`: a URL's password cut), else its type."""
    return one_line(str(err)) or type(err).__name__


def run_pipeline(stages: list[str] | None = None, pools: bool = False) -> dict[str, dict]:
    """Run the stages of ``dvc.yaml`` in order (all by default) and return their metrics files.

    ``pools``: run each stage as a ``run-stage`` flow run on its work pool (params.yaml
    ``orchestration.work_pools``; :mod:`flows.deployments`), its data moving through the DVC remote, waiting
    within ``orchestration.start_timeout_s`` and ``lost_worker_s`` (:mod:`flows.pools`); the scheduled
    deployment of ``infra/prefect.yaml`` sets it. False (``make pipeline``): every stage runs here.

    Asked for a subset, it also runs every stage upstream of it that is stale (a changed param, dep or
    command; an ``always_changed`` stage such as ``source``), in order, naming each and why, as
    ``dvc repro <stage>`` would: the stages asked for never run on stale inputs. Afterwards every stage
    it ran or relied on must be up to date (``dvc status``), or the flow fails naming the stale ones.

    Args:
        stages: a subset of stage names; None runs all.

    Raises:
        ValueError: an unknown stage name, credentials in params.yaml, or a bad ``orchestration`` limit.
        RuntimeError: a stage failed (:class:`flows.pools.PoolWaitError`: its pool had no live worker, did not
            start it in time or lost it), or a stage is still stale after the run.
    """
    params = read_params()  # refuses credentials in params.yaml before any stage runs
    order, graph = stage_order(), stage_graph()
    unknown = sorted(set(stages or []) - set(order))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; dvc.yaml has {order}")
    run_id = f"prefect-{flow_run.get_id() or 'local'}"
    wanted = set(order if stages is None else stages)
    revision = clean_revision() if pools else ""  # a worker runs the committed tree
    limits = pool_limits(params) if pools else None

    def run(stage: str) -> None:
        if pools:
            run_on_pool(stage, stage_pool(stage, params), run_id, revision, limits)
        else:
            run_stage(stage, run_id)

    status = "FAILED"
    try:  # the flow knows how the whole run ended (a failure between stages, a cancelled flow): it ends the parent
        run_in_order(
            order,
            graph,
            wanted,
            run=run,
            why_stale=lambda stage: stale_reasons(dvc_status([stage])).get(stage),
        )
        checked = sorted(wanted.union(*(nx.ancestors(graph, stage) for stage in wanted)))
        stale = stale_stages(dvc_status(checked))
        if stale:  # never report success on stale inputs
            raise RuntimeError(
                "stale after the run: " + "; ".join(f"{stage}: {why}" for stage, why in stale.items()) + " (dvc status)"
            )
        approve_policy()
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        StageRun.end_pipeline(run_id, status)
    metrics = {}
    for stage, spec in dvc_stages("dvc.yaml").items():
        for path in entry_paths(spec.get("metrics")):
            if os.path.exists(path):
                with open(path, encoding="utf-8") as handle:
                    metrics.setdefault(stage, {}).update(json.load(handle))
    return metrics


def approve_policy(report_path: str = paths.POLICY_GATE) -> str | None:
    """With ``registry.policy_approval.required``, wait for a person's approval of a policy that passed its gate
    and waits for one (:mod:`flows.approval`); returns the outcome, or None when nothing waits."""

    if not os.path.exists(report_path):  # no policy gate ran (nor a project with a registry section)
        return None
    approval = stage_params("registry")["policy_approval"]
    report = load_json(report_path)
    if not approval["required"] or not awaiting(report):
        return None
    return await_approval(report, int(approval["timeout_s"]))


def _figure(values: dict, key: str) -> str | None:
    """``key=value``, with ``[low, high]`` when the file holds ``<key>_low`` and ``<key>_high``; None if absent.

    A rate that is undefined (NaN, written as null) shows as ``n/a``.
    """
    if key not in values:
        return None
    value, low, high = values[key], values.get(f"{key}_low"), values.get(f"{key}_high")
    if not isinstance(value, (int, float)):
        return f"{key}=n/a" if value is None else None
    if isinstance(low, (int, float)) and isinstance(high, (int, float)):
        return f"{key}={value:.3f} [{low:.3f}, {high:.3f}]"
    return f"{key}={value:.3f}"


KIND_SUMMARY = {  # per kind of data (rlhf.kinds): prefix -> the figures the summary shows for each kind
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
    metrics: dict[str, dict], timings: dict[str, float | None] | None = None, console: Console | None = None
) -> None:
    """Print the time of each stage and the headline figures (rates with their interval), then any warning.

    Args:
        metrics: stage -> its metrics file's content (as :func:`run_pipeline` returns them).
        timings: stage -> seconds of its last run; by default :func:`stage_seconds` of each stage.
        console: where to print (the terminal by default).
    """
    table = Table(title="RLHF pipeline")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("figures")
    for stage, values in metrics.items():
        seconds = stage_seconds(stage) if timings is None else timings.get(stage)
        figures = ", ".join(f for f in (_figure(values, k) for k in [*SUMMARY.get(stage, []), *kind_keys(values)]) if f)
        table.add_row(stage, f"{seconds:.0f}" if isinstance(seconds, (int, float)) else "-", figures)
    console = console or Console()
    console.print(table)
    for line in summary_warnings(metrics):
        console.print(line, style="bold red", markup=False, highlight=False, soft_wrap=True)


def summary_text(metrics: dict[str, dict]) -> str:
    """:func:`print_summary`'s table and warnings as plain text (for the flow's log and its final state)."""
    buffer = io.StringIO()
    print_summary(metrics, console=Console(file=buffer, width=160, color_system=None, force_terminal=False))
    return buffer.getvalue().rstrip()


def main(stage: list[str] = typer.Option(None, help="run only these stages (repeatable)")) -> None:
    """Run the pipeline flow (its log ends with the summary table) and print ``dvc status`` (stale stages with
    why; ``up to date``).

    A failed flow ends with its reason on one line (Prefect has logged the details) and exit 1.
    """
    try:
        rlhf_pipeline(stages=stage or None)
    except (StageRefused, ValueError, RuntimeError) as err:
        print(f"[flow] FAILED: {first_line(err)}")
        raise SystemExit(1) from None
    status = dvc_status()
    stale = stale_stages(status)
    always = sorted(set(status) - set(stale))
    print(
        "dvc status:",
        "; ".join(f"{name}: {why}" for name, why in stale.items()) or "up to date",
        f"(always changed, by design: {', '.join(always)})" if always else "",
    )


if __name__ == "__main__":
    typer.run(main)
