"""Kind heads (rlhf.models.kind_heads): a score per kind of data mixed by a learned kind gate; by hand, then through
the loader, the scorers and the reward model's trainer."""

import dataclasses
import math

import pytest
import torch

from rlhf.data.kinds import training_kinds
from rlhf.models.kind_heads import head_kinds, mix, output_count, own_kind_scores, read_scores
from rlhf.models.loading import load_scalar_model
from rlhf.models.shared_prompt import score_groups, score_sequences
from rlhf.reward.trainer import RewardConfig, encode_pairs, train_reward_model
from rlhf.runtime.device import Runtime
from rlhf.training import supervised

KINDS = ["harmless", "helpful"]


def test_the_reward_mixes_the_kinds_scores_by_the_gate_by_hand():
    # scores (1, 3), gate logits (0, ln 3): softmax (1/4, 3/4), reward 1/4 + 9/4 = 2.5
    outputs = torch.tensor([[1.0, 3.0, 0.0, math.log(3.0)]])
    assert mix(outputs, 2).tolist() == [pytest.approx(2.5)]
    assert mix(torch.tensor([[0.7]]), 0).tolist() == [pytest.approx(0.7)]
    # training reads each response's own kind's score (kind 1: 3, kind 0: 1) and the gate's loss on that kind:
    # -log(3/4) = 0.287682 and -log(1/4) = 1.386294 nats
    scores, nll = own_kind_scores(outputs.repeat(2, 1), torch.tensor([1, 0]), 2)
    assert scores.tolist() == [3.0, 1.0]
    assert nll.tolist() == [pytest.approx(0.287682, abs=1e-6), pytest.approx(1.386294, abs=1e-6)]
    assert own_kind_scores(torch.tensor([[0.7]]), None, 0)[1] is None


def test_a_head_gets_the_training_pairs_kinds_only_when_asked_and_there_are_two():
    rows = [{"kind": "helpful"}, {"kind": "harmless"}, {"kind": "helpful"}]
    assert training_kinds(rows, True) == KINDS and training_kinds(rows, False) == []
    assert training_kinds(rows[:1], True) == [] and (output_count(KINDS), output_count([])) == (4, 1)


def _head_outputs(model, sequences: list[list[int]]) -> torch.Tensor:
    """The head's outputs at each sequence's last token, one sequence at a time: ``(N, outputs)``."""
    rows = []
    for ids in sequences:
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        rows.append(model.score(hidden).detach())
    return torch.stack(rows)


def test_kind_heads_travel_with_the_model_and_every_scorer_reads_their_mixture(tiny_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir, KINDS)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    assert model.score.out_features == 4 and head_kinds(model) == KINDS
    model.save_pretrained(tmp_path)
    again = load_scalar_model(str(tmp_path))  # the kinds come from the saved config
    assert head_kinds(again) == KINDS and torch.equal(again.score.weight, model.score.weight)
    sequences = [tokenizer.encode("hello there, friend"), tokenizer.encode("hello there")]
    outputs = _head_outputs(model, sequences)
    expected = (outputs[:, :2] * torch.softmax(outputs[:, 2:], dim=-1)).sum(-1)
    assert torch.allclose(score_sequences(model, tokenizer, sequences, 2, Runtime()), expected, atol=1e-5)
    assert torch.allclose(score_groups(model, tokenizer, [sequences], 2, Runtime()), expected, atol=1e-5)
    # a row that names its kind is read with that kind's score, in every path; a kind the model lacks: the mix
    own = torch.stack([outputs[0, 1], expected[1]])
    kinds = ["helpful", "general"]
    assert torch.allclose(score_sequences(model, tokenizer, sequences, 2, Runtime(), kinds), own, atol=1e-5)
    assert torch.allclose(score_groups(model, tokenizer, [sequences[:1], sequences[1:]], 2, Runtime(), kinds), own,
                          atol=1e-5)  # fmt: skip
    harmless = score_groups(model, tokenizer, [sequences], 2, Runtime(), ["harmless"])  # a group: one kind
    assert torch.allclose(harmless, outputs[:, 0], atol=1e-5)


