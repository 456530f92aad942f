"""Stage 3: PPO with every PPO-max technique as an independent switch (paper section 5.4).

One iteration: sample a small experience buffer of rollouts from the policy,
score it (reward model, reference model, value model), turn it into token
rewards (tutorial Eq. 11), advantages and returns (GAE, paper Eq. 9), then run
a few PPO epochs over it (tutorial Eq. 13, value loss paper Eq. 16, PPO-ptx
tutorial Eq. 14). The first ``value_pretrain_iterations`` iterations update the
value model only (critic pre-training, paper section 5.3.3).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import losses
from rlhf.models import pad, position_ids_from_mask, response_logprobs, sample, sequence_scores, token_scores
from rlhf.training import (
    Checkpointer,
    LogFn,
    clip_gradients,
    freeze_lower_layers,
    make_optimizer,
    make_scheduler,
    minibatch_indices,
)


@dataclass
class PPOConfig:
    """PPO hyperparameters and PPO-max switches (params.yaml section ``ppo``; defaults = the PPO-max preset).

    Every switch acts alone; none silently depends on another.
    """

    iterations: int = 12
    rollout_batch_size: int = 8  # prompts per iteration: the (small) experience buffer
    minibatch_size: int = 4
    ppo_epochs: int = 2
    policy_lr: float = 1e-6
    value_lr: float = 5e-6
    scheduler: str = "constant"
    warmup_steps: int = 0
    temperature: float = 0.7
    max_new_tokens: int = 48
    max_prompt_length: int = 192
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2
    # token-level KL penalty (tutorial Eq. 11) and optional adaptive controller
    kl_coef: float = 0.05
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    # reward normalisation and clipping by running statistics (paper Eq. 18)
    reward_normalize: bool = True
    reward_clip: float | None = 5.0
    # advantage normalisation / clipping (off in PPO-max: appendix B.1)
    advantage_normalize: bool = False
    advantage_clip: float | None = None
    # value-loss clipping (paper section 5.3; None disables)
    value_clip: float | None = 0.2
    # critic pre-training: value-only iterations before the policy moves
    value_pretrain_iterations: int = 2
    # global gradient-norm clipping, policy and value separately (None disables)
    max_grad_norm: float | None = 1.0
    # PPO-ptx (tutorial Eq. 14): LM loss on pretraining-style text
    ptx_coef: float = 0.0
    ptx_batch_size: int = 2
    ptx_max_length: int = 128
    entropy_coef: float = 0.0
    # penalty subtracted from the raw score of a response that hit the length limit without EOS (None: off)
    missing_eos_penalty: float | None = None
    # monitoring
    histogram_every: int = 5
    # pattern-collapse guard (section 5.2): None disables a check
    collapse_kl_max: float | None = 20.0
    collapse_length_ratio: float | None = 3.0
    collapse_perplexity_ratio: float | None = 3.0
    collapse_reward_skew: float | None = 3.0
    on_collapse: str = "stop"  # stop | rollback (to the best policy, fresh policy optimiser) | warn
    max_rollbacks: int = 2  # after this many rollbacks a further collapse stops the run
    validate_every: int = 4
    validation_prompts: int = 8
    checkpoint_every: int = 1
    trainable_layers: int | None = None  # train only the top N blocks of policy and value model (CPU budget); None: all
    seed: int = 0

    def __post_init__(self) -> None:
        """Reject settings no run could use, before any model is loaded.

        Raises:
            ValueError: an unknown ``on_collapse`` or a batch setting below 1.
        """
        if self.on_collapse not in ("stop", "rollback", "warn"):
            raise ValueError(f"ppo.on_collapse must be stop, rollback or warn, got {self.on_collapse!r}")
        for name in ("rollout_batch_size", "minibatch_size", "ppo_epochs", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ppo.{name} must be at least 1, got {getattr(self, name)}")


class RunningMoments:
    """Running mean and population std of all reward-model scores seen so far (Chan et al. parallel update).

    ``normalize`` raises while no statistics exist, so turning normalisation on
    cannot silently pass rewards through unchanged.
    """

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    @property
    def std(self) -> float:
        """Population standard deviation of everything seen."""
        return math.sqrt(self.m2 / self.count) if self.count else float("nan")

    def update(self, values: torch.Tensor) -> None:
        """Fold a batch ``(N,)`` of values into the statistics."""
        values = values.double().flatten()
        n = values.numel()
        if n == 0:
            return
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    def normalize(self, values: torch.Tensor, clip: float | None) -> torch.Tensor:
        """Paper Eq. 18 with these statistics.

        Raises:
            RuntimeError: no statistics yet.
        """
        if self.count == 0:
            raise RuntimeError("reward normalisation is on but no reward statistics exist yet")
        return losses.normalize_and_clip(values, self.mean, self.std, clip)

    def state_dict(self) -> dict[str, float]:
        """For checkpoints."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict`."""
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


