"""What PPO changed, on hand-worked values: paired score difference, length-controlled win rate, best-of-n KL."""

import math

import numpy as np
import pytest
import torch

from rlhf.evaluation.comparison import (
    LC_L2,
    Difference,
    LengthControlledRate,
    best_of_n_kl,
    length_controlled_rate,
    length_logit_fit,
    length_logit_fits,
    paired_difference,
    rate_difference,
)
from rlhf.stats import TiesWarning


def test_paired_difference_of_3_prompts_by_hand():
    # per prompt, mean over its 2 samples of first - second: (1 + 3) / 2 - 0 = 2, 0 - 1 = -1, (2 + 4) / 2 - 1 = 2
    # -> mean over prompts (2 - 1 + 2) / 3 = 1.0
    # bootstrap: j of the 3 draws are the -1 prompt, j ~ Binomial(3, 1/3), and the resample mean is
    # (2 (3 - j) - j) / 3 = 2 - j: P(-1) = 1/27 = 0.037, P(0) = 6/27, P(1) = 12/27, P(2) = 8/27 = 0.296.
    # The 2.5% point lies in the -1 block (0.037 > 0.025) and the 97.5% point in the 2 block: [-1, 2].
    first = torch.tensor([[1.0, 3.0], [0.0, 0.0], [2.0, 4.0]])
    second = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    result = paired_difference(first, second, resamples=10000, seed=0)
    assert isinstance(result, Difference)
    assert (result.mean, result.low, result.high, result.prompts) == (1.0, -1.0, 2.0, 3)
    assert paired_difference(first, second, resamples=10000, seed=0) == result  # seeded: reproducible


def test_paired_difference_collapses_to_the_point_when_every_prompt_differs_alike():
    # every prompt's mean difference is 0.5: every resample's mean is 0.5
    second = np.array([[0.0, 1.0], [2.0, 3.0], [-1.0, 4.0], [5.0, 5.0]])
    result = paired_difference(second + 0.5, second, resamples=100, seed=0)
    assert (result.mean, result.low, result.high, result.prompts) == (0.5, 0.5, 0.5, 4)


def test_paired_difference_of_one_prompt_has_no_interval_and_nan_is_an_error():
    # one prompt: (3 + 1) / 2 - (0 + 2) / 2 = 1.0, and no spread over prompts to resample
    one = paired_difference(np.array([[3.0, 1.0]]), np.array([[0.0, 2.0]]))
    assert one.mean == 1.0 and math.isnan(one.low) and math.isnan(one.high) and one.prompts == 1
    with pytest.raises(ValueError, match="NaN"):
        paired_difference(np.array([[1.0], [math.nan]]), np.zeros((2, 1)))
    with pytest.raises(ValueError, match=r"\(P, K\)"):
        paired_difference(np.zeros((2, 1)), np.zeros((3, 1)))
    with pytest.raises(ValueError, match=r"\(P, K\)"):
        paired_difference(np.zeros(3), np.zeros(3))


def test_rate_difference_of_2_prompts_by_hand():
    # the policy refuses prompt 1's response, SFT neither: per-prompt differences [1, 0], mean 0.5.
    # Bootstrap: the resample mean is j / 2, j ~ Binomial(2, 1/2) the draws of prompt 1: P(0) = P(1) = 1/4, both
    # above 2.5%, so the percentile interval is [0, 1] (a tail of 2000 resamples misses 1/4 with probability
    # 0.75^2000). Newcombe's floor (rlhf.stats.paired_rates_interval, worked in test_stats): [-0.272573, 0.905469].
    # Reported: the wider end of each, [-0.272573, 1.0].
    result = rate_difference(_column([1, 0]), _column([0, 0]), resamples=2000, seed=0)
    assert (result.mean, result.high, result.prompts) == (0.5, 1.0, 2)
    assert result.low == pytest.approx(-0.272573, abs=1e-6)


def test_rate_difference_does_not_collapse_when_nothing_happened():
    # no refusal by either on 16 prompts: every difference is 0, so the bootstrap alone says [0, 0]; the floor
    # says what 16 prompts can resolve: Wilson(0 of 16) = [0, 0.193607], so [-0.193607, 0.193607]
    result = rate_difference(np.zeros((16, 1)), np.zeros((16, 1)), resamples=200, seed=0)
    assert result.mean == 0.0 and (result.low, result.high) == pytest.approx((-0.193607, 0.193607), abs=1e-6)
    # one prompt: no bootstrap (no spread over prompts), the floor alone; Wilson(1 of 1) = [0.206549, 1],
    # Wilson(0 of 1) = [0, 0.793451]: low = 1 - sqrt(0.793451^2 + 0.793451^2) = -0.122109, high = 1
    one = rate_difference(np.ones((1, 1)), np.zeros((1, 1)))
    assert (one.mean, one.high, one.prompts) == (1.0, 1.0, 1) and one.low == pytest.approx(-0.122109, abs=1e-6)
    with pytest.raises(ValueError, match="0/1 outcomes"):
        rate_difference(np.full((2, 1), 0.5), np.zeros((2, 1)))


