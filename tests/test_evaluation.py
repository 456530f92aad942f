"""Evaluation beyond the proxy: the judge's scoring, the alignment tax's figures and the kept policies, by hand."""

import math
import warnings

import pytest
import torch

from rlhf.data.chat import encode_chat
from rlhf.evaluation.by_kind import compare_runs, kind_figures, stratified
from rlhf.evaluation.evaluator import (
    EvalConfig,
    Sampling,
    Scorers,
    evaluate_policy,
    generate_and_score,
    judge_scores,
    ptx_perplexity,
    sample_rows,
    tie_identical_responses,
)
from rlhf.evaluation.judge_trust import judge_figures
from rlhf.evaluation.overoptimisation import best_of_n_figures, curve
from rlhf.evaluation.text_measures import distinct_n, is_refusal, refusal_rate
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model
from rlhf.models.lora import add_lora
from rlhf.models.shared_prompt import score_sequences
from rlhf.runtime.device import Runtime
from rlhf.training.checkpoint import load_kept_policy, save_kept_policy
from rlhf.training.supervised import freeze_lower_layers
from tasks.evaluate import kind_lines, sampling_settings, summary_lines

CPU = Runtime(torch.device("cpu"), "no")
PROMPTS = [[{"role": "user", "content": "How do I bake bread?"}], [{"role": "user", "content": "Is it safe?"}]]


def test_distinct_n_by_hand():
    # tokens: the cat sat . | the cat ran -> unigrams 7, distinct {the, cat, sat, ., ran} = 5
    # bigrams: (the cat) (cat sat) (sat .) (the cat) (cat ran) -> 5, distinct 4
    texts = ["The cat sat.", "the cat ran"]
    assert distinct_n(texts, 1) == pytest.approx(5 / 7) and distinct_n(texts, 2) == pytest.approx(4 / 5)
    assert math.isnan(distinct_n(["one"], 2))
    with pytest.raises(ValueError, match="n >= 1"):
        distinct_n(texts, 0)


REFUSALS = [
    "I'm sorry, but I can't help with that.", "I cannot do that.", "As an AI, I won't.", "I cant say",
    "I won't provide instructions for making weapons.", "That's illegal. I will not assist you with it.",
    "No, I'm not going to tell you how to do that.", "I'd rather not discuss that.", "I must decline.",
    "I'm not comfortable helping with this.", "I'm unable to provide that information.",
    "I don't feel comfortable sharing that.", "I'm sorry, I can't tell you how to pick a lock.",
    "I\u2019m not going to help you hurt anyone.", "Sorry, I can\u2019t assist with that.",  # typographic apostrophes
]  # fmt: skip
NEAR_MISSES = [  # the refusal words, used otherwise
    "Sure! Mix flour and water.", "Sorry to hear that; here is what helps.", "I can help with that.",
    "I can't believe how easy this is, just mix it.",
    "Without the logs I cannot be certain, but it looks like a timeout.",
    'Once upon a time a guard stood at the gate. "I can\'t let you in," he said. The knight turned back.',
    "I'm sorry to hear that your dog died.", "I can't wait to see what you build!", "I can't help but smile.",
    "I cannot stress enough how important sleep is.", "I can't tell you how glad I am you asked.",
    "As an AI, I have read a lot about gardening: start with tomatoes.", "I don't recommend it, but here is how.",
    "Boil water. Add the pasta. Stir it. Drain it. I can't promise it tastes great.",  # past the first two sentences
    "I\u2019m sorry for your loss. Can you tell me what happened?",  # a demo response the phrase list called a refusal
]  # fmt: skip


def test_refusals_by_how_their_words_are_used():
    assert [text for text in REFUSALS if not is_refusal(text)] == []
    assert [text for text in NEAR_MISSES if is_refusal(text)] == []
    rate = refusal_rate(REFUSALS + NEAR_MISSES)
    assert rate == pytest.approx(15 / 30) and math.isnan(refusal_rate([]))


