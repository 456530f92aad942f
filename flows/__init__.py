"""Prefect flows that run the DVC stages."""

import tasks as tasks  # sets the no-telemetry environment before Prefect is imported
