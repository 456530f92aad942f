"""GPU check, the speed rows: our SFT, reward-model and PPO trainers against TRL 1.12.0's on this machine's device.

The workers of the speed benchmark (:mod:`bench.speed_ours`, :mod:`bench.speed_trl`, each its own process) run at
GPU sizes in bf16 (:data:`SIZES`), on the assets' model (:func:`bench.gpu_steps.model_folder`: a random model of
SmolLM2-135M's shape there) and the assets' ``inputs.json`` (the benchmark's HH-RLHF prompts, demonstrations and
pairs, tokenised here by :mod:`bench.gpu_prepare`). Both train every block: fair rows, equally frozen (nothing).
TRL is the one installed beside the check (the folder's wheels), and needs ``datasets``, whose compiled
requirements (pyarrow, pandas) a GPU image carries; without them the step fails in one line and the others run.

Per implementation and figure: seconds per step (median of the timed steps; the first is a warm-up), training
tokens/s (SFT, reward model), generation tokens/s and our per-phase seconds (PPO), peak GPU memory, and the
utilisation against the device's measured matmul peak (:func:`bench.speed_report.figures`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

from bench.gpu_steps import DEVICE_KIND, matmul_tflops, model_folder

SIZES = {  # per device kind: steps (the first a warm-up), PPO's prompts and new tokens, SFT's and the RM's batch
    "gpu": {"steps": 4, "ppo_batch": 64, "response": 128, "train_batch": 32, "precision": "bf16"},
    "cpu": {"steps": 2, "ppo_batch": 2, "response": 4, "train_batch": 2, "precision": "fp32"},
}


def speed(assets: str, work: str) -> dict[str, Any]:
    """Ours against TRL on SFT, the reward model and PPO (see the module's docstring)."""
    from bench.speed_setup import TRL_DIR

    trl = importlib.util.find_spec("trl")  # the folder's, installed beside the check; else the benchmark's own
    trl_dir = os.path.dirname(os.path.dirname(trl.origin)) if trl else TRL_DIR
    if not os.path.isfile(os.path.join(trl_dir, "trl", "__init__.py")):
        raise ModuleNotFoundError(f"no TRL beside the check nor in {TRL_DIR} (bench.speed_setup.ensure_trl)")
    speed_dir = os.path.join(work, "speed")
    os.makedirs(speed_dir)
    os.symlink(os.path.abspath(model_folder(assets, work)), os.path.join(speed_dir, "base"))
    shutil.copy(os.path.join(assets, "inputs.json"), speed_dir)
    os.environ["RLHF_SPEED_DIR"] = speed_dir  # read by bench.speed_setup in the workers
    os.environ["RLHF_TRL_DIR"] = trl_dir
    from bench.speed import run_worker
    from bench.speed_report import figures
    from bench.speed_worker import Spec

    size = SIZES[DEVICE_KIND]
    peak = {"bf16": matmul_tflops("bf16") * 1e3, "fp32": matmul_tflops("fp32") * 1e3}  # GFLOP/s
    rows: dict[str, Any] = {}
    for task in ("sft", "reward", "ppo"):
        shape = {"batch": size["ppo_batch"], "response": size["response"]} if task == "ppo" else {}
        shape = shape or {"batch": size["train_batch"]}
        spec = Spec(task=task, precision=size["precision"], steps=size["steps"], epochs=2, minibatches=2, **shape)
        for impl in ("ours", "trl"):
            result = run_worker(impl, spec, os.path.join(work, f"{task}-{impl}.log"))
            if "error" in result:
                rows[f"{task}/{impl}/error"] = " ".join(result["error"].split())[-300:]
                continue
            shown = figures(result, peak)
            rows[f"{task}/{impl}/step_s"] = shown["step_s"]
            rows[f"{task}/{impl}/utilisation"] = shown["utilisation"]
            if "peak_gpu_gb" in result:  # CUDA only
                rows[f"{task}/{impl}/peak_gpu_gb"] = result["peak_gpu_gb"]
            if task == "ppo":
                rows[f"{task}/{impl}/gen_tokens_per_s"] = shown["gen_tok_s"]
                for phase, seconds in (result["iterations"][-1].get("phases") or {}).items():
                    rows[f"{task}/{impl}/{phase}_s"] = seconds
            else:
                rows[f"{task}/{impl}/tokens_per_s"] = result["tokens_per_s"]
    failed = [key for key in rows if key.endswith("/error")]
    if failed:
        raise RuntimeError("; ".join(f"{key}: {rows[key]}" for key in failed))
    return rows


STEPS = {"speed": speed}
