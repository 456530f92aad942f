"""The advantage estimators side by side (not a test): gae (PPO-max), rloo and grpo on the development prompts.

Needs a pipeline run's ``models/sft``, ``models/reward_champion``, ``models/judge`` and ``data/validated/``
(``make pipeline`` or ``dvc repro``). Each estimator trains from SFT for ``--iterations`` policy iterations of
the same ``rollout_batch_size`` responses (gae: one sample a prompt; rloo and grpo: ``--k`` samples of each of
``rollout_batch_size / k`` prompts: the same number of sampled tokens), once per ``--seed``. The development
prompts are the last ``--dev-prompts`` ppo prompts by id, which PPO holds out as its validation prompts: never
trained on, never the evaluation's test prompts. On them the last policy is compared with SFT as the evaluation
does (sampled, the proxy's and the judge's win rates with their 95% intervals), and PPO's own figures are read
from its run: the greedy validation reward of SFT and of the last policy, and the slope of the rollouts' mean
reward over the iterations with its 95% interval. Writes ``reports/estimators/summary.json`` and prints a table.

Usage:
    python -m bench.estimators --iterations 12 --seed 0 --seed 1 --set policy_lr=1e-5
"""

from __future__ import annotations

import os

import typer

from bench.ablation import overrides
from bench.dev_compare import compare_on_dev, dev_prompts_of
from rlhf.files import write_json
from rlhf.ppo.types import PPOResult
from tasks import ppo
from tasks.kit import paths
from tasks.kit.common import setup_torch
from tasks.kit.params import read_params, stage_params
from tasks.kit.runs import StageRun

OUT = "reports/estimators"
CRITIC_FREE = {"value_pretrain_iterations": 0, "value_clip": None}  # what rloo and grpo refuse to read


def train(name: str, ppo_params: dict, generation: dict, out_dir: str) -> tuple[PPOResult, dict[int, dict]]:
    """One PPO run as the ppo stage runs it (its own MLflow run); returns its result and every logged figure by step
    (step 0, the start's validation, is logged but not in the result's history)."""
    logged: dict[int, dict[str, float]] = {}
    with StageRun(f"estimators-{name}", ppo_params) as stage:

        def log(metrics: dict[str, float], step: int) -> None:
            logged.setdefault(step, {}).update(metrics)
            stage.log(metrics, step)

        result = ppo.run(ppo_params, generation, log, out_dir=out_dir, checkpoint_name=f"est-{name}")
    return result, logged


def last_kept(policy_dir: str) -> str:
    """The last policy a run kept beside ``policy_dir`` (``<policy_dir>_kept/iteration-NNNN``)."""
    kept = policy_dir + ppo.KEPT_SUFFIX
    return os.path.join(kept, sorted(os.listdir(kept))[-1])


def main(
    iterations: int = typer.Option(12, help="policy iterations per run"),
    seeds: list[int] = typer.Option([0], "--seed", help="ppo.seed of each run (repeat the option)"),
    k: int = typer.Option(4, help="samples a prompt for rloo and grpo"),
    dev_prompts: int = typer.Option(32, help="the last N ppo prompts by id: held out, measured on"),
    estimators: list[str] = typer.Option(["gae", "rloo", "grpo"], "--estimator", help="which to run"),
    set_: list[str] = typer.Option([], "--set", help="override of the ppo section for every run, key=value"),
) -> None:
    """Train each estimator on each seed and compare them on the development prompts."""
    params = read_params()
    generation, device = stage_params("generation", params), stage_params("device", params)
    dev = dev_prompts_of(dev_prompts)
    os.environ["RLHF_PIPELINE_RUN_ID"] = os.environ.get("RLHF_PIPELINE_RUN_ID") or "estimators"
    results = {}
    for estimator in estimators:
        for seed in seeds:
            name = f"{estimator}-seed{seed}"
            own = {"advantage_estimator": estimator, "samples_per_prompt": 1 if estimator == "gae" else k}
            ppo_params = {
                **stage_params("ppo", params),
                "iterations": iterations,
                "seed": seed,
                "on_collapse": "warn",
                "validate_every": iterations,  # SFT first and the last policy, on the development prompts
                "validation_prompts": dev_prompts,
                "keep_every": iterations,
                **overrides(set_),
                **own,
                **({} if estimator == "gae" else CRITIC_FREE),
            }
            setup_torch(seed)
            out_dir = os.path.join("bench", "out", "estimators", name)
            result, logged = train(name, ppo_params, generation, out_dir)
            validation = {
                s: row["ppo/validation/reward"] for s, row in logged.items() if "ppo/validation/reward" in row
            }
            results[name] = {
                "reward_slope": [result.summary[f"ppo/reward/slope{end}"] for end in ("", "_low", "_high")],
                "validation_reward": {"sft": validation.get(0), "last": validation[max(validation)]},
                "last_kl": result.history[max(result.history)]["ppo/kl"],
                "seconds": sum(
                    v for row in result.history.values() for key, v in row.items() if key.startswith("ppo/time/")
                ),
                **compare_on_dev(last_kept(out_dir), paths.SFT, dev, generation, device, kept=True),
            }
            write_json(
                os.path.join(OUT, "summary.json"), {"iterations": iterations, "k": k, "set": set_, "runs": results}
            )
            row = results[name]
            (rise, low, high), seen = row["reward_slope"], row["validation_reward"]
            judge = [row[f"eval/judge/win_rate{end}"] for end in ("", "_low", "_high")]
            print(
                f"{name}: reward slope {rise:+.4f} [{low:+.4f}, {high:+.4f}]/iteration; validation reward SFT "
                f"{seen['sft']:.3f} -> {seen['last']:.3f}; judge win rate on dev {judge[0]:.3f} [{judge[1]:.3f}, "
                f"{judge[2]:.3f}], proxy {row['eval/proxy/win_rate']:.3f}; KL {row['eval/policy/kl']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    typer.run(main)
