"""What a team runs on a schedule so a project's disk stays bounded: ``rlhf-housekeeping`` (infra/housekeeping.md).

Four steps, in this order, each printing what it removes and the bytes; without ``--yes`` nothing is removed:

1. **registry**: of each registered model (params.yaml ``registry.reward_model``, ``registry.policy_model``) a
   version keeps its model files while it holds an alias, awaits a person's approval or is the one a rollback
   returns to, and so do the newest ``registry.keep_versions`` of the others. The older ones are tagged
   ``rlhf.pruned`` (:func:`tasks.kit.registry.require_files` then refuses them any alias) and their files are deleted
   through MLflow's artifact repository (a local folder, S3 or a proxying server alike); their metrics, tags and
   runs stay.
2. **checkpoints**: resume checkpoints (``checkpoints/<name>/<fingerprint>/``,
   :func:`tasks.kit.resume.run_checkpointer`) that no run can resume from: those of a stage DVC reports up to
   date (``dvc repro`` does not run it), and any whose manifest is unreadable or whose inputs are gone or have
   other content now (its fingerprint can no longer match). PPO's ``best/`` and ``kept/`` folders live inside a
   fingerprint folder and go with it.
3. **dvc gc**: the DVC cache objects that the workspace, the tips of all branches, all tags and all experiments
   do not use (``--all-commits``: nor any commit).
4. **mlflow gc**: runs deleted in MLflow (the UI, ``mlflow runs delete``), with their artifacts, through
   ``mlflow gc``. It refuses, in one line, while a deleted run holds the files of a version that keeps them (a
   champion, say): ``mlflow gc`` itself does not look at the registry. A tracking server's store is collected on
   the server: the step prints the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import typer
from rich.filesize import decimal

from tasks.cli import run_command
from tasks.kit.common import echo
from tasks.kit.dvclock import repair_dvc_rwlock
from tasks.kit.registry import (
    APPROVAL_TAG,
    PRUNED_TAG,
    RegistryError,
    _guard,
    _project,
    previous_holder,
    pruned,
    set_version_tag,
)

CHECKPOINTS = "checkpoints"
DVC_SCOPE = ("--workspace", "--all-branches", "--all-tags", "--all-experiments")
REMOTE_SCHEMES = ("http://", "https://", "databricks")  # tracking servers: `mlflow gc` runs on their host


class HousekeepingError(ValueError):
    """A housekeeping step that cannot go on, in one line (a bad param, a failed ``dvc`` or ``mlflow`` command)."""


@dataclass
class Removal:
    """One thing a step removes (or would remove): ``what``, ``why``, and its ``size`` in bytes (None: unknown)."""

    step: str
    what: str
    why: str
    size: int | None

    def line(self, apply: bool) -> str:
        """e.g. ``[dvc gc] would remove 12 objects of the DVC cache (1.1 GB): not used by the workspace, ...``."""
        size = "size unknown" if self.size is None else decimal(self.size)
        return f"[{self.step}] {'remove' if apply else 'would remove'} {self.what} ({size}): {self.why}"


def folder_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a file: its size; nothing there: 0)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def keep_versions(registry: dict[str, Any]) -> int:
    """params.yaml ``registry.keep_versions``: how many versions without an alias keep their model files.

    Raises:
        HousekeepingError: it is missing or not a whole number >= 0.
    """
    value = registry.get("keep_versions")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HousekeepingError(
            f"params.yaml: registry.keep_versions is {value!r}; it must be a whole number >= 0 (how many registered "
            f"versions without an alias keep their model files)"
        )
    return value


# ------------------------------------------------------------------------------------------------------ the registry


def artifact_bytes(uri: str) -> int:
    """Bytes under an artifact URI, listed through MLflow's artifact repository of its store (0: nothing there)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repo = get_artifact_repository(uri)

    def walk(path: str | None) -> int:
        return sum(walk(item.path) if item.is_dir else item.file_size or 0 for item in repo.list_artifacts(path))

    return walk(None)


