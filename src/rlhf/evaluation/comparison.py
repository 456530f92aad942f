"""What PPO changed, read on the same prompts: paired score difference, length-controlled win rate, best-of-n KL.

Beside the win rate (:func:`rlhf.stats.clustered_rate`), which says how often the policy beats the SFT model,
:func:`paired_difference` says by how much (in the scorer's units), and :func:`length_controlled_rate` says how
often it would win at equal length (a policy that only learned to write longer answers gains a raw win rate
from a length-biased scorer, not a length-controlled one). :func:`best_of_n_kl` is the KL that best-of-n
sampling from the SFT model spends, to read the policy's KL against.

:func:`rate_difference` says how much more often one model does something than the other on the same prompts
(the policy's refusal rate minus SFT's: a policy can win by helping less).

Every interval counts prompts, never comparisons: a 95% percentile bootstrap over prompts (Efron & Tibshirani
1993, ch. 13; ``scipy.stats.bootstrap``) that resamples whole rows of the ``(P, K)`` inputs. Ties follow the
product's rule (:func:`rlhf.stats.paired_rate`). Imports NumPy and SciPy, nothing of MLflow, Prefect or DVC.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit, log_expit
from scipy.stats import bootstrap

from rlhf.stats import paired_rate, paired_rates_interval

LC_L2 = 1e-2  # the L2 penalty on the length coefficient of length_controlled_rate (why: its docstring)


@dataclass(frozen=True)
class Difference:
    """The mean over prompts of the per-prompt mean score difference, with its 95% bootstrap interval.

    Attributes:
        mean: in the scorer's units (first minus second).
        low, high: 95% percentile bootstrap over prompts; NaN when ``prompts < 2``.
        prompts: P, the prompts averaged.
    """

    mean: float
    low: float
    high: float
    prompts: int


@dataclass(frozen=True)
class LengthControlledRate:
    """The predicted win rate at equal length (:func:`length_controlled_rate`) with its 95% interval.

    Attributes:
        rate: ``sigmoid(intercept)`` in [0, 1]; NaN when ``n == 0``.
        low, high: 95% percentile bootstrap over prompts (each resample refitted); NaN when fewer than 2
            prompts, or when ``n == 0``.
        length_coef: the fitted coefficient of ``tanh(length difference / sd)`` (log-odds; > 0: the scorer
            prefers the longer response); NaN when ``n == 0``.
        n: decisive comparisons fitted (ties excluded).
        ties: comparisons with exactly equal scores (not in ``n``).
    """

    rate: float
    low: float
    high: float
    length_coef: float
    n: int
    ties: int


def _matrix(values: Any, name: str) -> np.ndarray:
    """``values`` as a ``(P, K)`` float64 array; ValueError when not 2-D, empty or holding a NaN."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty (P, K) array, got shape {array.shape}")
    if np.isnan(array).any():
        raise ValueError(f"{name} holds {int(np.isnan(array).sum())} NaN values")
    return array


def _percentiles(result: Any) -> tuple[float, float]:
    """The 2.5% and 97.5% points of a ``scipy.stats.bootstrap`` result, over its finite resamples."""
    low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):  # some resamples undefined (NaN): drop them
        values = result.bootstrap_distribution[np.isfinite(result.bootstrap_distribution)]
        low, high = float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))
    return low, high


