"""The length expert, the decorrelation term and the length-bias figures by hand; the debiased trainer on hand-made
pairs where length alone decides and where content decides."""

import math
import random

import numpy as np
import pytest
import torch

from rlhf.models.loading import load_scalar_model
from rlhf.reward.length_bias import (
    balanced_accuracy,
    debiased_pair_loss,
    fit_length_expert,
    length_expert_scores,
    length_figures,
    length_preference,
)
from rlhf.reward.metrics import evaluate_reward_model
from rlhf.reward.trainer import RewardConfig, train_reward_model
from rlhf.runtime.device import Runtime


def test_length_expert_is_zero_on_symmetric_pairs_and_solves_its_optimality_condition():
    # (3 vs 1) and (1 vs 3): d = +log 2 and -log 2 cancel, so w = 0
    assert fit_length_expert([3, 1], [1, 3]) == pytest.approx(0.0, abs=1e-12)
    # one pair, chosen 3 tokens, rejected 1: d = log 4 - log 2 = log 2; the optimum of -log sigmoid(w d) + w^2 / 2
    # satisfies (1 - sigmoid(w d)) d = w. At w = 0.3: (1 - sigmoid(0.2079)) 0.6931 = 0.3413 > 0.3; at w = 0.35:
    # (1 - sigmoid(0.2426)) 0.6931 = 0.3347 < 0.35, so 0.3 < w < 0.35
    w = fit_length_expert([3], [1])
    assert 0.3 < w < 0.35
    assert (1 - 1 / (1 + math.exp(-w * math.log(2)))) * math.log(2) == pytest.approx(w, abs=1e-9)
    # chosen always shorter: a negative weight (the data prefers the shorter)
    assert fit_length_expert([1, 2, 4], [5, 9, 7]) < 0
    with pytest.raises(ValueError, match="L2 penalty"):
        fit_length_expert([1], [2], l2=0.0)


def test_length_expert_scores_by_hand():
    # w log(1 + L): 2 log 1 = 0, 2 log 4 = 2.7726
    assert length_expert_scores(torch.tensor([0, 3]), 2.0).tolist() == pytest.approx([0.0, 2 * math.log(4)])


def test_length_preference_by_hand_and_its_gradient_flows():
    chosen = torch.tensor([1.0, 0.0, 2.0, 5.0], requires_grad=True)
    rejected = torch.tensor([0.0, 1.0, 2.0, 0.0])
    lengths = torch.tensor([5, 4, 1, 3]), torch.tensor([2, 1, 6, 3])
    # signs of |y_w| - |y_l|: +1, +1, -1, 0 (equal lengths: left out); signed margins +1, -1, 0 of the other three
    # rms sqrt((1 + 1 + 0) / 3) = 0.816497, k / rms = 1 / 0.816497 = 1.224745
    # tanh(1.224745) + tanh(-1.224745) + tanh(0) = 0 over 3 pairs
    total, count, rms = length_preference(chosen, rejected, *lengths)
    assert (float(total), int(count), float(rms)) == (pytest.approx(0.0, abs=1e-6), 3, pytest.approx(0.816497))
    # the longer wins both pairs by 1: rms 1, tanh(1) = 0.761594 each; shrinking the margins changes nothing
    for size in (1.0, 1e-4):
        total, count, _ = length_preference(
            torch.tensor([size, 0.0]), torch.tensor([0.0, size]), torch.tensor([3, 1]), torch.tensor([1, 3])
        )
        assert (float(total), int(count)) == (pytest.approx(2 * math.tanh(1.0), abs=2e-4), 2)  # 1e-8 added to the rms
    length_preference(chosen, rejected, *lengths)[0].backward()
    # d/dr_w tanh(k s (r_w - r_l) / m) = k s / m (1 - tanh^2), m held fixed: pairs 0 and 1:
    # 1.224745 x (1 - tanh(1.224745)^2) = 1.224745 x (1 - 0.841048^2) = 0.358407; pair 2: s = -1 at margin 0:
    # -1.224745; pair 3 has no say
    assert chosen.grad.tolist() == pytest.approx([0.358407, 0.358407, -1.224745, 0.0], abs=2e-6)


