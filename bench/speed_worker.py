"""Speed benchmark, what both workers share: the run spec, step clocks, token counts, forced response length.

A worker (:mod:`bench.speed_ours`, :mod:`bench.speed_trl`) is one process that loads its models,
runs one measurement and prints exactly one JSON line on stdout (everything else the libraries
print is sent to stderr), so its peak resident memory (``ru_maxrss``) is its own.

The same instruments are put on both implementations from the outside, so they measure the
same things the same way:

- :class:`StepClock`: wall-clock seconds of each optimiser step / PPO iteration;
- :class:`TokenCounter`: real (attention-mask) and padded tokens of every training forward,
  counted by a pre-hook on the transformer backbone;
- :func:`force_full_length`: every sampling of the policy (TRL's ``generate``, our
  :func:`rlhf.models.sampling.decode`) samples exactly ``max_new_tokens`` tokens (EOS cannot be
  sampled) and its seconds and new tokens are recorded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlhf.models import sampling


@dataclass
class Spec:
    """One measurement: which trainer, at which precision and sizes.

    ``batch`` is prompts per PPO iteration, or examples (pairs for the reward model) per
    optimiser step; ``minibatches`` splits a PPO rollout; ``trainable_layers`` None trains every layer;
    ``lora_rank`` > 0 trains a LoRA policy instead (PPO only).
    """

    task: str  # ppo | reward | sft
    precision: str = "fp32"  # fp32 | bf16 (the implementation's own mixed precision)
    steps: int = 3  # PPO iterations or optimiser steps; the first is the warm-up, not timed
    batch: int = 4
    response: int = 32  # PPO new tokens per response
    epochs: int = 4  # PPO epochs per iteration
    minibatches: int = 1  # PPO minibatches per epoch
    trainable_layers: int | None = None
    lora_rank: int = 0  # PPO: a LoRA policy of this rank, its reference the same weights with adapters off
    lr: float = 1e-6
    seed: int = 0
    # PPO scaling (ours only): ``[[batch, response], ...]``; one warm-up iteration at the first size,
    # then ``steps`` timed iterations at each size, all in this one process
    sizes: list[list[int]] | None = None
    compile: bool = False  # ours only: torch.compile every decoder block (dynamic shapes) before the first step

    def schedule(self) -> list[tuple[int, int]]:
        """``(batch, response)`` of each PPO iteration; the first is the warm-up."""
        if not self.sizes:
            return [(self.batch, self.response)] * self.steps
        first = (self.sizes[0][0], self.sizes[0][1])
        return [first] + [(b, r) for b, r in self.sizes for _ in range(self.steps)]

    @classmethod
    def from_json(cls, text: str) -> Spec:
        """Parse the command-line argument of a worker."""
        return cls(**json.loads(text))

    def to_json(self) -> str:
        """The command-line argument of a worker."""
        return json.dumps(asdict(self))


def setup_torch(seed: int) -> None:
    """Use every core (as the product's stages do) and seed torch."""
    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    torch.manual_seed(seed)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (Linux ``ru_maxrss`` is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body of a causal LM or sequence-classification model (``model.model`` for Llama)."""
    return getattr(model, model.base_model_prefix)


def matmul_params(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Weights that take part in matmuls: every ``nn.Linear`` weight (a tied LM head counts; embeddings do not)."""
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and (m.weight.requires_grad or not trainable_only)
    )


def param_counts(model: torch.nn.Module) -> dict[str, int]:
    """``all``, ``trainable`` (unique tensors) and ``matmul`` / ``matmul_trainable`` (see :func:`matmul_params`)."""
    return {
        "all": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "matmul": matmul_params(model),
        "matmul_trainable": matmul_params(model, trainable_only=True),
    }


class StepClock:
    """Seconds between consecutive :meth:`tick` calls, from :meth:`start`; token counts snapshot at each tick."""

    def __init__(self, counter: TokenCounter | None = None) -> None:
        self.counter = counter
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.padded: list[int] = []
        self._last = time.perf_counter()

    def start(self) -> None:
        """Start the first step now (and forget tokens counted so far)."""
        self._last = time.perf_counter()
        if self.counter is not None:
            self.counter.reset()

    def tick(self) -> None:
        """End a step (after the queued GPU work, if any)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self._last = now
        if self.counter is not None:
            self.tokens.append(self.counter.real)
            self.padded.append(self.counter.padded)
            self.counter.reset()


class TokenCounter:
    """Counts the real and padded tokens of every forward of a backbone (a forward pre-hook).

    A packed batch (:mod:`rlhf.models.shared_prompt`: a 4D block mask) counts the tokens of the sequences it holds, as
    a plain batch of them would (a shared prompt once per sequence), so tokens/s compares the same data: a
    real position attends to its row's first token (a pad does not), and each sequence ends where the position
    ids stop counting up, its length the last position id + 1. ``computed`` counts the positions computed.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.real = self.padded = self.computed = 0
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if ids is None:
            return
        self.padded += ids.numel()
        if mask is not None and mask.dim() == 4:
            real, positions = mask[:, 0, :, 0], kwargs["position_ids"]
            follows = torch.zeros_like(real)
            follows[:, :-1] = real[:, 1:] & (positions[:, 1:] == positions[:, :-1] + 1)
            self.computed += int(real.sum())
            self.real += int((positions + 1)[real & ~follows].sum())
            return
        self.real += int(mask.sum()) if mask is not None else ids.numel()
        self.computed += int(mask.sum()) if mask is not None else ids.numel()

    def reset(self) -> None:
        """Zero the counts."""
        self.real = self.padded = self.computed = 0


@dataclass
class GenerationLog:
    """What :func:`force_full_length` saw: seconds and new tokens per response of each ``generate`` call."""

    seconds: list[float] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)  # per response (all rows of a call sample as long)
    responses: list[int] = field(default_factory=list)  # rows per call
    prompt_tokens: list[int] = field(default_factory=list)  # real prompt tokens per call (attention mask)


