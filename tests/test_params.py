"""params.yaml as a reader sees it: presets without shadows, no dead keys, every config field settable."""

import dataclasses
import os

import pytest

from rlhf.data.chat import check_reads_whole
from rlhf.data.validation import ValidationConfig
from rlhf.evaluation.evaluator import EvalConfig
from rlhf.evaluation.gate_rules import GateCriteria, PolicyCriteria
from rlhf.models.generation import GenerationSettings
from rlhf.ppo.config import PPOConfig
from rlhf.reward.trainer import JudgeConfig, RewardConfig
from rlhf.training.sft import SFTConfig
from tasks.kit.configs import DERIVED, config_from_params, derived_values, longest_response
from tasks.kit.params import load_yaml, read_params, stage_params
from tasks.prepare import DataConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "data": DataConfig,
    "validate": ValidationConfig,
    "sft": SFTConfig,
    "reward": RewardConfig,
    "generation": GenerationSettings,
    "ppo": PPOConfig,
    "evaluate": EvalConfig,
}
MODEL_KEYS = {"source", "random_init", "seed"}  # read by tasks/base_model.py, which refuses any other


def load(name: str) -> dict:
    return load_yaml(os.path.join(REPO, name))


def test_the_effective_ptx_coef_is_the_one_the_file_shows():
    params = load("params.yaml")
    assert "ptx_coef" not in params["ppo"]  # a preset's key stands only in the preset
    assert stage_params("ppo", params)["ptx_coef"] == params["ppo"]["presets"][params["ppo"]["preset"]]["ptx_coef"]


def test_a_key_set_both_by_the_preset_and_at_the_top_is_refused_naming_both_places():
    params = load("params.yaml")
    params["ppo"]["ptx_coef"] = 0.0
    with pytest.raises(
        ValueError, match=r"ppo\.ptx_coef is set both at the top of section 'ppo' and in ppo\.presets\.ppo_max;"
    ):
        stage_params("ppo", params)  # the active preset is named, though vanilla comes first in the file


def test_a_misspelled_profile_is_refused_naming_the_known_ones():
    params = load("params.yaml")
    params["profile"] = "tinny"
    with pytest.raises(ValueError, match=r"profile is 'tinny'; known profiles: \['demo', 'gpu', 'long', 'tiny'\]"):
        stage_params("sft", params)


@pytest.mark.parametrize("profile", ["demo", "tiny", "long", "gpu"])
@pytest.mark.parametrize("preset", ["vanilla", "ppo_max"])
def test_every_section_builds_its_config_under_every_profile_and_preset(profile, preset):
    params = load("params.yaml")
    params["profile"] = profile
    params["ppo"]["preset"] = preset

    def read(section: str) -> dict:
        return stage_params(section, params)

    configs = {
        section: config_from_params(cls, read(section), section, derived_values(section, read))
        for section, cls in CONFIGS.items()
    }
    assert set(stage_params("model", params)) <= MODEL_KEYS
    judge = config_from_params(
        JudgeConfig, {k: v for k, v in stage_params("judge", params).items() if k != "source"}, "judge"
    )
    # the reward model and the judge read whole prompts and responses (the stages check this when they start)
    longest = longest_response(read)  # what the stages check: PPO's rollouts or evaluation's samples
    assert longest[1] == max(configs["generation"].max_new_tokens, configs["evaluate"].max_new_tokens or 0)
    check_reads_whole(
        "reward.max_length",
        configs["reward"].max_length,
        ("ppo.max_prompt_length", configs["ppo"].max_prompt_length),
        longest,
    )
    for reader, length in (
        ("judge.max_length", judge.max_length),
        ("evaluate.judge_max_length", configs["evaluate"].judge_max_length),
    ):
        check_reads_whole(reader, length, ("ppo.max_prompt_length", configs["evaluate"].max_prompt_length), longest)
    assert configs["validate"].max_length == configs["reward"].max_length  # validation cuts as the reward model reads


def test_every_config_field_can_be_set_from_params_and_stands_in_the_file():
    params = load("params.yaml")
    for section, cls in CONFIGS.items():
        shown = set(stage_params(section, params))
        values = stage_params(section, params)
        for field in dataclasses.fields(cls):
            if (section, field.name) in DERIVED:  # another section's key holds it (the next test)
                assert field.name not in shown, f"{section}.{field.name} is derived from {DERIVED[section, field.name]}"
                continue
            if field.default is not dataclasses.MISSING:
                config_from_params(cls, {**values, field.name: field.default}, section)
            elif field.default_factory is not dataclasses.MISSING:
                config_from_params(cls, {**values, field.name: field.default_factory()}, section)
            if field.name not in ("storage_options",):  # a credential-free default; documented in docs/data.md
                assert field.name in shown, f"{section}.{field.name} is a setting but params.yaml does not show it"


