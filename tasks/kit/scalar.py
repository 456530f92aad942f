"""Train, centre and measure a scalar model (a reward model): what the reward and the judge stage share.

:func:`run` trains on a pairs file, centres the scores on its chosen responses and measures the model on held-out
pairs; :func:`summary_lines` is the printed summary of those figures; :func:`write_outputs` logs and stages them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from rlhf.data.kinds import kind_of, kinds_in, training_kinds
from rlhf.data.reading import load_jsonl
from rlhf.models.loading import block_count, load_scalar_model, load_tokenizer, save_tokenizer
from rlhf.reward.metrics import evaluate_reward_model
from rlhf.reward.trainer import JudgeConfig, RewardConfig, center_rewards, encode_pairs, train_reward_model
from rlhf.runtime.device import PhaseTimer
from rlhf.runtime.sharding import whole_model
from rlhf.stats import chance_warning
from tasks.kit import paths
from tasks.kit.common import setup_torch, stage_runtime
from tasks.kit.configs import config_from_params
from tasks.kit.console import progress_bars
from tasks.kit.outputs import StagedOutputs, is_part_figure, is_timing, write_headline, write_metrics
from tasks.kit.resume import run_checkpointer

CONFIGS = {"reward": RewardConfig, "judge": JudgeConfig}  # stage -> its typed config: same fields, own defaults


def check_depth(section: str, num_hidden_layers: int | None, init: str) -> None:
    """Refuse ``<section>.num_hidden_layers`` above the blocks of the model it starts from (``init``), before any
    run opens.

    Raises:
        ValueError: one line naming the key, the folder and its blocks.
    """
    blocks = block_count(init) if num_hidden_layers is not None else None
    if blocks is not None and num_hidden_layers > blocks:
        raise ValueError(
            f"params.yaml: {section}.num_hidden_layers {num_hidden_layers} is more than the {blocks} blocks of "
            f"{init}, which it starts from (null keeps them all)"
        )


def run(
    params: dict[str, Any],
    log,
    outputs: StagedOutputs | None,
    device: dict[str, Any] | None,
    splits: tuple[str, str],
    init: str,
    out: str,
    stage: str,
) -> tuple[dict[str, float], Any]:
    """Train, centre and evaluate; stage the model as ``out`` in ``outputs`` (written when they commit).

    ``device``: the params.yaml ``device`` section (None: read from params.yaml). ``splits``: the
    ``(train, eval)`` pair files; ``init``: the model folder the scalar model starts from; ``stage``: the name
    of its resume checkpoints and device settings (the judge stage trains its own model with these). In a
    training process other than rank 0 (``device.num_processes``) it only trains: ``outputs`` is None.

    Returns:
        ``(metrics, margin histogram figure)``; on rank 0 the metrics hold the seconds of each phase,
        ``rm/time/{train,center,evaluate}`` (training, centring on the train split's chosen responses, scoring the
        held-out pairs), which go to ``timings/<stage>.json`` and MLflow, not to the metrics file.

    Raises:
        FloatingPointError: training diverged, or the trained model's scores are not finite.
    """
    config = config_from_params(CONFIGS[stage], params, stage)
    setup_torch(config.seed)  # before the model is built: the seed owns any new head's initialisation
    train = load_jsonl(splits[0])
    tokenizer = load_tokenizer(init)
    model = load_scalar_model(init, training_kinds(train, config.kind_heads), config.num_hidden_layers)
    runtime = stage_runtime(stage, device)
    model = runtime.place(model)
    checkpointer = run_checkpointer(stage, params, [splits[0], init], runtime)
    timer = PhaseTimer(runtime)
    with timer("train"):
        metrics = train_reward_model(
            model,
            tokenizer,
            train,
            config,
            log=log,
            runtime=runtime,
            checkpointer=checkpointer,
            progress=progress_bars(),
        )
    model = whole_model(model, runtime.ranks.main)  # FSDP: gathered on rank 0
    if not runtime.ranks.main:
        return metrics, None  # rank 0 centres, measures and writes the model
    demonstrations = [
        chosen.input_ids
        for chosen, _ in encode_pairs(tokenizer, train[: config.center_max_examples], config.max_length)
    ]
    kinds = [kind_of(row) for row in train[: config.center_max_examples]]
    with timer("center"):
        metrics["rm/offset"] = center_rewards(model, tokenizer, demonstrations, config.eval_batch_size, runtime, kinds)
    with timer("evaluate"):
        eval_metrics, margins = evaluate_reward_model(
            model, tokenizer, load_jsonl(splits[1]), config.max_length, config.eval_batch_size, runtime
        )
    metrics.update({**eval_metrics, **timer.stats("rm/time")})
    bad = int((~torch.isfinite(margins)).sum())
    if bad or not math.isfinite(metrics["rm/offset"]):
        raise FloatingPointError(
            f"{stage}: the trained reward model gives non-finite scores (centring offset {metrics['rm/offset']}, "
            f"{bad} of {margins.numel()} {splits[1]} margins non-finite); nothing was written"
        )
    folder = outputs.folder(out)
    model.config.reward_max_length = config.max_length  # what it was trained at: readers check they fit in it
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    outputs.on_commit(checkpointer.clear)  # a failure before the commit resumes from the checkpoints
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.hist(margins.cpu().numpy(), bins=30)
    axis.axvline(0, color="black", linewidth=1)
    axis.set(
        xlabel="score(chosen) - score(rejected)",
        ylabel="pairs",
        title=f"{os.path.basename(splits[1]).split('.')[0]}: accuracy {metrics['rm/accuracy']:.3f}",
    )
    return metrics, figure


def summary_lines(metrics: dict[str, float]) -> list[str]:
    """The stage's printed summary of :func:`rlhf.reward.metrics.preference_metrics` on rm_eval.

    The first line is the accuracy with its Wilson 95% interval, decisive pairs
    and ties, then the length-bias accuracies; the second the balanced accuracy with its stratified interval and
    the length-only baseline; then the other ``rm/`` figures and, where timed, the seconds of each phase; last,
    when the balanced accuracy's interval includes chance (0.5), lies below it, or is undefined, a loud
    ``[reward] WARNING: ...`` line (:func:`rlhf.stats.chance_warning`); the same line for each kind of data
    whose figures are below or at chance, after one line of each kind's figures (:mod:`rlhf.data.kinds`).
    """
    accuracy = (metrics["rm/accuracy"], metrics["rm/accuracy_low"], metrics["rm/accuracy_high"])
    lines = [
        f"[reward] rm_eval accuracy {accuracy[0]:.3f} [{accuracy[1]:.3f}, {accuracy[2]:.3f}] (Wilson 95%) over "
        f"{metrics['rm/pairs']:.0f} decisive pairs, {metrics['rm/ties']:.0f} ties left out; "
        f"chosen shorter {metrics['rm/accuracy_chosen_shorter']:.3f} (n={metrics['rm/pairs_chosen_shorter']:.0f}), "
        f"chosen longer {metrics['rm/accuracy_chosen_longer']:.3f} (n={metrics['rm/pairs_chosen_longer']:.0f})",
        f"[reward] rm_eval balanced accuracy {_interval(metrics, 'rm/balanced_accuracy')} (stratified bootstrap 95%; "
        f"the mean of chosen shorter and chosen longer); prefer-the-shorter baseline "
        f"{_number(metrics.get('rm/length_baseline_accuracy'))}",
        "[reward] "
        + ", ".join(
            f"{k}={v:.3f}"
            for k, v in metrics.items()
            if k.startswith("rm/")
            and not is_part_figure(k)
            and not is_timing(k)
            and not k.startswith(("rm/loss", "rm/accuracy", "rm/pairs", "rm/ties", "rm/balanced", "rm/length_base"))
        ),
    ]
    if "rm/time/train" in metrics:
        lines.append(
            f"[reward] seconds: training {metrics['rm/time/train']:.0f}, centring {metrics['rm/time/center']:.0f}, "
            f"scoring rm_eval {metrics['rm/time/evaluate']:.0f}"
        )
    for kind in kinds_in(metrics, "rm"):
        figure = {k.removeprefix(f"rm/kind/{kind}/"): v for k, v in metrics.items() if k.startswith(f"rm/kind/{kind}/")}
        replies = ", ".join(
            f"{k.removeprefix('reply_beats_chosen/')} {_number(v)}"
            for k, v in figure.items()
            if k.startswith("reply_beats_chosen/")
        )
        lines.append(
            f"[reward] rm_eval {kind}: balanced accuracy {_interval(figure, 'balanced_accuracy')} over "
            f"{figure.get('pairs', 0):.0f} decisive pairs; accuracy {_number(figure.get('accuracy'))}, "
            f"prefer-the-shorter {_number(figure.get('length_baseline_accuracy'))}; beats the chosen response: "
            f"an empty answer {_number(figure.get('empty_beats_chosen'))}, {replies}"
        )
    for part in ["", *(f"/kind/{kind}" for kind in kinds_in(metrics, "rm"))]:
        balanced = tuple(metrics.get(f"rm{part}/balanced_accuracy{s}") for s in ("", "_low", "_high"))
        warning = chance_warning(f"rm_eval{part.replace('/kind/', ' ')} balanced accuracy", *balanced)
        if warning:
            lines.append(f"[reward] WARNING: {warning}: the reward model has not learned to rank")
    return lines


def _number(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"


def _interval(metrics: dict[str, float], key: str) -> str:
    """``0.612 [0.550, 0.671]``, or ``n/a`` parts where undefined."""
    return f"{_number(metrics.get(key))} [{_number(metrics.get(key + '_low'))}, {_number(metrics.get(key + '_high'))}]"


def write_outputs(
    stage, outputs: StagedOutputs, metrics: dict[str, float], steps: str, figure, figure_path: str, name: str
) -> None:
    """Log ``metrics`` at the step count ``metrics[steps]``, stage the margin histogram ``figure`` (also an MLflow
    figure) and the metrics files of stage ``name``: the headline figures in ``metrics/<name>.json``, those of each
    kind and source in ``metrics/<name>_kinds.json`` (:func:`tasks.kit.outputs.is_part_figure`); what the reward
    and the judge stage both write."""
    import mlflow  # noqa: PLC0415 rank 0 alone logs: the other processes of a launch never import MLflow (about 2 s)

    stage.log(metrics, int(metrics[steps]))
    figure.savefig(outputs.file(figure_path), dpi=100)
    mlflow.log_figure(figure, os.path.basename(figure_path))
    headline = {k: v for k, v in metrics.items() if not is_part_figure(k)}
    write_metrics(outputs.file(paths.metrics(name)), headline, stage)
    kinds = {k: v for k, v in metrics.items() if is_part_figure(k) or is_timing(k)}  # the timing file is rewritten
    write_metrics(outputs.file(paths.kind_metrics(name)), kinds, stage)
    write_headline(outputs, name, metrics)
