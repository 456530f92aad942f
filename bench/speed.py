"""Speed benchmark: our SFT, reward-model and PPO trainers against TRL 1.12.0's, same model, data and machine.

One command runs everything in one process tree: it installs TRL 1.12.0 into ``bench/out/trl-1.12.0``
(never into the environment), saves SmolLM2-135M-Instruct into ``bench/out/speed/base``, picks the
shared HH-RLHF prompts, demonstrations and pairs (``bench/out/speed/inputs.json``), measures this
machine's matmul peak (fp32, bf16), then runs each measurement in its own worker process
(:mod:`bench.speed_ours`, :mod:`bench.speed_trl`), ours and TRL's in alternation (A B A B) for
``--repeats`` rounds. Per implementation it takes the median over rounds; each ratio is the median
of the round-by-round ratios. The first step of every run is a warm-up and is not timed.

Figures (each at both implementations' fp32, and each at its best precision; plus a row of our
``trainable_layers=8`` lever, never in a ratio with TRL):

- PPO iteration (rollout + scoring + update) against ``trl.experimental.ppo.PPOTrainer``, with
  SmolLM2-135M as policy, reference, reward and value model;
- reward-model training against ``trl.RewardTrainer``; SFT against ``trl.SFTTrainer``;
- our PPO iteration at batch sizes and response lengths (scaling), with its per-phase seconds;
- the memory bandwidth and our sampling's tokens/s against the weight-reading bound (:mod:`bench.sampling`,
  row ``sampling``).

Writes ``bench/out/speed/results.json`` (every run, raw) and ``bench/out/speed/table.md``
(the tables for docs/results.md) and prints the tables. Worker logs go to ``bench/out/speed/logs/``.

Usage:
    python -m bench.speed            # the full run, alone on the machine (~35 min on 2 cores; 2 rounds took 24)
    python -m bench.speed --quick    # one round, fewer steps and scaling points, no lever rows (~10 min, 2 cores)
    python -m bench.speed --report-only  # rebuild the tables from bench/out/speed/results.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

import typer

from bench.sampling import table as sampling_table
from bench.speed_report import build_report, print_report, write_markdown
from bench.speed_setup import OUT, ROOT, ensure_inputs, ensure_trl
from bench.speed_worker import Spec

FIGURES = ("ppo", "reward", "sft")
WORKERS = {"ours": "bench.speed_ours", "trl": "bench.speed_trl"}
WORKER_TIMEOUT_S = 1800


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers") from None


def plan(
    repeats: int,
    ppo_steps: int,
    train_steps: int,
    batch: int,
    response: int,
    epochs: int,
    minibatches: int,
    train_batch: int,
    lever_layers: int | None,
    lora_rank: int,
    scaling_batches: list[int],
    scaling_responses: list[int],
    scaling_steps: int,
    scaling_precision: str,
    bf16_rows: bool = True,
    fair_epochs: int = 2,
    fair_minibatches: int = 2,
) -> list[dict[str, Any]]:
    """The runs in order: each round alternates ours and TRL per figure and precision, then the fair rows
    (both with the lower blocks frozen, ``trainable_layers = lever_layers``; PPO at the demo's
    ``fair_epochs`` x ``fair_minibatches``), then the lever rows (``lever_layers`` None: neither; PPO also a
    LoRA policy of ``lora_rank``, 0: none); the scaling run (ours only, one process) comes once, after the
    rounds. ``bf16_rows`` False (bf16 slower than fp32 on this machine): no best rows, the fp32 ones are each at
    its fastest.

    Returns:
        ``[{"row": str, "round": int, "impl": "ours" | "trl", "spec": Spec}]``.
    """
    sizes = {"ppo": {"batch": batch, "response": response, "epochs": epochs, "minibatches": minibatches}}
    settings = [("fp32", "fp32"), ("best", "bf16")] if bf16_rows else [("fp32", "fp32")]
    runs = []
    for round_ in range(repeats):
        for figure in FIGURES:
            shape = sizes.get(figure, {"batch": train_batch})
            steps = ppo_steps if figure == "ppo" else train_steps
            for setting, precision in settings:
                for impl in ("ours", "trl"):
                    spec = Spec(task=figure, precision=precision, steps=steps, **shape)
                    runs.append({"row": f"{figure}/{setting}", "round": round_, "impl": impl, "spec": spec})
            fair = {**shape, "epochs": fair_epochs, "minibatches": fair_minibatches} if figure == "ppo" else shape
            for setting, precision in (
                [(f"fair_{name}", precision) for name, precision in settings] if lever_layers else ()
            ):
                for impl in ("ours", "trl"):
                    spec = Spec(task=figure, precision=precision, steps=steps, trainable_layers=lever_layers, **fair)
                    runs.append({"row": f"{figure}/{setting}", "round": round_, "impl": impl, "spec": spec})
            if lever_layers is not None:
                lever = Spec(task=figure, precision="fp32", steps=steps, trainable_layers=lever_layers, **shape)
                runs.append({"row": f"{figure}/lever", "round": round_, "impl": "ours", "spec": lever})
            if lever_layers is not None and figure == "ppo" and lora_rank:
                lora = Spec(task=figure, precision="fp32", steps=steps, lora_rank=lora_rank, **shape)
                runs.append({"row": f"{figure}/lora", "round": round_, "impl": "ours", "spec": lora})
    grid = [[b, response] for b in scaling_batches] + [[batch, r] for r in scaling_responses if r != response]
    if batch not in scaling_batches:
        grid.insert(0, [batch, response])
    scaling = Spec(
        task="ppo",
        precision=scaling_precision,
        steps=scaling_steps,
        batch=batch,
        response=response,
        epochs=epochs,
        minibatches=minibatches,
        sizes=grid,
    )
    runs.append({"row": "ppo/scaling", "round": 0, "impl": "ours", "spec": scaling})
    return runs


def run_worker(impl: str, spec: Spec, log_path: str) -> dict[str, Any]:
    """Run one worker process; returns its JSON result, or ``{"error": ...}`` with the tail of its log."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    command = [sys.executable, "-m", WORKERS[impl], spec.to_json()]
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, timeout=WORKER_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {WORKER_TIMEOUT_S} s", "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        with open(log_path, encoding="utf-8") as log:
            tail = log.read()[-1500:]
        return {"error": f"exit {done.returncode}: {tail}", "wall_s": wall}
    return {**json.loads(lines[-1]), "wall_s": wall}


