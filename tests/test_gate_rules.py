"""The reward-model gate's pure decision (rlhf.evaluation.gate_rules) on hand-made metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlhf.evaluation.gate_rules import (
    GateCriteria,
    PolicyCriteria,
    as_records,
    decision_sentence,
    passed,
    policy_gate,
    reward_gate,
)
from rlhf.evaluation.judge_trust import judge_doubts

CRITERIA = GateCriteria(min_accuracy_low=0.5, champion_tolerance=0.02, max_ece=0.15, min_length_accuracy=0.35)


def metrics(correct=120, pairs=196, ece=0.05, shorter=0.62, longer=0.6, low=0.54, kinds=None) -> dict[str, float]:
    kinds = {"harmless": (0.6, 0.52), "helpful": (0.62, 0.51)} if kinds is None else kinds
    return {
        **{f"rm/kind/{k}/balanced_accuracy": v for k, (v, _) in kinds.items()},
        **{f"rm/kind/{k}/balanced_accuracy_low": v for k, (_, v) in kinds.items()},
        **{f"rm/kind/{k}/pairs": 98.0 for k in kinds},
        "rm/accuracy": correct / pairs if pairs else math.nan,
        "rm/pairs": float(pairs),
        "rm/ece": ece,
        "rm/accuracy_chosen_shorter": shorter,
        "rm/accuracy_chosen_longer": longer,
        "rm/pairs_chosen_shorter": 100.0,
        "rm/pairs_chosen_longer": 90.0,
        "rm/balanced_accuracy": (shorter + longer) / 2,  # rlhf.reward.length_bias.length_figures (tested there)
        "rm/balanced_accuracy_low": low if pairs else math.nan,
        "rm/length_baseline_accuracy": 0.55,
    }


def test_the_gate_reads_the_balanced_accuracy_and_a_passing_candidate():
    # balanced (0.62 + 0.6) / 2 = 0.61, its stratified lower bound 0.54 >= 0.5
    checks = reward_gate(metrics(), None, CRITERIA)
    assert checks[0].value == pytest.approx(0.54)
    assert [c.passed for c in checks] == [True, True, True, True, True] and passed(checks)
    line = checks[0].line()
    assert line.startswith("gate passed: rm_eval balanced accuracy lower 95% bound (stratified bootstrap), 0.540")
    assert "balanced accuracy 0.610; accuracy 0.612 over 196 pairs, prefer-the-shorter 0.550" in line


@pytest.mark.parametrize(
    ("candidate", "champion", "criterion", "value", "bound"),
    [
        # balanced accuracy's lower bound 0.466: not better than chance whatever the length
        (metrics(low=0.466), None, "rm_eval balanced accuracy lower 95% bound", 0.466, 0.5),
        # balanced 0.61 against a champion at 0.640 on the same split: below 0.640 - 0.02
        (metrics(), {"rm/balanced_accuracy": 0.64}, "rm_eval balanced accuracy against the champion", 0.61, 0.62),
        (metrics(ece=0.2), None, "rm_eval calibration error (ECE)", 0.2, 0.15),
        # the first demo's reward model: 0.77 on chosen-shorter pairs, 0.33 on chosen-longer ones
        (metrics(shorter=0.77, longer=0.33), None, "length bias", 0.33, 0.35),
        # the same kind the other way round: a model that learned "longer is better"
        (metrics(shorter=0.30, longer=0.80), None, "length bias", 0.30, 0.35),
    ],
)
def test_each_criterion_fails_alone_with_one_line(candidate, champion, criterion, value, bound):
    checks = reward_gate(candidate, champion, CRITERIA)
    failed = [c for c in checks if not c.passed]
    assert len(failed) == 1 and not passed(checks)
    assert failed[0].criterion.startswith(criterion)
    assert failed[0].value == pytest.approx(value, abs=1e-4) and failed[0].bound == pytest.approx(bound)
    line = failed[0].line()
    assert line.startswith(f"GATE FAILED: {criterion}") and "\n" not in line
    assert f"bound {bound:.3f}" in line


def test_a_candidate_within_the_tolerance_of_the_champion_passes():
    checks = reward_gate(metrics(), {"rm/balanced_accuracy": 0.63}, CRITERIA)  # 0.61 >= 0.63 - 0.02
    assert len(checks) == 6 and passed(checks)


def test_a_debiased_candidate_is_not_refused_for_giving_up_prefer_the_shorter():
    # the champion ranks by length on data whose chosen responses are mostly the shorter: accuracy 0.64 but
    # balanced (0.80 + 0.36) / 2 = 0.58; the candidate's accuracy 0.59 is lower, its balanced 0.60 higher
    champion = metrics(correct=125, shorter=0.80, longer=0.36)
    checks = reward_gate(metrics(correct=116, shorter=0.6, longer=0.6), champion, CRITERIA)
    assert passed(checks)


def test_undefined_figures_fail_rather_than_pass():
    no_pairs = reward_gate(metrics(pairs=0), None, CRITERIA)
    assert not no_pairs[0].passed and no_pairs[0].line().startswith("GATE FAILED") and "n/a" in no_pairs[0].line()
    one_kind = reward_gate(metrics(longer=math.nan), None, CRITERIA)
    assert not one_kind[-1].passed
    assert not next(c for c in reward_gate(metrics(ece=math.nan), None, CRITERIA) if "ECE" in c.criterion).passed
    assert not passed([])


@pytest.mark.parametrize(
    ("kinds", "failed"),
    [
        # helpful below chance (the demo's harmless-only model on helpful-base: 0.407 [0.358, 0.459]), harmless
        # good, and the whole split's lower bound 0.54 still above 0.5: the per-kind check alone fails it
        ({"harmless": (0.66, 0.60), "helpful": (0.41, 0.36)}, ["helpful"]),
        # at the bound is not above it: a lower end of exactly 0.5 fails
        ({"harmless": (0.57, 0.5), "helpful": (0.6, 0.53)}, ["harmless"]),
        # an undefined kind (no chosen-longer pairs among its decisive ones) fails
        ({"harmless": (0.6, 0.52), "helpful": (math.nan, math.nan)}, ["helpful"]),
    ],
)
def test_a_reward_model_at_or_below_chance_on_one_kind_fails_the_gate(kinds, failed):
    checks = reward_gate(metrics(kinds=kinds), None, CRITERIA)
    assert checks[0].passed and not passed(checks)
    lost = [c for c in checks if not c.passed]
    assert [c.criterion for c in lost] == [
        f"rm_eval balanced accuracy lower 95% bound on {k} pairs (above the bound)" for k in failed
    ]
    assert lost[0].line().startswith(f"GATE FAILED: rm_eval balanced accuracy lower 95% bound on {failed[0]} pairs")


def test_metrics_without_kinds_fail_the_per_kind_check_unless_it_is_off():
    checks = reward_gate(metrics(kinds={}), None, CRITERIA)
    assert [c.detail for c in checks if not c.passed] == ["the metrics hold no figures per kind (rm/kind/<kind>/...)"]
    off = GateCriteria(min_accuracy_low=0.5, champion_tolerance=0.02, max_ece=0.15, min_length_accuracy=0.35,
                       min_kind_accuracy_low=None)  # fmt: skip
    assert passed(reward_gate(metrics(kinds={}), None, off))


def test_bounds_outside_zero_one_are_refused():
    with pytest.raises(ValueError, match="registry.reward_gate.max_ece must be in"):
        GateCriteria(max_ece=1.5)


EVAL = {"eval/judge/win_rate": 0.75, "eval/judge/win_rate_low": 0.56, "eval/judge/decisive": 20.0,
        "eval/judge/ties": 4.0, "eval/judge/accuracy": 0.62, "eval/judge/accuracy_low": 0.53,
        "eval/judge/length_accuracy": 0.41, "eval/judge/meaningful": 1.0,
        "eval/proxy/win_rate": 0.9, "eval/proxy/win_rate_low": 0.4, "eval/proxy/decisive": 24.0,
        "eval/proxy/ties": 0.0, "eval/policy/kl": 3.0, "eval/policy/eos_rate": 0.9}  # fmt: skip
KINDS = {  # eval/kind/<kind>/... as rlhf.evaluation.by_kind.kind_figures names them: both kinds pass
    "eval/kind/harmless/prompts": 16.0, "eval/kind/harmless/judge_lc_win_rate": 0.44,
    "eval/kind/harmless/judge_lc_win_rate_low": 0.2, "eval/kind/harmless/judge_lc_win_rate_high": 0.68,
    "eval/kind/harmless/judge_decisive": 14.0, "eval/kind/harmless/judge_ties": 2.0,
    "eval/kind/harmless/proxy_lc_win_rate_high": 0.45, "eval/kind/harmless/judge_balanced_accuracy": 0.61,
    "eval/kind/harmless/judge_balanced_accuracy_low": 0.53, "eval/kind/harmless/judge_balanced_accuracy_high": 0.69,
    "eval/kind/helpful/prompts": 150.0, "eval/kind/helpful/policy_refusal_rate": 0.02,
    "eval/kind/helpful/sft_refusal_rate": 0.0, "eval/kind/helpful/refusal_increase": 0.02,
    "eval/kind/helpful/refusal_increase_low": -0.01, "eval/kind/helpful/refusal_increase_high": 0.047,
}  # fmt: skip
EVAL |= KINDS
POLICY = PolicyCriteria(min_win_rate_low=0.5, max_kl=10.0, min_eos_rate=0.5)


def test_policy_gate_passes_on_the_judge_and_reads_its_bound():
    checks = policy_gate(EVAL, {"stopped_by": None, "ppo/last/collapse": 0.0}, POLICY)
    assert [c.criterion.split(":")[0].split(",")[0] for c in checks] == [
        "the judge's verdicts mean something (accuracy above chance",
        "win rate over SFT by the judge",
        "KL to the SFT model (nats/response)",
        "no collapse in PPO",
        "EOS rate of the policy's responses",
        "harmless prompts",
        "helpful prompts",
    ]
    assert checks[5].criterion == (
        "harmless prompts: length-controlled win rate over SFT by the judge, upper 95% bound (not worse)"
    )
    assert checks[6].criterion == (
        "helpful prompts: refusal rate increase over SFT, upper 95% bound (paired bootstrap over prompts)"
    )
    assert checks[0].value == 1.0 and "length accuracy 0.410" in checks[0].detail
    assert checks[1].value == 0.56 and passed(checks)
    assert checks[5].value == 0.68 and checks[5].bound == 0.5
    assert (
        checks[5].detail
        == "length-controlled win rate 0.440 [0.200, 0.680] over 14 decisive comparisons, 2 ties, on 16 prompts"
    )
    assert checks[6].value == 0.047 and checks[6].bound == 0.1
    assert checks[6].detail == "refusal rate 0.020 against SFT's 0.000 on 150 prompts: increase 0.020 [-0.010, 0.047]"


def test_policy_gate_by_the_proxy_reads_the_proxy_and_skips_the_judge():
    checks = policy_gate(EVAL, {}, PolicyCriteria(verdict="proxy"))
    assert checks[0].criterion.startswith("win rate over SFT by the proxy") and checks[0].value == 0.4
    assert not checks[0].passed and len(checks) == 6
    assert "24 decisive comparisons, 0 ties" in checks[0].detail
    # the not-worse check on harmless prompts reads the verdict's length-controlled rate: the proxy's 0.45 < 0.5
    assert checks[4].criterion.startswith("harmless prompts: length-controlled win rate over SFT by the proxy")
    assert checks[4].value == 0.45 and not checks[4].passed


@pytest.mark.parametrize(
    ("evaluation", "ppo", "criterion"),
    [
        ({**EVAL, "eval/judge/meaningful": 0.0}, {}, "the judge's verdicts mean something"),  # judge_doubts says why
        ({**EVAL, "eval/judge/meaningful": None}, {}, "the judge's verdicts mean something"),  # no judge figure
        ({**EVAL, "eval/judge/win_rate_low": 0.387}, {}, "win rate over SFT by the judge"),
        ({**EVAL, "eval/judge/win_rate": None, "eval/judge/win_rate_low": None, "eval/judge/decisive": 0.0}, {},
         "win rate"),  # all ties
        ({**EVAL, "eval/policy/kl": 12.5}, {}, "KL to the SFT model"),
        (EVAL, {"stopped_by": "kl 25.1 above collapse_kl_max 20"}, "no collapse in PPO"),
        (EVAL, {"ppo/last/collapse": 1.0}, "no collapse in PPO"),
        ({**EVAL, "eval/policy/eos_rate": 0.3}, {}, "EOS rate"),
        # significantly worse than SFT on harmless prompts: the whole interval of the LC win rate below 0.5
        ({**EVAL, "eval/kind/harmless/judge_lc_win_rate_high": 0.47}, {}, "harmless prompts: length-controlled"),
        # a judge at chance on harmless pairs (the demo's 0.450 [0.365, 0.533]) measures nothing there
        ({**EVAL, "eval/kind/harmless/judge_balanced_accuracy_low": 0.365}, {}, "harmless prompts: length-controlled"),
        # all ties there: undefined, which fails as every undefined figure does
        ({**EVAL, "eval/kind/harmless/judge_lc_win_rate_high": None}, {}, "harmless prompts: length-controlled"),
        # the demo's best case: no refusal by either on 16 helpful prompts bounds the increase at 0.194 > 0.1
        ({**EVAL, "eval/kind/helpful/refusal_increase_high": 0.193607}, {}, "helpful prompts: refusal rate"),
        ({**EVAL, "eval/kind/helpful/refusal_increase_high": None}, {}, "helpful prompts: refusal rate"),
    ],
)  # fmt: skip
def test_policy_gate_fails_on_each_criterion_alone(evaluation, ppo, criterion):
    checks = policy_gate(evaluation, ppo, POLICY)
    failed = [c for c in checks if not c.passed]
    assert len(failed) == 1 and failed[0].criterion.startswith(criterion) and not passed(checks)
    assert failed[0].line().startswith(f"GATE FAILED: {criterion}")


def test_policy_gate_refuses_a_verdict_it_cannot_give():
    with pytest.raises(ValueError, match="verdict must be judge or proxy"):
        PolicyCriteria(verdict="human")


JUDGE = {"judge/accuracy": 0.592, "judge/accuracy_low": 0.504, "judge/accuracy_high": 0.674,
         "judge/balanced_accuracy": 0.559, "judge/balanced_accuracy_low": 0.512,
         "judge/balanced_accuracy_high": 0.604,
         "judge/accuracy_chosen_shorter": 0.913, "judge/accuracy_chosen_longer": 0.204}  # the demo's judge  # fmt: skip


def test_judge_doubts_a_judge_at_chance_and_one_that_ranks_by_length():
    assert judge_doubts({**JUDGE, "judge/accuracy_chosen_longer": 0.41}, 0.35) == []
    assert judge_doubts(JUDGE, 0.35) == [
        "it ranks by length: accuracy 0.913 on chosen-shorter and 0.204 on chosen-longer pairs, the smaller below 0.35"
    ]
    # its accuracy clears chance, but not its balanced accuracy: "prefer the shorter" would do as well
    at_chance = judge_doubts({**JUDGE, "judge/balanced_accuracy_low": 0.45, "judge/accuracy_chosen_longer": 0.41}, 0.35)
    assert at_chance == ["judge_eval balanced accuracy 0.56 [0.45, 0.60] includes chance (0.5)"]
    assert len(judge_doubts({}, 0.35)) == 2  # no figures: undefined, and no length accuracy either


def test_the_gate_says_why_the_judge_means_nothing():
    why = ["it ranks by length: accuracy 0.913 on chosen-shorter and 0.204 on chosen-longer pairs"]
    checks = policy_gate({**EVAL, "eval/judge/meaningful": 0.0}, {}, POLICY, why)
    assert not checks[0].passed and checks[0].detail == why[0] and why[0] in checks[0].line()


def test_the_refusal_bound_reads_the_product_s_interval_at_its_edge():
    from rlhf.evaluation.comparison import rate_difference

    # 150 helpful prompts, the policy refuses 7 more than SFT: increase 7/150 = 0.047, its upper bound 0.093
    # (the Newcombe floor: p1 = 7/150, Wilson(7 of 150) upper 0.093186; p2 = 0, lower 0) -> passes 0.1; 8 more:
    # 0.053, upper 0.101704 -> fails (params.yaml's comment on max_refusal_increase)
    def gate(extra: int) -> list:
        policy, sft = np.zeros((150, 1)), np.zeros((150, 1))
        policy[:extra] = 1.0
        increase = rate_difference(policy, sft, resamples=2000, seed=0)
        figures = {"eval/kind/helpful/refusal_increase_high": increase.high}
        return policy_gate({**EVAL, **figures}, {}, POLICY)

    seven, eight = gate(7)[-1], gate(8)[-1]
    assert seven.value == pytest.approx(0.093186, abs=1e-6) and seven.passed
    assert eight.value == pytest.approx(0.101704, abs=1e-6) and not eight.passed
    at_bound = policy_gate({**EVAL, "eval/kind/helpful/refusal_increase_high": 0.1}, {}, POLICY)[-1]
    assert at_bound.passed  # at most the bound


def test_a_kind_the_gate_names_but_the_evaluation_lacks_fails_with_a_clear_detail():
    harmless_only = {k: v for k, v in EVAL.items() if not k.startswith("eval/kind/helpful/")}
    checks = policy_gate(harmless_only, {}, POLICY)
    failed = [c for c in checks if not c.passed]
    assert len(failed) == 1 and failed[0].criterion.startswith("helpful prompts: refusal rate increase")
    assert failed[0].detail == (
        "no eval prompts of kind 'helpful' (kinds evaluated: harmless); registry.policy_gate.helpful_kinds names it: "
        "give the data that kind, or name only kinds it has"
    )
    assert "n/a" in failed[0].line()
    # no kinds at all (data prepared before kinds): both checks fail, neither passes silently
    plain = {k: v for k, v in EVAL.items() if not k.startswith("eval/kind/")}
    failed = [c for c in policy_gate(plain, {}, POLICY) if not c.passed]
    assert [c.detail.split(";")[0] for c in failed] == [
        "no eval prompts of kind 'harmless' (kinds evaluated: none)",
        "no eval prompts of kind 'helpful' (kinds evaluated: none)",
    ]
    # a gate that names no kinds checks none (a user's data with other kinds names its own)
    assert passed(policy_gate(plain, {}, PolicyCriteria(helpful_kinds=[], harmless_kinds=[])))
    other = PolicyCriteria(helpful_kinds=["chat"], harmless_kinds=["red-team", "toxicity"])
    assert other.helpful_kinds == ("chat",) and other.harmless_kinds == ("red-team", "toxicity")
    assert len(policy_gate(plain, {}, other)) == 5 + 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_refusal_increase": 1.5}, r"registry.policy_gate.max_refusal_increase must be in \[0, 1\]"),
        ({"helpful_kinds": "helpful"}, "registry.policy_gate.helpful_kinds must be a list of kind names"),
        ({"harmless_kinds": ["harmless", ""]}, "registry.policy_gate.harmless_kinds must be a list of kind names"),
    ],
)
def test_policy_criteria_refuse_a_bad_refusal_bound_or_kinds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyCriteria(**kwargs)


def test_a_judge_below_chance_on_one_kind_makes_its_verdicts_meaningless():
    good = {**JUDGE, "judge/accuracy_chosen_longer": 0.41}
    per_kind = {"judge/kind/helpful/balanced_accuracy": 0.66, "judge/kind/helpful/balanced_accuracy_low": 0.58,
                "judge/kind/helpful/balanced_accuracy_high": 0.74}  # fmt: skip
    assert judge_doubts({**good, **per_kind}, 0.35, ["helpful"]) == []
    # ranks harmless pairs backwards, though above chance over the whole split
    harmless = {"judge/kind/harmless/balanced_accuracy": 0.41, "judge/kind/harmless/balanced_accuracy_low": 0.33,
                "judge/kind/harmless/balanced_accuracy_high": 0.49}  # fmt: skip
    doubts = judge_doubts({**good, **per_kind, **harmless}, 0.35, ["helpful"])  # found in its metrics too
    assert doubts == ["judge_eval balanced accuracy on harmless pairs 0.41 [0.33, 0.49] is below chance (0.5)"]
    at_chance = {**harmless, "judge/kind/harmless/balanced_accuracy_high": 0.55}
    doubts = judge_doubts({**good, **per_kind, **at_chance}, 0.35, ["harmless", "helpful"])
    assert doubts == ["judge_eval balanced accuracy on harmless pairs 0.41 [0.33, 0.55] includes chance (0.5)"]
    # an evaluated kind the judge has no figure for cannot be told from chance
    (missing,) = judge_doubts({**good, **per_kind}, 0.35, ["harmless", "helpful"])
    assert missing.startswith("judge_eval balanced accuracy on harmless pairs is undefined")
    # and the gate fails on it, saying why
    checks = policy_gate({**EVAL, "eval/judge/meaningful": 0.0}, {}, POLICY, [missing])
    assert not checks[0].passed and checks[0].detail == missing


def test_a_policy_trained_against_a_candidate_that_failed_its_gate_fails_the_policy_gate():
    from rlhf.evaluation.gate_rules import policy_gate

    good = {**EVAL, "eval/reward_model_version": 3.0}
    assert not any("champion alias" in c.criterion for c in policy_gate(good, {}, POLICY))
    checks = policy_gate({**good, "eval/reward_model_champion": 0.0}, {}, POLICY)
    last = checks[-1]
    assert (last.criterion, last.value, last.bound, last.passed) == (
        "the reward model PPO trained against holds the champion alias",
        0.0,
        1.0,
        False,
    )
    assert "candidate version 3, which did not pass the reward gate" in last.detail and not passed(checks)


def test_a_decision_is_one_sentence_naming_the_criteria_that_failed():
    checks = [{"criterion": "EOS rate", "passed": False}, {"criterion": "KL", "passed": True},
              {"criterion": "win rate", "passed": False}]  # fmt: skip
    assert decision_sentence({"decision": "fail", "checks": checks}, "policy gate") == (
        "policy gate failed 2 of 3 checks: EOS rate; win rate"
    )
    assert (
        decision_sentence({"decision": "pass", "checks": checks[1:2]}, "reward gate")
        == "reward gate passed all 1 checks"
    )
    assert decision_sentence(None, "policy gate") is None and decision_sentence({}, "policy gate") is None


@pytest.mark.parametrize(
    ("figures", "why"),
    [
        ((0.45, 0.365, 0.533), "the judge's balanced accuracy on harmless pairs 0.45 [0.36, 0.53] includes chance"),
        ((0.3, 0.2, 0.4), "the judge's balanced accuracy on harmless pairs 0.30 [0.20, 0.40] is below chance"),
        ((None, None, None), "the judge's balanced accuracy on harmless pairs is undefined"),
    ],
)
def test_a_not_worse_check_read_from_a_judge_at_chance_on_that_kind_is_not_measured(figures, why):
    # the demo's case: harmless "not worse" passed (upper bound 0.68) on a judge that cannot tell harmless answers apart
    p = "eval/kind/harmless/judge_balanced_accuracy"
    blind = {**EVAL, **dict(zip((p, p + "_low", p + "_high"), figures, strict=True))}
    check = next(c for c in policy_gate(blind, {}, POLICY) if c.criterion.startswith("harmless prompts"))
    assert not check.passed and check.value == 0.68
    assert check.detail.startswith(f"not measured: {why}")
    assert check.detail.endswith("over 14 decisive comparisons, 2 ties, on 16 prompts")
    # any kind the gate names as harmless, read with that kind's own judge figures
    renamed = {k.replace("/harmless/", "/red-team/"): v for k, v in blind.items()}
    red_team = PolicyCriteria(harmless_kinds=["red-team"])
    check = next(c for c in policy_gate(renamed, {}, red_team) if c.criterion.startswith("red-team prompts"))
    assert not check.passed and check.detail.startswith(f"not measured: {why.replace('harmless', 'red-team')}")
    assert (
        check.why
        == "on red-team prompts nothing was measured: the judge cannot tell good red-team answers from bad ones"
    )
    # by the proxy the check reads the proxy, whose blindness the reward gate already judged
    by_proxy = policy_gate(blind, {}, PolicyCriteria(verdict="proxy"))
    assert not any(c.detail.startswith("not measured") for c in by_proxy)


def test_the_verdict_sentence_says_in_plain_words_which_checks_failed_and_why():
    # the demo's typical ending: a judge at chance, a win rate whose interval reaches below 0.5, harmless not
    # measured, too few helpful prompts to bound the refusals, a reward model that failed its gate
    evaluation = {
        **EVAL,
        "eval/judge/meaningful": 0.0,
        "eval/judge/win_rate": 0.6,
        "eval/judge/win_rate_low": 0.387,
        "eval/kind/harmless/judge_balanced_accuracy_low": 0.365,
        "eval/kind/helpful/refusal_increase": 0.0,
        "eval/kind/helpful/refusal_increase_high": 0.194,
        "eval/kind/helpful/prompts": 16.0,
        "eval/reward_model_champion": 0.0,
    }
    checks = policy_gate(evaluation, {}, POLICY, ["judge_eval balanced accuracy 0.52 [0.45, 0.59] includes chance"])
    sentence = decision_sentence({"decision": "fail", "checks": as_records(checks)}, "policy gate")
    assert sentence == (
        "policy gate failed 5 of 8 checks: the judge (the second reward model, which scores the answers) cannot yet "
        "tell better answers from worse on its own held-out pairs, so none of its verdicts count; the policy did "
        "not clearly beat the model it started from: the judge preferred it in 60% of 20 comparisons, and the low "
        "end of that figure's 95% interval, 39%, must be at least 50%; on harmless prompts nothing was measured: the "
        "judge cannot tell good harmless answers from bad ones; on helpful prompts the policy may refuse more often "
        "than its start: up to 19 percentage points more, at most 10 allowed (16 prompts are too few to rule it "
        "out); PPO trained against a reward model that had failed its own gate"
    )
    # a record written before the plain words (no "why") still names its criteria
    old = [{k: v for k, v in record.items() if k != "why"} for record in as_records(checks)]
    assert decision_sentence({"decision": "fail", "checks": old}, "policy gate").startswith(
        "policy gate failed 5 of 8 checks: the judge's verdicts mean something (accuracy above chance"
    )
