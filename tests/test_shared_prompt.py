"""One prompt, several responses (rlhf.models.shared_prompt): the packed layout by hand, and the packed path computes
what the plain path does, through the reward model's own trainer step and scoring.

In float32 the packed rows run the same blocks over the same tokens at the same positions, but attention sums
over rows of another length in another order: scores, losses and gradients agree within 1e-6 of their scale
(measured: 7e-7 on scores of about 3); under bf16 autocast the packed and plain passes round at different points, so
they agree within bf16's bound of tests/test_levers.py (1e-2 of the scale).
"""

from __future__ import annotations

import copy

import pytest
import torch

import rlhf.reward.trainer as reward_module
from rlhf.data.chat import encode_chat
from rlhf.models.loading import load_scalar_model
from rlhf.models.shared_prompt import common_prefix, pack, score_groups, score_sequences
from rlhf.reward.trainer import RewardConfig, encode_pairs, reward_step
from rlhf.runtime.device import Runtime

FP32, BF16 = Runtime(torch.device("cpu"), "no"), Runtime(torch.device("cpu"), "bf16")
LONG = "Tell me, slowly and in detail, everything you know about the history of the bicycle in Europe. " * 3
EXAMPLES = [
    # a prompt far longer than its responses; the responses share their first words
    {"prompt": [{"role": "user", "content": LONG}], "chosen": [{"role": "assistant", "content": "I can try."}],
     "rejected": [{"role": "assistant", "content": "I can not."}]},
    # a one-token response against a longer one
    {"prompt": [{"role": "user", "content": "Yes or no?"}], "chosen": [{"role": "assistant", "content": "No"}],
     "rejected": [{"role": "assistant", "content": "Yes, certainly, and here is why."}]},
    # a multi-turn prompt
    {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "How do I cook rice?"}],
     "chosen": [{"role": "assistant", "content": "Rinse it, then simmer it covered."}],
     "rejected": [{"role": "assistant", "content": "Burn it."}]},
]  # fmt: skip


def test_pack_lays_out_a_shared_prefix_once_with_restarted_positions_by_hand():
    # [1 2 3 4] and [1 2 5] share [1 2]: one row [1 2 3 4 5], positions [0 1 2 3 2]; [7 8] and [9] share
    # nothing: a row each; [1 2] is a prefix of [1 2 6]: one row [1 2 6], read at positions 1 and 2
    packed = pack([[[1, 2, 3, 4], [1, 2, 5]], [[7, 8], [9]], [[1, 2], [1, 2, 6]]], 0, torch.device("cpu"))
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0], [9, 0, 0, 0, 0], [1, 2, 6, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 2, 0, 0]]
    assert packed.row.tolist() == [0, 0, 1, 2, 3, 3] and packed.last.tolist() == [3, 4, 1, 0, 1, 2]
    # token 5 (position 4) attends to the prefix and itself, not to the other suffix [3 4]
    assert packed.attention_mask[0, 0, 4].tolist() == [True, True, False, False, True]
    assert packed.attention_mask[0, 0, 3].tolist() == [True, True, True, True, False]
    # a pad attends to pads only (never read), and no real token attends to a pad
    assert packed.attention_mask[1, 0, 3].tolist() == [False, False, True, True, False]
    assert not packed.attention_mask[1, 0, :2, 2:].any()
    assert packed.spread([[0, 1, 1, 1], [0, 0, 1], [1, 1], [1], [0, 1], [0, 0, 1]]).tolist() == [
        [False, True, True, True, True], [True, True, False, False, False], [True, False, False, False, False],
        [False, True, True, False, False],
    ]  # fmt: skip
    assert common_prefix([[1, 2, 3]]) == 0 and common_prefix([[1, 2], [1, 2, 3], [1, 4]]) == 1


@pytest.mark.parametrize("runtime, tolerance", [(FP32, 1e-6), (BF16, 1e-2)], ids=["fp32", "bf16"])
def test_scoring_groups_gives_each_sequence_its_plain_score(reward_model, tokenizer, runtime, tolerance):
    pairs = encode_pairs(tokenizer, EXAMPLES, 64)
    cut = encode_pairs(tokenizer, EXAMPLES[2:], 16)[0]  # cut from the left at different offsets: each alone
    assert common_prefix([cut[0].input_ids, cut[1].input_ids]) == 0
    replies = [encode_chat(tokenizer, EXAMPLES[2]["prompt"], [{"role": "assistant", "content": r}], 64).input_ids
               for r in ("", "No.", "OK.")]  # fmt: skip
    groups = [[c.input_ids, r.input_ids] for c, r in [*pairs, cut]] + [replies]
    flat = [s for g in groups for s in g]
    packed = score_groups(reward_model, tokenizer, groups, 3, runtime)
    plain = torch.stack([score_sequences(reward_model, tokenizer, [s], 1, runtime)[0] for s in flat])
    torch.testing.assert_close(packed, plain, rtol=0, atol=tolerance * max(1.0, float(plain.abs().max())))
    positions = sum(map(len, flat))
    shared = positions - sum(common_prefix(g) * (len(g) - 1) for g in groups)
    assert shared < positions  # the prompts ran once


def test_a_model_stored_in_bf16_scores_without_autocast(reward_model, tokenizer):
    # device.frozen_bf16 with mixed_precision no: the states the scorers gather are float32, the head bf16
    groups = [[c.input_ids, r.input_ids] for c, r in encode_pairs(tokenizer, EXAMPLES, 64)]
    flat = [s for g in groups for s in g]
    stored = copy.deepcopy(reward_model).to(torch.bfloat16)
    expected = score_groups(reward_model, tokenizer, groups, 3, FP32)
    for scores in (score_groups(stored, tokenizer, groups, 3, FP32), score_sequences(stored, tokenizer, flat, 2, FP32)):
        assert scores.dtype == torch.float32
        torch.testing.assert_close(scores, expected, rtol=0, atol=5e-2 * max(1.0, float(expected.abs().max())))


@pytest.mark.parametrize("runtime, tolerance", [(FP32, 1e-6), (BF16, 1e-2)], ids=["fp32", "bf16"])
def test_a_reward_step_packed_computes_the_plain_loss_and_gradients(
    tiny_dir, tokenizer, runtime, tolerance, monkeypatch
):
    pairs = encode_pairs(tokenizer, EXAMPLES, 64)
    config = RewardConfig(lm_coef=0.5, margin=0.1, length_decorrelation=1.0, trainable_layers=None)

    def run():
        torch.manual_seed(0)
        scalar = load_scalar_model(tiny_dir).eval()
        loss, metrics = reward_step(scalar, tokenizer, pairs, config, runtime, expert_weight=-0.7)([0, 2], [0, 1, 2])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in scalar.named_parameters() if p.grad is not None}
        return loss.detach(), metrics, grads

    packed = run()
    monkeypatch.setattr(reward_module, "can_pack", lambda model: False)
    plain = run()
    torch.testing.assert_close(packed[0], plain[0], rtol=tolerance, atol=tolerance)
    for key, value in plain[1].items():
        torch.testing.assert_close(packed[1][key], value, rtol=tolerance, atol=tolerance, msg=key)
    assert sorted(packed[2]) == sorted(plain[2])
    for name, grad in plain[2].items():
        scale = max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(packed[2][name], grad, rtol=0, atol=tolerance * scale, msg=name)
