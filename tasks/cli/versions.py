"""Which registered version a ``rlhf-model`` command uses, and the line that says so with its gate verdict.

A model argument is a folder, ``models:/<name>@<alias>``, ``models:/<name>/<version>`` or ``models:/<name>/latest``
(the newest version, as MLflow reads it). Without one, a policy command uses the champion of
``registry.policy_model``, or, while no version holds it (the demo's gates fail by design), the newest version,
and says so: a user's first try after ``make pipeline`` works, and never hides which model answered.
"""

from __future__ import annotations

import re

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+|latest))$")
CHAMPION = "champion"


class UserError(ValueError):
    """A bad argument, folder or prompts row: printed as one line, exit 1."""


def newest(client, name: str):
    """The newest version of ``name``, or None (none registered, or the name unknown)."""
    from tasks.kit.registry import _versions

    found = _versions(client, name)
    return max(found, key=lambda v: int(v.version)) if found else None


def find_version(uri: str, client):
    """The ``ModelVersion`` a ``models:/`` URI names.

    Raises:
        UserError: not such a URI, nothing registered under the name, or no version holds the alias (the line
            names the newest version and the URI that uses it). RegistryError: the version does not exist.
    """
    from tasks.kit.registry import holder, version

    match = MODEL_URI.match(uri)
    if match is None:
        raise UserError(
            f"{uri}: not a model URI; use models:/<name>@<alias>, models:/<name>/<version> or models:/<name>/latest"
        )
    name = match["name"]
    if match["version"] and match["version"] != "latest":
        return version(client, name, match["version"])
    found = newest(client, name) if match["version"] else holder(client, name, match["alias"])
    if found is not None:
        return found
    last = newest(client, name)
    if last is None:
        raise UserError(f"{name}: no version is registered yet (run the pipeline: make pipeline)")
    raise UserError(
        f"{name}: no version holds the alias {match['alias']}; the newest is version {last.version} "
        f"({gate_verdict(last)}): use models:/{name}/latest or models:/{name}/{last.version}"
    )


def default_version(client, name: str):
    """``(version, note)``: the champion of ``name``, or the newest version while none holds it (with a note that
    says so), for a command given no model.

    Raises:
        UserError: nothing registered under ``name``.
    """
    from tasks.kit.registry import holder

    found = holder(client, name, CHAMPION)
    if found is not None:
        return found, ""
    last = newest(client, name)
    if last is None:
        raise UserError(f"{name}: no version is registered yet (run the pipeline: make pipeline); or pass a folder")
    return last, f"no version holds {CHAMPION}, so the newest; "


def gate_verdict(found) -> str:
    """``gate: pass`` or ``gate: fail (<why, as the gate wrote it>)`` of a version; ``gate: not decided`` before."""
    from tasks.kit.registry import DECISION_TAG, REASON_TAG

    decision = found.tags.get(DECISION_TAG)
    if decision is None:
        return "gate: not decided"
    why = found.tags.get(REASON_TAG)
    return f"gate: {decision}" + (f" ({why})" if decision != "pass" and why else "")


def using_line(found, note: str = "") -> str:
    """The line a command prints before it uses version ``found``: which version, why it, and its verdict."""
    return f"using {found.name} version {found.version} ({note}{gate_verdict(found)})"
