"""Each equation against a value worked out by hand."""

import math

import pytest
import torch

from rlhf import likelihood, losses


def test_token_rewards_match_eq11_by_hand():
    # beta 0.1, log-ratios [0.2, -0.1, 0.3], score 1.5 on the last of 3 tokens:
    # [-0.1*0.2, -0.1*-0.1, -0.1*0.3 + 1.5] = [-0.02, 0.01, 1.47]
    logratio = torch.tensor([[0.2, -0.1, 0.3, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    rewards = losses.token_rewards(logratio, torch.tensor([1.5]), mask, beta=0.1)
    assert torch.allclose(rewards, torch.tensor([[-0.02, 0.01, 1.47, 0.0]]), atol=1e-6)


def test_token_rewards_put_score_on_last_real_token_not_pad():
    mask = torch.tensor([[True, False, False], [True, True, True]])
    rewards = losses.token_rewards(torch.zeros(2, 3), torch.tensor([2.0, 3.0]), mask, beta=0.5)
    assert rewards.tolist() == [[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]


def test_gae_three_steps_by_hand():
    # rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 1, lambda 0.95
    # deltas: d2 = 1 - 0.7 = 0.3; d1 = 0.7 - 0.6 = 0.1; d0 = 0.6 - 0.5 = 0.1
    # A2 = 0.3; A1 = 0.1 + 0.95*0.3 = 0.385; A0 = 0.1 + 0.95*0.385 = 0.46575
    # returns = A + V = [0.96575, 0.985, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    advantages, returns = losses.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert torch.allclose(advantages, torch.tensor([[0.46575, 0.385, 0.3, 0.0]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.96575, 0.985, 1.0, 0.0]]), atol=1e-6)


def test_sequence_returns_sum_the_response_tokens_only():
    # row 0: -0.1 - 0.2 + 2.0 = 1.7 (the 9 is a pad); row 1: 0.5
    rewards = torch.tensor([[-0.1, -0.2, 2.0, 9.0], [0.5, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert losses.sequence_returns(rewards, mask).tolist() == pytest.approx([1.7, 0.5])


def test_rloo_advantages_by_hand():
    # group 1 (1, 2, 6): 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5
    # group 2 (0, 0, 3): 0 - 1.5 = -1.5 twice; 3 - 0 = 3
    returns = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    assert losses.rloo_advantages(returns, 3).tolist() == pytest.approx([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0])


def test_grpo_advantages_by_hand():
    # group 1 (1, 3): mean 2, sample std sqrt(2): -1/1.41421, +1/1.41421 (eps 1e-4 added to the std)
    # group 2 (5, 5): equal returns, advantage 0
    returns = torch.tensor([1.0, 3.0, 5.0, 5.0])
    expected = [-1 / (2**0.5 + 1e-4), 1 / (2**0.5 + 1e-4), 0.0, 0.0]
    assert losses.grpo_advantages(returns, 2).tolist() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("estimator", [losses.rloo_advantages, losses.grpo_advantages])
def test_group_estimators_refuse_groups_that_do_not_fill_the_batch(estimator):
    with pytest.raises(ValueError, match="groups of 1"):
        estimator(torch.ones(4), 1)
    with pytest.raises(ValueError, match=r"\(5,\) returns in groups of 2"):
        estimator(torch.ones(5), 2)


def test_value_loss_clipping_by_hand():
    # return 10, old value 5, new value 1, clip 0.2: clipped prediction 4.8,
    # loss 0.5 * max((1-10)^2, (4.8-10)^2) = 0.5 * max(81, 27.04) = 40.5
    loss, stats = losses.clipped_value_loss(
        torch.tensor([[1.0]]), torch.tensor([[5.0]]), torch.tensor([[10.0]]), torch.tensor([[True]]), clip=0.2
    )
    assert loss.item() == pytest.approx(40.5)
    assert stats["clipfrac"].item() == 0.0  # the unclipped error (81) was the larger one


def test_value_loss_takes_clipped_error_when_larger():
    # return 0, old 5, new 1: clipped 4.8; max(1, 23.04) = 23.04 -> 11.52
    loss, stats = losses.clipped_value_loss(
        torch.tensor([[1.0]]), torch.tensor([[5.0]]), torch.tensor([[0.0]]), torch.tensor([[True]]), clip=0.2
    )
    assert loss.item() == pytest.approx(11.52)
    assert stats["clipfrac"].item() == 1.0


def test_kl_estimators_by_hand():
    logratio = torch.tensor([-1.0, 0.0, 2.0])
    assert losses.kl_k1(logratio).tolist() == [-1.0, 0.0, 2.0]
    # k3 = exp(-d) - 1 + d: e - 2 = 0.7183; 0; e^-2 + 1 = 1.1353
    assert torch.allclose(losses.kl_k3(logratio), torch.tensor([0.7183, 0.0, 1.1353]), atol=1e-4)


def test_masked_whiten_by_hand_and_degenerate_cases():
    assert torch.allclose(
        losses.masked_whiten(torch.tensor([[1.0, 3.0]]), torch.tensor([[True, True]])),
        torch.tensor([[-1.0, 1.0]]),
        atol=1e-4,
    )
    one = losses.masked_whiten(torch.tensor([[4.0, 7.0]]), torch.tensor([[True, False]]))
    none = losses.masked_whiten(torch.tensor([[4.0, 7.0]]), torch.tensor([[False, False]]))
    assert torch.isfinite(one).all() and torch.isfinite(none).all()
    assert one.tolist() == [[0.0, 0.0]]


def test_bradley_terry_loss_by_hand():
    # -log sigmoid(2 - 1) = log(1 + e^-1) = 0.31326
    assert losses.bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0])).item() == pytest.approx(
        math.log(1 + math.exp(-1)), abs=1e-6
    )
    # margin 1 makes it -log sigmoid(0) = log 2
    assert losses.bradley_terry_loss(torch.tensor([2.0]), torch.tensor([1.0]), margin=1.0).item() == pytest.approx(
        math.log(2), abs=1e-6
    )


def test_ppo_clip_loss_by_hand():
    # ratio e^0.5 = 1.6487 with A = 1: min(1.6487, 1.2) = 1.2 -> loss -1.2, clipped
    # ratio e^-0.5 = 0.6065 with A = 1: min(0.6065, 0.8) = 0.6065 -> loss -0.6065, not clipped
    logprobs = torch.tensor([[0.5, -0.5]])
    loss, stats = losses.ppo_clip_loss(
        logprobs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), clip=0.2
    )
    assert loss.item() == pytest.approx(-(1.2 + math.exp(-0.5)) / 2, abs=1e-6)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    assert stats["approx_kl"].item() == pytest.approx(0.125)  # 0.5 * 0.25


def test_normalize_and_clip_by_hand():
    out = losses.normalize_and_clip(torch.tensor([0.0, 4.0, 10.0]), mean=2.0, std=2.0, clip=2.0)
    assert torch.allclose(out, torch.tensor([-1.0, 1.0, 2.0]))


def test_adaptive_kl_controller_by_hand():
    # KL 12 vs target 6: error clipped to 0.2; beta 0.1 * (1 + 0.2 * 100 / 1000) = 0.102
    assert losses.adaptive_kl_coef(0.1, kl=12.0, target=6.0, horizon=1000, steps=100) == pytest.approx(0.102)
    # KL 5.4 vs 6: error -0.1 -> 0.1 * (1 - 0.01) = 0.099
    assert losses.adaptive_kl_coef(0.1, kl=5.4, target=6.0, horizon=1000, steps=100) == pytest.approx(0.099)


def test_next_token_logprobs_selects_only_response_token():
    # tokens [10, 11, 12, 13], only token 12 in the response: the one selected value is the
    # model's score of token 12 at index 1 of the shifted logprobs.
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 20)
    input_ids = torch.tensor([[10, 11, 12, 13]])
    token_mask = torch.tensor([[False, False, True, False]])
    logprobs, mask = likelihood.next_token_logprobs(logits, input_ids, token_mask)
    selected = logprobs[mask]
    assert selected.shape == (1,)
    assert selected.item() == pytest.approx(torch.log_softmax(logits[0, 1], -1)[12].item(), abs=1e-6)
    assert mask.tolist() == [[False, True, False]]


def test_language_model_loss_by_hand():
    # uniform logits over 4 tokens: NLL of any token is log 4
    logits = torch.zeros(1, 3, 4)
    loss = likelihood.language_model_loss(logits, torch.tensor([[0, 1, 2]]), torch.tensor([[False, True, True]]))
    assert loss.item() == pytest.approx(math.log(4), abs=1e-6)


def test_target_nll_by_hand():
    # logprobs of 3 target tokens: log 1/2, log 1/4, log 1/4 -> NLL sum = 5 log 2; a part of a batch of 5 tokens
    logprobs = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    assert likelihood.target_nll(logprobs, 3).item() == pytest.approx(5 * math.log(2) / 3, abs=1e-6)
    assert likelihood.target_nll(logprobs, 5).item() == pytest.approx(math.log(2), abs=1e-6)
    assert likelihood.target_nll(logprobs[:0], 0).item() == 0.0  # nothing to score: 0, not NaN


def test_last_token_index_left_and_right_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert losses.last_token_index(mask).tolist() == [2, 4, 0]


@pytest.mark.parametrize("planted", [math.inf, -math.inf, math.nan])
def test_losses_ignore_inf_or_nan_planted_in_padded_positions(planted):
    # the same two real tokens, with and without garbage in the padded third position:
    # losses and gradients must be equal and finite
    mask = torch.tensor([[True, True, False]])
    clean = torch.tensor([[-1.0, -2.0, 0.0]])
    dirty = torch.tensor([[-1.0, -2.0, planted]])
    for values in (clean, dirty):
        logprobs = values.clone().requires_grad_(True)
        loss, _ = losses.ppo_clip_loss(logprobs, dirty.detach(), torch.tensor([[1.0, -1.0, planted]]), mask, 0.2)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
        # ratio 1 on both real tokens: loss = -(1 * 1 + (-1) * 1) / 2 = 0
        assert loss.item() == pytest.approx(0.0, abs=1e-6)
        value, _ = losses.clipped_value_loss(values.clone().requires_grad_(True), dirty, dirty, mask, 0.2)
        assert value.item() == pytest.approx(0.0, abs=1e-6)  # the real positions predict their returns exactly
    rewards, values = torch.tensor([[0.0, 1.0, planted]]), torch.tensor([[0.5, 0.5, planted]])
    advantages, returns = losses.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # A1 = 1 - 0.5 = 0.5; A0 = 0 + 0.5 - 0.5 + 0.5 = 0.5
    assert advantages.tolist() == [[0.5, 0.5, 0.0]] and returns.tolist() == [[1.0, 1.0, 0.0]]
    assert losses.masked_mean(torch.tensor([[2.0, 4.0, planted]]), mask).item() == 3.0


def test_adaptive_kl_controller_on_a_sequence_at_the_demo_batch_size():
    # 8 samples per iteration, horizon 160 (steps / horizon = 0.05), target 6, beta 0.1:
    # KL 12 -> error +0.2 (clipped): 0.1 * 1.01 = 0.101
    # KL 3 -> error -0.5 -> -0.2: 0.101 * 0.99 = 0.09999
    # KL 6.6 -> error +0.1: 0.09999 * 1.005 = 0.10048995
    # KL 6 -> error 0: unchanged
    beta = 0.1
    expected = [0.101, 0.09999, 0.10048995, 0.10048995]
    for kl, want in zip([12.0, 3.0, 6.6, 6.0], expected, strict=True):
        beta = losses.adaptive_kl_coef(beta, kl=kl, target=6.0, horizon=160, steps=8)
        assert beta == pytest.approx(want, rel=1e-9)
    # ten iterations at twice the target raise beta by 1.01^10 = 1.1046: no longer inert (the old horizon
    # of 10,000 at 8 samples moved it by 1.00016^10 = 1.0016)
    beta = 0.1
    for _ in range(10):
        beta = losses.adaptive_kl_coef(beta, kl=12.0, target=6.0, horizon=160, steps=8)
    assert beta == pytest.approx(0.1 * 1.01**10, rel=1e-9)


def test_ppo_ratio_is_new_over_old_by_hand():
    # one token, log pi = 0.1, log pi_old = 0, A = 1: ratio e^0.1 = 1.10517 (inside the clip) -> loss -1.10517;
    # old over new would give e^-0.1 = 0.90484
    loss, stats = losses.ppo_clip_loss(
        torch.tensor([[0.1]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), clip=0.2
    )
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=1e-6)
    assert stats["ratio"].item() == pytest.approx(math.exp(0.1), abs=1e-6)


@pytest.mark.parametrize(
    ("log_ratio", "advantage", "loss", "grad"),
    [
        # clipped term taken (A > 0, rho = e^99 past 1.2): the constant -1.2, zero gradient (was NaN: 0 * inf)
        (99.0, 1.0, -1.2, 0.0),
        (1000.0, 1.0, -1.2, 0.0),
        # A < 0 and rho = e^99: the formula is inf in float32; log rho clamped at 80: e^80, zero gradient
        (99.0, -1.0, math.exp(80.0), 0.0),
        # A < 0, rho = e^50: finite, so the formula's own value and gradient, e^50 each
        (50.0, -1.0, math.exp(50.0), math.exp(50.0)),
        # rho = e^-90 (0 in float32 or a denormal) with A > 0: not clipped, about 0
        (-90.0, 1.0, 0.0, 0.0),
        # rho = e^-90 with A < 0: the clipped term 0.8, zero gradient
        (-90.0, -1.0, 0.8, 0.0),
    ],
)
def test_ppo_clip_loss_is_finite_at_extreme_log_ratios(log_ratio, advantage, loss, grad):
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    value, stats = losses.ppo_clip_loss(
        logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1, dtype=torch.bool), clip=0.2
    )
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logprobs.grad).all() and torch.isfinite(stats["ratio"])
    assert value.item() == pytest.approx(loss, rel=1e-5, abs=1e-30)
    assert logprobs.grad.item() == pytest.approx(grad, rel=1e-5, abs=1e-30)


def test_kl_k3_is_finite_at_extreme_log_ratios():
    # d = -90: exp(90) is inf in float32; clamped at -80: e^80 - 1 - 80. d = 99: e^-99 - 1 + 99 = 98.
    values = losses.kl_k3(torch.tensor([-90.0, -1000.0, 99.0, -50.0]))
    assert torch.isfinite(values).all()
    assert values.tolist() == pytest.approx([math.exp(80) - 81, math.exp(80) - 81, 98.0, math.exp(50) - 51], rel=1e-5)
