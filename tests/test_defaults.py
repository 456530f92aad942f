"""params.yaml's own values are the defaults: a typed config's field carries no default or params.yaml's value (the
default profile and preset applied), and every class a stage builds from params.yaml is checked here."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib

import pytest

from rlhf.evaluation import EvalConfig
from rlhf.gate_rules import GateCriteria, PolicyCriteria
from rlhf.ppo_config import PPOConfig
from rlhf.reward import JudgeConfig, RewardConfig
from rlhf.rollout import GenerationSettings
from rlhf.sft import SFTConfig
from rlhf.validation import ValidationConfig
from tasks.kit.configs import derived_values
from tasks.kit.params import read_params, stage_params
from tasks.prepare import DataConfig, SourceConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = {
    "data": DataConfig,
    "validate": ValidationConfig,
    "sft": SFTConfig,
    "reward": RewardConfig,
    "judge": JudgeConfig,
    "generation": GenerationSettings,
    "ppo": PPOConfig,
    "evaluate": EvalConfig,
    "registry.reward_gate": GateCriteria,
    "registry.policy_gate": PolicyCriteria,
}
# SourceConfig is each `data.more_sources` entry: a list item, no section; its fields are DataConfig's, checked above.
ENTRIES = {SourceConfig}


def _section_values(section: str) -> dict:
    params = read_params(str(ROOT / "params.yaml"))
    first, *rest = section.split(".")
    values = stage_params(first, params)
    for key in rest:
        values = values[key]
    derived = derived_values(section, lambda name: stage_params(name, params))
    return {**values, **{field: value for field, (_, value) in derived.items()}}


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_a_field_default_is_params_yaml_value(section):
    values = _section_values(section)
    wrong = {
        field.name: (_default(field), values[field.name])
        for field in dataclasses.fields(SECTIONS[section])
        if field.name in values
        and _default(field) is not dataclasses.MISSING
        and _default(field) != values[field.name]
        and not (isinstance(_default(field), tuple) and list(_default(field)) == values[field.name])
    }
    assert not wrong, f"{section}: field default != params.yaml value (default, params.yaml): {wrong}"


def test_every_config_a_stage_builds_is_checked():
    built = set()
    for path in [*ROOT.glob("tasks/*.py"), *ROOT.glob("tasks/kit/*.py")]:
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "config_from_params":
                target = node.args[0]
                if isinstance(target, ast.Subscript):  # a table of configs (tasks.kit.scalar.CONFIGS)
                    built |= {cls.__name__ for cls in getattr(module, target.value.id).values()}
                else:
                    built.add(target.id)
    checked = {cls.__name__ for cls in [*SECTIONS.values(), *ENTRIES]}
    assert built and built <= checked, f"configs built from params.yaml but not checked here: {built - checked}"


def test_the_check_sees_a_wrong_default(monkeypatch):
    field = next(f for f in dataclasses.fields(PPOConfig) if f.name == "iterations")
    monkeypatch.setattr(field, "default", _section_values("ppo")["iterations"] + 1)
    with pytest.raises(AssertionError, match="iterations"):
        test_a_field_default_is_params_yaml_value("ppo")
