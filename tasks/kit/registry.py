"""The MLflow model registry: versions found by content, aliases that move with a recorded history.

Everything that talks to the registry lives here (the core imports no MLflow; the gate's decision is
:mod:`rlhf.evaluation.gate_rules`). A version is an MLflow Model (:mod:`tasks.kit.served`: a pyfunc from code, nothing
pickled) holding the ``save_pretrained`` safetensors folder, which the pipeline reads back by downloading it for
the project's own loaders. Its source is ``runs:/<run>/model``: relative to its run, not to a machine's folder.

Every alias move (by a gate, ``promote`` or ``rollback``) is one tag, on the version moved to and in the
ledger (:mod:`tasks.kit.ledger`: where deleting the version, or the whole registered model, cannot take it),
``rlhf.alias_move.<alias>.<nanoseconds>`` = JSON ``{alias, from, to, by, reason, at, pipeline_run}``: MLflow
keeps only the current alias, and one tag per move never outgrows a tag's size limit. The ledger also keeps each
version's content hash, so content a person deleted is not registered again until restored
(:func:`refuse_deleted`, ``rlhf-registry restore``). The command for people is :mod:`tasks.cli.registry`.

A version whose model files ``rlhf-housekeeping`` deleted (:mod:`tasks.cli.housekeeping`, ``registry.keep_versions``)
carries ``rlhf.pruned`` = JSON ``{at, by, rule, bytes}`` and can never take an alias again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from rlhf.evaluation.gate_rules import as_records, decision_sentence, passed
from tasks.kit import ledger
from tasks.kit.alias_lock import alias_lock
from tasks.kit.common import one_line
from tasks.kit.runs import PIPELINE_RUN_TAG, create_if_missing, git_commit, pipeline_run_id

CHAMPION = "champion"
SHA_TAG, DATA_TAG, COMMIT_TAG = "rlhf.model_sha256", "rlhf.data_sha256", "rlhf.git_commit"
DECISION_TAG, CHECKS_TAG, CHALLENGER_TAG = "rlhf.gate.decision", "rlhf.gate.checks", "rlhf.challenger"
REASON_TAG = "rlhf.gate.reason"  # the decision in one sentence naming the failed criteria (also the description)
APPROVAL_TAG = "rlhf.approval"  # awaiting | approved | rejected | timed out
MOVE_PREFIX = "rlhf.alias_move."
PRUNED_TAG = "rlhf.pruned"  # JSON {at, by, rule, bytes}: rlhf-housekeeping deleted the version's model files
ARTIFACT_PATH = "model"
MAX_REASON = 1000  # characters of a reason; a longer one is refused before anything moves (MLflow tags hold 5,000)
MAX_BY = 200  # characters of who moved an alias (``approved by <reviewer>``)
LEGACY_METRIC_PREFIX = "rlhf.metric."  # versions registered before their figures became run metrics carry them so
PARAMS_TAG = "rlhf.params_sha256"  # sha256 of the params (canonical JSON); the whole file is the run's params.json
PARAMS_ARTIFACT = "params.json"
CONTENT_PREFIX = "rlhf.content."  # on the registered model: rlhf.content.<version> = the version's content hash
RESTORED_PREFIX = "rlhf.restored."  # on the registered model: rlhf.restored.<version> = JSON {reason, at}
RESTORED_TAG = "rlhf.restored_from"  # on a version brought back: JSON {version, reason, at} of the one deleted
MIRROR_PREFIX = "rlhf.registry."  # a version's tags and description, mirrored on its run: a restore reads them


class RegistryError(ValueError):
    """A registry failure in one line (a missing name, version or alias; a tracking server that is down).

    A ``ValueError`` so a stage's :func:`tasks.kit.common.cli` and the ``rlhf-registry`` command print it as one line.
    """


def folder_sha256(folder: str) -> str:
    """sha256 over a folder's files: each relative path (sorted) and its bytes; the content hash of a model.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such folder")
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, folder).encode() + b"\0")
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def files_sha256(paths: list[str]) -> str:
    """sha256 over files in the given order (each name and its bytes): the content hash of a training set."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


def version_tags(folder: str, params: dict[str, Any], data: list[str]) -> dict[str, str]:
    """The tags of a new version: content hashes of the model folder, its training data and its params
    (:data:`PARAMS_TAG`; :func:`register` stores the params whole), the git commit and the pipeline run id. Its
    figures are metrics of the run it was registered from (:func:`register`, :func:`version_metrics`), not tags."""

    return {
        SHA_TAG: folder_sha256(folder),
        DATA_TAG: files_sha256(data),
        COMMIT_TAG: git_commit(),
        PIPELINE_RUN_TAG: pipeline_run_id(),
        PARAMS_TAG: hashlib.sha256(_params_json(params).encode()).hexdigest(),
    }


def version_metrics(client, found) -> dict[str, float]:
    """The figures a version was judged on: the metrics of the run it was registered from (:func:`register` logs
    the ones that run lacked), over the ``rlhf.metric.<name>`` tags that versions registered before carried.

    Raises:
        RegistryError: the run cannot be read (one line).
    """
    legacy = {k[len(LEGACY_METRIC_PREFIX) :]: v for k, v in found.tags.items() if k.startswith(LEGACY_METRIC_PREFIX)}
    numbers = {}
    for key, value in legacy.items():
        try:
            numbers[key] = float(value)
        except ValueError:
            continue  # a tag edited by hand into something that is not a number: not a figure
    if not found.run_id:
        return numbers
    return numbers | dict(_guard(f"read run {found.run_id}", client.get_run, found.run_id).data.metrics)


def _log_missing_metrics(client, run_id: str, metrics: dict[str, Any]) -> None:
    """Log the numeric ``metrics`` run ``run_id`` does not hold at that value, at step 0, in one call."""
    from mlflow.entities import Metric  # noqa: PLC0415 (MLflow: seconds to import)

    have = _guard(f"read run {run_id}", client.get_run, run_id).data.metrics
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    stamp = int(time.time() * 1000)
    missing = [
        Metric(key, value, stamp, 0)
        for key, value in numbers.items()
        if key not in have or not (have[key] == value or (math.isnan(have[key]) and math.isnan(value)))
    ]
    for start in range(0, len(missing), 1000):  # MLflow's most per batch
        _guard(f"log the metrics of run {run_id}", client.log_batch, run_id, metrics=missing[start : start + 1000])


def _params_json(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str, indent=1)


def _guard(what: str, call, *args, **kwargs):
    """Run a registry call; a missing resource or an unreachable server becomes one :class:`RegistryError` line."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        return call(*args, **kwargs)
    except MlflowException as err:
        raise RegistryError(f"registry: {what}: {one_line(str(err.message))}") from None
    except OSError as err:  # requests' ConnectionError is an OSError, and so is a full disk
        cause = f"{type(err).__name__}: {one_line(str(err))}"
        where = "the disk is full" if err.errno == errno.ENOSPC else "tracking server unreachable"
        raise RegistryError(f"registry: {what}: {where} ({cause})") from None


