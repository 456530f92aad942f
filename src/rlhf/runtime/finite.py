"""Divergence: stop training at the first non-finite loss or gradient norm, refuse non-finite weights.

Steps that a mixed-precision loss scaler skips on purpose are counted, not fatal.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def clip_gradients(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global gradient-norm clipping (paper appendix C.2); returns the norm before clipping, a 0-dim tensor.

    ``max_norm=None`` measures the norm without clipping. No host round trip: the
    norm stays on the model's device until the step's figures are gathered.
    """
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (torch.distributed.tensor: ~1 s to import, sharded only)

    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # a sharded model's: over every shard


ScalerStep = Callable[[torch.optim.Optimizer], bool]


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss, gradient norm, rollout or weights; its message is one line naming where.

    ``metrics`` holds what the failing step measured, the non-finite value
    included, so a trainer can log it before the error leaves (a diverged run
    then shows its NaN or inf in the tracking UI instead of a gap).
    """

    def __init__(self, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.metrics = dict(metrics or {})


class FiniteGuard:
    """Stops a trainer at the first non-finite loss or gradient norm; counts the steps a loss scaler skips.

    A mixed-precision loss scaler (fp16 on GPUs: ``torch.amp.GradScaler``,
    accelerate) overflows the scaled gradients on purpose now and then, skips
    that optimiser step and lowers its scale; such steps are counted in
    ``skipped`` and are not fatal. ``scaler_step`` is where a scaler plugs in:
    it takes the optimiser step through the scaler and returns True when the
    scaler skipped it, e.g. with accelerate
    ``lambda opt: (opt.step(), accelerator.optimizer_step_was_skipped)[1]``.
    Without it (no scaler: the pipeline today) a non-finite gradient norm stops
    the run before the optimiser step, so the weights stay as the last finite
    step left them. A non-finite loss always stops the run: a scale multiplies
    gradients, never the loss, so the next step would be no better.

    Args:
        stage: named first in every message, e.g. ``"sft"`` or ``"ppo"``.
        scaler_step: see above; None: no loss scaler.
    """

    def __init__(self, stage: str, scaler_step: ScalerStep | None = None):
        self.stage = stage
        self.scaler_step = scaler_step
        self.skipped = 0

    def stop(self, key: str, value: float, where: str) -> NonFiniteError:
        """The error for a non-finite ``key`` (a metric name) of ``value`` at ``where`` (e.g. ``"step 3 of 4"``)."""
        return NonFiniteError(f"{self.stage}: non-finite {key} ({value}) at {where}; training stopped", {key: value})

    def check_loss(self, key: str, value: float, where: str) -> None:
        """Raise :class:`NonFiniteError` when the loss ``value`` (logged as ``key``) is NaN or infinite."""
        if not math.isfinite(value):
            raise self.stop(key, value, where)

    def clip(self, model: torch.nn.Module, max_grad_norm: float | None) -> torch.Tensor:
        """Clip the gradients of ``model`` (:func:`clip_gradients`); returns the norm before clipping."""
        return clip_gradients(model, max_grad_norm)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        grad_norm: float,
        key: str,
        where: str,
    ) -> None:
        """Take the optimiser and schedule step after :meth:`clip`, unless the gradient norm says stop.

        A step the scaler skipped is counted and the schedule does not step (the
        optimiser step did not happen; as accelerate's scheduler wrapper does).

        Args:
            grad_norm: the norm :meth:`clip` returned, on the host (logged as ``key``).

        Raises:
            NonFiniteError: a non-finite gradient norm that no scaler skipped.
        """
        if self.scaler_step is None:
            if not math.isfinite(grad_norm):
                raise self.stop(key, grad_norm, where)
            optimizer.step()
        elif self.scaler_step(optimizer):
            self.skipped += 1
            return
        elif not math.isfinite(grad_norm):
            raise self.stop(key, grad_norm, where)
        schedule.step()


def to_host(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """The figures of one optimiser step as floats, in one host round trip (one device sync).

    Args:
        values: 0-dim tensors (any device, any float dtype) or floats.

    Returns:
        The same keys, as Python floats (NaN and inf kept).
    """
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    stacked = torch.stack([v.detach().float().reshape(()) for v in tensors.values()]).tolist() if tensors else []
    host = dict(zip(tensors, stacked, strict=True))
    return {k: host[k] if k in host else float(v) for k, v in values.items()}


def non_finite_weights(model: torch.nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of ``model`` that hold a NaN or an infinity.

    For a sharded model (:mod:`rlhf.runtime.sharding`) each process checks its shards and the answers are combined
    (collective: every process calls it).
    """
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (torch.distributed.tensor: ~1 s to import, sharded only)

    tensors = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
    if not tensors:
        return []
    finite = torch.stack([torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all() for _, t in tensors])
    if any(isinstance(t, DTensor) for _, t in tensors):
        finite = finite.int()
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)  # one bad shard: a bad tensor
    return [name for (name, _), ok in zip(tensors, finite.tolist(), strict=True) if not ok]  # one host round trip


def check_finite_weights(model: torch.nn.Module, stage: str, where: str) -> None:
    """Raise :class:`NonFiniteError` when a weight of ``model`` is NaN or infinite (before it is saved).

    Every loss and gradient norm can be finite while an update overflows the
    weights (an infinite learning rate, say): the last line of defence before a
    model is written.
    """
    bad = non_finite_weights(model)
    if bad:
        raise NonFiniteError(
            f"{stage}: non-finite weights {where} ({len(bad)} tensors, first {bad[0]}); training stopped"
        )


def check_finite_rollout(experience, stats: dict[str, float], iteration: int, ranks) -> None:
    """Stop at a rollout whose scores, or logprobs, values, advantages or returns on response tokens, are not finite
    (counted over every rank's rollouts, so all ranks stop together).

    Args:
        experience: a :class:`rlhf.ppo.rollout.Experience` (``raw_scores`` ``(B,)``; ``logprobs``, ``values``,
            ``advantages``, ``returns`` ``(B, T)`` float, read where ``mask`` ``(B, T)`` bool is set).
        stats: the rollout's figures (the error carries them); iteration: 1-based, for the message.
        ranks: a :class:`rlhf.runtime.distributed.Ranks` (the counts are summed over processes).

    Raises:
        NonFiniteError: names the iteration and the tensors (its metrics: the rollout's stats).
    """
    mask = experience.mask
    tensors = {
        "raw_scores": experience.raw_scores,
        **{name: getattr(experience, name)[mask] for name in ("logprobs", "values", "advantages", "returns")},
    }
    counts = ranks.sum(
        torch.stack(
            [torch.stack([(~torch.isfinite(t)).sum(), t.new_tensor(t.numel()).long()]) for t in tensors.values()]
        )
    )
    found = zip(tensors, counts.tolist(), strict=True)
    bad = [f"{name} ({count} of {total} non-finite)" for name, (count, total) in found if count]
    if bad:
        raise NonFiniteError(
            f"ppo: non-finite rollout at iteration {iteration}: {', '.join(bad)}; training stopped", stats
        )
