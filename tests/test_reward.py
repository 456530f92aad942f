"""Reward-model measurements on hand-made score lists, and centring on the demonstrations."""

import math

import pytest
import torch

from rlhf.data.chat import encode_chat
from rlhf.models.loading import load_scalar_model
from rlhf.models.shared_prompt import score_sequences
from rlhf.reward.metrics import expected_calibration_error, pearson, preference_metrics
from rlhf.reward.trainer import center_rewards
from rlhf.runtime.device import Runtime


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
    before = score_sequences(model, tokenizer, demos, 3, Runtime())
    offset = center_rewards(model, tokenizer, demos, 3, Runtime())
    after = score_sequences(model, tokenizer, demos, 3, Runtime())
    assert offset == pytest.approx(before.mean().item(), abs=1e-5)
    assert after.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert model.config.reward_offset == offset
    # unchanged differences: centring only shifts
    assert torch.allclose(after - after[0], before - before[0], atol=1e-5)


def test_score_sequences_keeps_input_order_despite_length_sorting(tiny_dir, tokenizer):
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    sequences = [[5, 6, 7, 8, 9], [5], [5, 6, 7]]
    batched = score_sequences(model, tokenizer, sequences, 2, Runtime())
    alone = torch.stack([score_sequences(model, tokenizer, [s], 1, Runtime())[0] for s in sequences])
    assert torch.allclose(batched, alone, atol=1e-5)


def test_reward_loss_is_bradley_terry_plus_lm_coef_times_imitation_loss(tiny_dir, tokenizer):
    from rlhf.losses import bradley_terry_loss
    from rlhf.reward.trainer import RewardConfig, encode_pairs, train_reward_model

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
        steps=1,
        batch_size=2,
        lr=0.0,
        warmup_steps=0,
        scheduler="constant",
        lm_coef=0.7,
        trainable_layers=None,  # the imitation term trains the blocks
        margin=0.5,
        max_length=64,
        length_expert=False,
        length_decorrelation=0.0,
    )
    summary = train_reward_model(
        model, tokenizer, examples, config, lambda m, s: logged.update(m), Runtime(), progress=False
    )
    assert summary["rm/train_pairs"] == 2.0 and summary["rm/epochs"] == 1.0  # 1 step x 2 pairs of 2: each pair once
    pairs = encode_pairs(tokenizer, examples, 64)
    chosen = score_sequences(model, tokenizer, [c.input_ids for c, _ in pairs], 4, Runtime())
    rejected = score_sequences(model, tokenizer, [r.input_ids for _, r in pairs], 4, Runtime())
    expected = bradley_terry_loss(chosen, rejected, margin=0.5).item() + 0.7 * logged["rm/lm_loss"]
    assert logged["rm/loss"] == pytest.approx(expected, abs=1e-5)
    assert logged["rm/lm_loss"] > 0


def test_empty_response_metrics_by_hand():
    from rlhf.reward.length_bias import empty_response_metrics

    # empty [0.5, -1.0, 2.0] vs chosen [0.0, 0.0, 3.0]: means 0.5 and 1.0; empty wins on prompt 0 only -> 1/3
    # reply 1 [1, 1, 1] wins on prompts 0, 1 -> 2/3; reply 2 [-1, -1, 4] on prompt 2 -> 1/3: mean 1/2, max 2/3
    replies = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 4.0]])
    metrics = empty_response_metrics(torch.tensor([0.5, -1.0, 2.0]), replies, torch.tensor([0.0, 0.0, 3.0]))
    assert metrics == pytest.approx(
        {
            "rm/empty_score_mean": 0.5,
            "rm/chosen_score_mean": 1.0,
            "rm/empty_beats_chosen": 1 / 3,
            "rm/short_reply_beats_chosen": 1 / 2,
            "rm/short_reply_beats_chosen_max": 2 / 3,
        }
    )


