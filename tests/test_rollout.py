"""Scoring where the reward model learned to read, the value model's calibration, and settings refused at load time."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf.models.generation import GenerationSettings, treat_unfinished, unfinished_responses
from rlhf.models.loading import load_scalar_model
from rlhf.models.sampling import Rollout
from rlhf.ppo.config import PPOConfig, max_skewness
from rlhf.ppo.moments import RewardMoments, RunningMoments
from rlhf.ppo.rollout import calibrate_value_head, value_predictions
from rlhf.ppo.types import PPOModels
from rlhf.runtime.device import Runtime
from rlhf.runtime.distributed import Ranks


def hand_made_rollout(tokenizer) -> Rollout:
    """Prompt [5, 6] (left-padded to 3), then: an ended response, a truncated one, an empty one (EOS first)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    hello, there = tokenizer("Hello there", add_special_tokens=False)["input_ids"][:2]
    input_ids = torch.tensor(
        [
            [pad, 5, 6, hello, there, eos],
            [pad, 5, 6, hello, there, hello],
            [pad, 5, 6, eos, pad, pad],
        ]
    )
    response_mask = torch.tensor([[True, True, True], [True, True, True], [True, False, False]])
    attention_mask = torch.cat([torch.tensor([[0, 1, 1]] * 3), response_mask.long()], dim=1)
    return Rollout(input_ids, attention_mask, response_mask, 3, torch.tensor([True, False, True]))


@pytest.mark.parametrize(
    "no_eos, value, empty_response, expected",
    [
        # raw scores [0.3, 0.8, 0.6] of (ended, truncated, empty):
        ("penalty", 1.0, "no_eos", [0.3, -0.2, -0.4]),  # 0.8 - 1.0; 0.6 - 1.0
        ("constant", -1.0, "no_eos", [0.3, -1.0, -1.0]),
        ("score", None, "no_eos", [0.3, 0.8, 0.6]),
        ("constant", -1.0, "score", [0.3, -1.0, 0.6]),  # the empty response keeps its score
    ],
)
def test_unfinished_responses_scored_as_configured_on_a_hand_made_batch(
    tokenizer, no_eos, value, empty_response, expected
):
    settings = GenerationSettings(no_eos=no_eos, no_eos_value=value, empty_response=empty_response)
    unfinished, empty = unfinished_responses(hand_made_rollout(tokenizer), tokenizer, settings)
    assert empty.tolist() == [False, False, True]
    scores = treat_unfinished(torch.tensor([0.3, 0.8, 0.6]), unfinished, settings)
    assert scores.tolist() == pytest.approx(expected)


def test_whitespace_only_response_counts_as_empty(tokenizer):
    rollout = hand_made_rollout(tokenizer)
    (space,) = tokenizer(" ", add_special_tokens=False)["input_ids"]
    (newline,) = tokenizer("\n", add_special_tokens=False)["input_ids"]
    rollout.input_ids[0, 3:5] = torch.tensor([space, newline])  # " \n" then EOS
    _, empty = unfinished_responses(rollout, tokenizer, GenerationSettings())
    assert empty.tolist() == [True, False, True]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"no_eos": "drop"}, "generation.no_eos must be one of"),
        ({"no_eos": "score", "no_eos_value": -1.0}, "null for score"),
        ({"no_eos": "penalty", "no_eos_value": None}, "must be set for no_eos penalty"),
        ({"no_eos": "penalty", "no_eos_value": -1.0}, r"above 0 for no_eos penalty .* -1.0 would reward"),
        ({"no_eos": "penalty", "no_eos_value": 0.0}, "above 0 for no_eos penalty"),
        ({"empty_response": "ignore"}, "generation.empty_response"),
        ({"cache": "offloaded"}, r"generation.cache must be dynamic or static, got 'offloaded'"),
    ],
)
def test_generation_settings_refuse_contradictions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationSettings(**kwargs)