def test_debiased_pair_loss_by_hand():
    chosen, rejected = torch.tensor([1.0]), torch.tensor([0.0])
    lengths = (torch.tensor([3]), torch.tensor([1]))
    # no expert, no term: -log sigmoid(1) = log(1 + e^-1) = 0.313262
    plain, _ = debiased_pair_loss(chosen, rejected, *lengths, 0.0, 0.0, 0.0, count=1)
    assert float(plain) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    # expert w = 1: log-odds 1 + log 4 - log 2 = 1 + log 2; -log sigmoid = log(1 + e^-1 / 2) = 0.168809
    expert, correlation = debiased_pair_loss(chosen, rejected, *lengths, 1.0, 0.0, 0.0, count=1)
    assert float(expert) == pytest.approx(math.log(1 + math.exp(-1) / 2), abs=1e-6)
    # the longer wins, margin 1 = its rms m: preference tanh(1) = 0.761594; term 1 x 0.761594 x m 1 x (1 pair / 1)
    assert float(correlation) == pytest.approx(math.tanh(1.0))
    both, _ = debiased_pair_loss(chosen, rejected, *lengths, 1.0, 1.0, 0.0, count=1)
    assert float(both) == pytest.approx(math.tanh(1.0) + math.log(1 + math.exp(-1) / 2), abs=1e-6)
    # a part of 1 pair of a batch of 4: both terms are its share, a quarter
    share, _ = debiased_pair_loss(chosen, rejected, *lengths, 1.0, 1.0, 0.0, count=4)
    assert float(share) == pytest.approx(float(both) / 4, abs=1e-6)


def test_the_length_term_per_kind_by_hand_kinds_that_prefer_opposite_lengths_do_not_cancel():
    # pair 0 (kind 0): the longer wins by 1; pair 1 (kind 1): the shorter wins by 1. Over both pairs the mean
    # preference is (tanh(1) - tanh(1)) / 2 = 0: one mean lets a model rank each kind by its own length unpunished
    chosen, rejected = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])
    lengths = (torch.tensor([3, 1]), torch.tensor([1, 3]))
    bt = 2 * math.log(1 + math.exp(-1))  # the Bradley-Terry part of both pairs (no expert)
    pooled, preference = debiased_pair_loss(chosen, rejected, *lengths, 0.0, 1.0, 0.0, count=2)
    assert float(preference) == pytest.approx(0.0, abs=1e-7) and float(pooled) == pytest.approx(bt / 2, abs=1e-6)
    # within each kind: |tanh(1)| x m 1 x (1 pair / 2) each, tanh(1) in all
    groups = torch.tensor([[1, 0], [0, 1]])  # pair 0 in kind 0, pair 1 in kind 1
    by_kind, _ = debiased_pair_loss(chosen, rejected, *lengths, 0.0, 1.0, 0.0, count=2, groups=groups)
    assert float(by_kind) == pytest.approx(bt / 2 + math.tanh(1.0), abs=1e-6)
    # a pair in no group (an extra pair of rlhf.reward.augment) adds to no term: pair 1 alone is left, tanh(1) / 2
    lone, _ = debiased_pair_loss(chosen, rejected, *lengths, 0.0, 1.0, 0.0, count=2, groups=torch.tensor([[0, 1]]))
    assert float(lone) == pytest.approx(bt / 2 + math.tanh(1.0) / 2, abs=1e-6)
    # each pair its own expert weight: w = 1 for kind 0 (log-odds 1 + log 2), w = -1 for kind 1 (1 + log 2 too)
    weights = torch.tensor([1.0, -1.0])
    experts, _ = debiased_pair_loss(chosen, rejected, *lengths, weights, 0.0, 0.0, count=2)
    assert float(experts) == pytest.approx(math.log(1 + math.exp(-1) / 2), abs=1e-6)


