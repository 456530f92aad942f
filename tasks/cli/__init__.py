"""The console commands (pyproject's scripts): ``rlhf-registry``, ``rlhf-model``, ``rlhf-review`` and
``rlhf-housekeeping``; each also runs as ``python -m tasks.cli.<command>``."""
