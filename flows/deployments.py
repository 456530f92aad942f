"""The pipeline on Prefect work pools: each stage runs as a ``run-stage`` flow run on its pool's worker.

``infra/prefect.yaml`` deploys the pipeline flow (on a cron schedule, ``pools=True``) and one
``run-stage-<pool>`` deployment per work pool. Work pools run flow runs, not tasks, so with ``pools=True``
the pipeline flow sends every stage, in DVC's order, to the pool that params.yaml's
``orchestration.work_pools`` names for it (sft, reward, ppo and evaluate on ``gpu``, the rest on ``cpu``) and
waits for it.

Data moves through DVC, never by hand: the worker's checkout (a clone of the project) goes to the flow's
git revision, takes the flow's ``dvc.lock``, ``dvc pull``s the outputs of the stages upstream from the DVC
remote, runs ``dvc repro --single-item <stage>`` (the same task as a local run), ``dvc push``es the stage's
outputs and hands back its ``dvc.lock`` entry as the flow run's persisted result. The pipeline flow writes
that entry into its own ``dvc.lock`` and pulls the outputs, so its checkout records exactly what ran where.
The ``cache: false`` files (metrics and small reports, which git carries, not the DVC remote) travel with
the request and the result.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil
import yaml
from prefect import flow, get_run_logger

from flows.pools import PoolLimits, check_live_worker, wait_for_stage
from flows.stages import DVC, checkout_lock, run_stage, stage_graph, stop_tree
from rlhf.files import atomic_write_text
from tasks.kit.dvclock import repair_dvc_rwlock
from tasks.kit.params import load_yaml

LOCK = "dvc.lock"
DEFAULT_POOL = "cpu"


def stage_pool(stage: str, params: dict[str, Any]) -> str:
    """The work pool of ``stage``: ``orchestration.work_pools.<stage>``, else ``.default``, else ``cpu``."""
    pools = (params.get("orchestration") or {}).get("work_pools") or {}
    return str(pools.get(stage, pools.get("default", DEFAULT_POOL)))


def _run(*command: str) -> str:
    """Run a command in the current folder; its stdout. Raises RuntimeError with the output's tail on failure."""
    result = subprocess.run(list(command), capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"`{' '.join(command[:4])}` failed (exit {result.returncode}): " + " | ".join(tail))
    return result.stdout


def _dvc(*args: str) -> str:
    repair_dvc_rwlock()
    return _run(*DVC, *args)


def read_lock() -> dict[str, Any]:
    """``dvc.lock`` of the current folder (an empty lock when there is none)."""
    if not os.path.exists(LOCK):
        return {"schema": "2.0", "stages": {}}
    return load_yaml(LOCK, written_by_dvc=True) or {"schema": "2.0", "stages": {}}


def write_lock(lock: dict[str, Any]) -> None:
    """Replace ``dvc.lock`` atomically."""
    tmp = f"{LOCK}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        yaml.safe_dump(lock, handle, sort_keys=False)
    os.replace(tmp, LOCK)


def uncached_outs(stages: list[str] | None = None) -> list[str]:
    """The ``cache: false`` outputs (metrics and reports files) of ``stages`` (all by default) in dvc.yaml.

    DVC does not push them (git carries them), so they travel with a stage's request and its result.
    """
    spec = load_yaml("dvc.yaml")["stages"]
    paths = []
    for name in stages if stages is not None else list(spec):
        for key in ("outs", "metrics", "plots"):
            for entry in spec[name].get(key) or []:
                if isinstance(entry, dict):
                    ((path, options),) = entry.items()
                    if (options or {}).get("cache") is False:
                        paths.append(path)
    return paths


def read_files(paths: list[str]) -> dict[str, str]:
    """``{path: text}`` of those that exist."""
    files = {}
    for path in paths:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                files[path] = handle.read()
    return files


def write_files(files: dict[str, str]) -> None:
    """Write each ``{path: text}`` atomically (a folder is made where needed)."""
    for path, text in files.items():
        atomic_write_text(path, text)


def clean_revision() -> str:
    """The commit checked out here. Raises RuntimeError when tracked files differ from it: a worker starts
    from the commit, so uncommitted params or code would not be what it runs."""
    dirty = _run("git", "status", "--porcelain", "--untracked-files=no").splitlines()  # "XY path"; X may be " "
    changed = [line[3:] for line in dirty if line.strip() and line[3:] != LOCK]  # dvc.lock travels with the request
    if changed:
        raise RuntimeError(f"commit first: a stage on a work pool runs the committed tree, and {changed[0]} differs")
    return _run("git", "rev-parse", "HEAD").strip()


def stop_with_worker(interval_s: float = 1.0) -> None:
    """Stop this process, and the stage it runs, as soon as the worker that started it is gone.

    A worker runs each flow run as a child process; killed (SIGKILL: no chance to clean up), it left that child
    running, which finished the stage and wrote its outputs into the checkout after the pipeline had failed. A
    daemon thread watches the parent: once this process is re-parented, it stops every process under this one
    (:func:`flows.stages.stop_tree`: the stage stops without putting outputs in place) and then this one.
    """
    worker = os.getppid()

    def watch() -> None:
        while os.getppid() == worker:
            time.sleep(interval_s)
        for child in psutil.Process().children():
            stop_tree(child.pid)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="stop-with-worker", daemon=True).start()


