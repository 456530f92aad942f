"""The reward-model champion as the gate stage writes it into ``models/reward_champion/``, for the stages that read it.

The folder holds the champion's ``save_pretrained`` files plus ``registry_version.json`` (``{name, version,
sha256}``), or only ``NO_CHAMPION.json`` when no version holds the alias (its message names the command to run);
with ``registry.without_champion: candidate`` and no champion, the last candidate's files and
``{name, version, sha256, champion: false, why}`` (:func:`is_champion`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tasks.kit import paths

OUT_DIR = paths.CHAMPION
MARKER, VERSION_FILE = "NO_CHAMPION.json", "registry_version.json"


def promote_command(version: str | int) -> str:
    """The command a person runs to make ``version`` the champion."""
    return f'rlhf-registry promote reward --version {version} --reason "<why this model is good enough>"'


def held_version(folder: str = OUT_DIR) -> dict[str, Any] | None:
    """``{name, version, sha256}`` of the champion written in ``folder``, or None when it holds none."""
    path = os.path.join(folder, VERSION_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def require_champion(folder: str = OUT_DIR) -> dict[str, Any]:
    """What ``folder`` holds (``{name, version, sha256}``), for the stages that read the champion.

    Raises:
        ValueError: there is no champion yet (the line names the ``promote`` command), or the folder was not
            written by the gate stage.
    """
    marker = os.path.join(folder, MARKER)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as handle:
            raise ValueError(json.load(handle)["message"])
    held = held_version(folder)
    if held is None:
        raise ValueError(f"{folder}: no reward-model champion written by the gate stage (run `dvc repro gate`)")
    return held


def is_champion(held: dict[str, Any]) -> bool:
    """Whether what the folder holds is the champion (False: a candidate that did not pass, written because
    ``registry.without_champion`` is ``candidate``)."""
    return held.get("champion", True) is not False