def test_a_derived_value_is_set_once_refused_where_it_is_derived_and_reruns_its_stage():
    params, stages = load("params.yaml"), load("dvc.yaml")["stages"]
    for (section, field), source in DERIVED.items():
        owner = params[section]
        assert field not in owner and all(field not in (o or {}) for o in owner.get("profiles", {}).values())
        # the stage reading the section lists the source key and its section's profiles, so a change reruns it
        (stage,) = [name for name, spec in stages.items() if section in spec.get("params", [])]
        listed = [str(key) for key in stages[stage]["params"]]
        assert any(source == key or source.startswith(key + ".") for key in listed), (stage, source)
        assert f"{source.split('.')[0]}.profiles" in listed, (stage, source)
    values = stage_params("evaluate", params)
    derived = derived_values("evaluate", lambda name: stage_params(name, params))
    assert derived["judge_max_length"] == ("judge.max_length", 256)
    with pytest.raises(ValueError) as refused:
        config_from_params(EvalConfig, {**values, "judge_max_length": 192}, "evaluate", derived)
    assert str(refused.value) == (
        "params.yaml: evaluate.judge_max_length (192) is derived from judge.max_length (256): remove it and set "
        "judge.max_length"
    )


def test_every_top_level_key_is_read_by_a_stage():
    params, stages = load("params.yaml"), load("dvc.yaml")["stages"]
    listed = {key.split(".")[0] for stage in stages.values() for key in stage.get("params", [])}  # registry.x
    read_by_common = {"mlflow", "orchestration"}  # StageRun's tracking settings; the flow's work pools
    assert set(params) - listed - read_by_common == set()
    assert listed <= set(params)
    for stage, spec in stages.items():  # a stage that lists a section reads it (the task module names it)
        with open(os.path.join(REPO, "tasks", f"{stage}.py"), encoding="utf-8") as handle:
            source = handle.read()
        derived = [src for (owner, _), src in DERIVED.items() if f'"{owner}"' in source]  # read through DERIVED
        for key in spec.get("params", []):
            section = key.split(".")[0]
            through = any(
                src == key or src.startswith(key + ".") or key == f"{src.split('.')[0]}.profiles" for src in derived
            )
            assert key == "profile" or f'"{section}"' in source or through, f"{stage} lists {key} but never reads it"


class Loaded(Exception):
    """Raised by a stand-in loader: the stage got as far as building its first model."""


@pytest.mark.parametrize(
    "stage, section", [("sft", "sft"), ("reward", "reward"), ("ppo", "ppo"), ("evaluate", "evaluate")]
)
def test_each_stage_seeds_with_its_own_seed_before_it_builds_a_model(monkeypatch, stage, section):
    # a new head (reward model, a value model from SFT) is initialised when the model is built: the stage's
    # own seed must be set before that, or reward.seed / ppo.seed would not own the initialisation
    import importlib

    module = importlib.import_module("tasks.kit.scalar" if stage == "reward" else f"tasks.{stage}")  # reward, judge
    calls = []
    monkeypatch.setattr(module, "setup_torch", lambda seed: calls.append(("seed", seed)))

    def loader(path):
        calls.append(("load", path))
        raise Loaded

    monkeypatch.setattr(module, "load_tokenizer", loader)
    monkeypatch.setattr(module, "load_jsonl", lambda path: [])  # no data needed to get that far
    monkeypatch.setattr(module, "require_champion", lambda folder: {"version": "1"}, raising=False)  # ppo, evaluate
    params = {**stage_params(section, load("params.yaml")), "seed": 4321}
    if stage == "sft":
        params["steps"] = 40  # an SFT that trains (the default, 0, trains nothing and builds no model)
    generation = stage_params("generation", load("params.yaml"))
    reward = (params, None, None, None, ("rm_train.jsonl", "rm_eval.jsonl"), "models/sft", "models/reward", "reward")
    args = {"sft": (params, None, None), "reward": reward, "ppo": (params, generation, None)}
    with pytest.raises(Loaded):
        module.run(*args.get(stage, (params, generation)))
    assert calls[0] == ("seed", 4321) and calls[1][0] == "load"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-05", 1e-05),  # what `dvc exp run -S key=0.00001` writes; YAML 1.1 reads the string '1e-05'
        ("1.0e9", 1.0e9),  # a string in YAML 1.1 too (its exponent needs a sign)
        ("3e5", 3e5),
        ("-2.5E-3", -2.5e-3),
        (".5", 0.5),
        ("1.0e-05", 1e-05),
        ("12", 12),
        ("-3", -3),
        ("0x1F", 31),
        ("0o17", 15),
        (".inf", float("inf")),
        ("true", True),
        ("null", None),
        ("~", None),
        ("", None),  # nothing written
        ("'yes'", "yes"),  # quoted: a string for both
        ('"1_000"', "1_000"),
        ("keep", "keep"),
        ("2026-12-01", "2026-12-01"),  # YAML 1.2's core schema has no dates
    ],
)
def test_params_are_read_with_yaml_1_2_numbers(tmp_path, text, value):
    (tmp_path / "params.yaml").write_text(f"section:\n  value: {text}\n")
    read = read_params(str(tmp_path / "params.yaml"))["section"]["value"]
    assert read == value and type(read) is type(value)


