"""The LoRA lever (``ppo.lora_rank``): a policy of adapters whose reference is the same weights, adapters off.

Its equivalence test: with the adapters disabled the policy computes exactly what the SFT model computes, at
the start and after training; with them on it starts exactly there too (peft's ``B = 0``), so PPO's KL starts
at exactly 0 as with a separate reference copy. Exact (``torch.equal``), not a tolerance: the same weights,
the same kernels, and a zero update added.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_levers import CONFIG, TEMPERATURE
from test_ppo import PROMPTS, SETTINGS, four_models, small_config

from rlhf.data.chat import encode_prompt
from rlhf.models.generation import GenerationSettings
from rlhf.models.lora import ADAPTER_FILE, AdapterDisabledReference, add_lora, is_lora, merged_copy
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.loop import train_ppo
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.rollout import make_experience
from rlhf.ppo.types import PPOModels
from rlhf.ppo.update import make_optimisers, ppo_update
from rlhf.runtime.device import Runtime
from rlhf.training.checkpoint import Checkpointer

RANK, ALPHA = 4, 8.0


def lora_models(folder) -> tuple[PPOModels, torch.nn.Module]:
    """``(models with a LoRA policy and its adapter-disabled reference, a plain copy of the SFT policy)``."""
    models = four_models(folder)
    sft = copy.deepcopy(models.policy)
    policy = add_lora(models.policy, RANK, ALPHA)
    return PPOModels(policy, AdapterDisabledReference(policy), models.reward_model, models.value_model), sft


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def base_weights(policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in policy.named_parameters() if "lora_" not in k}


def test_only_the_adapters_train_and_freezing_the_reference_leaves_them_trainable(tiny_dir):
    models, _ = lora_models(tiny_dir)
    models.reference.requires_grad_(False)
    models.reference.eval()
    assert list(models.reference.parameters()) == []
    trainable = {k: p.numel() for k, p in models.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in k for k in trainable)
    # by hand, tiny Llama (hidden 32, MLP 64, 4 heads and 2 KV heads of 8): rank x (in + out) per projection,
    # q 32+32, k 32+16, v 32+16, o 32+32, gate 32+64, up 32+64, down 64+32 = 512 per unit of rank and block
    assert sum(trainable.values()) == 2 * RANK * 512


def test_lora_policy_and_its_reference_start_exactly_as_sft_and_the_reference_stays_sft(tiny_dir, tokenizer):
    models, sft = lora_models(tiny_dir)
    ids = torch.tensor([[1, 100, 200, 300, 2], [1, 7, 77, 777, 2]])
    assert torch.equal(logits(models.policy, ids), logits(sft, ids))
    assert torch.equal(logits(models.reference, ids), logits(sft, ids))
    # through the rollout: PPO's KL to the reference starts at exactly 0
    torch.manual_seed(0)
    prompts = [encode_prompt(tokenizer, p, 32) for p in PROMPTS[:4]]
    settings = GenerationSettings(max_new_tokens=6, temperature=TEMPERATURE)
    runtime = Runtime()
    experience, stats = make_experience(models, tokenizer, prompts, CONFIG, settings, RewardMoments(), 0.05, runtime)
    assert stats["ppo/kl"] == 0.0 and stats["ppo/kl_k3"] == 0.0
    # one PPO step at a large learning rate moves the adapters, never the base weights
    before = base_weights(models.policy)
    config = PPOConfig(
        rollout_batch_size=4, minibatch_size=4, ppo_epochs=1, policy_lr=1e-2, lora_rank=RANK, trainable_layers=None
    )
    optimisers = make_optimisers(models.policy, models.value_model, config)
    update = ppo_update(
        models.policy, models.value_model, optimisers, experience, config, TEMPERATURE, 0, None, True, runtime
    )
    assert update["ppo/policy/ratio"] == pytest.approx(1.0, abs=1e-6)  # the first minibatch, as without LoRA
    after = base_weights(models.policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not torch.equal(logits(models.policy, ids), logits(sft, ids))
    assert torch.equal(logits(models.reference, ids), logits(sft, ids))  # the reference is still the SFT model


def test_checkpoint_keeps_the_adapters_only_and_restores_them(tiny_dir, tmp_path):
    models, _ = lora_models(tiny_dir)
    with torch.no_grad():
        for name, p in models.policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    saved = {k: v.clone() for k, v in models.policy.named_parameters() if "lora_" in k}
    path = Checkpointer(str(tmp_path)).save(1, {"policy": models.policy}, {})
    files = sorted(p.name for p in (tmp_path / "step-00000001" / "policy").iterdir())
    assert ADAPTER_FILE in files and "model.safetensors" not in files
    with torch.no_grad():
        for name, p in models.policy.named_parameters():
            if "lora_" in name:
                p.zero_()
    Checkpointer(str(tmp_path)).load_model_weights(path, "policy", models.policy)
    restored = {k: v for k, v in models.policy.named_parameters() if "lora_" in k}
    assert all(torch.equal(saved[k], restored[k]) for k in saved)


def test_checkpoint_of_other_adapters_is_refused(tiny_dir, tmp_path):
    models, _ = lora_models(tiny_dir)
    path = Checkpointer(str(tmp_path)).save(1, {"policy": models.policy}, {})
    other = add_lora(four_models(tiny_dir).policy, RANK * 2, ALPHA)
    with pytest.raises(
        ValueError, match=r"adapter_model.safetensors: adapters do not match the policy \(size mismatch"
    ):
        Checkpointer(str(tmp_path)).load_model_weights(path, "policy", other)


def test_merged_copy_is_a_plain_model_computing_what_the_policy_computes(tiny_dir, tmp_path):
    models, sft = lora_models(tiny_dir)
    with torch.no_grad():
        for name, p in models.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    merged = merged_copy(models.policy)
    assert type(merged) is type(sft) and is_lora(models.policy)  # the policy itself keeps its adapters
    assert not any("lora_" in k for k in merged.state_dict())
    ids = torch.tensor([[1, 100, 200, 300, 2]])
    # W + (alpha / r) B A folded into W: fp32 sums in another order, measured 2e-7 of logits of scale 1
    torch.testing.assert_close(logits(merged, ids), logits(models.policy, ids), rtol=0, atol=1e-5)
    assert not torch.equal(logits(merged, ids), logits(sft, ids))
    assert merged_copy(sft) is sft


def test_ppo_with_a_lora_policy_trains_the_adapters_and_ships_the_best(tiny_dir, tokenizer, tmp_path):
    models, sft = lora_models(tiny_dir)
    before = base_weights(models.policy)
    prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS]
    config = small_config(lora_rank=RANK, lora_alpha=ALPHA, policy_lr=1e-2, validate_every=1, trainable_layers=None)
    logged: dict[int, dict[str, float]] = {}

    def log(metrics: dict[str, float], step: int) -> None:
        logged.setdefault(step, {}).update(metrics)

    result = train_ppo(
        models, tokenizer, prompts[:5], prompts[5:], [], config, SETTINGS, log, Checkpointer(str(tmp_path)), Runtime(),
        False,
    )  # fmt: skip
    assert is_lora(models.policy) and result.history
    after = base_weights(models.policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    ids = torch.tensor([[1, 100, 200, 300, 2]])
    assert torch.equal(logits(models.reference, ids), logits(sft, ids))
    # the shipped policy is the best by validation reward (step 0: the SFT policy), restored from its adapter checkpoint
    best = logged[result.best_iteration]["ppo/validation/reward"]
    assert result.summary["ppo/validation/reward"] == pytest.approx(best)
    assert best == max(
        metrics["ppo/validation/reward"] for metrics in logged.values() if "ppo/validation/reward" in metrics
    )


def test_lora_and_trainable_layers_are_refused_together():
    with pytest.raises(ValueError, match="lora_rank and ppo.trainable_layers"):
        PPOConfig(lora_rank=8, trainable_layers=4)
    with pytest.raises(ValueError, match="ppo.lora_rank must be at least 0, got -1"):
        PPOConfig(lora_rank=-1, trainable_layers=None)
    with pytest.raises(ValueError, match="rank >= 1"):
        add_lora(torch.nn.Linear(2, 2), 0, 1.0)


def test_the_ppo_stage_loads_the_sft_weights_once_for_a_lora_policy(tiny_dir, monkeypatch):
    import tasks.ppo

    loads = []
    real = tasks.ppo.load_causal_lm
    monkeypatch.setattr(tasks.ppo, "load_causal_lm", lambda folder: loads.append(folder) or real(folder))
    runtime = Runtime(torch.device("cpu"), "bf16", frozen_bf16=True)
    policy, reference = tasks.ppo.policy_and_reference(
        tiny_dir, PPOConfig(lora_rank=RANK, trainable_layers=None), runtime
    )
    assert loads == [tiny_dir] and is_lora(policy) and isinstance(reference, AdapterDisabledReference)
    assert reference.policy is policy and policy.dtype == torch.float32  # frozen_bf16 has no copy to act on
    loads.clear()
    policy, reference = tasks.ppo.policy_and_reference(tiny_dir, PPOConfig(), runtime)
    assert loads == [tiny_dir, tiny_dir] and not is_lora(policy) and reference.dtype == torch.bfloat16