def test_value_calibration_is_the_least_squares_fit_of_the_first_rollouts_returns():
    value_model = SimpleNamespace(config=SimpleNamespace(value_scale=2.0, value_bias=0.5))
    mask = torch.tensor([[True, True], [True, False]])
    values = torch.tensor([[0.0, 1.0], [-1.0, 7.0]])  # 7.0 sits on a pad: never read
    returns = torch.tensor([[2.0, 2.0], [-1.0, 9.0]])  # 9.0 sits on a pad: never read
    calibrated = calibrate_value_head(value_model, values, returns, mask, Ranks())
    # points (0, 2), (1, 2), (-1, -1): mean x 0, mean y 1, cov 1, var 2/3: slope 1.5, intercept 1
    assert calibrated[mask].tolist() == pytest.approx([1.0, 2.5, -0.5])
    # composed with the calibration the predictions were made under: 1.5 * (2 head + 0.5) + 1
    assert (value_model.config.value_scale, value_model.config.value_bias) == pytest.approx((3.0, 1.75))
    # a head that says nothing (one value everywhere) starts as the mean return
    flat = SimpleNamespace(config=SimpleNamespace())
    assert calibrate_value_head(flat, torch.ones(2, 2), returns, mask, Ranks())[mask].tolist() == [1.0] * 3
    assert (flat.config.value_scale, flat.config.value_bias) == (0.0, 1.0)


@torch.no_grad()
def test_a_calibrated_value_model_predicts_what_the_calibration_returned(tiny_dir):
    torch.manual_seed(0)
    value_model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(value_model.score.weight, std=1.0)
    ids, attn = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]]), torch.ones(2, 4, dtype=torch.long)
    head = value_predictions(value_model, ids, attn, 2)  # no calibration yet: the raw head at positions 1, 2
    mask = torch.ones(2, 2, dtype=torch.bool)
    returns = torch.tensor([[0.1 + 0.9 * 1.0, 1.0], [-0.2 - 0.9, -1.0]])  # rewards 0.1, 1 and -0.2, -1 at gamma 0.9
    calibrated = calibrate_value_head(value_model, head, returns, mask, Ranks())
    assert value_predictions(value_model, ids, attn, 2) == pytest.approx(calibrated, abs=1e-5)
    residual = ((returns - calibrated) ** 2).mean()
    assert residual <= ((returns - returns.mean()) ** 2).mean() + 1e-6  # explained variance >= 0 on the fit


def test_max_skewness_by_hand():
    # 8 values: (8 - 2) / sqrt(7) = 2.2678; 32 values: 30 / sqrt(31) = 5.3882
    assert max_skewness(8) == pytest.approx(2.2678, abs=1e-4)
    assert max_skewness(32) == pytest.approx(5.3882, abs=1e-4)
    # reached by n - 1 equal values and one outlier
    from rlhf.ppo.monitoring import skewness

    assert skewness([0.0] * 7 + [1.0]) == pytest.approx(max_skewness(8), abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"collapse_window": 1, "collapse_reward_skew": 3.0}, "collapse_reward_skew 3.0 can never fire"),
        ({"collapse_truncated_share": 1.0}, "collapse_truncated_share must be in"),
        ({"collapse_length_ratio": 1.0}, "collapse_length_ratio must be above 1"),
        ({"adaptive_kl": True, "kl_target": 6.0, "kl_horizon": 10000}, "inert"),
        ({"kl_target": 6.0}, r"ppo.kl_target is 6.0, but ppo.adaptive_kl is False, which does not read it"),
        ({"adaptive_kl": True, "kl_target": 6.0}, r"ppo.adaptive_kl is True, which reads ppo.kl_horizon: set it"),
        ({"validate_every": 0}, r"ppo.validation_prompts is 8, but ppo.validate_every is 0, which does not read"),
        ({"validation_prompts": None}, r"ppo.validate_every is 4, which reads ppo.validation_prompts: set it"),
        ({"validation_prompts": 0}, r"ppo.validate_every is 4, which reads ppo.validation_prompts: set it"),
        ({"scheduler": "constant", "warmup_steps": 5}, "has no warm-up"),
        ({"value_pretrain_explained_variance": 1.5}, "out of reach"),
        ({"value_init": "random"}, "value_init"),
        ({"iterations": -1}, r"^ppo.iterations must be at least 1, got -1$"),
        ({"iterations": 0}, r"^ppo.iterations must be at least 1, got 0$"),
        ({"kl_coef": -1.0}, r"^ppo.kl_coef must be at least 0, got -1.0$"),
        ({"clip": -0.2}, r"^ppo.clip must be above 0, got -0.2$"),
        ({"clip": 0.0}, r"^ppo.clip must be above 0, got 0.0$"),
        ({"policy_lr": 0.0}, r"^ppo.policy_lr must be above 0, got 0.0$"),
        ({"gamma": 1.5}, r"^ppo.gamma must be in \[0, 1\], got 1.5$"),
        ({"lam": -0.1}, r"^ppo.lam must be in \[0, 1\], got -0.1$"),
        ({"ptx_coef": -0.5}, r"^ppo.ptx_coef must be at least 0, got -0.5$"),
        ({"value_clip": 0.0}, r"^ppo.value_clip must be above 0, got 0.0$"),
        ({"max_prompt_length": 0}, r"^ppo.max_prompt_length must be at least 1, got 0$"),
    ],
)
def test_ppo_config_refuses_settings_that_cannot_act(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(**kwargs)
    assert math.isfinite(max_skewness(4 * 8))


def test_running_moments_population_stats_and_normalisation_by_running_not_batch_statistics():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0]))
    moments.update(torch.tensor([4.0]))
    # population mean and std of [1, 2, 3, 4]: 2.5 and sqrt(1.25) = 1.11803
    assert moments.mean == pytest.approx(2.5)
    assert moments.std == pytest.approx(1.25**0.5)
    # [3.5, 5.0] with the running statistics: (3.5 - 2.5) / 1.11803 = 0.89443; (5 - 2.5) / 1.11803 = 2.23607,
    # clipped at 2; the batch's own statistics would give [-1, 1]
    out = moments.normalize(torch.tensor([3.5, 5.0]), clip=2.0)
    assert out.tolist() == pytest.approx([0.89443, 2.0], abs=1e-5)
    with pytest.raises(RuntimeError, match="no reward statistics"):
        RunningMoments().normalize(torch.tensor([1.0]), clip=1.0)


