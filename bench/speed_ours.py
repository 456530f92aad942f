"""Speed benchmark, our worker: one measurement of this product's SFT, reward-model or PPO trainer.

Loads SmolLM2-135M from ``bench/out/speed/base`` with the product's loaders, trains on the shared
``inputs.json`` and prints one JSON line (see :mod:`bench.speed_worker`). The PPO figure is the
product's own iteration, :func:`rlhf.ppo.rollout.make_experience` then :func:`rlhf.ppo.update.ppo_update`,
exactly as :func:`rlhf.ppo.loop.train_ppo` calls them, without the collapse guard, validation and
checkpoints around them; the per-phase seconds are read from the stats those two return.

Usage (the orchestrator :mod:`bench.speed` runs it):
    python -m bench.speed_ours '{"task": "ppo", "precision": "fp32", "steps": 3}'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import typer

from bench.speed_setup import BASE, load_inputs
from bench.speed_worker import (
    GenerationLog,
    Spec,
    StepClock,
    TokenCounter,
    backbone,
    force_full_length,
    param_counts,
    run_worker,
    supervised_result,
    timed_summary,
)
from rlhf.runtime.device import Runtime, runtime_from_params

PHASES = ("generation", "reward", "policy_logprobs", "reference", "values", "update")
"""The per-phase seconds the product reports as ``ppo/time/<phase>``."""


def _runtime(precision: str) -> tuple[Runtime, str]:
    """Our trainers' device and precision, from accelerate as the stages take them (:func:`runtime_from_params`).

    fp32: ``mixed_precision: no``; bf16 (our best): ``mixed_precision: bf16`` with the frozen models in float32
    as the demo runs (``frozen_bf16: false``): the reference and reward model then hold the policy's frozen
    blocks exactly, so they are computed once (:mod:`rlhf.models.trunk`), which bf16 copies would prevent.

    Returns:
        ``(runtime, description of what runs)``.
    """
    bf16 = precision == "bf16"
    runtime = runtime_from_params({"mixed_precision": "bf16" if bf16 else "no", "cpu": False, "frozen_bf16": False})
    applied = "bf16" if bf16 else "fp32"
    return runtime, applied if runtime.device.type == "cpu" else f"{applied} on {runtime.device.type}"


def compile_blocks(models, on: bool) -> None:
    """``torch.compile`` each decoder block of ``models`` in place (dynamic shapes: the batches vary in length),
    so every path that runs the blocks (the plain pass, the shared trunk, packed rows, generation) is compiled."""
    for model in models if on else ():
        for block in backbone(model).layers:
            block.compile(dynamic=True)


def run_ppo(spec: Spec) -> dict[str, Any]:
    """PPO iterations (rollout, scoring, update) with SmolLM2-135M as policy, reference, reward and value model."""
    from rlhf.models.generation import GenerationSettings
    from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
    from rlhf.models.lora import AdapterDisabledReference, add_lora
    from rlhf.ppo.config import PPOConfig
    from rlhf.ppo.moments import RewardMoments
    from rlhf.ppo.rollout import make_experience
    from rlhf.ppo.types import PPOModels
    from rlhf.ppo.update import make_optimisers, ppo_update
    from rlhf.training.supervised import freeze_lower_layers

    runtime, applied = _runtime(spec.precision)
    prompts = load_inputs()["prompts"]
    tokenizer = load_tokenizer(BASE)
    policy = runtime.place(load_causal_lm(BASE))
    if spec.lora_rank:  # as tasks/ppo.py builds it: no second copy of the weights for the reference
        policy = add_lora(policy, spec.lora_rank, 2.0 * spec.lora_rank)
        reference = AdapterDisabledReference(policy)
    else:
        reference = runtime.frozen(load_causal_lm(BASE))
    reward_model, value_model = runtime.frozen(load_scalar_model(BASE)), runtime.place(load_scalar_model(BASE))
    models = PPOModels(policy, reference, reward_model, value_model)
    compile_blocks(models.as_tuple(), spec.compile)
    config = PPOConfig(
        rollout_batch_size=spec.batch,
        minibatch_size=max(spec.batch // spec.minibatches, 1),
        ppo_epochs=spec.epochs,
        policy_lr=spec.lr,
        value_lr=spec.lr,
        value_pretrain_iterations=0,
        collapse_reward_skew=None,
        trainable_layers=spec.trainable_layers,
        lora_rank=spec.lora_rank,
        lora_alpha=2.0 * max(spec.lora_rank, 1),
        seed=spec.seed,
    )
    for model in models.as_tuple():
        model.eval()  # dropout off; gradients still flow into policy and value model
    reference.requires_grad_(False)
    reward_model.requires_grad_(False)
    for model in (policy, value_model):
        freeze_lower_layers(model, config.trainable_layers)
    params = {"policy": param_counts(policy), "value": param_counts(value_model)}
    optimisers = make_optimisers(policy, value_model, config)
    moments = RewardMoments()
    generation = GenerationLog()
    force_full_length(policy, generation)
    clock, iterations = StepClock(), []
    clock.start()
    for iteration, (size, response) in enumerate(spec.schedule()):
        config = dataclasses.replace(config, rollout_batch_size=size, minibatch_size=max(size // spec.minibatches, 1))
        settings = GenerationSettings(max_new_tokens=response, temperature=0.7)
        batch = [prompts[(iteration * size + j) % len(prompts)] for j in range(size)]
        experience, stats = make_experience(
            models,
            tokenizer,
            batch,
            config,
            settings=settings,
            moments=moments,
            kl_coef=config.kl_coef,
            runtime=runtime,
            calibrate_value=iteration == 0,
        )
        update = ppo_update(
            policy,
            value_model,
            optimisers,
            experience,
            config=config,
            temperature=settings.temperature,
            order_seed=config.seed * 100003 + iteration,  # the minibatch order, as rlhf.ppo.loop fixes it
            ptx_batches=None,
            update_policy=True,
            runtime=runtime,
            iteration=iteration + 1,
        )
        clock.tick()
        merged = {**stats, **update}
        iterations.append(
            {
                "batch": size,
                "response": response,
                "seconds": clock.seconds[-1],
                "prompt_tokens": generation.prompt_tokens[-1],
                "phases": {phase: merged[f"ppo/time/{phase}"] for phase in PHASES},
                "generation_s": generation.seconds[-1],
                "new_tokens": generation.new_tokens[-1],
                "scored_length": stats["ppo/response_length"],
            }
        )
    return {
        "task": "ppo",
        "precision_applied": applied,
        "steps_s": clock.seconds,
        **timed_summary(clock.seconds),
        "iterations": iterations,
        "params": params,
    }


def _supervised(spec: Spec, task: str) -> dict[str, Any]:
    """SFT or reward-model training steps, timed by the per-step ``log`` callback."""
    from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
    from rlhf.reward.trainer import RewardConfig, train_reward_model
    from rlhf.training.sft import SFTConfig, train_sft

    runtime, applied = _runtime(spec.precision)
    inputs = load_inputs()
    tokenizer = load_tokenizer(BASE)
    common = dict(
        steps=spec.steps,
        batch_size=spec.batch,
        lr=spec.lr,
        warmup_steps=0,
        checkpoint_every=0,
        trainable_layers=spec.trainable_layers,
        group_by_length=False,  # TRL's default: the same batches on both sides
        seed=spec.seed,
    )
    if task == "sft":
        model, examples = load_causal_lm(BASE), [row["example"] for row in inputs["sft"]]
        config, train = SFTConfig(**common), train_sft
    else:
        model, examples = load_scalar_model(BASE), [row["example"] for row in inputs["pairs"]]
        config, train = RewardConfig(**common), train_reward_model
    model = runtime.place(model)
    compile_blocks([model], spec.compile)
    counter = TokenCounter(backbone(model))
    clock = StepClock(counter)

    def log(metrics: dict[str, float], step: int) -> None:
        clock.tick()  # called once per optimiser step, after it

    clock.start()  # nothing is checkpointed: checkpoint_every 0 and no checkpointer
    train(model, tokenizer, examples, config, log, runtime, progress=False)
    return supervised_result(task, applied, clock, model)


def run_sft(spec: Spec) -> dict[str, Any]:
    """SFT steps (:func:`rlhf.training.sft.train_sft`) on the shared demonstrations."""
    return _supervised(spec, "sft")


def run_reward(spec: Spec) -> dict[str, Any]:
    """Reward-model steps (:func:`rlhf.reward.trainer.train_reward_model`) on the shared pairs."""
    return _supervised(spec, "reward")


def main(spec: str = typer.Argument(..., help="the run, as JSON (fields of bench.speed_worker.Spec)")) -> None:
    """Run one measurement of our trainers and print its result as one JSON line."""
    run_worker("ours", spec, {"ppo": run_ppo, "sft": run_sft, "reward": run_reward})


if __name__ == "__main__":
    typer.run(main)
