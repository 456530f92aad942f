"""The artefact table (tasks/kit/paths.py) agrees with dvc.yaml, and no stage, command or flow types a path by hand."""

from __future__ import annotations

import ast
import json
import os
import re

import yaml

from rlhf.data.splitting import SPLITS
from tasks.kit import paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTEFACT = re.compile(r"(models|data|metrics|reports)/[\w./*-]+")


def _dvc_outs() -> list[str]:
    with open(os.path.join(ROOT, "dvc.yaml"), encoding="utf-8") as handle:
        stages = yaml.safe_load(handle)["stages"].values()
    entries = [entry for stage in stages for key in ("outs", "metrics", "plots") for entry in stage.get(key, [])]
    return [next(iter(entry)) if isinstance(entry, dict) else entry for entry in entries]


def _covered(path: str, outs: list[str]) -> bool:
    return any(path == out.rstrip("/") or path.startswith(out.rstrip("/") + "/") for out in outs)


def test_every_path_of_the_table_is_an_out_of_a_stage():
    named = [value for name, value in vars(paths).items() if name.isupper() and isinstance(value, str)]
    table = named + list(paths.REPORT_INPUTS.values()) + [paths.split(name) for name in SPLITS]
    outs = _dvc_outs()
    assert {paths.metrics(stage) for stage in ("sft", "reward", "judge", "ppo", "eval")} <= set(outs)
    assert [path for path in table if not _covered(path, outs)] == []


def test_no_stage_command_or_flow_types_an_artefact_path_of_its_own():
    typed = []
    for folder in ("tasks", "flows"):
        for base, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in names:
                path = os.path.join(base, name)
                if not name.endswith(".py") or path == paths.__file__:
                    continue
                with open(path, encoding="utf-8") as handle:
                    tree = ast.parse(handle.read())
                for node in ast.walk(tree):
                    if (
                        isinstance(node, ast.Constant)
                        and isinstance(node.value, str)
                        and ARTEFACT.fullmatch(node.value)
                    ):
                        typed.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}")
    assert typed == []


def test_each_stage_declares_only_its_headline_row_as_dvc_metrics_and_writes_it_as_numbers(tmp_path, monkeypatch):
    from tasks.kit.outputs import HEADLINE, StagedOutputs, write_headline

    with open(os.path.join(ROOT, "dvc.yaml"), encoding="utf-8") as handle:
        stages = yaml.safe_load(handle)["stages"]
    declared = {name: [next(iter(e)) for e in spec.get("metrics") or []] for name, spec in stages.items()}
    assert declared == {name: [paths.headline(name)] if name in HEADLINE else [] for name in stages}
    monkeypatch.chdir(tmp_path)
    values = {
        "rm/balanced_accuracy": 0.55321,
        "rm/balanced_accuracy_low": 0.5,  # not a headline figure
        "rm/kind/harmless/balanced_accuracy": float("nan"),  # undefined: DVC shows "-"
        "rm/kind/helpful/balanced_accuracy": 0.6,
    }
    with StagedOutputs() as outputs:
        write_headline(outputs, "reward", values)
    with open(paths.headline("reward")) as handle:
        assert json.load(handle) == {"bal_acc": 0.553, "helpful": 0.6}
