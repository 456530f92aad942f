"""The pipeline's stages as DVC knows them: the graph of ``dvc.yaml``, what ``dvc status`` says is stale, and
the Prefect task that runs one stage (``dvc repro --single-item <stage>``), locally or on a worker.

``dvc.yaml`` stays the only DAG; this module reads it and never keeps a copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator

import networkx as nx
import psutil
from filelock import FileLock, Timeout
from prefect import task

from flows.console import CLEAR, SKIPPED, relay, say, stage_log, terminal
from flows.summary import headline, read_metrics, stage_seconds
from tasks.kit import paths
from tasks.kit.console import PROGRESS_ENV
from tasks.kit.dvclock import repair_dvc_rwlock
from tasks.kit.params import load_yaml

DVC = (sys.executable, "-m", "dvc", "--wait-for-lock")  # another run's stage holds the repository lock: wait for it


def dvc_stages(dvc_file: str) -> dict:
    return load_yaml(dvc_file)["stages"]


def entry_paths(entries: list | None) -> list[str]:
    """Paths of a dvc.yaml deps/outs/metrics list (entries are strings or one-key dicts)."""
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def figure_files(spec: dict) -> list[str]:
    """A stage's figures as files (its metrics, its gate's report): the ``cache: false`` JSON outputs of its
    ``dvc.yaml`` entry, apart from its headline row (:func:`tasks.kit.paths.headline`: a few of them, renamed)."""
    found = []
    for entry in [*(spec.get("outs") or []), *(spec.get("metrics") or [])]:
        path, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        if path.endswith(".json") and (options or {}).get("cache") is False and not paths.is_headline(path):
            found.append(path)
    return found


def stage_graph(dvc_file: str = "dvc.yaml") -> nx.DiGraph:
    """The stages of ``dvc.yaml`` as a graph: an edge from a stage to every stage that reads one of its outs."""
    stages = dvc_stages(dvc_file)
    graph = nx.DiGraph()
    graph.add_nodes_from(stages)
    for name, stage in stages.items():
        for other, upstream in stages.items():
            outs = [path for key in ("outs", "metrics", "plots") for path in entry_paths(upstream.get(key))]
            deps = entry_paths(stage.get("deps"))
            if other != name and any(
                dep == out or dep.startswith(out.rstrip("/") + "/") for dep in deps for out in outs
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
    return list(nx.lexicographical_topological_sort(graph, key=list(dvc_stages(dvc_file)).index))


ALWAYS_CHANGED = "always changed"  # `always_changed: true` stages: DVC reports them so after every run


def dvc_status(targets: list[str] | None = None) -> dict[str, list]:
    """``dvc status --json`` of ``targets`` (each stage by itself, not its upstream; all stages by default).

    Returns:
        stage -> what DVC says changed, e.g. ``{"reward": [{"changed deps": {"params.yaml": {"reward":
        "modified"}}}], "source": ["always changed"]}``; empty when all are up to date.

    Raises:
        RuntimeError: ``dvc status`` failed (its message).
    """
    repair_dvc_rwlock()
    result = subprocess.run([*DVC, "status", "--json", *(targets or [])], capture_output=True, text=True)
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
    say: Callable[[str], None] = say,
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


STAGE_ERROR = re.compile(r"^\[\w+\] (error: |stopped by )")  # the line tasks.kit.common.cli prints


def retry_unless_refused(task, task_run, state) -> bool:
    """Prefect retry condition: retry a crash (a lost worker, a killed process), never a :class:`StageRefused`."""
    try:
        state.result()
    except StageRefused:
        return False
    except Exception:  # any other failure may be transient
        return True
    return True


CHECKOUT_LOCK = os.path.join(".dvc", "tmp", "rlhf-checkout.lock")


@contextlib.contextmanager
def checkout_lock(say: Callable[[str], None] = say) -> Iterator[None]:
    """Hold this checkout while a stage changes it (``dvc repro``, ``pull``, ``push``, a worker's ``git
    checkout``), waiting as long as another run holds it and saying so once.

    DVC locks the repository only around its own steps and lets a stage's command run unlocked, so a second
    ``dvc repro`` in the same checkout fails at once on the outputs' lock (``.dvc/tmp/rwlock``) rather than
    waiting: two pipeline runs (or a ``make pipeline`` beside a worker) sharing a checkout take turns here
    instead. Re-entrant within a process (a worker's stage holds it around the stage's own ``dvc repro``).
    """
    os.makedirs(os.path.dirname(CHECKOUT_LOCK), exist_ok=True)
    lock = FileLock(os.path.abspath(CHECKOUT_LOCK), is_singleton=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"[flow] another run holds this checkout ({CHECKOUT_LOCK}): waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def stop_tree(pid: int, grace_s: float = 10.0) -> None:
    """Stop process ``pid`` and every process under it (DVC and the stage command it runs): SIGTERM, which a stage
    answers by stopping without putting any output in place (:class:`tasks.kit.outputs.StagedOutputs`), then
    SIGKILL for whatever still runs after ``grace_s``. A process already gone is skipped."""
    try:
        top = psutil.Process(pid)
        family = [*top.children(recursive=True), top]
    except psutil.NoSuchProcess:
        return
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


@task(retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_refused, task_run_name="{stage}")
def run_stage(stage: str, pipeline_run_id: str) -> None:
    """Run one DVC stage (skipped by DVC when it is up to date); a retry resumes from the stage's checkpoint.

    Prints a line as the stage starts (naming its log), its loud lines, and a line as it ends with its time and
    headline figures (:func:`flows.summary.headline`); the stage's whole output and DVC's go to
    ``logs/<stage>.log`` (:func:`flows.console.relay`), its training loop's bar to the terminal when stdout is one.
    A stage that ends with its own error line (:data:`STAGE_ERROR`) is not retried: bad input, bad params and
    divergence fail the same way twice.

    Raises:
        StageRefused: the stage printed its one-line error (that line is the message).
        RuntimeError: the stage failed otherwise (its output tail is in the message).
    """
    # a stage's `python -m tasks.<stage>` is this interpreter, activated or not (else PATH's first python runs it)
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    bar = terminal()
    env = {**os.environ, "RLHF_PIPELINE_RUN_ID": pipeline_run_id, "PATH": path, PROGRESS_ENV: "1" if bar else "0"}
    log_path = stage_log(stage)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)

    def show(line: str) -> None:
        say(line, CLEAR if bar else "")

    show(f"[{stage}] running (log: {log_path})")
    with checkout_lock(), open(log_path, "w", encoding="utf-8") as log:
        repair_dvc_rwlock(show)
        process = subprocess.Popen(
            [*DVC, "repro", "--single-item", stage], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            lines = relay(process.stdout, log, show, bar)
            process.wait()
        except BaseException:  # this process stops (Ctrl-C, a cancelled or crashed flow run): so does the stage
            stop_tree(process.pid)
            raise
    if process.returncode != 0:
        refused = [line for line in lines[-20:] if STAGE_ERROR.match(line)]
        if refused:
            raise StageRefused(refused[-1])
        tail = "\n".join(lines[-20:])
        raise RuntimeError(f"stage {stage} failed (exit {process.returncode}; log: {log_path}):\n{tail}")
    if any(SKIPPED.match(line) for line in lines):
        show(f"[{stage}] up to date: DVC skipped it")
        return
    seconds = stage_seconds(stage)
    figures = headline(stage, read_metrics(figure_files(dvc_stages("dvc.yaml")[stage])))
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    show(f"[{stage}] done{took}" + (f": {figures}" if figures else ""))