def test_a_row_is_read_with_its_own_kinds_score_else_the_mix_by_hand():
    # row 0 names helpful: its score 2; row 1 names a kind the model lacks: the mix of (3, -1) by softmax(5, 0),
    # e^5 / (e^5 + 1) = 0.993307: 3 * 0.993307 - 0.006693 = 2.973228
    outputs = torch.tensor([[1.0, 2.0, 0.0, 0.0], [3.0, -1.0, 5.0, 0.0]])
    assert read_scores(outputs, KINDS, ["helpful", "general"]).tolist() == [2.0, pytest.approx(2.973228, abs=1e-6)]
    assert torch.equal(read_scores(outputs, KINDS), mix(outputs, 2))  # no kinds: the gate's mix
    assert read_scores(torch.tensor([[0.7]]), [], ["helpful"]).tolist() == [pytest.approx(0.7)]  # one output
    with pytest.raises(ValueError, match="1 kinds for 2 rows"):
        read_scores(outputs, KINDS, ["helpful"])


def test_a_pair_trains_its_own_kinds_score_and_the_gate_learns_its_kind(tiny_dir, tokenizer):
    examples = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "chosen": [{"role": "assistant", "content": f"good {i}"}],
            "rejected": [{"role": "assistant", "content": f"bad answer {i}"}],
            "kind": "harmless",
        }
        for i in range(2)
    ]
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir, KINDS)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    config = RewardConfig(
        steps=1, batch_size=2, lr=0.0, warmup_steps=0, scheduler="constant", max_length=64, length_expert=False,
        length_decorrelation=0.0, short_rejections=0.0, kind_heads=True, trainable_layers=None,
    )  # fmt: skip
    logged = {}
    train_reward_model(model, tokenizer, examples, config, lambda m, s: logged.update(m), Runtime(), progress=False)
    pairs = encode_pairs(tokenizer, examples, 64)
    chosen = _head_outputs(model, [c.input_ids for c, _ in pairs])
    rejected = _head_outputs(model, [r.input_ids for _, r in pairs])
    # the Bradley-Terry term reads the harmless score (column 0); the gate's loss is -log softmax(g)[harmless]
    # averaged over the 4 responses
    bradley_terry = -torch.nn.functional.logsigmoid(chosen[:, 0] - rejected[:, 0]).mean()
    gate = -torch.log_softmax(torch.cat([chosen, rejected])[:, 2:], dim=-1)[:, 0].mean()
    assert logged["rm/train_kind_loss"] == pytest.approx(float(gate), abs=1e-5)
    assert logged["rm/loss"] == pytest.approx(float(bradley_terry + gate), abs=1e-5)
    # with a learning rate, harmless pairs move the harmless score and the gate, never the helpful score
    before = model.score.weight.detach().clone()
    more = dataclasses.replace(config, lr=1e-2, steps=2)
    train_reward_model(model, tokenizer, examples, more, lambda m, s: None, Runtime(), progress=False)
    moved = (model.score.weight.detach() != before).any(dim=1).tolist()
    assert moved == [True, False, True, True]


def test_balanced_kinds_give_every_reward_batch_each_kinds_share(tiny_dir, tokenizer, monkeypatch):
    examples = [
        {
            "prompt": [{"role": "user", "content": f"q{i}" + " more" * (20 * (kind == "helpful"))}],
            "chosen": [{"role": "assistant", "content": f"good {i}"}],
            "rejected": [{"role": "assistant", "content": f"bad answer {i}"}],
            "kind": kind,
        }
        for i, kind in enumerate(["harmless", "harmless", "helpful", "helpful", "helpful", "helpful"])
    ]
    batches, original = [], supervised.minibatch_indices

    def recorded(*args):
        batches.append(original(*args))
        return batches[-1]

    monkeypatch.setattr(supervised, "minibatch_indices", recorded)
    config = RewardConfig(
        steps=4, batch_size=3, lr=0.0, warmup_steps=0, scheduler="constant", max_length=64, length_expert=False,
        length_decorrelation=0.0, short_rejections=0.0, kind_heads=True, trainable_layers=None, balance_kinds=True,
    )  # fmt: skip
    train_reward_model(load_scalar_model(tiny_dir, KINDS), tokenizer, examples, config, lambda m, s: None, Runtime(),
                       progress=False)  # fmt: skip
    # two epochs of two batches of 3: one harmless and two helpful pairs each, every pair once an epoch
    assert [sorted(examples[i]["kind"] for i in batch) for batch in batches] == [["harmless", "helpful", "helpful"]] * 4
    assert sorted(batches[0] + batches[1]) == sorted(batches[2] + batches[3]) == list(range(6))
