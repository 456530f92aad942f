"""Stage judge: an independent reward model for evaluation only, trained on its own split (judge_train).

The judge scores the policy against the SFT model in evaluate, beside the reward model PPO optimised
(the proxy): a win rate judged by the proxy rises exactly when the policy learns to fool it (reward
hacking, Gao et al. 2023). So no conversation of judge_train reaches any other split, and judge_eval's reach
no split that trains (``rlhf.data.splitting.assign_split``; judge_eval also holds the eval_prompts conversations' pairs,
whose prompts alone evaluation reads: ``rlhf.data.splitting.HELD_OUT_PAIRS``), the judge has its own seed and may
start from another backbone (``judge.source``), and nothing in training reads it: ppo does not depend on this stage.

Writes ``models/judge/``, ``metrics/judge.json`` (the ``judge/`` figures of
:func:`rlhf.reward.metrics.preference_metrics` on judge_eval) and ``reports/judge_margins.png`` together, after
everything that can fail: a failed or stopped run leaves the previous ones as they were.
"""

from __future__ import annotations

import tempfile
from typing import Any

from rlhf.data.chat import check_reads_whole
from rlhf.reward.trainer import JudgeConfig
from tasks.kit import paths
from tasks.kit.backbones import save_source
from tasks.kit.common import cli
from tasks.kit.configs import config_from_params, longest_response
from tasks.kit.outputs import StagedOutputs
from tasks.kit.params import stage_params
from tasks.kit.scalar import check_depth, write_outputs
from tasks.kit.scalar import run as train_scalar
from tasks.kit.scalar import summary_lines as scalar_summary
from tasks.kit.stage import training_stage

TRAIN, EVAL, BASE = paths.split("judge_train"), paths.split("judge_eval"), paths.BASE
OUT_DIR, FIGURE = paths.JUDGE, paths.JUDGE_MARGINS


def judge_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The reward trainer's ``rm/`` figures renamed ``judge/`` (the judge is measured on judge_eval, not rm_eval)."""
    return {("judge/" + key.removeprefix("rm/") if key.startswith("rm/") else key): v for key, v in metrics.items()}


def run(params: dict[str, Any], log, outputs: StagedOutputs | None, device: dict[str, Any] | None = None):
    """Train the judge as the reward stage trains the reward model, from ``judge.source`` (null: models/base).

    Returns:
        ``(metrics with judge/ names, margin histogram figure)``.

    Raises:
        FloatingPointError: training diverged or the judge's scores are not finite.
        FileNotFoundError: ``judge.source`` cannot be loaded.
    """
    source, knobs = params.get("source"), {k: v for k, v in params.items() if k != "source"}
    if source is None:
        metrics, figure = train_scalar(
            knobs, log, outputs, device, splits=(TRAIN, EVAL), init=BASE, out=OUT_DIR, stage="judge"
        )
        return judge_metrics(metrics), figure
    with tempfile.TemporaryDirectory(dir=".") as backbone:  # the other backbone as a safetensors folder
        save_source(source, backbone, key="judge.source")
        metrics, figure = train_scalar(
            knobs, log, outputs, device, splits=(TRAIN, EVAL), init=backbone, out=OUT_DIR, stage="judge"
        )
    return judge_metrics(metrics), figure


def summary_lines(metrics: dict[str, float]) -> list[str]:
    """The reward stage's summary (:func:`tasks.kit.scalar.summary_lines`) of the judge's ``judge/`` figures."""
    as_rm = {("rm/" + k.removeprefix("judge/") if k.startswith("judge/") else k): v for k, v in metrics.items()}
    lines = scalar_summary(as_rm)
    return [
        line.replace("[reward]", "[judge]")
        .replace("rm_eval", "judge_eval")
        .replace("the reward model", "the judge")
        .replace("rm/", "judge/")
        for line in lines
    ]


def main() -> None:
    """DVC stage command."""
    params, device = stage_params("judge"), stage_params("device")
    prompt_tokens, longest = stage_params("ppo")["max_prompt_length"], longest_response(stage_params)

    def check() -> None:  # the params, one line each, before any process starts
        config = config_from_params(JudgeConfig, {k: v for k, v in params.items() if k != "source"}, "judge")
        # ppo.max_prompt_length is evaluate's too (tasks/kit/configs.py DERIVED)
        check_reads_whole("judge.max_length", config.max_length, ("ppo.max_prompt_length", prompt_tokens), longest)
        if params.get("source") is None:  # another backbone's blocks are known once it is saved (run)
            check_depth("judge", config.num_hidden_layers, BASE)

    def finish(stage, outputs: StagedOutputs, trained) -> list[str]:
        metrics, figure = trained
        write_outputs(stage, outputs, metrics, "judge/steps", figure, FIGURE, "judge")
        return summary_lines(metrics)

    training_stage(
        "judge",
        {**params, "device": device},
        device,
        check,
        lambda log, outputs: run(params, log, outputs, device),
        finish,
    )


if __name__ == "__main__":
    cli(main)
