"""bench.reward_quality's params: each model's section as its stage reads it builds that model's config."""

from __future__ import annotations

import os

import pytest

from bench.reward_quality import MODELS, training_params
from tasks.kit.configs import config_from_params


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_models_params_build_its_config_with_the_overrides(name):
    params, source = training_params(name, ["lr=3e-4", "seed=5"])
    config = config_from_params(MODELS[name][0], params, name)  # judge.source is not a config key: taken out
    assert (config.lr, config.seed, source) == (3e-4, 5, None)


def test_a_judge_from_another_backbone_names_it_apart_from_its_config():
    params, source = training_params("judge", ["source=models/other"])
    assert source == "models/other" and "source" not in params


def test_the_backbone_is_the_init_folder_without_a_source_and_a_saved_copy_of_one(tmp_path, monkeypatch, tiny_dir):
    from bench.reward_quality import backbone

    monkeypatch.chdir(tmp_path)
    with backbone("models/base", None, "judge") as folder:
        assert folder == "models/base" and list(tmp_path.iterdir()) == []  # no folder made for nothing
    with backbone("models/base", tiny_dir, "judge") as folder:
        assert os.path.isfile(os.path.join(folder, "config.json"))
        assert os.path.dirname(os.path.abspath(folder)) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # removed on the way out
