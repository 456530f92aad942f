"""The one binomial interval (Wilson 95%) and the one tie rule, on hand-worked values; win_rate follows them."""

import math
import warnings

import pytest
import torch

from rlhf.evaluation.evaluator import win_rate
from rlhf.stats import (
    Z95,
    PairedRate,
    TiesWarning,
    chance_warning,
    clustered_rate,
    linear_trend,
    paired_rate,
    paired_rates_interval,
    wilson_interval,
)


def test_wilson_120_of_196_by_hand():
    # p = 120/196 = 0.612245; z = 1.959964, z^2 = 3.841459
    # z^2/n = 0.019599, so the denominator 1 + z^2/n = 1.019599
    # center = (p + z^2/(2n)) / 1.019599 = (0.612245 + 0.009800) / 1.019599 = 0.610087
    # p(1-p)/n = 0.612245 * 0.387755 / 196 = 0.0012112; z^2/(4n^2) = 3.841459 / 153664 = 0.0000250
    # half = z * sqrt(0.0012362) / 1.019599 = 1.959964 * 0.035160 / 1.019599 = 0.067588
    # -> [0.610087 - 0.067588, 0.610087 + 0.067588] = [0.5425, 0.6777]
    low, high = wilson_interval(120, 196)
    assert low == pytest.approx(0.5425, abs=5e-5)
    assert high == pytest.approx(0.6777, abs=5e-5)
    assert Z95 == 1.959964


def test_wilson_3_of_4_and_the_edges_by_hand():
    # p = 0.75, z^2/n = 0.960365, denominator 1.960365
    # center = (0.75 + 0.480182) / 1.960365 = 0.627527
    # half = 1.959964 * sqrt(0.046875 + 0.060023) / 1.960365 = 1.959964 * 0.326953 / 1.960365 = 0.326886
    assert wilson_interval(3, 4) == pytest.approx((0.3006, 0.9544), abs=5e-5)
    # p = 1 (5 of 5): half = z/den * z/(2n), so low = (1 + z^2/2n - z^2/2n) / den = 1 / (1 + z^2/5) = 1 / 1.768292
    # = 0.5655 and high = (1 + z^2/n) / den = 1
    assert wilson_interval(5, 5) == pytest.approx((0.5655, 1.0), abs=5e-5)
    # p = 0 (0 of 5): the mirror image
    assert wilson_interval(0, 5) == pytest.approx((0.0, 0.4345), abs=5e-5)
    low, high = wilson_interval(0, 0)
    assert math.isnan(low) and math.isnan(high)
    # a real-valued (effective) count, 1.5 of 2: p = 0.75, z^2/n = 1.920730, denominator 2.920730
    # center = (0.75 + 0.960365) / 2.920730 = 0.585596
    # half = 1.959964 / 2.920730 * sqrt(0.75 * 0.25 / 2 + 3.841459 / 16) = 0.671049 * sqrt(0.333841) = 0.387726
    assert wilson_interval(1.5, 2) == pytest.approx((0.1979, 0.9733), abs=5e-5)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(-1, 2)


def test_ties_are_left_out_of_n_and_reported_apart_with_a_warning():
    # pairs: win, win, loss, tie, win, tie -> 3 wins of n = 4 decisive, 2 ties
    first = torch.tensor([2.0, 1.0, 0.0, 5.0, 3.0, -1.0])
    second = torch.tensor([1.0, 0.0, 1.0, 5.0, 2.0, -1.0])
    with pytest.warns(TiesWarning, match="2 of 6 pairs tied"):
        result = paired_rate(first, second)
    # rate 3/4 with the 3-of-4 interval worked out above
    assert isinstance(result, PairedRate)
    assert (result.rate, result.wins, result.n, result.ties) == (0.75, 3, 4, 2)
    assert (result.low, result.high) == pytest.approx((0.3006, 0.9544), abs=5e-5)
    assert result.pairs == 6


