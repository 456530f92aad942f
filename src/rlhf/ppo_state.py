"""What the PPO loop carries from one iteration to the next (:class:`PPOState`), saved whole in every resume
checkpoint, and the best policy so far (:class:`Best`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


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
    before; :func:`rlhf.rollout.calibrate_value_head`);
    ``baseline`` the starting policy's mean response length and perplexity over its rollouts (the collapse
    guard's reference, :func:`rlhf.guard.pooled_baseline`);
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
