"""GPU check: the core's trainers, decoding and the matmul peak on this machine's GPU, in a few minutes, offline.

Runs each step of :mod:`bench.gpu_steps` in its own process with its own timeout, inside a total budget; a step
that fails or runs out of time is recorded and the next one runs. Without CUDA it runs the same steps at tiny
sizes on the CPU (the test suite does, so the check cannot rot). Writes ``<out>/<step>.json`` per step and
``<out>/table.md``, and prints the table. Exits 1 when a step failed.

Prepare the folder to carry on a machine with the package registries (``make gpu-check-folder``), then on the GPU
machine, from that folder (docs/gpu.md)::

    python3 -m pip install -q --no-index --no-deps --target site wheels/*.whl   # the image's torch is kept
    PYTHONPATH=site:. python3 -m bench.gpu_check --assets assets --out results

Here, on the CPU: ``make gpu-check-folder`` then ``make gpu-check`` (its assets), ``--only smoke,decode`` for some.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import typer

from bench import gpu_speed, gpu_stages, gpu_steps

STEPS = {**gpu_steps.STEPS, **gpu_stages.STAGES, **gpu_speed.STEPS}
"""Every step, in the order the check runs them."""
STEP_TIMEOUT_S = {
    "env": 60,
    "smoke": 240,
    "decode": 120,
    "stage_sft": 90,
    "stage_reward": 90,
    "stage_ppo": 180,
    "speed": 300,
}
"""Each step's own limit, seconds (the total budget may cut it shorter)."""


def main(
    assets: str = typer.Option(..., help="folder with the tokenizer and config.json (weights optional)"),
    out: str = typer.Option("bench/out/gpu_check", help="where the results go"),
    budget_s: float = typer.Option(360.0, help="total seconds for every step together"),
    only: str = typer.Option("", help="these steps only, comma-separated (default: every step)"),
    step: str = typer.Option("", help="run only this step, in this process (what each step's process does)"),
) -> None:
    """Run the steps, write the results and the table."""
    os.makedirs(out, exist_ok=True)
    if step:  # a step's own process: its figures, or its error in one line, as stdout's last line
        try:
            with tempfile.TemporaryDirectory(prefix=f"gpu-check-{step}-") as work:
                print(json.dumps({"figures": STEPS[step](assets, work)}))
        except Exception as error:  # recorded, and the next step runs
            print(json.dumps({"error": " ".join(f"{type(error).__name__}: {error}".split())[:500]}))
            raise typer.Exit(1) from None
        return
    deadline, results = time.monotonic() + budget_s, {}
    names = [name.strip() for name in only.split(",") if name.strip()] or list(STEPS)
    unknown = sorted(set(names) - set(STEPS))
    if unknown:
        raise typer.BadParameter(f"no step {', '.join(unknown)}; the steps: {', '.join(STEPS)}", param_hint="--only")
    for name in names:
        results[name] = _run(name, assets, min(STEP_TIMEOUT_S[name], deadline - time.monotonic()))
        with open(os.path.join(out, f"{name}.json"), "w") as handle:
            json.dump(results[name], handle, indent=2)
    table = render(results)
    with open(os.path.join(out, "table.md"), "w") as handle:
        handle.write(table)
    print(table)
    if not all(result["ok"] for result in results.values()):
        raise typer.Exit(1)


def _run(name: str, assets: str, timeout_s: float) -> dict[str, Any]:
    """One step in its own process: ``{"ok", "seconds", "figures" | "error"}``."""
    if timeout_s <= 1:
        return {"ok": False, "seconds": 0.0, "error": "not run: the budget was spent"}
    command = [sys.executable, "-m", "bench.gpu_check", "--assets", assets, "--step", name]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": timeout_s, "error": f"stopped after {timeout_s:.0f} s (its timeout)"}
    seconds = time.monotonic() - started
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):  # died before answering (a crash, a kill)
        last = (done.stderr.strip().splitlines() or [""])[-1]
        answer = {"error": f"exit code {done.returncode}: {last}"}
    if "figures" in answer:
        return {"ok": True, "seconds": seconds, "figures": answer["figures"]}
    return {"ok": False, "seconds": seconds, "error": answer["error"]}


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render(results: dict[str, dict[str, Any]]) -> str:
    """One markdown table: a row per step and figure (a failed step: its error)."""
    rows = ["| step | figure | value |", "| --- | --- | --- |"]
    for name, result in results.items():
        if not result["ok"]:
            rows.append(f"| {name} | FAILED after {result['seconds']:.0f} s | {result['error'].replace('|', '/')} |")
            continue
        rows.append(f"| {name} | seconds | {result['seconds']:.1f} |")
        rows += [f"| {name} | {key} | {_value(value)} |" for key, value in result["figures"].items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    typer.run(main)
