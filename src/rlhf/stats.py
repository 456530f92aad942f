"""The product's one binomial interval and its one tie rule.

Every rate the pipeline reports from paired comparisons (reward-model accuracy
on held-out pairs, the policy's win rate over the SFT model, the gate's
decisions) goes through :func:`paired_rate`, so all of them count ties the same
way and carry the same interval:

- Tie rule: a pair whose two scores are exactly equal is *not decisive*. It
  is left out of ``n`` (neither a success nor a failure, not one half) and
  reported apart as ``ties``; when any occur a :class:`TiesWarning` is issued
  (``warnings.warn``), and the count is always in the result, so callers that
  silence warnings still see it. A constant scorer therefore has ``n = 0``,
  ``ties = N`` and an undefined (NaN) rate, never 0.0 or 0.5.
- Interval: the Wilson score interval (Wilson, 1927; Brown, Cai & DasGupta,
  2001, "Interval Estimation for a Binomial Proportion", Eq. 4), 95% by
  default (``z = 1.959964``), computed by :func:`wilson_interval`. When several
  comparisons share a prompt (:func:`clustered_rate`), the interval counts
  prompts, never comparisons: a bootstrap over prompts, floored by the Wilson
  interval over the prompts with a decisive comparison.

Imports nothing but the standard library (scores may be torch tensors, NumPy
arrays or anything that compares elementwise and has ``.sum()``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

Z95 = 1.959964  # two-sided 95% standard-normal quantile


class TiesWarning(UserWarning):
    """Some compared pairs scored exactly equal; they were left out of the rate (see :func:`paired_rate`)."""


@dataclass(frozen=True)
class PairedRate:
    """A rate over decisive paired comparisons with its Wilson interval.

    Attributes:
        rate: ``wins / n``; NaN when ``n == 0``.
        low, high: Wilson score interval bounds in [0, 1]; NaN when ``n == 0``.
        wins: pairs where the first score is strictly greater.
        n: decisive pairs (``wins + losses``; ties excluded).
        ties: pairs with exactly equal scores (not in ``n``).
    """

    rate: float
    low: float
    high: float
    wins: int
    n: int
    ties: int

    @property
    def pairs(self) -> int:
        """All pairs compared: ``n + ties``."""
        return self.n + self.ties

    def includes(self, value: float) -> bool:
        """True when ``value`` lies in ``[low, high]``, or when the rate is undefined (``n == 0``)."""
        return self.n == 0 or self.low <= value <= self.high


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion.

    ``center = (p + z^2 / 2n) / (1 + z^2 / n)``,
    ``half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)``, with
    ``p = successes / n`` (Brown, Cai & DasGupta 2001, Eq. 4). Unlike the Wald
    interval it stays inside [0, 1] and is not empty at ``p = 0`` or ``p = 1``.

    The formula reads ``successes`` only through ``p``, so it may be real-valued: an effective count such as
    ``rate * prompts`` in :func:`clustered_rate`, where a prompt with several comparisons counts once, by its
    share of wins.

    Args:
        successes: number of successes, ``0 <= successes <= n`` (an int, or a float for an effective count).
        n: number of trials, ``>= 0``.
        z: standard-normal quantile (``Z95`` for a two-sided 95% interval).

    Returns:
        ``(low, high)`` in [0, 1]; ``(nan, nan)`` when ``n == 0``.

    Raises:
        ValueError: ``n < 0`` or ``successes`` outside ``[0, n]``.
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return float("nan"), float("nan")
    p = successes / n
    z2 = z * z
    denominator = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def paired_rate(first: Any, second: Any, z: float = Z95, what: str = "pairs") -> PairedRate:
    """The share of pairs where ``first`` beats ``second``, by the product's tie rule, with its Wilson interval.

    A pair is a win when ``first > second``, a loss when ``first < second``
    and a tie (not decisive: out of ``n``, counted in ``ties``) when they are
    exactly equal. Any tie issues a :class:`TiesWarning`.

    Args:
        first, second: ``(N,)`` float scores paired by index (torch tensors or
            NumPy arrays), e.g. chosen and rejected scores, or policy and SFT
            scores of the same prompt.
        z: standard-normal quantile of the interval (default 95%).
        what: what the pairs are, for the warning's text.

    Returns:
        :class:`PairedRate` (``rate``, ``low``, ``high`` NaN when every pair ties or ``N == 0``).

    Raises:
        ValueError: the shapes differ, or a score is NaN (a NaN pair is neither won, lost nor tied).
    """
    if tuple(first.shape) != tuple(second.shape) or len(first.shape) != 1:
        raise ValueError(f"paired_rate needs two (N,) score arrays, got {tuple(first.shape)} and {tuple(second.shape)}")
    wins, losses = int((first > second).sum()), int((first < second).sum())
    ties = int((first == second).sum())
    if wins + losses + ties != first.shape[0]:
        raise ValueError(f"{first.shape[0] - wins - losses - ties} of {first.shape[0]} {what} have a NaN score")
    n = wins + losses
    if ties:
        warnings.warn(
            f"{ties} of {n + ties} {what} tied (equal scores); left out of the rate (n={n})", TiesWarning, stacklevel=2
        )
    low, high = wilson_interval(wins, n, z)
    return PairedRate(rate=wins / n if n else float("nan"), low=low, high=high, wins=wins, n=n, ties=ties)


def paired_rates_interval(first: Any, second: Any, z: float = Z95) -> tuple[float, float]:
    """A 95% interval of ``mean(first) - mean(second)``, two rates measured on the same prompts.

    Newcombe's hybrid score interval for paired proportions (Newcombe 1998, "Improved confidence intervals for
    the difference between binomial proportions based on paired data", Statistics in Medicine 17, method 10):
    with ``p1, p2`` the two rates, ``[l1, u1]`` and ``[l2, u2]`` their Wilson intervals (:func:`wilson_interval`)
    and ``phi`` the correlation of the pairs,
    ``low = p1 - p2 - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)`` and
    ``high = p1 - p2 + sqrt((p2 - l2)^2 - 2 phi (p2 - l2)(u1 - p1) + (u1 - p1)^2)``. For 0/1 outcomes ``phi`` is
    the 2x2 table's ``(ad - bc) / sqrt((a+b)(c+d)(a+c)(b+d))``, which is the Pearson correlation of the two
    outcome vectors; here it is that correlation of the per-prompt rates, so a prompt with K samples counts once,
    by its share (the effective count of :func:`clustered_rate`'s floor). ``phi`` is 0 where a rate does not vary.
    Unlike a percentile bootstrap it does not collapse when nothing happened: 0 refusals of 16 by both gives
    ``[-0.194, 0.194]``, not ``[0, 0]``.

    Args:
        first, second: ``(P,)`` per-prompt rates in [0, 1] (e.g. each prompt's share of refused responses),
            paired by prompt; anything iterable of numbers.
        z: standard-normal quantile (``Z95``).

    Returns:
        ``(low, high)`` within [-1, 1]; ``(nan, nan)`` for no prompts.

    Raises:
        ValueError: the lengths differ or a rate is outside [0, 1] (or NaN).
    """
    x, y = [float(v) for v in first], [float(v) for v in second]
    if len(x) != len(y) or not all(0.0 <= v <= 1.0 for v in x + y):
        raise ValueError(f"paired_rates_interval needs two equal-length lists of rates in [0, 1], got {x} and {y}")
    n = len(x)
    if n == 0:
        return float("nan"), float("nan")
    p1, p2 = sum(x) / n, sum(y) / n
    (l1, u1), (l2, u2) = wilson_interval(min(p1 * n, n), n, z), wilson_interval(min(p2 * n, n), n, z)
    spread = math.sqrt(sum((v - p1) ** 2 for v in x) * sum((v - p2) ** 2 for v in y))
    phi = sum((a - p1) * (b - p2) for a, b in zip(x, y, strict=True)) / spread if spread > 0 else 0.0
    low = p1 - p2 - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    high = p1 - p2 + math.sqrt(max((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0.0))
    return max(low, -1.0), min(high, 1.0)


def chance_warning(name: str, rate: float | None, low: float | None, high: float | None, chance: float = 0.5) -> str:
    """The loud line for a rate whose interval includes chance (or lies below it), or ``""`` when it is above.

    Args:
        name: what the rate is, e.g. ``"rm_eval accuracy"``.
        rate, low, high: the rate and its interval (None or NaN when undefined,
            as read back from a metrics file where NaN is written as null).
        chance: the rate of a model that has learned nothing (0.5 for pairs).

    Returns:
        ``"rm_eval accuracy 0.53 [0.46, 0.60] includes chance (0.5)"``,
        ``"rm_eval accuracy 0.20 [0.10, 0.30] is below chance (0.5)"`` (it ranks
        backwards), ``"rm_eval accuracy is undefined (...)"``; ``""`` when the
        interval lies wholly above chance.
    """
    if any(v is None or not math.isfinite(v) for v in (rate, low, high)):
        return (
            f"{name} is undefined (no decisive pairs, or for a balanced accuracy none with the chosen response "
            f"shorter or none with it longer), so it cannot be told from chance ({chance})"
        )
    if low <= chance <= high:
        return f"{name} {rate:.2f} [{low:.2f}, {high:.2f}] includes chance ({chance})"
    if high < chance:
        return f"{name} {rate:.2f} [{low:.2f}, {high:.2f}] is below chance ({chance})"
    return ""


def clustered_rate(first: Any, second: Any, resamples: int = 2000, seed: int = 0, what: str = "prompts") -> PairedRate:
    """The win rate of ``first`` over ``second`` when several comparisons share a prompt, with a 95% interval.

    Comparisons of one prompt are correlated (the same question is easy or hard for both models), so every
    interval here counts prompts, never comparisons. The interval comes from a bootstrap over prompts (Efron &
    Tibshirani 1993, ch. 13, percentile method, resampling whole rows of ``first``/``second``;
    ``scipy.stats.bootstrap``): each resample draws P prompts with replacement and computes
    ``sum(wins) / sum(decisive)`` over their comparisons. Ties follow the product's rule (:func:`paired_rate`:
    out of the rate and of ``n``, counted in ``ties``, a :class:`TiesWarning`). A percentile bootstrap is too
    narrow with few prompts (5 prompts all won resample to [1, 1]), so the interval reported is the wider of it
    and a Wilson floor over prompts: :func:`wilson_interval` of ``rate * m`` successes in ``m`` trials, ``m``
    the prompts with at least one decisive comparison (6 prompts x 2 samples all won: Wilson of 6 of 6,
    [0.610, 1], not of 12 of 12). Neither bound is ever more optimistic than that floor.

    Args:
        first, second: ``(P, K)`` float scores (torch tensors or NumPy arrays): K comparisons on each of P prompts.
        resamples: bootstrap resamples.
        seed: of the resampling (the interval is reproducible).
        what: what a row is, for the tie warning.

    Returns:
        :class:`PairedRate` whose counts are comparisons: ``wins``, ``n`` decisive and ``ties`` over all
        ``P * K``; ``rate = wins / n``; ``low``, ``high`` the interval over prompts above (the Wilson floor alone
        when ``P < 2`` or every prompt is alike); all three NaN when no comparison is decisive.

    Raises:
        ValueError: the shapes differ or are not 2-D, or a score is NaN.
    """
    import numpy as np  # noqa: PLC0415 (numpy: only this path needs it)
    from scipy.stats import bootstrap  # noqa: PLC0415 (scipy: only the bootstrap needs it)

    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"clustered_rate needs two (P, K) score arrays, got {a.shape} and {b.shape}")
    flat = paired_rate(a.reshape(-1), b.reshape(-1), what=f"comparisons over {a.shape[0]} {what}")
    if flat.n == 0:
        return flat
    wins, decisive = (a > b).sum(axis=1).astype(float), (a != b).sum(axis=1).astype(float)
    prompts = int((decisive > 0).sum())  # the floor's trials: prompts with a decisive comparison
    floor_low, floor_high = wilson_interval(min(flat.rate * prompts, prompts), prompts)
    low, high = floor_low, floor_high
    if a.shape[0] >= 2 and not (np.all(wins == wins[0]) and np.all(decisive == decisive[0])):  # else degenerate
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a resample without a decisive comparison is NaN
            result = bootstrap(
                (wins, decisive),
                lambda w, d, axis=-1: np.sum(w, axis=axis) / np.sum(d, axis=axis),
                paired=True,
                vectorized=True,
                n_resamples=resamples,
                method="percentile",
                rng=np.random.default_rng(seed),
            )
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
        if not (math.isfinite(low) and math.isfinite(high)):  # NaN resamples: percentiles over the finite ones
            values = result.bootstrap_distribution[np.isfinite(result.bootstrap_distribution)]
            low, high = float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))
        low, high = min(low, floor_low), max(high, floor_high)
    return PairedRate(rate=flat.rate, low=low, high=high, wins=flat.wins, n=flat.n, ties=flat.ties)


def linear_trend(steps: list[float], values: list[float]) -> tuple[float, float, float]:
    """The least-squares slope of ``values`` over ``steps`` with its 95% interval (Student's t, ``n - 2`` degrees of
    freedom): whether a figure rises over a run, e.g. the rollouts' mean reward over PPO's policy iterations.

    Args:
        steps, values: equally long; at least 3 points with at least 2 distinct steps, else undefined.

    Returns:
        ``(slope, low, high)`` in units of ``values`` per step; NaN three times when undefined.
    """
    from scipy import stats as scipy_stats  # noqa: PLC0415 (scipy: only this path needs it)

    if len(steps) != len(values) or len(steps) < 3 or len(set(steps)) < 2:
        return math.nan, math.nan, math.nan
    fit = scipy_stats.linregress(steps, values)
    half = float(scipy_stats.t.ppf(0.975, len(steps) - 2)) * float(fit.stderr)
    return float(fit.slope), float(fit.slope) - half, float(fit.slope) + half
