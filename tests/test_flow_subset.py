"""A run of some stages never succeeds on stale inputs: the stale stages upstream of them run first, named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import networkx as nx
import pytest

from flows import pipeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# src (always changed) -> a -> b -> c -> d
GRAPH = nx.DiGraph([("src", "a"), ("a", "b"), ("b", "c"), ("c", "d")])
ORDER = ["src", "a", "b", "c", "d"]


class FakeDvc:
    """Stale reasons that move as DVC's do: a stage that ran is up to date, and when its output changed its
    direct children become stale (``changes``: the stages whose output changes when they run)."""

    def __init__(self, stale: dict[str, str], changes: set[str]):
        self.stale, self.changes, self.ran, self.asked = dict(stale), changes, [], []

    def run(self, stage: str) -> None:
        self.ran.append(stage)
        if stage != "src":
            self.stale.pop(stage, None)
        if stage in self.changes:
            for child in GRAPH.successors(stage):
                self.stale.setdefault(child, f"changed deps {stage}.out (modified)")

    def why_stale(self, stage: str) -> str | None:
        self.asked.append(stage)
        return self.stale.get(stage)


def plan(wanted, stale, changes=()):
    dvc, said = FakeDvc({"src": "always changed", **stale}, set(changes)), []
    ran = pipeline.run_in_order(ORDER, GRAPH, set(wanted), dvc.run, dvc.why_stale, said.append)
    assert ran == dvc.ran
    return ran, said, dvc


def test_a_stale_stage_upstream_of_the_subset_runs_first_and_is_named():
    ran, said, dvc = plan({"c", "d"}, {"b": "changed deps params.yaml:b (modified)"})
    assert ran == ["src", "b", "c", "d"]  # a is up to date: left alone
    assert said == [
        "[flow] src is stale (always changed) and upstream of c, d: running it first",
        "[flow] b is stale (changed deps params.yaml:b (modified)) and upstream of c, d: running it first",
    ]
    assert dvc.asked == ["src", "a", "b"]  # only upstream stages are asked, each just before its turn


def test_nothing_stale_upstream_runs_only_the_always_changed_stage_and_the_subset():
    ran, said, _ = plan({"c", "d"}, {})
    assert ran == ["src", "c", "d"] and len(said) == 1


def test_a_stage_made_stale_by_one_that_ran_before_it_runs_too():
    # the source's file changed: after src runs, a is stale; after a runs, b is; the subset asked for c only
    ran, said, _ = plan({"c"}, {}, changes={"src", "a", "b"})
    assert ran == ["src", "a", "b", "c"]
    assert said[1:] == [
        "[flow] a is stale (changed deps src.out (modified)) and upstream of c: running it first",
        "[flow] b is stale (changed deps a.out (modified)) and upstream of c: running it first",
    ]


def test_the_whole_pipeline_asks_nothing_and_stages_downstream_are_left_out():
    ran, said, dvc = plan(set(ORDER), {"b": "changed deps params.yaml:b (modified)"})
    assert ran == ORDER and said == [] and dvc.asked == []
    ran, _, dvc = plan({"b"}, {"d": "changed deps d.x (modified)"})
    assert ran == ["src", "b"] and dvc.asked == ["src", "a"]  # d is downstream of b: not this run's business


def test_dvc_status_json_reads_as_reasons():
    status = {
        "reward": [{"changed deps": {"params.yaml": {"reward.lr": "modified"}}}],
        "prepare": [
            {"changed deps": {"data/sources.json": "modified"}},
            {"changed outs": {"data/processed": "deleted"}},
        ],
        "source": ["always changed"],
        "sft": ["changed command"],
    }
    assert pipeline.stale_reasons(status) == {
        "reward": "changed deps params.yaml:reward.lr (modified)",
        "prepare": "changed deps data/sources.json (modified); changed outs data/processed (deleted)",
        "source": "always changed",
        "sft": "changed command",
    }
    assert list(pipeline.stale_stages(status)) == ["reward", "prepare", "sft"]


def test_the_real_dag_puts_the_source_stage_first_and_upstream_of_every_stage():
    dvc_file = os.path.join(REPO, "dvc.yaml")
    order, graph = pipeline.stage_order(dvc_file), pipeline.stage_graph(dvc_file)
    assert order[:2] == ["source", "prepare"]
    assert {"source", "prepare", "base_model", "validate", "sft", "reward"} <= nx.ancestors(graph, "ppo")
    assert nx.ancestors(graph, "reward") == {"source", "prepare", "base_model", "validate", "sft"}


def fake_project(root) -> str:
    """A DVC project of three stages a -> b -> c (each appends its param to its input), every command cheap."""
    project = os.path.join(root, "fake")
    os.makedirs(project)
    files = {
        "params.yaml": "a: {x: 1}\nb: {lr: 1}\nc: {y: 1}\n",
        "step.py": """\
            import sys, yaml
            name, source = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
            text = open(source).read() if source else ""
            value = yaml.safe_load(open("params.yaml"))[name]
            open(f"{name}.txt", "w").write(f"{text}{name}={value}\\n")
        """,
        "dvc.yaml": """\
            stages:
              a: {cmd: python step.py a, deps: [step.py], params: [a], outs: [a.txt]}
              b: {cmd: python step.py b a.txt, deps: [step.py, a.txt], params: [b], outs: [b.txt]}
              c: {cmd: python step.py c b.txt, deps: [step.py, b.txt], params: [c], outs: [c.txt]}
        """,
    }
    for name, text in files.items():
        with open(os.path.join(project, name), "w", encoding="utf-8") as handle:
            handle.write(textwrap.dedent(text))
    return project


def test_the_flow_fails_when_a_stage_it_relied_on_is_still_stale(tmp_path, monkeypatch):
    monkeypatch.chdir(fake_project(tmp_path))
    ran = []
    statuses = iter(
        [{"a": ["changed command"]}, {}, {"b": [{"changed deps": {"params.yaml": {"b.lr": "modified"}}}]}]
    )  # before a's turn, before b's turn, after the run
    monkeypatch.setattr(pipeline, "run_stage", lambda stage, run_id: ran.append(stage))
    monkeypatch.setattr(pipeline, "dvc_status", lambda targets=None: next(statuses))
    with pytest.raises(
        RuntimeError, match=r"stale after the run: b: changed deps params\.yaml:b\.lr \(modified\) \(dvc status\)"
    ):
        pipeline.run_pipeline(stages=["c"])
    assert ran == ["a", "c"]  # a was stale before its turn; b was not (yet): what is left stale fails the run


def dvc(project: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=env, capture_output=True, text=True)


@pytest.mark.integration
def test_a_subset_run_after_an_upstream_param_change_runs_the_stale_stage_first(tmp_path, monkeypatch, capsys):
    """docs/pipeline.md's `python -m flows.pipeline --stage ...` on real DVC (Prefect's own machinery left out: each
    stage runs `dvc repro --single-item` as the flow's task does)."""
    project = fake_project(tmp_path)
    assert dvc(project, "init", "--no-scm", "-q").returncode == 0
    assert dvc(project, "repro").returncode == 0
    with open(os.path.join(project, "params.yaml"), "w", encoding="utf-8") as handle:
        handle.write("a: {x: 1}\nb: {lr: 2}\nc: {y: 1}\n")  # as `reward.lr` changed before `--stage ppo`
    monkeypatch.chdir(project)
    # DVC's own answer, each stage by itself: b is stale, c (whose inputs have not changed yet) is not
    assert pipeline.stale_reasons(pipeline.dvc_status(["b", "c"])) == {"b": "changed deps params.yaml:b (modified)"}

    def run_stage(stage: str, run_id: str) -> None:  # the task's body, without Prefect's logger
        result = dvc(project, "repro", "--single-item", stage)
        print(result.stdout + result.stderr)
        assert result.returncode == 0

    monkeypatch.setattr(pipeline, "run_stage", run_stage)
    monkeypatch.setattr(pipeline, "flow_metrics", pipeline.run_pipeline)  # the flow's body, without Prefect
    pipeline.main(stage=["c"])
    output = capsys.readouterr().out
    assert "[flow] b is stale (changed deps params.yaml:b (modified)) and upstream of c: running it first" in output
    assert "Running stage 'b'" in output and "Running stage 'c'" in output and "Running stage 'a'" not in output
    assert "dvc status: up to date" in output
    with open(os.path.join(project, "c.txt"), encoding="utf-8") as handle:
        assert handle.read() == "a={'x': 1}\nb={'lr': 2}\nc={'y': 1}\n"


