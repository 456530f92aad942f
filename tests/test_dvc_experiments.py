"""DVC's own comparison tools on the pipeline's runs: `dvc exp run/show`, `dvc metrics/params/plots diff`.

The metrics files (and the PPO curves) are `cache: false` outputs tracked by git, so every commit and every
experiment carries them; wall-clock times live apart in the git-ignored `timings/`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_pipeline import copy_project, run, set_param

from tasks.kit import paths
from tasks.kit.outputs import HEADLINE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = ["prepare", "base_model", "validate", "sft", "reward", "gate", "ppo"]  # evaluate adds time, not coverage


def load(path: str):
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def test_write_metrics_keeps_wall_time_apart_and_the_summary_reads_it_there(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(REPO)  # tasks/, flows/
    from flows.summary import print_summary
    from tasks.kit.outputs import write_metrics

    monkeypatch.chdir(tmp_path)
    history = {
        2: {"ppo/kl": 0.25, "ppo/reward/mean": 1.0, "ppo/time/update": 3.5},
        "1": {"ppo/value/pretrain_iterations": 1.0},
    }
    metrics = {
        "ppo/policy_iterations": 1.0,
        "ppo/last/kl": float("nan"),
        "stopped_by": None,
        "ppo/last/time/update": 3.5,
    }
    curves = "metrics/ppo_curves.json"
    write_metrics("metrics/ppo.json", metrics, SimpleNamespace(stage="ppo", seconds=12.25), curves={curves: history})
    assert load("metrics/ppo.json") == {"ppo/policy_iterations": 1.0, "ppo/last/kl": None, "stopped_by": None}
    assert load("timings/ppo.json") == {"stage": "ppo", "seconds": 12.25, "phases": {"ppo/last/time/update": 3.5}}
    # every row holds every signal (DVC's plots fail on a row without the plotted field), in iteration order
    assert load(curves) == [
        {"iteration": 1, "ppo/kl": None, "ppo/reward/mean": None, "ppo/value/pretrain_iterations": 1.0},
        {"iteration": 2, "ppo/kl": 0.25, "ppo/reward/mean": 1.0, "ppo/value/pretrain_iterations": None},
    ]
    monkeypatch.setenv("COLUMNS", "300")
    print_summary({"ppo": load("metrics/ppo.json"), "sft": {"sft/loss_last": 1.0}})
    out = capsys.readouterr().out
    assert re.search(r"ppo\W+12\W", out) and re.search(r"sft\W+-\W", out), out  # sft has no timings/sft.json


def dvc_json(project: str, *args: str):
    """``python -m dvc <args> --json`` in the project; its stdout parsed (warnings go to stderr)."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    result = subprocess.run(
        [sys.executable, "-m", "dvc", *args, "--json"], cwd=project, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout)


def git(project: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True, check=True).stdout