def register(
    client,
    name: str,
    folder: str,
    run_id: str,
    tags: dict[str, str],
    params: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
):
    """Log ``folder`` as the artifacts of run ``run_id`` and register them as a new version of ``name``.

    The registered model is created on first use. ``params`` (the ones :func:`version_tags` hashed) are stored
    whole as the run's :data:`PARAMS_ARTIFACT`: a tag would cut them at 5,000 characters. ``metrics`` (the figures
    the version is judged on) become metrics of that run where it lacks them (:func:`version_metrics` reads them
    back), as the MLflow UI shows a version's figures: on its source run. Returns the ``ModelVersion``.

    Raises:
        RegistryError: the store or the artifact store cannot be reached or refuses (one line).
    """
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        client.get_registered_model(name)
    except MlflowException:  # first use; another process may register the first version at the same moment
        create, read = partial(client.create_registered_model, name), partial(client.get_registered_model, name)
        _guard(f"create registered model {name}", create_if_missing, create, read)
    from tasks.kit.served import save  # noqa: PLC0415 (MLflow: seconds to import)

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(folder))) as tmp:
        served = os.path.join(tmp, ARTIFACT_PATH)
        save(folder, served)
        _guard(f"log the artifacts of {folder}", client.log_artifacts, run_id, served, ARTIFACT_PATH)
    if params is not None:
        _guard("log the params", client.log_text, run_id, _params_json(params), PARAMS_ARTIFACT)
    if metrics:
        _log_missing_metrics(client, run_id, metrics)
    source = f"runs:/{run_id}/{ARTIFACT_PATH}"  # relative to the run: the store's location is not written here
    found = _guard(f"register {name}", client.create_model_version, name, source, run_id=run_id, tags=tags)
    mirror_tags(client, run_id, tags)
    if tags.get(SHA_TAG):  # kept where deleting the version or the model cannot take it: refuse_deleted() and
        record = {"version": str(found.version), "at": ledger.now(), "run_id": run_id}  # a restore read it
        _guard("record the content", ledger.write, client, f"content.{name}.{tags[SHA_TAG]}", record)
    return found


