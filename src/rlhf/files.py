"""Files written whole or not at all: a temporary file beside the target, then one rename.

Torch-free, so the light commands and stages (``tasks/source.py``, the CLIs' checks) write atomically without
importing torch; folders: :func:`tasks.kit.outputs.atomic_dir`, checkpoints: :mod:`rlhf.training.checkpoint`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any


def atomic_write_text(path: str, text: str) -> None:
    """Write a text file atomically (write a temporary file beside it, then rename).

    The file gets the usual mode of a new file, ``0o666 & ~umask`` (``mkstemp``
    alone would leave it 0600), as :func:`tasks.kit.outputs.atomic_dir` does for
    folders. On an error the temporary file is removed and ``path`` is left as it was.

    Args:
        path: the file to write (its folder is created if needed).
        text: the content, written as UTF-8.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(handle.fileno(), 0o666 & ~umask)
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, atomically."""
    atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