def _over_prompts(
    statistic: Callable[[np.ndarray], Any], prompts: int, resamples: int, seed: int, vectorized: bool = False
) -> Any:
    """``scipy.stats.bootstrap`` of ``statistic(rows)`` over ``prompts`` rows resampled with replacement;
    ``vectorized``: ``statistic`` takes ``(R, prompts)`` draws at once and returns ``(R,)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an undefined resample is NaN, dropped by _percentiles
        return bootstrap(
            (np.arange(prompts),),
            lambda rows, axis=-1: statistic(rows.astype(int)),
            vectorized=vectorized,
            n_resamples=resamples,
            method="percentile",
            rng=np.random.default_rng(seed),
        )


def paired_difference(first: Any, second: Any, resamples: int = 2000, seed: int = 0) -> Difference:
    """How much ``first`` outscores ``second`` on the same prompts: ``mean_p (mean_k first[p, k] - second[p, k])``.

    Each prompt's difference is the mean over its K samples of ``first - second`` (the samples of one prompt
    are not paired with each other, only the prompt is); the point is the mean of those P differences, equal
    to ``mean(first) - mean(second)``. The interval is the 95% percentile bootstrap of that mean over prompts
    (``scipy.stats.bootstrap``); when every prompt has the same difference it collapses to the point.

    Args:
        first, second: ``(P, K)`` float scores (torch tensors or NumPy arrays), e.g. the policy's and the SFT
            model's scores of K samples of each of P prompts.
        resamples: bootstrap resamples. seed: of the resampling (reproducible).

    Returns:
        :class:`Difference` in the scorers' units; ``low``/``high`` NaN when ``P < 2`` (one prompt says
        nothing of the spread over prompts).

    Raises:
        ValueError: a shape is not ``(P, K)`` or empty, the shapes differ, or a score is NaN.
    """
    a, b = _matrix(first, "first"), _matrix(second, "second")
    if a.shape != b.shape:
        raise ValueError(f"paired_difference needs two equal (P, K) shapes, got {a.shape} and {b.shape}")
    per_prompt = (a - b).mean(axis=1)  # (P,)
    mean, prompts = float(per_prompt.mean()), len(per_prompt)
    if prompts < 2:
        return Difference(mean, math.nan, math.nan, prompts)
    if np.all(per_prompt == per_prompt[0]):  # every resample is the point
        return Difference(mean, mean, mean, prompts)
    low, high = _percentiles(_over_prompts(lambda rows: float(per_prompt[rows].mean()), prompts, resamples, seed))
    return Difference(mean, low, high, prompts)


def rate_difference(first: Any, second: Any, resamples: int = 2000, seed: int = 0) -> Difference:
    """How much more often ``first`` does something than ``second`` on the same prompts, e.g. the policy's refusal
    rate minus SFT's: the mean over prompts of each prompt's difference of shares, with a 95% interval.

    The point and the interval are :func:`paired_difference`'s (a percentile bootstrap over prompts, pairs kept
    together), floored by Newcombe's paired score interval over prompts (:func:`rlhf.stats.paired_rates_interval`,
    each prompt counted once by its share): neither bound is ever more optimistic than that floor. A percentile
    bootstrap alone collapses when nothing happened (no refusal by either model on 16 prompts resamples to
    ``[0, 0]``) and is too narrow when little did, as :func:`rlhf.stats.clustered_rate` explains for win rates;
    the floor says what the prompts can resolve (0 of 16 by both: ``[-0.194, 0.194]``; 0 of 150: ``[-0.025,
    0.025]``).

    Args:
        first, second: ``(P, K)`` 0/1 outcomes (torch or NumPy; 1: the response does it), K samples of P prompts.
        resamples, seed: of the bootstrap.

    Returns:
        :class:`Difference`: ``mean`` the difference of the two rates, ``low``/``high`` its interval (the floor
        alone for one prompt).

    Raises:
        ValueError: shapes differ or are not ``(P, K)``, or an outcome is not 0 or 1.
    """
    a, b = _matrix(first, "first"), _matrix(second, "second")
    if not (np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all()):
        raise ValueError("rate_difference needs 0/1 outcomes")
    diff = paired_difference(a, b, resamples, seed)
    low, high = paired_rates_interval(a.mean(axis=1), b.mean(axis=1))
    if diff.prompts >= 2:
        low, high = min(low, diff.low), max(high, diff.high)
    return Difference(diff.mean, low, high, diff.prompts)


def length_logit_fit(wins: np.ndarray, length_diff: np.ndarray, l2: float = LC_L2) -> tuple[float, float]:
    """The logistic regression of AlpacaEval's length control: ``P(win) = sigmoid(a + b tanh(d / sd))``.

    Minimises ``-sum log-likelihood + l2 b^2 / 2`` (the intercept ``a`` unpenalised); ``sd`` is the population
    standard deviation of ``d``, and when every ``d`` is equal (``sd = 0``) length cannot be told apart from the
    intercept, so the length term is dropped (``x = 0``: ``a = logit(mean(wins))``, ``b = 0``). One fit of
    :func:`length_logit_fits`.

    Args:
        wins: ``(N,)`` 0/1 floats, 1 where the first response won (decisive comparisons only).
        length_diff: ``(N,)`` float, first's length minus second's (tokens).
        l2: penalty on ``b``, ``> 0``.

    Returns:
        ``(a, b)`` in log-odds; ``a = +inf`` (``-inf``) and ``b = 0`` when every comparison was won (lost):
        the equal-length win rate is then 1 (0), and the penalty alone sets ``b``.

    Raises:
        ValueError: no comparison, or ``l2 <= 0``.
    """
    if len(wins) == 0 or l2 <= 0:
        raise ValueError(f"length_logit_fit needs comparisons and l2 > 0, got {len(wins)} and l2={l2}")
    a, b = length_logit_fits(wins, length_diff, np.ones((1, len(wins))), l2)
    return float(a[0]), float(b[0])


def length_logit_fits(
    wins: np.ndarray, length_diff: np.ndarray, weights: np.ndarray, l2: float = LC_L2, tol: float = 1e-10
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`length_logit_fit` for R weightings of the same comparisons at once (a bootstrap's resamples).

    Fit ``r`` counts comparison ``n`` ``weights[r, n]`` times (a resample that drew its prompt twice counts it
    twice, ``sd`` included). Damped Newton steps with the exact gradient and Hessian (the objective is convex,
    strictly so in ``b`` through the penalty), each halved until the objective does not rise, until every
    gradient is below ``tol``.

    Args:
        wins: ``(N,)`` 0/1. length_diff: ``(N,)``. weights: ``(R, N)`` counts, ``>= 0``. l2: ``> 0``.

    Returns:
        ``(a, b)``, each ``(R,)`` float64: as :func:`length_logit_fit`; NaN for a fit whose weights are all 0.
    """
    y, d, w = np.asarray(wins, np.float64), np.asarray(length_diff, np.float64), np.asarray(weights, np.float64)
    total = w.sum(axis=1)
    safe = np.where(total > 0, total, 1.0)
    share = (w @ y) / safe
    mean = (w @ d) / safe
    sd = np.sqrt(np.maximum((w * (d - mean[:, None]) ** 2).sum(axis=1) / safe, 0.0))
    # an sd below rounding of equal differences counts as 0
    spread = sd > 1e-12 * np.maximum(np.abs(mean), 1.0)
    x = np.where(spread[:, None], np.tanh(d / np.where(spread, sd, 1.0)[:, None]), 0.0)
    sign = 2.0 * y - 1.0  # the log-likelihood of a comparison is log sigmoid(sign * logit)
    open_ = (share > 0) & (share < 1)
    a = np.log(np.where(open_, share, 0.5) / (1 - np.where(open_, share, 0.5)))
    b = np.zeros_like(a)

    def objective(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return -(w * log_expit(sign * (a[:, None] + b[:, None] * x))).sum(axis=1) + 0.5 * l2 * b**2

    for _ in range(100):
        p = expit(a[:, None] + b[:, None] * x)
        residual, curve = w * (y - p), w * p * (1 - p)
        grad_a, grad_b = -residual.sum(axis=1), -(residual * x).sum(axis=1) + l2 * b
        if np.all(~open_ | ((np.abs(grad_a) < tol) & (np.abs(grad_b) < tol))):
            break
        haa, hab, hbb = curve.sum(axis=1), (curve * x).sum(axis=1), (curve * x * x).sum(axis=1) + l2
        det = np.where(open_, haa * hbb - hab**2, 1.0)
        step_a, step_b = (hbb * grad_a - hab * grad_b) / det, (haa * grad_b - hab * grad_a) / det
        step = np.where(open_, 1.0, 0.0)
        before = objective(a, b)
        for _ in range(60):  # halve each fit's step until its objective does not rise
            rises = objective(a - step * step_a, b - step * step_b) > before + 1e-12 * np.abs(before)
            if not rises.any():
                break
            step = np.where(rises, step / 2, step)
        a, b = a - step * step_a, b - step * step_b
    a = np.where(open_, a, np.where(share >= 1, math.inf, -math.inf))
    b = np.where(open_, b, 0.0)
    return np.where(total > 0, a, math.nan), np.where(total > 0, b, math.nan)


def length_controlled_rate(
    first: Any,
    second: Any,
    first_lengths: Any,
    second_lengths: Any,
    resamples: int = 2000,
    seed: int = 0,
    l2: float = LC_L2,
    what: str = "prompts",
) -> LengthControlledRate:
    """The win rate of ``first`` over ``second`` at equal length (length-controlled AlpacaEval).

    Dubois, Galambosi, Liang & Hashimoto 2024, "Length-Controlled AlpacaEval: A Simple Way to Debias
    Automatic Evaluators" (AlpacaEval 2.0's LC win rate): over the decisive comparisons (ties apart, the
    product's rule, :func:`rlhf.stats.paired_rate`, with its :class:`rlhf.stats.TiesWarning`) fit
    ``P(first wins) = sigmoid(a + b tanh((len_first - len_second) / sd))`` (:func:`length_logit_fit`; ``sd``
    the standard deviation of the length differences of those comparisons) and report ``sigmoid(a)``, the
    predicted win rate when the lengths are equal. AlpacaEval's GLM also has a per-instruction difficulty term
    fitted over many models; with two models only the intercept and the length term remain.

    ``l2`` (default :data:`LC_L2` = 0.01) penalises ``b`` only, as ``l2 b^2 / 2`` on the summed negative
    log-likelihood: a Gaussian prior ``b ~ N(0, 10^2)``. It keeps ``b`` finite when length separates the
    verdicts (the first wins exactly when it is longer: the unpenalised maximum likelihood has ``b = inf``),
    so every bootstrap refit is defined, while shrinking a realistic coefficient (``|b| <= 3`` moves the odds
    at most e^3 fold, ``tanh`` being in (-1, 1)) by well under 1% at the product's 32 or more comparisons
    (relative shrinkage about ``l2 / (n var(x) p (1 - p))``). AlpacaEval's own fit is regularised too
    (scikit-learn's L2 logistic regression).

    Args:
        first, second: ``(P, K)`` float scores (torch tensors or NumPy arrays): K comparisons on each of P prompts.
        first_lengths, second_lengths: ``(P, K)`` response lengths (tokens; any unit, as only ``d / sd`` enters).
        resamples: bootstrap resamples over prompts (each refits, ``sd`` included). seed: of the resampling.
        l2: the penalty on the length coefficient, ``> 0``.
        what: what a row is, for the tie warning.

    Returns:
        :class:`LengthControlledRate`; ``rate``, ``low``, ``high``, ``length_coef`` NaN when no comparison is
        decisive; ``low``, ``high`` NaN when ``P < 2``. A resample without a decisive comparison is dropped.

    Raises:
        ValueError: shapes are not one ``(P, K)``, a score or a length is NaN, or ``l2 <= 0``.
    """
    a, b = _matrix(first, "first"), _matrix(second, "second")
    la, lb = _matrix(first_lengths, "first_lengths"), _matrix(second_lengths, "second_lengths")
    if not a.shape == b.shape == la.shape == lb.shape:
        raise ValueError(
            f"length_controlled_rate needs four equal (P, K) shapes, got {a.shape}, {b.shape}, "
            f"{la.shape} and {lb.shape}"
        )
    if l2 <= 0:
        raise ValueError(f"length_controlled_rate needs l2 > 0, got {l2}")
    flat = paired_rate(a.reshape(-1), b.reshape(-1), what=f"comparisons over {a.shape[0]} {what}")
    if flat.n == 0:
        return LengthControlledRate(math.nan, math.nan, math.nan, math.nan, 0, flat.ties)

    decisive = (a != b).reshape(-1)
    wins = (a > b).reshape(-1)[decisive].astype(np.float64)
    diff = (la - lb).reshape(-1)[decisive]
    prompt_of = np.repeat(np.arange(a.shape[0]), a.shape[1])[decisive]
    intercept, coef = length_logit_fit(wins, diff, l2)

    def rate(rows: np.ndarray, axis: int = -1) -> np.ndarray:  # (R, P) drawn prompts -> (R,) refitted rates
        drawn = rows.reshape(-1, a.shape[0])
        counts = np.zeros(drawn.shape)
        np.add.at(counts, (np.arange(len(drawn))[:, None], drawn), 1.0)
        return expit(length_logit_fits(wins, diff, counts[:, prompt_of], l2)[0])

    low = high = math.nan
    if a.shape[0] >= 2:
        low, high = _percentiles(_over_prompts(rate, a.shape[0], resamples, seed, vectorized=True))
    return LengthControlledRate(float(expit(intercept)), low, high, coef, flat.n, flat.ties)


def best_of_n_kl(n: int) -> float:
    """The KL divergence of best-of-n sampling to the policy it samples from: ``log(n) - (n - 1) / n`` nats.

    Gao, Schulman & Hilton 2023, "Scaling Laws for Reward Model Overoptimization", section 2 (after Stiennon et
    al. 2020): drawing n responses and keeping the best by a reward spends this KL, per response, to the base
    policy; Beirami et al. 2024 ("Theoretical guarantees on the best-of-n alignment policy") show it is an
    upper bound on the actual KL. The product reads a PPO policy's KL to SFT against it.

    Args:
        n: responses drawn per prompt, an integer ``>= 1``.

    Returns:
        Nats, ``>= 0`` (0 at ``n = 1``).

    Raises:
        ValueError: ``n < 1`` or not an integer.
    """
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"best_of_n_kl needs an integer n >= 1, got {n!r}")
    return math.log(n) - (n - 1) / n


