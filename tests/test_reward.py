"""Reward-model measurements on hand-made score lists, and centring on the demonstrations."""

import math

import pytest
import torch

from rlhf.models import encode_chat, load_scalar_model
from rlhf.reward import center_rewards, expected_calibration_error, pearson, preference_metrics, score_sequences


def test_preference_metrics_by_hand():
    chosen, rejected = torch.tensor([2.0, 1.0, 0.0]), torch.tensor([1.0, 2.0, -1.0])
    # margins [1, -1, 1]: accuracy 2/3, mean margin 1/3
    # sigmoid(1) = 0.7311, sigmoid(-1) = 0.2689: every confidence is 0.7311 (one bin), 2 of 3 correct
    # ECE = |2/3 - 0.7311| = 0.0644
    # chosen shorter in pairs 0 and 2 (5 < 8, 3 < 9), both right: 1.0
    metrics = preference_metrics(chosen, rejected, torch.tensor([5, 10, 3]), torch.tensor([8, 4, 9]))
    assert metrics["rm/accuracy"] == pytest.approx(2 / 3)
    assert metrics["rm/margin"] == pytest.approx(1 / 3)
    assert metrics["rm/ece"] == pytest.approx(abs(2 / 3 - 1 / (1 + math.exp(-1))), abs=1e-6)
    assert metrics["rm/accuracy_chosen_shorter"] == pytest.approx(1.0)
    assert metrics["rm/pairs"] == 3


def test_accuracy_on_shorter_chosen_pairs_only():
    # chosen shorter in pairs 0 and 2; pair 2 is wrong -> 0.5
    metrics = preference_metrics(
        torch.tensor([1.0, 5.0, 0.0]), torch.tensor([0.0, 0.0, 1.0]), torch.tensor([1, 9, 1]), torch.tensor([2, 3, 2])
    )
    assert metrics["rm/accuracy_chosen_shorter"] == pytest.approx(0.5)


def test_expected_calibration_error_two_bins_by_hand():
    # p = [0.9, 0.9, 0.6, 0.4], labels [1, 0, 1, 1]
    # confidences [0.9, 0.9, 0.6, 0.6]; correct [1, 0, 1, 0]
    # bin 0.85-0.9 (2 items): |0.5 - 0.9| = 0.4; bin 0.6 (2 items): |0.5 - 0.6| = 0.1 -> 0.5*0.4 + 0.5*0.1 = 0.25
    ece = expected_calibration_error(torch.tensor([0.9, 0.9, 0.6, 0.4]), torch.tensor([1, 0, 1, 1]), bins=10)
    assert ece == pytest.approx(0.25, abs=1e-6)
    assert expected_calibration_error(torch.zeros(0), torch.zeros(0)) == 0.0


def test_pearson_by_hand():
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])) == pytest.approx(1.0)
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    # x = [1, 2, 3], y = [1, 3, 2]: cov = (-1)(-1) + 0 + (1)(0) = 1; var x = 2, var y = 2 -> 0.5
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0])) == pytest.approx(0.5)
    assert pearson(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 2.0])) == 0.0


def test_centering_makes_mean_demonstration_score_zero(tiny_dir, tokenizer):
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    demos = [
        encode_chat(
            tokenizer,
            [{"role": "user", "content": f"question {i}"}],
            [{"role": "assistant", "content": "answer " * (i + 1)}],
            64,
        ).input_ids
        for i in range(7)
    ]
    before = score_sequences(model, tokenizer, demos, batch_size=3)
    offset = center_rewards(model, tokenizer, demos, batch_size=3)
    after = score_sequences(model, tokenizer, demos, batch_size=3)
    assert offset == pytest.approx(before.mean().item(), abs=1e-5)
    assert after.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert model.config.reward_offset == offset
    # unchanged differences: centring only shifts
    assert torch.allclose(after - after[0], before - before[0], atol=1e-5)


def test_score_sequences_keeps_input_order_despite_length_sorting(tiny_dir, tokenizer):
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    sequences = [[5, 6, 7, 8, 9], [5], [5, 6, 7]]
    batched = score_sequences(model, tokenizer, sequences, batch_size=2)
    alone = torch.stack([score_sequences(model, tokenizer, [s], batch_size=1)[0] for s in sequences])
    assert torch.allclose(batched, alone, atol=1e-5)


def test_reward_loss_is_bradley_terry_plus_lm_coef_times_imitation_loss(tiny_dir, tokenizer):
    from rlhf.losses import bradley_terry_loss
    from rlhf.reward import RewardConfig, encode_pairs, train_reward_model

    examples = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "chosen": [{"role": "assistant", "content": f"good {i}"}],
            "rejected": [{"role": "assistant", "content": f"bad answer {i}"}],
        }
        for i in range(2)
    ]
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    logged = {}
    config = RewardConfig(
        steps=1, batch_size=2, lr=0.0, warmup_steps=0, scheduler="constant", lm_coef=0.7, margin=0.5, max_length=64
    )
    train_reward_model(model, tokenizer, examples, config, lambda m, s: logged.update(m), progress=False)
    pairs = encode_pairs(tokenizer, examples, 64)
    chosen = score_sequences(model, tokenizer, [c.input_ids for c, _ in pairs], 4)
    rejected = score_sequences(model, tokenizer, [r.input_ids for _, r in pairs], 4)
    expected = bradley_terry_loss(chosen, rejected, margin=0.5).item() + 0.7 * logged["rm/lm_loss"]
    assert logged["rm/loss"] == pytest.approx(expected, abs=1e-5)
    assert logged["rm/lm_loss"] > 0