@torch.no_grad()
def test_make_experience_penalises_each_token_by_k1_and_adds_the_score_once(tiny_dir, tokenizer):
    # gamma = lambda = 1: the return at the first response token is the sum of the token rewards (the values
    # cancel), i.e. by Eq. 11 score - beta * sum_t (log pi - log pi_ref) with k1, never k3
    from rlhf.data.chat import encode_prompt
    from rlhf.models.forward import response_logprobs
    from rlhf.models.loading import load_causal_lm
    from rlhf.ppo.rollout import make_experience

    torch.manual_seed(0)
    policy, reference = load_causal_lm(tiny_dir), load_causal_lm(tiny_dir)
    for p in policy.parameters():
        p.add_(0.05 * torch.randn_like(p))  # so that the policy differs from the reference
    reward_model, value_model = load_scalar_model(tiny_dir), load_scalar_model(tiny_dir)
    torch.nn.init.normal_(reward_model.score.weight, std=1.0)
    config = PPOConfig(gamma=1.0, lam=1.0, reward_normalize=None, reward_clip=None, value_init="sft")
    settings = GenerationSettings(max_new_tokens=5, no_eos="score", no_eos_value=None)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": t}], 16) for t in ("Hi", "Tell me a joke")]
    beta = 0.3
    models = PPOModels(policy, reference, reward_model, value_model)
    experience, stats = make_experience(models, tokenizer, prompts, config, settings, RewardMoments(), beta, Runtime())
    ids, attn, start, mask = experience.input_ids, experience.attention_mask, experience.response_start, experience.mask
    logprobs, _ = response_logprobs(policy, ids, attn, start, 0.7)
    ref_logprobs, _ = response_logprobs(reference, ids, attn, start, 0.7)
    k1 = ((logprobs - ref_logprobs) * mask).sum(-1)
    assert k1.abs().min() > 1e-3  # the policy really differs, so k1 and k3 differ
    expected = experience.raw_scores - beta * k1
    assert experience.returns[:, 0] == pytest.approx(expected, abs=1e-4)
    assert stats["ppo/kl"] == pytest.approx(float(k1.mean()), abs=1e-5)


