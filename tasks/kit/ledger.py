"""The registry's ledger: what each registered model held and how its aliases moved, kept where deleting a version,
an alias or the whole registered model (all three are a click in the MLflow UI) cannot take it: the tags of an
experiment of its own, :data:`LEDGER_EXPERIMENT`, in the same tracking store. Nothing is ever logged to it.

Tag keys, each value JSON:

- ``content.<model>.<sha256>``: ``{"version", "at"}``, the content registered as that version of the model;
- ``restored.<model>.<sha256>``: ``{"version", "reason", "at"}``, a person let that deleted content be
  registered again (``rlhf-registry restore``);
- ``move.<model>.<alias>.<nanoseconds>``: an alias move (:func:`tasks.kit.registry.move_alias`'s record).

:mod:`tasks.kit.registry` writes and reads it; registries written before it keep the same records on the
registered model, which is read too.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from functools import partial
from typing import Any

from tasks.kit.runs import create_if_missing, set_tag_once

LEDGER_EXPERIMENT = "rlhf-registry-ledger"


def _experiment_id(client) -> str:
    """The ledger experiment's id, created on first use (another process creating it at once is success)."""
    found = client.get_experiment_by_name(LEDGER_EXPERIMENT)
    if found is not None:
        return str(found.experiment_id)

    def made_by_another() -> str:
        return client.get_experiment_by_name(LEDGER_EXPERIMENT).experiment_id

    return str(create_if_missing(partial(client.create_experiment, LEDGER_EXPERIMENT), made_by_another))


def now() -> str:
    """The time a record is written: UTC, ISO 8601 to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def write(client, key: str, value: dict[str, Any]) -> None:
    """Record ``value`` under ``key`` (replacing what the key held)."""
    set_tag_once(client, _experiment_id(client), key, json.dumps(value))


def read(client, prefix: str) -> dict[str, dict[str, Any]]:
    """Every record whose key starts with ``prefix``, by the rest of its key."""
    found = client.get_experiment_by_name(LEDGER_EXPERIMENT)
    tags = dict(found.tags) if found is not None else {}
    return {key[len(prefix) :]: json.loads(value) for key, value in tags.items() if key.startswith(prefix)}