@dataclass
class Experience:
    """A scored buffer of rollouts. Shapes: ``B`` rollouts, ``T`` = prompt + response tokens, ``R`` response tokens."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    response_start: int
    mask: torch.Tensor  # (B, R) bool
    logprobs: torch.Tensor  # (B, R) float32, policy at rollout time (temperature-scaled)
    values: torch.Tensor  # (B, R) float32, value model at rollout time
    advantages: torch.Tensor  # (B, R) float32
    returns: torch.Tensor  # (B, R) float32
    raw_scores: torch.Tensor  # (B,) float32


def _value_predictions(
    value_model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int
) -> torch.Tensor:
    """``V(s_t)`` for each response token: the value head at the position that predicts token ``t``; ``(B, R)``."""
    return token_scores(value_model, input_ids, attention_mask)[:, response_start - 1 : -1]


@torch.no_grad()
def make_experience(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    reward_model: PreTrainedModel,
    value_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    config: PPOConfig,
    moments: RunningMoments,
    kl_coef: float,
) -> tuple[Experience, dict[str, float]]:
    """Roll out, score and turn a batch of prompts into advantages and returns.

    Args:
        policy, reference, reward_model, value_model: the four models (dropout off).
        tokenizer: shared tokenizer.
        prompts: token lists (chat template with generation header).
        config: :class:`PPOConfig`.
        moments: running reward statistics (updated here when normalisation is on).
        kl_coef: the current beta.

    Returns:
        ``(experience, stats)``; stats are the iteration's monitoring signals.
    """
    rollout = sample(policy, tokenizer, prompts, config.max_new_tokens, config.temperature)
    ids, attn, start, mask = rollout.input_ids, rollout.attention_mask, rollout.response_start, rollout.response_mask
    logprobs, logits = response_logprobs(policy, ids, attn, start, config.temperature, with_logits=True)
    entropy = losses.entropy_from_logits(logits)
    del logits
    ref_logprobs, _ = response_logprobs(reference, ids, attn, start, config.temperature)
    values = _value_predictions(value_model, ids, attn, start)
    raw_scores = sequence_scores(reward_model, ids, attn)
    scores = raw_scores.clone()
    if config.missing_eos_penalty is not None:
        scores = scores - config.missing_eos_penalty * (~rollout.ended).float()
    if config.reward_normalize:
        moments.update(scores)
        scores = moments.normalize(scores, config.reward_clip)
    elif config.reward_clip is not None:
        scores = scores.clamp(-config.reward_clip, config.reward_clip)
    logratio = (logprobs - ref_logprobs) * mask
    rewards = losses.token_rewards(logratio, scores, mask, kl_coef)
    advantages, returns = losses.gae(rewards, values, mask, config.gamma, config.lam)
    lengths = mask.sum(-1).float()
    token_nll = -losses.masked_mean(logprobs, mask)
    kl_seq = (losses.kl_k1(logratio) * mask).sum(-1)
    kl3_seq = (losses.kl_k3(logratio) * mask).sum(-1)
    stats = {
        "ppo/reward/mean": float(raw_scores.mean()),
        "ppo/reward/std": float(raw_scores.std(unbiased=False)),
        "ppo/reward/normalized_mean": float(scores.mean()),
        "ppo/reward/normalized_std": float(scores.std(unbiased=False)),
        "ppo/reward/skew": _skewness(raw_scores),
        **{f"ppo/reward/p{q}": float(torch.quantile(raw_scores, q / 100)) for q in (10, 50, 90)},
        "ppo/reward/max": float(raw_scores.max()),
        "ppo/reward/running_mean": moments.mean if moments.count else float("nan"),
        "ppo/reward/running_std": moments.std,
        "ppo/kl": float(kl_seq.mean()),
        "ppo/kl_k3": float(kl3_seq.mean()),
        "ppo/kl_token": float(losses.masked_mean(losses.kl_k1(logratio), mask)),
        "ppo/kl_token_k3": float(losses.masked_mean(losses.kl_k3(logratio), mask)),
        "ppo/kl_coef": kl_coef,
        "ppo/perplexity": float(torch.exp(token_nll)),
        "ppo/response_length": float(lengths.mean()),
        "ppo/eos_rate": float(rollout.ended.float().mean()),
        "ppo/entropy": float(losses.masked_mean(entropy, mask)),
        "ppo/value/explained_variance": losses.explained_variance(values, returns, mask),
        "ppo/advantages/mean": float(losses.masked_mean(advantages, mask)),
        "ppo/returns/mean": float(losses.masked_mean(returns, mask)),
    }
    experience = Experience(ids, attn, start, mask, logprobs, values, advantages, returns, raw_scores)
    return experience, stats


def _skewness(x: torch.Tensor) -> float:
    """Sample skewness ``E[(x - mu)^3] / sigma^3`` of ``(N,)`` values; 0 when constant."""
    x = x.double()
    std = float(x.std(unbiased=False))
    return float(((x - x.mean()) ** 3).mean()) / std**3 if std > 0 else 0.0


@dataclass
class Optimisers:
    """Optimisers and schedules of the policy and value models."""

    policy: torch.optim.Optimizer
    value: torch.optim.Optimizer
    policy_schedule: torch.optim.lr_scheduler.LRScheduler
    value_schedule: torch.optim.lr_scheduler.LRScheduler


def ppo_update(
    policy: PreTrainedModel,
    value_model: PreTrainedModel,
    optimisers: Optimisers,
    experience: Experience,
    config: PPOConfig,
    generator: torch.Generator,
    ptx_batches: list[tuple[torch.Tensor, torch.Tensor]] | None,
    update_policy: bool,
) -> dict[str, float]:
    """``ppo_epochs`` passes over the buffer in minibatches: a policy step and a value step each.

    Policy loss: PPO-clip (tutorial Eq. 13) minus ``entropy_coef`` times the
    entropy, plus ``ptx_coef`` times the LM loss on pretraining-style text
    (tutorial Eq. 14). Value loss: paper Eq. 16, clipped around the values
    cached at rollout time. Gradients are clipped by global norm per model.

    Args:
        policy, value_model: trained in place.
        optimisers: :class:`Optimisers`.
        experience: from :func:`make_experience`.
        config: :class:`PPOConfig`.
        generator: orders the minibatches (seeded per iteration for exact resume).
        ptx_batches: ``(input_ids, attention_mask)`` batches of ptx text, one per policy step, or None.
        update_policy: False during critic pre-training (value steps only).

    Returns:
        Mean of each loss and diagnostic over the minibatches.
    """
    totals: dict[str, float] = {}
    count = 0
    n = experience.input_ids.shape[0]
    ptx_iter = iter(ptx_batches or [])
    for _ in range(config.ppo_epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, config.minibatch_size):
            idx = order[start : start + config.minibatch_size]
            ids, attn, mask = experience.input_ids[idx], experience.attention_mask[idx], experience.mask[idx]
            stats: dict[str, float] = {}
            if update_policy:
                stats.update(
                    _policy_step(policy, optimisers, experience, idx, ids, attn, mask, config, next(ptx_iter, None))
                )
            stats.update(_value_step(value_model, optimisers, experience, idx, ids, attn, mask, config))
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
            count += 1
    if update_policy:
        optimisers.policy_schedule.step()
    optimisers.value_schedule.step()
    return {key: value / count for key, value in totals.items()}


def _policy_step(policy, optimisers, experience, idx, ids, attn, mask, config, ptx_batch) -> dict[str, float]:
    advantages = experience.advantages[idx]
    if config.advantage_normalize:
        advantages = losses.masked_whiten(advantages, mask)
    if config.advantage_clip is not None:
        advantages = advantages.clamp(-config.advantage_clip, config.advantage_clip)
    logprobs, logits = response_logprobs(
        policy, ids, attn, experience.response_start, config.temperature, with_logits=config.entropy_coef > 0
    )
    loss, clip_stats = losses.ppo_clip_loss(logprobs, experience.logprobs[idx], advantages, mask, config.clip)
    stats = {
        "ppo/loss/policy": loss.item(),
        "ppo/policy/clipfrac": float(clip_stats["clipfrac"]),
        "ppo/policy/approx_kl": float(clip_stats["approx_kl"]),
        "ppo/policy/ratio": float(clip_stats["ratio"]),
    }
    if config.entropy_coef > 0:
        entropy = losses.masked_mean(losses.entropy_from_logits(logits), mask)
        loss = loss - config.entropy_coef * entropy
    if config.ptx_coef > 0 and ptx_batch is not None:
        ptx_ids, ptx_attn = ptx_batch
        ptx_logits = policy(
            input_ids=ptx_ids, attention_mask=ptx_attn, position_ids=position_ids_from_mask(ptx_attn)
        ).logits
        ptx_loss = losses.language_model_loss(ptx_logits, ptx_ids, ptx_attn.bool())
        loss = losses.ppo_ptx_loss(loss, ptx_loss, config.ptx_coef)
        stats["ppo/loss/ptx"] = ptx_loss.item()
    optimisers.policy.zero_grad(set_to_none=True)
    loss.backward()
    stats["ppo/policy/grad_norm"] = clip_gradients(policy, config.max_grad_norm)
    optimisers.policy.step()
    return stats


def _value_step(value_model, optimisers, experience, idx, ids, attn, mask, config) -> dict[str, float]:
    values = _value_predictions(value_model, ids, attn, experience.response_start)
    loss, value_stats = losses.clipped_value_loss(
        values, experience.values[idx], experience.returns[idx], mask, config.value_clip
    )
    optimisers.value.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = clip_gradients(value_model, config.max_grad_norm)
    optimisers.value.step()
    return {
        "ppo/loss/value": loss.item(),
        "ppo/value/clipfrac": float(value_stats["clipfrac"]),
        "ppo/value/grad_norm": grad_norm,
    }


def detect_collapse(stats: dict[str, float], baseline: dict[str, float], config: PPOConfig) -> str | None:
    """Pattern-collapse detector over the monitoring signals (paper section 5.2 and appendix A).

    Flags: sequence KL above ``collapse_kl_max``; mean response length or
    perplexity more than ``collapse_*_ratio`` times above or below its value at
    the first iteration (``baseline``); reward scores whose skewness exceeds
    ``collapse_reward_skew`` in absolute value (a long tail). ``None`` disables a check.

    Returns:
        A one-line reason, or None when nothing is wrong.
    """
    if config.collapse_kl_max is not None and stats["ppo/kl"] > config.collapse_kl_max:
        return f"KL {stats['ppo/kl']:.2f} > {config.collapse_kl_max}"
    for key, ratio in (
        ("ppo/response_length", config.collapse_length_ratio),
        ("ppo/perplexity", config.collapse_perplexity_ratio),
    ):
        if ratio is not None and baseline.get(key, 0) > 0:
            change = stats[key] / baseline[key]
            if change > ratio or change < 1 / ratio:
                return f"{key} moved from {baseline[key]:.2f} to {stats[key]:.2f} (x{change:.2f}, limit x{ratio})"
    if config.collapse_reward_skew is not None and abs(stats["ppo/reward/skew"]) > config.collapse_reward_skew:
        return f"reward distribution has a long tail (skew {stats['ppo/reward/skew']:.2f})"
    return None


@torch.no_grad()
def validation_reward(
    policy: PreTrainedModel,
    reward_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    config: PPOConfig,
) -> float:
    """Mean reward-model score of greedy responses on held-out prompts: the measure the best checkpoint is kept by."""
    rollout = sample(policy, tokenizer, prompts, config.max_new_tokens, config.temperature, greedy=True)
    return float(sequence_scores(reward_model, rollout.input_ids, rollout.attention_mask).mean())


def _ptx_batches(
    tokenizer, ptx_texts: list[list[int]], config: PPOConfig, iteration: int
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The ptx minibatches of one iteration, one per policy step, in an order fixed by the iteration."""
    if config.ptx_coef <= 0 or not ptx_texts:
        return None
    steps = config.ppo_epochs * -(-config.rollout_batch_size // config.minibatch_size)
    return [
        pad(
            tokenizer,
            [
                ptx_texts[i]
                for i in minibatch_indices(iteration * steps + s, len(ptx_texts), config.ptx_batch_size, config.seed)
            ],
            "right",
        )
        for s in range(steps)
    ]


@dataclass
class PPOResult:
    """What :func:`train_ppo` leaves: summary, per-iteration metrics, reward samples, why it stopped."""

    summary: dict[str, float]
    history: dict[int, dict[str, float]]
    reward_samples: dict[int, list[float]]
    stopped_by: str | None
    best_iteration: int


def _save(
    checkpointer: Checkpointer,
    step: int,
    policy,
    value_model,
    opt: Optimisers,
    moments: RunningMoments,
    state: dict[str, Any],
) -> None:
    """Checkpoint everything a resumed run needs to continue exactly."""
    checkpointer.save(
        step,
        {"policy": policy, "value": value_model},
        {
            "policy_optimizer": opt.policy.state_dict(),
            "value_optimizer": opt.value.state_dict(),
            "policy_schedule": opt.policy_schedule.state_dict(),
            "value_schedule": opt.value_schedule.state_dict(),
            "moments": moments.state_dict(),
            "rng": torch.get_rng_state(),
            "trainer": state,
        },
    )


def _restore(
    checkpointer: Checkpointer, path: str, policy, value_model, opt: Optimisers, moments: RunningMoments
) -> dict[str, Any]:
    """Load what :func:`_save` wrote; returns the trainer state."""
    saved = checkpointer.load_state(path)
    checkpointer.load_model_weights(path, "policy", policy)
    checkpointer.load_model_weights(path, "value", value_model)
    opt.policy.load_state_dict(saved["policy_optimizer"])
    opt.value.load_state_dict(saved["value_optimizer"])
    opt.policy_schedule.load_state_dict(saved["policy_schedule"])
    opt.value_schedule.load_state_dict(saved["value_schedule"])
    moments.load_state_dict(saved["moments"])
    torch.set_rng_state(saved["rng"])
    return saved["trainer"]


def _on_collapse(
    line: str, config: PPOConfig, state: dict[str, Any], policy, opt: Optimisers, best_dir: str, say
) -> float:
    """Act on a detected collapse as ``on_collapse`` says; returns 1.0 when the policy was rolled back."""
    say(line)
    best = Checkpointer(best_dir).latest()
    if config.on_collapse == "rollback" and best is not None and state["rollbacks"] < config.max_rollbacks:
        Checkpointer(best_dir).load_model_weights(best, "policy", policy)
        opt.policy.state.clear()  # the optimiser moments of the collapsed trajectory go too
        state["rollbacks"] += 1
        say(
            f"rolled the policy back to iteration {state['best_iteration']} "
            f"({state['rollbacks']}/{config.max_rollbacks})"
        )
        return 1.0
    if config.on_collapse != "warn":
        state["stopped_by"] = line
    return 0.0


def train_ppo(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    reward_model: PreTrainedModel,
    value_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    validation: list[list[int]],
    ptx_texts: list[list[int]],
    config: PPOConfig,
    log: LogFn,
    checkpointer: Checkpointer,
    progress: bool = True,
) -> PPOResult:
    """Train ``policy`` and ``value_model`` in place with PPO / PPO-max; leaves the best policy in ``policy``.

    Resumable: after each ``checkpoint_every`` iterations the policy, value
    model, both optimisers and schedules, running reward statistics, KL
    coefficient, RNG state, iteration counter and best-so-far are checkpointed;
    a restart continues from there. The best policy by validation reward is
    kept (``<checkpoint root>/best``) and loaded into ``policy`` at the end, so
    a pattern collapse never leaves the collapsed policy as the result. On a
    collapse (:func:`detect_collapse`) the run stops, rolls the policy back to
    the best checkpoint (``on_collapse: rollback``, at most ``max_rollbacks``
    times, then stops) or only warns, as configured.

    Args:
        policy: initialised from SFT; reference: a frozen copy of SFT.
        reward_model: frozen; value_model: initialised from the reward model (or SFT).
        tokenizer: shared tokenizer.
        prompts: training prompt token lists; validation: held-out prompt token lists.
        ptx_texts: token lists of pretraining-style text (PPO-ptx).
        config: :class:`PPOConfig`.
        log: ``log(metrics, step)`` with step = iteration (1-based).
        checkpointer: resume point and home of the best policy.

    Returns:
        :class:`PPOResult`.

    Raises:
        ValueError: no prompts.
    """
    from tqdm.auto import tqdm

    if not prompts:
        raise ValueError("no PPO prompts")
    for model in (policy, reference, reward_model, value_model):
        model.eval()  # dropout off everywhere; gradients still flow into policy and value
    for model in (reference, reward_model):
        model.requires_grad_(False)
    for model in (policy, value_model):
        freeze_lower_layers(model, config.trainable_layers)
    total = config.value_pretrain_iterations + config.iterations
    policy_updates = max(config.iterations, 1)
    policy_optimizer, value_optimizer = (
        make_optimizer(policy, config.policy_lr),
        make_optimizer(value_model, config.value_lr),
    )
    opt = Optimisers(
        policy_optimizer,
        value_optimizer,
        make_scheduler(policy_optimizer, config.scheduler, config.warmup_steps, policy_updates),
        make_scheduler(value_optimizer, config.scheduler, config.warmup_steps, total),
    )
    moments = RunningMoments()
    state: dict[str, Any] = {
        "iteration": 0,
        "kl_coef": config.kl_coef,
        "baseline": {},
        "best_reward": -math.inf,
        "best_iteration": 0,
        "reward_samples": {},
        "stopped_by": None,
        "history": {},
        "rollbacks": 0,
    }
    torch.manual_seed(config.seed)
    resume = checkpointer.latest()
    if resume:
        state = _restore(checkpointer, resume, policy, value_model, opt, moments)
    best_dir = os.path.join(checkpointer.root, "best")
    bar = tqdm(
        range(state["iteration"], total), desc="ppo", initial=state["iteration"], total=total, disable=not progress
    )
    for iteration in bar:
        if state["stopped_by"]:
            break
        step = iteration + 1
        batch = [prompts[i] for i in minibatch_indices(iteration, len(prompts), config.rollout_batch_size, config.seed)]
        experience, stats = make_experience(
            policy, reference, reward_model, value_model, tokenizer, batch, config, moments, state["kl_coef"]
        )
        update_policy = iteration >= config.value_pretrain_iterations
        generator = torch.Generator().manual_seed(config.seed * 100003 + iteration)
        ptx = _ptx_batches(tokenizer, ptx_texts, config, iteration) if update_policy else None
        stats.update(ppo_update(policy, value_model, opt, experience, config, generator, ptx, update_policy))
        stats["ppo/policy/lr"] = opt.policy_schedule.get_last_lr()[0]
        stats["ppo/value/lr"] = opt.value_schedule.get_last_lr()[0]
        stats["ppo/phase_value_pretrain"] = float(not update_policy)
        if config.adaptive_kl and update_policy:
            state["kl_coef"] = losses.adaptive_kl_coef(
                state["kl_coef"], stats["ppo/kl"], config.kl_target, config.kl_horizon, len(batch)
            )
        if config.histogram_every and (step % config.histogram_every == 0 or step == 1):
            state["reward_samples"][step] = experience.raw_scores.tolist()
        if not state["baseline"]:
            state["baseline"] = {k: stats[k] for k in ("ppo/response_length", "ppo/perplexity")}
        reason = detect_collapse(stats, state["baseline"], config) if update_policy else None
        stats["ppo/collapse"] = float(reason is not None)
        if (
            update_policy
            and config.validate_every
            and validation
            and (step % config.validate_every == 0 or step == total)
            and reason is None
        ):
            stats["ppo/validation_reward"] = validation_reward(policy, reward_model, tokenizer, validation, config)
            if stats["ppo/validation_reward"] > state["best_reward"]:
                state["best_reward"], state["best_iteration"] = stats["ppo/validation_reward"], step
                Checkpointer(best_dir, keep=1).save(
                    step, {"policy": policy}, {"iteration": step, "validation_reward": state["best_reward"]}
                )
        if reason is not None:
            stats["ppo/rollback"] = _on_collapse(
                f"pattern collapse at iteration {step}: {reason}", config, state, policy, opt, best_dir, bar.write
            )
        log(stats, step)
        state["history"][step] = stats
        bar.set_postfix(reward=f"{stats['ppo/reward/mean']:.3f}", kl=f"{stats['ppo/kl']:.3f}")
        state["iteration"] = step
        if config.checkpoint_every and (step % config.checkpoint_every == 0 or state["stopped_by"]) and step < total:
            _save(checkpointer, step, policy, value_model, opt, moments, state)
    best = Checkpointer(best_dir).latest()
    if best is not None:
        Checkpointer(best_dir).load_model_weights(best, "policy", policy)
    last = state["history"].get(state["iteration"], {})
    summary = {
        **{k: v for k, v in last.items() if isinstance(v, float)},
        "ppo/iterations": float(state["iteration"]),
        "ppo/best_iteration": float(state["best_iteration"] or state["iteration"]),
        "ppo/best_validation_reward": state["best_reward"] if state["best_iteration"] else float("nan"),
    }
    return PPOResult(
        summary=summary,
        history=state["history"],
        reward_samples=state["reward_samples"],
        stopped_by=state["stopped_by"],
        best_iteration=state["best_iteration"] or state["iteration"],
    )
