"""The reward-model gate stage and the registry command against a real MLflow store (sqlite, no server).

The stage's pieces run in-process on a project folder with tiny models: register, decide once, re-score the
champion on the current split, write the champion, promote and roll back by hand, the no-champion stop,
and the experiment rule. The whole stage under DVC is in tests/test_pipeline.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import yaml
from conftest import PAIR, files_as_model
from typer.testing import CliRunner

from rlhf.models.loading import load_scalar_model
from tasks import gate
from tasks.cli import registry as registry_cli
from tasks.kit import registry, served
from tasks.kit.champion import MARKER, OUT_DIR, VERSION_FILE, is_champion, require_champion
from tasks.kit.outputs import StagedOutputs

NAME = "rlhf-reward-model"
GOOD = {"rm/accuracy": 150 / 196, "rm/pairs": 196.0, "rm/ece": 0.05, "rm/accuracy_chosen_shorter": 0.7,
        "rm/accuracy_chosen_longer": 0.6, "rm/pairs_chosen_shorter": 100.0, "rm/pairs_chosen_longer": 96.0,
        "rm/balanced_accuracy": 0.65, "rm/balanced_accuracy_low": 0.58,
        "rm/kind/harmless/balanced_accuracy": 0.66, "rm/kind/harmless/balanced_accuracy_low": 0.56,
        "rm/kind/helpful/balanced_accuracy": 0.64, "rm/kind/helpful/balanced_accuracy_low": 0.55}  # fmt: skip
BAD = {**GOOD, "rm/accuracy": 100 / 196, "rm/balanced_accuracy_low": 0.441}  # not better than chance


def new_candidate(metrics: dict[str, float], seed: int) -> None:
    """A reward model with other weights (so another content hash) in models/reward, and its metrics."""
    torch.manual_seed(seed)
    model = load_scalar_model("models/reward")
    torch.nn.init.normal_(model.score.weight)
    model.save_pretrained("models/reward")
    os.makedirs("metrics", exist_ok=True)
    with open("metrics/reward.json", "w") as handle:
        json.dump(metrics, handle)


def run_gate(params_override=None) -> dict:
    """The gate stage's work, as its main() does it, in a run of its own."""
    from tasks.kit.params import stage_params
    from tasks.kit.runs import tracking_client

    client, experiment = tracking_client()
    run_id = client.create_run(experiment).info.run_id
    params = {**stage_params("registry"), **(params_override or {})}
    with StagedOutputs() as outputs:
        report = gate.run(params, stage_params("reward"), stage_params("device"), outputs, run_id)
    return report


def client():
    from tasks.kit.runs import tracking_client

    return tracking_client()[0]


def test_a_passing_candidate_becomes_champion_once_and_a_rerun_leaves_its_files_untouched(registry_project):
    new_candidate(GOOD, 1)
    report = run_gate()
    assert (report["decision"], report["decided"], report["champion"]["version"]) == ("pass", "now", "1")
    assert require_champion()["sha256"] == registry.folder_sha256("models/reward")
    files = sorted(os.listdir(OUT_DIR))
    assert VERSION_FILE in files and "model.safetensors" in files
    stamp = os.stat(os.path.join(OUT_DIR, "model.safetensors")).st_mtime_ns
    again = run_gate()
    assert (again["decision"], again["decided"]) == ("pass", "before")  # never re-decided
    assert json.dumps(again, allow_nan=False)
    assert os.stat(os.path.join(OUT_DIR, "model.safetensors")).st_mtime_ns == stamp
    moves = registry.history(client(), NAME)
    assert [(m["from"], m["to"], m["by"]) for m in moves] == [(None, "1", "gate")]
    found = client().get_model_version(NAME, "1")
    tags = found.tags
    assert tags[registry.DECISION_TAG] == "pass" and not [k for k in tags if k.startswith("rlhf.metric.")]
    assert registry.version_metrics(client(), found)["rm/pairs"] == 196.0  # a metric of its run, not a tag
    assert tags[registry.SHA_TAG] == registry.folder_sha256("models/reward") and tags["rlhf.pipeline_run_id"]


def test_a_version_is_an_mlflow_model_pyfunc_loads_and_its_decision_reads_as_a_sentence(registry_project):
    import mlflow
    import pandas as pd

    from rlhf.data.chat import encode_chat
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.shared_prompt import score_sequences
    from rlhf.runtime.device import Runtime

    new_candidate(BAD, 2)
    run_gate()
    found = client().get_model_version(NAME, "1")
    assert found.source == f"runs:/{found.run_id}/model"  # relative to its run, not to this machine's folders
    reason = found.tags[registry.REASON_TAG]
    assert reason.startswith("reward gate failed 1 of ") and reason.endswith(
        "checks: rm_eval balanced accuracy lower 95% bound (stratified bootstrap)"
    )
    assert found.description.startswith(f"{reason}.\n\n- GATE FAILED: rm_eval balanced accuracy lower 95% bound")
    assert found.description.count("\n- gate passed: ") == 4  # every check, a line each
    uri = f"models:/{NAME}/1"
    assert mlflow.models.get_model_info(uri).signature.inputs.input_names() == ["prompt", "response", "kind"]
    local = mlflow.artifacts.download_artifacts(f"{uri}/MLmodel")
    with open(local) as handle:
        assert str(registry_project) not in handle.read()  # no folder of this machine in the model's files
    rows = pd.DataFrame({"prompt": ["Is it safe?"] * 2, "response": ["Yes.", "No, never."], "kind": ["harmless", None]})
    rewards = mlflow.pyfunc.load_model(uri).predict(rows)
    tokenizer, model = load_tokenizer("models/reward"), load_scalar_model("models/reward")
    ids = [
        encode_chat(tokenizer, PAIR["prompt"], [{"role": "assistant", "content": r}], 64).input_ids
        for r in rows.response
    ]
    expected = score_sequences(model, tokenizer, ids, 8, Runtime(torch.device("cpu")))
    assert rewards == pytest.approx(expected.tolist(), abs=1e-5)  # the reward stage's own reading


