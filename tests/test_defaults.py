"""params.yaml's own values are the defaults: a typed config's field carries no default or params.yaml's value (the
default profile and preset applied), every class a stage builds from params.yaml is checked here, and the docs'
tables of values (the PPO-max switches, the data splits) show params.yaml's."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import re

import pytest

from rlhf.data.validation import ValidationConfig
from rlhf.evaluation.evaluator import EvalConfig
from rlhf.evaluation.gate_rules import GateCriteria, PolicyCriteria
from rlhf.models.generation import GenerationSettings
from rlhf.ppo.config import PPOConfig
from rlhf.reward.trainer import JudgeConfig, RewardConfig
from rlhf.training.sft import SFTConfig
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


def _table(page: str, header: str) -> list[list[str]]:
    """The rows of the table under ``header`` (its first line) in ``docs/<page>``, each as its stripped cells."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    start = lines.index(header) + 2  # the header, then the |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _page_value(text: str):
    text = re.sub(r"\s*\(.*?\)", "", text).strip()  # "0 (off)" -> "0"
    words = {"on": True, "off": False, "none": None}
    if text in words:
        return words[text]
    try:
        return float(text)
    except ValueError:
        return text


PPO_TABLE = "| switch | what it does | source | default (`ppo_max`) | `vanilla` |"


@pytest.mark.parametrize("column, preset", [(-2, "ppo_max"), (-1, "vanilla")])
def test_the_configuration_page_ppo_table_shows_params_yaml_presets(column, preset):
    params = read_params(str(ROOT / "params.yaml"))
    params["ppo"]["preset"] = preset
    values = stage_params("ppo", params)
    rows = _table("configuration.md", PPO_TABLE)
    assert len(rows) >= 14
    for row in rows:
        keys = re.findall(r"`(\w+)`", re.sub(r"\(.*?\)", "", row[0]))  # keys in parentheses carry no value
        shown = row[column] if row[column] != "same" else row[-2]
        for key, text in zip(keys, re.split(r"[,;]\s*", shown), strict=False):
            assert _page_value(text) == values[key], (
                f"docs/configuration.md {preset} column: {key} is {text}, params.yaml {values[key]}"
            )


SPLIT_TABLE = "| split | fraction (demo, `long`) | fraction (`gpu`) | demo rows (prepared) | read by |"


@pytest.mark.parametrize("column, profile", [(1, "demo"), (1, "long"), (2, "gpu")])
def test_the_data_page_split_table_shows_params_yaml_fractions(column, profile):
    params = read_params(str(ROOT / "params.yaml"))
    params["profile"] = profile
    data = stage_params("data", params)
    fractions, heldout = data["fractions"], data["ptx_heldout_fraction"]
    shares = {
        **fractions,
        "ptx_text": fractions["ptx_text"] * (1 - heldout),
        "ptx_heldout": fractions["ptx_text"] * heldout,
    }
    rows = _table("data.md", SPLIT_TABLE)
    assert {row[0].strip("`") for row in rows} == set(shares)
    for row in rows:
        formula = re.sub(r"\(\+.*?\)", "", row[column]).replace("×", "*").replace("−", "-")
        share = eval(formula, {"__builtins__": {}})  # the page's own arithmetic: "0.05 * (1 - 0.2)"
        assert share == pytest.approx(shares[row[0].strip("`")]), f"docs/data.md {profile}: {row}"


@pytest.mark.parametrize("profile", ["demo", "tiny", "long", "gpu"])
def test_a_profile_that_trains_sft_gives_the_sft_split_a_share(profile):
    # validate refuses an empty sft split where sft.steps is above 0: a shipped profile must not stop there
    params = read_params(str(ROOT / "params.yaml"))
    params["profile"] = profile
    steps, share = stage_params("sft", params)["steps"], stage_params("data", params)["fractions"]["sft"]
    assert share > 0 if steps > 0 else share == 0, (profile, steps, share)


@pytest.mark.parametrize("profile", ["demo", "long", "gpu"])
def test_the_judge_sees_at_least_as_many_pairs_as_the_reward_model(profile):
    # the gold model of Gao et al. sees more than the proxy: a judge that learned less than the reward model it
    # checks cannot tell a better policy from a reward hack
    params = read_params(str(ROOT / "params.yaml"))
    params["profile"] = profile
    judge, reward = stage_params("judge", params), stage_params("reward", params)
    assert judge["steps"] * judge["batch_size"] >= reward["steps"] * reward["batch_size"], profile