def matmul_peak() -> dict[str, float]:
    """This machine's best fp32 and bf16 matmul GFLOP/s, measured in a worker process."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.speed_setup", "peak"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def sampling_rows(quick: bool) -> dict[str, Any]:
    """The bandwidth and sampling rows of :mod:`bench.sampling`, measured in a worker process of their own."""
    path = os.path.join(OUT, "sampling.json")
    options = ["--batches", "4", "--new-tokens", "32"] if quick else []
    command = [sys.executable, "-m", "bench.sampling", "--out", path, *options]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=WORKER_TIMEOUT_S)
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _describe(run: dict[str, Any]) -> str:
    spec: Spec = run["spec"]
    extra = f" sizes={spec.sizes}" if spec.sizes else f" batch={spec.batch}"
    extra += f" response={spec.response}" if spec.task == "ppo" and not spec.sizes else ""
    extra += f" trainable_layers={spec.trainable_layers}" if spec.trainable_layers is not None else ""
    extra += f" lora_rank={spec.lora_rank}" if spec.lora_rank else ""
    return f"{run['impl']:4s} {spec.task:6s} {spec.precision}{extra}"


def _brief(result: dict[str, Any]) -> str:
    if "error" in result:
        return "FAILED: " + result["error"].strip().splitlines()[-1][:200]
    figure = f"{result['step_s_median']:.2f} s/step"
    if "tokens_per_s" in result:
        figure += f", {result['tokens_per_s']:.0f} tokens/s"
    return f"{figure}, peak {result['peak_rss_mb'] / 1024:.2f} GiB, {result['precision_applied']}"


def main(
    quick: bool = typer.Option(False, help="one round, fewer steps and scaling points, no levers (~10 min on 2 cores)"),
    repeats: int = typer.Option(3, help="rounds of A B alternation (1 with --quick)"),
    ppo_steps: int = typer.Option(3, help="PPO iterations per run, the first a warm-up (2 with --quick)"),
    train_steps: int = typer.Option(6, help="SFT / reward steps per run, the first a warm-up (3 with --quick)"),
    batch: int = typer.Option(4, help="PPO prompts per iteration"),
    response: int = typer.Option(32, help="PPO new tokens per response (forced in both)"),
    epochs: int = typer.Option(4, help="PPO epochs per iteration (TRL's default)"),
    minibatches: int = typer.Option(1, help="PPO minibatches per epoch (TRL's default)"),
    train_batch: int = typer.Option(4, help="SFT examples / reward pairs per optimiser step"),
    lever_layers: int = typer.Option(8, help="trainable_layers of the fair rows (both) and of our lever rows"),
    lora_rank: int = typer.Option(
        16, help="rank of the LoRA policy of our PPO lever row (alpha = 2 x rank; 0: no row)"
    ),
    levers: bool = typer.Option(True, help="run the fair and lever rows (not with --quick)"),
    scaling_batches: str = typer.Option("4,8,16", help="PPO batch sizes of the scaling run (response fixed)"),
    scaling_responses: str = typer.Option("32,64,128", help="PPO response lengths of the scaling run (batch fixed)"),
    scaling_steps: int = typer.Option(2, help="timed iterations per scaling point (1 with --quick)"),
    scaling_precision: str = typer.Option("bf16", help="precision of the scaling run (fp32 or bf16)"),
    rows: str = typer.Option("", help="run only these rows, e.g. ppo/fp32,ppo/lora,sampling (default: every row)"),
    report_only: bool = typer.Option(False, help="only rebuild table.md and the tables from results.json"),
) -> None:
    """Run the speed benchmark and write bench/out/speed/results.json and table.md."""
    if report_only:
        with open(os.path.join(OUT, "results.json"), encoding="utf-8") as handle:
            results = json.load(handle)
        report = build_report(results)
        write_markdown(report, os.path.join(OUT, "table.md"))
        print_report(report)
        return
    if quick:
        repeats, ppo_steps, train_steps, scaling_steps = 1, 2, 3, 1
        scaling_batches, scaling_responses, levers = "4,8", "32,64", False
    started = time.time()
    os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
    print(f"TRL in {ensure_trl()}; inputs in {ensure_inputs()}", flush=True)
    peak = matmul_peak()
    print(f"matmul peak: fp32 {peak['fp32']:.0f} GFLOP/s, bf16 {peak['bf16']:.0f} GFLOP/s", flush=True)
    bf16_rows = peak["bf16"] > peak["fp32"]
    if not bf16_rows:  # e.g. an AVX2-only CPU, where torch emulates bf16 (rlhf.runtime.device.native_bf16)
        scaling_precision = "fp32"
        print("bf16 is slower than fp32 here: each is at its fastest in the fp32 rows, so no bf16 row runs", flush=True)
    runs = plan(
        repeats=repeats,
        ppo_steps=ppo_steps,
        train_steps=train_steps,
        batch=batch,
        response=response,
        epochs=epochs,
        minibatches=minibatches,
        train_batch=train_batch,
        lever_layers=lever_layers if levers else None,
        lora_rank=lora_rank,
        scaling_batches=_ints(scaling_batches),
        scaling_responses=_ints(scaling_responses),
        scaling_steps=scaling_steps,
        scaling_precision=scaling_precision,
        bf16_rows=bf16_rows,
    )
    if rows:
        runs = [run for run in runs if run["row"] in rows.split(",")]
    settings = {"quick": quick, "repeats": repeats, "ppo_steps": ppo_steps, "train_steps": train_steps}
    settings |= {"batch": batch, "response": response, "epochs": epochs, "minibatches": minibatches}
    settings |= {"train_batch": train_batch, "lever_layers": lever_layers if levers else None}
    settings |= {"lora_rank": lora_rank if levers else 0, "rows": rows or "all"}
    settings |= {"scaling_precision": scaling_precision}
    results: dict[str, Any] = {"settings": settings, "peak_gflops": peak, "runs": []}
    for number, run in enumerate(runs, 1):
        label = f"[{number}/{len(runs)}] {_describe(run)}"
        print(f"{label} ...", flush=True)
        log_path = os.path.join(OUT, "logs", f"{number:02d}-{run['row'].replace('/', '-')}-{run['impl']}.log")
        result = run_worker(run["impl"], run["spec"], log_path)
        print(f"{label}: {_brief(result)} (wall {result['wall_s']:.0f} s)", flush=True)
        results["runs"].append({**run, "spec": asdict(run["spec"]), "result": result})
        results["wall_s"] = time.time() - started
        with open(os.path.join(OUT, "results.json"), "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    report = build_report(results)
    results["report"] = report
    results["wall_s"] = time.time() - started
    with open(os.path.join(OUT, "results.json"), "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1)
    write_markdown(report, os.path.join(OUT, "table.md"))
    print_report(report)
    if not rows or "sampling" in rows.split(","):
        results["sampling"] = sampling_rows(quick)
        results["wall_s"] = time.time() - started
        with open(os.path.join(OUT, "results.json"), "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
        lines = [
            "",
            "## Sampling against the weight-reading bound (bench.sampling)",
            "",
            *sampling_table(results["sampling"]),
        ]
        with open(os.path.join(OUT, "table.md"), "a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    print(f"wall time {results['wall_s'] / 60:.1f} min; wrote {OUT}/results.json and {OUT}/table.md")


if __name__ == "__main__":
    typer.run(main)