def best_of_n(selector: Any, scores: Any, n: int) -> np.ndarray:
    """Best-of-n sampling (Stiennon et al. 2020; Gao et al. 2023): per prompt, keep the first ``n`` responses'
    best by ``selector`` (the proxy) and return its score by ``scores`` (the judge).

    The first ``n`` of ``K >= n`` samples are ``n`` independent draws, so one set of ``K`` samples per prompt
    gives every ``n <= K`` (nested: best-of-4 sees the sample best-of-1 saw). Ties in ``selector`` keep the
    earliest sample.

    Args:
        selector, scores: ``(P, K)`` float scores of the same responses (torch or NumPy).
        n: responses kept per prompt, ``1 <= n <= K``.

    Returns:
        ``(P,)`` float64: each prompt's ``scores`` of its selected response.

    Raises:
        ValueError: shapes differ, a NaN, or ``n`` outside ``[1, K]``.
    """
    a, b = _matrix(selector, "selector"), _matrix(scores, "scores")
    if a.shape != b.shape:
        raise ValueError(f"best_of_n needs two score arrays of one shape, got {a.shape} and {b.shape}")
    if not 1 <= n <= a.shape[1]:
        raise ValueError(f"best_of_n: n must be in [1, {a.shape[1]}] (the samples per prompt), got {n}")
    picked = np.argmax(a[:, :n], axis=1)
    return b[np.arange(len(b)), picked]
