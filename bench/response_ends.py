"""Response-end benchmark (not a test): how many of a model's sampled responses end with EOS within k tokens.

Issue 20 asks that at least 90% of PPO's rollouts and 95% of evaluation's responses end, and a response cut at
``generation.max_new_tokens`` scores the constant (the ``no_eos`` rule). This measures what a budget of k tokens
buys, and what an SFT setting does to it. Needs ``data/validated/`` and ``models/base`` (and ``models/sft``
unless ``--train``) from a pipeline run. With ``--train`` it first fine-tunes ``models/base`` as the sft stage
does, the sft params overridden by ``--set key=value``: SFT settings are chosen on PPO's prompts, never on
eval_prompts. It samples as a first PPO rollout does (``generation.temperature``, one generator per prompt,
prompts cut at ``ppo.max_prompt_length``) up to the largest ``--within`` and prints, for each k, the share that
ended within k tokens, then the mean length of the responses that ended. Writes
``reports/response_ends.json``.

Usage:
    python -m bench.response_ends                               # models/sft on ppo_prompts
    python -m bench.response_ends --train --set lr=5e-5         # an SFT setting, trained here
    python -m bench.response_ends --model models/policy --prompts data/validated/eval_prompts.jsonl
"""

from __future__ import annotations

import time

import torch
import typer

from bench.ablation import overrides
from rlhf.data.chat import encode_prompt
from rlhf.data.reading import load_jsonl
from rlhf.files import write_json
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.sampling import prompt_seed, sample
from rlhf.training.sft import SFTConfig, train_sft
from tasks.kit import paths
from tasks.kit.common import setup_torch, stage_runtime
from tasks.kit.configs import config_from_params
from tasks.kit.params import stage_params

OUT = "reports/response_ends.json"


def ended_within(lengths: torch.Tensor, ended: torch.Tensor, budgets: list[int]) -> dict[int, float]:
    """The share of responses that ended with EOS within each budget.

    Args:
        lengths: ``(N,)`` int, response tokens including the EOS.
        ended: ``(N,)`` bool, an EOS was generated.
        budgets: token budgets k.

    Returns:
        ``{k: share}``, each share in [0, 1].
    """
    return {k: (ended & (lengths <= k)).float().mean().item() for k in budgets}


def main(
    model: str = typer.Option(paths.SFT, help="the causal LM to sample from (ignored with --train)"),
    prompts: str = typer.Option(paths.split("ppo_prompts"), help="a validated split with a prompt per row"),
    max_prompts: int = typer.Option(64, help="the first N prompts by id"),
    within: list[int] = typer.Option([64, 128, 192, 256], help="token budgets k"),
    batch_size: int = typer.Option(16),
    train: bool = typer.Option(False, "--train", help="fine-tune models/base with the sft params first"),
    set_: list[str] = typer.Option([], "--set", help="override of the sft params, key=value (with --train)"),
) -> None:
    """Sample, count the responses that end, print and save the shares."""
    generation, ppo = stage_params("generation"), stage_params("ppo")
    sft_params = {**stage_params("sft"), **overrides(set_)}
    examples = load_jsonl(paths.split("sft")) if train else []
    if train and not examples:
        raise SystemExit(
            f"{paths.split('sft')} is empty: without SFT (sft.steps 0) the data gives it no share; set "
            "data.fractions.sft (the gpu profile's: 0.07) and run the pipeline again"
        )
    setup_torch(ppo["seed"])
    runtime = stage_runtime("response-ends")
    source = paths.BASE if train else model
    tokenizer, policy = load_tokenizer(source), runtime.place(load_causal_lm(source))
    summary: dict[str, float] = {}
    if train:
        config = config_from_params(SFTConfig, sft_params, "sft")
        setup_torch(config.seed)
        start = time.perf_counter()
        summary = train_sft(policy, tokenizer, examples, config, lambda m, s: None, runtime)
        summary["train_seconds"] = time.perf_counter() - start
    policy.eval().requires_grad_(False)
    rows = sorted(load_jsonl(prompts), key=lambda row: row["id"])[:max_prompts]
    encoded = [encode_prompt(tokenizer, row["prompt"], ppo["max_prompt_length"]) for row in rows]
    lengths, ended, texts = [], [], []
    start = time.perf_counter()
    for first in range(0, len(encoded), batch_size):
        batch = encoded[first : first + batch_size]
        seeds = [prompt_seed(ppo["seed"], 0, first + i) for i in range(len(batch))]
        with runtime.autocast():
            rollout = sample(policy, tokenizer, batch, max(within), generation["temperature"], seeds=seeds)
        mask = rollout.response_mask
        lengths.append(mask.sum(-1).cpu())
        ended.append(rollout.ended.cpu())
        ids = rollout.input_ids[:, rollout.response_start :]
        texts += [tokenizer.decode(ids[i][mask[i]], skip_special_tokens=True) for i in range(len(batch))]
    length, done = torch.cat(lengths), torch.cat(ended)
    shares = ended_within(length, done, sorted(within))
    result = {
        "model": "models/base + sft " + repr(overrides(set_)) if train else model,
        "prompts": f"{prompts} (first {len(rows)})",
        "ended_within": shares,
        "ended_mean_length": length[done].float().mean().item() if done.any() else float("nan"),
        "sample_seconds": time.perf_counter() - start,
        **summary,
        "samples": [{"prompt_id": row["id"], "response": text} for row, text in zip(rows, texts, strict=True)][:8],
    }
    write_json(OUT, result)
    print(f"{result['model']} on {result['prompts']}")
    for k, share in shares.items():
        print(f"ended within {k:4d} tokens  {share:.3f}")
    for key in ("ended_mean_length", "sft/loss_first", "sft/loss_last", "train_seconds", "sample_seconds"):
        if key in result:
            print(f"{key:26s} {result[key]:.3f}")


if __name__ == "__main__":
    typer.run(main)
