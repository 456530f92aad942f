"""The PPO settings: one typed config of every PPO / PPO-max switch (params.yaml section ``ppo``).

How responses are sampled and how an unfinished one is scored is not here: that
is :class:`rlhf.models.generation.GenerationSettings` (params.yaml section ``generation``),
shared with the evaluation so the two can never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf.ranges import check_ranges, check_schedule


def max_skewness(n: int) -> float:
    """The largest absolute sample skewness ``n`` values can have: ``(n - 2) / sqrt(n - 1)``.

    Reached by ``n - 1`` equal values and one outlier. A skew threshold at or
    above it can never fire.

    Args:
        n: number of values (>= 2).

    Returns:
        The bound (0.0 for ``n <= 2``).
    """
    return (n - 2) / math.sqrt(n - 1) if n > 2 else 0.0


@dataclass
class PPOConfig:
    """PPO hyperparameters and PPO-max switches (params.yaml section ``ppo``).

    The defaults are params.yaml's: its ``ppo`` section with the ``ppo_max`` preset (``tests/test_defaults.py``
    keeps them equal; ``vanilla`` and the profiles are params.yaml's alone). Settings that no run could use, or a
    collapse threshold out of mathematical reach at the configured sizes, are refused when the config is built.
    Three settings are read only with another, and are refused without it: ``validation_prompts`` (set exactly
    when ``validate_every`` > 0), ``kl_target`` and ``kl_horizon`` (set exactly when ``adaptive_kl``).
    """

    value_init: str = "reward"  # reward | sft: where the value model starts (paper section 5.3.3)
    iterations: int = 3  # policy iterations (after critic pre-training)
    rollout_batch_size: int = 8  # prompts per iteration, all processes together: the experience buffer (paper 5.4)
    minibatch_size: int = 4  # rollouts per optimiser step, all processes together
    micro_batch_size: int | None = None  # at most this many rollouts (or ptx rows) per forward/backward pass (None: a
    # process's whole share)
    ppo_epochs: int = 2  # passes over each rollout buffer
    policy_lr: float = 1e-5
    value_lr: float = 3e-5
    scheduler: str = "constant"  # a transformers schedule, stepped once per optimiser step
    warmup_steps: int = 0  # optimiser steps
    max_prompt_length: int = 128  # tokens: a longer prompt keeps its last turns (cut from the left)
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2
    # token-level KL penalty (tutorial Eq. 11) and optional adaptive controller (Ziegler et al. 2019)
    kl_coef: float = 0.05
    adaptive_kl: bool = False
    kl_target: float | None = None  # nats per response (adaptive_kl only)
    kl_horizon: int | None = None  # samples (adaptive_kl only); Ziegler's 10,000 at batch 512 moves beta by up to 1%
    # a step, as 160 at batch 8
    # reward normalisation and clipping by running statistics (paper Eq. 18): per_kind (a mean and std per prompt
    # kind: the reward model's kind heads score on their own scales, rlhf.ppo.moments) | pooled (one over all
    # scores, the paper's) | None (neither)
    reward_normalize: str | None = "per_kind"
    reward_clip: float | None = 5.0
    # where the advantage comes from: gae (paper Eq. 9, against the value model: PPO-max) | rloo | grpo (the
    # returns of k samples of one prompt compared with each other, no value model: rlhf.losses.rloo_advantages,
    # grpo_advantages); the PPO-clip loss and every other switch are the same for all three
    advantage_estimator: str = "gae"
    samples_per_prompt: int = 1  # k responses sampled for each rollout prompt (rloo and grpo: at least 2);
    # rollout_batch_size counts responses, so a rollout holds rollout_batch_size / k prompts
    # advantage normalisation / clipping (off in PPO-max: appendix B.1)
    advantage_normalize: bool = False
    advantage_clip: float | None = None
    # value-loss clipping (paper section 5.3; None disables)
    value_clip: float | None = 0.2
    # critic pre-training (paper 5.3.3): value-only iterations until the explained variance on a fresh
    # rollout reaches the threshold, at most value_pretrain_iterations of them (0: none)
    value_pretrain_iterations: int = 1
    value_pretrain_explained_variance: float = 0.5  # ...until a fresh rollout's explained variance reaches this
    # global gradient-norm clipping, policy and value separately (None disables)
    max_grad_norm: float | None = 1.0
    # PPO-ptx (tutorial Eq. 14): LM loss on pretraining-style text
    ptx_coef: float = 0.5
    ptx_batch_size: int = 2
    ptx_max_length: int = 128
    entropy_coef: float = 0.0
    # monitoring
    histogram_every: int = 5  # policy iterations between reward histograms (reports/ppo)
    # pattern-collapse guard (paper section 5.2), checked on each rollout before the update; None disables a check
    collapse_window: int = 4  # iterations of rollouts the skew and truncation checks pool
    collapse_kl_max: float | None = 20.0
    collapse_length_ratio: float | None = 3.0  # mean length falls below first / ratio
    collapse_perplexity_ratio: float | None = 3.0  # perplexity moves above first * ratio or below first / ratio
    collapse_reward_skew: float | None = 3.0  # |skew| of the raw scores over the window
    collapse_truncated_share: float | None = 0.9  # share of the window's responses cut at max_new_tokens
    on_collapse: str = "stop"  # stop | rollback (to the best policy, fresh policy optimiser) | warn
    max_rollbacks: int = 2  # after this many rollbacks a further collapse stops the run
    validate_every: int = 4  # policy iterations between validations (the SFT policy first, the last always); 0: none
    validation_prompts: int | None = 8  # held-out prompts (validate_every > 0 only)
    keep_every: int = 2  # policy iterations between kept policies (and the last; 0: none), their trained weights
    # in models/policy_kept: evaluate's over-optimisation curve
    checkpoint_every: int = 4  # iterations between resume checkpoints (policy, value model, optimisers; 0: never)
    trainable_layers: int | None = 8  # train only the top N blocks of policy and value model (CPU budget); None: all
    # LoRA policy (rlhf.models.lora): adapters of this rank on every linear layer of the policy's blocks, whose
    # reference is
    # the same weights with the adapters disabled (one copy of the weights fewer); 0: the whole policy trains
    lora_rank: int = 0
    lora_alpha: float = 16.0
    seed: int = 0  # rollout sampling, minibatch order and the value head of a value model initialised from SFT

    def __post_init__(self) -> None:
        """Reject settings no run could use, before any model is loaded.

        Raises:
            ValueError: an unknown choice, a count, rate, coefficient or clip outside its domain
                (:func:`rlhf.ranges.check_ranges`: e.g. ``iterations`` below 1, ``kl_coef`` or ``clip`` negative,
                ``gamma`` or ``lam`` outside [0, 1]), warm-up with a schedule
                that has none, LoRA together with ``trainable_layers``, an inert adaptive-KL horizon, a collapse
                threshold that cannot fire at these sizes (names the key), or a setting read only with another
                switch set without it, or missing with it (names both keys and both values).
        """
        _check_read_with(self)
        if self.on_collapse not in ("stop", "rollback", "warn"):
            raise ValueError(f"ppo.on_collapse must be stop, rollback or warn, got {self.on_collapse!r}")
        _check_estimator(self)
        if self.reward_normalize not in ("per_kind", "pooled", None):
            raise ValueError(f"ppo.reward_normalize must be per_kind, pooled or null, got {self.reward_normalize!r}")
        if self.value_init not in ("reward", "sft"):
            raise ValueError(f"ppo.value_init must be reward or sft, got {self.value_init!r}")
        check_ranges(
            "ppo",
            self,
            at_least_1=(
                "iterations",
                "rollout_batch_size",
                "minibatch_size",
                "micro_batch_size",
                "ppo_epochs",
                "samples_per_prompt",
                "max_prompt_length",
                "kl_horizon",
                "ptx_batch_size",
                "ptx_max_length",
                "collapse_window",
            ),
            positive=(
                "policy_lr",
                "value_lr",
                "clip",
                "kl_target",
                "reward_clip",
                "advantage_clip",
                "value_clip",
                "max_grad_norm",
                "lora_alpha",
                "collapse_kl_max",
            ),
            non_negative=(
                "warmup_steps",
                "kl_coef",
                "value_pretrain_iterations",
                "ptx_coef",
                "entropy_coef",
                "histogram_every",
                "max_rollbacks",
                "validate_every",
                "keep_every",
                "checkpoint_every",
                "trainable_layers",
                "lora_rank",
            ),
            unit=("gamma", "lam"),
        )
        check_schedule("ppo", self.scheduler, self.warmup_steps)
        if self.adaptive_kl and 0.2 * self.rollout_batch_size / self.kl_horizon < 0.001:
            raise ValueError(
                f"ppo.kl_horizon {self.kl_horizon} makes the adaptive KL controller inert at rollout_batch_size "
                f"{self.rollout_batch_size} (beta moves at most {0.2 * self.rollout_batch_size / self.kl_horizon:.4%} "
                "per iteration): the horizon counts samples, e.g. 160 for 8 per iteration"
            )
        window = self.collapse_window * self.rollout_batch_size
        if self.collapse_reward_skew is not None and self.collapse_reward_skew >= max_skewness(window):
            raise ValueError(
                f"ppo.collapse_reward_skew {self.collapse_reward_skew} can never fire: the skewness of "
                f"{window} scores (collapse_window x rollout_batch_size) is at most {max_skewness(window):.2f}"
            )
        if self.collapse_truncated_share is not None and not 0 < self.collapse_truncated_share < 1:
            raise ValueError(f"ppo.collapse_truncated_share must be in (0, 1), got {self.collapse_truncated_share}")
        if self.value_pretrain_explained_variance > 1:
            raise ValueError(
                f"ppo.value_pretrain_explained_variance {self.value_pretrain_explained_variance} is out of reach "
                "(explained variance is at most 1)"
            )
        if self.lora_rank and self.trainable_layers is not None:
            raise ValueError(
                "ppo.lora_rank and ppo.trainable_layers both choose what the policy trains: with lora_rank "
                f"{self.lora_rank} set trainable_layers to null (the value model then trains every block)"
            )
        for name in ("collapse_length_ratio", "collapse_perplexity_ratio"):
            if getattr(self, name) is not None and getattr(self, name) <= 1:
                raise ValueError(f"ppo.{name} must be above 1 (a factor of change), got {getattr(self, name)}")

    @property
    def uses_critic(self) -> bool:
        """Whether there is a value model: only GAE reads one (``rloo`` and ``grpo`` need none)."""
        return self.advantage_estimator == "gae"

    def steps_per_iteration(self) -> int:
        """Optimiser steps per PPO iteration: ``ppo_epochs x ceil(rollout_batch_size / minibatch_size)``."""
        return self.ppo_epochs * -(-self.rollout_batch_size // self.minibatch_size)


def _check_estimator(config: PPOConfig) -> None:
    """Refuse an advantage estimator its other settings cannot serve.

    Raises:
        ValueError: an unknown estimator; ``rollout_batch_size`` not a multiple of ``samples_per_prompt``;
            ``rloo`` or ``grpo`` with fewer than 2 samples a prompt, or with a setting only a value model reads
            (``value_pretrain_iterations`` above 0, ``value_clip`` set): each names the keys and their values.
    """
    estimator, k = config.advantage_estimator, config.samples_per_prompt
    if estimator not in ("gae", "rloo", "grpo"):
        raise ValueError(f"ppo.advantage_estimator must be gae, rloo or grpo, got {estimator!r}")
    if k >= 1 and config.rollout_batch_size % k:
        raise ValueError(
            f"ppo.rollout_batch_size {config.rollout_batch_size} counts responses: it must be a multiple of "
            f"ppo.samples_per_prompt {k}"
        )
    if config.uses_critic:
        return
    if k < 2:
        raise ValueError(
            f"ppo.advantage_estimator {estimator} compares the samples of one prompt: set ppo.samples_per_prompt "
            f"to 2 or more (got {k})"
        )
    for name, unread in (("value_pretrain_iterations", 0), ("value_clip", None)):
        if getattr(config, name) != unread:
            raise ValueError(
                f"ppo.{name} is {getattr(config, name)}, but ppo.advantage_estimator {estimator} has no value "
                f"model to read it: set {name}: {'null' if unread is None else unread}, or use gae"
            )


def _check_read_with(config: PPOConfig) -> None:
    """Refuse a setting its switch would ignore, and a switch without the settings it reads.

    Raises:
        ValueError: ``validation_prompts`` set with ``validate_every`` 0, or missing with it above 0;
            ``kl_target`` or ``kl_horizon`` set without ``adaptive_kl``, or missing with it.
    """
    on = {"validation_prompts": config.validate_every > 0, "kl_target": config.adaptive_kl}
    on["kl_horizon"] = on["kl_target"]
    switch = {"validation_prompts": "validate_every", "kl_target": "adaptive_kl", "kl_horizon": "adaptive_kl"}
    for name, read in on.items():
        value, by = getattr(config, name), switch[name]
        if read and not value:
            raise ValueError(f"ppo.{by} is {getattr(config, by)}, which reads ppo.{name}: set it (got {value})")
        if not read and value is not None:
            raise ValueError(
                f"ppo.{name} is {value}, but ppo.{by} is {getattr(config, by)}, which does not read it: set "
                f"{name}: null, or turn {by} on"
            )


def check_processes(config: PPOConfig, validation_prompts: int | None, processes: int, sharded: bool) -> None:
    """Refuse what a launch on ``processes`` processes cannot run (checked before launching and by each rank).

    Every process generates for its share of the prompts, and under FSDP (``sharded``) its gathers are collective.

    Raises:
        ValueError: ``ppo.rollout_batch_size`` or the validation prompts (0 or None: no validation) below
            ``processes`` (above 1); ``ppo.lora_rank`` under FSDP (not implemented).
    """
    for name, value in (("rollout_batch_size", config.rollout_batch_size), ("validation_prompts", validation_prompts)):
        if processes > 1 and value and value < processes:
            raise ValueError(f"ppo.{name} is {value}: each of the {processes} training processes needs one at least")
    if sharded and config.lora_rank:
        raise ValueError("ppo.lora_rank with FSDP is not implemented: use data parallel (infra/accelerate/ddp.yaml)")
