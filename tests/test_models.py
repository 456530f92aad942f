"""Tokenisation, masks, padding and the reward model's read-out position."""

import copy

import pytest
import torch

from rlhf.models import (
    encode_chat,
    encode_prompt,
    load_scalar_model,
    pad,
    position_ids_from_mask,
    response_mask_from_tokens,
    sequence_scores,
    token_scores,
)


def test_tokenizer_pad_is_not_eos_and_template_has_no_default_system_prompt(tokenizer):
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_encode_chat_masks_the_assistant_response_and_ends_at_eos(tokenizer):
    prompt = [{"role": "user", "content": "Hi"}]
    encoded = encode_chat(tokenizer, prompt, [{"role": "assistant", "content": "Hello there"}], max_length=64)
    target = [t for t, m in zip(encoded.input_ids, encoded.response_mask, strict=True) if m]
    assert tokenizer.decode(target) == "Hello there<|im_end|>"
    assert encoded.input_ids[-1] == tokenizer.eos_token_id
    assert encoded.input_ids[: len(encode_prompt(tokenizer, prompt, 64))] == encode_prompt(tokenizer, prompt, 64)


def test_encode_chat_user_turns_inside_a_response_are_not_targets(tokenizer):
    response = [
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "B"},
        {"role": "assistant", "content": "C"},
    ]
    encoded = encode_chat(tokenizer, [{"role": "user", "content": "Q"}], response, max_length=128)
    target = tokenizer.decode([t for t, m in zip(encoded.input_ids, encoded.response_mask, strict=True) if m])
    assert target == "A<|im_end|>\nC<|im_end|>"


def test_encode_chat_truncates_from_the_left(tokenizer):
    encoded = encode_chat(
        tokenizer,
        [{"role": "user", "content": "word " * 100}],
        [{"role": "assistant", "content": "end"}],
        max_length=10,
    )
    assert len(encoded.input_ids) == 10 and encoded.input_ids[-1] == tokenizer.eos_token_id


def test_response_mask_keeps_eos_even_when_pad_equals_eos():
    eos = 2
    # [r1, EOS, PAD] where PAD has the EOS id: the first EOS is real, the one after is padding
    mask, ended = response_mask_from_tokens(torch.tensor([[7, eos, eos], [7, 8, 9]]), eos)
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert ended.tolist() == [True, False]


def test_position_ids_from_left_padded_mask():
    assert position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])).tolist() == [
        [0, 0, 0, 1, 2],
        [0, 1, 2, 3, 4],
    ]


@pytest.fixture(scope="module")
def reward_model(tiny_dir):
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    return model.eval()


def test_pad_equals_eos_trap_reward_read_at_second_eos(tiny_dir, tokenizer, reward_model):
    trap = copy.deepcopy(tokenizer)
    trap.pad_token = trap.eos_token  # as the base model's tokenizer ships
    eos = trap.eos_token_id
    assert trap.pad_token_id == eos
    p1, p2, r1 = 100, 101, 102
    sequences = [[p1, p2, eos, r1, eos], [p1, p2, eos, r1, eos, r1]]
    input_ids, attention_mask = pad(trap, sequences, "right")
    assert input_ids[0].tolist() == [p1, p2, eos, r1, eos, eos]  # [p1, p2, EOS, r1, EOS, PAD]
    assert attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0]  # both EOS kept, the pad masked
    with torch.no_grad():
        per_token = token_scores(reward_model, input_ids, attention_mask)
        scores = sequence_scores(reward_model, input_ids, attention_mask)
    assert scores[0].item() == pytest.approx(per_token[0, 4].item(), abs=1e-6)
    # comparing ids with the pad id (what an id-based read-out does) would stop at r1 or the first EOS
    assert scores[0].item() != pytest.approx(per_token[0, 3].item(), abs=1e-3)
    assert scores[0].item() != pytest.approx(per_token[0, 2].item(), abs=1e-3)


@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_score_alone_equals_score_in_padded_batch(tokenizer, reward_model, side):
    short = encode_chat(
        tokenizer, [{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": "Hello"}], 64
    ).input_ids
    long = encode_chat(
        tokenizer,
        [{"role": "user", "content": "Tell me more " * 3}],
        [{"role": "assistant", "content": "Sure " * 4}],
        64,
    ).input_ids
    long = (long * 3)[: 2 * len(short)]
    assert len(long) == 2 * len(short)
    with torch.no_grad():
        alone = sequence_scores(reward_model, torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long))
        input_ids, attention_mask = pad(tokenizer, [short, long], side)
        batched = sequence_scores(reward_model, input_ids, attention_mask)
    assert batched[0].item() == pytest.approx(alone.item(), abs=1e-5)
