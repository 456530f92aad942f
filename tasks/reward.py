"""Stage reward: train the reward model on rm_train (initialised from SFT), centre it, measure it on rm_eval.

Writes ``models/reward/``, ``metrics/reward.json`` and ``reports/reward_margins.png``
(the histogram of chosen - rejected scores, paper figure 2).
"""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rlhf.data import load_jsonl
from rlhf.models import load_scalar_model, load_tokenizer
from rlhf.reward import RewardConfig, center_rewards, encode_pairs, evaluate_reward_model, train_reward_model
from rlhf.stats import chance_warning
from rlhf.training import config_from_params
from tasks.common import (
    StageRun,
    atomic_dir,
    cli,
    run_checkpointer,
    setup_torch,
    stage_params,
    write_metrics,
)

TRAIN, EVAL, SFT = "data/validated/rm_train.jsonl", "data/validated/rm_eval.jsonl", "models/sft"
OUT_DIR, FIGURE = "models/reward", "reports/reward_margins.png"


def run(params: dict[str, Any], log) -> tuple[dict[str, float], Any]:
    """Train, centre, evaluate and save; returns ``(metrics, margin histogram figure)``."""
    config = config_from_params(RewardConfig, params, "reward")
    setup_torch(config.seed)  # before the model is built: the seed owns any new head's initialisation
    tokenizer, model = load_tokenizer(SFT), load_scalar_model(SFT)
    train = load_jsonl(TRAIN)
    checkpointer = run_checkpointer("reward", params, [TRAIN, SFT])
    metrics = train_reward_model(model, tokenizer, train, config, log, checkpointer)
    demonstrations = [
        chosen.input_ids
        for chosen, _ in encode_pairs(tokenizer, train[: config.center_max_examples], config.max_length)
    ]
    metrics["rm/offset"] = center_rewards(model, tokenizer, demonstrations, config.eval_batch_size)
    eval_metrics, margins = evaluate_reward_model(
        model, tokenizer, load_jsonl(EVAL), config.max_length, config.eval_batch_size
    )
    metrics.update(eval_metrics)
    with atomic_dir(OUT_DIR) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    checkpointer.clear()
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.hist(margins.numpy(), bins=30)
    axis.axvline(0, color="black", linewidth=1)
    axis.set(
        xlabel="score(chosen) - score(rejected)",
        ylabel="pairs",
        title=f"rm_eval: accuracy {metrics['rm/accuracy']:.3f}",
    )
    return metrics, figure


def summary_lines(metrics: dict[str, float]) -> list[str]:
    """The stage's printed summary of :func:`rlhf.reward.preference_metrics` on rm_eval.

    The first line is the accuracy with its Wilson 95% interval, decisive pairs
    and ties, then the length-bias accuracies, then the other ``rm/`` figures;
    last, when the interval includes chance (0.5), lies below it, or the accuracy is undefined,
    a loud ``[reward] WARNING: ...`` line (:func:`rlhf.stats.chance_warning`).
    """
    accuracy = (metrics["rm/accuracy"], metrics["rm/accuracy_low"], metrics["rm/accuracy_high"])
    lines = [
        f"[reward] rm_eval accuracy {accuracy[0]:.3f} [{accuracy[1]:.3f}, {accuracy[2]:.3f}] (Wilson 95%) over "
        f"{metrics['rm/pairs']:.0f} decisive pairs, {metrics['rm/ties']:.0f} ties left out; "
        f"chosen shorter {metrics['rm/accuracy_chosen_shorter']:.3f} (n={metrics['rm/pairs_chosen_shorter']:.0f}), "
        f"chosen longer {metrics['rm/accuracy_chosen_longer']:.3f} (n={metrics['rm/pairs_chosen_longer']:.0f})",
        "[reward] "
        + ", ".join(
            f"{k}={v:.3f}"
            for k, v in metrics.items()
            if k.startswith("rm/") and not k.startswith(("rm/loss", "rm/accuracy", "rm/pairs", "rm/ties"))
        ),
    ]
    warning = chance_warning("rm_eval accuracy", *accuracy)
    if warning:
        lines.append(f"[reward] WARNING: {warning}: the reward model has not learned to rank")
    return lines


def main() -> None:
    """DVC stage command."""
    import mlflow

    params = stage_params("reward")
    with StageRun("reward", params) as stage:
        metrics, figure = run(params, stage.log)
        stage.log(metrics, int(metrics["rm/steps"]))
        os.makedirs(os.path.dirname(FIGURE), exist_ok=True)
        figure.savefig(FIGURE, dpi=100)
        mlflow.log_figure(figure, "reward_margins.png")
    for line in summary_lines(metrics):
        print(line, flush=True)
    write_metrics("metrics/reward.json", {**metrics, "seconds": stage.seconds})


if __name__ == "__main__":
    cli(main)
