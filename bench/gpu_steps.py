"""GPU check, the steps: each runs in its own process (:mod:`bench.gpu_check`) and returns one dict of figures.

On a CUDA machine the steps run at GPU sizes in bf16 (:data:`SIZES` ``gpu``); without CUDA at tiny sizes in fp32
(``cpu``, the fallback the test suite runs). The model is the assets folder's (:mod:`bench.gpu_prepare`): its
weights where present (the real SmolLM2-135M, or the tests' tiny model), else a random model of the shape in its
``config.json`` (a lent GPU machine takes 64 MiB from here, not the 98 MB GGUF), seeded, with the real tokenizer
(without CUDA, of :data:`CPU_SHAPE`).

- ``env``: versions, the device, and the measured matmul peak (bf16 on CUDA, fp32 on the CPU), TFLOP/s.
- ``smoke``: the core trainers on the device: SFT and reward-model steps, two PPO iterations (PPO-ptx,
  validation, a checkpoint each), one iteration with the frozen models in bf16; every loss finite, every
  model and experience tensor on the device; a run stopped after its first iteration and resumed from that
  checkpoint gives the uninterrupted run's second iteration within :data:`RESUME_TOLERANCE`.
- ``decode``: :func:`rlhf.models.sampling.sample`'s decoding (transformers' ``generate``, a dynamic KV cache) against a
  static cache (compiled by transformers on CUDA), tokens per second and whether both sampled the same tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any

import torch

SIZES = {  # per device kind: the smoke test's batches and lengths, the decode batch and new tokens
    "gpu": {"batch": 32, "max_length": 256, "new_tokens": 64, "rollouts": 64, "decode_batch": 64, "decode_tokens": 128},
    "cpu": {"batch": 2, "max_length": 64, "new_tokens": 4, "rollouts": 4, "decode_batch": 2, "decode_tokens": 8},
}
RESUME_TOLERANCE = {"gpu": 2e-2, "cpu": 1e-5}
"""Largest relative difference of a figure of the resumed second iteration from the uninterrupted one's: fp32 on
the CPU repeats itself to rounding; bf16 on a GPU adds non-deterministic reduction order (cuBLAS, atomics in the
backward pass), about 1e-2 of a bf16 mantissa's 8 bits."""
DEVICE_KIND = "gpu" if torch.cuda.is_available() else "cpu"
CPU_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
CPU_SHAPE |= {"num_key_value_heads": 2, "head_dim": 16}
"""Without CUDA a random model of the config's shape shrinks to this (the tiny profile's): the fallback checks
that every step runs, in seconds."""


