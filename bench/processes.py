"""Seconds per optimiser step on one process against several (data parallel), for SFT and the reward model.

``python -m bench.processes [--processes 2] [--steps 6] [--model models/base]`` runs the same global batch
(the demo's: SFT 4 examples, reward model 8 pairs, bf16, the demo's trainable blocks) on one process with
every core, then under ``accelerate launch --multi_gpu --num_processes N`` (gloo on a CPU-only machine;
NCCL, one GPU each, on a GPU host) with the cores shared out. It prints one line per trainer and setting:
the median seconds per step after one warm-up step, and the speed-up. A benchmark, not a test (README:
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


def worker(model: str, steps: int) -> None:
    """One process of a measurement: time ``steps`` optimiser steps of each trainer; rank 0 prints JSON."""
    import torch
    from accelerate import PartialState

    from rlhf.chat import encode_chat
    from rlhf.data import load_jsonl
    from rlhf.device import Runtime
    from rlhf.distributed import Ranks
    from rlhf.models import load_causal_lm, load_scalar_model, load_tokenizer
    from rlhf.reward import RewardConfig, encode_pairs, reward_step
    from rlhf.sft import sft_step
    from rlhf.training import batch_gradients, freeze_lower_layers, make_optimizer, minibatch_indices

    state = PartialState(cpu=not torch.cuda.is_available())
    torch.set_num_threads(max((os.cpu_count() or 1) // state.num_processes, 1))
    ranks = Ranks(state.process_index, state.num_processes)
    runtime = Runtime(device=state.device, mixed_precision="bf16", ranks=ranks)
    tokenizer, rows = load_tokenizer(model), load_jsonl(DATA)[:64]
    encoded = [encode_chat(tokenizer, row["prompt"], row["chosen"], 256) for row in rows]
    trainers = {
        "sft": (lambda: load_causal_lm(model), lambda m: sft_step(m, tokenizer, encoded, runtime), 4, 12),
        "reward": (
            lambda: load_scalar_model(model),
            lambda m: reward_step(m, tokenizer, encode_pairs(tokenizer, rows, 256), RewardConfig(), runtime),
            8,
            8,
        ),
    }
    seconds = {}
    for name, (build, make_step, batch_size, layers) in trainers.items():
        torch.manual_seed(0)
        model_ = runtime.place(build().eval())
        freeze_lower_layers(model_, layers)
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
    if runtime.ranks.main:
        print(json.dumps({"processes": state.num_processes, **seconds}), flush=True)


def measure(processes: int, model: str, steps: int) -> dict[str, float]:
    """Run :func:`worker` on ``processes`` processes; its JSON line."""
    args = [__file__, "worker", "--model", model, "--steps", str(steps)]
    if processes == 1:
        command = [sys.executable, *args]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
                   *args]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"bench.processes: {processes} processes failed: {result.stderr.strip()[-2000:]}")
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "worker"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="models/base")
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.model, args.steps)
        return
    one, many = measure(1, args.model, args.steps), measure(args.processes, args.model, args.steps)
    for name in ("sft", "reward"):
        print(f"{name}: {one[name]:.2f} s/step on 1 process, {many[name]:.2f} s/step on {args.processes} "
              f"(speed-up {one[name] / many[name]:.2f}x; the same global batch)")  # fmt: skip


if __name__ == "__main__":
    main()
