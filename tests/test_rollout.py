"""Scoring where the reward model learned to read, the value model's scale, and settings refused at load time."""

import math

import pytest
import torch

from rlhf.models import Rollout, load_scalar_model, sequence_scores
from rlhf.ppo_config import PPOConfig, max_skewness
from rlhf.rollout import (
    GenerationSettings,
    RunningMoments,
    calibrate_value_head,
    treat_unfinished,
    unfinished_responses,
    value_predictions,
)


def hand_made_rollout(tokenizer) -> Rollout:
    """Prompt [5, 6] (left-padded to 3), then: an ended response, a truncated one, an empty one (EOS first)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    hello, there = tokenizer("Hello there", add_special_tokens=False)["input_ids"][:2]
    input_ids = torch.tensor(
        [
            [pad, 5, 6, hello, there, eos],
            [pad, 5, 6, hello, there, hello],
            [pad, 5, 6, eos, pad, pad],
        ]
    )
    response_mask = torch.tensor([[True, True, True], [True, True, True], [True, False, False]])
    attention_mask = torch.cat([torch.tensor([[0, 1, 1]] * 3), response_mask.long()], dim=1)
    return Rollout(input_ids, attention_mask, response_mask, 3, torch.tensor([True, False, True]))


@pytest.mark.parametrize(
    "no_eos, value, empty_response, expected",
    [
        # raw scores [0.3, 0.8, 0.6] of (ended, truncated, empty):
        ("penalty", 1.0, "no_eos", [0.3, -0.2, -0.4]),  # 0.8 - 1.0; 0.6 - 1.0
        ("constant", -1.0, "no_eos", [0.3, -1.0, -1.0]),
        ("score", None, "no_eos", [0.3, 0.8, 0.6]),
        ("constant", -1.0, "score", [0.3, -1.0, 0.6]),  # the empty response keeps its score
    ],
)
def test_unfinished_responses_scored_as_configured_on_a_hand_made_batch(
    tokenizer, no_eos, value, empty_response, expected
):
    settings = GenerationSettings(no_eos=no_eos, no_eos_value=value, empty_response=empty_response)
    unfinished, empty = unfinished_responses(hand_made_rollout(tokenizer), tokenizer, settings)
    assert empty.tolist() == [False, False, True]
    scores = treat_unfinished(torch.tensor([0.3, 0.8, 0.6]), unfinished, settings)
    assert scores.tolist() == pytest.approx(expected)


def test_whitespace_only_response_counts_as_empty(tokenizer):
    rollout = hand_made_rollout(tokenizer)
    (space,) = tokenizer(" ", add_special_tokens=False)["input_ids"]
    (newline,) = tokenizer("\n", add_special_tokens=False)["input_ids"]
    rollout.input_ids[0, 3:5] = torch.tensor([space, newline])  # " \n" then EOS
    _, empty = unfinished_responses(rollout, tokenizer, GenerationSettings())
    assert empty.tolist() == [True, False, True]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"no_eos": "drop"}, "generation.no_eos must be one of"),
        ({"no_eos": "score", "no_eos_value": -1.0}, "null for score"),
        ({"no_eos": "penalty", "no_eos_value": None}, "must be set for no_eos penalty"),
        ({"empty_response": "ignore"}, "generation.empty_response"),
    ],
)
def test_generation_settings_refuse_contradictions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationSettings(**kwargs)


@torch.no_grad()
def test_value_model_from_the_reward_model_starts_on_the_normalised_reward_scale(tiny_dir, tokenizer):
    torch.manual_seed(0)
    value_model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(value_model.score.weight, std=1.0)
    ids, attn = torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long)
    head = value_predictions(value_model, ids, attn, 2)  # no calibration yet: the raw head at positions 1, 2
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 3.0]))  # mean 2, std 1
    calibrate_value_head(value_model, offset=0.5, moments=moments)
    # V = (head - offset - mean) / std = head - 2.5
    assert value_predictions(value_model, ids, attn, 2) == pytest.approx(head - 2.5, abs=1e-6)
    calibrate_value_head(value_model, offset=0.5, moments=None)  # normalisation off: only the offset
    assert value_predictions(value_model, ids, attn, 2) == pytest.approx(head - 0.5, abs=1e-6)
    # with normalisation off, V of the state before the last token (position 2) is the reward model's
    # centred score of the first three tokens
    value_model.config.reward_offset = 0.5
    full = value_predictions(value_model, ids, attn, 1)
    assert full[0, -1].item() == pytest.approx(sequence_scores(value_model, ids[:, :3], attn[:, :3]).item(), abs=1e-5)


def test_max_skewness_by_hand():
    # 8 values: (8 - 2) / sqrt(7) = 2.2678; 32 values: 30 / sqrt(31) = 5.3882
    assert max_skewness(8) == pytest.approx(2.2678, abs=1e-4)
    assert max_skewness(32) == pytest.approx(5.3882, abs=1e-4)
    # reached by n - 1 equal values and one outlier
    from rlhf.rollout import skewness

    assert skewness(torch.tensor([0.0] * 7 + [1.0])) == pytest.approx(max_skewness(8), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"collapse_window": 1, "collapse_reward_skew": 3.0}, "collapse_reward_skew 3.0 can never fire"),
        ({"collapse_truncated_share": 1.0}, "collapse_truncated_share must be in"),
        ({"collapse_length_ratio": 1.0}, "collapse_length_ratio must be above 1"),
        ({"adaptive_kl": True, "kl_horizon": 10000}, "inert"),
        ({"scheduler": "constant", "warmup_steps": 5}, "has no warm-up"),
        ({"value_pretrain_explained_variance": 1.5}, "out of reach"),
        ({"value_init": "random"}, "value_init"),
    ],
)
def test_ppo_config_refuses_settings_that_cannot_act(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(**kwargs)
    assert math.isfinite(max_skewness(4 * 8))
