"""rlhf-housekeeping (tasks/cli/housekeeping.py): what it removes and what it keeps, checked on the files themselves.

Unit tests run against a real MLflow sqlite store (``registry_project``) and real checkpoint folders; the
integration test runs the whole command, ``dvc gc`` and ``mlflow gc`` included, on a small DVC project.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import unicodedata
import urllib.parse

import pytest
import yaml
from conftest import files_as_model
from rich.filesize import decimal
from typer.testing import CliRunner

from tasks.cli import housekeeping
from tasks.cli import registry as registry_cli
from tasks.kit import registry
from tasks.kit.resume import run_checkpointer

NAME = "rlhf-reward-model"


def tracking():
    from tasks.kit.runs import tracking_client

    return tracking_client()


def register_versions(count: int) -> None:
    """``count`` versions of NAME, each a 1 kB folder of its own content logged to a run of its own."""
    client, experiment = tracking()
    for number in range(1, count + 1):
        folder = f"model-{number}"
        files_as_model(folder, bytes([number]) * 1000)
        run_id = client.create_run(experiment).info.run_id
        registry.register(client, NAME, folder, run_id, {registry.SHA_TAG: str(number)})


def files_of(number: int) -> str:
    """The local folder holding version ``number``'s model files."""
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    source = registry.version(tracking()[0], NAME, number).source  # runs:/<run>/model
    return urllib.parse.urlparse(RunsArtifactRepository.get_underlying_uri(source)).path


def test_retention_keeps_aliased_rollback_approval_and_the_newest_and_prunes_the_rest(registry_project):
    register_versions(7)
    client = tracking()[0]
    for number in (2, 3):  # champion 2 -> 3: a rollback returns to 2
        registry.move_alias(client, NAME, number, "gate", "passed")
    client.set_registered_model_alias(NAME, "staging", "4")
    client.set_model_version_tag(NAME, "1", registry.APPROVAL_TAG, "awaiting")
    lines: list[str] = []
    removals, keep_runs = housekeeping.prune_versions(client, NAME, 1, False, lines.append)  # a dry run
    assert [r.what for r in removals] == [f"the model files of {NAME} version {n}" for n in (6, 5)]
    sizes = {n: housekeeping.folder_bytes(files_of(n)) for n in range(1, 8)}  # the MLflow Model: weights and all
    assert [r.size for r in removals] == [sizes[6], sizes[5]] and sizes[6] > 1000
    assert all(os.path.isdir(files_of(n)) for n in range(1, 8))
    assert lines[0] == (
        f"[registry] {NAME} (registry.keep_versions 1): keeps the model files of version 7 (one of the newest 1 "
        "without an alias), 4 (holds staging), 3 (holds champion), 2 (a rollback returns to it), 1 (awaits approval)"
    )
    assert keep_runs == {registry.version(client, NAME, n).run_id for n in (1, 2, 3, 4, 7)}
    removals, _ = housekeeping.prune_versions(client, NAME, 1, True, lines.append)
    assert [os.path.isdir(files_of(n)) for n in range(1, 8)] == [True, True, True, True, False, False, True]
    record = registry.pruned(registry.version(client, NAME, 5))
    assert (record["rule"], record["bytes"], record["by"]) == (
        "registry.keep_versions 1",
        sizes[5],
        "rlhf-housekeeping",
    )
    assert client.get_run(registry.version(client, NAME, 5).run_id).info.lifecycle_stage == "active"  # run kept
    assert housekeeping.prune_versions(client, NAME, 1, True, lines.append)[0] == []  # nothing left to do
    status = CliRunner().invoke(registry_cli.app, ["status", "reward"])
    assert status.exit_code == 0 and status.output.splitlines()[-1] == (
        f"{NAME}: model files pruned by rlhf-housekeeping (registry.keep_versions 1), so they cannot be promoted: "
        "version 5, 6"
    )


