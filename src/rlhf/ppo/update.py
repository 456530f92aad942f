"""The PPO update: a few epochs of minibatch steps over one experience buffer.

Policy loss: PPO-clip (tutorial Eq. 13), optional entropy bonus (paper
appendix B.3), plus the PPO-ptx language-model term (tutorial Eq. 14). Value
loss: paper Eq. 16, clipped around the rollout-time values (section 5.3). Each
model's gradients are clipped by global norm (appendix C.2), and each schedule
steps once per optimiser step. The first non-finite loss or gradient norm of
either model stops the run (:class:`rlhf.runtime.finite.FiniteGuard`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import likelihood, losses
from rlhf.data.chat import pad
from rlhf.models.forward import position_ids_from_mask, response_logprobs
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.rollout import Experience, value_predictions
from rlhf.runtime.device import PhaseTimer, Runtime
from rlhf.runtime.finite import FiniteGuard, NonFiniteError, ScalerStep, to_host
from rlhf.runtime.sharding import is_sharded
from rlhf.training.supervised import make_optimizer, make_scheduler, minibatch_indices, summed_over_ranks


@dataclass
class Optimisers:
    """Optimisers and schedules of the policy and value models; each schedule steps once per optimiser step.

    ``value`` and ``value_schedule`` are None where there is no value model (``rloo``, ``grpo``).

    ``policy_guard`` and ``value_guard`` stop the run at a non-finite loss or
    gradient norm and count the steps a loss scaler skips (:class:`rlhf.runtime.finite.FiniteGuard`).
    """

    policy: torch.optim.Optimizer
    value: torch.optim.Optimizer | None
    policy_schedule: torch.optim.lr_scheduler.LRScheduler
    value_schedule: torch.optim.lr_scheduler.LRScheduler | None
    policy_guard: FiniteGuard = field(default_factory=lambda: FiniteGuard("ppo"))
    value_guard: FiniteGuard = field(default_factory=lambda: FiniteGuard("ppo"))


def make_optimisers(
    policy: PreTrainedModel,
    value_model: PreTrainedModel | None,
    config: PPOConfig,
    scaler_step: ScalerStep | None = None,
) -> Optimisers:
    """AdamW for both models (the policy alone without a value model); schedules sized in optimiser steps (policy
    iterations, and value pre-training).

    ``scaler_step``: a mixed-precision loss scaler's step for both guards (:class:`rlhf.runtime.finite.FiniteGuard`).
    """
    policy_optimizer = make_optimizer(policy, config.policy_lr)
    per_iteration = config.steps_per_iteration()
    value_iterations = config.value_pretrain_iterations + config.iterations
    value_optimizer = make_optimizer(value_model, config.value_lr) if value_model is not None else None
    value_schedule = (
        make_scheduler(value_optimizer, config.scheduler, config.warmup_steps, value_iterations * per_iteration)
        if value_optimizer is not None
        else None
    )
    return Optimisers(
        policy_optimizer,
        value_optimizer,
        make_scheduler(policy_optimizer, config.scheduler, config.warmup_steps, config.iterations * per_iteration),
        value_schedule,
        FiniteGuard("ppo", scaler_step),
        FiniteGuard("ppo", scaler_step),
    )


def ppo_update(
    policy: PreTrainedModel,
    value_model: PreTrainedModel | None,
    optimisers: Optimisers,
    experience: Experience,
    config: PPOConfig,
    temperature: float,
    order_seed: int,
    ptx_batches: list[tuple[torch.Tensor, torch.Tensor]] | None,
    update_policy: bool,
    runtime: Runtime,
    iteration: int = 1,
) -> dict[str, float]:
    """``ppo_epochs`` passes over the buffer in minibatches: a policy step and a value step each (no value step
    without a value model).

    Policy loss: PPO-clip (tutorial Eq. 13) minus ``entropy_coef`` times the
    entropy, plus ``ptx_coef`` times the LM loss on pretraining-style text
    (tutorial Eq. 14). Value loss: paper Eq. 16, clipped around the values
    cached at rollout time. Gradients are clipped by global norm per model.

    Args:
        policy, value_model: trained in place; value_model None: no critic (``rloo``, ``grpo``).
        optimisers: :class:`Optimisers`.
        experience: from :func:`rlhf.ppo.rollout.make_experience`: this rank's rollouts (global rollout ``r + k W``
            is row ``k`` of rank ``r``). The minibatches are drawn from all ranks' rollouts together, and each
            step's gradient is the whole minibatch's (:mod:`rlhf.runtime.distributed`).
        config: :class:`PPOConfig`.
        temperature: the sampling temperature (logprobs are those of the sampled distribution).
        order_seed: seeds the minibatch order (one per iteration, so a resumed run repeats it).
        ptx_batches: ``(input_ids, attention_mask)`` batches of ptx text, one per policy step, or None.
        update_policy: False during critic pre-training (value steps only).
        runtime: device and precision; forward passes run under ``runtime.autocast()``.
        iteration: the rollout iteration (1-based), named when a step fails.

    Returns:
        Mean of each loss and diagnostic over the minibatches, and ``ppo/time/update`` (seconds).

    Raises:
        NonFiniteError: (a ``FloatingPointError``) a non-finite loss or gradient norm, e.g.
            ``ppo: non-finite ppo/loss/value (nan) at iteration 2, PPO epoch 1, minibatch 1; training stopped``;
            its ``metrics`` hold that minibatch's figures.
    """
    totals: dict[str, float] = {}
    count = 0
    ranks = runtime.ranks
    n = ranks.total(experience.input_ids.shape[0], runtime.device)  # all ranks' rollouts (rank r: r, r + W, ..)
    ptx_iter = iter(ptx_batches or [])
    rng, timer = random.Random(order_seed), PhaseTimer(runtime)
    with timer("update"):
        for epoch in range(config.ppo_epochs):
            order = rng.sample(range(n), n)  # host-side bookkeeping: no tensor, no device
            for number, start in enumerate(range(0, n, config.minibatch_size), 1):
                idx = [g // ranks.world_size for g in ranks.shard_of(order[start : start + config.minibatch_size])]
                where = f"iteration {iteration}, PPO epoch {epoch + 1}, minibatch {number}"
                stats: dict[str, float] = {}
                try:
                    if update_policy:
                        ptx = next(ptx_iter, None)
                        policy_step(
                            policy,
                            optimisers,
                            experience,
                            idx,
                            config=config,
                            temperature=temperature,
                            ptx_batch=ptx,
                            runtime=runtime,
                            where=where,
                            stats=stats,
                        )
                    if value_model is not None:
                        value_step(
                            value_model,
                            optimisers,
                            experience,
                            idx,
                            config=config,
                            runtime=runtime,
                            where=where,
                            stats=stats,
                        )
                except NonFiniteError as err:
                    err.metrics = {**stats, **err.metrics}
                    raise
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
                count += 1
    return {**{key: value / count for key, value in totals.items()}, **timer.stats("ppo/time")}


def policy_step(
    policy: PreTrainedModel,
    optimisers: Optimisers,
    experience: Experience,
    idx: list[int],
    config: PPOConfig,
    temperature: float,
    ptx_batch: tuple[torch.Tensor, torch.Tensor] | None,
    runtime: Runtime,
    where: str = "a policy step",
    stats: dict[str, float] | None = None,
) -> dict[str, float]:
    """One optimiser step of the policy on the rollouts ``idx`` of the buffer; returns its stats.

    The forward passes run under ``runtime.autocast()``; the step's figures reach
    the host once, after the backward pass and before the optimiser step, and are
    written into ``stats`` (so a failing step's figures reach the log).

    Raises:
        NonFiniteError: the PPO-clip loss, the ptx loss, their sum or the gradient norm is not finite.
    """
    stats = {} if stats is None else stats
    guard, ranks = optimisers.policy_guard, runtime.ranks
    mask = experience.mask
    count = ranks.sum(mask[idx].sum().float())  # response tokens of the whole minibatch, every rank's rows
    advantages = experience.advantages.clone()  # rows idx whitened over the minibatch (every rank's rows)
    if config.advantage_normalize:
        advantages[idx] = losses.masked_whiten(advantages[idx], mask[idx], across=ranks.sum)
    if config.advantage_clip is not None:
        advantages = advantages.clamp(-config.advantage_clip, config.advantage_clip)
    with_logits = config.entropy_coef > 0
    together = runtime.device if is_sharded(policy) else None  # FSDP: every rank runs as many passes
    figures: dict[str, torch.Tensor] = {}
    optimisers.policy.zero_grad(set_to_none=True)
    for rows, counted in ranks.passes(idx, config.micro_batch_size, [0], together):
        ids, attn, part_mask = experience.input_ids[rows], experience.attention_mask[rows], mask[rows]
        with runtime.autocast():
            entry = experience.policy_entry.rows(rows) if experience.policy_entry is not None else None
            logprobs, logits = response_logprobs(
                policy, ids, attn, experience.response_start, temperature, with_logits, entry=entry
            )
            loss, clip_stats = losses.ppo_clip_loss(
                logprobs, experience.logprobs[rows], advantages[rows], part_mask, config.clip, count
            )
            shares = {"ppo/loss/policy": loss, **{f"ppo/policy/{key}": value for key, value in clip_stats.items()}}
            if config.entropy_coef > 0:
                entropy = losses.masked_mean(likelihood.entropy_from_logits(logits), part_mask, count=count)
                loss = loss - config.entropy_coef * entropy
        (loss if counted else loss * 0.0).backward()
        if counted:
            _add(figures, {**shares, "ppo/loss/policy_total": loss})
    if config.ptx_coef > 0 and ptx_batch is not None:
        ptx_ids, ptx_attn = ptx_batch  # the whole ptx minibatch, on every rank; each takes its share of the rows
        ptx_count = ptx_attn[:, 1:].sum()  # the tokens language_model_loss scores, all rows
        mine = ranks.shard(list(range(ptx_ids.shape[0])))
        for rows, counted in ranks.passes(mine, config.micro_batch_size, [0], together):
            with runtime.autocast():
                ids, attn = ptx_ids[rows], ptx_attn[rows]
                position_ids = position_ids_from_mask(attn)
                ptx_logits = policy(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits
                ptx_loss = likelihood.language_model_loss(ptx_logits, ids, attn.bool(), ptx_count)
                loss = losses.ppo_ptx_loss(torch.zeros_like(ptx_loss), ptx_loss, config.ptx_coef)
            (loss if counted else loss * 0.0).backward()
            if counted:
                _add(figures, {"ppo/loss/ptx": ptx_loss, "ppo/loss/policy_total": loss})
    ranks.sum_gradients(policy)
    figures = summed_over_ranks(figures, ranks, runtime.device)
    figures["ppo/policy/grad_norm"] = guard.clip(policy, config.max_grad_norm)
    host = to_host(figures)
    stats.update({k: v for k, v in host.items() if k != "ppo/loss/policy_total"})
    for key in ("ppo/loss/policy", "ppo/loss/ptx", "ppo/loss/policy_total"):
        if key in host:
            guard.check_loss(key, host[key], where)
    guard.step(
        optimisers.policy, optimisers.policy_schedule, host["ppo/policy/grad_norm"], "ppo/policy/grad_norm", where
    )
    optimisers.policy.zero_grad(set_to_none=True)  # the gradients' memory is free for the value step
    return stats


def _add(totals: dict[str, torch.Tensor], shares: dict[str, torch.Tensor]) -> None:
    """Add each detached share (one micro-batch's part of a minibatch figure) into ``totals``."""
    for key, value in shares.items():
        totals[key] = totals.get(key, 0.0) + value.detach().float()


def value_step(
    value_model: PreTrainedModel,
    optimisers: Optimisers,
    experience: Experience,
    idx: list[int],
    config: PPOConfig,
    runtime: Runtime,
    where: str = "a value step",
    stats: dict[str, float] | None = None,
) -> dict[str, float]:
    """One optimiser step of the value model on the rollouts ``idx`` of the buffer (paper Eq. 16, clipped).

    The forward pass runs under ``runtime.autocast()``; the step's figures reach the
    host once and are written into ``stats``; returns them.

    Raises:
        NonFiniteError: the value loss or the gradient norm is not finite.
    """
    stats = {} if stats is None else stats
    guard, ranks = optimisers.value_guard, runtime.ranks
    count = ranks.sum(experience.mask[idx].sum().float())  # response tokens of the whole minibatch
    figures: dict[str, torch.Tensor] = {}
    optimisers.value.zero_grad(set_to_none=True)
    together = runtime.device if is_sharded(value_model) else None  # FSDP: every rank runs as many passes
    for part, counted in ranks.passes(idx, config.micro_batch_size, [0], together):
        ids, attn, mask = experience.input_ids[part], experience.attention_mask[part], experience.mask[part]
        with runtime.autocast():
            entry = experience.value_entry.rows(part) if experience.value_entry is not None else None
            values = value_predictions(value_model, ids, attn, experience.response_start, entry)
            old_values, returns = experience.values[part], experience.returns[part]
            loss, value_stats = losses.clipped_value_loss(values, old_values, returns, mask, config.value_clip, count)
        (loss if counted else loss * 0.0).backward()  # FSDP: a pass every rank joins (rlhf.runtime.sharding)
        if counted:
            _add(figures, {"ppo/loss/value": loss, "ppo/value/clipfrac": value_stats["clipfrac"]})
    ranks.sum_gradients(value_model)
    figures = summed_over_ranks(figures, ranks, runtime.device)
    figures["ppo/value/grad_norm"] = guard.clip(value_model, config.max_grad_norm)
    host = to_host(figures)
    stats.update(host)
    guard.check_loss("ppo/loss/value", host["ppo/loss/value"], where)
    guard.step(optimisers.value, optimisers.value_schedule, host["ppo/value/grad_norm"], "ppo/value/grad_norm", where)
    optimisers.value.zero_grad(set_to_none=True)  # the gradients' memory is free for the next policy step
    return stats


def ptx_batches(
    tokenizer: PreTrainedTokenizerBase,
    ptx_texts: list[list[int]],
    config: PPOConfig,
    policy_iteration: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The ptx minibatches of one policy iteration on ``device``, one per policy step, in an order fixed by the
    iteration."""
    if config.ptx_coef <= 0 or not ptx_texts:
        return None
    steps = config.steps_per_iteration()
    batches = []
    for s in range(steps):
        indices = minibatch_indices(policy_iteration * steps + s, len(ptx_texts), config.ptx_batch_size, config.seed)
        batches.append(pad(tokenizer, [ptx_texts[i] for i in indices], "right", device))
    return batches
