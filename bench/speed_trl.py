"""Speed benchmark, TRL's worker: one measurement of TRL 1.12.0's SFTTrainer, RewardTrainer or PPOTrainer.

TRL is imported from ``bench/out/trl-1.12.0`` (put first on ``sys.path`` here, never installed
into the environment). Models, data and sizes are those of :mod:`bench.speed_ours`: SmolLM2-135M
from ``bench/out/speed/base`` loaded as float32, the token ids of the shared ``inputs.json``
(already tokenised by the product's chat encoder, so TRL's own tokenisation is skipped), the
same batch sizes, response length, PPO epochs and minibatches, every layer trainable; in the fair rows
(``trainable_layers`` set) the same lower blocks frozen as ours freezes them (``requires_grad`` off on the
embeddings and the lower blocks of the trained models: :func:`rlhf.training.supervised.freeze_lower_layers`).

Settings changed from TRL's defaults so both implementations do the same work:
``gradient_checkpointing=False`` (TRL's default is True; ours has none), ``bf16`` set by the row's
precision (TRL's default is True), ``use_cpu=True`` where there is no GPU (TRL refuses bf16 on a
CPU without it), ``report_to="none"``, ``save_strategy="no"``; PPO: ``stop_token=None`` and the
shared forced response length (:func:`bench.speed_worker.force_full_length`),
``num_sample_generations=0``, ``ACCELERATE_MIXED_PRECISION`` set from the row's precision
(``PPOTrainer`` builds its own ``Accelerator()``, which ignores ``bf16=True``; this is what
``accelerate launch --mixed_precision bf16`` sets).

Usage (the orchestrator :mod:`bench.speed` runs it):
    python -m bench.speed_trl '{"task": "ppo", "precision": "fp32", "steps": 3}'
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import typer

from bench.speed_setup import BASE, TRL_DIR, TRL_VERSION, load_inputs
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
from rlhf.training.supervised import freeze_lower_layers


def _use_trl() -> str:
    """Put ``bench/out/trl-1.12.0`` first on ``sys.path`` (this worker process only); returns TRL's version.

    Raises:
        RuntimeError: another TRL would be imported.
    """
    if TRL_DIR not in sys.path:
        sys.path.insert(0, TRL_DIR)
    import trl

    if not trl.__file__.startswith(TRL_DIR) or trl.__version__ != TRL_VERSION:
        raise RuntimeError(f"expected TRL {TRL_VERSION} from {TRL_DIR}, got {trl.__version__} from {trl.__file__}")
    return trl.__version__


def _common_args(spec: Spec, output_dir: str) -> dict[str, Any]:
    """TrainingArguments both supervised trainers and PPO share (see the module docstring)."""
    import torch

    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=spec.batch,
        gradient_accumulation_steps=1,
        learning_rate=spec.lr,
        bf16=spec.precision == "bf16",
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=spec.seed,
    )


def _args_summary(args: Any) -> dict[str, Any]:
    """The TRL settings that bear on speed, as they ended up (for results.json)."""
    names = ("bf16", "gradient_checkpointing", "optim", "max_grad_norm", "per_device_train_batch_size")
    summary = {name: str(getattr(args, name, None)) for name in names}
    for name in ("num_ppo_epochs", "num_mini_batches", "response_length", "stop_token", "max_length"):
        if hasattr(args, name):
            summary[name] = str(getattr(args, name))
    return summary


def _clock_callback(clock: StepClock) -> Any:
    """A TrainerCallback that starts ``clock`` at ``on_train_begin`` and ticks it at every ``on_step_end``."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            """Start the clock when TRL's training loop starts."""
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            """Tick after every optimiser step."""
            clock.tick()

    return Clock()