def test_balanced_accuracy_and_its_stratified_interval_by_hand():
    # chosen-shorter 3 of 4 right (0.75), chosen-longer 1 of 2 (0.5): (0.75 + 0.5) / 2 = 0.625
    rate, low, high = balanced_accuracy(np.array([1, 1, 0, 1]), np.array([0, 1]), resamples=4000, seed=0)
    assert rate == pytest.approx(0.625)
    # resampling within each kind: the shorter kind's mean lies in {0, .25, .5, .75, 1}, the longer's in {0, .5, 1};
    # the 2.5% point is at most (0.5 + 0) / 2 and the 97.5% point at least (1 + 1) / 2 - ... : the interval is wide
    assert 0.0 <= low <= 0.375 and 0.875 <= high <= 1.0
    assert balanced_accuracy(np.array([1, 1]), np.array([1, 1, 1])) == (1.0, 1.0, 1.0)  # nothing varies
    assert all(math.isnan(v) for v in balanced_accuracy(np.array([1]), np.array([])))


def test_length_figures_by_hand_a_length_ranker_is_at_half():
    lengths = torch.tensor([2, 9, 3, 8, 5]), torch.tensor([6, 4, 7, 1, 5])
    # a ranker that prefers the shorter: score = -length. Pairs 0, 2 chosen shorter (right), 1, 3 chosen longer
    # (wrong), pair 4 equal lengths and tied: balanced (1 + 0) / 2 = 0.5
    figures = length_figures(-lengths[0].float(), -lengths[1].float(), *lengths, resamples=500)
    assert figures["rm/balanced_accuracy"] == pytest.approx(0.5)
    assert figures["rm/balanced_accuracy_low"] == figures["rm/balanced_accuracy_high"] == pytest.approx(0.5)
    # "prefer the shorter" is right on 2 of the 4 pairs of unequal length
    assert figures["rm/length_baseline_accuracy"] == pytest.approx(0.5)
    assert figures["rm/length_baseline_pairs"] == 4


WORDS = ["apple", "river", "stone", "cloud", "lamp", "tree", "music", "paper"]


def _pairs(kind: str, n: int, seed: int) -> list[dict]:
    """Hand-made pairs. ``length``: the same words, chosen always the shorter (length alone decides). ``content``:
    chosen says "yes", rejected "no", each padded with the same random words to independent random lengths."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [{"role": "user", "content": f"question {rng.choice(WORDS)} {i}"}]
        if kind == "length":
            short, long = sorted(rng.sample(range(1, 25), 2))
            chosen, rejected = " ".join(["stone"] * short), " ".join(["stone"] * long)
        else:
            filler = [rng.choice(WORDS) for _ in range(24)]
            chosen = " ".join(["yes"] + filler[: rng.randint(0, 20)])
            rejected = " ".join(["no"] + filler[: rng.randint(0, 20)])
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


def _accuracy_after_training(tiny_dir, tokenizer, kind: str, debiased: bool) -> float:
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    config = RewardConfig(
        steps=80,
        batch_size=16,
        lr=3e-3,
        warmup_steps=0,
        scheduler="cosine",
        max_length=64,
        length_expert=debiased,
        length_decorrelation=1.0 if debiased else 0.0,
        trainable_layers=None,  # every block of the 2-layer model, in a fixed order
        group_by_length=False,
    )
    train_reward_model(
        model, tokenizer, _pairs(kind, 320, seed=0), config, lambda m, s: None, Runtime(), progress=False
    )
    metrics, _ = evaluate_reward_model(model, tokenizer, _pairs(kind, 200, seed=1), 64, 64, Runtime())
    return metrics["rm/accuracy"]


@pytest.mark.parametrize("debiased", [False, True])
def test_where_length_alone_decides_the_plain_model_learns_it_and_the_debiased_one_does_not(
    tiny_dir, tokenizer, debiased
):
    accuracy = _accuracy_after_training(tiny_dir, tokenizer, "length", debiased)
    if debiased:
        assert 0.4 <= accuracy <= 0.6
    else:
        assert accuracy >= 0.9


def test_where_content_decides_the_debiased_model_still_learns_it(tiny_dir, tokenizer):
    assert _accuracy_after_training(tiny_dir, tokenizer, "content", debiased=True) >= 0.9