def test_preference_metrics_ties_intervals_and_length_bias_by_hand():
    from rlhf.stats import TiesWarning

    chosen, rejected = torch.tensor([2.0, 1.0, 0.0, 3.0, 1.0]), torch.tensor([1.0, 2.0, -1.0, 3.0, 1.0])
    chosen_lengths, rejected_lengths = torch.tensor([5, 10, 3, 4, 6]), torch.tensor([8, 4, 9, 4, 2])
    # pair 0: right, chosen shorter; 1: wrong, chosen longer; 2: right, chosen shorter;
    # 3: tie, equal lengths (in neither subset); 4: tie, chosen longer
    # accuracy 2 of 3 decisive (a tie used to count as wrong: 2/5 = 0.4); ties 2
    # Wilson 2 of 3: p = 0.666667, z^2/n = 1.280486, den = 2.280486, center = (0.666667 + 0.640243) / 2.280486
    # = 0.573084; half = 1.959964 * sqrt(0.074074 + 0.106707) / 2.280486 = 1.959964 * 0.425183 / 2.280486 = 0.365424
    # -> [0.2077, 0.9385]
    # chosen shorter: pairs 0, 2 -> 2/2 = 1.0 (n 2); chosen longer: pair 1 wrong, pair 4 tied -> 0/1 = 0.0 (n 1)
    with pytest.warns(TiesWarning, match="2 of 5 rm_eval pairs tied"):
        metrics = preference_metrics(chosen, rejected, chosen_lengths, rejected_lengths)
    assert metrics["rm/accuracy"] == pytest.approx(2 / 3)
    assert metrics["rm/accuracy_low"] == pytest.approx(0.2077, abs=5e-5)
    assert metrics["rm/accuracy_high"] == pytest.approx(0.9385, abs=5e-5)
    assert (metrics["rm/pairs"], metrics["rm/ties"]) == (3, 2)
    assert (metrics["rm/accuracy_chosen_shorter"], metrics["rm/pairs_chosen_shorter"]) == (1.0, 2)
    assert (metrics["rm/accuracy_chosen_longer"], metrics["rm/pairs_chosen_longer"]) == (0.0, 1)
    assert metrics["rm/margin"] == pytest.approx((1 - 1 + 1 + 0 + 0) / 5)


def test_preference_metrics_of_a_constant_model_are_undefined_not_zero():
    from rlhf.stats import TiesWarning

    scores = torch.full((4,), 0.25)
    with pytest.warns(TiesWarning, match="4 of 4"):
        metrics = preference_metrics(scores, scores.clone(), torch.tensor([1, 2, 3, 4]), torch.tensor([4, 3, 2, 1]))
    for key in ("rm/accuracy", "rm/accuracy_low", "rm/accuracy_high", "rm/accuracy_chosen_shorter"):
        assert math.isnan(metrics[key]), key
    assert (metrics["rm/pairs"], metrics["rm/ties"]) == (0, 4)
    assert (metrics["rm/pairs_chosen_shorter"], metrics["rm/pairs_chosen_longer"]) == (0, 0)


def test_reward_stage_and_flow_summary_warn_loudly_when_accuracy_includes_chance(capsys, monkeypatch):
    import os

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tasks/, flows/
    from flows.summary import print_summary
    from tasks.reward import summary_lines

    metrics = {
        "rm/accuracy": 0.53,
        "rm/accuracy_low": 0.46,
        "rm/accuracy_high": 0.60,
        "rm/balanced_accuracy": 0.5,
        "rm/balanced_accuracy_low": 0.43,
        "rm/balanced_accuracy_high": 0.57,
        "rm/length_baseline_accuracy": 0.47,
        "rm/pairs": 196.0,
        "rm/ties": 0.0,
        "rm/accuracy_chosen_shorter": 0.4,
        "rm/pairs_chosen_shorter": 90.0,
        "rm/accuracy_chosen_longer": 0.6,
        "rm/pairs_chosen_longer": 100.0,
        "rm/margin": 0.1,
        "rm/loss_last": 0.6,
    }
    expected = (
        "WARNING: rm_eval balanced accuracy 0.50 [0.43, 0.57] includes chance (0.5): the reward model has not "
        "learned to rank"
    )
    lines = summary_lines(metrics)
    assert lines[0].startswith("[reward] rm_eval accuracy 0.530 [0.460, 0.600] (Wilson 95%) over 196 decisive pairs")
    assert lines[1].startswith("[reward] rm_eval balanced accuracy 0.500 [0.430, 0.570] (stratified bootstrap 95%")
    assert lines[-1] == f"[reward] {expected}"
    # the metrics file as the flow reads it back; a balanced accuracy of 0.61 [0.55, 0.67] is clear of chance
    monkeypatch.setenv("COLUMNS", "300")  # a table row on one line
    print_summary({"reward": {**metrics, "seconds": 3.0}})
    out = capsys.readouterr().out
    assert expected in out and "rm/accuracy=0.530 [0.460, 0.600]" in out
    good = {
        **metrics,
        "rm/balanced_accuracy": 0.61,
        "rm/balanced_accuracy_low": 0.55,
        "rm/balanced_accuracy_high": 0.67,
    }
    assert not any("WARNING" in line for line in summary_lines(good))
    print_summary({"reward": good})
    assert "WARNING" not in capsys.readouterr().out
    # a constant model: NaN is written as null in metrics/reward.json
    undefined = {f"rm/{kind}accuracy{end}": None for kind in ("", "balanced_") for end in ("", "_low", "_high")}
    print_summary({"reward": {**metrics, **undefined}})
    out = capsys.readouterr().out
    assert "WARNING: rm_eval balanced accuracy is undefined" in out and "rm/accuracy=n/a" in out


