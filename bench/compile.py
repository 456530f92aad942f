"""torch.compile per stage on this machine, cold: compile time and steady-state step time against eager.

Each measurement is one worker process of :mod:`bench.speed_ours` (SmolLM2-135M, the shared HH-RLHF inputs of
:mod:`bench.speed`, whose lengths vary from batch to batch as the demo's do) with the demo's trained blocks
(``--trainable-layers``, 8: the reward model and PPO's; SFT trains 12 in the demo) and bf16, once eager and once
with every decoder block compiled (``torch.compile(dynamic=True)``), each with an empty inductor cache of its
own (``TORCHINDUCTOR_CACHE_DIR``), as after a fresh clone. Per stage it prints the first step (compilation
included), the median of the later steps, and the whole run; a stage wins with compile when its whole run,
compilation included, is shorter.

Usage (after ``python -m bench.speed`` has written, or with ``--setup`` writes, ``bench/out/speed``):
    python -m bench.compile [--steps 6] [--ppo-steps 3]
"""

from __future__ import annotations

import json
import os
import tempfile

import typer

from bench.speed import run_worker
from bench.speed_setup import OUT, ensure_inputs
from bench.speed_worker import Spec


def measure(spec: Spec, log_path: str) -> dict:
    """One worker run with an empty inductor cache of its own; its result (``steps_s``: every step)."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            return run_worker("ours", spec, log_path)
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def main(
    steps: int = typer.Option(6, help="SFT / reward-model steps per run (the first compiles)"),
    ppo_steps: int = typer.Option(3, help="PPO iterations per run (the first compiles)"),
    trainable_layers: int = typer.Option(8, help="the top blocks trained, as the demo's reward model and PPO"),
    precision: str = typer.Option("bf16", help="fp32 or bf16 (the demo's)"),
) -> None:
    """Measure eager against compiled per stage and write bench/out/compile.json."""
    ensure_inputs()
    shapes = {
        "sft": {"batch": 4},
        "reward": {"batch": 8},
        "ppo": {"batch": 8, "response": 128, "epochs": 2, "minibatches": 2},
    }
    os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
    results = []
    for task, shape in shapes.items():
        for compiled in (False, True):
            spec = Spec(task=task, precision=precision, steps=ppo_steps if task == "ppo" else steps,
                        trainable_layers=trainable_layers, compile=compiled, **shape)  # fmt: skip
            name = f"compile-{task}-{'on' if compiled else 'off'}"
            result = measure(spec, os.path.join(OUT, "logs", f"{name}.log"))
            results.append({"task": task, "compile": compiled, "result": result})
            if "error" in result:
                print(f"{name}: {result['error'][:300]}", flush=True)
                continue
            seconds = result["steps_s"]
            print(f"{task:7s} compile {'on ' if compiled else 'off'}: first step {seconds[0]:7.1f} s, later steps "
                  f"median {result['step_s_median']:6.2f} s, {len(seconds)} steps {sum(seconds):7.1f} s, "
                  f"process {result['wall_s']:6.1f} s", flush=True)  # fmt: skip
    with open(os.path.join(os.path.dirname(OUT), "compile.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    typer.run(main)
