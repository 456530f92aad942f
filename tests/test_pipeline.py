"""The whole pipeline on the tiny profile, through `dvc repro` and through the Prefect flow (integration)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.runtime.device import mixed_precision

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), "shared")
STAGES = ["prepare", "base_model", "validate", "sft", "reward", "gate", "judge", "ppo", "evaluate", "report"]
TINY_MORE_SOURCES = (  # the tiny profile's second kind of data, as params.yaml writes it (tests replace it)
    "      more_sources: [{name: helpful-base, kind: helpful, "
    "source: ../shared/data/hh-rlhf/helpful-base/pairs.jsonl.gz,\n                      max_rows: 60}]"
)


def make_project(root) -> str:
    """A clean copy of the tracked and unignored files as a git repo, with ../shared beside it, on the tiny profile."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    project = os.path.join(root, "main")
    for name in files:
        if os.path.exists(os.path.join(REPO, name)):
            os.makedirs(os.path.dirname(os.path.join(project, name)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), os.path.join(project, name))
    os.symlink(SHARED, os.path.join(root, "shared"))
    set_param(project, "profile: demo", "profile: tiny")
    for command in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"],
    ):
        subprocess.run(command, cwd=project, check=True)
    return project


def copy_project(source: str, root) -> str:
    """A copy of a project :func:`make_project` made, at ``root/main`` with ../shared beside it: git, DVC cache,
    outputs and the MLflow store, whose absolute paths (artifact locations, model version sources) are rewritten
    to the copy's, so the copy never reads or writes the original."""
    project = os.path.join(root, "main")
    shutil.copytree(source, project, symlinks=True)
    os.symlink(SHARED, os.path.join(root, "shared"))
    with sqlite3.connect(os.path.join(project, "mlflow.db")) as db:
        tables = [name for (name,) in db.execute("select name from sqlite_master where type = 'table'")]
        for table in tables:
            for _, column, kind, *_ in db.execute(f"pragma table_info({table})").fetchall():
                if any(word in kind.upper() for word in ("CHAR", "TEXT")):
                    db.execute(
                        f"update {table} set {column} = replace({column}, ?, ?) where {column} like ?",
                        (source, project, f"%{source}%"),
                    )
    return project


def set_param(project: str, old: str, new: str) -> None:
    path = os.path.join(project, "params.yaml")
    with open(path) as handle:
        text = handle.read()
    assert old in text, old
    with open(path, "w") as handle:
        handle.write(text.replace(old, new, 1))


def run(project: str, *args: str, timeout: int = 600, expect_failure: bool = False) -> str:
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "PREFECT_HOME": os.path.join(project, ".prefect-home"),
        "RLHF_PIPELINE_RUN_ID": "",
    }
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert (result.returncode != 0) == expect_failure, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def ran_stages(output: str) -> list[str]:
    return [stage for stage in STAGES if f"Running stage '{stage}'" in output]


def assert_outputs(project: str) -> None:
    for path in (
        "models/policy/model.safetensors",
        "models/reward/model.safetensors",
        "models/reward_champion/model.safetensors",
        "models/reward_champion/registry_version.json",
        "reports/eval/samples.md",
        "reports/eval/samples.json",
        "reports/ppo/ppo_kl.png",
        "models/judge/model.safetensors",
        "models/policy_kept/iteration-0003/kept.json",  # tiny: policy iterations 2 (keep_every) and 3 (the last),
        "models/policy_kept/iteration-0004/kept.json",  # named by the rollout step (1 critic pre-training rollout)
        "reports/index.html",
    ):
        assert os.path.exists(os.path.join(project, path)), path
    with open(os.path.join(project, "metrics/eval.json")) as handle:
        metrics = json.load(handle)
    assert metrics["eval/prompts"] == 4 and metrics["eval/samples_per_prompt"] == 2
    for who in ("judge", "proxy"):
        assert metrics[f"eval/{who}/decisive"] + metrics[f"eval/{who}/ties"] == 8
        assert metrics[f"eval/{who}/decisive"] == 0 or 0.0 <= metrics[f"eval/{who}/win_rate"] <= 1.0
    assert 0.0 <= metrics["eval/policy/eos_rate"] <= 1.0 and metrics["eval/judge/meaningful"] in (0.0, 1.0)
    with open(os.path.join(project, "metrics/overoptimisation.json")) as handle:
        curve = json.load(handle)
    assert [row["iteration"] for row in curve] == [0, 3, 4] and curve[0]["kl"] == 0.0
    with open(os.path.join(project, "timings/evaluate.json")) as handle:
        timing = json.load(handle)
    parts = [timing["phases"][f"eval/time/{part}"] for part in ("comparison", "curve", "best_of_n")]
    phases = [timing["phases"][f"eval/time/{phase}"] for phase in ("generation", "reward", "logprobs", "judge")]
    assert 0.0 < sum(phases) <= sum(parts) <= timing["seconds"], timing  # where evaluate's seconds go
    for stage, prefix in (("reward", "rm"), ("judge", "judge")):  # and the scalar models' (training, scoring)
        with open(os.path.join(project, f"timings/{stage}.json")) as handle:
            timing = json.load(handle)
        scalar_phases = [timing["phases"][f"{prefix}/time/{phase}"] for phase in ("train", "center", "evaluate")]
        assert min(scalar_phases) > 0.0 and sum(scalar_phases) <= timing["seconds"], timing
    # all up to date but the always_changed stages (source re-reads the data source, gate the registry, report
    # writes the page of each pipeline run)
    assert changed(project) == {}


