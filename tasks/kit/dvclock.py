"""DVC's outputs lock file left unreadable by a killed process: found and removed before the next DVC command."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

RWLOCK = os.path.join(".dvc", "tmp", "rwlock")


def repair_dvc_rwlock(say: Callable[[str], None] = print) -> bool:
    """Remove DVC's outputs lock file (:data:`RWLOCK`) when it cannot be read; returns whether it did.

    DVC rewrites the file in place (truncate, then write): a process killed in between leaves it empty or cut
    short, and every later ``dvc repro`` then fails at once ("JSON structure is corrupted") until a person
    deletes it. An unreadable file holds no lock anyone can honour, and DVC itself drops the entries of processes
    that are gone, so removing it loses nothing. Read under DVC's own guard of the file (no writer is halfway).
    """
    from dvc.lock import make_lock  # noqa: PLC0415 (DVC: a second to import)
    from dvc.rwlock import SCHEMA  # noqa: PLC0415
    from voluptuous import Invalid  # noqa: PLC0415

    if not os.path.exists(RWLOCK):
        return False
    with make_lock(f"{RWLOCK}.lock", tmp_dir=os.path.dirname(RWLOCK), wait=True):
        try:
            with open(RWLOCK, encoding="utf-8") as handle:
                SCHEMA(json.load(handle))
            return False
        except (ValueError, Invalid) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            why = "empty" if os.path.getsize(RWLOCK) == 0 else f"{type(err).__name__}"
            os.remove(RWLOCK)
    say(
        f"[flow] {RWLOCK} was unreadable ({why}), left by a process killed while writing it: removed "
        "(DVC makes a new one)"
    )
    return True