@pytest.mark.integration
def test_an_experiment_compares_with_the_committed_baseline_in_dvc_exp_show_and_diffs(tiny_run, tmp_path, monkeypatch):
    for who in ("AUTHOR", "COMMITTER"):  # dvc exp run commits; CI may have no git identity
        monkeypatch.setenv(f"GIT_{who}_NAME", "t")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "t@t")
    project = copy_project(tiny_run, tmp_path)  # the whole tiny pipeline has run there
    # ppo runs twice: 2 policy iterations (the KL penalty acts from the second on: the first starts at KL 0)
    set_param(project, "    tiny: {iterations: 3,", "    tiny: {iterations: 2,")
    output = run(project, "dvc", "repro", "ppo")
    assert "Running stage 'ppo'" in output and "Running stage 'sft'" not in output  # what the param touches
    for stage in BASELINE:  # times stay out of what git and DVC compare
        assert "seconds" in load(os.path.join(project, "timings", f"{stage}.json"))
    for root, _, names in os.walk(os.path.join(project, "metrics")):
        for name in names:
            values = load(os.path.join(root, name))
            keys = values if isinstance(values, dict) else values[0]
            assert "seconds" not in keys and not [k for k in keys if "/time/" in k], name
    # what docs/pipeline.md says to commit is all the run leaves for git
    git(project, "add", "dvc.lock", "metrics", "params.yaml")
    git(project, "commit", "-qm", "baseline")
    assert git(project, "status", "--porcelain") == ""
    assert "metrics/ppo_curves.json" in git(project, "ls-files", "metrics")
    baseline = git(project, "rev-parse", "HEAD").strip()
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    wide = {**env, "COLUMNS": "1000"}  # DVC wraps its table to the terminal: here, never
    table = subprocess.run([sys.executable, "-m", "dvc", "metrics", "show"], cwd=project, env=wide, capture_output=True)
    lines = table.stdout.decode().splitlines()  # one row a stage, numbers only, within 120 columns
    assert sorted(line.split()[0] for line in lines[1:]) == sorted(paths.headline(stage) for stage in HEADLINE)
    assert max(len(line) for line in lines) <= 120, lines

    output = run(project, "dvc", "exp", "run", "-n", "kl-0.1", "-S", "ppo.kl_coef=0.1", "ppo")
    ran = [stage for stage in [*BASELINE, "evaluate"] if f"Running stage '{stage}'" in output]
    assert ran == ["gate", "ppo"]  # the gate reruns always: it keeps the champion (never moved by an experiment)
    gate_report = load(os.path.join(project, "reports", "reward_gate.json"))
    assert gate_report["run_in_experiment"] == "kl-0.1" and gate_report["champion"]["version"] == "1"

    shown = {entry["rev"]: entry for entry in dvc_json(project, "exp", "show")}
    base = shown[baseline]
    (experiment,) = [r for e in base["experiments"] for r in e["revs"] if r["name"] == "kl-0.1"]
    for entry in (base, experiment):
        assert entry["error"] is None
        # exp show's columns: each stage's headline row (metrics/headline/<stage>.json), numbers only
        assert set(entry["data"]["metrics"]) == {paths.headline(stage) for stage in HEADLINE}  # evaluate: the fixture's
        for stage in HEADLINE:
            loaded = entry["data"]["metrics"][paths.headline(stage)]
            assert loaded.get("error") is None and loaded["data"], stage
            assert all(isinstance(v, (int, float)) for v in loaded["data"].values()), stage
    # rlhf-experiments: the same data turned round, within 120 columns: the param swept, the headline figures
    shown = subprocess.run([sys.executable, "-m", "tasks.cli.experiments"], cwd=os.path.join(project, "metrics"),
                           env={**env, "COLUMNS": "120"}, capture_output=True, text=True)  # fmt: skip
    assert shown.returncode == 0 and max(len(line) for line in shown.stdout.splitlines()) <= 120, shown
    lines = [line.split() for line in shown.stdout.splitlines() if line.strip()]
    assert lines[0] == ["param", "/", "figure", "workspace", baseline[:7], "kl-0.1"]  # the workspace holds kl-0.1
    assert lines[1] == ["ppo.kl_coef", "0.1", "0.05", "0.1"] and not [line for line in lines if "profiles" in line[0]]
    assert [line[:2] for line in lines[2:]][:2] == [["sft", "loss"], ["reward", "bal_acc"]]  # "<stage> <figure>"
    base_metrics, exp_metrics = base["data"]["metrics"], experiment["data"]["metrics"]
    assert base["data"]["params"]["params.yaml"]["data"]["ppo"]["kl_coef"] == 0.05
    assert experiment["data"]["params"]["params.yaml"]["data"]["ppo"]["kl_coef"] == 0.1
    assert exp_metrics["metrics/headline/reward.json"] == base_metrics["metrics/headline/reward.json"]  # ppo reran

    # the diffs between the committed baseline and the experiment: only what the experiment changed; the headline
    # rows by default, a stage's every figure when its file is named
    assert set(dvc_json(project, "metrics", "diff", baseline, "kl-0.1")) <= {"metrics/headline/ppo.json"}
    metrics_diff = dvc_json(project, "metrics", "diff", baseline, "kl-0.1", "--targets", "metrics/ppo.json")
    assert set(metrics_diff) == {"metrics/ppo.json"}
    assert metrics_diff["metrics/ppo.json"]["ppo/last/kl_coef"]["old"] == pytest.approx(0.05)
    assert metrics_diff["metrics/ppo.json"]["ppo/last/kl_coef"]["new"] == pytest.approx(0.1)
    assert len(metrics_diff["metrics/ppo.json"]) > 1  # the penalty changed the run, not just its record
    params_diff = dvc_json(project, "params", "diff", baseline, "kl-0.1")
    assert params_diff == {"params.yaml": {"ppo.kl_coef": {"old": 0.05, "new": 0.1, "diff": pytest.approx(0.05)}}}
    plots = dvc_json(project, "plots", "diff", baseline, "kl-0.1")
    # evaluate did not run (ppo is the target): its curve, metrics/overoptimisation.json, is in neither revision
    errors = [e for e in plots.get("errors") or [] if e.get("source") != "metrics/overoptimisation.json"]
    assert not errors, errors
    out = str(tmp_path / "plots")  # the page renders offline: the chart libraries inlined, no remote script
    subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "-o", out], cwd=project, env=env, check=True)
    with open(os.path.join(out, "index.html"), encoding="utf-8") as handle:
        page = handle.read()
    assert not re.search(r"<script[^>]*\ssrc=", page) and "vegaEmbed(" in page and "ppo_curves" in page
    iterations = len(load(os.path.join(project, "metrics", "ppo_curves.json")))
    for name in ("metrics/ppo_curves.json", "ppo/kl", "ppo/value/explained_variance"):
        (figure,) = plots["data"][name]
        assert figure["revisions"] == [baseline, "kl-0.1"], name
        assert len(figure["content"]["data"]["values"]) == 2 * iterations, name
