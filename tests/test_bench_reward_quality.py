"""bench.reward_quality's params: each model's section as its stage reads it builds that model's config."""

from __future__ import annotations

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
