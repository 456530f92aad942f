"""DVC and MLflow beyond one machine: a DVC remote and MLflow artifacts on S3 (moto's server), a shared
`mlflow server` with the registry, all on 127.0.0.1 (integration).

A copy of the finished tiny run reruns the stages that register or read models against the server; the tests
then push and pull its outs, read the registry through the server, and break one thing at a time (a down server,
a wrong credential).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from servers import BUCKET, S3, free_port, mlflow_server, moto_s3, quiet_env
from test_pipeline import STAGES, copy_project, set_param

from tasks.kit.common import cli

pytestmark = pytest.mark.integration

REMOTE = f"s3://{BUCKET}/dvc"
REGISTERED = "rlhf-reward-model"
SERVED_STAGES = ["reward", "gate", "ppo", "evaluate", "report"]  # register, gate or read models; the parent report
CLIENT = {
    # a server that does not answer fails in seconds, not after MLflow's minutes of back-off
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    # downloads stream through the server: moto, with its credential checks on, fails on the presigned S3 URLs
    # that MLflow clients otherwise fetch directly (infra/storage.md)
    "MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD": "false",
}


@dataclass
class Project:
    """The tiny project run against the servers: its folder, the environment its commands get, what they printed."""

    folder: str
    env: dict[str, str]
    server: str
    s3: S3
    logs: list[str]  # the servers' logs
    printed: list[str] = field(default_factory=list)

    def run(self, *args: str, env: dict[str, str] | None = None, cwd: str | None = None, fails: bool = False) -> str:
        """Run ``python -m <args>`` in the project (or ``cwd``); returns stdout + stderr, also kept in ``printed``.
        Fails the test when the exit status is not as expected."""
        result = subprocess.run([sys.executable, "-m", *args], cwd=cwd or self.folder, env=env or self.env,
                                capture_output=True, text=True, timeout=600)  # fmt: skip
        output = result.stdout + result.stderr
        self.printed.append(output)
        assert (result.returncode != 0) == fails, f"{args}: exit {result.returncode}\n{output[-4000:]}"
        return output


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """The folder of the servers' stores and logs."""
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="module")
def s3(served) -> Iterator[S3]:
    """moto's S3 on a free port, stopped after the module."""
    with moto_s3(str(served)) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def server(s3, served) -> Iterator[str]:
    """An `mlflow server` whose artifacts go to ``s3://rlhf/mlflow``; its URI. Stopped after the module."""
    with mlflow_server(str(served), s3) as uri:
        yield uri


@pytest.fixture(scope="module")
def project(s3, server, served, tiny_run, tmp_path_factory) -> Project:
    """A copy of the finished tiny run with the DVC remote ``s3://rlhf/dvc`` committed, and every stage that talks
    to the tracking store and registry run again (`dvc repro --force`) with MLFLOW_TRACKING_URI at the server; AWS
    credentials and endpoint only in the environment."""
    root = tmp_path_factory.mktemp("project")
    folder = copy_project(tiny_run, root)
    env = quiet_env(str(root), **s3.env(), **CLIENT, MLFLOW_TRACKING_URI=server, RLHF_PIPELINE_RUN_ID="")
    ran = Project(folder, env, server, s3, [str(served / "moto.log"), str(served / "mlflow-server.log")])
    ran.run("dvc", "remote", "add", "-d", "store", REMOTE)
    output = ran.run("dvc", "repro", "--force", "--single-item", *SERVED_STAGES)
    assert [stage for stage in STAGES if f"Running stage '{stage}'" in output] == SERVED_STAGES
    subprocess.run(["git", "add", "-A"], cwd=folder, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "ran"], cwd=folder, check=True)
    return ran