@pytest.mark.parametrize(
    ("kind", "exempt", "term"),
    [(None, ("harmless",), 1.0), ("harmless", ("harmless",), 0.0), ("harmless", (), 1.0)],
    ids=["a-kind-not-exempt", "an-exempt-kind", "nothing-exempt"],
)
def test_the_debiased_loss_adds_the_length_expert_and_the_preference_term(tiny_dir, tokenizer, kind, exempt, term):
    """The trainer's logged loss is :func:`rlhf.reward.length_bias.debiased_pair_loss` of the model's own scores,
    with the length expert fitted on the training pairs (it goes through the product's step, not a copy of it);
    the pairs of a kind ``length_decorrelation_exempt`` names take no length term, their expert kept."""
    from rlhf.reward.length_bias import debiased_pair_loss, fit_length_expert
    from rlhf.reward.trainer import RewardConfig, encode_pairs, response_lengths, train_reward_model

    examples = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "chosen": [{"role": "assistant", "content": "ok " * (i + 1)}],
            "rejected": [{"role": "assistant", "content": "no " * (3 - i)}],
            **({"kind": kind} if kind else {}),
        }
        for i in range(3)
    ]
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    logged = {}
    config = RewardConfig(
        steps=1,
        batch_size=3,
        lr=0.0,
        scheduler="constant",
        warmup_steps=0,
        max_length=64,
        length_decorrelation_exempt=exempt,
    )
    summary = train_reward_model(
        model, tokenizer, examples, config, lambda m, s: logged.update(m), Runtime(), progress=False
    )
    pairs = encode_pairs(tokenizer, examples, 64)
    lengths = response_lengths(pairs)
    assert summary["rm/length_expert_weight"] == pytest.approx(fit_length_expert(*lengths))
    chosen = score_sequences(model, tokenizer, [c.input_ids for c, _ in pairs], 4, Runtime())
    rejected = score_sequences(model, tokenizer, [r.input_ids for _, r in pairs], 4, Runtime())
    expected, preference = debiased_pair_loss(
        chosen, rejected, *(torch.tensor(n) for n in lengths), summary["rm/length_expert_weight"], term, 0.0, count=3
    )
    assert logged["rm/loss"] == pytest.approx(float(expected), abs=1e-5)
    assert logged["rm/train_length_preference"] == pytest.approx(float(preference), abs=1e-5)


def test_a_reader_shorter_than_the_prompt_and_response_it_scores_is_refused_in_one_line():
    from rlhf.data.chat import check_reads_whole

    check_reads_whole("reward.max_length", 320, ("ppo.max_prompt_length", 192), ("generation.max_new_tokens", 128))
    check_reads_whole("models/reward", None, ("ppo.max_prompt_length", 192), ("generation.max_new_tokens", 128))
    with pytest.raises(ValueError) as refused:
        check_reads_whole("judge.max_length", 192, ("ppo.max_prompt_length", 192), ("generation.max_new_tokens", 64))
    assert str(refused.value) == (
        "judge.max_length is 192 tokens, but it scores ppo.max_prompt_length (192) + generation.max_new_tokens "
        "(64) = 256: a prompt and response would be cut; set it to at least 256"
    )


