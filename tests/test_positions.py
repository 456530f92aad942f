"""Every place the code chooses a position in a sequence, pinned against values built by hand.

Logits against labels, values against states, where a score is read, where a
reward lands, where GAE's recursion starts. Each test runs the tiny model once
per real (unpadded) sequence, takes its raw outputs at every position, picks
the expected value with explicit indices, and compares with what the product
returns on a padded batch. Reading the logits one position late, the most
common RLHF bug, fails here.
"""

import pytest
import torch

from rlhf import likelihood, losses
from rlhf.models.forward import response_logprobs, sequence_scores
from rlhf.models.loading import load_causal_lm, load_scalar_model
from rlhf.models.sampling import response_mask_from_tokens
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.rollout import Experience, value_predictions
from rlhf.ppo.update import Optimisers, policy_step
from rlhf.runtime.device import Runtime

PAD, EOS = 0, 2  # the prepared SmolLM2 tokenizer (checked in test_models.py)

# Two rollouts, prompt length P = 4 (left-padded), response length R = 3 (right-padded after the EOS):
#   row 0: prompt [1, 28, 105, 9]          response [311, 45, EOS]
#   row 1: prompt [PAD, PAD, 1, 77]        response [512, EOS, PAD]
P, R = 4, 3
IDS = torch.tensor([[1, 28, 105, 9, 311, 45, EOS], [PAD, PAD, 1, 77, 512, EOS, PAD]])
ATTN = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0]])
LEFT_PADS = [0, 2]  # padded index i of row r is index i - LEFT_PADS[r] of the row's real tokens
REAL = [[1, 28, 105, 9, 311, 45, EOS], [1, 77, 512, EOS]]


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_causal_lm(tiny_dir)


@pytest.fixture(scope="module")
def scalar_model(tiny_dir):
    """The tiny model with a scalar head of unit-scale weights (so neighbouring positions differ clearly)."""
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    return model


@torch.no_grad()
def lm_logits_alone(model, real_ids: list[int]) -> torch.Tensor:
    """``(L, V)``: the causal LM's logits at every position of one unpadded sequence."""
    return model(input_ids=torch.tensor([real_ids])).logits[0]


@torch.no_grad()
def head_alone(model, real_ids: list[int]) -> torch.Tensor:
    """``(L,)``: the scalar head's output at every position of one unpadded sequence."""
    return model.score(model.model(input_ids=torch.tensor([real_ids])).last_hidden_state)[0, :, 0]


def test_response_logprobs_read_the_logits_one_position_before_each_token(policy):
    temperature = 0.7
    with torch.no_grad():
        logprobs, logits = response_logprobs(policy, IDS, ATTN, P, temperature, with_logits=True)
    assert logprobs.shape == (2, R)
    for row in range(2):
        full = lm_logits_alone(policy, REAL[row])
        for t in range(R):
            # token t of the response sits at padded index P + t; the logits predicting it are those of
            # padded index P - 1 + t, i.e. index P - 1 + t - pads of the real sequence
            source = P - 1 + t - LEFT_PADS[row]
            token = IDS[row, P + t].item()
            expected = torch.log_softmax(full[source] / temperature, dim=-1)[token]
            assert logprobs[row, t].item() == pytest.approx(expected.item(), abs=1e-4), (row, t)
            assert torch.allclose(logits[row, t], full[source] / temperature, atol=1e-4), (row, t)
    # by hand, two entries spelled out: row 0 token 311 is predicted at index 3 (after 9),
    # row 1 token EOS at padded index 5 - 1 = 4, which is index 2 (token 512) of its real sequence
    row0 = torch.log_softmax(lm_logits_alone(policy, REAL[0])[3] / temperature, -1)[311]
    row1 = torch.log_softmax(lm_logits_alone(policy, REAL[1])[2] / temperature, -1)[EOS]
    assert logprobs[0, 0].item() == pytest.approx(row0.item(), abs=1e-4)
    assert logprobs[1, 1].item() == pytest.approx(row1.item(), abs=1e-4)
    # the test can tell one position late from right: the late reading differs by far more than the tolerance
    late = torch.log_softmax(lm_logits_alone(policy, REAL[0])[4] / temperature, -1)[311]
    assert abs(late.item() - row0.item()) > 1e-2


def test_value_predictions_read_v_of_s_t_where_token_t_is_predicted_and_apply_calibration(scalar_model):
    scalar_model.config.value_scale, scalar_model.config.value_bias = 2.0, -0.6
    try:
        with torch.no_grad():
            values = value_predictions(scalar_model, IDS, ATTN, P)
    finally:
        del scalar_model.config.value_scale, scalar_model.config.value_bias
    assert values.shape == (2, R)
    for row in range(2):
        head = head_alone(scalar_model, REAL[row])
        for t in range(R):
            # V(s_t): the state before token t ends at padded index P - 1 + t
            expected = (head[P - 1 + t - LEFT_PADS[row]] - 0.3) * 2.0
            assert values[row, t].item() == pytest.approx(expected.item(), abs=1e-4), (row, t)
    head0 = head_alone(scalar_model, REAL[0])
    assert values[0, 0].item() == pytest.approx(((head0[3] - 0.3) * 2.0).item(), abs=1e-4)
    assert abs((head0[4] - head0[3]).item()) > 1e-2  # one position late would be caught