def add_rows(project: str, name: str, start: int, count: int = 30) -> None:
    """Write ``count`` preference rows of the shared data from row ``start`` on (past the tiny profile's 120)."""
    import gzip

    source = os.path.join(SHARED, "data", "hh-rlhf", "harmless-base", "pairs.jsonl.gz")
    with gzip.open(source, "rt") as handle:
        lines = handle.readlines()[start : start + count]
    with open(os.path.join(project, name), "w") as handle:
        handle.writelines(lines)


def changed(project: str) -> dict:
    """``dvc status --json`` less what the always_changed stages (source, gate, report) report for being so: the
    stale stages, and why."""
    status = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"], cwd=project, capture_output=True, text=True, check=True
    ).stdout
    found = {name: [why for why in whys if why != "always changed"] for name, whys in json.loads(status).items()}
    return {name: whys for name, whys in found.items() if whys}


def champion(project: str) -> str:
    with open(os.path.join(project, "models/reward_champion/registry_version.json")) as handle:
        return json.load(handle)["version"]


def test_dvc_repro_runs_everything_then_only_what_a_ppo_param_touches(tiny_run, tmp_path):
    project = copy_project(tiny_run, tmp_path)  # every stage ran (the fixture checks it) and left its outputs
    assert_outputs(project)
    # a ppo param makes ppo alone stale (what reads its policy follows it: the next repro runs evaluate on it)
    set_param(project, "  policy_lr: 1.0e-5", "  policy_lr: 3.0e-5")
    assert changed(project) == {"ppo": [{"changed deps": {"params.yaml": {"ppo": "modified"}}}]}
    # new preference rows (a second source): prepare and everything after it rerun; the new reward model passes
    # the (open) tiny gate, so the champion moves and ppo and evaluate run on it
    add_rows(project, "more-1.jsonl", 1000)
    set_param(project, TINY_MORE_SOURCES, TINY_MORE_SOURCES.removesuffix("}]") + "}, {source: more-1.jsonl}]")
    # all but base_model and sft: none of the 30 new conversations falls in sft's 8% of the hash range
    assert ran_stages(run(project, "dvc", "repro")) == [s for s in STAGES if s not in ("base_model", "sft")]
    assert champion(project) == "2"
    # a promotion by hand reaches DVC through the gate: the champion's folder changes, so what reads it (ppo, and
    # evaluate's proxy) is stale, nothing upstream
    output = run(project, "tasks.cli.registry", "promote", "reward", "--version", "1", "--reason", "test")
    assert "moved from version 2 to 1" in output
    assert ran_stages(run(project, "dvc", "repro", "gate")) == ["gate"]
    assert champion(project) == "1"
    stale = changed(project)
    assert stale.pop("report")  # it reads the gate's report
    assert stale == {s: [{"changed deps": {"models/reward_champion": "modified"}}] for s in ("ppo", "evaluate")}
    # a rollback brings back version 2's folder byte for byte: ppo and evaluate, which ran on it, are up to date
    # again, and the repro keeps it (the gate never re-decides a version)
    assert "moved from version 1 to 2" in run(project, "tasks.cli.registry", "rollback", "reward", "--reason", "test")
    assert ran_stages(run(project, "dvc", "repro", "ppo")) == ["gate"]
    assert champion(project) == "2"
    # a new reward lr under a floor no model can pass: version 3 fails its gate; the champion and its folder stay
    # exactly as they were, so nothing downstream of the gate reruns
    before = subprocess.run(["git", "hash-object", "models/reward_champion/model.safetensors"], cwd=project,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    set_param(project, "  lr: 1.0e-3            # the head's", "  lr: 2.0e-3            # the head's")
    set_param(project, "reward_gate: {min_accuracy_low: 0.0,", "reward_gate: {min_accuracy_low: 1.0,")
    output = run(project, "dvc", "repro", "ppo")
    assert "[gate] GATE FAILED: rm_eval balanced accuracy lower 95% bound (stratified bootstrap)" in output
    assert ran_stages(output) == ["reward", "gate"] and champion(project) == "2"
    assert subprocess.run(["git", "hash-object", "models/reward_champion/model.safetensors"], cwd=project,
                          capture_output=True, text=True, check=True).stdout == before  # fmt: skip
    with open(os.path.join(project, "metrics/ppo.json")) as handle:
        assert json.load(handle)["ppo/reward_model_version"] == 2.0
    # a stage that fails under dvc repro leaves its previous outputs in place
    with open(os.path.join(project, "data/validated/rm_train.jsonl")) as handle:
        before = handle.read()
    with open(os.path.join(project, "metrics/validate.json")) as handle:
        metrics_before = handle.read()
    set_param(project, "max_quarantine_fraction: 0.25}", "max_quarantine_fraction: 0.0}")
    output = run(project, "dvc", "repro", "validate", expect_failure=True)
    assert "rule role_marker_in_response" in output
    with open(os.path.join(project, "data/validated/rm_train.jsonl")) as handle:
        assert handle.read() == before
    with open(os.path.join(project, "metrics/validate.json")) as handle:  # DVC must not delete it either
        assert handle.read() == metrics_before


def test_prefect_flow_runs_the_stale_stages_on_two_sharded_processes_and_groups_mlflow_runs(tiny_run, tmp_path):
    project = copy_project(tiny_run, tmp_path)
    # the training stages on two gloo processes through the tested FSDP config (docs/scaling.md: running at scale;
    # infra/accelerate/ddp.yaml is tested by tests/test_distributed.py)
    set_param(project, "num_processes: 1 ", "num_processes: 2 ")
    set_param(project, "accelerate_config: null", "accelerate_config: infra/accelerate/fsdp.yaml")
    output = run(project, "flows.pipeline", "--stage", "judge", "--stage", "ppo")  # every trainer, on two processes
    ran = [stage for stage in STAGES if f"[{stage}] done in " in output]  # the console: a line as each ends
    assert ran == ["sft", "reward", "gate", "judge", "ppo"]  # what `device` reaches, up to the stages asked for
    assert [stage for stage in STAGES if f"[{stage}] running (log: logs/{stage}.log)" in output] == ran
    assert "Running stage" not in output and "it/s]" not in output  # DVC's chatter and bars: in the logs only
    precision = mixed_precision({"mixed_precision": "auto", "cpu": True})  # bf16 only where this CPU has it natively
    line = f"device cpu:0, mixed precision {precision} (auto), 2 processes (FSDP: trained models sharded)"
    for stage in ("sft", "reward", "judge", "ppo"):  # rank 0 alone prints, logs and writes
        log = Path(project, "logs", f"{stage}.log").read_text()
        assert f"Running stage '{stage}'" in log and log.count(f"[{stage}] {line}") == 1
        assert log.count(f"[{stage}] started (MLflow run") == 1 and "it/s]" not in log  # no bar off a terminal
    assert output.count("RLHF pipeline") == 1  # the summary table, once
    lines = output.splitlines()  # stdout, then stderr (Prefect's log lines)
    assert max(map(len, lines)) <= 120, max(lines, key=len)  # a person's terminal; Prefect's lines shortened too
    (start,) = [i for i, line in enumerate(lines) if line.startswith("dvc status:")]
    head = next(i for i in range(start, len(lines)) if lines[i].startswith("[flow] "))
    status = " ".join(line.strip() for line in lines[start:head])  # wrapped at 120 columns
    assert "evaluate: changed deps" in status  # evaluate, not asked for, reads the new policy: stale
    # stdout's last lines: the verdict (of the fixture's evaluate), its head and a "- why" for each failed check
    head_line, *rest = lines[head:]
    assert head_line.startswith("[flow] policy gate failed ") and head_line.endswith("(reports/policy_gate.json):")
    reasons: list[str] = []
    for line in rest[: next((i for i, line in enumerate(rest) if not line.startswith("  ")), len(rest))]:
        if line.startswith("  - "):
            reasons.append(line[4:])
        else:  # wrapped: indented under its item's text
            assert line.startswith("    ") and not line.startswith("     "), line
            reasons[-1] += " " + line.strip()
    assert len(reasons) == int(head_line.split()[4]), (head_line, reasons)  # "failed N of M checks"
    # Prefect holds the outcome a team acts on: a refused gate is a FAILED state (red, automations fire), exit 0
    # above; its log holds every line the console showed, the verdict last
    with sqlite3.connect(os.path.join(project, ".prefect-home", "prefect.db")) as db:
        states = db.execute("select state_type, state_name, state_id from flow_run").fetchall()
        logs = [row[0] for row in db.execute("select message from log order by timestamp").fetchall()]
    assert [(kind, name) for kind, name, _ in states] == [("FAILED", "Gate failed")]
    shown = [line for line in lines if re.match(r"\[(\w+)\] (running|done)", line)]  # a wrapped one: its start
    assert all(any(log.startswith(line) for log in logs) for line in shown), logs
    last = len(logs) - 1 - logs[::-1].index(head_line)
    assert logs[last : last + 1 + len(reasons)] == [head_line, *(f"  - {why}" for why in reasons)]  # whole lines
    with sqlite3.connect(os.path.join(project, "mlflow.db")) as db:
        parents = db.execute(  # the flow's pipeline run (the fixture's `dvc repro` made its own)
            "select run_uuid from tags where key = 'rlhf.pipeline_run_id' and value like 'prefect-%' and run_uuid in "
            "(select run_uuid from tags where key = 'rlhf.kind' and value = 'pipeline')"
        ).fetchall()
        assert len(parents) == 1
        children = db.execute(
            "select count(*) from tags where key = 'mlflow.parentRunId' and value = ?", parents[0]
        ).fetchone()[0]
        (name,) = db.execute("select name from runs where run_uuid = ?", parents[0]).fetchone()
        params = dict(db.execute("select key, value from params where run_uuid = ?", parents[0]).fetchall())
        (kind,) = db.execute("select value from experiment_tags where key = 'mlflow.experimentKind'").fetchone()
        tags = dict(db.execute("select key, value from tags where run_uuid = ?", parents[0]).fetchall())
    assert children == len(ran)
    # the runs page reads the verdict, the source and the commit off the parent run as off any run
    sentence = tags["rlhf.verdict.sentence"]  # the verdict as one sentence
    assert tags["rlhf.verdict"] == "Gate failed"
    what, report = head_line.removeprefix("[flow] ").removesuffix(":").rsplit(" (", 1)
    assert sentence == f"{what}: {'; '.join(reasons)} ({report}"
    assert tags["mlflow.source.name"] == "dvc.yaml" and tags["mlflow.source.type"] == "PROJECT"
    assert re.fullmatch(r"[0-9a-f]{40}", tags["mlflow.source.git.commit"])
    # the parent is named for people and holds the whole params as this run read them (the profile applied)
    assert re.fullmatch(r"tiny pipeline \d{4}-\d\d-\d\d \d\d:\d\d UTC", name)
    assert params["profile"] == "tiny" and params["ppo.iterations"] == "3" and params["device.num_processes"] == "2"
    assert params["data.more_sources.0.name"] == "helpful-base" and len(params) > 150
    assert kind == "custom_model_development"  # MLflow's UI opens the runs, not the GenAI traces


def test_ppo_stage_killed_with_sigkill_resumes_to_the_same_result(tiny_run, tmp_path):
    import glob
    import signal
    import time

    project = copy_project(tiny_run, tmp_path)  # ppo reads the champion the gate wrote there
    set_param(project, "    tiny: {iterations: 3,", "    tiny: {iterations: 12, checkpoint_every: 1,")
    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "RLHF_PIPELINE_RUN_ID": "kill-test",
    }

    def ppo_stage():
        return subprocess.Popen(
            [sys.executable, "-m", "tasks.ppo"],
            cwd=project,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    assert ppo_stage().wait(timeout=600) == 0
    with open(os.path.join(project, "metrics/ppo.json")) as handle:
        uninterrupted = json.load(handle)
    assert not glob.glob(os.path.join(project, "checkpoints/ppo/*/step-*"))  # cleared after success
    process = ppo_stage()
    deadline = time.time() + 600

    def latest_steps() -> list[str]:
        return [Path(p).read_text().strip() for p in glob.glob(os.path.join(project, "checkpoints/ppo/*/latest"))]

    while time.time() < deadline and not any(step >= "step-00000005" for step in latest_steps()):
        assert process.poll() is None, "the stage finished before it could be killed"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert ppo_stage().wait(timeout=600) == 0
    with open(os.path.join(project, "metrics/ppo.json")) as handle:
        resumed = json.load(handle)
    for key, value in uninterrupted.items():
        if key != "seconds" and isinstance(value, float):
            assert resumed[key] == pytest.approx(value, abs=1e-6), key
