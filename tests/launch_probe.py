"""A stage-shaped command for tests/test_distributed.py, launched on two processes by
:func:`tasks.kit.launch.other_rank`.

``python -m launch_probe`` (from tests/) with ``LAUNCH_PROBE`` set to

- ``rank0``: rank 1 "trains" (nothing) and stops, rank 0 raises the ValueError a bad input would;
- ``rank1``: rank 1 raises it while rank 0 waits (the launcher then stops rank 0 with SIGTERM);
- ``hang``: each rank writes its pid to ``LAUNCH_PROBE_PIDS/<rank>`` and waits 5 minutes.

Not a test module.
"""

from __future__ import annotations

import os
import time

from tasks.kit.common import cli
from tasks.kit.launch import other_rank

MODE = os.environ.get("LAUNCH_PROBE", "rank0")


def train() -> None:
    """Rank 1's part."""
    if MODE == "rank1":
        raise ValueError("launch_probe: rank 1 refuses")
    wait()


def wait() -> None:
    """Record this rank's pid (``hang``) and wait."""
    if MODE == "hang":
        with open(os.path.join(os.environ["LAUNCH_PROBE_PIDS"], os.environ["RANK"]), "w") as handle:
            handle.write(str(os.getpid()))
    if MODE != "rank0":
        time.sleep(300)


def main() -> None:
    """Rank 0 fails (``rank0``) or waits."""
    if other_rank({"num_processes": 2, "mixed_precision": "no"}, "launch_probe", train, lambda: None):
        return
    if MODE == "rank0":
        raise ValueError("launch_probe: rank 0 refuses")
    wait()


if __name__ == "__main__":
    cli(main)
