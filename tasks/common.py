"""What every stage shares: params with profile and preset overrides, MLflow runs, atomic outputs, timing."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import yaml

PARAMS_FILE = "params.yaml"
PIPELINE_RUN_TAG = "rlhf.pipeline_run_id"


def read_params(path: str = PARAMS_FILE) -> dict[str, Any]:
    """Read params.yaml.

    Raises:
        FileNotFoundError: no params file.
    """
    with open(path, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def stage_params(section: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The params of one section with its preset (if any) and then the active profile's overrides applied.

    A section may hold ``preset`` + ``presets: {name: overrides}`` and
    ``profiles: {name: overrides}``; both keys are removed from the result.

    Raises:
        ValueError: the section, preset or profile does not exist.
    """
    params = params or read_params()
    if section not in params:
        raise ValueError(f"{PARAMS_FILE}: no section {section!r}")
    values = copy.deepcopy(params[section])
    presets = values.pop("presets", {})
    preset = values.pop("preset", None)
    if preset is not None:
        if preset not in presets:
            raise ValueError(f"{PARAMS_FILE}: {section}.preset is {preset!r}; known presets: {sorted(presets)}")
        values.update(presets[preset])
    profiles = values.pop("profiles", {})
    profile = params.get("profile", "demo")
    values.update((profiles or {}).get(profile, {}))
    return values


def pipeline_run_id(params_path: str = PARAMS_FILE) -> str:
    """The id that groups the stage runs of one pipeline run.

    Set by the Prefect flow (``RLHF_PIPELINE_RUN_ID``); under plain ``dvc repro``
    derived from the git commit and the params file's content.
    """
    if os.environ.get("RLHF_PIPELINE_RUN_ID"):
        return os.environ["RLHF_PIPELINE_RUN_ID"]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "no-git"
    with open(params_path, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:12]
    return f"repro-{commit[:12]}-{digest}"


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` in one rename.

    On an exception the temporary folder is removed and ``path`` is left as it was.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.tmp-")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the output folder gets the usual mode
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.old-")
        os.replace(path, os.path.join(old, "x"))
    os.replace(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_root(stage: str) -> str:
    """Where a stage keeps its resume checkpoints: outside every DVC out, so a rerun does not delete them."""
    return os.path.join("checkpoints", stage)


def setup_torch(seed: int) -> None:
    """Seed torch and use every core."""
    torch.manual_seed(seed)
    torch.set_num_threads(max(os.cpu_count() or 1, 1))


class StageRun:
    """One MLflow run for one stage, nested under the pipeline run's parent run.

    Use as a context manager; ``log`` is the ``log(metrics, step)`` callback the
    trainers take. The stage's wall time is printed and logged as ``stage/seconds``.
    """

    def __init__(self, stage: str, params: dict[str, Any]):
        self.stage = stage
        self.params = params
        self.start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> StageRun:
        import mlflow

        settings = read_params().get("mlflow", {})
        mlflow.set_tracking_uri(
            os.environ.get("MLFLOW_TRACKING_URI", settings.get("tracking_uri", "sqlite:///mlflow.db"))
        )
        mlflow.set_experiment(settings.get("experiment", "rlhf"))
        run_id = pipeline_run_id()
        found = mlflow.search_runs(
            filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{run_id}' and tags.`rlhf.kind` = 'pipeline'",
            output_format="list",
            max_results=1,
        )
        parent = (
            found[0].info.run_id
            if found
            else mlflow.start_run(
                run_name=f"pipeline {run_id}", tags={PIPELINE_RUN_TAG: run_id, "rlhf.kind": "pipeline"}
            ).info.run_id
        )
        if not found:
            mlflow.end_run()
        self.run = mlflow.start_run(
            run_name=self.stage,
            nested=True,
            parent_run_id=parent,
            tags={PIPELINE_RUN_TAG: run_id, "rlhf.kind": "stage", "rlhf.stage": self.stage},
        )
        mlflow.log_params({k: str(v)[:500] for k, v in _flatten(self.params).items()})
        mlflow.log_param("profile", read_params().get("profile", "demo"))
        self.start = time.perf_counter()
        print(f"[{self.stage}] started (MLflow run {self.run.info.run_id}, pipeline {run_id})", flush=True)
        return self

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log finite float metrics at ``step`` (NaN and inf are dropped: MLflow rejects them)."""
        import mlflow

        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}, step=step)

    def __exit__(self, exc_type, exc, tb) -> None:
        import mlflow

        self.seconds = time.perf_counter() - self.start
        if exc_type is None:
            mlflow.log_metric("stage/seconds", self.seconds)
        mlflow.end_run(status="FINISHED" if exc_type is None else "FAILED")
        print(f"[{self.stage}] {'finished' if exc_type is None else 'FAILED'} in {self.seconds:.1f} s", flush=True)


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def write_metrics(path: str, metrics: dict[str, Any]) -> None:
    """Write a DVC metrics file (JSON, atomically); non-finite floats become null."""
    from rlhf.training import write_json

    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    write_json(path, clean)


def load_json(path: str) -> dict[str, Any]:
    """Read a JSON file."""
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def run_checkpointer(stage: str, params: dict[str, Any], inputs: list[str]):
    """A :class:`rlhf.training.Checkpointer` for this stage, params and inputs.

    The folder name carries a fingerprint of the stage's params and of its
    input files (content of data files, name and size of model files), so a
    rerun with other params or inputs never resumes a stale run.
    """
    from rlhf.training import Checkpointer

    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for path in inputs:
        files = (
            [os.path.join(root, f) for root, _, names in os.walk(path) for f in sorted(names)]
            if os.path.isdir(path)
            else [path]
        )
        for file in sorted(files):
            digest.update(file.encode())
            if file.endswith((".jsonl", ".json")):
                with open(file, "rb") as handle:
                    digest.update(handle.read())
            else:
                digest.update(str(os.path.getsize(file)).encode())
    return Checkpointer(os.path.join(checkpoint_root(stage), digest.hexdigest()[:16]))


def cli(main) -> None:
    """Run a stage's ``main``; bad input ends with one line on stderr and exit code 1, not a traceback.

    ``ValueError``, ``FileNotFoundError`` and ``KeyError`` from the stage are bad
    input or configuration (their messages name the file, row, param and rule);
    anything else is a bug and keeps its traceback.
    """
    import sys

    try:
        main()
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(1) from None
