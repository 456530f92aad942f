"""Short replies of the data as extra rejected responses (rlhf.reward.augment), and how the reward trainer reads
them."""

from __future__ import annotations

import pytest
import torch

from rlhf.reward.augment import AUGMENTED, short_rejections, short_replies

LONG = "Take the wheel off, find the hole with soapy water, roughen it, glue the patch and pump the tyre back up."


def pair(key: str, chosen: str, rejected: str, kind: str = "helpful") -> dict:
    return {
        "id": key,
        "kind": kind,
        "source": "s",
        "prompt": [{"role": "user", "content": f"question {key}"}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def test_short_replies_are_the_datas_own_and_never_the_ones_the_measure_tries():
    examples = [
        pair("a", LONG, "Yes."),
        pair("b", "You're welcome!", "No."),  # "No." is one of the measure's replies: left out
        pair("c", LONG, "Sure,  why?"),  # visible text: "Sure, why?"
        pair("d", LONG, "This one has five words."),  # five words: not short
        pair("e", LONG, "Yes.", kind="harmless"),  # once each, whatever the kind
    ]
    assert short_replies(examples) == ["Sure, why?", "Yes.", "You're welcome!"]


def test_extra_pairs_by_hand_the_share_kinds_and_substantive_chosen_responses():
    examples = [
        pair("a", LONG, "Yes."),  # unit_point("a", salt="short-rejection") = 0.2529
        pair("b", "You're welcome!", "Why?"),  # 0.4611, but its chosen response is short: never
        pair("c", LONG, "It depends, really, I think."),  # 0.1528
        pair("d", LONG, "Maybe.", kind="harmless"),  # 0.0732, but harmless: saying less may be right
        pair("f", LONG, "Nope, sorry."),  # 0.9687
    ]
    pool = short_replies(examples)
    assert pool == ["Maybe.", "Nope, sorry.", "Why?", "Yes.", "You're welcome!"]
    extra = short_rejections(examples, 0.3, ["helpful"])  # a (0.2529) and c (0.1528) are below 0.3
    assert [e["id"] for e in extra] == ["a+short", "c+short"]
    # the reply: pool[int(unit_point(id, salt="short-reply") * 5)]: a 0.6954 -> 3, c 0.6061 -> 3
    assert [e["rejected"][0]["content"] for e in extra] == ["Yes.", "Yes."]
    assert all(e[AUGMENTED] and e["chosen"] == examples[0]["chosen"] and e["kind"] == "helpful" for e in extra)
    assert [e["id"] for e in short_rejections(examples, 1.0, ["helpful"])] == ["a+short", "c+short", "f+short"]
    assert short_rejections(examples, 0.0, ["helpful"]) == []
    assert [e["id"] for e in short_rejections(examples, 0.1, ["helpful", "harmless"])] == ["d+short"]
    with pytest.raises(ValueError, match=r"share of short rejections must be in \[0, 1\], got 1.5"):
        short_rejections(examples, 1.5, ["helpful"])


def test_the_trainer_adds_the_extra_pairs_outside_the_length_expert(tiny_dir, tokenizer):
    from rlhf.models.loading import load_scalar_model
    from rlhf.reward.length_bias import fit_length_expert
    from rlhf.reward.trainer import RewardConfig, encode_pairs, response_lengths, train_reward_model
    from rlhf.runtime.device import Runtime

    examples = [pair("a", LONG, "Yes."), pair("c", LONG + " " + LONG, "It depends, really."), pair("f", "Ok.", LONG)]
    torch.manual_seed(0)
    config = RewardConfig(steps=1, batch_size=5, lr=0.0, scheduler="constant", warmup_steps=0, max_length=96,
                          short_rejections=1.0, short_rejection_kinds=("helpful",))  # fmt: skip
    summary = train_reward_model(
        load_scalar_model(tiny_dir), tokenizer, examples, config, lambda m, s: None, Runtime(), progress=False
    )
    # a and c have substantive chosen responses: two extra pairs; the expert is fitted on the three real ones
    assert summary["rm/short_rejections"] == 2.0 and summary["rm/train_pairs"] == 5.0
    lengths = response_lengths(encode_pairs(tokenizer, examples, 96))
    assert summary["rm/length_expert_weight"] == pytest.approx(fit_length_expert(*lengths))