@pytest.mark.parametrize("side", ["right", "left"])
def test_sequence_scores_read_at_the_last_real_token_minus_the_offset(scalar_model, side):
    long, short = [1, 28, 105, 9, 311, EOS], [1, 77, 512, EOS]
    if side == "right":
        ids = torch.tensor([long, short + [PAD, PAD]])
        attn = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
        last = [5, 3]  # padded index of the last real token (the EOS)
    else:
        ids = torch.tensor([long, [PAD, PAD] + short])
        attn = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
        last = [5, 5]
    scalar_model.config.reward_offset = 0.25
    try:
        with torch.no_grad():
            scores = sequence_scores(scalar_model, ids, attn)
    finally:
        del scalar_model.config.reward_offset
    assert ids[0, last[0]].item() == EOS and ids[1, last[1]].item() == EOS
    # the real sequences end at index 5 (long) and 3 (short)
    expected = torch.stack([head_alone(scalar_model, long)[5], head_alone(scalar_model, short)[3]]) - 0.25
    assert torch.allclose(scores, expected, atol=1e-4)
    one_early = head_alone(scalar_model, long)[4] - 0.25
    assert abs((one_early - expected[0]).item()) > 1e-2


def test_response_mask_runs_through_the_first_eos():
    responses = torch.tensor(
        [
            [5, EOS, 7, EOS],  # ends at index 1; later tokens are padding whatever their id
            [5, 6, 7, 8],  # no EOS: cut at max_new_tokens, every token real
            [EOS, PAD, PAD, PAD],  # EOS first: one real token
            [PAD, 5, EOS, PAD],  # a sampled pad id before the EOS is a real token
        ]
    )
    mask, ended = response_mask_from_tokens(responses, EOS)
    assert mask.tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, False, False, False],
        [True, True, True, False],
    ]
    assert ended.tolist() == [True, False, True, True]


def test_token_rewards_score_lands_on_the_eos_or_last_token_never_on_a_pad():
    responses = torch.tensor([[5, 6, 7, 8], [5, EOS, PAD, PAD], [EOS, PAD, PAD, PAD]])
    mask, _ = response_mask_from_tokens(responses, EOS)
    mask = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])  # a fourth row with no token at all
    logratio = torch.tensor(
        [[0.1, -0.2, 0.3, 0.4], [0.5, 0.6, 7.0, 8.0], [-0.3, 9.0, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]]
    )  # 7, 8 and 9 sit on pads
    scores = torch.tensor([1.5, -2.0, 0.7, 4.0])
    rewards = losses.token_rewards(logratio, scores, mask, beta=0.1)
    expected = torch.tensor(
        [
            [-0.01, 0.02, -0.03, -0.04 + 1.5],  # no EOS: the score on the last token, index 3
            [-0.05, -0.06 - 2.0, 0.0, 0.0],  # EOS at index 1 takes the score
            [0.03 + 0.7, 0.0, 0.0, 0.0],  # EOS first: the score on index 0
            [0.0, 0.0, 0.0, 0.0],  # nothing to score
        ]
    )
    assert torch.allclose(rewards, expected, atol=1e-6)


