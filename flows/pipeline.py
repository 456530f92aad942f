"""The pipeline as a Prefect flow: each DVC stage is a Prefect task running ``dvc repro --single-item <stage>``.

What is stale, cached and versioned stays DVC's (``dvc.yaml`` is the only DAG);
Prefect adds retries, logs and an id that groups the stage runs of one
pipeline run in MLflow. Runs on Prefect's ephemeral API unless
``PREFECT_API_URL`` names a server.

Usage: ``python -m flows.pipeline [--stage NAME ...]``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import networkx as nx
import typer
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, Failed

from flows.approval import await_approval, awaiting
from flows.console import FitToConsoleWidth, to_prefect_log
from flows.deployments import clean_revision, run_on_pool, stage_pool
from flows.pools import pool_limits
from flows.stages import (
    StageRefused,
    dvc_stages,
    dvc_status,
    figure_files,
    run_in_order,
    run_stage,
    stage_graph,
    stage_order,
    stale_reasons,
    stale_stages,
)
from flows.summary import (
    COMPLETED,
    GATE_FAILED,
    print_summary,
    read_metrics,
    summary_markdown,
    verdict,
    verdict_lines,
)
from tasks.kit import paths
from tasks.kit.common import one_line
from tasks.kit.console import fit
from tasks.kit.outputs import load_json
from tasks.kit.params import read_params, stage_params
from tasks.kit.runs import VERDICT_SENTENCE_TAG, VERDICT_TAG, StageRun


@flow(name="rlhf-pipeline", log_prints=False)
def rlhf_pipeline(stages: list[str] | None = None, pools: bool = False) -> Any:
    """:func:`run_pipeline` as a Prefect flow: prints the summary table once (:func:`flows.summary.print_summary`),
    publishes it as the flow run's Markdown artifact ``rlhf-summary``, and ends in a state named after the verdict
    (:func:`flows.summary.verdict`), its message the verdict's sentence, whose lines end its Prefect log
    (:func:`flows.summary.verdict_lines`):
    ``Completed`` (type COMPLETED) when every gate that ran passed, ``Gate failed`` (type FAILED, red in the UI,
    FAILED in ``prefect flow-run ls``, what an automation or notification on failed runs acts on) when a gate
    refused; a stage that failed ends the run Failed with the stage's error. ``make pipeline`` exits 0 on a gate
    that refused (:func:`flow_metrics`): a designed outcome, not a crash.

    Returns:
        that state, with the metrics as data.
    """
    logger = get_run_logger()
    try:
        metrics = run_pipeline(stages, pools)
    except Exception as err:
        logger.error("FAILED: %s", first_line(err))
        raise
    print_summary(metrics, warnings=False)  # each stage has printed its own warnings as it ended
    create_markdown_artifact(
        key="rlhf-summary", markdown=summary_markdown(metrics), description="The pipeline run's figures"
    )
    name, sentence = verdict(metrics)
    for line in verdict_lines(metrics):  # the console prints them last, after dvc status
        to_prefect_log(line)
    return (Completed if name == COMPLETED else Failed)(name=name, message=sentence, data=metrics)


def flow_metrics(stages: list[str] | None) -> dict[str, dict]:
    """Run :func:`rlhf_pipeline`; its metrics when it completed or a gate refused (its ``Gate failed`` state).

    Raises:
        the error of the stage that failed (StageRefused, RuntimeError, ValueError), as the flow raised it.
    """
    state = rlhf_pipeline(stages=stages, return_state=True)
    if state.is_failed() and state.name != GATE_FAILED:
        state.result()  # raises what failed
    return state.result(raise_on_failure=False)


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

    status, tags = "FAILED", {}
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
        specs = dvc_stages("dvc.yaml").items()
        metrics = {stage: values for stage, spec in specs if (values := read_metrics(figure_files(spec)))}
        name, sentence = verdict(metrics)
        tags = {VERDICT_TAG: name, VERDICT_SENTENCE_TAG: sentence}
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        StageRun.end_pipeline(run_id, status, tags)
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


def without_traceback(record: logging.LogRecord) -> bool:
    """A logging filter that keeps a record's message and drops its traceback: a stage that fails says why in its
    own line (and ``logs/<stage>.log`` holds its whole output); Prefect's engine adds 40 lines of its own frames."""
    record.exc_info, record.exc_text = None, None
    return True


STOPPED = "[flow] stopped by Ctrl-C; `make pipeline` resumes (DVC reruns what is stale, PPO from its checkpoint)"
CTRL_C_GRACE_S = 10.0


def leave_soon_after_ctrl_c(grace_s: float = CTRL_C_GRACE_S) -> None:
    """On Ctrl-C, raise KeyboardInterrupt as Python does, and leave ``grace_s`` seconds later whatever is still
    running (exit 130, :data:`STOPPED` printed); a second Ctrl-C is Python's own.

    Ctrl-C reaches the whole process group: the stage stops without putting outputs in place and the flow ends
    its MLflow run as KILLED, but Prefect's temporary server stops too, and Prefect then retried recording the
    crash on it, and sending its events, for minutes. Everything worth doing after a Ctrl-C is done in seconds.
    """
    previous = signal.getsignal(signal.SIGINT)

    def leave() -> None:
        print(STOPPED, flush=True)
        sys.stderr.flush()
        os._exit(130)

    def on_ctrl_c(signum: int, frame: Any) -> None:
        for name in ("prefect.events.clients", "prefect._internal.concurrency"):  # the stopped server's socket
            logging.getLogger(name).setLevel(logging.CRITICAL)
        timer = threading.Timer(grace_s, leave)
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGINT, previous)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)


def main(stage: list[str] = typer.Option(None, help="run only these stages (repeatable)")) -> None:
    """Run the pipeline flow and print ``dvc status`` (stale stages with why; ``up to date``), then the verdict: its
    head and a line for each failed check (:func:`flows.summary.verdict_lines`), in 120 columns.

    The console shows each stage's start, loud lines and end (:mod:`flows.console`; the rest is in
    ``logs/<stage>.log``) and Prefect's flow-level lines, not its server's or each task's state. A failed flow
    ends with its reason on one line and exit 1; a gate that refuses ends with that line and exit 0.
    """
    logging.getLogger("prefect").setLevel(logging.WARNING)  # the temporary server's start and stop notes
    logging.getLogger("prefect.flow_runs").setLevel(logging.INFO)  # "Beginning flow run", its final state
    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)  # a stage's own end line says it finished
    for name in ("prefect.flow_runs", "prefect.task_runs"):  # a failed stage: its line, not the engine's traceback
        logging.getLogger(name).addFilter(without_traceback)
    for handler in logging.getLogger().handlers:  # Prefect's console handler: its lines in 120 columns
        handler.addFilter(FitToConsoleWidth(handler))
    leave_soon_after_ctrl_c()
    try:
        metrics = flow_metrics(stage or None)
    except (StageRefused, ValueError, RuntimeError) as err:
        print(fit(f"[flow] FAILED: {first_line(err)}"))
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(STOPPED)
        raise SystemExit(130) from None
    status = dvc_status()
    stale = stale_stages(status)
    always = sorted(set(status) - set(stale))
    stale_text = "; ".join(f"{name}: {why}" for name, why in stale.items()) or "up to date"
    by_design = f" (always changed, by design: {', '.join(always)})" if always else ""
    print(fit(f"dvc status: {stale_text}{by_design}"))
    for line in verdict_lines(metrics):
        print(fit(line))


if __name__ == "__main__":
    typer.run(main)