class _State:
    def __init__(self, error):
        self.error = error

    def result(self):
        if self.error is not None:
            raise self.error


def test_a_stage_that_printed_its_own_error_is_not_retried_a_crash_is():
    from flows.stages import STAGE_ERROR, StageRefused, retry_unless_refused

    assert STAGE_ERROR.match("[ppo] error: ValueError: params.yaml: ppo.ptx_coef is set both ...")
    assert STAGE_ERROR.match("[sft] stopped by SIGTERM")
    assert not STAGE_ERROR.match("Traceback (most recent call last):")
    assert retry_unless_refused(None, None, _State(StageRefused("[ppo] error: ValueError: ..."))) is False
    assert retry_unless_refused(None, None, _State(RuntimeError("stage ppo failed (exit 137)"))) is True


@pytest.mark.integration
@pytest.mark.parametrize(
    "left", ["", '{"write": {"a.txt": {"pid": 1', '{"write": []}', "\xff\xfe"], ids=["empty", "cut", "format", "bytes"]
)
def test_an_unreadable_rwlock_a_killed_process_left_is_removed_and_the_stage_runs(tmp_path, monkeypatch, capsys, left):
    # DVC truncates the file, then writes it: a kill in between left it empty and every later stage failed at once
    from flows.stages import run_stage
    from tasks.kit.dvclock import RWLOCK, repair_dvc_rwlock

    project = fake_project(tmp_path)
    assert dvc(project, "init", "--no-scm", "-q").returncode == 0
    monkeypatch.chdir(project)
    os.makedirs(os.path.dirname(RWLOCK), exist_ok=True)
    with open(RWLOCK, "wb") as handle:
        handle.write(left.encode("latin-1"))
    failed = dvc(project, "repro", "--single-item", "a")
    assert failed.returncode != 0 and "failed to reproduce" in failed.stderr  # DVC alone: stuck until it is deleted
    monkeypatch.setattr("flows.stages.stage_seconds", lambda stage: None)
    monkeypatch.setattr("flows.stages.headline", lambda stage, metrics: "")
    run_stage.fn("a", "run-1")  # the flow's task: repairs, says so, runs
    output = capsys.readouterr().out
    assert f"[flow] {RWLOCK} was unreadable (" in output and "[a] done" in output
    assert os.path.exists("a.txt") and not repair_dvc_rwlock()  # DVC wrote a readable one: left as it is
    with open(RWLOCK, encoding="utf-8") as handle:
        assert not any(json.load(handle).values())  # and it holds no lock once the stage ended
    open(RWLOCK, "w").close()  # `dvc status` (each flow run's first and last DVC command) failed on it too
    assert "a" not in pipeline.dvc_status()  # read, and a is up to date