def test_no_ties_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = paired_rate(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    # 1 of 2: center 0.5, half = 1.959964 * sqrt(0.125 + 0.240091) / 2.920729 = 0.405469
    assert (result.rate, result.n, result.ties) == (0.5, 2, 0)
    assert (result.low, result.high) == pytest.approx((0.0945, 0.9055), abs=5e-5)


def test_constant_scores_give_nan_with_n_zero_not_zero_or_one_half():
    scores = torch.zeros(5)
    with pytest.warns(TiesWarning):
        result = paired_rate(scores, scores.clone())
    assert math.isnan(result.rate) and math.isnan(result.low) and math.isnan(result.high)
    assert (result.wins, result.n, result.ties) == (0, 0, 5)
    assert result.includes(0.5)  # an undefined rate cannot be told from chance


def test_nan_scores_and_shape_mismatch_are_errors():
    with pytest.raises(ValueError, match="1 of 2 pairs have a NaN score"):
        paired_rate(torch.tensor([1.0, float("nan")]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match=r"\(N,\)"):
        paired_rate(torch.zeros(2), torch.zeros(3))


def test_win_rate_follows_the_tie_rule_by_hand():
    # policy vs SFT per prompt: win, tie, loss, win, win -> 3 wins of n = 4, 1 tie (before: (3 + 0.5) / 5 = 0.7)
    policy = torch.tensor([[1.0], [0.5], [-1.0], [2.0], [0.3]])
    sft = torch.tensor([[0.0], [0.5], [0.0], [1.0], [0.2]])
    with pytest.warns(TiesWarning, match="1 of 5 comparisons over 5 evaluation prompts tied"):
        result = win_rate(policy, sft, 1000, 0)
    assert isinstance(result, PairedRate)
    assert (result.rate, result.wins, result.n, result.ties) == (0.75, 3, 4, 1)
    assert result.low <= 0.3006 and result.high >= 0.9544  # never narrower than Wilson's (0.3006, 0.9544)
    with pytest.warns(TiesWarning):
        constant = win_rate(torch.ones(4, 2), torch.ones(4, 2), 1000, 0)
    assert math.isnan(constant.rate) and (constant.n, constant.ties) == (0, 8)


def test_clustered_rate_30_of_50_by_hand():
    # 30 wins of 50 prompts, one comparison each: rate 0.6. The percentile bootstrap resamples the binomial
    # proportion: its 2.5% and 97.5% points are those of Binomial(50, 0.6) / 50, i.e. 23/50 = 0.46 and
    # 37/50 = 0.74 (P(X <= 22) = 0.0160, P(X <= 23) = 0.0314; P(X <= 36) = 0.9720, P(X <= 37) = 0.9867),
    # wider than Wilson's [0.4618, 0.7239], so they are the interval: 0.6 +- 0.14.
    first, second = torch.tensor([[1.0]] * 30 + [[-1.0]] * 20), torch.zeros(50, 1)
    result = clustered_rate(first, second, resamples=10000, seed=0)
    assert (result.rate, result.wins, result.n, result.ties) == (0.6, 30, 50, 0)
    assert (result.low, result.high) == pytest.approx((0.46, 0.74), abs=1e-9)
    assert clustered_rate(first, second, resamples=10000, seed=0) == result  # seeded: reproducible


def test_clustered_rate_counts_a_prompt_once_however_many_samples_it_has():
    # the same 50 prompts with 4 identical samples each: 120 wins of 200 comparisons, but still 50 prompts'
    # worth of evidence: the interval of 30 of 50, not Wilson's [0.531, 0.665] for 200 independent comparisons
    first, second = torch.tensor([[1.0] * 4] * 30 + [[-1.0] * 4] * 20), torch.zeros(50, 4)
    result = clustered_rate(first, second, resamples=10000, seed=0)
    assert (result.rate, result.wins, result.n) == (0.6, 120, 200)
    assert (result.low, result.high) == pytest.approx((0.46, 0.74), abs=1e-9)
    assert wilson_interval(120, 200) == pytest.approx((0.5308, 0.6654), abs=5e-5)


def test_clustered_rate_is_never_narrower_than_wilson_over_prompts():
    # 5 wins of 5 prompts: every resample is 1.0, but 5 prompts cannot prove a 100% rate: Wilson's [0.5655, 1]
    result = clustered_rate(torch.ones(5, 1), torch.zeros(5, 1))
    assert result.rate == 1.0 and result.low == pytest.approx(0.5655, abs=5e-5) and result.high == 1.0
    with pytest.raises(ValueError, match=r"\(P, K\)"):
        clustered_rate(torch.ones(5), torch.zeros(5))


def test_clustered_rate_floors_by_prompts_not_comparisons_6_by_2_all_won():
    # 6 prompts x 2 samples, all 12 comparisons won. The floor counts the 6 prompts with a decisive comparison,
    # with rate * 6 = 6 successes: Wilson of 6 of 6. At p = 1 the low bound is 1 / (1 + z^2/n):
    # z^2 / 6 = 3.841459 / 6 = 0.640243, so low = 1 / 1.640243 = 0.609666, high = 1.
    # (Counting the 12 comparisons as independent would give 1 / (1 + 3.841459 / 12) = 1 / 1.320122 = 0.757506.)
    result = clustered_rate(torch.ones(6, 2), torch.zeros(6, 2))
    assert (result.rate, result.wins, result.n, result.ties) == (1.0, 12, 12, 0)  # the counts stay comparisons
    assert result.low == pytest.approx(0.609666, abs=1e-6) and result.high == 1.0


def test_clustered_rate_floor_counts_only_prompts_with_a_decisive_comparison():
    # 3 prompts x 2: prompts 0 and 1 won twice, prompt 2 tied twice. Comparisons: 4 wins of n = 4, 2 ties.
    # Every resample with a decisive comparison is 1.0 (one of prompt 2 alone is NaN, dropped): the bootstrap
    # gives [1, 1], so the floor is the interval. It counts the 2 prompts with a decisive comparison, not all 3
    # and not the 4 comparisons: Wilson of 2 of 2, low = 1 / (1 + z^2/2) = 1 / (1 + 1.920730) = 0.342380
    # (of 3 of 3 it would be 1 / 2.280486 = 0.438503; of 4 of 4, 1 / 1.960365 = 0.510109).
    first, second = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), torch.zeros(3, 2)
    with pytest.warns(TiesWarning, match="2 of 6 comparisons over 3 prompts tied"):
        result = clustered_rate(first, second, resamples=2000, seed=0)
    assert (result.rate, result.wins, result.n, result.ties) == (1.0, 4, 4, 2)
    assert result.low == pytest.approx(0.342380, abs=1e-6) and result.high == 1.0


def test_chance_warning():
    assert chance_warning("acc", 0.53, 0.46, 0.60) == "acc 0.53 [0.46, 0.60] includes chance (0.5)"
    assert chance_warning("acc", 0.61, 0.5425, 0.6777) == ""
    assert chance_warning("acc", 0.2, 0.1, 0.3) == "acc 0.20 [0.10, 0.30] is below chance (0.5)"  # ranks backwards
    assert "undefined" in chance_warning("acc", None, None, None)
    assert "undefined" in chance_warning("acc", float("nan"), float("nan"), float("nan"))


def _outcomes(a: int, b: int, c: int, d: int) -> tuple[list[int], list[int]]:
    """A paired 2x2 table as two 0/1 lists: a both 1, b only the first, c only the second, d neither."""
    return [1] * (a + b) + [0] * (c + d), [1] * a + [0] * b + [1] * c + [0] * d


def test_paired_rates_interval_newcombe_36_12_2_0_by_hand():
    # Newcombe 1998's first example (paired data, method 10): a = 36, b = 12, c = 2, d = 0, n = 50
    # p1 = 48/50 = 0.96, p2 = 38/50 = 0.76, difference 0.2; Wilson: [l1, u1] = [0.865399, 0.988961],
    # [l2, u2] = [0.625873, 0.857026]; phi = (ad - bc) / sqrt((a+b)(c+d)(a+c)(b+d)) = -24 / sqrt(48*2*38*12)
    # = -0.114708 (the Pearson correlation of the two 0/1 lists)
    # low = 0.2 - sqrt(0.094601^2 - 2 phi 0.094601 * 0.097026 + 0.097026^2) = 0.2 - 0.143070 = 0.056930
    # high = 0.2 + sqrt(0.134127^2 - 2 phi 0.134127 * 0.028961 + 0.028961^2) = 0.2 + 0.140428 = 0.340428
    low, high = paired_rates_interval(*_outcomes(36, 12, 2, 0))
    assert (low, high) == pytest.approx((0.056930, 0.340428), abs=1e-6)
    # phi taken as 0 would give sqrt(0.094601^2 + 0.097026^2) = 0.135513: the correlation matters
    assert 0.2 - low != pytest.approx(0.135513, abs=1e-3)


def test_paired_rates_interval_when_nothing_happened_or_on_one_prompt_by_hand():
    # 0 of 16 by both: p1 = p2 = 0, phi = 0 (neither varies); Wilson(0, 16) = [0, z^2 / (16 + z^2)]
    # = [0, 3.841459 / 19.841459] = [0, 0.193607], so the difference is [-0.193607, 0.193607], not [0, 0]
    assert paired_rates_interval([0] * 16, [0] * 16) == pytest.approx((-0.193607, 0.193607), abs=1e-6)
    # 2 prompts, the first does it on prompt 1 only: p1 = 0.5, p2 = 0; Wilson(1, 2) = [0.094531, 0.905469],
    # Wilson(0, 2) = [0, 0.657620]; phi = 0 (the second does not vary)
    # low = 0.5 - sqrt(0.405469^2 + 0.657620^2) = 0.5 - 0.772573 = -0.272573; high = 0.5 + 0.405469 = 0.905469
    assert paired_rates_interval([1, 0], [0, 0]) == pytest.approx((-0.272573, 0.905469), abs=1e-6)
    # K samples count a prompt once, by its share: prompt 1 does it in 1 of its 2 samples, prompt 2 in neither.
    # p1 = 0.25 over 2 prompts: Wilson(0.5 of 2): center (0.25 + 0.960365) / 2.920730 = 0.414405, half
    # 0.671049 * sqrt(0.25 * 0.75 / 2 + 0.240091) = 0.387727, so u1 = 0.802133 and high = 0.25 + 0.552133; the
    # 4 samples taken as 4 prompts (Wilson(1 of 4), u1 = 0.699358) would claim more than 2 prompts can show
    assert paired_rates_interval([0.5, 0.0], [0, 0])[1] == pytest.approx(0.802133, abs=1e-6)
    assert paired_rates_interval([1, 0, 0, 0], [0] * 4)[1] == pytest.approx(0.699358, abs=1e-6)
    low, high = paired_rates_interval([], [])
    assert math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError, match=r"rates in \[0, 1\]"):
        paired_rates_interval([2], [0])
    with pytest.raises(ValueError, match="equal-length"):
        paired_rates_interval([1, 0], [0])


def test_linear_trend_by_hand():
    # (1, 1), (2, 2), (3, 4): mean x 2, mean y 7/3; Sxy = (-1)(-4/3) + (1)(5/3) = 3, Sxx = 2 -> slope 1.5;
    # residuals 1/6, -1/3, 1/6 -> SSE 1/6, s^2 = SSE / (n - 2) = 1/6, se = sqrt(s^2 / Sxx) = 0.288675;
    # t(0.975, 1 df) = 12.7062 -> half-width 3.66795
    slope, low, high = linear_trend([1, 2, 3], [1, 2, 4])
    assert slope == pytest.approx(1.5)
    assert (low, high) == pytest.approx((1.5 - 3.66795, 1.5 + 3.66795), abs=1e-4)
    assert all(math.isnan(v) for v in linear_trend([1, 2], [1, 2]))  # too few points
    assert all(math.isnan(v) for v in linear_trend([1, 1, 1], [1, 2, 3]))  # one step
