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
    A key that a preset sets lives only in ``presets``: the same key at the
    section's top level would read as the value in effect and silently not be
    (a profile may still override it: profiles are applied last, by design).

    Raises:
        ValueError: the section, preset or profile does not exist, or a key of a
            preset also stands at the section's top level (names both places).
    """
    params = params or read_params()
    if section not in params:
        raise ValueError(f"{PARAMS_FILE}: no section {section!r}")
    values = copy.deepcopy(params[section])
    presets = values.pop("presets", {}) or {}
    preset = values.pop("preset", None)
    for name, overrides in presets.items():
        clash = sorted(set(overrides or {}) & set(values) - {"profiles"})
        if clash:
            raise ValueError(
                f"{PARAMS_FILE}: {section}.{clash[0]} is set both at the top of section {section!r} and in "
                f"{section}.presets.{name}; a preset's keys live only in the preset (edit it there, or drop it "
                f"from every preset to set it at the top)"
            )
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


MANIFEST = "manifest.json"  # beside a stage's checkpoints: what its fingerprint was made of


def file_sha256(path: str) -> str:
    """Hex sha256 of a file's content, streamed (``hashlib.file_digest``, ~1 GB/s; a 540 MB model in ~0.5 s)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def input_hashes(path: str) -> dict[str, str]:
    """Content hashes of one stage input: ``{relative file name: sha256}`` for a folder, ``{"": sha256}`` for a file.

    Every file under a folder is read in full (never just its size: models of
    one architecture all have the same file sizes).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    if os.path.isfile(path):
        return {"": file_sha256(path)}
    if not os.path.isdir(path):
        raise FileNotFoundError(f"stage input {path} does not exist")
    files = sorted(
        os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path) for name in names
    )
    return {name: file_sha256(os.path.join(path, name)) for name in files}


def fingerprint_manifest(params: dict[str, Any], inputs: list[str]) -> dict[str, Any]:
    """What a stage's resume fingerprint is made of: its params and the content of its current input files.

    Args:
        params: the stage's params (after preset and profile).
        inputs: files and folders the stage reads (data splits, model folders).

    Returns:
        ``{"fingerprint": 16 hex, "params_sha256", "params" (JSON-normalised),
        "inputs": {path: {"sha256": of the input, "files": {name: sha256}}}}``.
        The fingerprint is the sha256 of the params hash and the per-input hashes.

    Raises:
        FileNotFoundError: an input does not exist.
    """
    params_json = json.dumps(params, sort_keys=True, default=str)
    hashes = {}
    for path in inputs:
        files = input_hashes(path)
        whole = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        hashes[path] = {"sha256": whole, "files": files}
    params_sha = hashlib.sha256(params_json.encode()).hexdigest()
    summary = json.dumps({"params": params_sha, "inputs": {p: h["sha256"] for p, h in hashes.items()}}, sort_keys=True)
    return {
        "fingerprint": hashlib.sha256(summary.encode()).hexdigest()[:16],
        "params_sha256": params_sha,
        "params": json.loads(params_json),
        "inputs": hashes,
    }


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 30 else text[:27] + "..."


def stale_changes(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """What differs between a stale checkpoint's manifest and the current one, one phrase per change.

    Args:
        old: the stale folder's manifest (None: it has none, written before manifests existed).
        new: :func:`fingerprint_manifest` of the current run.

    Returns:
        e.g. ``["input models/reward (model.safetensors)", "param lr (1e-05 -> 2e-05)"]``.
    """
    if old is None:
        return ["no readable manifest (e.g. written by an older version that fingerprinted model files by size)"]
    changes = []
    old_inputs, new_inputs = old.get("inputs", {}), new["inputs"]
    for path in sorted(set(old_inputs) | set(new_inputs)):
        if path not in old_inputs:
            changes.append(f"input {path} (not read before)")
        elif path not in new_inputs:
            changes.append(f"input {path} (no longer read)")
        elif old_inputs[path]["sha256"] != new_inputs[path]["sha256"]:
            before, after = old_inputs[path]["files"], new_inputs[path]["files"]
            names = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n) and n)
            shown = ", ".join(names[:3]) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
            changes.append(f"input {path} ({shown})" if names else f"input {path}")
    if old.get("params_sha256") != new["params_sha256"]:
        before, after = _flatten(old.get("params", {})), _flatten(new["params"])
        keys = sorted(k for k in set(before) | set(after) if before.get(k, "<unset>") != after.get(k, "<unset>"))
        changes += [
            f"param {k} ({_short(before.get(k, '<unset>'))} -> {_short(after.get(k, '<unset>'))})" for k in keys
        ]
        if not keys:
            changes.append("params")
    return changes or ["fingerprint scheme"]


def run_checkpointer(stage: str, params: dict[str, Any], inputs: list[str]):
    """A :class:`rlhf.training.Checkpointer` for this stage, params and inputs, in ``checkpoints/<stage>/<fp>/``.

    The fingerprint ``<fp>`` hashes the stage's params and the *content* of
    its current input files (sha256 of every file, streamed; never file sizes,
    never the stage's own dvc.lock entry, which describes the last finished
    run), so a killed stage resumes only with the same params and inputs. Its
    :func:`fingerprint_manifest` is written to ``<fp>/manifest.json``.

    Every other folder under ``checkpoints/<stage>/`` is stale and is removed;
    when it held a checkpoint, one line says why the stage starts fresh, e.g.
    ``[ppo] stale checkpoint checkpoints/ppo/0123456789abcdef (step-00000020)
    discarded, starting fresh: changed since it was written: input models/reward
    (model.safetensors), param lr (1e-05 -> 2e-05)`` (:func:`stale_changes`).

    Args:
        stage: checkpoint name (the stage, or e.g. ``ablation-vanilla``).
        params: the stage's params.
        inputs: files and folders the stage reads.

    Raises:
        FileNotFoundError: an input does not exist.
    """
    from rlhf.training import Checkpointer, atomic_write_text

    manifest = fingerprint_manifest(params, inputs)
    root = checkpoint_root(stage)
    current = os.path.join(root, manifest["fingerprint"])
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        folder = os.path.join(root, name)
        if folder == current or not os.path.isdir(folder):
            continue
        steps = sorted(d for d in os.listdir(folder) if d.startswith("step-"))
        if steps:
            try:
                changes = stale_changes(load_json(os.path.join(folder, MANIFEST)), manifest)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing or malformed manifest
                changes = stale_changes(None, manifest)
            print(
                f"[{stage}] stale checkpoint {folder} ({steps[-1]}) discarded, starting fresh: "
                f"changed since it was written: {', '.join(changes)}",
                flush=True,
            )
        shutil.rmtree(folder, ignore_errors=True)
    atomic_write_text(os.path.join(current, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return Checkpointer(current)


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
