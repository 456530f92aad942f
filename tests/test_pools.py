"""Waiting on a work pool (flows/pools.py) against a stand-in for the Prefect client: the live-worker check, the
start limit and the lost worker. tests/test_pool_limits.py runs the same against a real server and workers. And
a worker killed mid-stage: its flow run's process stops, and the stage with it (flows/deployments.py)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import types
import uuid

import httpx
import pytest
from prefect.client.schemas.objects import Worker
from prefect.states import Completed, Pending, Running, Scheduled

from flows.pools import PoolLimits, PoolWaitError, check_live_worker, live_workers, pool_limits, wait_for_stage

NOW = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)
LIMITS = PoolLimits(start_timeout_s=10, lost_worker_s=30)


def worker(name: str, seconds_ago: float | None) -> Worker:
    beat = None if seconds_ago is None else NOW - datetime.timedelta(seconds=seconds_ago)
    return Worker(name=name, work_pool_id=uuid.uuid4(), last_heartbeat_time=beat)


def test_a_worker_is_live_while_its_last_heartbeat_is_within_the_bound():
    workers = [worker("fresh", 5), worker("edge", 30), worker("stale", 30.5), worker("never", None)]
    assert live_workers(workers, NOW, within_s=30) == ["fresh", "edge"]


@pytest.mark.parametrize("value", [None, "soon", 0, -5, float("nan"), float("inf"), True])
def test_a_limit_that_is_not_a_positive_number_of_seconds_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"^params.yaml: orchestration.start_timeout_s is .*above 0$"):
        pool_limits({"orchestration": {"start_timeout_s": value, "lost_worker_s": 120}})


def test_limits_read_numbers_and_numbers_written_as_strings():
    assert pool_limits({"orchestration": {"start_timeout_s": "600", "lost_worker_s": 1.2e2}}) == PoolLimits(600, 120)


class FakeClient:
    """What wait_for_stage and check_live_worker ask of Prefect's client, with scripted answers."""

    def __init__(self, states=(), workers=(), paused=False, clock=None):
        self.states, self.workers, self.paused, self.clock = list(states), list(workers), paused, clock
        self.set_states = []

    def read_flow_run(self, flow_run_id):
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(state, Exception):  # the server did not answer this read
            raise state
        return types.SimpleNamespace(id=flow_run_id, state=state)

    def read_workers_for_work_pool(self, pool):
        return self.workers

    def read_work_pool(self, pool):
        return types.SimpleNamespace(is_paused=self.paused)

    def set_flow_run_state(self, flow_run_id, state, force=False):
        self.set_states.append((state.type.value, state.message, force))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


@pytest.fixture(autouse=True)
def frozen_now(monkeypatch):
    monkeypatch.setattr("flows.pools._now", lambda: NOW)


def test_nothing_is_submitted_to_a_pool_without_a_live_worker_or_a_paused_one():
    with pytest.raises(PoolWaitError, match=r"^stage sft: work pool gpu has no live worker \(no heartbeat in 30 s"):
        check_live_worker(FakeClient(workers=[worker("old", 31)]), "sft", "gpu", LIMITS)
    with pytest.raises(PoolWaitError, match=r"^stage sft: work pool gpu has no live worker"):
        check_live_worker(FakeClient(workers=[]), "sft", "gpu", LIMITS)
    with pytest.raises(PoolWaitError, match=r"^stage sft: work pool gpu is paused \(prefect work-pool resume gpu\)$"):
        check_live_worker(FakeClient(workers=[worker("w", 1)], paused=True), "sft", "gpu", LIMITS)
    check_live_worker(FakeClient(workers=[worker("w", 1)]), "sft", "gpu", LIMITS)  # a live worker: no error


def test_a_stage_no_worker_starts_in_time_is_cancelled_and_named():
    clock = Clock()
    client = FakeClient(states=[Scheduled()], workers=[worker("w", 1)])
    with pytest.raises(PoolWaitError) as caught:
        wait_for_stage(client, "id", "sft", "gpu", LIMITS, clock=clock, sleep=clock.sleep)
    assert str(caught.value) == (
        "stage sft: no worker of work pool gpu took it within 10 s (orchestration.start_timeout_s); "
        "its flow run is cancelled"
    )
    assert client.set_states == [("CANCELLED", "no worker of work pool gpu took it within 10 s", True)]
    assert 10 < clock.now <= 12  # one poll (2 s) past the limit at most


