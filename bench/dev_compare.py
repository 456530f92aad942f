"""Two models compared on the development prompts as the evaluation compares policy and SFT (not a test).

The development prompts are the last ``N`` ppo prompts by id: PPO holds them out as its validation prompts (with
``validation_prompts`` N), they are never the evaluation's test prompts, and a choice made on them (what PPO starts
from, an estimator, a learning rate) leaves the test split to report it. Each model samples and is scored by the
proxy (``models/reward_champion``) and the judge (``models/judge``) with the ``generation`` section's settings;
the first's win rates over the second come with their 95% intervals, overall and per kind of prompt (the judge's
length-controlled rate too: :func:`rlhf.evaluation.by_kind.kind_figures`).

Usage:
    python -m bench.dev_compare --first models/base --second models/sft --dev-prompts 64
"""

from __future__ import annotations

import json
from typing import Any

import typer

from rlhf.data.kinds import kind_of
from rlhf.data.reading import load_jsonl
from rlhf.evaluation.by_kind import kind_figures, stratified
from rlhf.evaluation.evaluator import EvalConfig, Sampling, Scorers, evaluate_policy
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
from rlhf.training.checkpoint import load_kept_policy
from tasks.kit import paths
from tasks.kit.common import setup_torch, stage_runtime
from tasks.kit.configs import config_from_params, derived_values
from tasks.kit.params import stage_params

SHOWN = ("eval/judge/", "eval/proxy/", "eval/policy/", "eval/sft/", "eval/kind/")


def dev_prompts_of(count: int) -> list[dict[str, Any]]:
    """The last ``count`` ppo prompts by id (PPO's validation prompts when ``ppo.validation_prompts`` is ``count``)."""
    return sorted(load_jsonl(paths.split("ppo_prompts")), key=lambda row: row["id"])[-count:]


def compare_on_dev(
    first: str,
    second: str,
    dev: list[dict[str, Any]],
    generation: dict[str, Any],
    device: dict[str, Any],
    kept: bool = False,
) -> dict[str, float]:
    """``first`` against ``second`` on the prompts ``dev``: evaluate's figures with ``first`` as the policy and
    ``second`` as SFT (win rates of the first; KL of the first to the second), overall and per kind.

    Args:
        first, second: model folders; with ``kept`` the first is a kept policy (:func:`load_kept_policy`) of the
            model ``second``.
        dev: prompt rows (``prompt``, ``kind``).
        generation, device: the params.yaml sections.
    """
    evaluate = {**stage_params("evaluate"), "max_prompts": len(dev)}
    config = config_from_params(EvalConfig, evaluate, "evaluate", derived_values("evaluate", stage_params))
    settings = config_from_params(GenerationSettings, generation, "generation")
    setup_torch(config.seed)
    runtime = stage_runtime("evaluate", device)
    rows = stratified(dev, None)
    reference = runtime.place(load_causal_lm(second)).requires_grad_(False)
    model = runtime.place(load_kept_policy(second, first) if kept else load_causal_lm(first)).requires_grad_(False)
    scorers = Scorers(
        runtime.frozen(load_scalar_model(paths.CHAMPION)),
        runtime.frozen(load_scalar_model(paths.JUDGE)),
        load_tokenizer(paths.JUDGE),
    )
    kinds = [kind_of(row) for row in rows]
    sampling = Sampling(scorers, load_tokenizer(second), config, settings, runtime)
    prompts, heldout = [row["prompt"] for row in rows], load_jsonl(paths.split("ptx_heldout"))
    metrics, runs = evaluate_policy(reference, model, prompts, heldout, sampling, kinds=kinds)
    metrics |= kind_figures(runs, kinds, config.bootstrap_resamples, config.seed)
    return {k: v for k, v in metrics.items() if k.startswith(SHOWN)}


def main(
    first: str = typer.Option(..., help="the model whose win rates are given (the policy's place)"),
    second: str = typer.Option(paths.SFT, help="the model it is compared with (SFT's place)"),
    dev_prompts: int = typer.Option(64, help="the last N ppo prompts by id"),
) -> None:
    """Print the comparison as JSON."""
    figures = compare_on_dev(
        first, second, dev_prompts_of(dev_prompts), stage_params("generation"), stage_params("device")
    )
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    typer.run(main)