def _column(values: list[float]) -> np.ndarray:
    """One comparison per prompt: ``(P, 1)``."""
    return np.array(values, dtype=np.float64)[:, None]


def test_lc_rate_without_length_differences_is_the_raw_rate_by_hand():
    # equal lengths: x = 0 (sd = 0 guard), so the fit is logit(wins / n) = logit(3/4) = ln 3 and the LC rate is
    # sigmoid(ln 3) = 3 / (3 + 1) = 0.75, the raw rate of 3 wins of 4 decisive (the tie is apart), b = 0
    first, second = _column([1.0, 1.0, 1.0, 0.0, 0.5]), _column([0.0, 0.0, 0.0, 1.0, 0.5])
    lengths = _column([10.0] * 5)
    with pytest.warns(TiesWarning, match="1 of 5 comparisons over 5 prompts tied"):
        result = length_controlled_rate(first, second, lengths, lengths, resamples=200, seed=0)
    assert isinstance(result, LengthControlledRate)
    assert result.rate == pytest.approx(0.75, abs=1e-9) and result.length_coef == pytest.approx(0.0, abs=1e-9)
    assert (result.n, result.ties) == (4, 1) and result.low <= 0.75 <= result.high
    # the first always 7 tokens longer: every difference alike, sd = 0, length cannot be told from the
    # intercept, so the length term is dropped: the raw rate again
    with pytest.warns(TiesWarning):
        longer = length_controlled_rate(first, second, lengths + 7, lengths, resamples=200, seed=0)
    assert longer.rate == pytest.approx(0.75, abs=1e-9) and longer.length_coef == pytest.approx(0.0, abs=1e-9)


def test_lc_rate_is_one_half_when_length_explains_a_symmetric_record():
    # longer by 1 token: 3 wins of 4; shorter by 1: 1 win of 4. Raw rate 4/8 = 0.5. d = +-1: mean 0, sd 1,
    # x = +-tanh(1) = +-0.761594. Swapping wins and losses and the sign of x gives the same data, so the
    # intercept is 0: LC rate sigmoid(0) = 0.5. Nearly unpenalised (l2 = 1e-9) the fit is saturated:
    # sigmoid(b tanh 1) = 3/4, b = ln 3 / tanh 1 = 1.098612 / 0.761594 = 1.442517.
    first = _column([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    lengths = _column([11.0] * 4 + [9.0] * 4)
    result = length_controlled_rate(first, 0.5 * np.ones((8, 1)), lengths, 10 * np.ones((8, 1)), 200, 0, l2=1e-9)
    assert result.rate == pytest.approx(0.5, abs=1e-9) and result.length_coef == pytest.approx(1.442517, abs=1e-5)
    assert result.n == 8 and result.low <= 0.5 <= result.high


def test_lc_rate_below_the_raw_rate_when_the_longer_response_wins_by_hand():
    # longer by 1: 7 wins of 8; shorter by 1: 1 win of 4. Raw rate 8/12 = 0.666667.
    # d: eight +1, four -1: mean 1/3, sd = sqrt(1 - 1/9) = 0.942809, x = +-tanh(1.060660) = +-0.785916.
    # Saturated fit (l2 ~ 0): a + b x = logit(7/8) = ln 7 and a - b x = logit(1/4) = -ln 3, so
    # a = (ln 7 - ln 3) / 2 = 0.423649 and the LC rate is sigmoid(a) = sqrt(7/3) / (1 + sqrt(7/3))
    # = 1.527525 / 2.527525 = 0.604356
    first = _column([1.0] * 7 + [0.0] + [1.0] + [0.0] * 3)
    lengths = _column([21.0] * 8 + [19.0] * 4)
    result = length_controlled_rate(first, 0.5 * np.ones((12, 1)), lengths, 20 * np.ones((12, 1)), 200, 0, l2=1e-9)
    assert result.rate == pytest.approx(0.604356, abs=1e-5) and result.length_coef > 0


def test_lc_rate_when_the_first_wins_exactly_when_it_is_longer():
    # 9 comparisons longer by 1, all won; 1 shorter by 1, lost. Raw rate 0.9. Length separates the verdicts:
    # unpenalised, b = inf. With |x| equal, the intercept's equation 9 (1 - sigmoid(a + b x)) = sigmoid(a - b x)
    # reads 9 / (1 + u v) = u / (u + v) with u = e^a, v = e^(b x), i.e. u^2 = 9 + 8 u / v -> 9 as b grows:
    # a -> ln 3, the LC rate -> 3 / (3 + 1) = 0.75, well below 0.9. The penalty keeps b finite, so the rate
    # lies just above 0.75: 0.7523 at the default l2 = 0.01, and within 1e-5 of 0.75 at l2 = 1e-6.
    first, second = _column([1.0] * 9 + [0.0]), 0.5 * np.ones((10, 1))
    lengths, base = _column([6.0] * 9 + [4.0]), 5 * np.ones((10, 1))
    result = length_controlled_rate(first, second, lengths, base, resamples=200, seed=0)
    assert LC_L2 == 1e-2 and 0.75 < result.rate < 0.76 and 0 < result.length_coef < math.inf
    assert result.low <= result.rate <= result.high
    tight = length_controlled_rate(first, second, lengths, base, resamples=10, seed=0, l2=1e-6)
    assert tight.rate == pytest.approx(0.75, abs=1e-5)


def test_lc_rate_edges_and_errors():
    lengths = _column([3.0, 5.0, 8.0])
    with pytest.warns(TiesWarning):
        ties = length_controlled_rate(np.zeros((3, 1)), np.zeros((3, 1)), lengths, lengths)
    assert math.isnan(ties.rate) and math.isnan(ties.length_coef) and (ties.n, ties.ties) == (0, 3)
    won = length_controlled_rate(np.ones((3, 1)), np.zeros((3, 1)), lengths, lengths[::-1], resamples=50)
    assert (won.rate, won.low, won.high, won.length_coef, won.n) == (1.0, 1.0, 1.0, 0.0, 3)  # all won: rate 1
    one = length_controlled_rate(np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]]), np.ones((1, 2)), np.ones((1, 2)))
    assert one.rate == pytest.approx(0.5) and math.isnan(one.low) and math.isnan(one.high)  # one prompt
    assert length_logit_fit(np.array([0.0, 0.0]), np.array([1.0, -1.0])) == (-math.inf, 0.0)  # all lost
    with pytest.raises(ValueError, match="l2 > 0"):
        length_controlled_rate(np.ones((3, 1)), np.zeros((3, 1)), lengths, lengths, l2=0.0)
    with pytest.raises(ValueError, match="NaN"):
        length_controlled_rate(np.ones((3, 1)), np.zeros((3, 1)), _column([1.0, math.nan, 2.0]), lengths)
    with pytest.raises(ValueError, match=r"\(P, K\)"):
        length_controlled_rate(np.ones((3, 1)), np.zeros((3, 1)), np.ones((3, 2)), lengths)


