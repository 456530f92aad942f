"""Ablation: `vanilla` vs `ppo_max` on the demo model and data, same iterations, curves side by side.

Needs ``models/sft``, ``models/reward`` and ``data/processed`` from a pipeline run
(``make pipeline`` or ``dvc repro``). Each preset gets the same shared overrides
(``--set key=value``, e.g. a larger learning rate and short responses, the way
the paper's ablations provoke collapse) plus its own (``--vanilla key=value``,
``--ppo-max key=value``, e.g. a zero KL coefficient for vanilla). Writes one
figure per signal and the reward histograms into ``reports/ablation/`` and the
MLflow run "ablation", and prints a table of the first and last figures.

Usage:
    python -m bench.ablation --iterations 40 --set policy_lr=2e-5 --generation max_new_tokens=16 --vanilla kl_coef=0
"""

from __future__ import annotations

import json
import os

import mlflow
import typer
import yaml

from rlhf.files import write_json
from tasks import ppo
from tasks.kit.outputs import atomic_dir
from tasks.kit.params import Yaml12Loader, read_params, stage_params
from tasks.kit.runs import StageRun

OUT = "reports/ablation"
HEADLINE = [
    "ppo/reward/mean",
    "ppo/kl",
    "ppo/perplexity",
    "ppo/response_length",
    "ppo/entropy",
    "ppo/reward/skew",
    "ppo/collapse",
]


def overrides(pairs: list[str]) -> dict:
    """Parse ``key=value`` pairs; values are read as params.yaml's YAML 1.2 (numbers such as 1e-05, null, true)."""
    parsed = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"{pair!r} is not key=value")
        parsed[key.strip()] = yaml.load(value, Loader=Yaml12Loader)  # a SafeLoader, reading numbers as params.yaml
    return parsed


def main(
    iterations: int = typer.Option(40, help="policy iterations per preset"),
    set_: list[str] = typer.Option([], "--set", help="override for both presets, key=value"),
    vanilla: list[str] = typer.Option([], help="override for vanilla only, key=value"),
    ppo_max: list[str] = typer.Option([], "--ppo-max", help="override for ppo_max only, key=value"),
    generation: list[str] = typer.Option([], "--generation", help="override of the generation section, key=value"),
) -> None:
    """Run both presets and write the comparison."""
    params = read_params()
    sampling = {**stage_params("generation", params), **overrides(generation)}
    histories, samples, summaries = {}, {}, {}
    os.environ["RLHF_PIPELINE_RUN_ID"] = os.environ.get("RLHF_PIPELINE_RUN_ID") or "ablation"
    for preset, own in (("vanilla", overrides(vanilla)), ("ppo_max", overrides(ppo_max))):
        section = {**params, "ppo": {**params["ppo"], "preset": preset}}
        ppo_params = {
            **stage_params("ppo", section),
            "iterations": iterations,
            "on_collapse": "warn",
            **overrides(set_),
            **own,
        }
        with StageRun(f"ablation-{preset}", ppo_params) as stage:
            result = ppo.run(
                ppo_params,
                sampling,
                stage.log,
                out_dir=os.path.join("bench", "out", "ablation", preset),
                checkpoint_name=f"ablation-{preset}",
            )
        histories[preset], samples[preset], summaries[preset] = result.history, result.reward_samples, result.summary
    with atomic_dir(OUT) as tmp:
        ppo.save_figures(histories, samples, tmp)
        table = {
            name: {"first": {k: h[min(h)].get(k) for k in HEADLINE}, "last": {k: h[max(h)].get(k) for k in HEADLINE}}
            for name, h in histories.items()
        }
        write_json(
            os.path.join(tmp, "summary.json"),
            {"iterations": iterations, "overrides": set_, "vanilla": vanilla, "ppo_max": ppo_max, "table": table},
        )
        with open(os.path.join(tmp, "history.json"), "w", encoding="utf-8") as handle:
            json.dump(histories, handle)
    with StageRun("ablation", {"iterations": iterations, "set": set_, "vanilla": vanilla, "ppo_max": ppo_max}):
        mlflow.log_artifacts(OUT, "ablation")
    for name, row in table.items():
        print(name)
        for key in HEADLINE:
            print(f"  {key:24s} first {row['first'][key]!s:>22}  last {row['last'][key]!s:>22}")


if __name__ == "__main__":
    typer.run(main)