def test_a_failing_candidate_keeps_the_champion_rescored_on_the_current_split(registry_project, capsys):
    new_candidate(GOOD, 1)
    run_gate()
    stamp = os.stat(os.path.join(OUT_DIR, "model.safetensors")).st_mtime_ns
    new_candidate(BAD, 2)
    report = run_gate()
    assert (report["decision"], report["champion"]["version"], report["champion_compared"]) == ("fail", "1", "1")
    # the champion was scored again on this rm_eval (two pairs, one of each length kind), not read from its tags
    assert report["champion_accuracy"] in (0.0, 0.5, 1.0) and report["champion_balanced_accuracy"] in (0.0, 0.5, 1.0)
    failed = [line for line in gate.report_lines(report) if "GATE FAILED" in line]
    assert failed[0].startswith(
        "[gate] GATE FAILED: rm_eval balanced accuracy lower 95% bound (stratified bootstrap), 0.441, bound 0.500"
    )
    assert os.stat(os.path.join(OUT_DIR, "model.safetensors")).st_mtime_ns == stamp  # untouched
    assert str(registry.holder(client(), NAME).version) == "1"


def test_a_bound_written_as_dvc_exp_run_writes_it_gives_a_decision(registry_project):
    # `dvc exp run -S registry.reward_gate.max_ece=0.00001` writes 1e-05, which YAML 1.1 reads as a string:
    # the gate ended in a TypeError; read as YAML 1.2 it is a number and the gate decides on it
    text = (registry_project / "params.yaml").read_text()
    assert "max_ece: 0.15" in text
    (registry_project / "params.yaml").write_text(text.replace("max_ece: 0.15", "max_ece: 1e-05", 1))
    new_candidate(GOOD, 1)  # ECE 0.05 > 1e-05
    report = run_gate()
    assert report["decision"] == "fail"
    assert "[gate] GATE FAILED: rm_eval calibration error (ECE), 0.050, bound 0.000" in gate.report_lines(report)


def test_promote_and_rollback_by_hand_are_recorded_and_survive_the_next_gate_run(registry_project):
    new_candidate(GOOD, 1)
    run_gate()
    new_candidate(BAD, 2)
    run_gate()
    runner = CliRunner()
    result = runner.invoke(registry_cli.app, ["promote", "reward", "--version", "2", "--reason", "reviewed by hand"])
    assert result.exit_code == 0, result.output
    assert "moved from version 1 to 2" in result.output
    report = run_gate()  # does not re-decide version 2 (failed) and does not undo the move
    assert (report["decided"], report["decision"], require_champion()["version"]) == ("before", "fail", "2")
    assert registry.folder_sha256(OUT_DIR) != ""  # written from the registry
    reason = "version 2 misbehaves\n\x1b[2J\x1b[31mcleared\u202e"  # a newline, terminal codes, a BiDi override
    result = runner.invoke(registry_cli.app, ["rollback", "reward", "--reason", reason])
    assert result.exit_code == 0, result.output
    run_gate()
    assert require_champion()["version"] == "1"
    assert registry.history(client(), NAME)[-1]["reason"] == reason  # stored as typed
    status = runner.invoke(registry_cli.app, ["status", "reward"])
    assert status.exit_code == 0 and "champion = version 1 (gate: pass)" in status.output
    assert status.output.startswith(f"project {registry_project}, tracking store sqlite:///")
    assert [line.split("  ")[2] for line in status.output.splitlines()[2:]] == ["(none) -> 1", "1 -> 2", "2 -> 1"]
    assert "by rollback: version 2 misbehaves\\n\\x1b[2J\\x1b[31mcleared\\u202e" in status.output  # shown escaped
    assert "\x1b" not in status.output + result.output and "\u202e" not in status.output