def _pairs_of_four():
    return [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "chosen": [{"role": "assistant", "content": "yes " * words}],
            "rejected": [{"role": "assistant", "content": "no " * (4 - i)}],
        }
        for i, words in enumerate([9, 1, 5, 2])  # not in order of length: the states come back in the pairs' order
    ]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_a_head_trained_alone_reads_the_states_computed_once_as_the_backbone_gives_them(
    tiny_dir, tokenizer, monkeypatch, packed
):
    """``trainable_layers: 0``: the step that reads :func:`frozen_pair_states` gives the loss, the figures and the
    head's gradient of the step that runs the backbone (the same pairs, the same weights), on the packed rows and
    on the plain ones a model that cannot take them reads; a pair that shares its chosen response with another
    (a short rejection's) reads the state that chosen response's one pass gave."""
    import rlhf.models.shared_prompt as shared_prompt
    import rlhf.reward.trainer as trainer
    from rlhf.reward.trainer import RewardConfig, encode_pairs, frozen_pair_states, reward_step

    for module in (trainer, shared_prompt):
        monkeypatch.setattr(module, "can_pack", lambda model: packed)
    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    config = RewardConfig(trainable_layers=0, max_length=64, length_expert=False)
    examples = _pairs_of_four()
    examples.append({**examples[0], "rejected": [{"role": "assistant", "content": "Why?"}]})
    pairs = encode_pairs(tokenizer, examples, 64)
    states = frozen_pair_states(model, tokenizer, pairs, 6, Runtime())  # 6 sequences a pass: the last one shorter
    assert states[0].shape == states[1].shape == (5, model.config.hidden_size)
    results = []
    for cached in (states, None):
        model.zero_grad(set_to_none=True)
        loss, figures = reward_step(model, tokenizer, pairs, config, Runtime(), groups=[0] * 5, states=cached)(
            [1, 3, 4], [0, 1, 2, 3, 4]
        )
        loss.backward()
        results.append((loss.item(), {k: v.item() for k, v in figures.items()}, model.score.weight.grad.clone()))
    (cached_loss, cached_figures, cached_grad), (loss, figures, grad) = results
    assert cached_loss == pytest.approx(loss, abs=1e-6)
    assert cached_figures == pytest.approx(figures, abs=1e-6)
    torch.testing.assert_close(cached_grad, grad, atol=1e-6, rtol=1e-5)
    assert grad.abs().sum() > 0


def test_a_head_trained_alone_leaves_every_backbone_weight_and_the_final_norm_as_they_were(tiny_dir, tokenizer):
    from rlhf.reward.trainer import RewardConfig, train_reward_model

    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = RewardConfig(
        trainable_layers=0, steps=3, batch_size=2, lr=1e-2, warmup_steps=0, max_length=64, group_by_length=False
    )
    summary = train_reward_model(
        model, tokenizer, _pairs_of_four(), config, lambda m, s: None, Runtime(), progress=False
    )
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {"score.weight"}
    assert summary["rm/steps"] == 3.0


def test_an_imitation_term_with_no_block_trained_is_refused():
    from rlhf.reward.trainer import RewardConfig

    with pytest.raises(
        ValueError, match=r"^reward\.lm_coef > 0 trains the backbone's blocks: it needs trainable_layers"
    ):
        RewardConfig(trainable_layers=0, lm_coef=0.5)


def test_a_kind_exempt_from_a_length_term_taken_over_every_kind_is_refused():
    from rlhf.reward.trainer import JudgeConfig, RewardConfig

    RewardConfig(length_by_kind=False, length_decorrelation_exempt=())
    with pytest.raises(ValueError) as refused:
        JudgeConfig(length_by_kind=False)
    assert str(refused.value) == (
        "judge.length_decorrelation_exempt names kinds of data (harmless): it needs length_by_kind: true, which "
        "takes the length term on each kind apart (with length_by_kind: false set it to [])"
    )
