"""A stage-shaped command for tests/test_distributed.py: on two processes, rank 0 fails with one line.

``python -m launch_probe`` (from tests/): :func:`tasks.launch.other_rank` launches it on two processes;
rank 1 "trains" (nothing) and stops, rank 0 raises the ValueError a bad input would. Not a test module.
"""

from __future__ import annotations

from tasks.common import cli
from tasks.launch import other_rank


def main() -> None:
    """Fail on rank 0 as a stage fails on bad input."""
    if other_rank({"num_processes": 2, "mixed_precision": "no"}, "launch_probe", lambda: None, lambda: None):
        return
    raise ValueError("launch_probe: rank 0 refuses")


if __name__ == "__main__":
    cli(main)
