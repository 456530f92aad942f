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
import re
import subprocess
import sys
from collections.abc import Callable

import networkx as nx
import typer
from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from rich.console import Console
from rich.table import Table

from tasks.params import load_yaml

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


def _stages(dvc_file: str) -> dict:
    return load_yaml(dvc_file)["stages"]


def _paths(entries: list | None) -> list[str]:
    """Paths of a dvc.yaml deps/outs/metrics list (entries are strings or one-key dicts)."""
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def stage_graph(dvc_file: str = "dvc.yaml") -> nx.DiGraph:
    """The stages of ``dvc.yaml`` as a graph: an edge from a stage to every stage that reads one of its outs."""
    stages = _stages(dvc_file)
    graph = nx.DiGraph()
    graph.add_nodes_from(stages)
    for name, stage in stages.items():
        for other, upstream in stages.items():
            outs = _paths(upstream.get("outs")) + _paths(upstream.get("metrics")) + _paths(upstream.get("plots"))
            if other != name and any(
                dep == out or dep.startswith(out.rstrip("/") + "/") for dep in _paths(stage.get("deps")) for out in outs
            ):
                graph.add_edge(other, name)
    return graph


def stage_order(dvc_file: str = "dvc.yaml") -> list[str]:
    """Stage names of ``dvc.yaml`` in dependency order (a stage after every stage whose outs it reads).

    Raises:
        ValueError: the stages form a cycle.
    """
    graph = stage_graph(dvc_file)
    if not nx.is_directed_acyclic_graph(graph):
        raise ValueError(f"{dvc_file}: the stages form a cycle")
    return list(nx.lexicographical_topological_sort(graph, key=list(_stages(dvc_file)).index))


ALWAYS_CHANGED = "always changed"  # `always_changed: true` stages: DVC reports them so after every run


def dvc_status(targets: list[str] | None = None) -> dict[str, list]:
    """``dvc status --json`` of ``targets`` (each stage by itself, not its upstream; all stages by default).

    Returns:
        stage -> what DVC says changed, e.g. ``{"reward": [{"changed deps": {"params.yaml": {"reward":
        "modified"}}}], "source": ["always changed"]}``; empty when all are up to date.

    Raises:
        RuntimeError: ``dvc status`` failed (its message).
    """
    result = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json", *(targets or [])], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"dvc status failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip() or "{}")


def _change(entry) -> str:
    """One entry of a stage's ``dvc status --json`` list as words: ``changed deps params.yaml:reward (modified)``."""
    if isinstance(entry, str):
        return entry
    phrases = []
    for kind, files in entry.items():
        if not isinstance(files, dict):
            phrases.append(f"{kind} ({files})")
            continue
        for path, change in files.items():
            if isinstance(change, dict):  # params.yaml: {param: change}
                phrases += [f"{kind} {path}:{param} ({what})" for param, what in change.items()]
            else:
                phrases.append(f"{kind} {path} ({change})")
    return ", ".join(phrases)


def stale_reasons(status: dict[str, list]) -> dict[str, str]:
    """Stage -> why DVC says it is stale, from :func:`dvc_status`'s dict.

    e.g. ``{"reward": "changed deps params.yaml:reward (modified)", "source": "always changed"}``.
    """
    return {stage: "; ".join(_change(e) for e in entries) or "changed" for stage, entries in status.items()}


def stale_stages(status: dict[str, list]) -> dict[str, str]:
    """:func:`stale_reasons` without the ``always_changed`` stages (DVC reports them after every run, by design)."""
    return {stage: why for stage, why in stale_reasons(status).items() if why != ALWAYS_CHANGED}


def run_in_order(
    order: list[str],
    graph: nx.DiGraph,
    wanted: set[str],
    run: Callable[[str], None],
    why_stale: Callable[[str], str | None],
    say: Callable[[str], None] = print,
) -> list[str]:
    """Run the ``wanted`` stages in ``order``, each after every stage upstream of it that is stale when reached.

    A stage upstream of a wanted one runs when ``why_stale(stage)`` (asked just before, so a stage made stale
    by one that ran before it counts) gives a reason, and ``say`` names it, the reason and the wanted stages
    it feeds; an up-to-date upstream stage does not run. A wanted stage always goes to ``run`` (DVC skips it
    when it is up to date).

    Returns:
        the stages run, in order.
    """
    feeds = {
        stage: [w for w in order if w in wanted and stage in nx.ancestors(graph, w)]
        for stage in order
        if stage not in wanted
    }
    ran = []
    for stage in order:
        if stage not in wanted:
            if not feeds[stage]:
                continue
            why = why_stale(stage)
            if not why:
                continue
            say(f"[flow] {stage} is stale ({why}) and upstream of {', '.join(feeds[stage])}: running it first")
        run(stage)
        ran.append(stage)
    return ran