def plan_versions(client, name: str, keep: int) -> tuple[list[tuple[Any, str]], list[Any], list[Any]]:
    """Which versions of ``name`` keep their model files, and why; which lose them; which were pruned before.

    Returns:
        ``(kept, prune, pruned_before)``, each newest first: ``kept`` as ``(version, why)`` pairs.

    Raises:
        RegistryError: the registry cannot be read (one line).
    """
    found = _guard(f"search {name}", client.search_model_versions, f"name = '{name}'")
    versions = sorted(found, key=lambda v: int(v.version), reverse=True)
    aliases: dict[str, list[str]] = {}
    for alias, number in _guard(f"registered model {name}", client.get_registered_model, name).aliases.items():
        aliases.setdefault(str(number), []).append(alias)
    try:
        back = previous_holder(client, name)
    except RegistryError:  # nothing to roll back to
        back = None
    kept, prune, before, newest = [], [], [], 0
    for version in versions:
        if pruned(version):
            before.append(version)
            continue
        why = [f"holds {alias}" for alias in aliases.get(str(version.version), [])]
        why += ["a rollback returns to it"] if str(version.version) == back else []
        why += ["awaits approval"] if version.tags.get(APPROVAL_TAG) == "awaiting" else []
        if not why and newest < keep:
            newest += 1
            why.append(f"one of the newest {keep} without an alias")
        if why:
            kept.append((version, ", ".join(why)))
        else:
            prune.append(version)
    return kept, prune, before


def prune_versions(client, name: str, keep: int, apply: bool, say) -> tuple[list[Removal], set[str]]:
    """Delete the model files of the versions of ``name`` that :func:`plan_versions` prunes (with ``apply``).

    Each is tagged ``rlhf.pruned`` first, so no alias can move to it while its files go; a version pruned before
    whose files are still there (a deletion that failed) loses them now.

    Returns:
        ``(removals, run ids of the versions that keep their files)``.

    Raises:
        RegistryError: the registry or its artifact store cannot be reached or refuses (one line).
    """
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    kept, prune, before = plan_versions(client, name, keep)
    held = "version " + ", ".join(f"{version.version} ({why})" for version, why in kept) if kept else "no version"
    say(f"[registry] {name} (registry.keep_versions {keep}): keeps the model files of {held}")
    older = f"not one of the newest {keep} without an alias" if keep else "no alias, and registry.keep_versions is 0"
    removals = []
    for version, again in [(v, False) for v in prune] + [(v, True) for v in before]:
        size = _guard(f"list the files of {name} version {version.version}", artifact_bytes, version.source)
        if again and not size:
            continue
        why = "left by an earlier prune" if again else older
        removals.append(Removal("registry", f"the model files of {name} version {version.version}", why, size))
        say(removals[-1].line(apply))
        if not apply:
            continue
        if not again:
            record = {
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
                "by": "rlhf-housekeeping",
                "rule": f"registry.keep_versions {keep}",
                "bytes": size,
            }
            set_version_tag(client, name, version.version, PRUNED_TAG, json.dumps(record), version.run_id)
        repo = get_artifact_repository(version.source)
        _guard(f"delete the files of {name} version {version.version}", repo.delete_artifacts)
    return removals, {version.run_id for version, _ in kept}


# --------------------------------------------------------------------------------------------------- deleted runs


