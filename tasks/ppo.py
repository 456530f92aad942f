"""Stage ppo: PPO / PPO-max from the SFT policy against the frozen reward model.

Reads ``data/validated/{ppo_prompts,ptx_text}.jsonl``, ``models/sft`` (policy
init and reference) and ``models/reward_champion`` (the reward model that holds the registry's
``champion`` alias, written by the gate stage; value-model init).
Writes ``models/policy/`` (the best policy by validation reward), ``models/policy_kept/`` (every
``ppo.keep_every``-th policy, for evaluate's over-optimisation curve), ``metrics/ppo.json``,
``metrics/ppo_curves.json`` and ``reports/ppo/`` (one curve per signal, reward histograms) together,
after everything that can fail (:class:`tasks.kit.outputs.StagedOutputs`): a failed or stopped run leaves
the previous ones as they were.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from rlhf.data.chat import check_reads_whole, encode_prompt
from rlhf.data.kinds import kind_of
from rlhf.data.ptx import ptx_token_ids
from rlhf.data.reading import load_jsonl
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer, save_tokenizer
from rlhf.models.lora import AdapterDisabledReference, add_lora, merged_copy
from rlhf.ppo.config import PPOConfig, check_processes
from rlhf.ppo.loop import train_ppo
from rlhf.ppo.types import PPOModels
from rlhf.report.plots import reward_histograms, signal_figures
from rlhf.runtime.sharding import whole_model
from tasks.kit import paths
from tasks.kit.champion import is_champion, require_champion
from tasks.kit.common import cli, setup_torch, stage_runtime
from tasks.kit.configs import config_from_params
from tasks.kit.console import progress_bars
from tasks.kit.launch import distributed_type
from tasks.kit.outputs import StagedOutputs, write_headline, write_metrics
from tasks.kit.params import stage_params
from tasks.kit.resume import run_checkpointer
from tasks.kit.stage import training_stage

PROMPTS, PTX, SFT, REWARD = paths.split("ppo_prompts"), paths.split("ptx_text"), paths.SFT, paths.CHAMPION
OUT_DIR, REPORTS, METRICS, CURVES = paths.POLICY, paths.PPO_REPORTS, paths.metrics("ppo"), paths.PPO_CURVES
KEPT_SUFFIX = (
    "_kept"  # models/policy_kept: every ppo.keep_every-th policy as what it adds to SFT (rlhf.training.checkpoint)
)


def run(
    params: dict[str, Any],
    generation: dict[str, Any],
    log,
    out_dir: str = OUT_DIR,
    checkpoint_name: str = "ppo",
    outputs: StagedOutputs | None = None,
    device: dict[str, Any] | None = None,
):
    """Train the policy and stage it as ``out_dir`` in ``outputs``; returns the trainer's result.

    ``device``: the params.yaml ``device`` section (None: read from params.yaml); the policy and value
    model are trained in float32, the reference and reward model stored as ``device.frozen_bf16`` says
    (with ``ppo.lora_rank`` the reference is the policy's own float32 base, adapters disabled).

    The policy is written when ``outputs`` commits (without ``outputs``, as soon as it is trained); in a
    training process other than rank 0 (``device.num_processes``) nothing is written.

    The last ``validation_prompts`` prompts (in id order) are held out to pick the best checkpoint.
    ``ppo.seed`` is set before any model is built, so it owns the value head of ``value_init: sft``.

    Raises:
        ValueError: a bad setting; fewer prompts than the validation set needs; no reward-model champion.
        FloatingPointError: training diverged (:func:`rlhf.ppo.loop.train_ppo`).
    """
    config = config_from_params(PPOConfig, params, "ppo")
    settings = config_from_params(GenerationSettings, generation, "generation")
    champion = require_champion(REWARD)  # no champion: stop here, naming the promote command
    if not is_champion(champion):
        print(
            f"[ppo] WARNING: training against reward-model candidate version {champion['version']}, which "
            f"{champion.get('why', 'is not the champion')} (registry.without_champion: candidate); the policy gate "
            "will fail this policy",
            flush=True,
        )
    setup_torch(config.seed)
    tokenizer = load_tokenizer(SFT)
    runtime = stage_runtime("ppo", device)
    value_init = REWARD if config.value_init == "reward" else SFT
    value_model = runtime.place(load_scalar_model(value_init)) if config.uses_critic else None  # rloo, grpo: none
    reward_model = load_scalar_model(REWARD)
    trained = getattr(reward_model.config, "reward_max_length", None)
    covers = (
        ("ppo.max_prompt_length", config.max_prompt_length),
        ("generation.max_new_tokens", settings.max_new_tokens),
    )
    check_reads_whole(f"{REWARD} (trained at max_length)", trained, *covers)
    models = PPOModels(*policy_and_reference(SFT, config, runtime), runtime.frozen(reward_model), value_model)
    rows = sorted(load_jsonl(PROMPTS), key=lambda row: row["id"])
    held_out = config.validation_prompts or 0  # set exactly when validate_every > 0 (PPOConfig)
    if len(rows) <= held_out:
        raise ValueError(f"{PROMPTS}: {len(rows)} prompts, but {held_out} are held out for validation")
    encoded = [encode_prompt(tokenizer, row["prompt"], config.max_prompt_length) for row in rows]
    train_prompts, validation = encoded[: len(encoded) - held_out], encoded[len(encoded) - held_out :]
    kinds = [kind_of(row) for row in rows]  # each prompt rewarded with its own kind's score
    train_kinds, validation_kinds = kinds[: len(kinds) - held_out], kinds[len(kinds) - held_out :]
    ptx = (
        [ptx_token_ids(tokenizer, row, config.ptx_max_length) for row in load_jsonl(PTX)] if config.ptx_coef > 0 else []
    )
    checkpointer = run_checkpointer(
        checkpoint_name, {"ppo": params, "generation": generation}, [PROMPTS, PTX, SFT, REWARD], runtime
    )
    result = train_ppo(
        models,
        tokenizer,
        train_prompts,
        validation,
        ptx_texts=ptx,
        config=config,
        settings=settings,
        log=log,
        checkpointer=checkpointer,
        runtime=runtime,
        progress=progress_bars(),
        prompt_kinds=train_kinds,
        validation_kinds=validation_kinds,
    )
    result.summary["ppo/reward_model_version"] = float(champion["version"])
    models.policy = whole_model(models.policy, runtime.ranks.main)  # FSDP: gathered on rank 0
    if not runtime.ranks.main:
        return result  # rank 0 writes the policy
    with contextlib.nullcontext(outputs) if outputs is not None else StagedOutputs() as staged:
        folder = staged.folder(out_dir)
        merged_copy(models.policy).save_pretrained(folder, safe_serialization=True)  # LoRA: adapters folded in
        save_tokenizer(tokenizer, folder)
        kept = staged.folder(out_dir + KEPT_SUFFIX)  # the policies of the over-optimisation curve (evaluate's)
        if result.kept:
            shutil.copytree(result.kept, kept, dirs_exist_ok=True)
        staged.on_commit(checkpointer.clear)  # a failure before the commit resumes from the checkpoints
    return result


def policy_and_reference(sft: str, config: PPOConfig, runtime) -> tuple[Any, Any]:
    """The policy (trained in float32 on ``runtime``'s device) and its reference, both the SFT model at the start.

    With ``ppo.lora_rank`` the policy is a LoRA model and the reference is that model with its adapters
    disabled (:mod:`rlhf.models.lora`): the SFT weights are loaded once. Otherwise the reference is a second,
    frozen copy (bf16 under ``device.frozen_bf16``).
    """
    policy = runtime.place(load_causal_lm(sft))
    if config.lora_rank:
        policy = add_lora(policy, config.lora_rank, config.lora_alpha)
        return policy, AdapterDisabledReference(policy)
    return policy, runtime.frozen(load_causal_lm(sft))


def save_figures(histories: dict, samples: dict, folder: str) -> list[str]:
    """Write the signal curves and reward histograms as PNGs into ``folder``; returns the paths."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib: only the figures need it)

    os.makedirs(folder, exist_ok=True)
    figures = {**signal_figures(histories), "reward_histograms": reward_histograms(samples)}
    written = []
    for stem, figure in figures.items():
        written.append(os.path.join(folder, f"{stem}.png"))
        figure.savefig(written[-1], dpi=90)
        plt.close(figure)
    return written


def main() -> None:
    """DVC stage command."""
    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    params, generation, device = stage_params("ppo"), stage_params("generation"), stage_params("device")

    def check() -> None:  # the params, one line each, before any process starts
        config = config_from_params(PPOConfig, params, "ppo")
        config_from_params(GenerationSettings, generation, "generation")
        check_processes(config, config.validation_prompts, device["num_processes"], distributed_type(device) == "FSDP")

    def finish(stage, outputs: StagedOutputs, result) -> list[str]:
        reports = outputs.folder(REPORTS)
        save_figures({"ppo": result.history}, {"ppo": result.reward_samples}, reports)
        mlflow.log_artifacts(reports, "ppo")
        if result.stopped_by:
            mlflow.set_tag("rlhf.collapse", result.stopped_by)
        mlflow.set_tag("rlhf.reward_model_version", f"{result.summary['ppo/reward_model_version']:.0f}")
        summary = {**result.summary, "stopped_by": result.stopped_by}
        write_metrics(outputs.file(METRICS), summary, stage, curves={outputs.file(CURVES): result.history})
        write_headline(outputs, "ppo", summary)
        return summary_lines(summary, result.best_iteration)

    training_stage(
        "ppo",
        {**params, "generation": generation, "device": device},
        device,
        check,
        lambda log, outputs: run(params, generation, log, outputs=outputs, device=device),
        finish,
    )


def summary_lines(summary: dict[str, Any], shipped: int) -> list[str]:
    """The stage's printed summary: rollouts and critic pre-training, then the shipped policy (``shipped``: its
    rollout step, 0 = SFT) and the last rollout."""
    nan = float("nan")
    slope = [summary.get(f"ppo/reward/slope{end}", nan) for end in ("", "_low", "_high")]
    return [
        f"[ppo] {int(summary['ppo/iterations'])} rollouts, {int(summary['ppo/policy_iterations'])} policy updates, "
        f"the rollouts' mean reward changed by {slope[0]:+.4f} [{slope[1]:+.4f}, {slope[2]:+.4f}] an iteration (95%); "
        f"critic pre-training: {summary.get('ppo/value/pretrain_iterations', 0):.0f} iterations, "
        f"explained variance {summary.get('ppo/value/pretrain_explained_variance', nan):.3f}",
        f"[ppo] shipped policy: iteration {shipped} (0 = SFT); on the validation prompts: reward "
        f"{summary.get('ppo/validation/reward', nan):.3f}, EOS rate {summary.get('ppo/validation/eos_rate', nan):.2f}, "
        f"KL {summary.get('ppo/validation/kl', nan):.3f}; "
        f"last rollout: reward {summary.get('ppo/last/reward/mean', nan):.3f}, "
        f"EOS rate {summary.get('ppo/last/eos_rate', nan):.2f}, KL {summary.get('ppo/last/kl', nan):.3f} "
        f"(ppo/last/kl, the headline's), "
        f"explained variance {summary.get('ppo/last/value/explained_variance', nan):.3f} "
        f"(of the outcome: {summary.get('ppo/last/value/explained_variance_outcome', nan):.3f})",
    ]


if __name__ == "__main__":
    cli(main)