def model_folder(assets: str, work: str) -> str:
    """``assets`` when it holds weights, else a folder in ``work`` with a seeded random model of its config's shape
    (safetensors) and its tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(assets, "model.safetensors")):
        return assets
    folder = os.path.join(work, "random-model")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        torch.manual_seed(0)
        shape = {} if DEVICE_KIND == "gpu" else CPU_SHAPE
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets, **shape))
        model.save_pretrained(folder)
        from rlhf.models.loading import load_tokenizer, save_tokenizer

        save_tokenizer(load_tokenizer(assets), folder)
    return folder


def step_runtime(frozen_bf16: bool = False):
    """The steps' device and precision: bf16 on CUDA, fp32 on the CPU
    (:func:`rlhf.runtime.device.runtime_from_params`)."""
    from rlhf.runtime.device import runtime_from_params

    precision = "bf16" if DEVICE_KIND == "gpu" else "no"
    return runtime_from_params({"mixed_precision": precision, "cpu": DEVICE_KIND == "cpu", "frozen_bf16": frozen_bf16})


def env(assets: str, work: str) -> dict[str, Any]:
    """Versions, the device and its measured matmul peak (:func:`matmul_tflops`)."""
    import transformers

    dtype = "bf16" if DEVICE_KIND == "gpu" else "fp32"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if DEVICE_KIND == "gpu" else "cpu",
        "sizes": DEVICE_KIND,
        "matmul_dtype": dtype,
        "matmul_tflops": matmul_tflops(dtype),
    }


def matmul_tflops(dtype: str) -> float:
    """The device's best square matmul in ``dtype`` (``bf16`` or ``fp32``), TFLOP/s: the fastest of 10 products
    of 8192 x 8192 matrices on CUDA (512 on the CPU) after 3 warm-ups."""
    size = 8192 if DEVICE_KIND == "gpu" else 512
    device = torch.device("cuda" if DEVICE_KIND == "gpu" else "cpu")
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a, b = (torch.randn(size, size, device=device, dtype=torch_dtype) for _ in range(2))
    best = math.inf
    for index in range(13):
        _sync()
        start = time.perf_counter()
        a @ b
        _sync()
        if index >= 3:
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def _sync() -> None:
    if DEVICE_KIND == "gpu":
        torch.cuda.synchronize()


def _examples(count: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": [{"role": "user", "content": f"Question {i}: how do I keep basil alive indoors?"}],
            "chosen": [
                {"role": "assistant", "content": f"Give it bright light and water it when the soil dries ({i})."}
            ],
            "rejected": [{"role": "assistant", "content": f"No idea ({i})."}],
        }
        for i in range(count)
    ]


def _on_device(tensors: dict[str, Any], device: torch.device) -> list[str]:
    """Names of the tensors (and of the modules' parameters) not on ``device``."""
    wrong = []
    for name, value in tensors.items():
        if isinstance(value, torch.nn.Module):
            wrong += [f"{name}.{p}" for p, t in value.named_parameters() if t.device.type != device.type]
        elif isinstance(value, torch.Tensor) and value.device.type != device.type:
            wrong.append(name)
    return wrong


def smoke(assets: str, work: str) -> dict[str, Any]:
    """The core trainers on the device (see the module's docstring); raises on the first broken promise."""
    from rlhf.data.chat import encode_prompt, encode_text
    from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
    from rlhf.reward.trainer import RewardConfig, train_reward_model
    from rlhf.training.sft import SFTConfig, train_sft

    size, folder = SIZES[DEVICE_KIND], model_folder(assets, work)
    runtime, tokenizer = step_runtime(), load_tokenizer(folder)
    examples, figures = _examples(4 * size["batch"]), {"precision": runtime.mixed_precision}
    loop = {"steps": 3, "batch_size": size["batch"], "max_length": size["max_length"], "checkpoint_every": 0}
    loop |= {"trainable_layers": None, "warmup_steps": 0}
    started = time.perf_counter()
    policy = runtime.place(load_causal_lm(folder))
    sft = train_sft(policy, tokenizer, examples, SFTConfig(**loop), ignore_log, runtime, progress=False)
    figures["sft_s"], figures["sft_loss_last"] = time.perf_counter() - started, sft["sft/loss_last"]
    started = time.perf_counter()
    reward_model = runtime.place(load_scalar_model(folder))
    reward_config = RewardConfig(**loop, length_expert=False, short_rejections=0.0, kind_heads=False)
    reward = train_reward_model(reward_model, tokenizer, examples, reward_config, ignore_log, runtime, progress=False)
    figures["reward_s"], figures["reward_loss_last"] = time.perf_counter() - started, reward["rm/loss_last"]
    prompts = [encode_prompt(tokenizer, ex["prompt"], size["max_length"] // 2) for ex in examples]
    ptx = [encode_text(tokenizer, ex["chosen"][0]["content"]) for ex in examples]
    wrong = _on_device({"sft policy": policy, "reward model": reward_model}, runtime.device)
    full, started = _ppo(folder, tokenizer, prompts, ptx, os.path.join(work, "full"), runtime), time.perf_counter()
    stopped_root = os.path.join(work, "stopped")
    with contextlib.suppress(_Stop):
        _ppo(folder, tokenizer, prompts, ptx, stopped_root, runtime, stop_at=2)
    resumed = _ppo(folder, tokenizer, prompts, ptx, stopped_root, runtime)
    figures["ppo_stopped_and_resumed_s"] = time.perf_counter() - started
    figures["ppo_iteration_s"] = full["seconds"] / 2
    figures["resume_figures_compared"], figures["resume_max_rel_diff"] = _compare(
        full["logged"][2], resumed["logged"][2]
    )
    frozen = _ppo(folder, tokenizer, prompts, ptx, os.path.join(work, "frozen"), step_runtime(frozen_bf16=True), 1)
    wrong += full["wrong"] + frozen["wrong"]
    non_finite = [k for run in (full, frozen) for m in run["logged"].values() for k, v in m.items() if _bad(v)]
    non_finite += [k for k, v in {**sft, **reward}.items() if _bad(v)]
    figures |= {"off_device": len(wrong), "non_finite": len(non_finite), "frozen_bf16_iteration_s": frozen["seconds"]}
    if wrong or non_finite:
        raise AssertionError(f"off the device: {wrong[:5]}; non-finite: {sorted(set(non_finite))[:5]}")
    if figures["resume_max_rel_diff"] > RESUME_TOLERANCE[DEVICE_KIND]:
        raise AssertionError(f"resumed iteration differs by {figures['resume_max_rel_diff']:.3g} (relative)")
    return figures


def four_models(folder: str, runtime):
    """PPO's policy, reference, reward and value model, all from ``folder``, placed as tasks/ppo.py places them."""
    from rlhf.models.loading import load_causal_lm, load_scalar_model
    from rlhf.ppo.types import PPOModels

    return PPOModels(
        runtime.place(load_causal_lm(folder)),
        runtime.frozen(load_causal_lm(folder)),
        runtime.frozen(load_scalar_model(folder)),
        runtime.place(load_scalar_model(folder)),
    )


class _Stop(Exception):
    """Raised from the log callback: a run stopped after an iteration's checkpoint."""


def ignore_log(metrics: dict[str, float], step: int) -> None:
    del metrics, step


def _bad(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _compare(full: dict[str, float], resumed: dict[str, float]) -> tuple[int, float]:
    """How many figures both runs logged for the iteration (seconds aside), and their largest relative difference
    (relative to at least 1e-3, so a figure near 0 is compared absolutely)."""
    keys = [k for k in full if k in resumed and not k.startswith("ppo/time/") and isinstance(full[k], float)]
    keys = [k for k in keys if math.isfinite(full[k])]
    if not keys:
        raise AssertionError("the resumed run logged none of the uninterrupted run's figures")
    return len(keys), max(abs(resumed[k] - full[k]) / max(abs(full[k]), 1e-3) for k in keys)


def _ppo(folder, tokenizer, prompts, ptx, root, runtime, iterations=2, stop_at=None) -> dict[str, Any]:
    """``iterations`` PPO-max iterations from ``folder`` as all four models (checkpoint every iteration, PPO-ptx,
    validation); also the device of one experience buffer's tensors. ``stop_at``: raise :class:`_Stop` once that
    step has been logged (its checkpoint written first)."""
    from rlhf.models.generation import GenerationSettings
    from rlhf.ppo.config import PPOConfig
    from rlhf.ppo.loop import train_ppo
    from rlhf.ppo.moments import RewardMoments
    from rlhf.ppo.rollout import make_experience
    from rlhf.training.checkpoint import Checkpointer

    size = SIZES[DEVICE_KIND]
    torch.manual_seed(0)
    models = four_models(folder, runtime)
    config = PPOConfig(
        iterations=iterations,
        value_pretrain_iterations=0,
        rollout_batch_size=size["rollouts"],
        minibatch_size=size["rollouts"] // 2,
        ppo_epochs=1,
        validate_every=1,
        validation_prompts=2,
        checkpoint_every=1,
        ptx_coef=0.5,
        ptx_batch_size=2,
        collapse_reward_skew=None,
        collapse_truncated_share=None,
    )
    settings = GenerationSettings(max_new_tokens=size["new_tokens"], temperature=0.7, no_eos="score", no_eos_value=None)
    logged: dict[int, dict[str, float]] = {}

    def log(metrics: dict[str, float], step: int) -> None:
        logged[step] = {**logged.get(step, {}), **metrics}
        if stop_at is not None and step == stop_at:
            raise _Stop

    started = time.perf_counter()
    train_ppo(
        models,
        tokenizer,
        prompts[2:],
        prompts[:2],
        ptx_texts=ptx,
        config=config,
        settings=settings,
        log=log,
        checkpointer=Checkpointer(root),
        runtime=runtime,
        progress=False,
    )
    seconds = time.perf_counter() - started
    experience, _ = make_experience(
        models,
        tokenizer,
        prompts[: size["rollouts"]],
        config,
        settings=settings,
        moments=RewardMoments(),
        kl_coef=0.05,
        runtime=runtime,
    )
    tensors = {f"experience.{f.name}": getattr(experience, f.name) for f in dataclasses.fields(experience)}
    tensors |= {"policy": models.policy, "value model": models.value_model}
    return {"logged": logged, "seconds": seconds, "wrong": _on_device(tensors, runtime.device)}


def decode(assets: str, work: str) -> dict[str, Any]:
    """The product's sampling (:func:`rlhf.models.sampling.sample`, as rollouts and evaluation call it, one seed per
    prompt)
    with the dynamic KV cache (the default) and the static one (``generation.cache``).

    Both sample ``decode_batch`` prompts for up to ``decode_tokens`` new tokens in float32 on the CPU, bf16 on a GPU
    (tokens/s count the response tokens sampled, a response that ends stopping early); ``same_tokens`` says whether
    both sampled the same ids.
    """
    from rlhf.data.chat import encode_prompt
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.models.sampling import sample

    size, folder = SIZES[DEVICE_KIND], model_folder(assets, work)
    tokenizer, runtime = load_tokenizer(folder), step_runtime()
    model = runtime.place(load_causal_lm(folder))
    if DEVICE_KIND == "gpu":
        model = model.to(torch.bfloat16)
    prompts = [encode_prompt(tokenizer, _examples(1)[0]["prompt"], 64)] * size["decode_batch"]
    seeds = list(range(len(prompts)))
    figures, rollouts = {}, {}
    for cache in ("dynamic", "static"):
        for _repeat in range(2):  # the first builds the cache (and compiles a static one): not timed
            _sync()
            started = time.perf_counter()
            rollout = sample(model, tokenizer, prompts, size["decode_tokens"], 0.7, seeds=seeds, cache=cache)
            _sync()
            seconds = time.perf_counter() - started
        figures[f"{cache}_tokens_per_s"] = float(rollout.response_mask.sum()) / seconds
        rollouts[cache] = rollout.input_ids
    figures["same_tokens"] = bool(torch.equal(rollouts["dynamic"], rollouts["static"]))
    figures["static_speedup"] = figures["static_tokens_per_s"] / figures["dynamic_tokens_per_s"]
    return figures


STEPS = {"env": env, "smoke": smoke, "decode": decode}
"""This module's steps, in the order the check runs them."""