def outs(folder: str, cached_only: bool = False) -> list[str]:
    """The outs in ``folder``'s dvc.lock; with ``cached_only`` those DVC caches (a remote carries), not ``cache: false``
    ones."""
    with open(os.path.join(folder, "dvc.yaml")) as handle:
        stages = yaml.safe_load(handle)["stages"].values()
    entries = [entry for stage in stages for kind in ("outs", "metrics", "plots") for entry in stage.get(kind, [])]
    flagged = [item for entry in entries if isinstance(entry, dict) for item in entry.items()]
    uncached = {path for path, flags in flagged if (flags or {}).get("cache") is False} if cached_only else set()
    with open(os.path.join(folder, "dvc.lock")) as handle:
        lock = yaml.safe_load(handle)
    return sorted({out["path"] for stage in lock["stages"].values() for out in stage.get("outs", [])} - uncached)


def hashes(folder: str, paths: list[str]) -> dict[str, str]:
    """sha256 of every file under ``paths`` (files or folders, relative to ``folder``), by relative path."""
    found = {}
    for top in (os.path.join(folder, path) for path in paths):
        files = [os.path.join(root, name) for root, _, names in os.walk(top) for name in names] or [top]
        for path in files:
            with open(path, "rb") as handle:
                found[os.path.relpath(path, folder)] = hashlib.sha256(handle.read()).hexdigest()
    return found


def assert_no_secret(s3: S3, *texts: str) -> None:
    """Neither the S3 secret nor the access key id appears in any of ``texts``."""
    for text in texts:
        assert s3.secret not in text and s3.key_id not in text


def test_the_gate_registers_through_the_server_with_artifacts_on_s3(project):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=project.server)
    champion = client.get_model_version_by_alias(REGISTERED, "champion")
    assert champion.version == "1" and champion.tags["rlhf.gate.decision"] == "pass"
    assert champion.source == f"runs:/{champion.run_id}/model"  # an MLflow Model logged to its run
    # proxied: the server writes S3, not the client
    assert client.get_run(champion.run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    keys = project.s3.keys("mlflow/")
    assert any(key.endswith("/artifacts/model/MLmodel") for key in keys), keys
    assert any("/artifacts/model/artifacts/" in key and key.endswith("/model.safetensors") for key in keys), keys
    with open(os.path.join(project.folder, "models/reward_champion/registry_version.json")) as handle:
        assert json.load(handle)["version"] == "1"
    status = project.run("tasks.cli.registry", "status", "reward")  # the command people run, against the server
    assert f"tracking store {project.server}" in status and f"{REGISTERED}: champion = version 1" in status


def test_evaluate_registers_the_policy_through_the_server_and_the_parent_run_has_the_report(project):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=project.server)
    (version,) = client.search_model_versions("name = 'rlhf-policy'")
    assert version.source == f"runs:/{version.run_id}/model" and "rlhf.gate.decision" in version.tags
    assert client.get_run(version.run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    assert any(key.endswith("/model.safetensors") and f"{version.run_id}/artifacts/model/artifacts/" in key
               for key in project.s3.keys("mlflow/"))  # fmt: skip
    experiment = client.get_experiment_by_name("rlhf").experiment_id
    (parent,) = client.search_runs(experiment, "tags.`rlhf.kind` = 'pipeline'")
    assert "index.html" in [artifact.path for artifact in client.list_artifacts(parent.info.run_id)]


def test_dvc_push_then_pull_into_a_fresh_clone_restores_every_out(project, tmp_path):
    pushed = project.run("dvc", "push")
    assert "pushed" in pushed and project.s3.keys("dvc/files/md5/")
    clone = str(tmp_path / "main")
    subprocess.run(["git", "clone", "-q", project.folder, clone], check=True)
    os.symlink(os.path.realpath(os.path.join(project.folder, "..", "shared")), tmp_path / "shared")
    project.run("dvc", "pull", cwd=clone)
    carried = outs(project.folder, cached_only=True)
    origin = hashes(project.folder, carried)
    assert {"models/reward/model.safetensors", "models/reward_champion/registry_version.json",
            "data/validated/rm_eval.jsonl", "models/policy/model.safetensors"} <= set(origin)  # fmt: skip
    assert any(path.startswith("models/policy_kept/iteration-") for path in origin)  # the kept PPO policies
    assert hashes(clone, carried) == origin


def test_a_new_experiment_with_an_s3_artifact_location_writes_there_itself(project, tmp_path, monkeypatch):
    import mlflow

    from tasks.kit.runs import tracking_client

    location = f"s3://{BUCKET}/direct"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"experiment": "direct",
                                                                     "artifact_location": location}}))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    for name, value in {**project.env, "MLFLOW_TRACKING_URI": project.server}.items():
        if name.startswith(("AWS_", "MLFLOW_")):
            monkeypatch.setenv(name, value)
    client, experiment = tracking_client()
    assert client.get_experiment(experiment).artifact_location == location
    run = client.create_run(experiment)
    (tmp_path / "note.txt").write_text("on S3")
    client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
    assert project.s3.keys("direct/") == [f"direct/{run.info.run_id}/artifacts/note.txt"]
    back = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="note.txt", dst_path=tmp_path)
    assert Path(back).read_text() == "on S3"