def test_promote_or_rollback_to_a_pruned_version_is_refused_in_one_line(registry_project):
    register_versions(3)
    client = tracking()[0]
    for number in (1, 2, 3):  # champion 1 -> 2 -> 3: version 1 is no rollback target yet, so 0 keeps prune it
        registry.move_alias(client, NAME, number, "gate", "passed")
    assert [r.what[-1] for r in housekeeping.prune_versions(client, NAME, 0, True, lambda line: None)[0]] == ["1"]
    runner = CliRunner()
    result = runner.invoke(registry_cli.app, ["promote", "reward", "--version", "1", "--reason", "it was fine"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith(f"registry: {NAME} version 1 cannot hold champion: its model files were pruned on")
    assert "(registry.keep_versions 0)" in result.output
    assert (
        "moved from version 3 to 2" in runner.invoke(registry_cli.app, ["rollback", "reward", "--reason", "r"]).output
    )
    result = runner.invoke(registry_cli.app, ["rollback", "reward", "--reason", "further back"])  # to 1: pruned
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "version 1 cannot hold champion" in result.output
    assert str(registry.holder(client, NAME).version) == "2"


def test_mlflow_gc_is_refused_while_a_deleted_run_holds_files_a_version_keeps(registry_project):
    register_versions(2)
    client = tracking()[0]
    registry.move_alias(client, NAME, 2, "gate", "passed")
    champion_run = registry.version(client, NAME, 2).run_id
    client.delete_run(champion_run)
    keep_runs = housekeeping.prune_versions(client, NAME, 0, False, lambda line: None)[1]
    with pytest.raises(housekeeping.HousekeepingError, match=f"refused: deleted run {champion_run} holds the model"):
        housekeeping.collect_runs(client, "sqlite:///unused.db", keep_runs, True, print)
    assert os.path.isdir(files_of(2))


@pytest.mark.parametrize("value", [-1, "3", True, None, 2.5])
def test_keep_versions_must_be_a_whole_number(value):
    with pytest.raises(housekeeping.HousekeepingError, match=r"registry.keep_versions is .*; it must be a whole"):
        housekeeping.keep_versions({"keep_versions": value})


def make_checkpoint(name: str, inputs: list[str], subfolders: tuple[str, ...] = ("step-00000004",)) -> str:
    """A checkpoint folder as a stage leaves it, made by the stage's own :func:`run_checkpointer`."""
    root = run_checkpointer(name, {"lr": 1e-5}, inputs).root
    for sub in subfolders:
        os.makedirs(os.path.join(root, sub))
        with open(os.path.join(root, sub, "state.pt"), "wb") as handle:
            handle.write(b"s" * 100)
    return root


def test_checkpoints_no_run_can_resume_from_are_removed_and_resumable_ones_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("data")
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "data" / name).write_text("{}\n")
    resumable = make_checkpoint("sft", ["data/a.jsonl"])  # stale stage, same inputs: its next run resumes
    benchmark = make_checkpoint("ablation-vanilla", ["data/a.jsonl"])  # no stage: a rerun with the same args
    up_to_date = make_checkpoint("reward", ["data/a.jsonl"])  # dvc repro does not run an up-to-date stage
    changed = make_checkpoint("ppo", ["data/b.jsonl"], ("step-00000008", "best/step-00000004", "kept/iteration-0004"))
    no_manifest = os.path.join("checkpoints", "judge", "0123456789abcdef")
    os.makedirs(os.path.join(no_manifest, "step-00000001"))
    (tmp_path / "data" / "b.jsonl").write_text('{"other": 1}\n')
    stages, stale = {"sft", "reward", "judge", "ppo"}, {"sft", "judge", "ppo"}
    lines: list[str] = []
    removals = housekeeping.remove_checkpoints(stages, stale, False, lines.append)
    assert all(os.path.isdir(f) for f in (resumable, benchmark, up_to_date, changed, no_manifest))  # a dry run
    assert {r.what: r.why for r in removals} == {
        no_manifest: "no readable manifest.json, so no run can match its fingerprint",
        changed: "changed since it was written: input data/b.jsonl",
        up_to_date: "stage reward is up to date, so dvc repro does not run it",
    }
    assert next(r.size for r in removals if r.what == changed) == 300 + os.path.getsize(f"{changed}/manifest.json")
    assert (
        f"[checkpoints] keep {resumable} (" in lines[-1]
        and "stage sft is stale and its inputs are unchanged" in lines[-1]
    )
    assert any(line.startswith(f"[checkpoints] keep {benchmark}") and "no pipeline stage" in line for line in lines)
    housekeeping.remove_checkpoints(stages, stale, True, lines.append)
    assert sorted(os.listdir("checkpoints")) == ["ablation-vanilla", "sft"]  # emptied stage folders go too
    assert os.path.isdir(os.path.join(resumable, "step-00000004")) and os.path.isdir(benchmark)


def git(project, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=project, check=True)


def dvc(project, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, check=True, capture_output=True)


def cached(project, content: bytes) -> str:
    digest = hashlib.md5(content).hexdigest()
    return os.path.join(project, ".dvc", "cache", "files", "md5", digest[:2], digest[2:])


@pytest.mark.integration
def test_the_command_on_a_small_dvc_project_removes_what_nothing_uses_and_keeps_the_rest(
    tmp_path, empty_db, monkeypatch
):
    """v1 of an out is used by an older commit only, v2 by the branch tip, v3 by the workspace; a run deleted in
    MLflow and a live one; a checkpoint of an up-to-date stage."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = {"step": 1, "mlflow": {"tracking_uri": "sqlite:///mlflow.db", "experiment": "rlhf"},
              "registry": {"reward_model": NAME, "policy_model": "rlhf-policy", "keep_versions": 1}}  # fmt: skip
    (project / ".gitignore").write_text("/mlflow.db\n/mlruns/\n/checkpoints/\n")
    (project / "make.py").write_text(
        "import yaml\nn = yaml.safe_load(open('params.yaml'))['step']\nopen('out.bin', 'w').write(str(n) * 1000)\n"
    )
    stage = {"cmd": f"{sys.executable} make.py", "deps": ["make.py"], "params": ["step"], "outs": ["out.bin"]}
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": stage}}))
    git(project, "init", "-q")
    dvc(project, "init", "-q")
    for step in (1, 2, 3):
        (project / "params.yaml").write_text(yaml.safe_dump({**params, "step": step}))
        dvc(project, "repro", "-q")
        if step < 3:  # v3 stays uncommitted: only the workspace uses it
            git(project, "add", "-A")
            git(project, "commit", "-qm", f"step {step}")
    versions = [cached(str(project), str(n).encode() * 1000) for n in (1, 2, 3)]
    assert all(os.path.isfile(path) for path in versions)
    checkpoint = make_checkpoint("make", ["out.bin"])
    total = 1000 + housekeeping.folder_bytes(checkpoint) + 700  # v1, the checkpoint, the deleted run's notes
    shutil.copy(empty_db, project / "mlflow.db")
    client, experiment = tracking()
    runs = {}
    for kind in ("live", "deleted"):
        runs[kind] = client.create_run(experiment).info
        client.log_text(runs[kind].run_id, kind * 100, "notes.txt")
    client.delete_run(runs["deleted"].run_id)
    folders = {kind: urllib.parse.urlparse(info.artifact_uri).path for kind, info in runs.items()}

    lines: list[str] = []
    assert housekeeping.collect_cache(True, False, lines.append) == []  # --all-commits keeps v1 too
    assert lines == [
        "[dvc gc] nothing to remove: the cache holds only what the workspace, any commit or an experiment uses"
    ]
    runner = CliRunner()
    dry = runner.invoke(housekeeping.app, [])
    assert dry.exit_code == 0, dry.output
    assert all(os.path.exists(path) for path in [*versions, checkpoint, *folders.values()])
    output = dry.output.splitlines()
    assert "[dvc gc] would remove 1 object of the DVC cache (1.0 kB): not used by the workspace, a branch tip, a " \
        "tag or an experiment" in output  # fmt: skip
    assert f"[checkpoints] would remove {checkpoint} (" in dry.output and "stage make is up to date" in dry.output
    deleted = runs["deleted"]
    assert (
        f"[mlflow gc] would remove deleted run {deleted.run_id} ({deleted.run_name}) (700 bytes): deleted in MLflow"
        in dry.output
    )
    assert output[-1] == f"would free {decimal(total)}; removals: 3; a dry run: nothing was removed (--yes)"

    done = runner.invoke(housekeeping.app, ["--yes"])
    assert done.exit_code == 0, done.output
    assert done.output.splitlines()[-1] == f"freed {decimal(total)}; removals: 3"
    assert [os.path.exists(path) for path in versions] == [False, True, True]
    assert not os.path.exists(checkpoint) and not os.path.exists(folders["deleted"])
    assert os.path.isfile(os.path.join(folders["live"], "notes.txt"))
    assert housekeeping.deleted_runs(client) == []
    dvc(project, "status")  # the workspace still checks out: nothing it uses went
    assert "[dvc gc] nothing to remove" in runner.invoke(housekeeping.app, []).output


def test_every_field_registry_commands_print_is_escaped(registry_project):
    # control characters planted in each text field the registry commands read back: the gate's decision, the
    # pruned record's rule, a move's reviewer, reason and pipeline run; none reaches the terminal raw (a metric is a
    # number of its run, printed as one; an old version's metric tag that is not a number is not read)
    from tasks.kit.common import UNPRINTABLE

    raw = "x\x1b[2J\r\u202e"
    register_versions(3)
    client = tracking()[0]
    registry.move_alias(client, NAME, 3, f"by {raw}", f"reason {raw}", pipeline_run=f"run {raw}")
    client.set_model_version_tag(NAME, "3", registry.DECISION_TAG, f"pass {raw}")
    client.set_model_version_tag(NAME, "3", "rlhf.metric.rm/balanced_accuracy", raw)
    record = {"at": raw, "by": raw, "rule": f"registry.keep_versions {raw}", "bytes": 1}
    client.set_model_version_tag(NAME, "1", registry.PRUNED_TAG, json.dumps(record))
    runner = CliRunner()
    for command in (["status", "reward"], ["promote", "reward", "--version", "1", "--reason", raw]):
        output = runner.invoke(registry_cli.app, command).output
        assert raw.encode("unicode_escape").decode() in output, output
        assert not {ch for ch in output if unicodedata.category(ch) in UNPRINTABLE} - {"\n"}, output


def test_two_moves_at_once_take_turns_and_each_records_the_holder_it_moved_from(registry_project, monkeypatch):
    # a 1 s delay between reading the holder and writing the alias (the probe): without the lock both
    # moves recorded "from 1"
    import threading
    import time

    from tasks.kit import alias_lock

    register_versions(3)
    client = tracking()[0]
    registry.move_alias(client, NAME, 1, "gate", "passed")
    holder = registry.holder
    monkeypatch.setattr(registry, "holder", lambda *a, **k: (holder(*a, **k), time.sleep(1))[0])
    threads = [
        threading.Thread(target=registry.move_alias, args=(tracking()[0], NAME, number, "promote", "by hand"))
        for number in (2, 3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    moves = [(m["from"], m["to"]) for m in registry.history(client, NAME)]
    assert moves[0] == (None, "1") and moves[1][0] == "1" and moves[2][0] == moves[1][1], moves  # a chain
    assert str(holder(client, NAME).version) == moves[2][1]
    assert not client.search_registered_models(f"name = '{alias_lock.lock_name(NAME, 'champion')}'")  # released
    # a lock whose holder was killed while it held it is broken after STALE_S; a live one makes the mover wait
    client.create_registered_model(alias_lock.lock_name(NAME, "champion"), description="a killed process")
    monkeypatch.setattr(alias_lock, "WAIT_S", 0.5)
    busy = r"another move of champion of .* \(a killed process\); nothing"
    with pytest.raises(registry.RegistryError, match=busy), alias_lock.alias_lock(client, NAME, "champion", wait_s=0.5):
        pass
    with alias_lock.alias_lock(client, NAME, "champion", stale_s=0.0):
        pass


def test_a_lock_released_between_the_create_and_its_lookup_is_taken_on_the_next_try():
    # MLflow's SQL store answers a refused create by looking the existing model up; when its holder releases it in
    # between, the create raises "not found" (RESOURCE_DOES_NOT_EXIST): the lock is free, not a registry failure
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    from tasks.kit import alias_lock

    class Store:
        def __init__(self):
            self.creates, self.deleted = 0, []

        def create_registered_model(self, name, description):
            self.creates += 1
            if self.creates == 1:
                raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)

        def get_registered_model(self, name):
            raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)

        def delete_registered_model(self, name):
            self.deleted.append(name)

    store = Store()
    with alias_lock.alias_lock(store, NAME, "champion", wait_s=1.0):
        assert store.creates == 2
    assert store.deleted == [alias_lock.lock_name(NAME, "champion")]