def force_full_length(model: torch.nn.Module, log: GenerationLog) -> None:
    """Make every sampling of ``model`` sample exactly ``max_new_tokens`` tokens; record its time and length.

    TRL samples with ``model.generate``: the instance's method is wrapped, its generation config (or the model's)
    copied with ``min_new_tokens = max_new_tokens``, so transformers masks EOS until the last token. Ours samples
    with :func:`rlhf.models.sampling.decode`: the module's function is wrapped for this model, EOS's score set to
    -inf at every step and no token taken for an end. Both implementations get the same treatment, so both
    generate, score and train on responses of the same length.
    """
    original, original_decode = model.generate, sampling.decode

    def record(call: Callable[[], Any], prompt_width: int, mask: torch.Tensor | None, rows: int) -> Any:
        start = time.perf_counter()
        output = call()
        log.seconds.append(time.perf_counter() - start)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        log.new_tokens.append(int(sequences.shape[1] - prompt_width))
        log.responses.append(int(sequences.shape[0]))
        log.prompt_tokens.append(int(mask.sum()) if mask is not None else rows * prompt_width)
        return output

    def generate(*args: Any, **kwargs: Any) -> Any:
        config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
        if config.max_new_tokens:
            config.min_new_tokens = config.max_new_tokens
        kwargs["generation_config"] = config
        ids = kwargs.get("input_ids", args[0] if args else None)
        return record(lambda: original(*args, **kwargs), ids.shape[1], kwargs.get("attention_mask"), len(ids))

    def decode(decoded: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, sampler: Any,
               eos_token_id: int, pad_token_id: int, cache: str = "dynamic") -> torch.Tensor:  # fmt: skip
        if decoded is not model:
            return original_decode(
                decoded, input_ids, attention_mask, max_new_tokens, sampler, eos_token_id, pad_token_id, cache=cache
            )
        no_eos = _NoEos(sampler, eos_token_id)  # and an end id no token has: every row decodes every step

        def call() -> torch.Tensor:
            return original_decode(
                model, input_ids, attention_mask, max_new_tokens, no_eos, -1, pad_token_id, cache=cache
            )

        return record(call, 0, attention_mask, len(input_ids))

    model.generate = generate
    sampling.decode = decode


class _NoEos:
    """A sampler (:class:`rlhf.models.sampling.PerPromptSampling`, or None: greedy) that never picks EOS."""

    def __init__(self, sampler: Any, eos_token_id: int):
        self.sampler, self.eos_token_id = sampler, eos_token_id

    def perturb(self, scores: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """The sampler's perturbed scores (greedy: the logits) ``(R, V)`` float32, EOS's set to -inf."""
        perturbed = scores.float().clone() if self.sampler is None else self.sampler.perturb(scores, rows)
        perturbed[:, self.eos_token_id] = -math.inf
        return perturbed


def timed_summary(seconds: list[float], tokens: list[int] | None = None) -> dict[str, Any]:
    """Step statistics without the first (warm-up) step: median and mean seconds, tokens/s over the timed steps."""
    timed = seconds[1:] or seconds
    summary: dict[str, Any] = {
        "step_s_median": statistics.median(timed),
        "step_s_mean": sum(timed) / len(timed),
        "timed_steps": len(seconds[1:]),
        "warmup_s": seconds[0] if seconds else float("nan"),
    }
    if tokens:
        counted = tokens[1:] if len(seconds) > 1 else tokens
        summary["tokens_per_step"] = sum(counted) / len(counted)
        summary["tokens_per_s"] = sum(counted) / sum(timed)
    return summary


def supervised_result(task: str, applied: str, clock: StepClock, model: Any, **extra: Any) -> dict[str, Any]:
    """The result of an SFT or reward-model run, the same for both implementations (``extra``: their own keys)."""
    return {
        "task": task,
        "precision_applied": applied,
        **extra,
        "steps_s": clock.seconds,
        "tokens": clock.tokens,
        "padded_tokens": clock.padded,
        **timed_summary(clock.seconds, clock.tokens),
        "params": {"model": param_counts(model)},
    }


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Send whatever the libraries print to stderr, keeping stdout for the one result line."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def run_worker(impl: str, spec_json: str, tasks: dict[str, Callable[[Spec], dict[str, Any]]]) -> None:
    """Run ``tasks[spec.task](spec)`` and print its result, with the spec and peak memory, as one JSON line."""
    spec = Spec.from_json(spec_json)
    setup_torch(spec.seed)
    with quiet_stdout():
        result = tasks[spec.task](spec)
    result.update(impl=impl, spec=asdict(spec), peak_rss_mb=peak_rss_mb(), threads=torch.get_num_threads())
    if torch.cuda.is_available():
        result["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