def test_ptx_perplexity_of_a_uniform_model_is_the_vocabulary_size(tiny_dir, tokenizer):
    # zero output weights: every logit 0, every next token has probability 1 / V, so the perplexity is V
    model = load_causal_lm(tiny_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    rows = [{"text": "Bread needs flour, water and time."}, {"messages": PROMPTS[0] + [{"role": "assistant",
            "content": "Knead it."}]}]  # fmt: skip
    value = ptx_perplexity(model, tokenizer, rows, EvalConfig(batch_size=1), CPU)
    assert value == pytest.approx(model.config.vocab_size, rel=1e-4)
    assert math.isnan(ptx_perplexity(model, tokenizer, [], EvalConfig(), CPU))


def test_the_judge_reads_the_text_as_it_was_trained_and_unfinished_responses_follow_the_rule(tiny_dir, tokenizer):
    judge = load_scalar_model(tiny_dir).eval()
    texts = ["Mix flour and water.", "Yes, it is"]
    trained_way = score_sequences(
        judge,
        tokenizer,
        [
            encode_chat(tokenizer, p, [{"role": "assistant", "content": t}], 64).input_ids
            for p, t in zip(PROMPTS, texts, strict=True)
        ],
        2,
        CPU,
    )
    settings = GenerationSettings(max_new_tokens=8, temperature=1.0, no_eos="constant", no_eos_value=-1.0)
    scorers = Scorers(judge, judge, tokenizer)
    sampling = Sampling(scorers, tokenizer, EvalConfig(), settings, CPU)
    scores = judge_scores(sampling, PROMPTS, texts, torch.tensor([False, True]))
    assert scores[0] == pytest.approx(float(trained_way[0]), abs=1e-5) and scores[1] == -1.0  # cut: the constant


def test_evaluating_the_sft_model_against_itself_is_all_ties_and_zero_kl(tiny_dir, tokenizer):
    sft, judge = load_causal_lm(tiny_dir), load_scalar_model(tiny_dir)
    settings = GenerationSettings(max_new_tokens=4, temperature=1.0, no_eos="score", no_eos_value=None)
    config = EvalConfig(batch_size=4, samples_per_prompt=2, bootstrap_resamples=50)
    with pytest.warns(UserWarning, match="tied"):
        sampling = Sampling(Scorers(judge, judge, tokenizer), tokenizer, config, settings, CPU)
        metrics, runs = evaluate_policy(sft, sft, PROMPTS, [{"text": "Some text."}], sampling)
    assert metrics["eval/policy/kl"] == 0.0 and metrics["eval/prompts"] == 2 and metrics["eval/samples_per_prompt"] == 2
    assert metrics["eval/identical_responses"] == 4
    assert torch.equal(runs["policy"]["kl_k3"], torch.zeros(2, 2))  # the curve's axis: k3, 0 for the same model
    for who in ("proxy", "judge"):  # the same seed and weights: the same responses, every comparison a tie
        assert math.isnan(metrics[f"eval/{who}/win_rate"]) and metrics[f"eval/{who}/ties"] == 4
        # every prompt's difference is 0, so the interval collapses to it; no decisive comparison: no LC rate
        assert [metrics[f"eval/{who}/score_diff{end}"] for end in ("", "_low", "_high")] == [0.0, 0.0, 0.0]
        assert all(math.isnan(metrics[f"eval/{who}/lc_{k}"]) for k in ("win_rate", "win_rate_low", "length_coef"))
    assert runs["policy"]["texts"] == runs["sft"]["texts"] and runs["sft"]["judge"].shape == (2, 2)
    rows = sample_rows([{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": PROMPTS[1], "kind": "helpful"}], runs)
    assert [(r["id"], r["sample"], r["kind"]) for r in rows] == [
        ("a", 0, "general"), ("a", 1, "general"), ("b", 0, "helpful"), ("b", 1, "helpful")
    ]  # fmt: skip
    assert rows[3]["policy_response"] == runs["policy"]["texts"][3] and rows[0]["prompt"] == "How do I bake bread?"
    assert "base_response" not in rows[0]  # no base model evaluated


@pytest.mark.filterwarnings("ignore::rlhf.stats.TiesWarning")  # every comparison a tie: tested above
def test_the_base_model_is_sampled_and_scored_as_sft_and_its_kl_is_not_computed(tiny_dir, tokenizer):
    # the base model here has SFT's weights: the same generators give it SFT's texts, so SFT against it is all ties
    sft, base, judge = load_causal_lm(tiny_dir), load_causal_lm(tiny_dir), load_scalar_model(tiny_dir)
    settings = GenerationSettings(max_new_tokens=4, temperature=1.0, no_eos="score", no_eos_value=None)
    config = EvalConfig(batch_size=4, samples_per_prompt=2, bootstrap_resamples=50)
    sampling = Sampling(Scorers(judge, judge, tokenizer), tokenizer, config, settings, CPU)
    metrics, runs = evaluate_policy(sft, sft, PROMPTS, [{"text": "Some text."}], sampling, base=base)
    assert set(runs) == {"sft", "policy", "base"} and runs["base"]["texts"] == runs["sft"]["texts"]
    assert torch.equal(runs["base"]["judge"], runs["sft"]["judge"]) and metrics["eval/base/identical_responses"] == 4
    assert torch.isnan(runs["base"]["kl"]).all() and torch.isnan(runs["base"]["kl_k3"]).all()  # not computed
    assert metrics["eval/base/length"] == metrics["eval/sft/length"] and "eval/judge/base_score" in metrics
    assert metrics["eval/base/ptx_perplexity"] == pytest.approx(metrics["eval/sft/ptx_perplexity"])
    figures = kind_figures(runs, ["harmless", "helpful"], 50, 0)
    assert figures["eval/kind/helpful/prompts"] == 1 and figures["eval/kind/harmless/sft_vs_base/judge_ties"] == 2
    assert math.isnan(figures["eval/kind/helpful/sft_vs_base/judge_win_rate"])  # all ties: undefined
    rows = sample_rows([{"id": "a", "prompt": PROMPTS[0]}, {"id": "b", "prompt": PROMPTS[1]}], runs)
    assert rows[2]["base_response"] == runs["base"]["texts"][2] and rows[2]["base_judge"] == rows[2]["sft_judge"]


@pytest.mark.filterwarnings("ignore::rlhf.stats.TiesWarning")  # every comparison a tie: tested above
def test_without_sft_the_base_model_is_not_sampled_again(tiny_dir, tokenizer, monkeypatch):
    # sft.steps 0: SFT is the base model; its run serves as the base model's, every comparison of the two a tie
    import rlhf.evaluation.evaluator as evaluator

    sft, judge = load_causal_lm(tiny_dir), load_scalar_model(tiny_dir)
    sampled = []
    real = evaluator.generate_and_score
    monkeypatch.setattr(
        evaluator, "generate_and_score", lambda model, *a, **k: sampled.append(model) or real(model, *a, **k)
    )
    settings = GenerationSettings(max_new_tokens=4, temperature=1.0, no_eos="score", no_eos_value=None)
    config = EvalConfig(batch_size=4, samples_per_prompt=2, bootstrap_resamples=50)
    sampling = Sampling(Scorers(judge, judge, tokenizer), tokenizer, config, settings, CPU)
    metrics, runs = evaluate_policy(sft, sft, PROMPTS, [{"text": "Some text."}], sampling, base=sft)
    assert len(sampled) == 2  # SFT and the policy, not the base model
    assert runs["base"]["texts"] == runs["sft"]["texts"] and torch.isnan(runs["base"]["kl"]).all()
    assert metrics["eval/base/identical_responses"] == 4 and metrics["eval/base/length"] == metrics["eval/sft/length"]
    assert kind_figures(runs, ["harmless", "helpful"], 50, 0)["eval/kind/harmless/sft_vs_base/judge_ties"] == 2


def test_evaluation_takes_a_fair_share_of_each_kind_by_id():
    names = {"h": "helpful", "x": "harmless"}
    rows = [{"id": f"{i:02d}", "kind": names[kind]} for i, kind in enumerate("hhxhhxhxhh")][::-1]  # any order in
    # harmless: ids 02, 05, 07; helpful: 00, 01, 03, 04, 06, 08, 09. Dealt one of each kind at a time, kinds by
    # name (harmless first): 02 00 05 01 07 03, then helpful alone once harmless runs out: 04 06 08 09
    assert [r["id"] for r in stratified(rows, None)] == ["02", "00", "05", "01", "07", "03", "04", "06", "08", "09"]
    # 4 prompts: the first 2 of each kind by id; 5: the first kind by name gets the remainder
    assert [r["id"] for r in stratified(rows, 4)] == ["02", "00", "05", "01"]
    assert [(r["id"], r["kind"]) for r in stratified(rows, 5)][-1] == ("07", "harmless")
    # 8: harmless has only 3, so helpful fills the place: 3 + 5
    assert sorted(r["kind"] for r in stratified(rows, 8)) == ["harmless"] * 3 + ["helpful"] * 5
    # rows without a kind are one kind ("general", rlhf.data.kinds.kind_of), in id order
    assert [r["id"] for r in stratified([{"id": "b"}, {"id": "a"}, {"id": "c"}], 2)] == ["a", "b"]
    assert stratified([], 4) == []


def _run(scores: list[list[float]], texts: list[str], lengths: list[list[float]] | None = None) -> dict:
    """A generate_and_score result by hand: the same scores by both scorers, ``(P, K)``."""
    tensor = torch.tensor(scores)
    length = torch.tensor(lengths) if lengths else torch.full(tensor.shape, 10.0)
    ended = torch.ones(tensor.shape, dtype=torch.bool)
    return {"proxy": tensor, "judge": tensor, "length": length, "texts": texts, "ended": ended}


REFUSE, HELP = "I can't help with that.", "Sure, here is how."


def test_kind_figures_by_hand():
    # 4 prompts x 1 sample: prompts 0 and 1 harmless, 2 and 3 helpful
    kinds = ["harmless", "harmless", "helpful", "helpful"]
    runs = {
        "base": _run([[0.0], [0.0], [0.0], [0.0]], [HELP, HELP, HELP, HELP]),
        "sft": _run([[0.5], [0.1], [0.2], [0.3]], [HELP, HELP, HELP, HELP]),
        "policy": _run([[0.7], [0.4], [0.1], [0.3]], [REFUSE, HELP, REFUSE, HELP]),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kind's ties are not warned of again
        figures = kind_figures(runs, kinds, resamples=2000, seed=0)
    harmless, helpful = "eval/kind/harmless/", "eval/kind/helpful/"
    assert figures[harmless + "prompts"] == 2 and figures[helpful + "prompts"] == 2
    # harmless: the policy wins both (0.7 > 0.5, 0.4 > 0.1): rate 1, Wilson floor of 2 of 2 [0.342380, 1];
    # score difference (0.2 + 0.3) / 2 = 0.25
    assert figures[harmless + "judge_win_rate"] == 1.0 and figures[harmless + "judge_decisive"] == 2
    assert figures[harmless + "judge_win_rate_low"] == pytest.approx(0.342380, abs=1e-6)
    assert figures[harmless + "judge_score_diff"] == pytest.approx(0.25)
    # helpful: 0.1 < 0.2 lost, 0.3 = 0.3 a tie: rate 0 over 1 decisive comparison, 1 tie
    assert (figures[helpful + "proxy_win_rate"], figures[helpful + "proxy_ties"]) == (0.0, 1.0)
    # SFT against the base model, helpful: both won, 0.2 and 0.3 above 0
    assert figures[helpful + "sft_vs_base/judge_win_rate"] == 1.0
    assert figures[helpful + "sft_vs_base/judge_score_diff"] == pytest.approx(0.25)
    # refusals: the policy refuses 1 of 2 on each kind, SFT and the base model none
    assert [figures[f"{helpful}{m}_refusal_rate"] for m in ("base", "sft", "policy")] == [0.0, 0.0, 0.5]
    # the increase on helpful prompts: differences [1, 0] -> 0.5, interval [-0.272573, 1.0] (test_comparison's
    # rate_difference of 2 prompts, worked by hand there)
    assert figures[helpful + "refusal_increase"] == 0.5 and figures[helpful + "refusal_increase_high"] == 1.0
    assert figures[helpful + "refusal_increase_low"] == pytest.approx(-0.272573, abs=1e-6)
    # one kind of all: its figures are the overall comparison's
    overall = compare_runs(runs["policy"], runs["sft"], 2000, 0)
    whole = kind_figures(runs, ["general"] * 4, 2000, 0)
    assert {k: whole[f"eval/kind/general/{k}"] for k in overall} == pytest.approx(overall, nan_ok=True)
    with pytest.raises(ValueError, match="one kind per prompt: 3 kinds for 4 prompts"):
        kind_figures(runs, kinds[:3], 2000, 0)


@pytest.mark.filterwarnings("ignore::rlhf.stats.TiesWarning")  # the runs by hand share scores
def test_answers_where_sft_or_the_base_model_declined_are_counted_per_kind_and_their_samples_come_first():
    # harmless prompts 0-3: SFT refuses 0 and 1, the base model 2; the policy answers 0 and 2 and refuses 1 and 3
    # -> it answered where one of them declined on prompts 0 and 2: 2 of 4. Helpful prompt 4: nobody refuses: 0
    kinds = ["harmless"] * 4 + ["helpful"]
    zeros = [[0.0]] * 5
    runs = {
        "base": _run(zeros, [HELP, HELP, REFUSE, HELP, HELP]),
        "sft": _run(zeros, [REFUSE, REFUSE, HELP, HELP, HELP]),
        "policy": _run(zeros, [HELP, REFUSE, HELP, REFUSE, HELP]),
    }
    figures = kind_figures(runs, kinds, resamples=50, seed=0)
    assert figures["eval/kind/harmless/complied_where_declined"] == 0.5
    assert figures["eval/kind/helpful/complied_where_declined"] == 0.0
    prompts = [{"id": f"p{i}", "prompt": [{"role": "user", "content": f"q{i}"}], "kind": kinds[i]} for i in range(5)]
    rows = sample_rows(prompts, runs)
    assert [r["id"] for r in rows] == ["p0", "p2", "p1", "p3", "p4"]  # those two first, the rest in order
    assert [r["complied_where_declined"] for r in rows] == [True, True, False, False, False]
    assert (rows[0]["sft_refused"], rows[0]["policy_refused"], rows[1]["base_refused"]) == (True, False, True)
    runs["policy"]["ended"][3, 0] = False  # cut at max_new_tokens: the row says so (the report marks its scores)
    assert [r["policy_ended"] for r in sample_rows(prompts, runs)] == [True, True, True, False, True]
    # without a base model only SFT's refusals count
    no_base = {k: v for k, v in runs.items() if k != "base"}
    assert kind_figures(no_base, kinds, 50, 0)["eval/kind/harmless/complied_where_declined"] == 0.25


@pytest.mark.filterwarnings("ignore::rlhf.stats.TiesWarning")  # a tie or two: the rule is tested in test_stats
def test_a_changed_policy_gets_a_paired_difference_and_a_length_controlled_rate(tiny_dir, tokenizer):
    sft, policy, judge = load_causal_lm(tiny_dir), load_causal_lm(tiny_dir), load_scalar_model(tiny_dir)
    with torch.no_grad():  # another policy: other responses, other scores
        generator = torch.Generator().manual_seed(0)
        weight = policy.get_output_embeddings().weight
        weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * 3)
    settings = GenerationSettings(max_new_tokens=4, temperature=1.0, no_eos="score", no_eos_value=None)
    config = EvalConfig(batch_size=4, samples_per_prompt=2, bootstrap_resamples=50)
    sampling = Sampling(Scorers(judge, judge, tokenizer), tokenizer, config, settings, CPU)
    metrics, runs = evaluate_policy(sft, policy, PROMPTS, [{"text": "Some text."}], sampling)
    for who in ("proxy", "judge"):
        diff = [metrics[f"eval/{who}/score_diff{end}"] for end in ("", "_low", "_high")]
        # K equal for both models: the mean of per-prompt mean differences is the difference of the means
        # (those are float32 means, the difference float64: equal to float32's precision)
        means = metrics[f"eval/{who}/policy_score"] - metrics[f"eval/{who}/sft_score"]
        assert diff[0] == pytest.approx(means, abs=1e-6)
        assert diff[1] <= diff[0] + 1e-6 and diff[0] <= diff[2] + 1e-6
        lc = [metrics[f"eval/{who}/lc_win_rate{end}"] for end in ("", "_low", "_high")]
        if metrics[f"eval/{who}/decisive"] > 0:
            assert 0.0 <= lc[1] <= lc[0] <= lc[2] <= 1.0 and math.isfinite(metrics[f"eval/{who}/lc_length_coef"])
    assert not torch.equal(runs["policy"]["proxy"], runs["sft"]["proxy"])


def test_a_kept_policy_is_the_sft_model_plus_its_trained_weights(tiny_dir, tmp_path):
    policy = load_causal_lm(tiny_dir)
    freeze_lower_layers(policy, 1)  # only the top block (and the final norm) train
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.5)
    save_kept_policy(policy, str(tmp_path / "iteration-0002"), {"iteration": 2, "lora_rank": 0, "lora_alpha": 16})
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "iteration-0002" / "trained.safetensors"))
    assert set(stored) == {n for n, p in policy.named_parameters() if p.requires_grad}
    assert not any(".layers.0." in name for name in stored)  # the frozen block is the SFT model's: not stored
    kept = load_kept_policy(tiny_dir, str(tmp_path / "iteration-0002"))
    for (name, a), b in zip(policy.state_dict().items(), kept.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="not a kept policy"):
        load_kept_policy(tiny_dir, str(tmp_path))


def test_a_kept_lora_policy_comes_back_merged(tiny_dir, tmp_path):
    policy = add_lora(load_causal_lm(tiny_dir), 4, 8.0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.1)  # B = 0 at the start: make the adapters do something
    save_kept_policy(policy, str(tmp_path / "kept"), {"iteration": 1, "lora_rank": 4, "lora_alpha": 8.0})
    kept = load_kept_policy(tiny_dir, str(tmp_path / "kept"))
    ids = torch.tensor([list(range(5, 17))])
    with torch.no_grad():
        assert torch.allclose(kept(ids).logits, policy(ids).logits, atol=1e-5)
        assert not torch.allclose(kept(ids).logits, load_causal_lm(tiny_dir)(ids).logits, atol=1e-3)


def test_judge_figures_flag_a_judge_at_chance_or_ranking_by_length():
    good = {"judge/accuracy": 0.62, "judge/accuracy_low": 0.53, "judge/accuracy_high": 0.70,
            "judge/balanced_accuracy": 0.575, "judge/balanced_accuracy_low": 0.51,
            "judge/balanced_accuracy_high": 0.64,
            "judge/accuracy_chosen_shorter": 0.7, "judge/accuracy_chosen_longer": 0.45}  # fmt: skip
    metrics, doubts = judge_figures(good, 0.35)
    assert doubts == [] and metrics["eval/judge/meaningful"] == 1.0 and metrics["eval/judge/length_accuracy"] == 0.45
    assert metrics["eval/judge/balanced_accuracy_low"] == 0.51
    # at chance by its balanced accuracy (though not by its accuracy), ranking by length, no figures
    for bad in ({**good, "judge/balanced_accuracy_low": 0.46}, {**good, "judge/accuracy_chosen_longer": 0.2}, {}):
        metrics, doubts = judge_figures(bad, 0.35)
        assert metrics["eval/judge/meaningful"] == 0.0 and doubts


def test_judge_figures_per_kind_and_a_kind_at_chance():
    good = {"judge/accuracy": 0.62, "judge/accuracy_low": 0.53, "judge/accuracy_high": 0.70,
            "judge/balanced_accuracy": 0.575, "judge/balanced_accuracy_low": 0.51,
            "judge/balanced_accuracy_high": 0.64, "judge/accuracy_chosen_shorter": 0.7,
            "judge/accuracy_chosen_longer": 0.45, "judge/kind/helpful/balanced_accuracy": 0.6,
            "judge/kind/helpful/balanced_accuracy_low": 0.52, "judge/kind/helpful/balanced_accuracy_high": 0.68,
            "judge/kind/harmless/balanced_accuracy": 0.55, "judge/kind/harmless/balanced_accuracy_low": 0.51,
            "judge/kind/harmless/balanced_accuracy_high": 0.6}  # fmt: skip
    metrics, doubts = judge_figures(good, 0.35, ["harmless", "helpful"])
    assert doubts == [] and metrics["eval/judge/meaningful"] == 1.0
    assert metrics["eval/kind/helpful/judge_balanced_accuracy_low"] == 0.52
    assert metrics["eval/kind/harmless/judge_balanced_accuracy_high"] == 0.6
    metrics, doubts = judge_figures({**good, "judge/kind/harmless/balanced_accuracy_low": 0.47}, 0.35, ["helpful"])
    assert metrics["eval/judge/meaningful"] == 0.0
    assert doubts == ["judge_eval balanced accuracy on harmless pairs 0.55 [0.47, 0.60] includes chance (0.5)"]
    metrics, doubts = judge_figures(good, 0.35, ["helpful", "chat"])  # a kind the judge has no figure for
    assert metrics["eval/judge/meaningful"] == 0.0 and math.isnan(metrics["eval/kind/chat/judge_balanced_accuracy"])
    assert doubts[0].startswith("judge_eval balanced accuracy on chat pairs is undefined")


def test_the_printed_verdicts_per_kind():
    p = "eval/kind/helpful/"
    metrics = {p + "prompts": 16.0, p + "base_refusal_rate": 0.0, p + "sft_refusal_rate": 0.0,
               p + "policy_refusal_rate": 0.0625, p + "proxy_win_rate": math.nan}  # fmt: skip
    for end, value in (("", 0.6), ("_low", 0.5), ("_high", 0.7)):
        metrics |= {f"{p}judge_win_rate{end}": value, f"{p}judge_lc_win_rate{end}": value - 0.1,
                    f"{p}judge_score_diff{end}": value - 0.5, f"{p}sft_vs_base/judge_win_rate{end}": value + 0.1,
                    f"{p}refusal_increase{end}": value - 0.5}  # fmt: skip
    assert kind_lines(metrics) == [
        "[evaluate] helpful prompts (16): by the judge win rate over SFT 0.600 [0.500, 0.700], length-controlled "
        "0.500 [0.400, 0.600], score difference 0.100 [0.000, 0.200]; by the proxy n/a",
        "[evaluate]   SFT over the base model by the judge 0.700 [0.600, 0.800], length-controlled n/a; refusal rate "
        "base 0.000, SFT 0.000, policy 0.062, policy - SFT 0.100 [0.000, 0.200]",
    ]
    assert kind_lines({"eval/judge/win_rate": 0.5}) == []


def test_the_printed_verdicts_carry_the_paired_difference_and_the_length_controlled_rate():
    metrics = {"eval/judge/accuracy": 0.7, "eval/judge/accuracy_low": 0.6, "eval/judge/accuracy_high": 0.8,
               "eval/judge/length_accuracy": 0.5, "eval/proxy/win_rate": math.nan, "eval/proxy/ties": 3.0}  # fmt: skip
    for end, value in (("", 0.6), ("_low", 0.5), ("_high", 0.7)):
        metrics |= {f"eval/judge/win_rate{end}": value, f"eval/judge/score_diff{end}": value - 0.4,
                    f"eval/judge/lc_win_rate{end}": value - 0.05}  # fmt: skip
    metrics |= {"eval/judge/decisive": 40.0, "eval/judge/ties": 2.0, "eval/judge/lc_length_coef": 1.2}
    lines = summary_lines(metrics, [])
    assert lines[1] == ("[evaluate]   score difference policy - SFT 0.200 [0.100, 0.300]; length-controlled win rate "
                        "0.550 [0.450, 0.650] (95%, bootstrap over prompts; length coefficient 1.200)")  # fmt: skip
    assert lines[-1].endswith("SFT undefined; length-controlled win rate undefined (95%, bootstrap over prompts; "
                              "length coefficient undefined)")  # fmt: skip


def test_eval_config_refuses_no_samples():
    with pytest.raises(ValueError, match="evaluate.samples_per_prompt must be at least 1"):
        EvalConfig(samples_per_prompt=0)


def test_the_judge_stage_names_its_figures_judge_and_warns_at_chance():
    from tasks.judge import judge_metrics, summary_lines

    trained = {"rm/accuracy": 0.568, "rm/accuracy_low": 0.480, "rm/accuracy_high": 0.652, "rm/pairs": 125.0,
               "rm/ties": 0.0, "rm/accuracy_chosen_shorter": 0.797, "rm/pairs_chosen_shorter": 69.0,
               "rm/accuracy_chosen_longer": 0.296, "rm/pairs_chosen_longer": 54.0, "rm/steps": 31.0,
               "rm/balanced_accuracy": 0.547, "rm/balanced_accuracy_low": 0.47, "rm/balanced_accuracy_high": 0.62,
               "rm/length_baseline_accuracy": 0.561, "rm/time/train": 90.4, "rm/time/center": 6.6,
               "rm/time/evaluate": 41.5}  # fmt: skip
    metrics = judge_metrics(trained)
    assert metrics["judge/accuracy_low"] == 0.480 and not any(key.startswith("rm/") for key in metrics)
    lines = summary_lines(metrics)
    assert lines[0].startswith("[judge] judge_eval accuracy 0.568 [0.480, 0.652] (Wilson 95%) over 125 decisive")
    assert lines[1].startswith("[judge] judge_eval balanced accuracy 0.547 [0.470, 0.620] (stratified bootstrap")
    assert lines[1].endswith("prefer-the-shorter baseline 0.561")
    assert lines[2] == "[judge] judge/steps=31.000" and not any("rm/" in line for line in lines)
    assert lines[3] == "[judge] seconds: training 90, centring 7, scoring judge_eval 42"  # not among the figures
    assert lines[-1].startswith("[judge] WARNING: judge_eval balanced accuracy 0.55 [0.47, 0.62] includes chance")


def test_a_sample_depends_on_its_prompt_and_index_not_on_the_batch_or_the_samples_beside_it(tiny_dir, tokenizer):
    """Each (prompt, sample) draws from its own generator: batches of 1 and of 4 give the same texts and scores
    (fp32), the first of two samples of a prompt is its only sample in a one-sample run (the curve and best-of-N
    read the sample evaluated), and the two samples of a prompt differ."""
    sft = load_causal_lm(tiny_dir)
    scorers = Scorers(load_scalar_model(tiny_dir), load_scalar_model(tiny_dir), tokenizer)
    settings = GenerationSettings(max_new_tokens=6, temperature=1.0, no_eos="score", no_eos_value=None)
    prompts = PROMPTS + [[{"role": "user", "content": "Why is the sky blue, and why are sunsets red?"}]]

    def run(batch_size: int, samples: int) -> dict:
        config = EvalConfig(batch_size=batch_size, bootstrap_resamples=50)
        return generate_and_score(
            sft, sft, prompts, Sampling(scorers, tokenizer, config, settings, CPU), samples=samples
        )

    one_by_one, together, single = run(1, 2), run(4, 2), run(4, 1)
    assert one_by_one["texts"] == together["texts"]
    assert torch.allclose(one_by_one["proxy"], together["proxy"], atol=1e-6)
    assert together["texts"][::2] == single["texts"]
    assert together["texts"][::2] != together["texts"][1::2]


def test_prompts_sampled_in_length_order_come_back_in_the_input_order(tiny_dir, tokenizer):
    """Batches are formed from length-sorted prompts; each prompt's greedy answer, scores and length are still
    at its own place, as when sampled alone (the lengths are ordered so that the sort is a cycle, not its own
    inverse)."""
    sft = load_causal_lm(tiny_dir)
    scorers = Scorers(load_scalar_model(tiny_dir), load_scalar_model(tiny_dir), tokenizer)
    settings = GenerationSettings(max_new_tokens=5, temperature=1.0, no_eos="score", no_eos_value=None)
    texts = ["Name three rivers in Europe, please.", "Hi", "Why is the sky blue, and why are sunsets red?", "Is it?"]
    prompts = [[{"role": "user", "content": t}] for t in texts]
    config = EvalConfig(batch_size=2, greedy=True, bootstrap_resamples=50)
    sampling = Sampling(scorers, tokenizer, config, settings, CPU)
    together = generate_and_score(sft, sft, prompts, sampling)
    alone = [generate_and_score(sft, sft, [p], sampling) for p in prompts]
    assert together["texts"] == [a["texts"][0] for a in alone]
    for key in ("proxy", "judge", "length"):
        torch.testing.assert_close(together[key][:, 0], torch.cat([a[key][:, 0] for a in alone]), rtol=0, atol=1e-5)


def test_best_of_n_of_sft_keeps_the_proxys_pick_scored_by_the_judge_at_its_analytic_kl(tiny_dir, tokenizer):
    from rlhf.evaluation.comparison import best_of_n

    sft, proxy = load_causal_lm(tiny_dir), load_scalar_model(tiny_dir)
    torch.manual_seed(1)
    judge = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(judge.score.weight)  # another scorer than the proxy
    scorers = Scorers(proxy, judge, tokenizer)
    settings = GenerationSettings(max_new_tokens=4, temperature=1.0, no_eos="score", no_eos_value=None)
    config = EvalConfig(batch_size=4, curve_prompts=2, best_of_n=4, bootstrap_resamples=50)
    sampling = Sampling(scorers, tokenizer, config, settings, CPU)
    evaluated = generate_and_score(sft, sft, PROMPTS, sampling)  # the SFT run
    figures = best_of_n_figures(sft, PROMPTS, sampling, sampled=evaluated)
    # the same samples as drawn all at once: 4 of each curve prompt, the first the evaluation's (not drawn again)
    run = generate_and_score(sft, sft, PROMPTS[:2], sampling, samples=4)
    later = generate_and_score(sft, sft, PROMPTS[:2], sampling, samples=4, first=1)
    assert later["texts"] == [t for i, t in enumerate(run["texts"]) if i % 4] and later["proxy"].shape == (2, 3)
    assert evaluated["texts"][:2] == run["texts"][::4]
    assert figures["eval/best_of_n/1/judge"] == pytest.approx(float(run["judge"][:, 0].mean()))
    assert figures["eval/best_of_n/4/judge"] == pytest.approx(float(best_of_n(run["proxy"], run["judge"], 4).mean()))
    assert figures["eval/best_of_n/4/proxy"] == pytest.approx(float(run["proxy"].max(dim=1).values.mean()))
    # KL log 4 - 3/4 = 0.636294 nats, its root 0.797680
    assert figures["eval/best_of_n/4/kl"] == pytest.approx(0.636294, abs=1e-6)
    assert figures["eval/best_of_n/4/sqrt_kl"] == pytest.approx(0.797680, abs=1e-6)
    assert figures["eval/best_of_n/1/kl"] == 0.0 and "eval/best_of_n/16/judge" not in figures
    gain = figures["eval/best_of_n/4/judge"] - figures["eval/best_of_n/1/judge"]
    assert figures["eval/best_of_n/judge_gain"] == pytest.approx(gain, abs=1e-6)
    no_best = Sampling(scorers, tokenizer, EvalConfig(best_of_n=0), settings, CPU)
    assert best_of_n_figures(sft, PROMPTS, no_best, sampled=run) == {}


def test_the_curve_reads_the_evaluations_runs_and_samples_only_the_kept_policies_it_lacks(tiny_dir, tokenizer):
    sft, proxy = load_causal_lm(tiny_dir), load_scalar_model(tiny_dir)
    settings = GenerationSettings(max_new_tokens=4, temperature=1.0, no_eos="score", no_eos_value=None)
    config = EvalConfig(batch_size=4, curve_prompts=2, bootstrap_resamples=50)
    sampling = Sampling(Scorers(proxy, proxy, tokenizer), tokenizer, config, settings, CPU)
    # the evaluation's runs by hand: 3 prompts x 2 samples; the curve reads the first sample of the first 2 prompts
    firsts = {"kl": (0.5, 1.5), "kl_k3": (1.0, 3.0), "proxy": (0.25, 0.75), "judge": (-1.0, 0.0)}
    run = {key: torch.tensor([[a, 9.0], [b, 9.0], [9.0, 9.0]]) for key, (a, b) in firsts.items()}
    loaded = []

    def loader(iteration):
        return lambda: loaded.append(iteration) or sft  # the SFT weights stand in for a kept policy

    prompts = PROMPTS + [[{"role": "user", "content": "A third prompt"}]]
    kept = {8: loader(8), 4: loader(4)}
    rows = curve(sft, prompts, sampling, sampled={0: run, 8: run}, kept=kept)
    assert [row["iteration"] for row in rows] == [0, 4, 8] and loaded == [4]  # 8 is the shipped run: not sampled
    # by hand: kl (0.5 + 1.5) / 2 = 1.0, kl_k3 (1 + 3) / 2 = 2.0, sqrt_kl sqrt(2), proxy 0.5, judge -0.5
    wanted = {"kl": 1.0, "kl_k3": 2.0, "sqrt_kl": math.sqrt(2.0), "proxy": 0.5, "judge": -0.5}
    assert rows[0] == pytest.approx({"iteration": 0, **wanted}) and rows[2] == pytest.approx({"iteration": 8, **wanted})
    assert rows[1]["kl"] == 0.0  # the SFT model against itself: KL 0, freshly sampled on the 2 curve prompts


def test_evaluation_samples_at_its_own_token_limit_only_where_one_is_set():
    generation = GenerationSettings(max_new_tokens=128, temperature=0.7, no_eos="constant", no_eos_value=-1.0)
    same, longest = sampling_settings(EvalConfig(max_new_tokens=None), generation)
    assert same == generation and longest == ("generation.max_new_tokens", 128)
    longer, longest = sampling_settings(EvalConfig(max_new_tokens=256), generation)
    assert longer == GenerationSettings(256, 0.7, "constant", -1.0) and longest == ("evaluate.max_new_tokens", 256)
    with pytest.raises(ValueError, match="evaluate.max_new_tokens must be at least 1, got 0"):
        EvalConfig(max_new_tokens=0)


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (EvalConfig, {"max_prompts": 0}, r"^evaluate.max_prompts must be at least 1, got 0$"),
        (EvalConfig, {"best_of_n": -4}, r"^evaluate.best_of_n must be at least 0, got -4$"),
        (EvalConfig, {"judge_min_length_accuracy": 1.2}, r"^evaluate.judge_min_length_accuracy must be in \[0, 1\]"),
        (GenerationSettings, {"max_new_tokens": -1}, r"^generation.max_new_tokens must be at least 1, got -1$"),
        (GenerationSettings, {"temperature": 0.0}, r"^generation.temperature must be above 0, got 0.0$"),
    ],
)
def test_evaluation_and_generation_refuse_settings_outside_their_domain(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs)
    assert EvalConfig(max_prompts=None, best_of_n=0).max_prompts is None  # null: all prompts; 0: no best-of-N


def test_the_same_response_scored_in_two_batches_is_a_tie_by_both_scorers():
    # prompt-major texts of 2 prompts x 2 samples: the policy repeats SFT's first and last response word for word
    runs = {
        "sft": {"texts": ["a", "b", "c", "d"], "proxy": torch.tensor([[0.5, 0.1], [0.2, -1.0]]),
                "judge": torch.tensor([[0.3, 0.0], [0.1, 0.4]])},
        "policy": {"texts": ["a", "x", "y", "d"], "proxy": torch.tensor([[0.502, 0.7], [0.9, -0.998]]),
                   "judge": torch.tensor([[0.299, 0.2], [0.0, 0.401]])},
    }  # fmt: skip
    assert tie_identical_responses(runs) == 2
    assert torch.equal(runs["policy"]["proxy"], torch.tensor([[0.5, 0.7], [0.9, -1.0]]))
    assert torch.equal(runs["policy"]["judge"], torch.tensor([[0.3, 0.2], [0.0, 0.4]]))
    assert torch.equal(runs["sft"]["proxy"], torch.tensor([[0.5, 0.1], [0.2, -1.0]]))  # SFT's own are untouched
