"""One move of a model's alias at a time, across every process and host that shares the registry.

MLflow has no transaction: a move reads the alias's holder, points the alias at the new version and records
``from -> to``; two moves at once could both record "from 1". The lock is a registered model of its own
(:func:`lock_name`): creating a registered model whose name exists is refused by every MLflow store (a unique
name), and deleting one is permanent, so create is "acquire" and delete is "release". A lock older than
``stale_s`` belonged to a process that was killed while it held it: it is broken (a move takes a second).
A create refused because the name exists may come back as "not found" (MLflow's SQL store looks the existing
model up to word its error, and the holder may release it in between): the lock is free, so it is tried again.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

from tasks.kit.common import one_line

WAIT_S = 60.0
STALE_S = 120.0


def lock_name(name: str, alias: str) -> str:
    """The registered model that holds the lock of ``alias`` of ``name`` while a move runs."""
    return f"{name}.{alias}.move-lock"


@contextlib.contextmanager
def alias_lock(client, name: str, alias: str, wait_s: float = WAIT_S, stale_s: float = STALE_S) -> Iterator[None]:
    """Hold the lock of ``alias`` of ``name`` (waiting up to ``wait_s`` seconds for another move) while the block
    runs; released whatever the block raises.

    Raises:
        RegistryError: another move held it for ``wait_s`` (nothing moved), or the registry refused (one line).
    """
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (MLflow: seconds to import)

    from tasks.kit.registry import RegistryError  # noqa: PLC0415 (registry moves aliases under this lock)

    lock, deadline = lock_name(name, alias), time.monotonic() + wait_s
    holder = f"{socket.gethostname()} pid {os.getpid()}"
    while True:
        try:
            client.create_registered_model(lock, description=f"a move of {alias} of {name} by {holder} is running")
            break
        except MlflowException as err:
            # RESOURCE_DOES_NOT_EXIST: the store's lookup to word "it exists" found it released: try again below
            if err.error_code not in ("RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST"):
                raise RegistryError(f"registry: lock {lock}: {one_line(str(err.message))}") from None
        with contextlib.suppress(MlflowException):  # released in between: try again at once
            held = client.get_registered_model(lock)
            if time.time() - held.creation_timestamp / 1000 > stale_s:  # its holder was killed while holding it
                _release(client, lock)
                continue
            if time.monotonic() > deadline:
                raise RegistryError(
                    f"registry: another move of {alias} of {name} holds {lock} ({held.description}); nothing moved: "
                    "try again"
                )
        time.sleep(0.2)
    try:
        yield
    finally:
        _release(client, lock)


def _release(client, lock: str) -> None:
    from mlflow.exceptions import MlflowException  # noqa: PLC0415

    with contextlib.suppress(MlflowException):  # already gone (broken as stale): nothing to release
        client.delete_registered_model(lock)