def _load_models(kinds: list[str]) -> list[Any]:
    """Float32 models from the shared base folder: ``causal`` (AutoModelForCausalLM) or ``scalar`` (one label)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    loaded = []
    for kind in kinds:
        if kind == "causal":
            loaded.append(AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32))
        else:
            loaded.append(AutoModelForSequenceClassification.from_pretrained(BASE, num_labels=1, dtype=torch.float32))
    return loaded


def run_ppo(spec: Spec) -> dict[str, Any]:
    """``trl.experimental.ppo.PPOTrainer.train()`` for ``spec.steps`` updates; each step timed by a callback."""
    if spec.sizes:
        raise ValueError("the scaling rows (sizes) are ours only")
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if spec.precision == "bf16" else "no"
    from datasets import Dataset
    from transformers import AutoTokenizer

    version = _use_trl()
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    prompts = load_inputs()["prompts"]
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    tokenizer.padding_side = "left"  # prompts are left-padded for generation, as TRL's examples do
    policy, reference, reward_model, value_model = _load_models(["causal", "causal", "scalar", "scalar"])
    for model in (policy, value_model):
        freeze_lower_layers(model, spec.trainable_layers)
    generation = GenerationLog()
    force_full_length(policy, generation)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as output_dir:
        args = PPOConfig(
            **_common_args(spec, output_dir),
            num_mini_batches=spec.minibatches,
            num_ppo_epochs=spec.epochs,
            response_length=spec.response,
            temperature=0.7,
            total_episodes=spec.steps * spec.batch,
            local_rollout_forward_batch_size=spec.batch,
            num_sample_generations=0,
            stop_token=None,
            kl_coef=0.05,
            logging_steps=1,
        )
        trainer = PPOTrainer(
            args=args,
            processing_class=tokenizer,
            model=policy,
            ref_model=reference,
            reward_model=reward_model,
            train_dataset=Dataset.from_dict({"input_ids": prompts}),
            value_model=value_model,
            callbacks=[_clock_callback(clock)],
        )
        mixed_precision = str(trainer.accelerator.mixed_precision)
        trainer.train()
    return {
        "task": "ppo",
        "precision_applied": "bf16" if mixed_precision == "bf16" else f"fp32 (accelerator: {mixed_precision})",
        "trl_version": version,
        "trl_args": _args_summary(args),
        "steps_s": clock.seconds,
        **timed_summary(clock.seconds),
        "iterations": [
            {
                "batch": rows,
                "response": spec.response,
                "seconds": seconds,
                "prompt_tokens": prompt_tokens,
                "generation_s": generation_s,
                "new_tokens": new_tokens,
            }
            for seconds, rows, prompt_tokens, generation_s, new_tokens in zip(
                clock.seconds,
                generation.responses,
                generation.prompt_tokens,
                generation.seconds,
                generation.new_tokens,
                strict=True,
            )
        ],
        "params": {"policy": param_counts(policy), "value": param_counts(value_model)},
    }


def _supervised(spec: Spec, task: str) -> dict[str, Any]:
    """SFTTrainer or RewardTrainer ``train()`` for ``spec.steps`` steps on the shared, pre-tokenised data."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    version = _use_trl()
    inputs = load_inputs()
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    clock_holder: list[StepClock] = []
    with tempfile.TemporaryDirectory() as output_dir:
        common = {**_common_args(spec, output_dir), "max_steps": spec.steps, "lr_scheduler_type": "cosine"}
        if task == "sft":
            from trl import SFTConfig, SFTTrainer

            (model,) = _load_models(["causal"])
            rows = inputs["sft"]
            dataset = Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "labels")})
            args, trainer_cls = SFTConfig(**common, max_length=None), SFTTrainer
        else:
            from trl import RewardConfig, RewardTrainer

            (model,) = _load_models(["scalar"])
            rows = inputs["pairs"]
            dataset = Dataset.from_dict({k: [r[k] for r in rows] for k in ("chosen_ids", "rejected_ids")})
            args, trainer_cls = RewardConfig(**common, max_length=None), RewardTrainer
        freeze_lower_layers(model, spec.trainable_layers)
        counter = TokenCounter(backbone(model))
        clock_holder.append(StepClock(counter))
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[_clock_callback(clock_holder[0])],
        )
        mixed_precision = str(trainer.accelerator.mixed_precision)
        trainer.train()
    clock = clock_holder[0]
    applied = "bf16" if mixed_precision == "bf16" else f"fp32 (accelerator: {mixed_precision})"
    return supervised_result(task, applied, clock, model, trl_version=version, trl_args=_args_summary(args))


def run_sft(spec: Spec) -> dict[str, Any]:
    """TRL's SFTTrainer on the shared demonstrations (loss on the response tokens, as ours)."""
    return _supervised(spec, "sft")


def run_reward(spec: Spec) -> dict[str, Any]:
    """TRL's RewardTrainer on the shared pairs."""
    return _supervised(spec, "reward")


def main(spec: str = typer.Argument(..., help="the run, as JSON (fields of bench.speed_worker.Spec)")) -> None:
    """Run one measurement of TRL's trainers and print its result as one JSON line."""
    run_worker("trl", spec, {"ppo": run_ppo, "sft": run_sft, "reward": run_reward})


if __name__ == "__main__":
    typer.run(main)