class StageRefused(RuntimeError):
    """A stage ended with its own one-line error (bad input, bad params, divergence): a retry would fail the same."""


STAGE_ERROR = re.compile(r"^\[\w+\] (error: |stopped by )")  # the line tasks.common.cli prints


def retry_unless_refused(task, task_run, state) -> bool:
    """Prefect retry condition: retry a crash (a lost worker, a killed process), never a :class:`StageRefused`."""
    try:
        state.result()
    except StageRefused:
        return False
    except Exception:  # any other failure may be transient
        return True
    return True


@task(retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_refused, task_run_name="{stage}")
def run_stage(stage: str, pipeline_run_id: str) -> None:
    """Run one DVC stage (skipped by DVC when it is up to date); a retry resumes from the stage's checkpoint.

    A stage that ends with its own error line (:data:`STAGE_ERROR`) is not retried: bad input, bad
    params and divergence fail the same way twice.

    Raises:
        StageRefused: the stage printed its one-line error (that line is the message).
        RuntimeError: the stage failed otherwise (its output tail is in the message).
    """
    logger = get_run_logger()
    # a stage's `python -m tasks.<stage>` is this interpreter, activated or not (else PATH's first python runs it)
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "RLHF_PIPELINE_RUN_ID": pipeline_run_id, "PATH": path}
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
        refused = [line for line in tail if STAGE_ERROR.match(line)]
        if refused:
            raise StageRefused(refused[-1])
        raise RuntimeError(f"stage {stage} failed (exit {process.returncode}):\n" + "\n".join(tail))
    logger.info("stage %s done", stage)


@flow(name="rlhf-pipeline", log_prints=False)
def rlhf_pipeline(stages: list[str] | None = None, pools: bool = False) -> dict[str, dict]:
    """Run the stages of ``dvc.yaml`` in order (all by default) and return their metrics files.

    ``pools``: run each stage as a ``run-stage`` flow run on its work pool (params.yaml
    ``orchestration.work_pools``; :mod:`flows.deployments`), its data moving through the DVC remote; the
    scheduled deployment of ``infra/prefect.yaml`` sets it. False (``make pipeline``): every stage runs here.

    Asked for a subset, it also runs every stage upstream of it that is stale (a changed param, dep or
    command; an ``always_changed`` stage such as ``source``), in order, naming each and why, as
    ``dvc repro <stage>`` would: the stages asked for never run on stale inputs. Afterwards every stage
    it ran or relied on must be up to date (``dvc status``), or the flow fails naming the stale ones.

    Args:
        stages: a subset of stage names; None runs all.

    Raises:
        ValueError: an unknown stage name, or credentials in params.yaml.
        RuntimeError: a stage failed, or a stage is still stale after the run.
    """
    from flows.deployments import clean_revision, run_on_pool, stage_pool
    from tasks.params import read_params
    from tasks.runs import StageRun

    params = read_params()  # refuses credentials in params.yaml before any stage runs
    order, graph = stage_order(), stage_graph()
    unknown = sorted(set(stages or []) - set(order))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; dvc.yaml has {order}")
    run_id = f"prefect-{flow_run.get_id() or 'local'}"
    wanted = set(order if stages is None else stages)
    revision = clean_revision() if pools else ""  # a worker runs the committed tree

    def run(stage: str) -> None:
        if pools:
            run_on_pool(stage, stage_pool(stage, params), run_id, revision)
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
    for stage, spec in _stages("dvc.yaml").items():
        for path in _paths(spec.get("metrics")):
            if os.path.exists(path):
                with open(path, encoding="utf-8") as handle:
                    metrics.setdefault(stage, {}).update(json.load(handle))
    return metrics