def _versions(client, name: str) -> list:
    return _guard(f"search {name}", client.search_model_versions, f"name = '{name}'")


def _model_tags(client, name: str) -> dict[str, str]:
    """The registered model's own tags (none before its first version)."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        return dict(client.get_registered_model(name).tags)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return {}
        raise RegistryError(f"registry: read {name}: {one_line(str(err.message))}") from None


def refuse_deleted(client, name: str, sha: str, restore: str) -> None:
    """Refuse to register content a person deleted from the registry, until a person restores it.

    A version deleted in the MLflow UI leaves its content hash on the registered model (:func:`register`); the
    same bytes coming back through ``dvc repro`` would otherwise become a new version and could take the alias
    again, undoing what the person did.

    Raises:
        RegistryError: ``sha`` was a version that no longer exists and was not restored; names the version and
            ``restore``, the command that brings it back.
    """
    for record in _deleted(client, name):
        if record["sha"] == sha and not record["restored"]:
            gone = "deleted from the registry" if record["model_exists"] else f"deleted with the whole {name}"
            command = restore.format(version=record["version"])
            if not record["model_exists"]:  # every version went: bring them all back, aliases with them
                command = command.replace(f" --version {record['version']}", "")
            raise RegistryError(
                f"registry: this content was {name} version {record['version']}, which was {gone}; it is not "
                f"registered again until a person restores it: {command} (or retrain)"
            )


def _recorded(client, name: str) -> dict[str, str]:
    """Content hash -> the version it was registered as, from the ledger and (registries written before it) the
    registered model's ``rlhf.content.<version>`` tags."""
    tags = _model_tags(client, name)
    contents = {sha: key[len(CONTENT_PREFIX) :] for key, sha in tags.items() if key.startswith(CONTENT_PREFIX)}
    ledgered = _guard("read the ledger", ledger.read, client, f"content.{name}.")
    return contents | {sha: record["version"] for sha, record in ledgered.items()}


def _deleted(client, name: str) -> list[dict[str, Any]]:
    """The content registered under ``name`` that no version holds any more (a version, or the whole registered
    model, deleted by a person): ``{sha, version, restored, model_exists}`` each."""
    tags, exists = _model_tags(client, name), model_exists(client, name)
    held = {found.tags.get(SHA_TAG) for found in _versions(client, name)} if exists else set()
    restored = _guard("read the ledger", ledger.read, client, f"restored.{name}.")
    return [
        {
            "sha": sha,
            "version": number,
            "restored": sha in restored or f"{RESTORED_PREFIX}{number}" in tags,
            "model_exists": exists,
        }
        for sha, number in _recorded(client, name).items()
        if sha not in held
    ]


def model_exists(client, name: str) -> bool:
    """Whether the registered model ``name`` exists (a person may have deleted it whole)."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        client.get_registered_model(name)
        return True
    except MlflowException:
        return False


def find_by_sha(client, name: str, sha: str):
    """The newest version of ``name`` whose content hash tag is ``sha``, or None. Raises RegistryError (one line)."""
    found = _guard(f"search {name}", client.search_model_versions, f"name = '{name}' and tags.`{SHA_TAG}` = '{sha}'")
    return max(found, key=lambda v: int(v.version)) if found else None


def holder(client, name: str, alias: str = CHAMPION):
    """The version that holds ``alias``, or None (also when ``name`` is not registered yet)."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise RegistryError(f"registry: read alias {alias} of {name}: {err.message}") from None


def version(client, name: str, number: str | int):
    """Version ``number`` of ``name``. Raises RegistryError when it does not exist."""
    return _guard(f"{name} version {number}", client.get_model_version, name, str(number))


def existing_version(client, name: str, number: str | int):
    """Version ``number`` of ``name``, or None when it or the whole model was deleted. Raises RegistryError (one
    line) when the registry cannot be read."""
    return next((v for v in _versions(client, name) if str(v.version) == str(number)), None)


