"""Reward-model quality benchmark (not a test): train on the real rm_train split with a CPU budget you choose.

Prints the held-out metrics.

Needs ``data/validated/`` and ``models/sft`` from a pipeline run. Overrides the
``reward`` params with ``--set key=value`` (e.g. ``--set steps=230 --set trainable_layers=12``),
trains from the SFT model, centres, evaluates on rm_eval and writes
``reports/reward_benchmark.json`` plus an MLflow run "reward-benchmark".

Usage:
    python -m bench.reward_quality --set steps=230 --set lr=2e-5
"""

from __future__ import annotations

import time

import typer

from bench.ablation import overrides
from rlhf.checkpoint import write_json
from rlhf.data import load_jsonl
from rlhf.models import load_scalar_model, load_tokenizer
from rlhf.reward import RewardConfig, center_rewards, encode_pairs, evaluate_reward_model, train_reward_model
from rlhf.training import config_from_params
from tasks.common import setup_torch, stage_runtime
from tasks.params import stage_params
from tasks.runs import StageRun

TRAIN, EVAL, SFT, OUT = (
    "data/validated/rm_train.jsonl",
    "data/validated/rm_eval.jsonl",
    "models/sft",
    "reports/reward_benchmark.json",
)


def main(set_: list[str] = typer.Option([], "--set", help="override of the reward params, key=value")) -> None:
    """Train, centre, evaluate; print and save the metrics."""
    params = {**stage_params("reward"), **overrides(set_)}
    config = config_from_params(RewardConfig, params, "reward")
    setup_torch(config.seed)
    train, held_out = load_jsonl(TRAIN), load_jsonl(EVAL)
    with StageRun("reward-benchmark", params) as stage:
        runtime = stage_runtime("reward-benchmark")
        tokenizer, model = load_tokenizer(SFT), runtime.place(load_scalar_model(SFT))
        start = time.perf_counter()
        summary = train_reward_model(model, tokenizer, train, config, stage.log, runtime)
        seconds = time.perf_counter() - start
        demonstrations = [
            c.input_ids for c, _ in encode_pairs(tokenizer, train[: config.center_max_examples], config.max_length)
        ]
        summary["rm/offset"] = center_rewards(model, tokenizer, demonstrations, config.eval_batch_size, runtime)
        metrics, _ = evaluate_reward_model(
            model, tokenizer, held_out, config.max_length, config.eval_batch_size, runtime
        )
        stage.log(metrics, config.steps)
    result = {
        **summary,
        **metrics,
        "train_pairs": len(train),
        "pairs_seen": config.steps * config.batch_size,
        "train_seconds": seconds,
        "params": params,
    }
    write_json(OUT, result)
    for key in (
        "rm/accuracy",
        "rm/margin",
        "rm/ece",
        "rm/length_corr",
        "rm/accuracy_chosen_shorter",
        "rm/pairs",
        "pairs_seen",
        "train_seconds",
    ):
        print(f"{key:28s} {result[key]:.4f}" if isinstance(result[key], float) else f"{key:28s} {result[key]}")


if __name__ == "__main__":
    typer.run(main)
