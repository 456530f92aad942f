"""Running reward statistics for PPO's reward normalisation (paper Eq. 18), pooled or one stream per prompt kind.

The reward model reads each kind of prompt with its own head (:mod:`rlhf.models.kind_heads`), and the two heads'
scores are not on one scale: on the demo's reward model helpful scores spread 2.4x as wide as harmless ones and
sit ~0.45 higher, on `long`'s 2.4x as wide and ~0.4 lower (docs/results.md, "The two kinds' scores on one scale?").
One running mean and std over both makes a helpful response's normalised reward partly say "this was a helpful
prompt": the critic must learn the kind, and the policy's gradient on harmless prompts is scaled down. Per kind
(``per_kind``), each kind's scores are centred and scaled by their own history, so the rewards PPO mixes are on one
scale (Safe RLHF, Dai et al. 2024, section 3, keeps the two kinds' signals apart for the same reason).
Imports torch only.
"""

from __future__ import annotations

import math

import torch

from rlhf import losses

POOLED = "all"  # the one stream's name when kinds are pooled, or no prompt names its kind


class RunningMoments:
    """Running mean and population std of all values seen so far (Chan et al. parallel update).

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


class RewardMoments:
    """The running statistics PPO normalises the reward-model scores with: one :class:`RunningMoments` per stream.

    ``per_kind=True``: a stream per prompt kind (a row's kind names its stream); ``False``, or rows without kinds:
    one stream, :data:`POOLED`, over every score (the paper's Eq. 18 as written). ``kinds``: every kind the run's
    prompts have (or None), the streams a checkpoint written before the streams starts (:meth:`load_state_dict`).
    """

    def __init__(self, per_kind: bool = True, kinds: list[str] | None = None) -> None:
        self.per_kind = per_kind
        self.kinds = sorted(set(kinds)) if per_kind and kinds else [POOLED]
        self.streams: dict[str, RunningMoments] = {}

    def keys(self, count: int, kinds: list[str] | None) -> list[str]:
        """Each of ``count`` rows' stream: its kind when per kind and kinds are given, else :data:`POOLED`.

        Raises:
            ValueError: ``kinds`` is not one per row.
        """
        if kinds is not None and len(kinds) != count:
            raise ValueError(f"{len(kinds)} kinds for {count} reward scores")
        return list(kinds) if self.per_kind and kinds is not None else [POOLED] * count

    def update(self, scores: torch.Tensor, kinds: list[str] | None = None) -> None:
        """Fold scores ``(N,)`` into their streams (``kinds``: each row's kind, or None); a stream seen for the first
        time starts empty."""
        keys = self.keys(scores.shape[0], kinds)
        for key in dict.fromkeys(keys):
            self.streams.setdefault(key, RunningMoments())
            rows = torch.tensor([k == key for k in keys], device=scores.device)
            self.streams[key].update(scores[rows])

    def normalize(self, scores: torch.Tensor, kinds: list[str] | None, clip: float | None) -> torch.Tensor:
        """Paper Eq. 18 per row with its stream's statistics: ``clip((r - mean_k) / std_k, +-clip)``.

        Args:
            scores: ``(N,)`` float reward-model scores.
            kinds: each row's kind, or None.
            clip: delta, or None for no clipping.

        Returns:
            ``(N,)`` in the scores' dtype.

        Raises:
            RuntimeError: a row's stream has no statistics yet.
            ValueError: ``kinds`` is not one per row.
        """
        keys = self.keys(scores.shape[0], kinds)
        normalized = torch.empty_like(scores)
        for key in dict.fromkeys(keys):
            stream = self.streams.get(key, RunningMoments())
            rows = torch.tensor([k == key for k in keys], device=scores.device)
            normalized[rows] = stream.normalize(scores[rows], clip)
        return normalized

    def stats(self) -> dict[str, float]:
        """Each stream's running mean and std: ``ppo/reward/running/<stream>/{mean,std}``."""
        return {
            f"ppo/reward/running/{key}/{name}": value
            for key, stream in sorted(self.streams.items())
            for name, value in (("mean", stream.mean), ("std", stream.std))
        }

    def state_dict(self) -> dict[str, dict[str, float]]:
        """For checkpoints: ``{stream: RunningMoments.state_dict()}``."""
        return {key: stream.state_dict() for key, stream in self.streams.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`, or a checkpoint written before the streams (one ``RunningMoments`` state:
        ``count``, ``mean``, ``m2``), whose statistics then start every stream of :attr:`kinds`, as they normalised
        every score (so the streams are in the next checkpoint, whichever kinds appear before it)."""
        self.streams = {}
        if "count" in state:
            state = {key: state for key in self.kinds}
        for key, saved in state.items():
            self.streams[key] = RunningMoments()
            self.streams[key].load_state_dict(saved)
