"""Prefect flows that run the DVC stages."""

import os

import tasks as tasks  # sets the no-telemetry environment before Prefect is imported

# A fresh ephemeral API server (a flow run with no PREFECT_API_URL) first migrates its database. On a busy 2-core
# machine that took more than Prefect's 20 s, and the flow failed with "Timed out while attempting to connect to
# ephemeral Prefect API server" before any stage ran (the two-process flow test in a CI run). Set before Prefect
# reads its settings; the environment still wins.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