def set_version_tag(client, name: str, number: str | int, key: str, value: str, run_id: str | None = None) -> None:
    """Set tag ``key`` of version ``number`` of ``name``, and its mirror on the version's run (``run_id``, read
    from the version when None): deleting the version cannot take it (:func:`tasks.kit.restore.restore`).

    Raises:
        RegistryError: the version is gone or the registry cannot be reached (one line).
    """
    _guard(f"tag {name} version {number}", client.set_model_version_tag, name, str(number), key, value)
    mirror_tags(client, run_id or version(client, name, number).run_id, {key: value})


def mirror_tags(client, run_id: str, tags: dict[str, str]) -> None:
    """Copy a version's ``tags`` (a description under ``description``) onto its run as ``rlhf.registry.<key>``
    (one call a hundred). Raises RegistryError (one line)."""
    from mlflow.entities import RunTag  # noqa: PLC0415 (MLflow: seconds to import)

    mirrored = [RunTag(f"{MIRROR_PREFIX}{key}", value) for key, value in tags.items()]
    for start in range(0, len(mirrored), 100):
        _guard("mirror the version's tags on its run", client.log_batch, run_id, tags=mirrored[start : start + 100])


def pruned(found) -> dict[str, Any] | None:
    """The record of version ``found``'s deleted model files (``{at, by, rule, bytes}``), or None while it has them."""
    return json.loads(found.tags[PRUNED_TAG]) if PRUNED_TAG in found.tags else None


def require_files(found, alias: str = CHAMPION) -> None:
    """Refuse a version whose model files were pruned: nothing may take ``alias`` without the files to load.

    Raises:
        RegistryError: e.g. ``registry: rlhf-reward-model version 2 cannot hold champion: its model files were
            pruned on 2026-11-30T03:00:00+00:00 (registry.keep_versions 3); promote a version that keeps them``.
    """
    record = pruned(found)
    if record is not None:
        raise RegistryError(
            f"registry: {found.name} version {found.version} cannot hold {alias}: its model files were pruned on "
            f"{record['at']} ({record['rule']}); promote a version that keeps them (rlhf-registry status lists "
            f"the pruned ones)"
        )


def move_alias(
    client, name: str, to: str | int, by: str, reason: str, alias: str = CHAMPION, pipeline_run: str = ""
) -> dict[str, Any]:
    """Point ``alias`` of ``name`` at version ``to`` and record the move on that version; returns the record.
    Movers of the same alias take turns (:func:`tasks.kit.alias_lock.alias_lock`): each records the holder it
    moved the alias from.

    Raises:
        RegistryError: the reason is empty or longer than :data:`MAX_REASON`, ``by`` longer than :data:`MAX_BY`
            (nothing moves: a record cut short would not say what the person wrote), the version does not
            exist, already holds the alias or has no model files (pruned, :func:`require_files`), another move
            held the alias for a minute, or the registry cannot be reached.
    """
    reason = reason.strip()
    if not reason:
        raise RegistryError("registry: the reason must say why the alias moves (it is recorded); nothing moved")
    if len(reason) > MAX_REASON:
        raise RegistryError(
            f"registry: the reason is {len(reason):,} characters, over the {MAX_REASON:,} recorded; nothing moved: "
            "shorten it (a link to a ticket or document can hold the rest)"
        )
    if len(by) > MAX_BY:
        raise RegistryError(f"registry: who moved it is {len(by):,} characters, over {MAX_BY}; nothing moved")
    with alias_lock(client, name, alias):  # the holder read, the move and its record: one step for other movers
        return _move_locked(client, name, to, by, reason, alias, pipeline_run)


def _move_locked(client, name: str, to: str | int, by: str, reason: str, alias: str, pipeline_run: str):
    target = version(client, name, to)
    require_files(target, alias)
    previous = holder(client, name, alias)
    if previous is not None and str(previous.version) == str(target.version):
        raise RegistryError(f"registry: {name} version {target.version} already holds {alias}; nothing moved")
    record = {
        "alias": alias,
        "from": str(previous.version) if previous is not None else None,
        "to": str(target.version),
        "by": by,
        "reason": reason,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "pipeline_run": pipeline_run,
    }
    _guard(f"move {alias} of {name}", client.set_registered_model_alias, name, alias, target.version)
    key = f"{MOVE_PREFIX}{alias}.{time.time_ns()}"
    _guard(f"record the move of {alias}", client.set_model_version_tag, name, target.version, key, json.dumps(record))
    # and in the ledger, where deleting the version or the whole model cannot take it (history() reads all)
    _guard(f"record the move of {alias}", ledger.write, client, f"move.{name}.{alias}.{key.rsplit('.', 1)[1]}", record)
    return record


