"""MLflow runs of the stages: one run per stage under one parent per pipeline run, ended as the stage ended."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from filelock import FileLock

from tasks.kit import paths
from tasks.kit.mlflow_params import mlflow_params, mlflow_text
from tasks.kit.params import DEFAULT_PROFILE, PARAMS_FILE, read_params, stage_params

PIPELINE_RUN_TAG = "rlhf.pipeline_run_id"
VERDICT_TAG = "rlhf.verdict"  # the parent run's: Completed | Gate failed (flows.summary.verdict)
VERDICT_SENTENCE_TAG = "rlhf.verdict.sentence"  # the parent run's: the verdict's sentence, the console's last line
SOURCE_TAGS = {"mlflow.source.name": "dvc.yaml", "mlflow.source.type": "PROJECT"}  # the parent run's Source column
PARENT_SETTLE_S = 1.0  # how long a new parent run waits before it looks for an older one (StageRun._adopt_parent)


def pipeline_run_id(params_path: str = PARAMS_FILE) -> str:
    """The id that groups the stage runs of one pipeline run.

    Set by the Prefect flow (``RLHF_PIPELINE_RUN_ID``); under plain ``dvc repro``
    derived from the git commit and the params file's content.
    """
    if os.environ.get("RLHF_PIPELINE_RUN_ID"):
        return os.environ["RLHF_PIPELINE_RUN_ID"]
    with open(params_path, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:12]
    return f"repro-{git_commit()[:12]}-{digest}"


def git_commit() -> str:
    """The commit checked out in the current folder (``no-git`` outside a repository)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "no-git"


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else params.yaml's ``mlflow.tracking_uri``, with a relative local path made
    absolute against :func:`tasks.kit.paths.project_root`: every stage, experiment and command of one project
    reaches the same store whatever folder it runs in."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or read_params().get("mlflow", {}).get("tracking_uri", "")
    uri = uri or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.join(paths.project_root(), uri[len("sqlite:///") :])
    if "://" not in uri and not os.path.isabs(uri):  # a folder: MLflow's file store
        return os.path.join(paths.project_root(), uri)
    return uri