def test_a_running_stage_whose_pool_went_silent_is_marked_crashed_and_named():
    clock = Clock()
    client = FakeClient(states=[Pending(), Running()], workers=[worker("w", 31)])
    with pytest.raises(PoolWaitError, match=r"^stage ppo: its worker is lost: work pool gpu sent no heartbeat for 30"):
        wait_for_stage(client, "id", "ppo", "gpu", LIMITS, clock=clock, sleep=clock.sleep)
    assert client.set_states == [("CRASHED", "its worker is lost: work pool gpu sent no heartbeat for 30 s", True)]


def test_a_stage_that_starts_and_ends_while_its_worker_lives_is_returned_untouched():
    clock = Clock()
    # taken at 6 s (< 10), its process starting for 20 s and running 40 s (both past the start limit)
    states = [Scheduled()] * 3 + [Pending()] * 10 + [Running()] * 20 + [Completed()]
    client = FakeClient(states=states, workers=[worker("w", 3)])
    run = wait_for_stage(client, "id", "sft", "gpu", LIMITS, clock=clock, sleep=clock.sleep)
    assert run.state.is_completed() and client.set_states == []


def test_reads_that_fail_for_a_while_do_not_end_the_wait_on_a_running_stage():
    # a busy server: 20 s of failed reads (within lost_worker_s, 30) while the stage runs on a live worker; ending
    # the wait here would let the pipeline's retry submit the stage again beside itself
    clock = Clock()
    timeout = httpx.ReadTimeout("timed out")
    states = [Running()] * 2 + [timeout] * 10 + [Running()] * 2 + [Completed()]
    client = FakeClient(states=states, workers=[worker("w", 3)])
    run = wait_for_stage(client, "id", "sft", "gpu", LIMITS, clock=clock, sleep=clock.sleep)
    assert run.state.is_completed() and client.set_states == [] and clock.now == 28


def test_reads_that_keep_failing_end_the_wait_like_a_lost_worker():
    clock = Clock()
    client = FakeClient(states=[Running(), httpx.ConnectError("refused")], workers=[worker("w", 3)])
    with pytest.raises(PoolWaitError) as caught:
        wait_for_stage(client, "id", "ppo", "gpu", LIMITS, clock=clock, sleep=clock.sleep)
    why = "the Prefect server did not answer for 30 s (ConnectError)"
    assert str(caught.value) == f"stage ppo on work pool gpu: {why} (orchestration.lost_worker_s)"
    assert client.set_states == [("CRASHED", why, True)] and 30 < clock.now <= 34


def test_a_worker_refuses_an_uncommitted_tree_naming_the_whole_path(tmp_path, monkeypatch):
    import subprocess

    from flows.deployments import clean_revision

    monkeypatch.chdir(tmp_path)
    for name in ("params.yaml", "dvc.lock"):
        (tmp_path / name).write_text("a: 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run([*git, *args], check=True)
    (tmp_path / "dvc.lock").write_text("a: 2\n")
    assert len(clean_revision()) == 40  # dvc.lock travels with the request: not a difference
    (tmp_path / "params.yaml").write_text("a: 2\n")  # git status: " M params.yaml", a leading space
    with pytest.raises(RuntimeError, match=r"runs the committed tree, and params\.yaml differs$"):
        clean_revision()


STAGE_UNDER_A_WORKER = """
import subprocess, sys
from flows.deployments import stop_with_worker
stop_with_worker(0.1)
stage = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("stage", stage.pid, flush=True)
stage.wait()
"""


A_WORKER = (
    f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {STAGE_UNDER_A_WORKER!r}]); time.sleep(120)"
)


def test_a_flow_run_whose_worker_is_killed_stops_with_the_stage_it_runs():
    import psutil

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    # a worker starts a flow run's process, which runs a stage; then the worker is killed (SIGKILL)
    lost = subprocess.Popen([sys.executable, "-c", A_WORKER], env=env, stdout=subprocess.PIPE, text=True)
    stage = int(lost.stdout.readline().split()[1])
    flow_run = psutil.Process(stage).ppid()
    lost.kill()
    lost.wait()

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 15
    while not (gone(stage) and gone(flow_run)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(stage) and gone(flow_run)