def history(client, name: str, alias: str = CHAMPION) -> list[dict[str, Any]]:
    """Every recorded move of ``alias`` of ``name``, oldest first, also the moves to a version deleted since (kept
    on the registered model). Raises RegistryError (one line)."""
    prefix = f"{MOVE_PREFIX}{alias}."
    tags = _model_tags(client, name)  # moves recorded before the ledger kept them
    for found in _versions(client, name):
        tags |= found.tags  # and before the registered model did
    moves = {key[len(prefix) :]: _record(value) for key, value in tags.items() if key.startswith(prefix)}
    moves |= _guard("read the ledger", ledger.read, client, f"move.{name}.{alias}.")
    # a tag a person added by hand (not nanoseconds, not a move record) is not a move: left out, never a traceback
    kept = {int(at): move for at, move in moves.items() if at.isdigit() and isinstance(move, dict) and "to" in move}
    return [kept[at] for at in sorted(kept)]


def _record(value: str) -> Any:
    """A move record's JSON, or None when the tag holds something else."""
    try:
        return json.loads(value)
    except ValueError:
        return None


def previous_holder(client, name: str, alias: str = CHAMPION) -> str:
    """The version a rollback returns ``alias`` to: the history replayed as a stack, where every move but a
    rollback puts the version it replaced on top and every rollback takes the top off. So rollbacks step back
    one holder at a time (after 1 -> 2 -> 3, rollback gives 2, then 1) instead of flipping between two.

    Raises:
        RegistryError: nothing left to roll back to.
    """
    earlier: list[str] = []
    for move in history(client, name, alias):
        if move["by"] == "rollback":
            if earlier:
                earlier.pop()
        elif move["from"] is not None:
            earlier.append(str(move["from"]))
    if not earlier:
        raise RegistryError(f"registry: {name} has no earlier holder of {alias} to roll back to")
    return renumbered(client, name).get(earlier[-1], earlier[-1])


def renumbered(client, name: str) -> dict[str, str]:
    """Old number -> the number it has now, for each version a restore brought back under another number (the
    ledger's ``renumber.<model>.<old>``; restored twice, 2 -> 4 -> 6, maps 2 to 6). Raises RegistryError."""
    direct = {
        old: record["to"] for old, record in _guard("read the ledger", ledger.read, client, f"renumber.{name}.").items()
    }
    final = {}
    for old in direct:
        new, seen = direct[old], {old}
        while new in direct and new not in seen:
            seen.add(new)
            new = direct[new]
        final[old] = new
    return final


def experiment_name() -> str | None:
    """The DVC experiment this process runs in (``dvc exp run`` sets ``DVC_EXP_NAME``), or None."""
    return os.environ.get("DVC_EXP_NAME") or None


def decide_once(
    client, name: str, candidate, judge, reason: str, move: bool = True, what: str = "gate"
) -> dict[str, Any]:
    """A gate's decision on ``candidate``: the one stored on it, or a new one, stored and acted on.

    ``judge() -> (checks, extra)`` (:class:`rlhf.evaluation.gate_rules.Check` list, and figures to record beside them)
    runs only for a version without a decision: a decision is never taken twice, so a later run never undoes
    a person's move. On a pass the ``champion`` alias moves to the candidate (recorded with ``reason``), except
    inside a DVC experiment, where the candidate is only tagged a challenger, and with ``move`` False, where it
    is tagged as awaiting a person's approval (``rlhf.approval: awaiting``; :mod:`flows.approval`). A new decision
    is also written for people: :data:`REASON_TAG` and the version's description say it in a sentence (``what``
    names the gate) followed by every check's line.

    Returns:
        The record (``decision`` pass|fail, ``checks``, ``lines``, the extras, ``decided_at``,
        ``pipeline_run``, ``experiment``) plus ``decided``: ``now`` or ``before``.
    """

    if DECISION_TAG in candidate.tags:
        stored = json.loads(candidate.tags[CHECKS_TAG])
        if move and stored["decision"] == "pass" and stored.get("experiment") and not experiment_name():
            # a challenger of a DVC experiment whose model now runs outside one (the experiment was applied
            # and committed): its pass takes effect, once
            experiment, stored["experiment"] = stored["experiment"], None
            set_version_tag(client, name, candidate.version, CHECKS_TAG, json.dumps(stored), candidate.run_id)
            move_alias(client, name, str(candidate.version), "gate", f"{reason}; decided in experiment {experiment}")
        return {**stored, "decided": "before"}
    checks, extra = judge()
    record = {
        "decision": "pass" if passed(checks) else "fail",
        "checks": as_records(checks),
        "lines": [check.line() for check in checks],
        **extra,
        "decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "pipeline_run": pipeline_run_id(),
        "experiment": experiment_name(),
    }
    version_, run_id = str(candidate.version), candidate.run_id
    set_version_tag(client, name, version_, CHECKS_TAG, json.dumps(record), run_id)
    set_version_tag(client, name, version_, DECISION_TAG, record["decision"], run_id)
    sentence = decision_sentence(record, what)
    set_version_tag(client, name, version_, REASON_TAG, sentence, run_id)
    description = f"{sentence}.\n\n" + "\n".join(f"- {line}" for line in record["lines"])
    _guard("describe the decision", client.update_model_version, name, version_, description=description)
    mirror_tags(client, run_id, {"description": description})
    if record["decision"] == "pass" and record["experiment"]:
        set_version_tag(client, name, version_, CHALLENGER_TAG, record["experiment"], run_id)
    elif record["decision"] == "pass" and not move:
        set_version_tag(client, name, version_, APPROVAL_TAG, "awaiting", run_id)
        record["awaiting_approval"] = True
    elif record["decision"] == "pass":
        move_alias(client, name, version_, "gate", reason, pipeline_run=record["pipeline_run"])
    return {**record, "decided": "now"}