def deleted_runs(client) -> list[Any]:
    """Every run in MLflow's ``deleted`` lifecycle stage, in any experiment (deleted experiments too)."""
    from mlflow.entities import ViewType

    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    runs, token = [], None
    while experiments:
        page = client.search_runs(experiments, run_view_type=ViewType.DELETED_ONLY, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            break
    return runs


def collect_runs(client, uri: str, keep_runs: set[str], apply: bool, say) -> list[Removal]:
    """Remove the deleted runs of the tracking store ``uri`` for good with ``mlflow gc`` (with ``apply``).

    Raises:
        HousekeepingError: a deleted run holds the files of a version that keeps them (``keep_runs``), or
            ``mlflow gc`` failed.
    """
    from mlflow.exceptions import MlflowException

    runs = deleted_runs(client)
    held = [run.info.run_id for run in runs if run.info.run_id in keep_runs]
    if held:
        raise HousekeepingError(
            f"[mlflow gc] refused: deleted run {held[0]} holds the model files of a registered version that keeps "
            f"them, and mlflow gc would delete them; restore it (mlflow runs restore --run-id {held[0]}) or let "
            f"registry.keep_versions prune that version first; nothing was collected"
        )
    if not runs:
        say(f"[mlflow gc] nothing to remove: no deleted runs in {uri}")
        return []
    if uri.startswith(REMOTE_SCHEMES):
        say(
            f"[mlflow gc] {len(runs)} deleted runs in {uri}, a tracking server: collect them on its host with "
            f"`MLFLOW_TRACKING_URI={uri} mlflow gc --backend-store-uri <the server's --backend-store-uri>` "
            f"(add --artifacts-destination <the server's> when it proxies artifacts)"
        )
        return []
    removals, why = [], "deleted in MLflow; mlflow gc removes its metadata and artifacts for good"
    for run in runs:
        try:
            size = artifact_bytes(run.info.artifact_uri)
        except (MlflowException, OSError):  # mlflow gc, too, goes on past artifacts it cannot reach
            size = None
        removals.append(Removal("mlflow gc", f"deleted run {run.info.run_id} ({run.info.run_name})", why, size))
        say(removals[-1].line(apply))
    if apply:
        command = [sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", uri, "--tracking-uri", uri]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise HousekeepingError(f"[mlflow gc] failed (exit {result.returncode}): {last}")
    return removals


# ---------------------------------------------------------------------------------------------- resume checkpoints


def unresumable(folder: str, name: str, stages: set[str], stale: set[str]) -> str | None:
    """Why no run can resume from checkpoint folder ``folder`` (``checkpoints/<name>/<fingerprint>``), or None.

    ``stages``: the pipeline's stage names; ``stale``: those ``dvc status`` reports stale.
    """
    from tasks.kit.outputs import load_json
    from tasks.kit.resume import MANIFEST, fingerprint_manifest, stale_changes

    if name in stages and name not in stale:
        return f"stage {name} is up to date, so dvc repro does not run it"
    try:
        manifest = load_json(os.path.join(folder, MANIFEST))
        params, inputs = manifest["params"], list(manifest["inputs"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}, so no run can match its fingerprint"
    gone = [path for path in inputs if not os.path.exists(path)]
    if gone:
        return f"its input {gone[0]} is gone"
    current = fingerprint_manifest(params, inputs)
    if current["fingerprint"] != os.path.basename(folder):
        return f"changed since it was written: {', '.join(stale_changes(manifest, current))}"
    return None


def remove_checkpoints(stages: set[str], stale: set[str], apply: bool, say) -> list[Removal]:
    """Remove the checkpoint folders under ``checkpoints/`` that :func:`unresumable` gives a reason for (with
    ``apply``); say why each other one stays."""
    from rlhf.training.checkpoint import Checkpointer

    removals = []
    for name in sorted(os.listdir(CHECKPOINTS)) if os.path.isdir(CHECKPOINTS) else []:
        parent = os.path.join(CHECKPOINTS, name)
        folders = sorted(os.path.join(parent, entry) for entry in os.listdir(parent))
        for folder in (path for path in folders if os.path.isdir(path)):
            why = unresumable(folder, name, stages, stale)
            if why is None:
                whose = f"stage {name} is stale" if name in stages else f"{name} is no pipeline stage (a benchmark?)"
                say(
                    f"[checkpoints] keep {folder} ({decimal(folder_bytes(folder))}): {whose} and its inputs are "
                    f"unchanged, so its next run resumes from it (or discards it if its params changed)"
                )
                continue
            removals.append(Removal("checkpoints", folder, why, folder_bytes(folder)))
            say(removals[-1].line(apply))
            if apply:
                Checkpointer(folder).clear()
        if apply and not os.listdir(parent):
            os.rmdir(parent)
    return removals


# ------------------------------------------------------------------------------------------------------------- dvc


def dvc(*args: str) -> str:
    """Run ``dvc <args>`` here; returns its standard output.

    Raises:
        HousekeepingError: it failed (the last line of its message).
    """
    repair_dvc_rwlock()
    result = subprocess.run([sys.executable, "-m", "dvc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise HousekeepingError(f"[dvc {args[0]}] failed (exit {result.returncode}): {last}")
    return result.stdout


def stale_stages() -> tuple[set[str], set[str]]:
    """``(the stages of dvc.yaml, the ones dvc status reports stale)``. Raises HousekeepingError (one line)."""
    stages = {line.strip() for line in dvc("stage", "list", "--name-only").splitlines() if line.strip()}
    return stages, set(json.loads(dvc("status", "--json").strip() or "{}"))


def collect_cache(all_commits: bool, apply: bool, say) -> list[Removal]:
    """``dvc gc`` of the cache objects no branch tip, tag, experiment or the workspace uses (``all_commits``: nor
    any commit), with ``apply``; listed first by a dry run. Raises HousekeepingError (one line)."""
    scope = [*DVC_SCOPE, *(["--all-commits"] if all_commits else [])]
    listed = dvc("gc", *scope, "--force", "--dry")
    paths = [line.removeprefix("Removing ").strip() for line in listed.splitlines() if line.startswith("Removing ")]
    users = f"the workspace, {'any commit' if all_commits else 'a branch tip, a tag'} or an experiment"
    if not paths:
        say(f"[dvc gc] nothing to remove: the cache holds only what {users} uses")
        return []
    objects = f"{len(paths)} object{'' if len(paths) == 1 else 's'} of the DVC cache"
    removal = Removal("dvc gc", objects, f"not used by {users}", sum(folder_bytes(path) for path in paths))
    say(removal.line(apply))
    if apply:
        dvc("gc", *scope, "--force")
    return [removal]


# ----------------------------------------------------------------------------------------------------- the command


def housekeep(apply: bool, all_commits: bool, project: str | None, say=echo) -> list[Removal]:
    """Run the four steps in the project ``project`` (else the one around the current folder), printing each line.

    Returns:
        What was removed (``apply``) or would be.

    Raises:
        HousekeepingError, RegistryError: a step cannot go on (one line); the steps before it are done.
    """
    import mlflow

    from tasks.kit.params import stage_params
    from tasks.kit.runs import tracking_uri

    os.chdir(_project(project))
    registry = stage_params("registry")
    keep, uri = keep_versions(registry), tracking_uri()
    removals: list[Removal] = []
    keep_runs: set[str] = set()
    local_db = uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///") :])
    client = None if local_db else mlflow.MlflowClient(tracking_uri=uri)
    for name in (registry["reward_model"], registry["policy_model"]):
        if client is None or not _guard(f"search {name}", client.search_registered_models, f"name = '{name}'"):
            say(f"[registry] {name}: not registered yet")
            continue
        pruning, keeping = prune_versions(client, name, keep, apply, say)
        removals += pruning
        keep_runs |= keeping
    if os.path.isdir(CHECKPOINTS):
        removals += remove_checkpoints(*stale_stages(), apply, say)
    removals += collect_cache(all_commits, apply, say)
    if client is None:
        say(f"[mlflow gc] no tracking store at {uri} yet")
    else:
        removals += collect_runs(client, uri, keep_runs, apply, say)
    return removals


app = typer.Typer(
    rich_markup_mode="markdown",  # the docstrings' `code` shown as code, not as backticks
    help="Remove what a project no longer needs: pruned model files, stale checkpoints, DVC cache, "
    "deleted MLflow runs. A dry run unless --yes.",
)


@app.command()
def main(
    yes: bool = typer.Option(False, "--yes", help="remove (default: a dry run that only says what would go)"),
    all_commits: bool = typer.Option(
        False, "--all-commits", help="dvc gc also keeps what any git commit uses, not just branch tips and tags"
    ),
    project: str = typer.Option(None, help="the project folder (default: found from here)"),
) -> None:
    """Prune registered versions' model files (registry.keep_versions), remove checkpoints no run can resume from,
    dvc gc, mlflow gc; print each removal and the bytes freed."""
    try:
        removals = housekeep(yes, all_commits, project)
    except (HousekeepingError, RegistryError) as err:
        echo(str(err), err=True)
        raise typer.Exit(1) from None
    total = sum(removal.size or 0 for removal in removals)
    if yes:
        echo(f"freed {decimal(total)}; removals: {len(removals)}")
    else:
        echo(f"would free {decimal(total)}; removals: {len(removals)}; a dry run: nothing was removed (--yes)")


def console() -> None:
    """The console command (pyproject's scripts): :data:`app` through :func:`tasks.cli.run_command`."""
    run_command(app)


if __name__ == "__main__":
    console()
