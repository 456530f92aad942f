"""Seconds per optimiser step and trained-state memory per process: one process, data parallel and FSDP.

``python -m bench.processes [--processes 2] [--steps 6] [--model models/base] [--trainable-layers 12]`` runs
the same global batch (the demo's: SFT 4 examples, reward model 8 pairs, the demo's ``mixed_precision: auto``:
bf16 where the device computes it natively, else fp32) on one process with every
core, then on N processes with the cores shared out, under ``infra/accelerate/ddp.yaml`` (every process holds
the whole model) and ``infra/accelerate/fsdp.yaml`` (the trained model sharded, :mod:`rlhf.runtime.sharding`): gloo
on a CPU-only machine, NCCL with one GPU each on a GPU host. It prints one line per trainer and launch: the
median seconds per step after one warm-up step, the speed-up, and the megabytes one process holds of the
model's weights (frozen blocks included), gradients and AdamW moments. A benchmark, not a test (docs/scaling.md:
running at scale has the figures measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DATA = "data/validated/rm_train.jsonl"


def worker(model: str, steps: int, layers: int | None) -> None:
    """One process of a measurement: time ``steps`` optimiser steps of each trainer; rank 0 prints JSON."""
    import torch
    from accelerate import PartialState
    from torch.distributed.tensor import DTensor

    from rlhf.data.chat import encode_chat
    from rlhf.data.reading import load_jsonl
    from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
    from rlhf.reward.trainer import RewardConfig, encode_pairs, reward_step
    from rlhf.runtime.device import Runtime, mixed_precision
    from rlhf.runtime.distributed import Ranks
    from rlhf.runtime.sharding import shard, sharding_from_environ
    from rlhf.training.sft import sft_step
    from rlhf.training.supervised import batch_gradients, freeze_lower_layers, make_optimizer, minibatch_indices

    state = PartialState(cpu=not torch.cuda.is_available())
    torch.set_num_threads(max((os.cpu_count() or 1) // state.num_processes, 1))
    ranks = Ranks(state.process_index, state.num_processes)
    precision = mixed_precision({"mixed_precision": "auto", "cpu": state.device.type == "cpu"})
    runtime = Runtime(device=state.device, mixed_precision=precision, ranks=ranks, sharding=sharding_from_environ())
    tokenizer, rows = load_tokenizer(model), load_jsonl(DATA)[:64]
    encoded = [encode_chat(tokenizer, row["prompt"], row["chosen"], 256) for row in rows]
    trainers = {
        "sft": (lambda: load_causal_lm(model), lambda m: sft_step(m, tokenizer, encoded, runtime), 4),
        "reward": (
            lambda: load_scalar_model(model),
            lambda m: reward_step(m, tokenizer, encode_pairs(tokenizer, rows, 256), RewardConfig(), runtime),
            8,
        ),
    }

    def megabytes(tensors) -> float:  # of this process: a sharded tensor's local shard
        return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None) / 1e6

    seconds = {}
    for name, (build, make_step, batch_size) in trainers.items():
        torch.manual_seed(0)
        model_ = runtime.place(build().eval())
        freeze_lower_layers(model_, layers)
        shard(model_, runtime.sharding)
        step_fn, optimizer, times = make_step(model_), make_optimizer(model_, 1e-5), []
        for step in range(steps + 1):
            batch = minibatch_indices(step, len(rows), batch_size, 0)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            batch_gradients(model_, step_fn, batch, None, name, runtime)
            optimizer.step()
            runtime.synchronize()
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times[1:])
        grads = [p.grad for p in model_.parameters()]
        moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        seconds[f"{name}_mb"] = megabytes(model_.parameters()) + megabytes(grads) + megabytes(moments)
    if runtime.ranks.main:
        print(json.dumps({"processes": state.num_processes, **seconds}), flush=True)


def measure(processes: int, config: str | None, model: str, steps: int, layers: int | None) -> dict[str, float]:
    """Run :func:`worker` on ``processes`` processes with accelerate config ``config`` (infra/accelerate/); its
    JSON line."""
    from rlhf.runtime.device import mixed_precision  # noqa: PLC0415 (imports torch, which the launching process needs only here)

    args = [__file__, "worker", "--model", model, "--steps", str(steps), "--trainable-layers", str(layers)]
    if processes == 1:
        command = [sys.executable, *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"infra/accelerate/{config}",
                   "--num_processes", str(processes), "--mixed_precision", mixed_precision({"mixed_precision": "auto"}),
                   "--dynamo_backend", "no",
                   *args]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"bench.processes: {processes} processes ({config}) failed: {result.stderr.strip()[-2000:]}")
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "worker"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="models/base")
    parser.add_argument("--trainable-layers", type=lambda v: None if v == "None" else int(v), default=12)
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.model, args.steps, args.trainable_layers)
        return
    one = measure(1, None, args.model, args.steps, args.trainable_layers)
    for config in ("ddp.yaml", "fsdp.yaml"):
        many = measure(args.processes, config, args.model, args.steps, args.trainable_layers)
        for name in ("sft", "reward"):
            mb = f"{one[name + '_mb']:.0f} MB against {many[name + '_mb']:.0f} MB per process"
            print(f"{name}: {one[name]:.2f} s/step on 1 process, {many[name]:.2f} s/step on {args.processes} with "
                  f"{config} (speed-up {one[name] / many[name]:.2f}x; the same global batch); weights, gradients and "
                  f"AdamW moments {mb}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
