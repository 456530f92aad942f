"""GPU check, the ``gpu`` profile's stages: one step of each stage's core work at that profile's sizes, its peak
memory beside the ~16 GB docs/configuration.md estimates for one GPU worker.

Each stage is its own step (its own process, so its peak is its own). The sizes come from ``params.yaml`` (the
assets folder's copy, else the working directory's) with ``profile: gpu``, read as the stages read them
(:func:`tasks.kit.params.stage_params`, :func:`tasks.kit.configs.config_from_params`): SFT and the reward model
take two optimiser steps of the profile's batch at its ``max_length`` (every example that long: the worst
case), PPO one iteration of the profile's rollouts with ``generation.max_new_tokens`` new tokens (a random model
never ends a response: again the worst case). Without CUDA the same code runs at :data:`CPU_SIZES`.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from typing import Any

import torch
import yaml

from bench.gpu_steps import DEVICE_KIND, four_models, ignore_log, model_folder, step_runtime

CPU_SIZES = {"batch_size": 2, "max_length": 48, "rollout_batch_size": 4, "minibatch_size": 2, "max_new_tokens": 4}
"""Without CUDA: the sizes the fallback runs at (the profile's would take hours on a CPU)."""
ESTIMATE_GB = 16.0
"""docs/configuration.md's estimate of one GPU worker's memory for the ``gpu`` profile."""


def _params(assets: str) -> dict[str, Any]:
    path = os.path.join(assets, "params.yaml")
    with open(path if os.path.isfile(path) else "params.yaml") as handle:
        params = yaml.safe_load(handle)
    return {**params, "profile": "gpu"}


def _section(cls: type, section: str, params: dict[str, Any], **changes: Any) -> Any:
    """``params``' ``section`` as the stage reads it, with ``changes`` (and :data:`CPU_SIZES` without CUDA)."""
    from tasks.kit.configs import config_from_params
    from tasks.kit.params import stage_params

    config = config_from_params(cls, stage_params(section, params), section)
    if DEVICE_KIND == "cpu":
        changes |= {k: v for k, v in CPU_SIZES.items() if hasattr(config, k)}
    return dataclasses.replace(config, **changes)


def _examples(count: int, words: int) -> list[dict[str, Any]]:
    text = " ".join(["the plant needs bright light and water when the soil is dry"] * (words // 12 + 1))
    return [
        {
            "prompt": [{"role": "user", "content": f"{i} {text}"}],
            "chosen": [{"role": "assistant", "content": f"{text} {i}"}],
            "rejected": [{"role": "assistant", "content": f"{i} no"}],
        }
        for i in range(count)
    ]


def _peak(started: float) -> dict[str, Any]:
    if DEVICE_KIND == "gpu":
        peak_gb = torch.cuda.max_memory_allocated() / 1e9
    else:  # the process's resident peak (kB on Linux)
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return {"work_s": time.perf_counter() - started, "peak_gb": peak_gb, "estimate_gb": ESTIMATE_GB}


def _supervised(assets: str, work: str, section: str, changes: dict[str, Any]) -> dict[str, Any]:
    """Two optimiser steps of the SFT or reward-model trainer at the profile's batch and ``max_length``."""
    from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
    from rlhf.reward.trainer import RewardConfig, train_reward_model
    from rlhf.training.sft import SFTConfig, train_sft

    cls, load, train = {
        "sft": (SFTConfig, load_causal_lm, train_sft),
        "reward": (RewardConfig, load_scalar_model, train_reward_model),
    }[section]
    folder, runtime = model_folder(assets, work), step_runtime()
    config = _section(cls, section, _params(assets), steps=2, checkpoint_every=0, warmup_steps=0, **changes)
    started = time.perf_counter()
    model = runtime.place(load(folder))
    examples = _examples(2 * config.batch_size, config.max_length)
    summary = train(model, load_tokenizer(folder), examples, config, ignore_log, runtime, progress=False)
    return {"batch": config.batch_size, "max_length": config.max_length, **_peak(started), **summary}


def stage_sft(assets: str, work: str) -> dict[str, Any]:
    """Two SFT steps at the profile's batch and ``max_length``."""
    return _supervised(assets, work, "sft", {})


def stage_reward(assets: str, work: str) -> dict[str, Any]:
    """Two reward-model steps at the profile's batch and ``max_length`` (the judge trains the same way)."""
    return _supervised(assets, work, "reward", {"kind_heads": False})


def stage_ppo(assets: str, work: str) -> dict[str, Any]:
    """One PPO-max iteration at the profile's rollouts, minibatches, epochs and new tokens, four models."""
    from rlhf.data.chat import encode_prompt, encode_text
    from rlhf.models.generation import GenerationSettings
    from rlhf.models.loading import load_tokenizer
    from rlhf.ppo.config import PPOConfig
    from rlhf.ppo.loop import train_ppo
    from rlhf.training.checkpoint import Checkpointer

    folder, runtime, params = model_folder(assets, work), step_runtime(), _params(assets)
    changes = {"iterations": 1, "value_pretrain_iterations": 0, "validate_every": 0, "validation_prompts": None}
    changes |= {"checkpoint_every": 0, "keep_every": 0, "collapse_reward_skew": None, "collapse_truncated_share": None}
    config = _section(PPOConfig, "ppo", params, **changes)
    settings = _section(GenerationSettings, "generation", params, no_eos="score", no_eos_value=None)
    tokenizer = load_tokenizer(folder)
    started = time.perf_counter()
    models = four_models(folder, runtime)
    examples = _examples(config.rollout_batch_size, config.max_prompt_length)
    prompts = [encode_prompt(tokenizer, ex["prompt"], config.max_prompt_length) for ex in examples]
    ptx = [encode_text(tokenizer, ex["chosen"][0]["content"])[: config.ptx_max_length] for ex in examples]
    logged = {}
    train_ppo(
        models,
        tokenizer,
        prompts,
        [],
        ptx_texts=ptx,
        config=config,
        settings=settings,
        log=lambda m, s: logged.update(m),
        checkpointer=Checkpointer(work),
        runtime=runtime,
        progress=False,
    )
    sizes = {"rollouts": config.rollout_batch_size, "new_tokens": settings.max_new_tokens, "epochs": config.ppo_epochs}
    return {**sizes, **_peak(started), "kl": logged.get("ppo/kl")}


STAGES = {"stage_sft": stage_sft, "stage_reward": stage_reward, "stage_ppo": stage_ppo}