def scored_tiny_models(tiny_dir, tokenizer):
    """The tiny policy and reference, a reward and a value model with random heads (std 1), 5-token samples that
    read their truncated scores, and two prompts."""
    from rlhf.data.chat import encode_prompt
    from rlhf.models.loading import load_causal_lm

    torch.manual_seed(0)
    policy, reference = load_causal_lm(tiny_dir), load_causal_lm(tiny_dir)
    reward_model, value_model = load_scalar_model(tiny_dir), load_scalar_model(tiny_dir)
    torch.nn.init.normal_(reward_model.score.weight, std=1.0)
    torch.nn.init.normal_(value_model.score.weight, std=1.0)
    settings = GenerationSettings(max_new_tokens=5, no_eos="score", no_eos_value=None)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": t}], 16) for t in ("Hi", "Tell me a joke")]
    return PPOModels(policy, reference, reward_model, value_model), settings, prompts


@torch.no_grad()
def test_make_experience_calibrates_the_value_model_on_the_first_rollouts_returns(tiny_dir, tokenizer):
    # after calibration the returns regressed on the values have slope 1 and intercept 0 (the fit is the identity),
    # and the values the experience holds are what the calibrated value model now predicts
    from rlhf.ppo.rollout import make_experience

    models, settings, prompts = scored_tiny_models(tiny_dir, tokenizer)
    value_model = models.value_model
    config = PPOConfig(gamma=1.0, lam=1.0, reward_normalize=None, reward_clip=None, value_init="sft")
    experience, stats = make_experience(
        models, tokenizer, prompts, config, settings, RewardMoments(), 0.1, Runtime(), calibrate_value=True
    )
    assert value_model.config.value_scale != 1.0
    # lambda = 1: the GAE returns are the Monte Carlo ones, so both readings of the critic agree
    outcome = stats["ppo/value/explained_variance_outcome"]
    assert outcome == pytest.approx(stats["ppo/value/explained_variance"], rel=1e-5) and outcome == outcome
    ids, attn, start, mask = experience.input_ids, experience.attention_mask, experience.response_start, experience.mask
    assert value_predictions(value_model, ids, attn, start)[mask] == pytest.approx(experience.values[mask], abs=1e-5)
    x, y = experience.values[mask].double(), experience.returns[mask].double()  # gamma = lambda = 1: Monte Carlo
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    assert (float(slope), float(y.mean() - slope * x.mean())) == pytest.approx((1.0, 0.0), abs=1e-4)


def test_rollout_stats_explained_variance_and_token_means_by_hand():
    from rlhf.ppo.monitoring import COLUMNS, rollout_stats

    def table(values, returns=(1.0, 3.0)):  # two one-token responses, outcomes 1 and 3, these values and returns
        rows = []
        for outcome, ret, value in zip((1.0, 3.0), returns, values, strict=True):
            row = dict.fromkeys(COLUMNS, 0.0) | {"length": 1.0, "ended": 1.0, "returns": ret, "returns_sq": ret**2}
            row |= {"residual": ret - value, "residual_sq": (ret - value) ** 2, "logprobs": -1.0, "raw": outcome}
            row |= {"outcome": outcome, "outcome_sq": outcome**2, "outcome_residual": outcome - value}
            row |= {"outcome_residual_sq": (outcome - value) ** 2}
            rows.append([row[name] for name in COLUMNS])
        return torch.tensor(rows, dtype=torch.float64)

    perfect = rollout_stats(table((1.0, 3.0)))
    assert perfect["ppo/value/explained_variance"] == pytest.approx(1.0)
    assert perfect["ppo/value/explained_variance_outcome"] == pytest.approx(1.0)
    # GAE returns that are the values (1.5, 2.5) read as perfect; against the outcomes 1 and 3 the residuals
    # -0.5 and 0.5 have variance 0.25 of the outcomes' 1: 1 - 0.25 / 1 = 0.75
    smooth = rollout_stats(table((1.5, 2.5), returns=(1.5, 2.5)))
    assert smooth["ppo/value/explained_variance"] == pytest.approx(1.0)
    assert smooth["ppo/value/explained_variance_outcome"] == pytest.approx(0.75)
    # values constant 2: residual -1 and 1 has the variance of the returns (1): 1 - 1 / 1 = 0
    constant = rollout_stats(table((2.0, 2.0)))
    assert constant["ppo/value/explained_variance"] == pytest.approx(0.0)
    # token means: returns (1 + 3) / 2 tokens = 2; perplexity exp(2 / 2) = e; raw score mean 2, std 1
    assert constant["ppo/returns/mean"] == pytest.approx(2.0) and constant["ppo/perplexity"] == pytest.approx(2.71828)
    assert constant["ppo/reward/mean"] == pytest.approx(2.0) and constant["ppo/reward/std"] == pytest.approx(1.0)