def approve_policy(report_path: str = "reports/policy_gate.json") -> str | None:
    """With ``registry.policy_approval.required``, wait for a person's approval of a policy that passed its gate
    and waits for one (:mod:`flows.approval`); returns the outcome, or None when nothing waits."""
    from flows.approval import await_approval, awaiting
    from tasks.outputs import load_json
    from tasks.params import stage_params

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


def summary_warnings(metrics: dict[str, dict]) -> list[str]:
    """Loud lines for the summary: the reward model's accuracy interval includes chance (or is below it, or
    undefined), and each ``GATE FAILED: criterion, value, bound`` line of the reward and the policy gate.

    Reads ``rm/accuracy``, ``rm/accuracy_low`` and ``rm/accuracy_high`` of the
    reward stage's metrics file (NaN is stored as null); the rule and wording
    are :func:`rlhf.stats.chance_warning`'s, as printed by the reward stage. The
    gates' lines come from ``reports/reward_gate.json`` and ``reports/policy_gate.json``.
    """
    from rlhf.stats import chance_warning

    lines = []
    reward = metrics.get("reward", {})
    if "rm/accuracy_low" in reward:
        warning = chance_warning(
            "rm_eval balanced accuracy", *(reward.get(f"rm/balanced_accuracy{s}") for s in ("", "_low", "_high"))
        )
        lines += [f"WARNING: {warning}: the reward model has not learned to rank"] if warning else []
    judge = metrics.get("judge", {})
    if "judge/balanced_accuracy_low" in judge:
        warning = chance_warning(
            "judge_eval balanced accuracy", *(judge.get(f"judge/balanced_accuracy{s}") for s in ("", "_low", "_high"))
        )
        lines += [f"WARNING: {warning}: the judge's win rates mean nothing"] if warning else []
    gate = metrics.get("gate", {})
    lines += [f"reward model {line}" for line in gate.get("lines", []) if line.startswith("GATE FAILED")]
    policy = metrics.get("evaluate", {})  # reports/policy_gate.json is one of evaluate's metrics files
    lines += [f"policy {line}" for line in policy.get("lines", []) if line.startswith("GATE FAILED")]
    if gate and not gate.get("champion"):
        lines.append("WARNING: no reward model holds the champion alias: ppo cannot run (rlhf-registry status)")
    return lines


def stage_seconds(stage: str) -> float | None:
    """The wall time of the stage's last run, from ``timings/<stage>.json``; None when it has none.

    ``tasks.outputs.write_metrics`` writes it there, apart from the metrics file: a time differs between two
    runs of the same inputs, so it is neither committed nor compared by ``dvc exp show``/``dvc metrics diff``.
    """
    from tasks.outputs import timing_path

    path = timing_path(stage)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle).get("seconds")


def print_summary(metrics: dict[str, dict], timings: dict[str, float | None] | None = None) -> None:
    """Print the time of each stage and the headline figures (rates with their interval), then any warning.

    Args:
        metrics: stage -> its metrics file's content (as :func:`rlhf_pipeline` returns them).
        timings: stage -> seconds of its last run; by default :func:`stage_seconds` of each stage.
    """
    table = Table(title="RLHF pipeline")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("figures")
    for stage, values in metrics.items():
        seconds = stage_seconds(stage) if timings is None else timings.get(stage)
        figures = ", ".join(f for f in (_figure(values, k) for k in SUMMARY.get(stage, [])) if f)
        table.add_row(stage, f"{seconds:.0f}" if isinstance(seconds, (int, float)) else "-", figures)
    console = Console()
    console.print(table)
    for line in summary_warnings(metrics):
        console.print(line, style="bold red", markup=False, highlight=False, soft_wrap=True)


def main(stage: list[str] = typer.Option(None, help="run only these stages (repeatable)")) -> None:
    """Run the pipeline flow and print the summary and ``dvc status`` (stale stages with why; ``up to date``).

    A failed flow ends with its reason on one line (Prefect has logged the details) and exit 1.
    """
    try:
        metrics = rlhf_pipeline(stages=stage or None)
    except (StageRefused, ValueError, RuntimeError) as err:
        print(f"[flow] FAILED: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}")
        raise SystemExit(1) from None
    print_summary(metrics)
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
