"""Bringing back what a person deleted from the registry (``rlhf-registry restore``): each deleted version with its
content, tags and description, and the aliases as they were, from what deleting them cannot take: the ledger
(:mod:`tasks.kit.ledger`: each content with the run that holds it, every alias move) and the version's tags
mirrored on that run (:func:`tasks.kit.registry.mirror_tags`).

A version comes back as a new version of the model, with the number it had when the model was deleted whole
(numbers between are consumed by placeholders deleted at once), else the next number (recorded in the ledger as
``renumber.<model>.<old>``, through which a rollback reads the history), tagged
:data:`~tasks.kit.registry.RESTORED_TAG` with the number it had. Its gate decision comes back with it, so the
next gate run does not decide it again, and each alias whose last recorded move was to a restored version returns
to it, unless another version took the alias since.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial

from tasks.kit import ledger
from tasks.kit.registry import (
    ARTIFACT_PATH,
    DECISION_TAG,
    MAX_REASON,
    MIRROR_PREFIX,
    RESTORED_TAG,
    RegistryError,
    _deleted,
    _guard,
    _record,
    _recorded,
    _versions,
    holder,
    mirror_tags,
    model_exists,
    move_alias,
)
from tasks.kit.runs import create_if_missing


@dataclass
class Restored:
    """One deleted version brought back: the number it had, the one it has now (None: the next gate run registers
    its content again: a record written before the registry kept each content's run), its gate decision."""

    old: str
    new: str | None
    decision: str


def restore(client, name: str, number: str | None, reason: str) -> tuple[list[Restored], list[str]]:
    """Bring back deleted version ``number`` of ``name``, or with None every deleted version (a model deleted whole
    comes back), then the aliases as they were. Returns the versions and one line per alias considered.

    Raises:
        RegistryError: no reason (or over :data:`MAX_REASON`), no such version was recorded, it exists, nothing
            deleted is left, or the registry refuses (one line each).
    """
    reason = reason.strip()
    if not reason or len(reason) > MAX_REASON:
        raise RegistryError(f"registry: --reason must say why, in at most {MAX_REASON:,} characters; nothing done")
    if number is not None and str(number) not in _recorded(client, name).values():
        back = [v.version for v in _versions(client, name) if _restored_from(v) == str(number)]
        if back:
            raise RegistryError(f"registry: {name} version {number} was restored as version {back[-1]}; nothing to do")
        raise RegistryError(f"registry: {name} has no record of a version {number}; nothing to restore")
    deleted = [r for r in _deleted(client, name) if number is None or r["version"] == str(number)]
    if number is not None and not deleted:
        raise RegistryError(f"registry: {name} version {number} exists; nothing to restore")
    todo = sorted((r for r in deleted if not r["restored"]), key=lambda r: int(r["version"]))
    if not todo:
        what = f"version {number} was restored already" if number is not None else "has no deleted version left"
        raise RegistryError(f"registry: {name} {what}; run the gate (dvc repro)")
    contents = _guard("read the ledger", ledger.read, client, f"content.{name}.")
    runs = {r["sha"]: _live_run(client, contents.get(r["sha"], {}).get("run_id")) for r in todo}
    gone = [r["version"] for r in todo if contents.get(r["sha"], {}).get("run_id") and runs[r["sha"]] is None]
    if gone:  # checked before anything is registered: a restore is whole or nothing
        raise RegistryError(
            f"registry: {name} version {', '.join(gone)}: the MLflow run that holds its files was deleted; restore "
            "the run first (mlflow runs restore --run-id <id>, before mlflow gc), or retrain; nothing restored"
        )
    fresh = not model_exists(client, name)
    if fresh:
        create, read = partial(client.create_registered_model, name), partial(client.get_registered_model, name)
        _guard(f"create registered model {name}", create_if_missing, create, read)
    done, last = [], 0
    for r in todo:
        run = runs[r["sha"]]
        if fresh and run is not None:  # a model deleted whole: its versions get their numbers back
            last = _skip_to(client, name, last, int(r["version"]), run)
        done.append(_restore_one(client, name, r["sha"], r["version"], contents.get(r["sha"], {}), run, reason))
        last = int(done[-1].new) if done[-1].new else last
    return done, _aliases_as_they_were(client, name, {r.old: r.new for r in done if r.new}, reason)


def _skip_to(client, name: str, last: int, number: int, run) -> int:
    """Consume the version numbers between ``last`` and ``number`` (versions deleted and never recorded, or
    restored since under another number) with placeholders deleted at once: MLflow numbers a model's next version
    after every version it ever had, so the restored one gets ``number``. Returns ``number - 1``."""
    source = f"runs:/{run.info.run_id}/{ARTIFACT_PATH}"
    for _ in range(last + 1, number):
        placeholder = _guard(
            f"keep {name}'s numbers", client.create_model_version, name, source, run_id=run.info.run_id
        )
        _guard(f"keep {name}'s numbers", client.delete_model_version, name, placeholder.version)
    return number - 1


def _restore_one(client, name: str, sha: str, old: str, content: dict, run, reason: str) -> Restored:
    """Register the content of deleted version ``old`` again from its ``run``, with its mirrored tags."""
    entry = {"version": old, "reason": reason, "at": ledger.now()}
    if run is None:  # recorded before the registry kept each content's run: the next gate run registers it
        _guard("record the restore", ledger.write, client, f"restored.{name}.{sha}", entry)
        return Restored(old, None, "")
    mirrored = {k[len(MIRROR_PREFIX) :]: v for k, v in run.data.tags.items() if k.startswith(MIRROR_PREFIX)}
    description = mirrored.pop("description", None)
    tags = mirrored | {RESTORED_TAG: json.dumps(entry)}
    source = f"runs:/{run.info.run_id}/{ARTIFACT_PATH}"
    found = _guard(
        f"register {name} again",
        client.create_model_version,
        name,
        source,
        run_id=run.info.run_id,
        tags=tags,
        description=description,
    )
    mirror_tags(client, run.info.run_id, {RESTORED_TAG: tags[RESTORED_TAG]})
    record = {**content, "version": str(found.version), "at": ledger.now()}
    _guard("record the content", ledger.write, client, f"content.{name}.{sha}", record)
    if str(found.version) != old:  # the history names the old number: rollback reads it through this
        renumber = {"to": str(found.version), "at": ledger.now()}
        _guard("record the new number", ledger.write, client, f"renumber.{name}.{old}", renumber)
    return Restored(old, str(found.version), tags.get(DECISION_TAG, "none"))


def _restored_from(found) -> str | None:
    """The number version ``found`` had before a restore brought it back, or None."""
    record = _record(found.tags.get(RESTORED_TAG, "null"))  # a tag edited by hand is no record, not a traceback
    return str(record["version"]) if isinstance(record, dict) and "version" in record else None


def _live_run(client, run_id: str | None):
    """The run ``run_id`` while it exists and is not deleted, else None."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    return run if run.info.lifecycle_stage == "active" else None


def _aliases_as_they_were(client, name: str, renumbered: dict[str, str], reason: str) -> list[str]:
    """Move each alias whose last recorded move went to a restored version back to it (its new number), unless a
    version holds the alias now (a later decision stands). Returns one line per such alias."""
    last: dict[str, tuple[int, dict]] = {}
    for key, record in _guard("read the ledger", ledger.read, client, f"move.{name}.").items():
        alias, at = key.rsplit(".", 1)
        if alias not in last or int(at) > last[alias][0]:
            last[alias] = (int(at), record)
    lines = []
    for alias, (_, record) in sorted(last.items()):
        new = renumbered.get(str(record["to"]))
        if new is None:
            continue
        current = holder(client, name, alias)
        if current is not None:
            lines.append(f"{alias} stays with version {current.version}, which took it after version {record['to']}")
            continue
        try:
            move_alias(client, name, new, "restore", f"as before version {record['to']} was deleted: {reason}")
        except RegistryError as err:  # its model files were pruned: it cannot hold an alias
            lines.append(f"{alias} not moved back: {err}")
            continue
        lines.append(f"{alias} -> version {new}, as before the deletion")
    return lines
