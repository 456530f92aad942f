"""Stage ppo: PPO / PPO-max from the SFT policy against the frozen reward model.

Reads ``data/validated/{ppo_prompts,ptx_text}.jsonl``, ``models/sft`` (policy
init and reference) and ``models/reward`` (reward model; value-model init).
Writes ``models/policy/`` (the best policy by validation reward),
``metrics/ppo.json`` and ``reports/ppo/`` (one curve per signal, reward histograms).
"""

from __future__ import annotations

import os
from typing import Any

from rlhf.data import load_jsonl
from rlhf.models import encode_prompt, load_causal_lm, load_scalar_model, load_tokenizer
from rlhf.plots import reward_histograms, signal_figures
from rlhf.ppo import PPOConfig, PPOResult, train_ppo
from rlhf.training import config_from_params
from tasks.common import (
    StageRun,
    atomic_dir,
    cli,
    read_params,
    run_checkpointer,
    setup_torch,
    stage_params,
    write_metrics,
)

PROMPTS, PTX, SFT, REWARD = (
    "data/validated/ppo_prompts.jsonl",
    "data/validated/ptx_text.jsonl",
    "models/sft",
    "models/reward",
)
OUT_DIR, REPORTS = "models/policy", "reports/ppo"


def run(params: dict[str, Any], log, out_dir: str = OUT_DIR, checkpoint_name: str = "ppo") -> PPOResult:
    """Train and save the policy; returns the trainer's result.

    The last ``validation_prompts`` prompts (in id order) are held out to pick the best checkpoint.

    Raises:
        ValueError: ``value_init`` is neither ``reward`` nor ``sft``; fewer prompts than the validation set needs.
    """
    value_init = params.get("value_init", "reward")
    if value_init not in ("reward", "sft"):
        raise ValueError(f"params.yaml ppo.value_init must be reward or sft, got {value_init!r}")
    config = config_from_params(PPOConfig, {k: v for k, v in params.items() if k != "value_init"}, "ppo")
    tokenizer = load_tokenizer(SFT)
    policy, reference, reward_model = load_causal_lm(SFT), load_causal_lm(SFT), load_scalar_model(REWARD)
    value_model = load_scalar_model(REWARD if value_init == "reward" else SFT)
    value_model.config.reward_offset = 0.0  # the value head predicts returns; it has no centring offset
    rows = sorted(load_jsonl(PROMPTS), key=lambda row: row["id"])
    held_out = config.validation_prompts if config.validate_every else 0
    if len(rows) <= held_out:
        raise ValueError(f"{PROMPTS}: {len(rows)} prompts, but {held_out} are held out for validation")
    encoded = [encode_prompt(tokenizer, row["prompt"], config.max_prompt_length) for row in rows]
    train_prompts, validation = encoded[: len(encoded) - held_out], encoded[len(encoded) - held_out :]
    ptx = (
        [
            tokenizer(row["text"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"][: config.ptx_max_length]
            for row in load_jsonl(PTX)
        ]
        if config.ptx_coef > 0
        else []
    )
    checkpointer = run_checkpointer(checkpoint_name, params, [PROMPTS, PTX, SFT, REWARD])
    result = train_ppo(
        policy,
        reference,
        reward_model,
        value_model,
        tokenizer,
        train_prompts,
        validation,
        ptx,
        config,
        log,
        checkpointer,
    )
    with atomic_dir(out_dir) as tmp:
        policy.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    checkpointer.clear()
    return result


def save_figures(histories: dict, samples: dict, folder: str) -> list[str]:
    """Write the signal curves and reward histograms as PNGs into ``folder``; returns the paths."""
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    figures = {**signal_figures(histories), "reward_histograms": reward_histograms(samples)}
    paths = []
    for stem, figure in figures.items():
        paths.append(os.path.join(folder, f"{stem}.png"))
        figure.savefig(paths[-1], dpi=90)
        plt.close(figure)
    return paths


def main() -> None:
    """DVC stage command."""
    import mlflow

    params = stage_params("ppo")
    setup_torch(read_params().get("seed", 0))
    with StageRun("ppo", params) as stage:
        result = run(params, stage.log)
        with atomic_dir(REPORTS) as tmp:
            save_figures({"ppo": result.history}, {"ppo": result.reward_samples}, tmp)
        mlflow.log_artifacts(REPORTS, "ppo")
        if result.stopped_by:
            mlflow.set_tag("rlhf.collapse", result.stopped_by)
    summary = {**result.summary, "stopped_by": result.stopped_by, "seconds": stage.seconds}
    print(
        f"[ppo] {int(summary['ppo/iterations'])} iterations, best at {result.best_iteration}; "
        f"reward {summary.get('ppo/reward/mean', float('nan')):.3f}, KL {summary.get('ppo/kl', float('nan')):.3f}"
    )
    write_metrics("metrics/ppo.json", summary)


if __name__ == "__main__":
    cli(main)
