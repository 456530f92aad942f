"""The scheduled deployment on work pools: a real Prefect server on 127.0.0.1, a cpu and a gpu process worker
in two checkouts, DVC carrying the data between them through a local remote (integration)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from test_pipeline import copy_project, set_param

pytestmark = pytest.mark.integration

BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(cwd: str, env: dict, *args: str, timeout: int = 300) -> str:
    result = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args}: {result.stdout[-2000:]} {result.stderr[-2000:]}"
    return result.stdout


def start(cwd: str, env: dict, log: str, *args: str) -> subprocess.Popen:
    with open(log, "w") as handle:
        return subprocess.Popen(list(args), cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen) -> None:
    """A Prefect worker stops on the second SIGINT; the server on the first."""
    for _ in range(2):
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                continue
    if process.poll() is None:
        process.kill()
        process.wait()


def start_server_with_pools(project: str, env: dict, log: str, port: int) -> subprocess.Popen:
    """A Prefect server on 127.0.0.1:``port``, answering, with a ``cpu`` and a ``gpu`` process work pool."""
    server = start(project, env, log, f"{BIN}/prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port))
    for _ in range(90):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    for pool in ("cpu", "gpu"):
        command(project, env, f"{BIN}/prefect", "work-pool", "create", pool, "--type", "process")
    return server


RERUN = ["source", "reward", "gate", "ppo"]  # after a reward param change, for ppo


def test_scheduled_deployment_runs_each_stale_stage_on_its_pool(tiny_run, tmp_path):
    """A finished tiny run, pushed to the DVC remote; then a new reward lr and the deployment run for ppo: the
    stale stages run on their pools (reward and ppo on the gpu host, reading what they need from the remote,
    the gate between them on the cpu host), the rest is not run again."""
    project = copy_project(tiny_run, tmp_path)
    port = free_port()
    env = {
        **os.environ,
        "PATH": BIN + os.pathsep + os.environ["PATH"],
        "PREFECT_HOME": str(tmp_path / "prefect-home"),  # one home: the workers' results are read by the flow
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_URI": f"sqlite:///{project}/mlflow.db",  # one tracking store and registry for both hosts
        "RLHF_PIPELINE_RUN_ID": "",
    }
    command(project, env, sys.executable, "-m", "dvc", "remote", "add", "-d", "store", str(tmp_path / "dvc-remote"))
    command(project, env, sys.executable, "-m", "dvc", "push", "--quiet")
    set_param(project, "  lr: 1.0e-3            # the head's", "  lr: 2.0e-3            # the head's")
    command(project, env, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "remote, reward lr")
    gpu_root = tmp_path / "gpu-host"
    gpu_root.mkdir()
    command(str(gpu_root), env, "git", "clone", "-q", project, "main")
    os.symlink(os.path.realpath(os.path.join(project, "..", "shared")), gpu_root / "shared")
    processes = []
    try:
        processes.append(start_server_with_pools(project, env, str(tmp_path / "server.log"), port))
        command(
            project, env, f"{BIN}/prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"
        )
        for pool, checkout in (("cpu", project), ("gpu", str(gpu_root / "main"))):
            worker_env = {**env, "RLHF_PROJECT": checkout}
            processes.append(start(checkout, worker_env, str(tmp_path / f"worker-{pool}.log"), f"{BIN}/prefect",
                                   "worker", "start", "--pool", pool, "--type", "process"))  # fmt: skip
        trigger = (
            "from prefect.deployments import run_deployment; "
            "run = run_deployment('rlhf-pipeline/scheduled', parameters={'stages': ['ppo']}, "
            "timeout=1200, poll_interval=3); "
            "print(run.state.type.value, run.state.name, run.state.message)"
        )
        out = command(project, env, sys.executable, "-c", trigger, timeout=1300)
        # the fixture's policy gate refused: the run ended as designed, FAILED named Gate failed (what a team's
        # automation on failed runs acts on), not a crash
        ended = "FAILED Gate failed policy gate failed "
        assert out.strip().startswith(ended), out + (tmp_path / "worker-cpu.log").read_text()[-3000:]
        runs = flow_runs(env["PREFECT_API_URL"])
    finally:
        for process in reversed(processes):
            stop(process)
    with open(os.path.join(project, "params.yaml")) as handle:
        pools = yaml.safe_load(handle)["orchestration"]["work_pools"]
    expected = {stage: pools.get(stage, pools["default"]) for stage in RERUN}
    assert {r["stage"]: r["pool"] for r in runs if r["stage"] and r["state"] == "COMPLETED"} == expected
    assert expected["ppo"] == "gpu" and expected["gate"] == "cpu"
    # every output came back to the flow's checkout: ppo and what it needs are up to date there
    status = command(project, env, sys.executable, "-m", "dvc", "status", "--json", "--with-deps", "ppo")
    assert json.loads(status) == {name: ["always changed"] for name in ("source", "gate")}
    assert os.path.exists(os.path.join(project, "models/policy/model.safetensors"))
    with open(os.path.join(project, "models/reward_champion/registry_version.json")) as handle:
        assert json.load(handle)["version"] == "2"  # the gate (cpu) saw the reward model the gpu host registered


def flow_runs(api_url: str) -> list[dict]:
    """Every flow run the Prefect server at ``api_url`` holds: id, deployment name, stage parameter, pool, state
    type and message, start and end (seconds since the epoch). Read in this process: a new Python process per
    read costs seconds of CPU that the workers under test would lose on a 2-core machine."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        names: dict = {}
        runs = []
        for r in client.read_flow_runs():
            if r.deployment_id and r.deployment_id not in names:
                names[r.deployment_id] = client.read_deployment(r.deployment_id).name
            runs.append({"id": str(r.id), "deployment": names.get(r.deployment_id), "stage": r.parameters.get("stage"),
                         "pool": r.work_pool_name, "state": r.state.type.value, "message": r.state.message,
                         "start": r.start_time and r.start_time.timestamp(),
                         "end": r.end_time and r.end_time.timestamp()})  # fmt: skip
        return runs
