"""Waiting for a stage on a work pool, with limits: a pool without a live worker, a run no worker starts and a
run whose worker is gone each end the wait with one line naming the stage and the pool.

A worker is live while its heartbeats reach the Prefect server (``prefect worker start`` sends one every
``PREFECT_WORKER_HEARTBEAT_SECONDS``, 30 s by default). params.yaml ``orchestration`` holds the two limits:

- ``start_timeout_s``: how long a stage may wait for a worker of its pool to take it (its flow run Pending or
  Running). Past it the stage's flow run is cancelled (a worker started later runs nothing) and the pipeline
  fails.
- ``lost_worker_s``: how long a running stage's pool may go without a heartbeat from any of its workers. Past
  it the stage's flow run is marked Crashed and the pipeline fails, within ``lost_worker_s`` plus one poll.
  A pool with several workers is watched as a whole: a run whose own worker died while another worker of the
  pool lives is not noticed (Prefect does not record which worker took a flow run).
  A read the server does not answer (busy, or briefly unreachable) is tried again at the next poll; reads that
  fail for ``lost_worker_s`` end the wait the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import FlowRun, Worker
from prefect.states import Cancelled, Crashed

POLL_S = 2.0  # how often the pipeline reads the stage's flow run and its pool's workers


class PoolWaitError(RuntimeError):
    """A stage on a work pool could not run: no live worker, not started in time, or its worker was lost."""


@dataclass(frozen=True)
class PoolLimits:
    """How long the pipeline waits on a work pool (params.yaml ``orchestration``), in seconds."""

    start_timeout_s: float  # a submitted stage no worker took by then is cancelled
    lost_worker_s: float  # a running stage whose pool sent no heartbeat for this long is lost


def pool_limits(params: dict[str, Any]) -> PoolLimits:
    """:class:`PoolLimits` from params.yaml's ``orchestration`` section (numbers, or numbers written as strings).

    Raises:
        ValueError: a limit is missing, not a number, not finite or not above 0 (one line naming the key).
    """
    section = params.get("orchestration") or {}
    values = {}
    for key in ("start_timeout_s", "lost_worker_s"):
        value = section.get(key)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
            raise ValueError(f"params.yaml: orchestration.{key} is {value!r}: it must be a number of seconds above 0")
        values[key] = number
    return PoolLimits(**values)


def live_workers(workers: list[Worker], now: datetime.datetime, within_s: float) -> list[str]:
    """Names of the workers whose last heartbeat is at most ``within_s`` seconds before ``now`` (timezone-aware)."""
    return [
        worker.name
        for worker in workers
        if worker.last_heartbeat_time is not None and (now - worker.last_heartbeat_time).total_seconds() <= within_s
    ]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def check_live_worker(client: SyncPrefectClient, stage: str, pool: str, limits: PoolLimits) -> None:
    """Refuse to submit ``stage`` to ``pool`` when the pool is paused or none of its workers is live.

    Raises:
        PoolWaitError: one line naming the stage, the pool and what to do.
    """
    if client.read_work_pool(pool).is_paused:
        raise PoolWaitError(f"stage {stage}: work pool {pool} is paused (prefect work-pool resume {pool})")
    if not live_workers(client.read_workers_for_work_pool(pool), _now(), limits.lost_worker_s):
        raise PoolWaitError(
            f"stage {stage}: work pool {pool} has no live worker (no heartbeat in {limits.lost_worker_s:.0f} s, "
            f"orchestration.lost_worker_s); start one: prefect worker start --pool {pool}"
        )


def wait_for_stage(
    client: SyncPrefectClient,
    flow_run_id: Any,
    stage: str,
    pool: str,
    limits: PoolLimits,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> FlowRun:
    """Poll the stage's flow run until it ends; cancel it when no worker took it in time (still Scheduled or
    Late), crash it when it runs and its pool is lost.

    A read that fails (the server busy or briefly unreachable: an HTTP error) is tried again at the next poll: a
    stage still running on a live worker must not end the wait, as the pipeline's retry would then submit it a
    second time beside itself. Reads that keep failing for ``lost_worker_s`` end it like a lost worker.

    Returns:
        the flow run in its final state (completed, failed, crashed or cancelled by someone else).

    Raises:
        PoolWaitError: not taken within ``start_timeout_s`` (the run is cancelled first), running while the pool
            sent no heartbeat for ``lost_worker_s`` (the run is marked Crashed first), or no read answered for
            ``lost_worker_s`` (the run is marked Crashed where the server takes it).
    """
    submitted = last_read = clock()
    while True:
        try:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            taken = run.state is not None and (run.state.is_pending() or run.state.is_running())
            lost = taken and not live_workers(client.read_workers_for_work_pool(pool), _now(), limits.lost_worker_s)
        except httpx.HTTPError as err:
            if clock() - last_read <= limits.lost_worker_s:
                sleep(POLL_S)
                continue
            why = f"the Prefect server did not answer for {limits.lost_worker_s:.0f} s ({type(err).__name__})"
            with contextlib.suppress(httpx.HTTPError):
                client.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)
            raise PoolWaitError(f"stage {stage} on work pool {pool}: {why} (orchestration.lost_worker_s)") from err
        last_read = clock()
        if not taken and clock() - submitted > limits.start_timeout_s:
            why = f"no worker of work pool {pool} took it within {limits.start_timeout_s:.0f} s"
            client.set_flow_run_state(flow_run_id, Cancelled(message=why), force=True)
            raise PoolWaitError(f"stage {stage}: {why} (orchestration.start_timeout_s); its flow run is cancelled")
        if lost:
            why = f"its worker is lost: work pool {pool} sent no heartbeat for {limits.lost_worker_s:.0f} s"
            client.set_flow_run_state(flow_run_id, Crashed(message=why), force=True)
            raise PoolWaitError(f"stage {stage}: {why} (orchestration.lost_worker_s); its flow run is marked crashed")
        sleep(POLL_S)
