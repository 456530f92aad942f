"""Stage 3: PPO with every PPO-max technique as an independent switch (paper section 5.4).

One iteration (:func:`_iteration`, five phases): collect a small experience buffer (:mod:`rlhf.ppo.rollout`),
let critic pre-training end when it may, check the buffer for a pattern collapse before anything trains on it
(:mod:`rlhf.ppo.guard`), then run a few PPO epochs over it (:mod:`rlhf.ppo.update`: tutorial Eq. 13, value loss
paper Eq. 16, PPO-ptx tutorial Eq. 14). Until the value model explains the returns of a fresh rollout (or
``value_pretrain_iterations`` have passed) only the value model trains (critic pre-training, paper section 5.3.3).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlhf import losses
from rlhf.models.generation import GenerationSettings
from rlhf.models.sampling import prompt_seed
from rlhf.ppo.config import PPOConfig, check_processes
from rlhf.ppo.guard import act_on_collapse, detect_collapse, pooled_baseline, window_signals
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.rollout import Experience, make_experience, validation_stats
from rlhf.ppo.types import Best, PPOModels, PPOResult, PPOState
from rlhf.ppo.update import Optimisers, make_optimisers, ppo_update, ptx_batches
from rlhf.runtime.device import Runtime
from rlhf.runtime.finite import NonFiniteError, ScalerStep, check_finite_rollout, check_finite_weights
from rlhf.runtime.sharding import load_optimizer_state, optimizer_state, shard
from rlhf.stats import linear_trend
from rlhf.training.checkpoint import Checkpointer, save_kept_policy
from rlhf.training.supervised import LogFn, freeze_lower_layers, minibatch_indices


@dataclass
class _Loop:
    """What every iteration of one :func:`train_ppo` call reads: models, data, settings, optimisers, where the best
    policy lives and where progress lines go."""

    models: PPOModels
    tokenizer: PreTrainedTokenizerBase
    prompts: list[list[int]]
    validation: list[list[int]]  # empty when validation is off
    ptx_texts: list[list[int]]
    config: PPOConfig
    settings: GenerationSettings
    runtime: Runtime
    opt: Optimisers
    moments: RewardMoments
    best_dir: str
    say: Callable[[str], None]
    prompt_kinds: list[str] | None = (
        None  # each prompt's kind of data (rlhf.models.kind_heads.read_scores); None: the gate
    )
    validation_kinds: list[str] | None = None


def _save(checkpointer: Checkpointer, step: int, loop: _Loop, state: PPOState) -> None:
    """Checkpoint everything a resumed run needs to continue exactly."""
    models, opt, moments, main = loop.models, loop.opt, loop.moments, checkpointer.ranks.main
    critic = models.value_model is not None
    checkpointer.save(
        step,
        {"policy": models.policy, **({"value": models.value_model} if critic else {})},
        {
            "policy_optimizer": optimizer_state(models.policy, opt.policy, main),
            "policy_schedule": opt.policy_schedule.state_dict(),
            **(
                {
                    "value_optimizer": optimizer_state(models.value_model, opt.value, main),
                    "value_schedule": opt.value_schedule.state_dict(),
                }
                if critic
                else {}
            ),
            "moments": moments.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],  # sampling on a GPU
            "trainer": state.to_checkpoint(),
        },
    )


def _restore(checkpointer: Checkpointer, path: str, loop: _Loop) -> PPOState:
    """Load what :func:`_save` wrote; returns the trainer state."""
    models, opt, moments = loop.models, loop.opt, loop.moments
    saved = checkpointer.load_state(path)
    checkpointer.load_model_weights(path, "policy", models.policy)
    load_optimizer_state(models.policy, opt.policy, saved["policy_optimizer"])
    opt.policy_schedule.load_state_dict(saved["policy_schedule"])
    if models.value_model is not None:
        checkpointer.load_model_weights(path, "value", models.value_model)
        load_optimizer_state(models.value_model, opt.value, saved["value_optimizer"])
        opt.value_schedule.load_state_dict(saved["value_schedule"])
    moments.load_state_dict(saved["moments"])
    torch.set_rng_state(saved["rng"])
    if saved.get("cuda_rng"):
        torch.cuda.set_rng_state_all(saved["cuda_rng"])
    state = PPOState.from_checkpoint(saved["trainer"])
    if state.value_calibration is not None:
        models.value_model.config.value_scale, models.value_model.config.value_bias = state.value_calibration
    opt.policy_guard.skipped, opt.value_guard.skipped = state.skipped_steps
    return state


def train_ppo(
    models: PPOModels,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    validation: list[list[int]],
    ptx_texts: list[list[int]],
    config: PPOConfig,
    settings: GenerationSettings,
    log: LogFn,
    checkpointer: Checkpointer,
    runtime: Runtime,
    progress: bool = True,
    scaler_step: ScalerStep | None = None,
    prompt_kinds: list[str] | None = None,
    validation_kinds: list[str] | None = None,
) -> PPOResult:
    """Train the policy and value model in place with PPO / PPO-max; leaves the policy to ship in ``models.policy``.

    Before the first update the starting (SFT) policy is kept as the first
    fallback (``<checkpoint root>/best``, iteration 0, with its validation
    figures). Each rollout is checked for a collapse before anything trains on
    it (:func:`rlhf.ppo.guard.detect_collapse`); the run then stops, rolls back to
    the best policy, or only warns (``on_collapse``). With validation on, the
    policy with the best greedy validation reward (the SFT policy included) is
    shipped; without it, the last one (the fallback after a stop).

    Resumable: every ``checkpoint_every`` iterations the policy, value model,
    optimisers, schedules, running reward statistics, the value calibration,
    KL coefficient, RNG state, counters and the best-so-far are checkpointed.

    Divergence stops the run with one line naming the iteration
    (:class:`rlhf.runtime.finite.NonFiniteError`, a ``FloatingPointError``): a rollout
    with a non-finite score, logprob, value, advantage or return; a non-finite
    loss or gradient norm of a policy or value step (the steps a mixed-precision
    loss scaler skips on purpose are counted, ``ppo/{policy,value}/skipped_steps``);
    a shipped policy with non-finite weights. The failing iteration's figures, its
    NaN or inf included, are logged first.

    Args:
        models: :class:`PPOModels`; policy and reference start as the SFT model, the value model
            as the reward model (``value_init: reward``, calibrated on the first rollout) or SFT.
        tokenizer: shared tokenizer.
        prompts: training prompt token lists; validation: held-out prompt token lists.
        ptx_texts: token lists of the PPO-ptx text.
        config: :class:`PPOConfig`; settings: :class:`GenerationSettings`.
        log: ``log(metrics, step)`` with step = rollout iteration (1-based; 0 holds the SFT validation).
        checkpointer: resume point and home of the best policy.
        runtime: device and precision (:class:`rlhf.runtime.device.Runtime`); the four models already on its device.
        scaler_step: a mixed-precision loss scaler's step (:class:`rlhf.runtime.finite.FiniteGuard`); None: no scaler.
        prompt_kinds, validation_kinds: each prompt's kind of data, its responses rewarded with that kind's score
            (:func:`rlhf.models.kind_heads.read_scores`); None: the reward model's kind gate.

    Returns:
        :class:`PPOResult`; its summary holds the shipped policy's validation figures and
        ``ppo/last/*`` for the last rollout.

    Raises:
        ValueError: no prompts. NonFiniteError: see above.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415 (tqdm: only a training loop needs it)

    if not prompts:
        raise ValueError("no PPO prompts")
    validation_prompts = len(validation) if config.validate_every else None
    check_processes(config, validation_prompts, runtime.ranks.world_size, runtime.sharding is not None)
    for model in (models.reference, models.reward_model, *models.trained()):
        model.eval()  # dropout off everywhere; gradients still flow into policy and value
    models.reference.requires_grad_(False)
    models.reward_model.requires_grad_(False)
    for model in models.trained():
        freeze_lower_layers(model, config.trainable_layers)
        shard(model, runtime.sharding)  # FSDP: before the optimisers (rlhf.runtime.sharding)
    validate = bool(config.validate_every and validation)
    shown = progress and runtime.ranks.main  # one bar and one set of lines, however many processes
    bar = tqdm(desc="ppo", total=config.iterations, disable=not shown)
    loop = _Loop(
        models=models,
        tokenizer=tokenizer,
        prompts=prompts,
        validation=validation if validate else [],
        ptx_texts=ptx_texts,
        config=config,
        settings=settings,
        runtime=runtime,
        opt=make_optimisers(models.policy, models.value_model, config, scaler_step),
        moments=RewardMoments(per_kind=config.reward_normalize == "per_kind", kinds=prompt_kinds),
        best_dir=os.path.join(checkpointer.root, "best"),
        say=bar.write if runtime.ranks.main else (lambda line: None),
        prompt_kinds=prompt_kinds,
        validation_kinds=validation_kinds if validate else None,
    )
    kept_dir = os.path.join(checkpointer.root, "kept")
    torch.manual_seed(config.seed)
    resume = checkpointer.latest()
    if resume:
        state = _restore(checkpointer, resume, loop)
    else:
        state = PPOState(kl_coef=config.kl_coef, pretraining=config.value_pretrain_iterations > 0)
        _keep_best(loop, state, 0)
        log(state.best.stats, 0)
    bar.update(state.policy_iterations)
    while state.policy_iterations < config.iterations and not state.stopped_by:
        try:
            stats = _iteration(loop, state)
        except NonFiniteError as err:
            log(err.metrics, state.iteration + 1)
            raise
        step = state.iteration
        done = state.policy_iterations
        if (
            validate
            and stats.get("ppo/updated_policy")
            and (done % config.validate_every == 0 or done == config.iterations)
        ):
            stats.update(_keep_best(loop, state, step))
        if stats.get("ppo/updated_policy") and _kept_now(done, config):
            # named by the rollout step, as the curves, the checkpoints and ppo/shipped_iteration count
            meta = {"iteration": step, "policy_iteration": done}
            meta |= {"lora_rank": config.lora_rank, "lora_alpha": config.lora_alpha}
            save_kept_policy(models.policy, os.path.join(kept_dir, f"iteration-{step:04d}"), meta, runtime.ranks)
        log(stats, step)
        state.history[step] = stats
        bar.update(int(stats.get("ppo/updated_policy", 0.0)))
        bar.set_postfix(reward=f"{stats['ppo/reward/mean']:.3f}", kl=f"{stats['ppo/kl']:.3f}")
        finished = state.policy_iterations >= config.iterations
        checkpoint_now = config.checkpoint_every and (step % config.checkpoint_every == 0 or state.stopped_by)
        if checkpoint_now and not finished:  # every rank: a sharded model is gathered, rank 0 writes
            _save(checkpointer, step, loop, state)
    bar.close()
    if validate or state.stopped_by:
        best = Checkpointer(loop.best_dir)
        best.load_model_weights(best.latest(), "policy", models.policy)
        shipped = state.best
    else:
        shipped = Best(iteration=state.iteration)
    check_finite_weights(models.policy, "ppo", f"in the policy to ship (iteration {shipped.iteration})")
    return PPOResult(
        summary=_summary(state, shipped),
        history=state.history,
        reward_samples=state.reward_samples,
        stopped_by=state.stopped_by,
        best_iteration=shipped.iteration,
        kept=kept_dir if os.path.isdir(kept_dir) else None,
    )


def _kept_now(policy_iterations: int, config: PPOConfig) -> bool:
    """Whether the policy after ``policy_iterations`` updates is kept (every ``keep_every``, and the last)."""
    if not config.keep_every:
        return False
    return policy_iterations % config.keep_every == 0 or policy_iterations == config.iterations


def _iteration(loop: _Loop, state: PPOState) -> dict[str, float]:
    """One PPO iteration, in five phases; returns the iteration's stats.

    1. rollout: this iteration's prompts sampled, scored and turned into advantages (:func:`_rollout`);
    2. critic pre-training: does the value model explain the returns well enough to end it (:func:`_pretraining`);
    3. collapse guard: is the rollout a pattern collapse, to be held back from training (:func:`_guard`);
    4. update: PPO epochs over the buffer, then the adaptive KL (:func:`_update`), unless held back;
    5. bookkeeping: learning rates, reward histograms, the iteration count.
    """
    experience, stats = _rollout(loop, state)
    _pretraining(loop, state, stats)
    update_policy = not state.pretraining
    held_back, raw_scores = _guard(loop, state, experience, stats, update_policy)
    if not held_back:
        _update(loop, state, experience, stats, update_policy)
    opt, step = loop.opt, state.iteration + 1
    stats["ppo/updated_policy"] = float(update_policy and not held_back)
    stats["ppo/policy/lr"] = opt.policy_schedule.get_last_lr()[0]
    if opt.value_schedule is not None:
        stats["ppo/value/lr"] = opt.value_schedule.get_last_lr()[0]
    if loop.config.histogram_every and (step % loop.config.histogram_every == 0 or step == 1):
        state.reward_samples[step] = raw_scores.tolist()
    state.iteration = step
    return stats


def _rollout(loop: _Loop, state: PPOState) -> tuple[Experience, dict[str, float]]:
    """Phase 1: the iteration's ``rollout_batch_size`` responses (``samples_per_prompt`` of each prompt, side by
    side), each rank's share rolled out, checked finite."""
    models, config, iteration = loop.models, loop.config, state.iteration
    # a continuing stream over seeded epochs, so every rollout has rollout_batch_size responses
    # (an epoch's short last batch would shrink the buffer, its statistics and its optimiser steps)
    size, ranks, prompts = config.rollout_batch_size, loop.runtime.ranks, loop.prompts
    k = config.samples_per_prompt
    stream = [minibatch_indices(iteration * (size // k) + j, len(prompts), 1, config.seed)[0] for j in range(size // k)]
    chosen = [index for index in stream for _ in range(k)]  # a prompt's samples are consecutive rows (a group)
    batch = [prompts[i] for i in chosen]
    kinds = [loop.prompt_kinds[i] for i in chosen] if loop.prompt_kinds is not None else None
    seeds = [prompt_seed(config.seed, iteration, j) for j in range(size)]  # a prompt's tokens: not its rank's
    calibrate = config.uses_critic and config.value_init == "reward" and state.value_calibration is None
    experience, stats = make_experience(
        models,
        loop.tokenizer,
        ranks.shard(batch),
        config,
        settings=loop.settings,
        moments=loop.moments,
        kl_coef=state.kl_coef,
        runtime=loop.runtime,
        calibrate_value=calibrate,
        seeds=ranks.shard(seeds),
        kinds=ranks.shard(kinds) if kinds is not None else None,
    )
    check_finite_rollout(experience, stats, iteration + 1, ranks)
    if calibrate:
        state.value_calibration = [models.value_model.config.value_scale, models.value_model.config.value_bias]
    return experience, stats


def _pretraining(loop: _Loop, state: PPOState, stats: dict[str, float]) -> None:
    """Phase 2: end critic pre-training (paper section 5.3.3) once the value model explains this rollout's
    returns or ``value_pretrain_iterations`` have passed."""
    config, iteration = loop.config, state.iteration
    if state.pretraining:
        explained = stats["ppo/value/explained_variance"]
        if explained >= config.value_pretrain_explained_variance or iteration >= config.value_pretrain_iterations:
            state.pretraining = False
            stats["ppo/value/pretrain_iterations"] = float(iteration)
            stats["ppo/value/pretrain_explained_variance"] = explained
            loop.say(f"critic pre-training done after {iteration} iterations: explained variance {explained:.3f}")


def _guard(
    loop: _Loop, state: PPOState, experience: Experience, stats: dict[str, float], update_policy: bool
) -> tuple[bool, torch.Tensor]:
    """Phase 3: the collapse guard over the window of rollouts; ``(held_back, every rank's raw scores)``."""
    config, ranks = loop.config, loop.runtime.ranks
    raw_scores = ranks.gather(experience.raw_scores)  # every rank's, in the batch's order
    truncated = (~ranks.gather(experience.ended)).float().tolist()
    state.window = (state.window + [{"scores": raw_scores.tolist(), "truncated": truncated}])[-config.collapse_window :]
    stats.update(window_signals(state.window))
    if state.policy_iterations == 0:  # sampled by the starting policy: the collapse guard's reference pools it
        state.baseline = pooled_baseline(state.baseline, stats)
    reason = detect_collapse(stats, state.baseline, config) if update_policy else None
    stats["ppo/collapse"] = float(reason is not None)
    if reason is not None:
        line = f"pattern collapse in the rollout of iteration {state.iteration + 1}: {reason}"
        stats["ppo/rollback"] = act_on_collapse(
            line, config, state, loop.models.policy, loop.opt.policy, loop.best_dir, loop.say
        )
    return reason is not None and config.on_collapse != "warn", raw_scores


def _update(loop: _Loop, state: PPOState, experience: Experience, stats: dict[str, float], update_policy: bool) -> None:
    """Phase 4: PPO epochs over the buffer (the value model alone while pre-training), with ptx batches when the
    policy trains; then the adaptive KL coefficient from this rollout's KL (:func:`rlhf.losses.adaptive_kl_coef`)."""
    models, config, opt, iteration = loop.models, loop.config, loop.opt, state.iteration
    ptx = (
        ptx_batches(loop.tokenizer, loop.ptx_texts, config, state.policy_iterations, loop.runtime.device)
        if update_policy
        else None
    )
    try:
        stats.update(
            ppo_update(
                models.policy,
                models.value_model,
                opt,
                experience,
                config=config,
                temperature=loop.settings.temperature,
                order_seed=config.seed * 100003 + iteration,  # the minibatch order, fixed by the iteration
                ptx_batches=ptx,
                update_policy=update_policy,
                runtime=loop.runtime,
                iteration=iteration + 1,
            )
        )
    except NonFiniteError as err:
        err.metrics = {**stats, **err.metrics}
        raise
    state.skipped_steps = [opt.policy_guard.skipped, opt.value_guard.skipped]
    if update_policy:
        state.policy_iterations += 1
        if config.adaptive_kl:
            state.kl_coef = losses.adaptive_kl_coef(
                state.kl_coef, stats["ppo/kl"], config.kl_target, config.kl_horizon, config.rollout_batch_size
            )


def _keep_best(loop: _Loop, state: PPOState, step: int) -> dict[str, float]:
    """Validate the policy; keep it in ``loop.best_dir`` when it beats the best so far (always at step 0)."""
    models, runtime = loop.models, loop.runtime
    stats = {}
    if loop.validation:
        stats = validation_stats(
            models.policy,
            models.reference,
            models.reward_model,
            loop.tokenizer,
            prompts=loop.validation,
            settings=loop.settings,
            runtime=runtime,
            kinds=loop.validation_kinds,
        )
    reward = stats.get("ppo/validation/reward", -math.inf)
    if step == 0 or reward > state.best.reward:
        state.best = Best(step, reward, stats)
        checkpointer = Checkpointer(loop.best_dir, keep=1, ranks=runtime.ranks)
        checkpointer.save(step, {"policy": models.policy}, {"iteration": step})
        runtime.ranks.barrier()  # a rollback on any rank may read it next
    return stats


def _summary(state: PPOState, shipped: Best) -> dict[str, float]:
    """The shipped policy's figures, the last rollout's apart (``ppo/last/*``), the run's counters, and whether the
    rollouts' mean raw reward rose over the policy iterations: ``ppo/reward/slope`` with ``_low``/``_high``, per
    iteration with its 95% interval (:func:`rlhf.stats.linear_trend`; NaN with fewer than 3 policy iterations)."""
    last = state.history.get(state.iteration, {})
    pretrain = [s for s in state.history.values() if "ppo/value/pretrain_iterations" in s]
    trained = sorted((step, s["ppo/reward/mean"]) for step, s in state.history.items() if s.get("ppo/updated_policy"))
    slope = linear_trend([float(step) for step, _ in trained], [reward for _, reward in trained])
    return {
        **{k: v for k, v in shipped.stats.items() if isinstance(v, float)},
        **{k.replace("ppo/", "ppo/last/", 1): v for k, v in last.items() if isinstance(v, float)},
        **{k: v for s in pretrain for k, v in s.items() if k.startswith("ppo/value/pretrain_")},
        "ppo/iterations": float(state.iteration),
        "ppo/policy_iterations": float(state.policy_iterations),
        "ppo/shipped_iteration": float(shipped.iteration),
        "ppo/rollbacks": float(state.rollbacks),
        **dict(zip(("ppo/reward/slope", "ppo/reward/slope_low", "ppo/reward/slope_high"), slope, strict=True)),
        "ppo/policy/skipped_steps": float(state.skipped_steps[0]),
        "ppo/value/skipped_steps": float(state.skipped_steps[1]),
    }
