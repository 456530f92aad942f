"""Reward-model quality benchmark (not a test): choose the reward model's settings on a split of rm_train.

Needs ``data/validated/`` and ``models/sft`` from a pipeline run. Overrides the ``reward`` params with
``--set key=value`` (e.g. ``--set length_decorrelation=0 --set length_expert=false``). By default it holds out
``--dev-fraction`` of rm_train by conversation root (a salted hash, so no conversation is in both parts), trains
from the SFT model on the rest, centres, and measures on the held-out part: settings are chosen there, never on
rm_eval. ``--rm-eval`` trains on all of rm_train and measures on rm_eval instead (to report a chosen setting
once, e.g. over seeds). Writes ``reports/reward_benchmark.json`` plus an MLflow run "reward-benchmark".

Usage:
    python -m bench.reward_quality --set length_decorrelation=0
    python -m bench.reward_quality --rm-eval --set seed=1
"""

from __future__ import annotations

import dataclasses
import time

import typer

from bench.ablation import overrides
from rlhf.checkpoint import write_json
from rlhf.data import conversation_root, load_jsonl, unit_point
from rlhf.models import load_scalar_model, load_tokenizer
from rlhf.reward import RewardConfig, center_rewards, encode_pairs, evaluate_reward_model, train_reward_model
from tasks.kit.common import setup_torch, stage_runtime
from tasks.kit.configs import config_from_params
from tasks.kit.params import stage_params
from tasks.kit.runs import StageRun

TRAIN, EVAL, SFT, OUT = (
    "data/validated/rm_train.jsonl",
    "data/validated/rm_eval.jsonl",
    "models/sft",
    "reports/reward_benchmark.json",
)


def dev_split(rows: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """``(train, dev)``: ``fraction`` of ``rows`` by a salted hash of the conversation root, whole conversations."""
    dev = [unit_point(conversation_root(row["prompt"]), salt="reward-dev") < fraction for row in rows]
    return [r for r, d in zip(rows, dev, strict=True) if not d], [r for r, d in zip(rows, dev, strict=True) if d]


def main(
    set_: list[str] = typer.Option([], "--set", help="override of the reward params, key=value"),
    dev_fraction: float = typer.Option(0.2, help="share of rm_train held out to measure on"),
    rm_eval: bool = typer.Option(False, "--rm-eval", help="train on all of rm_train, measure on rm_eval"),
) -> None:
    """Train, centre, evaluate; print and save the metrics."""
    params = {**stage_params("reward"), **overrides(set_)}
    config = config_from_params(RewardConfig, params, "reward")
    setup_torch(config.seed)
    if rm_eval:
        train, held_out = load_jsonl(TRAIN), load_jsonl(EVAL)
    else:
        train, held_out = dev_split(load_jsonl(TRAIN), dev_fraction)
        config = dataclasses.replace(config, steps=-(-config.steps * len(train) // (len(train) + len(held_out))))
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
        "held_out": "rm_eval" if rm_eval else f"{len(held_out)} pairs of rm_train (dev, {dev_fraction})",
        "pairs_seen": config.steps * config.batch_size,
        "train_seconds": seconds,
        "params": params,
    }
    write_json(OUT, result)
    for key in (
        "rm/accuracy",
        "rm/balanced_accuracy",
        "rm/balanced_accuracy_low",
        "rm/balanced_accuracy_high",
        "rm/accuracy_chosen_longer",
        "rm/length_baseline_accuracy",
        "rm/empty_beats_chosen",
        "rm/short_reply_beats_chosen",
        "rm/length_expert_weight",
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