def test_dvc_push_with_a_wrong_secret_is_one_line_and_keeps_every_local_file(project):
    before = hashes(project.folder, outs(project.folder))
    wrong = {**project.env, "AWS_SECRET_ACCESS_KEY": "wrong-secret"}
    output = project.run("dvc", "push", env=wrong, fails=True)
    # DVC's own line; at exit s3fs may add a RuntimeWarning about a coroutine never awaited (not an error)
    errors = [line for line in output.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "403" in errors[0] and "Traceback" not in output, output
    assert hashes(project.folder, outs(project.folder)) == before and "wrong-secret" not in output


def test_a_stage_with_its_server_down_or_its_s3_secret_refused_is_one_line_and_keeps_its_outputs(project, tmp_path):
    before = hashes(project.folder, outs(project.folder))
    down = {**project.env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}
    output = project.run("tasks.gate", env=down, fails=True)
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert errors[0].startswith(f"[gate] error: MlflowException: API request to {down['MLFLOW_TRACKING_URI']}/")
    # a new experiment and registered model whose artifacts the stage writes to S3 itself (mlflow.artifact_location),
    # with a secret the object store refuses
    params = os.path.join(project.folder, "params.yaml")
    shutil.copy(params, tmp_path / "params.yaml")
    try:
        set_param(project.folder, "artifact_location: null", f"artifact_location: s3://{BUCKET}/refused")
        set_param(project.folder, "experiment: rlhf", "experiment: refused")
        set_param(project.folder, f"reward_model: {REGISTERED}", "reward_model: refused")
        output = project.run("tasks.gate", env={**project.env, "AWS_SECRET_ACCESS_KEY": "wrong-secret"}, fails=True)
    finally:
        shutil.copy(tmp_path / "params.yaml", params)
    last = output.strip().splitlines()[-1]
    assert last.startswith("[gate] error: S3UploadFailedError: Failed to upload ") and "Traceback" not in output
    assert f" to {BUCKET}/refused/" in last and "SignatureDoesNotMatch" in last, output
    assert hashes(project.folder, outs(project.folder)) == before and "wrong-secret" not in output


def test_no_secret_reaches_params_the_lock_mlflow_or_any_output(project):
    import mlflow

    files = [os.path.join(project.folder, name) for name in ("params.yaml", "dvc.lock", ".dvc/config")]
    client = mlflow.MlflowClient(tracking_uri=project.server)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
    assert runs
    recorded = [repr((run.data.params, run.data.tags)) for run in runs]
    recorded += [repr(v.tags) for v in client.search_model_versions(f"name = '{REGISTERED}'")]
    assert_no_secret(
        project.s3, *(Path(path).read_text() for path in files + project.logs), *recorded, *project.printed
    )


def test_a_secret_in_a_url_is_cut_out_of_the_error_line(capsys):
    from mlflow.exceptions import MlflowException

    def main():
        raise MlflowException("API request to https://ann:hunter2@mlflow.example/api failed\nmore")

    with pytest.raises(SystemExit) as ended:
        cli(main)
    assert ended.value.code == 1
    line = "[test_storage] error: MlflowException: API request to https://mlflow.example/api failed\n"
    assert capsys.readouterr().err == line
