"""Reward-model and judge quality benchmark (not a test): choose their settings on the development split.

Needs ``data/validated/`` and ``models/sft`` (``models/base`` for the judge) from a pipeline run. Overrides the
model's params with ``--set key=value`` (e.g. ``--set length_decorrelation=0 --set length_expert=false``). By
default it holds out ``--dev-fraction`` of the training split (rm_train; judge_train with ``--model judge``) as the
development split (:func:`rlhf.data.splitting.dev_split`: a salted hash of the conversation root, so no conversation
is in
both parts), trains on the rest, centres, and measures on the development split, overall and per kind of data:
settings are chosen there, never on the test split (rm_eval, judge_eval), which the gates read and every reported
figure comes from. ``--test`` trains on all of the training split and measures on the test split instead, to
report a chosen setting once. Writes ``reports/<model>_benchmark.json`` plus an MLflow run.

Usage:
    python -m bench.reward_quality --set length_decorrelation=0
    python -m bench.reward_quality --model judge --set steps=120
    python -m bench.reward_quality --test --set seed=1
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import typer

from bench.ablation import overrides
from rlhf.data.kinds import kind_of, kinds_in, training_kinds
from rlhf.data.reading import load_jsonl
from rlhf.data.splitting import dev_split
from rlhf.files import write_json
from rlhf.models.loading import load_scalar_model, load_tokenizer
from rlhf.reward.metrics import evaluate_reward_model
from rlhf.reward.trainer import JudgeConfig, RewardConfig, center_rewards, encode_pairs, train_reward_model
from tasks.kit.backbones import save_source
from tasks.kit.common import setup_torch, stage_runtime
from tasks.kit.configs import config_from_params
from tasks.kit.params import stage_params
from tasks.kit.runs import StageRun

MODELS = {  # what each model trains from and on, and its test split (the pipeline's, read only with --test)
    "reward": (RewardConfig, "models/sft", "data/validated/rm_train.jsonl", "data/validated/rm_eval.jsonl"),
    "judge": (JudgeConfig, "models/base", "data/validated/judge_train.jsonl", "data/validated/judge_eval.jsonl"),
}
OUT = "reports/{model}_benchmark.json"


def training_params(model_name: str, set_: list[str]) -> tuple[dict[str, Any], str | None]:
    """The model's params as its stage reads them, with the ``--set`` overrides, and the backbone they name.

    Returns:
        ``(params for its config, source)``: ``source`` is ``judge.source`` (another backbone the judge starts
        from, which :mod:`tasks.judge` takes out of the params before building its config), None for the reward
        model or a judge from models/base.
    """
    params = {**stage_params(model_name), **overrides(set_)}
    return {k: v for k, v in params.items() if k != "source"}, params.get("source")


@contextlib.contextmanager
def backbone(init: str, source: str | None, model_name: str) -> Iterator[str]:
    """The folder the model trains from: ``init``, or ``source`` saved into a temporary folder (removed on the way
    out) as :mod:`tasks.judge` saves it; no folder is made when ``source`` is None."""
    if source is None:
        yield init
        return
    with tempfile.TemporaryDirectory(dir=".") as folder:
        save_source(source, folder, key=f"{model_name}.source")
        yield folder


def main(
    set_: list[str] = typer.Option([], "--set", help="override of the model's params, key=value"),
    model_name: str = typer.Option("reward", "--model", help="reward (from SFT, rm_train) or judge (from base)"),
    dev_fraction: float = typer.Option(0.2, help="share of the training split held out to measure on"),
    test: bool = typer.Option(False, "--test", "--rm-eval", help="train on all of it, measure on the test split"),
    train_kinds: list[str] = typer.Option([], "--train-kind", help="train only on these kinds (default: all)"),
) -> None:
    """Train, centre, evaluate; print and save the metrics."""
    config_class, init, train_path, test_path = MODELS[model_name]
    params, source = training_params(model_name, set_)
    config = config_from_params(config_class, params, model_name)
    setup_torch(config.seed)
    if test:
        train, held_out = load_jsonl(train_path), load_jsonl(test_path)
    else:
        train, held_out = dev_split(load_jsonl(train_path), dev_fraction)
        config = dataclasses.replace(config, steps=-(-config.steps * len(train) // (len(train) + len(held_out))))
    train = [row for row in train if not train_kinds or kind_of(row) in train_kinds]
    with StageRun(f"{model_name}-benchmark", params) as stage, backbone(init, source, model_name) as init:
        runtime = stage_runtime("reward-benchmark")
        kinds = training_kinds(train, config.kind_heads)
        tokenizer, model = load_tokenizer(init), runtime.place(load_scalar_model(init, kinds, config.num_hidden_layers))
        start = time.perf_counter()
        summary = train_reward_model(model, tokenizer, train, config, stage.log, runtime)
        seconds = time.perf_counter() - start
        demonstrations = [
            c.input_ids for c, _ in encode_pairs(tokenizer, train[: config.center_max_examples], config.max_length)
        ]
        demo_kinds = [kind_of(row) for row in train[: config.center_max_examples]]
        summary["rm/offset"] = center_rewards(
            model, tokenizer, demonstrations, config.eval_batch_size, runtime, demo_kinds
        )
        metrics, _ = evaluate_reward_model(
            model, tokenizer, held_out, config.max_length, config.eval_batch_size, runtime
        )
        stage.log(metrics, config.steps)
    result = {
        **summary,
        **metrics,
        "train_pairs": len(train),
        "held_out": test_path if test else f"{len(held_out)} pairs of {train_path} (dev, {dev_fraction})",
        "pairs_seen": config.steps * config.batch_size,
        "train_seconds": seconds,
        "params": params,
        "source": source,
    }
    write_json(OUT.format(model=model_name), result)
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
    for kind in kinds_in(result, "rm"):
        figures = {k.removeprefix(f"rm/kind/{kind}/"): v for k, v in result.items() if k.startswith(f"rm/kind/{kind}/")}
        print(
            f"{kind}: balanced {figures['balanced_accuracy']:.3f} [{figures['balanced_accuracy_low']:.3f}, "
            f"{figures['balanced_accuracy_high']:.3f}] over {figures['pairs']:.0f} pairs; accuracy "
            f"{figures['accuracy']:.3f}; shorter {figures['accuracy_chosen_shorter']:.3f} longer "
            f"{figures['accuracy_chosen_longer']:.3f}; empty beats chosen {figures.get('empty_beats_chosen', 'n/a')}, "
            f"one-word max {figures.get('short_reply_beats_chosen_max', 'n/a')}"
        )


if __name__ == "__main__":
    typer.run(main)