def test_weighted_fits_are_the_fits_of_the_repeated_comparisons():
    # a bootstrap resample counts a drawn prompt as often as it was drawn: weights 2, 0, 1, 1 are the data
    # [c0, c0, c2, c3]; all-zero weights have no fit (NaN); one all-won weighting has a = +inf, b = 0
    wins, diff = np.array([1.0, 0.0, 1.0, 0.0]), np.array([5.0, -3.0, 1.0, 4.0])
    a, b = length_logit_fits(wins, diff, np.array([[2, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]]))
    repeated = length_logit_fit(np.array([1.0, 1.0, 1.0, 0.0]), np.array([5.0, 5.0, 1.0, 4.0]))
    assert (a[0], b[0]) == (pytest.approx(repeated[0], abs=1e-8), pytest.approx(repeated[1], abs=1e-8))
    assert (a[1], b[1]) == (
        pytest.approx(length_logit_fit(wins, diff)[0]),
        pytest.approx(length_logit_fit(wins, diff)[1]),
    )
    assert math.isnan(a[2]) and math.isnan(b[2]) and (a[3], b[3]) == (math.inf, 0.0)


def test_best_of_n_kl_by_hand():
    # log(n) - (n - 1) / n: n = 1 -> 0 - 0 = 0; n = 2 -> 0.693147 - 0.5 = 0.193147;
    # n = 4 -> 1.386294 - 0.75 = 0.636294
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(0.193147, abs=1e-6)
    assert best_of_n_kl(4) == pytest.approx(0.636294, abs=1e-6)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="n >= 1"):
            best_of_n_kl(bad)


def test_best_of_n_keeps_the_selectors_best_of_the_first_n_and_returns_its_score_by_hand():
    from rlhf.evaluation.comparison import best_of_n

    proxy = np.array([[0.1, 0.9, 0.5, 2.0], [1.0, 1.0, 0.2, 0.0]])
    judge = np.array([[10.0, 20.0, 30.0, 40.0], [1.0, 2.0, 3.0, 4.0]])
    # n = 1: the first sample of each prompt -> [10, 1]
    assert best_of_n(proxy, judge, 1).tolist() == [10.0, 1.0]
    # n = 2: prompt 0 picks sample 1 (0.9 > 0.1) -> 20; prompt 1 ties 1.0 = 1.0 -> the earliest, 1
    assert best_of_n(proxy, judge, 2).tolist() == [20.0, 1.0]
    # n = 4: prompt 0 picks sample 3 (2.0) -> 40; prompt 1 still sample 0 -> 1
    assert best_of_n(proxy, judge, 4).tolist() == [40.0, 1.0]
    with pytest.raises(ValueError, match=r"n must be in \[1, 4\]"):
        best_of_n(proxy, judge, 5)
    with pytest.raises(ValueError, match="one shape"):
        best_of_n(proxy, judge[:, :2], 1)