def test_registry_command_errors_are_one_line(registry_project, tmp_path_factory, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(registry_cli.app, ["status", "reward"])  # nothing registered yet
    assert result.exit_code == 1 and result.output.strip().startswith("registry: registered model rlhf-reward-model")
    new_candidate(GOOD, 1)
    run_gate()
    result = runner.invoke(registry_cli.app, ["promote", "reward", "--version", "7", "--reason", "x"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1 and "version 7" in result.output
    result = runner.invoke(registry_cli.app, ["rollback", "reward", "--reason", "x"])
    assert result.exit_code == 1 and "no earlier holder" in result.output
    result = runner.invoke(registry_cli.app, ["promote", "reward", "--version", "1", "--reason", " "])
    assert result.exit_code == 1 and "--reason must say why" in result.output
    # from another folder, naming the project
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    result = runner.invoke(registry_cli.app, ["status", "reward", "--project", str(registry_project)])
    assert result.exit_code == 0 and "champion = version 1" in result.output
    # a tracking server that is down: one line, in seconds
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    result = runner.invoke(registry_cli.app, ["status", "reward", "--project", str(registry_project)])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("registry: ")


def test_an_over_long_reason_is_refused_before_anything_moves_and_params_are_kept_whole(registry_project):
    new_candidate(GOOD, 1)
    run_gate()
    new_candidate(BAD, 2)
    run_gate()
    runner = CliRunner()
    result = runner.invoke(registry_cli.app, ["promote", "reward", "--version", "2", "--reason", "why " * 2500])
    assert result.exit_code == 1 and result.output.strip() == (
        "registry: the reason is 9,999 characters, over the 1,000 recorded; nothing moved: shorten it (a link to a "
        "ticket or document can hold the rest)"
    )
    assert str(registry.holder(client(), NAME).version) == "1" and len(registry.history(client(), NAME)) == 1
    with pytest.raises(registry.RegistryError, match="who moved it is 201 characters, over 200; nothing moved"):
        registry.move_alias(client(), NAME, "2", "x" * 201, "a reason")
    assert str(registry.holder(client(), NAME).version) == "1"
    # the params: a hash on the version, the whole file (longer than a tag's 5,000 characters) with its run
    from tasks.kit.params import stage_params

    found = client().get_model_version(NAME, "1")
    with open(client().download_artifacts(found.run_id, registry.PARAMS_ARTIFACT, str(registry_project))) as handle:
        params = json.load(handle)
    assert params == json.loads(json.dumps(stage_params("reward"), default=str))
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, indent=1).encode()).hexdigest()
    assert found.tags[registry.PARAMS_TAG] == digest and "rlhf.params" not in found.tags


def start_together(folder, extra_env: dict[str, str]) -> None:
    """Four processes (tests/store_worker.py) create the experiment, the pipeline's parent run and the registered
    model at the same moment; each must succeed, with one registered model of four versions and one parent."""
    files_as_model(folder / "folder", b"w")
    worker = os.path.join(os.path.dirname(__file__), "store_worker.py")
    env = {
        **os.environ,
        **extra_env,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]),
    }
    workers = [
        subprocess.Popen(
            [sys.executable, worker, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for i in range(4)
    ]
    while not all(os.path.exists(f"ready-{i}") for i in range(4)):
        time.sleep(0.05)
    open("go", "w").close()
    results = [worker.communicate(timeout=300) for worker in workers]
    failed = [i for i, worker in enumerate(workers) if worker.returncode]
    for i in failed:  # shown whole under "Captured stdout": an assertion message is cut in the middle
        print(f"worker {i} exited {workers[i].returncode}\nstdout:\n{results[i][0]}\nstderr:\n{results[i][1]}")
    assert not failed, [results[i][1].strip().splitlines()[-1:] for i in failed]
    assert sorted(int(out.split()[-1]) for out, _ in results) == [1, 2, 3, 4]  # one registered model, 4 versions
    from tasks.kit.runs import PIPELINE_RUN_TAG, tracking_client

    store, experiment = tracking_client()
    parents = store.search_runs(
        [experiment], filter_string=f"tags.`{PIPELINE_RUN_TAG}` = 'gate-test' and tags.`rlhf.kind` = 'pipeline'"
    )
    assert len(parents) == 1 and len(store.search_experiments()) == 2  # Default and the project's


def test_stages_that_open_a_new_sqlite_store_together_all_succeed(registry_project):
    # MLflow's table setup on a file that does not exist yet, and each check-then-create, would race
    os.remove("mlflow.db")
    start_together(registry_project, {})


@pytest.mark.integration
def test_stages_that_start_together_against_a_tracking_server_with_two_workers_all_succeed(
    registry_project, monkeypatch
):
    # two server processes answer the four clients: each create-if-missing meets RESOURCE_ALREADY_EXISTS
    from servers import free_port, quiet_env, serving

    port = free_port()
    folder = str(registry_project)
    args = [
        f"{os.path.dirname(sys.executable)}/mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "2",
        "--backend-store-uri",
        f"sqlite:///{folder}/server.db",
        "--artifacts-destination",
        f"{folder}/server-artifacts",
    ]
    uri = f"http://127.0.0.1:{port}"
    with serving(args, quiet_env(folder), os.path.join(folder, "mlflow-server.log"), f"{uri}/health"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        start_together(registry_project, {"MLFLOW_TRACKING_URI": uri})


def test_a_tracking_server_that_died_fails_a_download_in_seconds_with_the_cause_in_its_line(
    registry_project, monkeypatch
):
    from servers import free_port, quiet_env, serving

    from tasks.kit.runs import SERVER_PATIENCE

    for name in SERVER_PATIENCE:  # the product's defaults, not this machine's: removed again after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    port, folder = free_port(), str(registry_project)
    uri = f"http://127.0.0.1:{port}"
    args = [f"{os.path.dirname(sys.executable)}/mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--backend-store-uri", f"sqlite:///{folder}/server.db", "--artifacts-destination", f"{folder}/art"]
    with serving(args, quiet_env(folder), os.path.join(folder, "mlflow-server.log"), f"{uri}/health"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        new_candidate(GOOD, 1)
        run_gate()
        store = client()
        found = registry.version(store, NAME, 1)
    os.makedirs("fetched")  # the server is gone: MLflow's own defaults retried for 272 s
    started = time.monotonic()
    with pytest.raises(registry.RegistryError) as failure:
        registry.download(store, found, "fetched")
    assert time.monotonic() - started < 30
    message = str(failure.value)
    assert "\n" not in message and message.startswith(f"registry: download {NAME} version 1: ")
    assert "Connection refused" in message or "Max retries exceeded" in message, message  # the cause, not cut


@pytest.mark.parametrize(
    "error, reason",
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            "the disk is full (OSError: [Errno 28] No space left on device)",
        ),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "tracking server unreachable (ConnectionRefusedError:"),
    ],
)
def test_a_registry_call_that_fails_with_an_os_error_names_the_cause(error, reason):
    def call():
        raise error

    with pytest.raises(registry.RegistryError) as failure:
        registry._guard("register rlhf-reward-model", call)
    assert str(failure.value).startswith(f"registry: register rlhf-reward-model: {reason}")


def test_a_download_that_would_fill_the_disk_is_refused_before_it_starts_naming_the_sizes(
    registry_project, monkeypatch
):
    # MLflow turns a download that ran out of disk into "please ensure that the path is correct"
    new_candidate(GOOD, 1)
    run_gate()
    store = client()
    found = registry.version(store, NAME, 1)
    weights = sum(os.path.getsize(os.path.join("models/reward", name)) for name in os.listdir("models/reward"))
    needed = registry.artifact_bytes(found.source)
    assert weights <= needed < weights + 200_000  # the model's files and MLflow's few small ones
    os.makedirs("fetched")
    monkeypatch.setattr(registry.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 5e5, 5e5))
    with pytest.raises(registry.RegistryError) as failure:
        registry.download(store, found, "fetched")
    assert str(failure.value) == (
        f"registry: download {NAME} version 1: its {needed / 1e6:,.0f} MB do not fit in the 0 MB free on "
        f"{os.path.abspath('.')}'s disk; free some space (rlhf-housekeeping --yes deletes old versions' model files)"
    )
    assert os.listdir("fetched") == []