@flow(name="run-stage", persist_result=True, log_prints=True)
def run_stage_flow(
    stage: str, pipeline_run_id: str, revision: str, lock: dict[str, Any], files: dict[str, str]
) -> dict[str, Any]:
    """One stage on this worker's checkout: revision, lock and the ``cache: false`` files from the pipeline
    flow, the cached inputs from the DVC remote.

    Returns:
        ``{"entry": its dvc.lock entry, "files": its cache: false outputs}`` (the flow run's persisted result).

    Raises:
        RuntimeError: git, ``dvc pull``/``push`` or the stage failed (the output's tail in the message).
    """
    logger = get_run_logger()
    stop_with_worker()
    with checkout_lock():
        if _run("git", "rev-parse", "HEAD").strip() != revision:
            _run("git", "fetch", "--quiet", "origin")
            _run("git", "checkout", "--quiet", "--detach", revision)
        write_lock(lock)
        write_files(files)
        upstream = sorted(stage_graph().predecessors(stage))
        if upstream:
            _dvc("pull", "--quiet", *upstream)  # what this stage reads, as the lock records it
        run_stage.fn(stage, pipeline_run_id)
        _dvc("push", "--quiet", stage)
        result = {"entry": read_lock()["stages"].get(stage), "files": read_files(uncached_outs([stage]))}
    logger.info("stage %s done on %s, outputs pushed", stage, os.uname().nodename)
    return result


def run_on_pool(stage: str, pool: str, pipeline_run_id: str, revision: str, limits: PoolLimits) -> None:
    """Run ``stage`` as a ``run-stage-<pool>`` flow run and wait; then record its lock entry and pull its outputs.

    Nothing is submitted to a paused pool or one without a live worker; a run no worker starts within
    ``limits.start_timeout_s`` is cancelled; a running one whose pool goes silent for ``limits.lost_worker_s``
    is marked Crashed (:mod:`flows.pools`).

    Raises:
        PoolWaitError: no live worker, not started in time, or its worker lost (one line naming stage and pool).
        RuntimeError: the flow run did not complete (its state and message), or returned no lock entry.
    """
    from prefect.client.orchestration import get_client  # noqa: PLC0415 (Prefect's client: rlhf-deploy --help starts without it)
    from prefect.deployments import run_deployment  # noqa: PLC0415 (Prefect's client: rlhf-deploy --help starts without it)

    with get_client(sync_client=True) as client:
        check_live_worker(client, stage, pool, limits)
        submitted = run_deployment(
            f"run-stage/run-stage-{pool}",
            parameters={
                "stage": stage,
                "pipeline_run_id": pipeline_run_id,
                "revision": revision,
                "lock": read_lock(),
                "files": read_files(uncached_outs()),
            },
            timeout=0,  # wait_for_stage waits, with the limits
        )
        run = wait_for_stage(client, submitted.id, stage, pool, limits)
    if not run.state.is_completed():
        raise RuntimeError(f"stage {stage} on work pool {pool}: {run.state.type.value} ({run.state.message})")
    result = run.state.result()
    if not result.get("entry"):
        raise RuntimeError(f"stage {stage} on work pool {pool} handed back no dvc.lock entry")
    with checkout_lock():
        write_files(result["files"])
        lock = read_lock()
        lock.setdefault("stages", {})[stage] = result["entry"]
        write_lock(lock)
        _dvc("pull", "--quiet", stage)


PREFECT_FILE = os.path.join("infra", "prefect.yaml")


def project_folder(start: str) -> str:
    """The nearest folder from ``start`` upward that holds ``dvc.yaml`` and ``infra/prefect.yaml``.

    Raises:
        FileNotFoundError: none does (one line naming ``start``).
    """
    folder = os.path.abspath(start)
    while True:
        if os.path.isfile(os.path.join(folder, "dvc.yaml")) and os.path.isfile(os.path.join(folder, PREFECT_FILE)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            raise FileNotFoundError(
                f"rlhf-deploy: no project (dvc.yaml and {PREFECT_FILE}) at or above {os.path.abspath(start)}: "
                "run it in a checkout of the project"
            )
        folder = parent


def deploy() -> None:
    """``rlhf-deploy``: ``prefect deploy --all --prefect-file infra/prefect.yaml`` from the project's root, found
    from the current folder upward (the entrypoints in prefect.yaml are paths from the root, so Prefect itself
    fails with a traceback anywhere else). Outside a project: one line and exit 1; else Prefect's exit status.
    Other arguments go to ``prefect deploy``; ``--help`` says so and exits 0."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(
            "Usage: rlhf-deploy [PREFECT DEPLOY OPTIONS]\n\n"
            f"Deploy every deployment of {PREFECT_FILE} (prefect deploy --all) from the project root, found from "
            "the current folder upward; other options go to `prefect deploy` (see `prefect deploy --help`)."
        )
        raise SystemExit(0)
    try:
        root = project_folder(os.getcwd())
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        raise SystemExit(1) from None
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    command = [prefect, "--no-prompt", "deploy", "--all", "--prefect-file", PREFECT_FILE, *sys.argv[1:]]
    done = subprocess.run(command, cwd=root, stderr=subprocess.PIPE, text=True)
    boxed = boxed_error(done.stderr) if done.returncode else None
    if boxed:  # Prefect's CLI frames a usage error in a box: one line, as every command of ours says it
        print(f"rlhf-deploy: {boxed} (see rlhf-deploy --help)", file=sys.stderr)
    else:
        sys.stderr.write(done.stderr)
    raise SystemExit(done.returncode)


def boxed_error(text: str) -> str | None:
    """The message of the framed ``Error`` box Prefect's CLI prints for a usage error (``╭─ Error ─╮``, lines
    ``│ ... │``, ``╰─╯``) as one line, or None when ``text`` holds no such box (then it is shown as it is)."""
    lines = text.strip().splitlines()
    if not lines or not lines[0].startswith("╭─ Error"):
        return None
    inner = [line.strip().strip("│").strip() for line in lines[1:] if line.strip().startswith("│")]
    return " ".join(part for part in inner if part) or None