@pytest.mark.parametrize(
    ("text", "old", "new"),
    [("1_000", "1000", "'1_000'"), ("1:30", "90", "'1:30'"), ("017", "15", "17"), ("0b101", "5", "'0b101'"),
     ("yes", "True", "'yes'"), ("Off", "False", "'Off'")],
)  # fmt: skip
def test_a_value_only_yaml_1_1_reads_as_a_number_is_refused_naming_the_key(tmp_path, text, old, new):
    (tmp_path / "params.yaml").write_text(f"sft:\n  steps: 4\n  lr: {text}\n")
    with pytest.raises(ValueError) as failure:
        read_params(str(tmp_path / "params.yaml"))
    assert str(failure.value) == (
        f"{tmp_path}/params.yaml:3: sft.lr is {text}, which YAML 1.1 reads as {old} and YAML 1.2 (DVC) as {new}: "
        "write it so both agree (a number as 1000 or 1.0e-5, a boolean as true or false, a string in quotes)"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [("sft:\n  steps: 4\n  lr: 1.0\n  steps: 2\n",
      "params.yaml:4: sft.steps is given twice (first on line 2); YAML keeps one of them silently and DVC refuses "
      "the file: delete one"),
     ("ppo:\n  profiles:\n    long: {iterations: 3, iterations: 4}\n",
      "params.yaml:3: ppo.profiles.long.iterations is given twice (first on line 3)"),
     ("sft:\n  steps: [4   # a comment\n  lr: 1.0\n",
      "params.yaml:3:3: not valid YAML: while parsing a flow sequence; expected ',' or ']', but got '<scalar>'"),
     ("sft:\n  steps: 4\n lr: 1.0\n",
      "params.yaml:3:2: not valid YAML: while parsing a block mapping; expected <block end>")],
)  # fmt: skip
def test_a_key_given_twice_or_text_that_is_not_yaml_is_refused_in_one_line_naming_where(tmp_path, text, message):
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ValueError) as failure:
        read_params(str(tmp_path / "params.yaml"))
    assert str(failure.value).startswith(f"{tmp_path}/{message}") and "\n" not in str(failure.value)


def test_anchors_aliases_and_merge_keys_are_not_keys_given_twice(tmp_path):
    text = "base: &b {steps: 4, lr: 1.0}\nsft:\n  <<: *b\n  <<: {seed: 3}\n  lr: 2.0\nreward: *b\n"
    (tmp_path / "params.yaml").write_text(text)
    params = read_params(str(tmp_path / "params.yaml"))
    assert params["sft"] == {"steps": 4, "lr": 2.0, "seed": 3} and params["reward"] == {"steps": 4, "lr": 1.0}


def test_typed_fields_and_the_gate_criteria_take_numbers_written_as_strings():
    assert config_from_params(GateCriteria, {"max_ece": "1e-05"}, "registry.reward_gate").max_ece == 1e-05
    policy = config_from_params(PolicyCriteria, {"max_kl": "2.5", "min_eos_rate": 0.5}, "registry.policy_gate")
    assert policy.max_kl == 2.5
    assert config_from_params(SFTConfig, {"steps": "8", "lr": "3e-5"}, "sft").steps == 8
    with pytest.raises(ValueError, match=r"registry.reward_gate.max_ece must be a number, got 'small'"):
        config_from_params(GateCriteria, {"max_ece": "small"}, "registry.reward_gate")
    with pytest.raises(ValueError, match=r"sft.steps must be an integer, got '8.5'"):
        config_from_params(SFTConfig, {"steps": "8.5"}, "sft")
    with pytest.raises(ValueError, match=r"^params.yaml: sft.steps must be at least 0, got -5$"):  # a config's rule
        config_from_params(SFTConfig, {"steps": -5}, "sft")


def test_params_are_parsed_once_while_the_file_stays_the_same_and_again_when_it_changes(tmp_path, monkeypatch):
    from tasks.kit import params as module

    path = tmp_path / "params.yaml"
    path.write_text("sft: {lr: 1.0e-4}\n")
    parsed = []
    monkeypatch.setattr(module, "load_yaml", lambda name: parsed.append(name) or load_yaml(name))
    first = read_params(str(path))
    first["sft"]["lr"] = 0.5  # the caller's own copy
    assert read_params(str(path)) == {"sft": {"lr": 1.0e-4}} and len(parsed) == 1
    path.write_text("sft: {lr: 2.0e-4}\n")  # same size, likely the same modification time
    assert read_params(str(path)) == {"sft": {"lr": 2.0e-4}} and len(parsed) == 2


def test_the_longest_response_is_evaluations_only_where_it_samples_longer_than_ppo():
    sections = {"generation": {"max_new_tokens": 128}, "evaluate": {"max_new_tokens": None}}
    assert longest_response(sections.__getitem__) == ("generation.max_new_tokens", 128)
    sections["evaluate"]["max_new_tokens"] = 256
    assert longest_response(sections.__getitem__) == ("evaluate.max_new_tokens", 256)
    sections["evaluate"]["max_new_tokens"] = 64  # shorter than the rollouts: they are the longest it scores
    assert longest_response(sections.__getitem__) == ("generation.max_new_tokens", 128)