def download(client, found, folder: str) -> None:
    """Download version ``found``'s model folder into ``folder`` (an empty folder that exists) and check it against
    the content hash registered with it (:data:`SHA_TAG`) before anything uses it.

    Raises:
        RegistryError: the artifacts cannot be read, were pruned (``rlhf-housekeeping``), or hold other content
            than was registered (a truncated or replaced file in the artifact store); one line.
    """

    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    from tasks.kit.served import weights_folder  # noqa: PLC0415 (imports MLflow)

    record = pruned(found)
    if record is not None:
        raise RegistryError(
            f"registry: {found.name} version {found.version} has no model files to download: they were pruned on "
            f"{record['at']} ({record['rule']})"
        )
    what, parent = f"download {found.name} version {found.version}", os.path.dirname(os.path.abspath(folder))
    needed, free = _guard(what, artifact_bytes, found.source), shutil.disk_usage(parent).free
    if needed > free:  # MLflow reports a download that filled the disk as a wrong path
        raise RegistryError(
            f"registry: {what}: its {needed / 1e6:,.0f} MB do not fit in the {free / 1e6:,.0f} MB free on {parent}'s "
            "disk; free some space (rlhf-housekeeping --yes deletes old versions' model files)"
        )
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        path = _guard(what, mlflow.artifacts.download_artifacts, artifact_uri=found.source, dst_path=tmp)
        path = weights_folder(path)
        for entry in os.listdir(path):
            shutil.move(os.path.join(path, entry), os.path.join(folder, entry))
    expected = found.tags.get(SHA_TAG)
    if expected and folder_sha256(folder) != expected:
        raise RegistryError(
            f"registry: {found.name} version {found.version} downloaded with other content than registered "
            f"(sha256 {folder_sha256(folder)[:12]}..., registered {expected[:12]}...): its files in the artifact "
            "store are damaged or replaced; promote another version or register this one again"
        )


def artifact_bytes(uri: str) -> int:
    """The bytes of every file under the artifact ``uri`` (a version's ``source``: ``runs:/<run>/model``, ...),
    listed folder by folder. Raises what MLflow's listing raises."""
    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    total = 0
    for entry in mlflow.artifacts.list_artifacts(artifact_uri=uri):
        name = entry.path.rstrip("/").rsplit("/", 1)[-1]
        total += artifact_bytes(f"{uri}/{name}") if entry.is_dir else int(entry.file_size or 0)
    return total


def _project(project: str | None) -> str:
    """The project folder: ``project``, else the nearest folder up from here holding params.yaml and dvc.yaml.
    Raises RegistryError when there is none (never another project's registry by default)."""
    candidates = [project] if project else [os.getcwd(), *[str(p) for p in Path(os.getcwd()).parents]]
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "params.yaml")) and os.path.isfile(os.path.join(folder, "dvc.yaml")):
            return folder
    where = project or f"or above {os.getcwd()}"
    raise RegistryError(f"registry: no project (params.yaml and dvc.yaml) at {where}; run it there or pass --project")
