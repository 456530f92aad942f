"""The pipeline as a Prefect flow: each DVC stage is a Prefect task running ``dvc repro --single-item <stage>``.

What is stale, cached and versioned stays DVC's (``dvc.yaml`` is the only DAG);
Prefect adds retries, logs and an id that groups the stage runs of one
pipeline run in MLflow. Runs on Prefect's ephemeral API unless
``PREFECT_API_URL`` names a server.

Usage: ``python -m flows.pipeline [--stage NAME ...]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import networkx as nx
import typer
import yaml
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from rich.console import Console
from rich.table import Table

SUMMARY = {
    "prepare": [],
    "base_model": [],
    "validate": ["validate/valid", "validate/quarantined"],
    "sft": ["sft/loss_first", "sft/loss_last"],
    "reward": ["rm/accuracy", "rm/pairs", "rm/ties", "rm/accuracy_chosen_shorter", "rm/margin", "rm/ece"],
    "ppo": [
        "ppo/policy_iterations",
        "ppo/value/pretrain_explained_variance",
        "ppo/shipped_iteration",
        "ppo/validation/reward",
        "ppo/validation/eos_rate",
        "ppo/validation/kl",
        "ppo/last/eos_rate",
        "ppo/last/value/explained_variance",
    ],
    "evaluate": [
        "eval/sft/reward",
        "eval/policy/reward",
        "eval/win_rate",
        "eval/ties",
        "eval/policy/kl",
        "eval/sft/eos_rate",
        "eval/policy/eos_rate",
        "eval/sft/length",
        "eval/policy/length",
    ],
}


def _stages(dvc_file: str) -> dict:
    with open(dvc_file, encoding="utf-8") as handle:
        return yaml.safe_load(handle)["stages"]


def _paths(entries: list | None) -> list[str]:
    """Paths of a dvc.yaml deps/outs/metrics list (entries are strings or one-key dicts)."""
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def stage_order(dvc_file: str = "dvc.yaml") -> list[str]:
    """Stage names of ``dvc.yaml`` in dependency order (a stage after every stage whose outs it reads).

    Raises:
        ValueError: the stages form a cycle.
    """
    stages = _stages(dvc_file)
    graph = nx.DiGraph()
    graph.add_nodes_from(stages)
    for name, stage in stages.items():
        for other, upstream in stages.items():
            outs = _paths(upstream.get("outs")) + _paths(upstream.get("metrics"))
            if other != name and any(
                dep == out or dep.startswith(out.rstrip("/") + "/") for dep in _paths(stage.get("deps")) for out in outs
            ):
                graph.add_edge(other, name)
    if not nx.is_directed_acyclic_graph(graph):
        raise ValueError(f"{dvc_file}: the stages form a cycle")
    return list(nx.lexicographical_topological_sort(graph, key=list(stages).index))


@task(retries=1, retry_delay_seconds=5, task_run_name="{stage}")
def run_stage(stage: str, pipeline_run_id: str) -> None:
    """Run one DVC stage (skipped by DVC when it is up to date); a retry resumes from the stage's checkpoint.

    Raises:
        RuntimeError: the stage failed (its output tail is in the message).
    """
    logger = get_run_logger()
    env = {**os.environ, "RLHF_PIPELINE_RUN_ID": pipeline_run_id}
    process = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro", "--single-item", stage],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tail: list[str] = []
    for line in process.stdout:
        print(line, end="", flush=True)
        tail = (tail + [line.rstrip()])[-20:]
    if process.wait() != 0:
        raise RuntimeError(f"stage {stage} failed (exit {process.returncode}):\n" + "\n".join(tail))
    logger.info("stage %s done", stage)


@flow(name="rlhf-pipeline", log_prints=False)
def rlhf_pipeline(stages: list[str] | None = None) -> dict[str, dict]:
    """Run the stages of ``dvc.yaml`` in order (all by default) and return their metrics files.

    Args:
        stages: a subset of stage names; None runs all.

    Raises:
        ValueError: an unknown stage name.
    """
    order = stage_order()
    unknown = sorted(set(stages or []) - set(order))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; dvc.yaml has {order}")
    run_id = f"prefect-{flow_run.get_id() or 'local'}"
    for stage in order:
        if stages is None or stage in stages:
            run_stage(stage, run_id)
    metrics = {}
    for stage, spec in _stages("dvc.yaml").items():
        for path in _paths(spec.get("metrics")):
            if os.path.exists(path):
                with open(path, encoding="utf-8") as handle:
                    metrics.setdefault(stage, {}).update(json.load(handle))
    return metrics


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


def summary_warnings(metrics: dict[str, dict]) -> list[str]:
    """Loud lines for the summary: the reward model's accuracy interval includes chance (or is below it, or undefined).

    Reads ``rm/accuracy``, ``rm/accuracy_low`` and ``rm/accuracy_high`` of the
    reward stage's metrics file (NaN is stored as null); the rule and wording
    are :func:`rlhf.stats.chance_warning`'s, as printed by the reward stage.
    """
    from rlhf.stats import chance_warning

    reward = metrics.get("reward", {})
    if "rm/accuracy_low" not in reward:
        return []
    warning = chance_warning(
        "rm_eval accuracy", reward.get("rm/accuracy"), reward.get("rm/accuracy_low"), reward.get("rm/accuracy_high")
    )
    return [f"WARNING: {warning}: the reward model has not learned to rank"] if warning else []


def print_summary(metrics: dict[str, dict]) -> None:
    """Print the time of each stage and the headline figures (rates with their interval), then any warning."""
    table = Table(title="RLHF pipeline")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("figures")
    for stage, values in metrics.items():
        seconds = values.get("seconds")
        figures = ", ".join(f for f in (_figure(values, k) for k in SUMMARY.get(stage, [])) if f)
        table.add_row(stage, f"{seconds:.0f}" if isinstance(seconds, (int, float)) else "-", figures)
    console = Console()
    console.print(table)
    for line in summary_warnings(metrics):
        console.print(line, style="bold red", markup=False, highlight=False, soft_wrap=True)


def main(stage: list[str] = typer.Option(None, help="run only these stages (repeatable)")) -> None:
    """Run the pipeline flow and print the summary and ``dvc status``."""
    print_summary(rlhf_pipeline(stages=stage or None))
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], capture_output=True, text=True)
    print("dvc status:", status.stdout.strip() or status.stderr.strip())


if __name__ == "__main__":
    typer.run(main)