def test_a_damaged_champion_in_the_store_is_refused_before_it_is_rescored_and_a_damaged_folder_in_one_line(
    registry_project,
):
    new_candidate(GOOD, 1)
    run_gate()
    champion = client().get_model_version(NAME, "1")
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    files = RunsArtifactRepository.get_underlying_uri(champion.source).removeprefix("file://")  # the MLflow Model's
    stored = os.path.join(served.weights_folder(files), "model.safetensors")
    with open(stored, "r+b") as handle:  # truncated in the artifact store
        handle.truncate(os.path.getsize(stored) // 2)
    new_candidate(GOOD, 2)  # the champion is downloaded to be re-scored against it
    with pytest.raises(registry.RegistryError) as failure:
        run_gate()
    assert str(failure.value).startswith(
        f"registry: {NAME} version 1 downloaded with other content than registered (sha256 "
    )
    shutil.copy(stored, "models/reward/model.safetensors")  # a local folder: one line, not a SafetensorError
    with pytest.raises(
        ValueError, match=r"^models/reward: cannot load the model \(\w+: .*\): the folder is incomplete"
    ):
        load_scalar_model("models/reward")


def test_no_champion_writes_a_marker_and_ppo_stops_with_the_promote_command(registry_project):
    import tasks.ppo
    from tasks.kit.params import stage_params

    new_candidate(BAD, 2)
    report = run_gate()
    assert report["decision"] == "fail" and report["champion"] is None
    assert os.listdir(OUT_DIR) == [MARKER]
    with pytest.raises(ValueError, match=r"rlhf-registry promote reward --version 1 --reason"):
        tasks.ppo.run(stage_params("ppo"), stage_params("generation"), print)


def test_without_a_champion_the_demo_trains_against_the_failed_candidate_marked_and_its_policy_fails(
    registry_project, capsys
):
    new_candidate(BAD, 2)
    report = run_gate({"without_champion": "candidate"})
    held = report["champion"]
    assert report["decision"] == "fail" and report["gate/champion_version"] is None
    assert held["version"] == "1" and held["champion"] is False and held["why"] == "failed its gate"
    assert require_champion() == held and not is_champion(held)  # ppo and evaluate read the candidate's files
    assert os.path.isfile(os.path.join(OUT_DIR, "model.safetensors")) and MARKER not in os.listdir(OUT_DIR)
    assert gate.report_lines(report)[-1] == (
        "[gate] champion: none; ppo and evaluate read candidate version 1, which failed its gate "
        "(registry.without_champion: candidate): the policy gate will fail what they make"
    )
    assert client().get_registered_model(NAME).aliases == {}  # the alias never moves
    with pytest.raises(ValueError, match=r"^registry.without_champion must be one of stop, candidate, got 'go'$"):
        run_gate({"without_champion": "go"})


@pytest.mark.parametrize(
    ("change", "line"),
    [({"reward_gate": {"min_acuracy_low": 0.5}}, "section 'registry.reward_gate' has unknown keys ['min_acuracy_low']"),
     ({"without_champion": "go"}, "registry.without_champion must be one of stop, candidate, got 'go'")],
)  # fmt: skip
def test_a_bad_gate_setting_stops_the_stage_before_its_mlflow_run_opens(registry_project, change, line):
    params = yaml.safe_load((registry_project / "params.yaml").read_text())
    params["registry"].update(change)
    (registry_project / "params.yaml").write_text(yaml.safe_dump(params))
    runs_before = client().search_runs([e.experiment_id for e in client().search_experiments()])
    with pytest.raises(ValueError, match=re.escape(line)):
        gate.main()
    assert client().search_runs([e.experiment_id for e in client().search_experiments()]) == runs_before
    assert not os.path.exists(OUT_DIR) and client().search_registered_models() == []


def test_a_champion_alias_removed_by_hand_is_named_as_the_cause(registry_project):
    new_candidate(GOOD, 1)
    assert run_gate()["champion"]["version"] == "1"
    client().delete_registered_model_alias(NAME, "champion")  # a person, in the MLflow UI
    report = run_gate()
    assert (report["decided"], report["decision"], report["champion"]) == ("before", "pass", None)
    with open(os.path.join(OUT_DIR, MARKER)) as handle:
        message = json.load(handle)["message"]
    assert (
        "(the last candidate, version 1, passed its gate and took the alias, which was removed in the registry"
        in message
    )
    assert "experiment" not in message  # it used to blame a DVC experiment


def test_a_version_deleted_by_hand_keeps_its_history_and_its_content_stays_out_until_restored(registry_project):
    new_candidate(GOOD, 1)
    assert run_gate()["champion"]["version"] == "1"
    client().delete_model_version(NAME, "1")  # a person, in the MLflow UI
    assert [(m["from"], m["to"], m["by"]) for m in registry.history(client(), NAME)] == [(None, "1", "gate")]
    with pytest.raises(registry.RegistryError) as failure:  # the same bytes are still in models/reward
        run_gate()
    assert str(failure.value) == (
        f"registry: this content was {NAME} version 1, which was deleted from the registry; it is not registered "
        'again until a person restores it: rlhf-registry restore reward --version 1 --reason "..." (or retrain)'
    )
    assert client().search_model_versions(f"name = '{NAME}'") == []  # nothing registered again
    runner = CliRunner()
    result = runner.invoke(registry_cli.app, ["restore", "reward", "--version", "1", "--reason", "deleted by mistake"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == [
        f"{NAME}: version 1 restored as version 2 (gate: pass), tags kept",  # the model exists: MLflow numbers it
        f"{NAME}: champion -> version 2, as before the deletion",
    ]
    again = runner.invoke(registry_cli.app, ["restore", "reward", "--version", "1", "--reason", "twice"])
    assert again.output.strip() == f"registry: {NAME} version 1 was restored as version 2; nothing to do"
    restored = client().get_model_version(NAME, "2")
    assert json.loads(restored.tags[registry.RESTORED_TAG])["version"] == "1"
    assert restored.tags[registry.SHA_TAG] and restored.description.startswith("reward gate passed all 5 checks.")
    report = run_gate()  # the restored version's decision came back with it: not decided again, champion kept
    assert (report["candidate"]["version"], report["decided"], report["champion"]["version"]) == ("2", "before", "2")
    assert [(m["to"], m["by"]) for m in registry.history(client(), NAME)] == [("1", "gate"), ("2", "restore")]


def test_a_registered_model_deleted_whole_stays_deleted_and_keeps_its_history_until_restored(registry_project):
    new_candidate(GOOD, 1)
    run_gate()
    new_candidate({**GOOD, "rm/balanced_accuracy": 0.66}, 2)
    assert run_gate()["champion"]["version"] == "2"
    client().delete_registered_model(NAME)  # a person, in the MLflow UI: every version and alias with it
    moves = [(m["from"], m["to"], m["by"]) for m in registry.history(client(), NAME)]
    assert moves == [(None, "1", "gate"), ("1", "2", "gate")]  # the history outlives the model
    status = CliRunner().invoke(registry_cli.app, ["status", "reward"])
    assert status.exit_code == 0 and "1 -> 2" in status.output, status.output
    with pytest.raises(registry.RegistryError) as failure:  # models/reward still holds version 2's bytes
        run_gate()
    assert str(failure.value) == (
        f"registry: this content was {NAME} version 2, which was deleted with the whole {NAME}; it is not "
        'registered again until a person restores it: rlhf-registry restore reward --reason "..." (or retrain)'
    )
    promote = CliRunner().invoke(registry_cli.app, ["promote", "reward", "--version", "1", "--reason", "r"])
    assert promote.exit_code == 1 and promote.output.strip() == (
        f'registry: {NAME} was deleted from the registry whole; rlhf-registry restore reward --reason "..." brings '
        "every version back with its aliases, then move it"
    )
    assert client().search_registered_models(f"name = '{NAME}'") == []  # not created again
    restored = CliRunner().invoke(registry_cli.app, ["restore", "reward", "--reason", "a mistake"])  # all of it
    assert restored.exit_code == 0 and restored.output.splitlines()[1:] == [
        f"{NAME}: version 1 restored as version 1 (gate: pass), tags kept",
        f"{NAME}: version 2 restored as version 2 (gate: pass), tags kept",
        f"{NAME}: champion -> version 2, as before the deletion",
    ]
    report = run_gate()  # models/reward is version 2's content, decided before: nothing re-decided
    assert (report["candidate"]["version"], report["decided"], report["champion"]["version"]) == ("2", "before", "2")
    assert [m["to"] for m in registry.history(client(), NAME)] == ["1", "2", "2"]


def test_a_restore_brings_back_a_promotion_by_hand_and_a_rerun_keeps_it(registry_project):
    # the case: v2 failed its gate and a person promoted it from v1; the model was deleted whole; restore
    # and a rerun used to register only models/reward's content and hand the champion back to v1's
    new_candidate(GOOD, 1)
    run_gate()
    new_candidate(BAD, 2)
    assert run_gate()["decision"] == "fail"
    runner = CliRunner()
    assert (
        runner.invoke(registry_cli.app, ["promote", "reward", "--version", "2", "--reason", "read it"]).exit_code == 0
    )
    before = {v.version: v.tags for v in client().search_model_versions(f"name = '{NAME}'")}
    client().delete_registered_model(NAME)
    result = runner.invoke(registry_cli.app, ["restore", "reward", "--reason", "deleted by mistake"])
    assert result.exit_code == 0 and f"{NAME}: champion -> version 2, as before the deletion" in result.output
    after = {v.version: v.tags for v in client().search_model_versions(f"name = '{NAME}'")}

    def kept(tags: dict) -> dict:  # every tag as it was, but the move records (the ledger keeps them) and where from
        return {k: v for k, v in tags.items() if not k.startswith((registry.MOVE_PREFIX, registry.RESTORED_TAG))}

    assert {number: kept(tags) for number, tags in after.items()} == {n: kept(t) for n, t in before.items()}
    status = runner.invoke(registry_cli.app, ["status", "reward"])
    assert (
        "deleted from the registry whole" not in status.output and "champion = version 2 (gate: fail)" in status.output
    )
    new_candidate(BAD, 2)  # the same bytes as version 2 (models/reward as a dvc repro leaves it)
    report = run_gate()
    assert (report["candidate"]["version"], report["decided"], report["champion"]["version"]) == ("2", "before", "2")
    moves = [(m["from"], m["to"], m["by"]) for m in registry.history(client(), NAME)]
    assert moves == [(None, "1", "gate"), ("1", "2", "promote"), (None, "2", "restore")]


def test_restores_keep_numbers_and_a_rollback_reads_the_history_through_them(registry_project):
    # the helper's case: v3 promoted over v2, v2 deleted alone and restored (as v4), the model deleted whole and
    # restored: the numbers came back 1, 2, 3 and a rollback to "2" named a version that did not exist
    new_candidate(GOOD, 1)
    run_gate()
    new_candidate({**GOOD, "rm/balanced_accuracy": 0.66}, 2)
    run_gate()
    new_candidate(BAD, 3)
    run_gate()
    runner = CliRunner()
    assert runner.invoke(registry_cli.app, ["promote", "reward", "--version", "3", "--reason", "x"]).exit_code == 0
    client().delete_model_version(NAME, "2")
    result = runner.invoke(registry_cli.app, ["restore", "reward", "--version", "2", "--reason", "r"])
    assert f"{NAME}: version 2 restored as version 4 (gate: pass), tags kept" in result.output
    client().delete_registered_model(NAME)
    result = runner.invoke(registry_cli.app, ["restore", "reward", "--reason", "r"])
    restored = (("1", "pass"), ("3", "fail"), ("4", "pass"))
    assert result.exit_code == 0 and result.output.splitlines()[1:] == [
        *(f"{NAME}: version {n} restored as version {n} (gate: {g}), tags kept" for n, g in restored),
        f"{NAME}: champion -> version 3, as before the deletion",
    ]
    assert sorted(int(v.version) for v in client().search_model_versions(f"name = '{NAME}'")) == [1, 3, 4]
    result = runner.invoke(registry_cli.app, ["rollback", "reward", "--reason", "back"])  # history: 2 -> 3
    assert result.exit_code == 0 and "moved from version 3 to 4" in result.output  # and 2 is 4 now
    new_candidate(BAD, 4)  # a new model takes the next number, never an old one
    assert run_gate()["candidate"]["version"] == "5"
    # a move tag added by hand in the UI is not a move (status and rollback read past it)
    client().set_model_version_tag(NAME, "1", f"{registry.MOVE_PREFIX}champion.abc", "not json")
    status = runner.invoke(registry_cli.app, ["status", "reward"])
    assert status.exit_code == 0 and "champion = version 4" in status.output, status.output


def test_a_restore_whose_run_was_deleted_is_refused_whole_in_one_line(registry_project):
    new_candidate(GOOD, 1)
    run_gate()
    found = client().get_model_version(NAME, "1")
    client().delete_run(found.run_id)
    client().delete_model_version(NAME, "1")
    result = CliRunner().invoke(registry_cli.app, ["restore", "reward", "--reason", "r"])
    assert result.exit_code == 1 and result.output.strip() == (
        f"registry: {NAME} version 1: the MLflow run that holds its files was deleted; restore the run first "
        "(mlflow runs restore --run-id <id>, before mlflow gc), or retrain; nothing restored"
    )
    assert client().search_model_versions(f"name = '{NAME}'") == []


def test_inside_a_dvc_experiment_a_passing_candidate_is_only_a_challenger(registry_project, monkeypatch):
    new_candidate(GOOD, 1)
    run_gate()
    new_candidate({**GOOD, "rm/accuracy": 160 / 196}, 3)
    monkeypatch.setenv("DVC_EXP_NAME", "try-more-steps")
    bounds = {"min_accuracy_low": 0.5, "champion_tolerance": 1.0, "max_ece": 0.15, "min_length_accuracy": 0.35}
    report = run_gate({"reward_gate": bounds})  # the champion re-scored on one pair may be at 1.0
    assert report["decision"] == "pass" and report["experiment"] == "try-more-steps"
    assert str(registry.holder(client(), NAME).version) == "1" and require_champion()["version"] == "1"
    assert client().get_model_version(NAME, "2").tags[registry.CHALLENGER_TAG] == "try-more-steps"
    # the experiment applied and committed: its model runs outside an experiment, and its pass takes effect once
    monkeypatch.delenv("DVC_EXP_NAME")
    report = run_gate({"reward_gate": bounds})
    assert report["decided"] == "before" and require_champion()["version"] == "2"
    assert registry.history(client(), NAME)[-1]["reason"].endswith("decided in experiment try-more-steps")
    assert run_gate({"reward_gate": bounds})["champion"]["version"] == "2"
    assert len(registry.history(client(), NAME)) == 2  # once: the next run moves nothing


def test_evaluate_registers_the_policy_once_and_promotes_it_only_through_its_gate(registry_project, tiny_dir):
    from tasks.evaluate import gate_lines, gate_policy
    from tasks.kit.runs import tracking_client

    shutil.copytree(tiny_dir, "models/policy")
    (registry_project / "data" / "validated" / "eval_prompts.jsonl").write_text(
        json.dumps({"prompt": PAIR["prompt"]}) + "\n"
    )
    os.makedirs("metrics", exist_ok=True)
    with open("metrics/ppo.json", "w") as handle:
        json.dump({"stopped_by": None, "ppo/last/collapse": 0.0}, handle)
    tied = {
        "eval/judge/win_rate": None,
        "eval/judge/win_rate_low": None,
        "eval/judge/decisive": 0.0,
        "eval/judge/ties": 24.0,
        "eval/judge/accuracy": 0.62,
        "eval/judge/accuracy_low": 0.55,
        "eval/judge/meaningful": 1.0,
        "eval/policy/kl": 0.0,
        "eval/policy/eos_rate": 0.5,
        "eval/kind/harmless/prompts": 150.0,  # both kinds evaluated: not worse on harmless, no more refusals
        "eval/kind/harmless/judge_lc_win_rate_high": 0.9,
        "eval/kind/harmless/judge_balanced_accuracy": 0.6,  # the judge tells harmless answers apart
        "eval/kind/harmless/judge_balanced_accuracy_low": 0.55,
        "eval/kind/harmless/judge_balanced_accuracy_high": 0.65,
        "eval/kind/helpful/prompts": 150.0,
        "eval/kind/helpful/refusal_increase_high": 0.025,
    }  # fmt: skip (the demo's: the shipped policy was the SFT model)
    client_, experiment = tracking_client()
    report = gate_policy(tied, client_.create_run(experiment).info.run_id)
    assert (report["candidate"]["version"], report["decision"]) == ("1", "fail")
    assert report["checks"][1]["value"] is None and json.dumps(report, allow_nan=False)  # strict JSON: no NaN
    failed = [line for line in report["lines"] if line.startswith("GATE FAILED")]
    assert len(failed) == 1 and failed[0].startswith("GATE FAILED: win rate over SFT by the judge, lower 95% bound")
    assert registry.holder(client(), "rlhf-policy") is None
    # the same policy again: found by its content, not registered twice, not re-decided
    won = {**tied, "eval/judge/win_rate": 0.9, "eval/judge/win_rate_low": 0.7, "eval/judge/decisive": 24.0,
           "eval/judge/ties": 0.0}  # fmt: skip
    again = gate_policy(won, client_.create_run(experiment).info.run_id)
    assert (again["candidate"]["version"], again["decided"], again["decision"]) == ("1", "before", "fail")
    printed = gate_lines(again)  # says the decision is the stored one, and the failed check it stored
    assert (
        printed[0] == f"[evaluate] policy rlhf-policy version 1: fail (decided before, at {report['decided_at']}, kept)"
    )
    assert printed[1:] == [f"[evaluate] {failed[0]}"]
    assert gate_lines(report)[0] == "[evaluate] policy rlhf-policy version 1: fail (decided now)"
    # a new policy that wins: version 2 takes the champion alias
    model = load_scalar_model("models/reward")  # any other weights: another content hash
    shutil.rmtree("models/policy")
    model.save_pretrained("models/policy")
    passed = gate_policy(won, client_.create_run(experiment).info.run_id)
    assert (passed["candidate"]["version"], passed["decision"]) == ("2", "pass")
    assert str(registry.holder(client(), "rlhf-policy").version) == "2"
    assert client().get_model_version("rlhf-policy", "2").description.startswith("policy gate passed all ")
    # version 1 (the tiny causal LM) as an MLflow Model: a prompt in, the policy's greedy answer out
    import mlflow
    import pandas as pd

    from rlhf.data.chat import encode_prompt
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from tasks.kit.served import respond

    policy = mlflow.pyfunc.load_model("models:/rlhf-policy/1")
    answers = policy.predict(pd.DataFrame({"prompt": ["Is it safe?"]}), params={"max_new_tokens": 4, "greedy": True})
    tokenizer = load_tokenizer(tiny_dir)
    ids = [encode_prompt(tokenizer, PAIR["prompt"], 252)]
    assert list(answers) == respond(load_causal_lm(tiny_dir), tokenizer, ids, 4, 1.0, True)


def test_the_flow_summary_repeats_every_gate_failed_line():
    from flows.summary import summary_warnings

    ece = "GATE FAILED: rm_eval calibration error (ECE), 0.200, bound 0.150"
    win = "GATE FAILED: win rate over SFT by the judge, lower 95% bound (bootstrap over prompts), n/a, bound 0.500"
    metrics = {
        "gate": {
            "lines": ["gate passed: rm_eval accuracy lower 95% bound (Wilson), 0.54, bound 0.5", ece],
            "champion": {"version": "1"},
        },  # fmt: skip
        "evaluate": {"eval/judge/win_rate": None, "lines": [win]},
    }
    assert summary_warnings(metrics) == [f"reward model {ece}", f"policy {win}"]
    metrics["gate"]["champion"] = None
    assert summary_warnings(metrics)[-1].startswith("WARNING: no reward model holds the champion alias")
    metrics["gate"]["champion"] = {"version": "1", "champion": False, "why": "failed its gate"}
    assert summary_warnings(metrics)[-1] == (
        "WARNING: no reward model holds the champion alias: ppo trained against candidate version 1, which failed "
        "its gate (registry.without_champion)"
    )


def test_the_flow_summary_shows_each_kinds_figures_and_warns_for_a_kind_at_chance():
    from rich.console import Console

    from flows.summary import print_summary, summary_warnings

    reward = {"rm/balanced_accuracy": 0.55, "rm/balanced_accuracy_low": 0.51, "rm/balanced_accuracy_high": 0.6,
              "rm/kind/harmless/balanced_accuracy": 0.41, "rm/kind/harmless/balanced_accuracy_low": 0.35,
              "rm/kind/harmless/balanced_accuracy_high": 0.48, "rm/kind/helpful/balanced_accuracy": 0.57,
              "rm/kind/helpful/balanced_accuracy_low": 0.51, "rm/kind/helpful/balanced_accuracy_high": 0.63,
              "rm/kind/helpful/empty_beats_chosen": 0.16}  # fmt: skip
    assert summary_warnings({"reward": reward}) == [
        "WARNING: rm_eval harmless balanced accuracy 0.41 [0.35, 0.48] is below chance (0.5): the reward model has "
        "not learned to rank"
    ]
    console = Console(width=400, color_system=None, record=True)
    print_summary({"reward": reward}, {"reward": 1.0}, console)
    text = console.export_text()
    assert (
        "rm/kind/helpful/balanced_accuracy=0.570 [0.510, 0.630]" in text
        and "rm/kind/helpful/empty_beats_chosen=0.160" in text
    )


def test_rollbacks_step_back_one_holder_at_a_time_and_a_move_to_the_holder_is_refused(registry_project):
    runner = CliRunner()
    for seed in (1, 2, 3):  # versions 1, 2, 3, each passing: champion 1 -> 2 -> 3
        new_candidate({**GOOD, "rm/accuracy": (150 + 10 * seed) / 196}, seed)
        run_gate({"reward_gate": {"min_accuracy_low": 0.5, "champion_tolerance": 1.0, "max_ece": 0.15,
                                  "min_length_accuracy": 0.35}})  # fmt: skip
    assert require_champion()["version"] == "3"
    for expected in ("moved from version 3 to 2", "moved from version 2 to 1"):
        result = runner.invoke(registry_cli.app, ["rollback", "reward", "--reason", "step back"])
        assert result.exit_code == 0 and expected in result.output, result.output
    result = runner.invoke(registry_cli.app, ["rollback", "reward", "--reason", "again"])
    assert result.exit_code == 1 and "no earlier holder" in result.output
    result = runner.invoke(registry_cli.app, ["promote", "reward", "--version", "1", "--reason", "again"])
    assert result.exit_code == 1 and "version 1 already holds champion; nothing moved" in result.output
    # a promotion past the gate says what it overrides
    new_candidate(BAD, 9)
    run_gate()
    result = runner.invoke(registry_cli.app, ["promote", "reward", "--version", "4", "--reason", "reviewed"])
    assert result.exit_code == 0 and "note: version 4 failed its gate; moved by hand" in result.output


def test_the_command_never_guesses_a_project_and_reports_bad_params_in_one_line(registry_project, tmp_path_factory,
                                                                                 monkeypatch):  # fmt: skip
    runner = CliRunner()
    monkeypatch.chdir(tmp_path_factory.mktemp("no-project"))
    result = runner.invoke(registry_cli.app, ["status", "reward"])
    assert result.exit_code == 1 and result.output.startswith("registry: no project (params.yaml and dvc.yaml)")
    (registry_project / "params.yaml").write_text("registry: [unclosed\n")
    result = runner.invoke(registry_cli.app, ["status", "reward", "--project", str(registry_project)])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith(f"registry: {registry_project}/params.yaml: ")
    (registry_project / "params.yaml").write_text("mlflow: {tracking_uri: sqlite:///other.db}\nregistry: {}\n")
    result = runner.invoke(registry_cli.app, ["status", "reward", "--project", str(registry_project)])
    assert result.exit_code == 1 and "KeyError" in result.output and len(result.output.strip().splitlines()) == 1
    (registry_project / "params.yaml").write_text(
        "mlflow: {tracking_uri: sqlite:///other.db}\nregistry: {reward_model: rlhf-reward-model}\n"
    )
    result = runner.invoke(registry_cli.app, ["status", "reward", "--project", str(registry_project)])
    assert result.exit_code == 1 and "no tracking store at sqlite:///" in result.output
    assert not (registry_project / "other.db").exists()  # looking never creates a store