SERVER_PATIENCE = {
    # MLflow's defaults (7 retries, backoff factor 2) spent 272 s on a tracking server that had died: with these
    # a stage fails within seconds of it (a refused or reset connection), retried twice, 1 then 2 s apart; the
    # timeout (MLflow's 120 s between bytes) stays, so a healthy slow download or upload is never cut
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def tracking_client():
    """``(MlflowClient, experiment id)`` of :func:`tracking_uri` and params.yaml's ``mlflow.experiment``.

    A new experiment keeps its artifacts at params.yaml's ``mlflow.artifact_location`` (e.g. ``s3://bucket/mlflow``,
    written by the client itself with the credentials of its environment); without one, a local store's in
    ``<project root>/mlruns`` (never the folder the command happens to run in) and a tracking server's where the
    server puts them (``--artifacts-destination``, proxied). An existing experiment keeps its location.
    """
    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    for name, value in SERVER_PATIENCE.items():  # the environment's own settings win
        os.environ.setdefault(name, value)
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    settings = read_params().get("mlflow", {})
    name = settings.get("experiment", "rlhf")
    location = settings.get("artifact_location")
    if not location and uri.startswith(("sqlite:", "/")):
        location = f"file://{os.path.join(paths.project_root(), 'mlruns')}"
    with store_setup_lock(uri):  # a new SQLite file: one process creates its tables, the others wait
        client = mlflow.MlflowClient()
        if location and client.get_experiment_by_name(name) is None:
            create_if_missing(
                lambda: client.create_experiment(name, artifact_location=location),
                lambda: client.get_experiment_by_name(name),
            )
        get_or_create = partial(mlflow.set_experiment, name)  # a second call finds what another process made
        experiment = create_if_missing(get_or_create, get_or_create)
    if EXPERIMENT_KIND_TAG not in experiment.tags:  # else MLflow's UI opens it on the GenAI traces page
        set_tag_once(client, experiment.experiment_id, EXPERIMENT_KIND_TAG, "custom_model_development")
    return client, experiment.experiment_id


def set_tag_once(client, experiment_id: str, key: str, value: str) -> None:
    """Set an experiment tag that processes starting together may all set: a store refuses the second insert of
    a key (SQLite's unique constraint), which is success when the key is there now.

    Raises:
        MlflowException: the store refused and the key is not set.
    """
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        client.set_experiment_tag(experiment_id, key, value)
    except MlflowException:
        if key not in client.get_experiment(experiment_id).tags:
            raise


EXPERIMENT_KIND_TAG = (
    "mlflow.experimentKind"  # model training (runs and models), not GenAI (traces); a person's own stays
)


def pipeline_params() -> dict[str, str]:
    """Every section of params.yaml as this run reads it (the preset and profile applied), as MLflow params of the
    pipeline's parent run (``ppo.clip``, ``data.more_sources.0.name``, ...; each stage's run holds its own too).
    A params file whose profile no section defines (a stage's own params do not need one) is logged as written."""
    params = read_params()
    try:
        sections = {name: stage_params(name, params) for name, value in params.items() if isinstance(value, dict)}
    except ValueError:
        sections = {name: value for name, value in params.items() if name != "profile"}
    return mlflow_params({"profile": params.get("profile", DEFAULT_PROFILE), **sections})


@contextlib.contextmanager
def store_setup_lock(uri: str) -> Iterator[None]:
    """Hold ``<file>.lock`` while a process opens a SQLite tracking store (nothing for a server).

    MLflow creates a new store's tables (and migrates an old one) when a process first opens it, without a
    lock of its own: two stages starting together on a new file both ran the migration, and the file was
    broken for good (``table _alembic_tmp_metrics already exists``). A server sets its database up once.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return

    path = uri[len("sqlite:///") :]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with FileLock(f"{path}.lock"):
        yield


def create_if_missing(create: Callable[[], Any], read: Callable[[], Any]) -> Any:
    """``create()``, or ``read()`` when MLflow says the object already exists: another process created it between
    our look and our create (two stages starting together, a server with several workers), which is success.

    Raises:
        MlflowException: any other refusal (:func:`tasks.kit.common.cli` prints its first line).
    """
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        return create()
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return read()


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) raised as an exception inside a stage (:class:`StageRun`).

    The stage unwinds as from any error: its staged outputs are dropped
    (:class:`StagedOutputs`), its MLflow run and the pipeline's end KILLED, and
    :func:`cli` exits with 128 + the signal's number, as a shell reports it.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """Hold the stop signals back while the block runs (renames that must not be cut in half).

    A stop signal that arrives meanwhile is raised again when the block ends,
    so the handler in place before it acts then (a stage's raises
    :class:`Stopped`; the default ends the process). Only the main thread can
    hold signals; elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if caught:
            signal.raise_signal(caught[0])


PID_TAG, HOST_TAG, BOOT_TAG, START_TAG = "rlhf.pid", "rlhf.host", "rlhf.boot_id", "rlhf.pid_start"


def _boot_id() -> str:
    """This machine's boot id (Linux), "" where there is none: it changes at every reboot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def process_state(pid: int) -> tuple[str, str] | None:
    """``(state letter, start time in clock ticks after boot)`` of process ``pid``; None when there is none.

    Read from ``/proc/<pid>/stat`` (fields 3 and 22); without ``/proc``, ``("?", "")`` when ``kill(pid, 0)`` finds it.
    """
    if os.path.exists("/proc/self/stat"):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            return fields[0], fields[19]
        except (FileNotFoundError, ProcessLookupError):
            return None
        except (OSError, IndexError):
            pass  # /proc unreadable or malformed: ask the kernel below instead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # the process exists but belongs to another user: alive
    return "?", ""


def owner_tags() -> dict[str, str]:
    """Run tags naming the process that owns a run: its pid and start time, the host and its boot id."""
    process = process_state(os.getpid())
    return {
        PID_TAG: str(os.getpid()),
        HOST_TAG: socket.gethostname(),
        BOOT_TAG: _boot_id(),
        START_TAG: process[1] if process else "",
    }


def owner_gone(tags: dict[str, str]) -> bool:
    """True only when the process that :func:`owner_tags` named is surely gone.

    On this host it is gone when the machine has rebooted since (another boot
    id), no process has its pid, that process has exited (a zombie), or the pid
    now names a process that started at another time (the pid was reused). A run
    of another host, or one without these tags, is never called gone: nothing
    here can tell whether its process still runs.
    """
    pid = tags.get(PID_TAG, "")
    if not pid.isdigit() or tags.get(HOST_TAG) != socket.gethostname():
        return False
    boot = _boot_id()
    if tags.get(BOOT_TAG) and boot and tags[BOOT_TAG] != boot:
        return True
    process = process_state(int(pid))
    if process is None or process[0] in ("Z", "X"):
        return True
    return bool(tags.get(START_TAG) and process[1] and tags[START_TAG] != process[1])


def _running_children(client, experiment_id: str, parent_id: str) -> list:
    """The RUNNING stage runs of parent run ``parent_id``."""
    return client.search_runs(
        [experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}' and attributes.status = 'RUNNING'",
        max_results=1000,
    )


def close_stale_runs(client, experiment_id: str, say=print) -> list[str]:
    """Close as KILLED the stage runs left RUNNING by a process that is gone (SIGKILL, a crash, a reboot).

    Only runs whose owner tags say so (:func:`owner_gone`); a run whose process
    may still be alive, here or on another host, is left alone. The parent
    pipeline run of a closed run is closed as KILLED too unless another of its
    stages still runs (a stage that continues that pipeline reopens it).

    Args:
        client: an ``mlflow.MlflowClient``.
        experiment_id: the experiment to look in.
        say: prints one line per closed stage run.

    Returns:
        The ids of the runs closed, parents included.
    """
    running = client.search_runs(
        [experiment_id],
        filter_string="attributes.status = 'RUNNING' and tags.`rlhf.kind` = 'stage'",
        max_results=1000,
    )
    stale = [run for run in running if owner_gone(run.data.tags)]
    closed = []
    for run in stale:
        client.set_terminated(run.info.run_id, "KILLED")
        closed.append(run.info.run_id)
        tags = run.data.tags
        say(
            f"MLflow run {run.info.run_id} ({tags.get('rlhf.stage', '?')}, pid {tags[PID_TAG]} on {tags[HOST_TAG]}) "
            "was left RUNNING by a process that is gone: closed as KILLED"
        )
    for parent_id in sorted({run.data.tags.get("mlflow.parentRunId") for run in stale} - {None}):
        still_running = _running_children(client, experiment_id, parent_id)
        if client.get_run(parent_id).info.status == "RUNNING" and not still_running:
            client.set_terminated(parent_id, "KILLED")
            closed.append(parent_id)
    return closed


class StageRun:
    """One MLflow run for one stage, nested under the pipeline run's parent run.

    Use as a context manager; ``log`` is the ``log(metrics, step)`` callback the
    trainers take. The stage's wall time is printed and logged as ``stage/seconds``.

    How runs end. The stage run ends FINISHED, FAILED (an exception) or KILLED
    (SIGTERM, SIGINT or SIGHUP, which raise :class:`Stopped` inside the stage,
    so it unwinds like from an error). The parent pipeline run is RUNNING while
    one of its stages runs and takes the status of the stage that ends (a
    FINISHED stage ends it only when none of its other stages still runs): the
    stage that ends a pipeline, evaluate or the one that failed, leaves its
    final status; the Prefect flow has the last word (:meth:`end_pipeline`).
    The stage run's tags name the process that owns it (:func:`owner_tags`);
    a run left RUNNING by a process that is gone (SIGKILL) is closed as KILLED
    when the next stage run starts on that host (:func:`close_stale_runs`).
    """

    def __init__(self, stage: str, params: dict[str, Any]):
        self.stage = stage
        self.params = params
        self.start = 0.0
        self._end: float | None = None
        self._handlers: dict[int, Any] = {}
        self._ending = False
        self._late: list[int] = []
        self.parent_id: str | None = None
        self.experiment_id: str | None = None

    @property
    def seconds(self) -> float:
        """Wall time of the stage so far; fixed when the stage ends."""
        if not self.start:
            return 0.0
        return (self._end if self._end is not None else time.perf_counter()) - self.start

    @staticmethod
    def _client():
        """``(MlflowClient, experiment id)`` for :func:`tracking_uri` and the experiment of params.yaml."""
        return tracking_client()

    @staticmethod
    def _find_parent(client, experiment_id: str, pipeline_run: str):
        """The parent run of ``pipeline_run``: the oldest, should two stages have created one at once."""
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run}' and tags.`rlhf.kind` = 'pipeline'",
            order_by=["attributes.start_time ASC"],
            max_results=10,
        )
        return min(found, key=lambda run: (run.info.start_time, run.info.run_id)) if found else None

    @staticmethod
    def end_pipeline(pipeline_run: str, status: str, tags: dict[str, str] | None = None) -> None:
        """End the parent run of pipeline run ``pipeline_run`` with ``status`` (FINISHED, FAILED or KILLED), its
        ``tags`` set first (the verdict, :data:`VERDICT_TAG`, a column of MLflow's runs page).

        For the Prefect flow, which knows how a whole flow run ended (a failure
        between stages, a cancelled flow); nothing when the pipeline has no run.
        """
        client, experiment_id = StageRun._client()
        parent = StageRun._find_parent(client, experiment_id, pipeline_run)
        if parent is not None:
            for key, value in (tags or {}).items():
                client.set_tag(parent.info.run_id, key, mlflow_text(value))
            client.set_terminated(parent.info.run_id, status)

    def _on_stop(self, signum: int, frame) -> None:
        if self._ending:  # the stage's fate is decided: note it and let the run end as it is
            self._late.append(signum)
            return
        raise Stopped(signum)

    def _adopt_parent(self, client, pipeline_run: str) -> str:
        """The id of ``pipeline_run``'s parent run, created when there is none (and reopened when it ended)."""
        parent = self._find_parent(client, self.experiment_id, pipeline_run)
        if parent is None:
            from mlflow.entities import Param  # noqa: PLC0415 (MLflow: seconds to import)

            tags = {PIPELINE_RUN_TAG: pipeline_run, "rlhf.kind": "pipeline", **SOURCE_TAGS}
            tags["mlflow.source.git.commit"] = git_commit()  # the UI's Version column, as a stage run's own
            profile = read_params().get("profile", DEFAULT_PROFILE)
            run_name = f"{profile} pipeline {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC"
            created = client.create_run(self.experiment_id, tags=tags, run_name=run_name)
            # two stages of one pipeline run may start together: the oldest parent is the one, ours goes. Looked
            # for a second later, when the other's create (a server's other worker) is visible to both of us: looked
            # for at once, each saw only its own and both kept it (one in ~10 rounds on two server workers)
            time.sleep(PARENT_SETTLE_S)
            parent = self._find_parent(client, self.experiment_id, pipeline_run)
            if parent.info.run_id != created.info.run_id:
                client.delete_run(created.info.run_id)
            else:
                params = [Param(key, value) for key, value in pipeline_params().items()]
                client.log_batch(created.info.run_id, params=params)
        elif parent.info.status != "RUNNING":  # a later stage of the same pipeline run continues it
            client.update_run(parent.info.run_id, status="RUNNING")
        return parent.info.run_id

    def _start_under_parent(self, client, pipeline_run: str, attempts: int = 5):
        """Start this stage's run nested under the pipeline's parent run.

        A stage starting together with others may adopt a parent that its creator deletes a moment later, having
        seen an older one (:meth:`_adopt_parent`): MLflow then refuses to start under it, and the stage adopts
        again; a run already started under it moves to the oldest parent (its ``mlflow.parentRunId`` tag).
        """
        import mlflow  # noqa: PLC0415 (MLflow: seconds to import)
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

        tags = {PIPELINE_RUN_TAG: pipeline_run, "rlhf.kind": "stage", "rlhf.stage": self.stage, **owner_tags()}
        for attempt in range(attempts):
            self.parent_id = self._adopt_parent(client, pipeline_run)
            try:
                run = mlflow.start_run(run_name=self.stage, nested=True, parent_run_id=self.parent_id, tags=tags)
                break
            except MlflowException:
                deleted = client.get_run(self.parent_id).info.lifecycle_stage == "deleted"
                if not deleted or attempt == attempts - 1:
                    raise
        oldest = self._find_parent(client, self.experiment_id, pipeline_run)
        if oldest is not None and oldest.info.run_id != self.parent_id:
            self.parent_id = oldest.info.run_id
            client.set_tag(run.info.run_id, "mlflow.parentRunId", self.parent_id)
        return run

    def __enter__(self) -> StageRun:
        import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

        if threading.current_thread() is threading.main_thread():
            self._handlers = {sig: signal.signal(sig, self._on_stop) for sig in STOP_SIGNALS}
        try:
            client, self.experiment_id = self._client()
            close_stale_runs(client, self.experiment_id, say=lambda line: print(f"[{self.stage}] {line}", flush=True))
            run_id = pipeline_run_id()
            self.run = self._start_under_parent(client, run_id)
            mlflow.log_params(mlflow_params(self.params, reserved=("profile",)))
            mlflow.log_param("profile", mlflow_text(read_params().get("profile", "demo")))
        except BaseException as err:
            self.__exit__(type(err), err, err.__traceback__)
            raise
        self.start = time.perf_counter()
        print(f"[{self.stage}] started (MLflow run {self.run.info.run_id}, pipeline {run_id})", flush=True)
        return self

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics at ``step``; NaN and infinities stay visible.

        MLflow stores NaN as NaN, but an infinity as +-1.8e308 (SQL has no
        infinity), which would read as a finite number: so an infinity is logged
        as NaN, and every non-finite value also sets the run tag
        ``rlhf.non_finite.<metric>`` to what it was, e.g. ``inf at step 3``.

        A stop signal that arrives during the write is delivered right after it
        (:func:`held_stop_signals`): raised inside the tracking store's database call it would
        cut the query, and SQLAlchemy logs a traceback of its own.
        """
        with held_stop_signals():
            self._log(metrics, step)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

        values = {key: float(value) for key, value in metrics.items()}
        mlflow.log_metrics({k: v if math.isfinite(v) else math.nan for k, v in values.items()}, step=step)
        odd = {f"rlhf.non_finite.{k}": f"{v} at step {step}" for k, v in values.items() if not math.isfinite(v)}
        if odd:
            mlflow.set_tags(odd)

    def __exit__(self, exc_type, exc, tb) -> None:
        import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

        self._ending = True
        if self._end is None and self.start:
            self._end = time.perf_counter()
        if exc_type is None:
            status = "FINISHED"
        else:
            status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        try:
            if mlflow.active_run() is not None:
                if exc_type is None:
                    mlflow.log_metric("stage/seconds", self.seconds)
                mlflow.end_run(status=status)
            if self.parent_id is not None:
                client = mlflow.MlflowClient()
                if status != "FINISHED" or not _running_children(client, self.experiment_id, self.parent_id):
                    client.set_terminated(self.parent_id, status)
        except Exception as err:
            if exc_type is None:
                raise
            print(f"[{self.stage}] could not record the end of the run in MLflow: {err}", file=sys.stderr)
        finally:
            for sig, handler in self._handlers.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            self._handlers = {}
        if self._late and exc_type is None:
            names = ", ".join(signal.Signals(s).name for s in self._late)
            print(f"[{self.stage}] {names} came as the stage finished: its outputs are complete and kept", flush=True)
        word = {"FINISHED": "finished", "FAILED": "FAILED", "KILLED": "KILLED"}[status]
        print(f"[{self.stage}] {word} in {self.seconds:.1f} s", flush=True)