def test_the_collapse_guard_compares_with_the_mean_of_the_starting_policys_rollouts_by_hand():
    from rlhf.ppo.guard import detect_collapse, pooled_baseline

    baseline = {}
    for length, perplexity in ((109.0, 4.0), (74.0, 5.0), (63.0, 3.0), (58.0, 4.0)):  # the long run's SFT rollouts
        rollout = {"ppo/response_length": length, "ppo/perplexity": perplexity, "ppo/truncated_share": 0.0}
        baseline = pooled_baseline(baseline, rollout)
    # (109 + 74 + 63 + 58) / 4 = 76.0 tokens, (4 + 5 + 3 + 4) / 4 = 4.0
    assert baseline == {"ppo/response_length": 76.0, "ppo/perplexity": 4.0, "ppo/truncated_share": 0.0, "rollouts": 4.0}
    config = PPOConfig(collapse_reward_skew=None, collapse_truncated_share=None)
    calm = {"ppo/window/reward_skew": 0.0, "ppo/window/truncated_share": 0.0, "ppo/kl": 0.3, "ppo/perplexity": 4.0}
    # 26.5 tokens: under the first rollout's 109 / 3, not under the pooled 76 / 3 = 25.3
    assert detect_collapse({**calm, "ppo/response_length": 26.5}, baseline, config) is None
    reason = detect_collapse({**calm, "ppo/response_length": 25.0}, baseline, config)
    assert reason == "mean response length fell from 76.0 to 25.0 (limit /3.0)"


def test_the_truncation_guard_fires_only_above_what_the_starting_policy_did():
    # a base model that writes long (no SFT): its own first rollouts cut at max_new_tokens are not a collapse
    from rlhf.ppo.guard import detect_collapse, pooled_baseline

    baseline = {}
    for share in (1.0, 0.875):  # the starting policy's rollouts: 15 of 16 responses cut
        baseline = pooled_baseline(
            baseline, {"ppo/response_length": 128.0, "ppo/perplexity": 3.0, "ppo/truncated_share": share}
        )
    assert baseline["ppo/truncated_share"] == 0.9375
    config = PPOConfig(collapse_reward_skew=None)  # collapse_truncated_share 0.9
    calm = {"ppo/window/reward_skew": 0.0, "ppo/kl": 0.3, "ppo/perplexity": 3.0, "ppo/response_length": 128.0}
    assert detect_collapse({**calm, "ppo/window/truncated_share": 0.9375}, baseline, config) is None
    reason = detect_collapse({**calm, "ppo/window/truncated_share": 1.0}, baseline, config)
    assert reason == "100% of the last 4 rollouts' responses hit max_new_tokens (the starting policy's: 94%)"
    # a start that ends its responses: the threshold alone
    start = {"ppo/response_length": 60.0, "ppo/perplexity": 3.0, "ppo/truncated_share": 0.1}
    assert detect_collapse({**calm, "ppo/window/truncated_share": 0.95}, start, config).startswith("95% of the last 4")
    assert detect_collapse({**calm, "ppo/window/truncated_share": 0.85}, start, config) is None


@torch.no_grad()
def test_the_outcome_reading_of_the_critic_does_not_depend_on_lambda(tiny_dir, tokenizer):
    # the Monte Carlo returns are the same whatever GAE's lambda; the GAE returns (built from the values) are not
    from rlhf.ppo.rollout import make_experience

    models, settings, prompts = scored_tiny_models(tiny_dir, tokenizer)
    readings = []
    for lam in (1.0, 0.5):
        config = PPOConfig(gamma=1.0, lam=lam, reward_normalize=None, reward_clip=None, value_init="sft")
        _, stats = make_experience(
            models, tokenizer, prompts, config, settings, RewardMoments(), 0.1, Runtime(), seeds=[1, 2]
        )
        readings.append((stats["ppo/value/explained_variance"], stats["ppo/value/explained_variance_outcome"]))
    (gae_1, outcome_1), (gae_half, outcome_half) = readings
    assert outcome_half == pytest.approx(outcome_1, rel=1e-5) and gae_1 == pytest.approx(outcome_1, rel=1e-5)
    assert abs(gae_half - outcome_half) > 1e-3