def test_gae_recursion_starts_at_the_last_real_token():
    # gamma 0.9, lambda 0.8 (gamma * lambda = 0.72). Row 0: three real tokens, then a pad holding garbage
    # (reward 99, value 55). The value after the last real token is 0:
    #   d2 = 1.0 + 0.9*0 - (-0.4) = 1.4                 A2 = 1.4
    #   d1 = -0.2 + 0.9*(-0.4) - 0.3 = -0.86            A1 = -0.86 + 0.72*1.4 = 0.148
    #   d0 = 0.1 + 0.9*0.3 - 0.5 = -0.13                A0 = -0.13 + 0.72*0.148 = -0.02344
    #   returns = A + V = [0.47656, 0.448, 1.0]
    # Row 1: the same three tokens and a fourth real one (reward 0.2, value 0.1):
    #   d3 = 0.2 - 0.1 = 0.1                            A3 = 0.1
    #   d2 = 1.0 + 0.9*0.1 + 0.4 = 1.49                 A2 = 1.49 + 0.72*0.1 = 1.562
    #   d1 = -0.86                                      A1 = -0.86 + 0.72*1.562 = 0.26464
    #   d0 = -0.13                                      A0 = -0.13 + 0.72*0.26464 = 0.0605408
    #   returns = [0.5605408, 0.56464, 1.162, 0.2]
    rewards = torch.tensor([[0.1, -0.2, 1.0, 99.0], [0.1, -0.2, 1.0, 0.2]])
    values = torch.tensor([[0.5, 0.3, -0.4, 55.0], [0.5, 0.3, -0.4, 0.1]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    advantages, returns = losses.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(advantages[0], torch.tensor([-0.02344, 0.148, 1.4, 0.0]), atol=1e-6)
    assert torch.allclose(returns[0], torch.tensor([0.47656, 0.448, 1.0, 0.0]), atol=1e-6)
    assert torch.allclose(advantages[1], torch.tensor([0.0605408, 0.26464, 1.562, 0.1]), atol=1e-6)
    assert torch.allclose(returns[1], torch.tensor([0.5605408, 0.56464, 1.162, 0.2]), atol=1e-6)


def test_next_token_logprobs_and_language_model_loss_shift_by_one(policy):
    # right-padded text, as the ptx batches are: row 0 has 5 tokens, row 1 has 3 then 2 pads
    ids = torch.tensor([[1, 28, 105, 9, EOS], [1, 77, EOS, PAD, PAD]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=attn).logits
    logprobs, mask = likelihood.next_token_logprobs(logits, ids, attn.bool())
    assert mask.tolist() == [[True, True, True, True], [True, True, False, False]]
    logp = torch.log_softmax(logits, dim=-1)
    for row in range(2):
        for t in range(4):
            # column t scores token t + 1 with the logits of position t
            assert logprobs[row, t].item() == pytest.approx(logp[row, t, ids[row, t + 1]].item(), abs=1e-5)
    targets = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]  # (row, index) of every real token after the first
    nll = -sum(logp[r, i - 1, ids[r, i]] for r, i in targets) / len(targets)
    loss = likelihood.language_model_loss(logits, ids, attn.bool())
    assert loss.item() == pytest.approx(nll.item(), abs=1e-5)
    unshifted = -sum(logp[r, i, ids[r, i]] for r, i in targets) / len(targets)
    assert abs(unshifted.item() - nll.item()) > 1e-2


class RecordingSGD(torch.optim.SGD):
    """SGD with learning rate 0 that keeps a copy of the gradients each step was asked to apply."""

    def step(self, closure=None):
        self.recorded = [
            p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for group in self.param_groups
            for p in group["params"]
        ]
        return super().step(closure)


def test_policy_step_adds_exactly_ptx_coef_times_the_lm_gradient(tiny_dir):
    policy = load_causal_lm(tiny_dir)
    params = [p for p in policy.parameters() if p.requires_grad]
    with torch.no_grad():
        current, _ = response_logprobs(policy, IDS, ATTN, P, 0.7)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    experience = Experience(
        input_ids=IDS,
        attention_mask=ATTN,
        response_start=P,
        mask=mask,
        logprobs=current - 0.05,
        values=torch.zeros(2, R),
        advantages=torch.tensor([[1.0, -0.5, 2.0], [0.3, -1.0, 0.0]]),
        returns=torch.zeros(2, R),
        raw_scores=torch.zeros(2),
        ended=torch.tensor([True, True]),
    )
    ptx_ids = torch.tensor([[1, 28, 105, 9, EOS], [1, 77, EOS, PAD, PAD]])
    ptx_attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])

    def step_gradients(ptx_coef: float) -> tuple[list[torch.Tensor], dict[str, float]]:
        config = PPOConfig(ptx_coef=ptx_coef, max_grad_norm=None, entropy_coef=0.0, advantage_normalize=False)
        recorder = RecordingSGD(params, lr=0.0)
        value_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        optimisers = Optimisers(
            recorder,
            value_optimizer,
            torch.optim.lr_scheduler.LambdaLR(recorder, lambda step: 1.0),
            torch.optim.lr_scheduler.LambdaLR(value_optimizer, lambda step: 1.0),
        )
        stats = policy_step(policy, optimisers, experience, [0, 1], config, 0.7, (ptx_ids, ptx_attn), Runtime())
        return recorder.recorded, stats

    with_ptx, stats = step_gradients(0.5)
    without_ptx, _ = step_gradients(0.0)

    # the ptx LM loss by hand: mean NLL of every real token after the first, each scored by the logits before it
    policy.zero_grad(set_to_none=True)
    logp = torch.log_softmax(policy(input_ids=ptx_ids, attention_mask=ptx_attn).logits, dim=-1)
    targets = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]
    nll = -sum(logp[r, i - 1, ptx_ids[r, i]] for r, i in targets) / len(targets)
    lm_grads = torch.autograd.grad(nll, params, allow_unused=True)
    assert stats["ppo/loss/ptx"] == pytest.approx(nll.item(), abs=1e-5)

    difference = torch.cat([(a - b).flatten() for a, b in zip(with_ptx, without_ptx, strict=True)])
    expected = torch.cat(
        [(0.5 * g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(lm_grads, params, strict=True)]
    )
    assert expected.norm() > 1e-3  # the term is large enough for its absence to show
    assert torch.allclose(difference, expected, atol=1e-6, rtol=1e-4)
