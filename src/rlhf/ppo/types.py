"""PPO's types, below every other PPO module: the four models (:class:`PPOModels`), what the loop carries from
one iteration to the next (:class:`PPOState`, saved whole in every resume checkpoint), the best policy so far
(:class:`Best`) and what a run leaves (:class:`PPOResult`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedModel


@dataclass
class Best:
    """The best policy so far: the rollout step it was kept at, its validation reward and figures."""

    iteration: int = 0
    reward: float = -math.inf
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class PPOState:
    """The PPO loop's counters and signals; a resumed run continues from exactly these.

    ``iteration`` counts rollouts (critic pre-training included), ``policy_iterations`` policy updates;
    ``value_calibration`` is the value head's affine map fitted on the first rollout (``[scale, bias]``, None
    before; :func:`rlhf.ppo.rollout.calibrate_value_head`);
    ``baseline`` the starting policy's mean response length and perplexity over its rollouts (the collapse
    guard's reference, :func:`rlhf.ppo.guard.pooled_baseline`);
    ``window`` the last ``collapse_window`` rollouts' scores and truncation flags; ``history`` and
    ``reward_samples`` the per-rollout figures and score samples by step; ``stopped_by`` the collapse line that
    stopped the run; ``skipped_steps`` the optimiser steps a loss scaler skipped (policy, value).
    """

    kl_coef: float
    pretraining: bool
    iteration: int = 0
    policy_iterations: int = 0
    value_calibration: list[float] | None = None
    baseline: dict[str, float] = field(default_factory=dict)
    window: list[dict[str, list[float]]] = field(default_factory=list)
    best: Best = field(default_factory=Best)
    reward_samples: dict[int, list[float]] = field(default_factory=dict)
    stopped_by: str | None = None
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    rollbacks: int = 0
    skipped_steps: list[int] = field(default_factory=lambda: [0, 0])

    def to_checkpoint(self) -> dict[str, Any]:
        """Plain containers only: a checkpoint loads with ``torch.load(weights_only=True)``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any]) -> PPOState:
        """The state :meth:`to_checkpoint` wrote."""
        return cls(**{**saved, "best": Best(**saved["best"])})


@dataclass
class PPOResult:
    """What :func:`train_ppo` leaves: summary, per-iteration metrics, reward samples, why it stopped."""

    summary: dict[str, float]
    history: dict[int, dict[str, float]]
    reward_samples: dict[int, list[float]]
    stopped_by: str | None
    best_iteration: int
    # the folder of the kept policies (``iteration-NNNN``, :func:`rlhf.training.checkpoint.save_kept_policy`), if any
    kept: str | None = None


@dataclass
class PPOModels:
    """The four models of PPO: policy and value model (trained), reference and reward model (frozen).

    ``value_model`` is None where the advantage needs no critic (``ppo.advantage_estimator`` rloo or grpo).
    """

    policy: PreTrainedModel
    reference: PreTrainedModel
    reward_model: PreTrainedModel
    value_model: PreTrainedModel | None

    def as_tuple(self) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedModel, PreTrainedModel | None]:
        """``(policy, reference, reward_model, value_model)``."""
        return self.policy, self.reference, self.reward_model, self.value_model

    def trained(self) -> list[PreTrainedModel]:
        """The models PPO trains: the policy, and the value model where there is one."""
        return [self.policy] + ([self.value_model] if self.value_model is not None else [])
