"""PPO trainer behaviour on a tiny random Llama.

Ratio at the start, critic pre-training, the collapse guard before the update, the SFT fallback,
the shipped policy's figures, exact resume, the critic-free advantage estimators (rloo, grpo).
"""

import json
import os

import pytest
import torch
from conftest import Killed

import rlhf.ppo.loop as ppo_module
from rlhf.data.chat import encode_prompt
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.loop import train_ppo
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.rollout import make_experience
from rlhf.ppo.types import PPOModels
from rlhf.ppo.update import make_optimisers, ppo_update
from rlhf.runtime.device import Runtime
from rlhf.stats import linear_trend
from rlhf.training.checkpoint import Checkpointer

PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ["Hi", "How are you?", "Tell me a joke", "What is 2+2?", "Name a colour", "Say yes"]
]
SETTINGS = GenerationSettings(max_new_tokens=4, temperature=0.7, no_eos="score", no_eos_value=None)


@pytest.fixture(scope="module")
def dropout_dir(tiny_dir, tmp_path_factory):
    """The tiny model saved with attention dropout 0.5 in its config (which the trainer must switch off)."""
    model = load_causal_lm(tiny_dir)
    model.config.attention_dropout = 0.5
    folder = tmp_path_factory.mktemp("dropout")
    model.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as handle:
        assert json.load(handle)["attention_dropout"] == 0.5
    return str(folder)


def four_models(folder, critic: bool = True) -> PPOModels:
    """Policy, reference, a random reward head and a value model starting as the reward model (critic False: none)."""
    torch.manual_seed(0)
    policy, reference = load_causal_lm(folder), load_causal_lm(folder)
    reward_model, value_model = load_scalar_model(folder), load_scalar_model(folder)
    torch.nn.init.normal_(reward_model.score.weight, std=1.0)
    value_model.score.weight.data.copy_(reward_model.score.weight.data)
    return PPOModels(policy, reference, reward_model, value_model if critic else None)


def small_config(**overrides) -> PPOConfig:
    values = {
        "iterations": 3,
        "value_pretrain_iterations": 1,
        "rollout_batch_size": 2,
        "minibatch_size": 2,
        "ppo_epochs": 1,
        "validate_every": 2,
        "validation_prompts": 1,
        "collapse_reward_skew": None,
        "collapse_truncated_share": None,  # a random tiny model never ends a response
        "checkpoint_every": 1,
        "value_pretrain_explained_variance": 1.0,  # only a perfect critic ends pre-training before the cap
        **overrides,
    }
    return PPOConfig(**values)


def train(folder, tokenizer, root, config, log=None, settings=SETTINGS, ptx=None):
    prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS]
    models = four_models(folder, critic=config.uses_critic)
    logged = {}

    def record(metrics, step):
        if log is not None:
            log(metrics, step)
        logged[step] = metrics

    result = train_ppo(
        models,
        tokenizer,
        prompts[:5],
        prompts[5:],
        ptx or [],
        config,
        settings,
        record,
        Checkpointer(str(root)),
        Runtime(),
        False,
    )
    return result, logged, models


def test_ppo_ratio_is_one_on_first_minibatch_with_dropout_in_config(dropout_dir, tokenizer):
    models = four_models(dropout_dir)
    assert models.policy.config.attention_dropout == 0.0
    models.policy.train()  # even in train mode nothing may drop out
    config = PPOConfig(rollout_batch_size=4, minibatch_size=4, ppo_epochs=1)
    prompts = [encode_prompt(tokenizer, p, 32) for p in PROMPTS[:4]]
    settings = GenerationSettings(max_new_tokens=6)
    moments, runtime = RewardMoments(), Runtime()
    experience, _ = make_experience(models, tokenizer, prompts, config, settings, moments, 0.05, runtime)
    opt = make_optimisers(models.policy, models.value_model, config)
    stats = ppo_update(models.policy, models.value_model, opt, experience, config, 0.7, 0, None, True, runtime)
    assert stats["ppo/policy/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ppo/policy/clipfrac"] == 0.0


def test_schedules_step_once_per_optimiser_step(tiny_dir, tokenizer, tmp_path):
    # linear decay over iterations x steps_per_iteration = 2 x (1 epoch x 2 minibatches) = 4 policy steps:
    # after the first policy iteration (2 steps) the policy lr is 1e-3 * (1 - 2/4) = 5e-4
    config = small_config(
        iterations=2, value_pretrain_iterations=0, rollout_batch_size=4, scheduler="linear", policy_lr=1e-3
    )
    _, logged, _ = train(tiny_dir, tokenizer, tmp_path, config)
    assert logged[1]["ppo/policy/lr"] == pytest.approx(5e-4)
    assert logged[2]["ppo/policy/lr"] == pytest.approx(0.0)


def plant(monkeypatch, key, values_by_step):
    """Make the rollout of iteration ``step`` (1-based) report ``key`` as given."""
    real = ppo_module.make_experience
    counter = {"step": 0}

    def make_experience(*args, **kwargs):
        experience, stats = real(*args, **kwargs)
        counter["step"] += 1
        if counter["step"] in values_by_step:
            stats[key] = values_by_step[counter["step"]]
        return experience, stats

    monkeypatch.setattr(ppo_module, "make_experience", make_experience)


@pytest.mark.parametrize("threshold, expected_pretrain", [(0.6, 2), (1.0, 3)])
def test_critic_pretraining_runs_until_explained_variance_passes_or_the_cap(
    tiny_dir, tokenizer, tmp_path, monkeypatch, threshold, expected_pretrain
):
    # explained variance of the fresh rollouts: 0.1, 0.2, 0.7, ...: with threshold 0.6 the third rollout
    # (after 2 value-only iterations) passes and trains the policy; with 1.0 the cap of 3 ends it
    plant(monkeypatch, "ppo/value/explained_variance", {1: 0.1, 2: 0.2, 3: 0.7, 4: 0.8})
    config = small_config(iterations=1, value_pretrain_iterations=3, value_pretrain_explained_variance=threshold)
    result, logged, _ = train(tiny_dir, tokenizer, tmp_path, config)
    updated = [step for step in sorted(logged) if logged[step].get("ppo/updated_policy")]
    assert updated == [expected_pretrain + 1]
    assert result.summary["ppo/value/pretrain_iterations"] == expected_pretrain
    assert result.summary["ppo/value/pretrain_explained_variance"] == {2: 0.7, 3: 0.8}[expected_pretrain]


@pytest.mark.parametrize(
    "action, expected_rollouts, expected_rollbacks", [("stop", 2, 0), ("rollback", 5, 1), ("warn", 4, 0)]
)
def test_collapse_is_caught_before_the_update_and_the_sft_policy_is_the_first_fallback(
    tiny_dir, tokenizer, tmp_path, monkeypatch, action, expected_rollouts, expected_rollbacks
):
    # rollout 1 is critic pre-training; rollout 2 is the first policy rollout and "collapses" before any
    # validation; with rollback it is retried (rollout 3) and the run goes on to 3 policy iterations
    calls = {"n": 0}

    def detect(stats, baseline, config):
        calls["n"] += 1
        return "planted" if calls["n"] == 1 else None

    monkeypatch.setattr(ppo_module, "detect_collapse", detect)
    config = small_config(iterations=3, policy_lr=1e-2, on_collapse=action, max_rollbacks=1)
    result, logged, models = train(tiny_dir, tokenizer, tmp_path, config)
    assert max(logged) == expected_rollouts
    assert logged[2]["ppo/collapse"] == 1.0
    assert logged[2]["ppo/updated_policy"] == float(action == "warn")
    assert sum(m.get("ppo/rollback", 0.0) for m in logged.values()) == expected_rollbacks
    assert (result.stopped_by is not None) == (action == "stop")
    sft = four_models(tiny_dir).policy.state_dict()
    shipped = models.policy.state_dict()
    if action == "stop":  # nothing trained on the collapsed rollout: the shipped policy is the SFT policy
        assert result.best_iteration == 0
        assert all(torch.equal(sft[k], v) for k, v in shipped.items())
    best = Checkpointer(str(tmp_path / "best")).latest()
    assert best.endswith(f"step-{result.best_iteration:08d}")
    saved = type(models.policy).from_pretrained(os.path.join(best, "policy")).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in shipped.items())


def test_summary_reports_the_shipped_policy_and_the_last_rollout_apart(tiny_dir, tokenizer, tmp_path, monkeypatch):
    # validation rewards planted: SFT (step 0) 0.5, policy after rollout 3 (its 2nd policy iteration) 0.9,
    # after rollout 4 (the last) 0.1: the policy of rollout 3 is shipped and reported
    import rlhf.ppo.loop as module

    real = module.validation_stats
    planted = iter([0.5, 0.9, 0.1])

    def validation_stats(*args, **kwargs):
        return {**real(*args, **kwargs), "ppo/validation/reward": next(planted)}

    monkeypatch.setattr(module, "validation_stats", validation_stats)
    config = small_config(iterations=3, value_pretrain_iterations=1, validate_every=2)
    result, logged, _ = train(tiny_dir, tokenizer, tmp_path, config)
    assert logged[0]["ppo/validation/reward"] == 0.5
    assert result.best_iteration == 3
    assert result.summary["ppo/shipped_iteration"] == 3.0
    assert result.summary["ppo/validation/reward"] == 0.9
    assert result.summary["ppo/last/reward/mean"] == logged[4]["ppo/reward/mean"]
    assert result.summary["ppo/last/validation/reward"] == 0.1
    # the trend of the policy iterations' rollouts (2, 3, 4; rollout 1 only pre-trained the critic)
    trend = linear_trend([2.0, 3.0, 4.0], [logged[step]["ppo/reward/mean"] for step in (2, 3, 4)])
    assert [result.summary[f"ppo/reward/slope{end}"] for end in ("", "_low", "_high")] == pytest.approx(trend)


def killed_and_resumed(folder, tokenizer, root, config, ptx) -> dict:
    """A run killed at its step 4 and resumed from its last checkpoint (step 3): what the resumed run logged."""

    def kill(metrics, step):
        if step == 4:
            raise Killed

    with pytest.raises(Killed):
        train(folder, tokenizer, root, config, log=kill, ptx=ptx)
    assert Checkpointer(str(root)).latest().endswith("step-00000003")
    return train(folder, tokenizer, root, config, ptx=ptx)[1]


def test_resume_after_kill_matches_uninterrupted_run(tiny_dir, tokenizer, tmp_path):
    config = small_config(iterations=4, ptx_coef=0.5, ptx_batch_size=1)
    ptx = [[10, 11, 12, 2], [20, 21, 2]]
    _, full, _ = train(tiny_dir, tokenizer, tmp_path / "full", config, ptx=ptx)
    resumed = killed_and_resumed(tiny_dir, tokenizer, tmp_path / "resumed", config, ptx)
    assert sorted(resumed) == [4, 5]
    assert sorted(full) == [0, 1, 2, 3, 4, 5]
    for step in resumed:
        for key, value in full[step].items():
            if key.startswith("ppo/time/"):  # wall-clock seconds
                continue
            assert resumed[step][key] == pytest.approx(value, abs=1e-6, nan_ok=True), (step, key)


def test_every_keep_every_th_policy_and_the_last_are_kept_as_they_were(tiny_dir, tokenizer, tmp_path):
    from rlhf.training.checkpoint import load_kept_policy

    config = small_config(iterations=3, validate_every=0, validation_prompts=None, keep_every=2)
    result, _, models = train(tiny_dir, tokenizer, tmp_path / "run", config)
    # policy iterations 2 (every 2nd) and 3 (the last), named by the rollout step: 1 critic pre-training rollout
    assert sorted(os.listdir(result.kept)) == ["iteration-0003", "iteration-0004"]
    last = load_kept_policy(tiny_dir, os.path.join(result.kept, "iteration-0004"))
    for (name, shipped), kept in zip(models.policy.state_dict().items(), last.state_dict().values(), strict=True):
        assert torch.equal(shipped, kept), name  # validation off: the last policy ships, and it was kept whole
    assert (
        train(
            tiny_dir,
            tokenizer,
            tmp_path / "none",
            small_config(validate_every=0, validation_prompts=None, keep_every=0),
        )[0].kept
        is None
    )
    with pytest.raises(ValueError, match="ppo.keep_every must be at least 0, got -1"):
        small_config(keep_every=-1)


GROUPS = {"advantage_estimator": "rloo", "samples_per_prompt": 2, "value_pretrain_iterations": 0, "value_clip": None}


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_a_group_estimator_compares_the_samples_of_one_prompt_with_no_value_model(tiny_dir, tokenizer, estimator):
    # 4 responses, 2 samples of each of 2 prompts (consecutive rows): every token of a response carries its
    # sequence's advantage; with k = 2 RLOO gives R_a - R_b and R_b - R_a, GRPO +-1/sqrt(2) (opposite signs)
    config = PPOConfig(**{**GROUPS, "advantage_estimator": estimator, "rollout_batch_size": 4})
    models = four_models(tiny_dir, critic=False)
    prompts = [encode_prompt(tokenizer, p, 32) for p in (PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[2])]
    settings = GenerationSettings(max_new_tokens=6, no_eos="score", no_eos_value=None)
    experience, stats = make_experience(
        models, tokenizer, prompts, config, settings, RewardMoments(), 0.05, Runtime(), seeds=[1, 2, 3, 4]
    )
    mask = experience.mask
    first, returns = experience.advantages[:, 0].tolist(), experience.returns[:, 0].tolist()
    assert torch.equal(experience.advantages, torch.tensor(first)[:, None] * mask)  # one advantage a response
    assert torch.equal(experience.returns, torch.tensor(returns)[:, None] * mask)
    assert torch.equal(experience.values, torch.zeros_like(experience.values))
    for a, b in ((0, 1), (2, 3)):
        assert first[a] == pytest.approx(-first[b], abs=1e-6)
        if estimator == "rloo":
            assert first[a] == pytest.approx(returns[a] - returns[b], abs=1e-6)
        else:
            assert abs(first[a]) == pytest.approx(2**-0.5, abs=1e-3)
    assert (
        "ppo/time/values" not in stats
        and stats["ppo/value/explained_variance"] != stats["ppo/value/explained_variance"]
    )


def test_a_group_estimator_trains_the_policy_alone_and_resumes_exactly(tiny_dir, tokenizer, tmp_path, monkeypatch):
    # a rollout of 4 responses holds 2 prompts, each twice, side by side; no value step, no value checkpoint
    seen = []
    real = ppo_module.make_experience

    def record(models, tokenizer_, prompts, *args, **kwargs):
        seen.append([tuple(p) for p in prompts])
        return real(models, tokenizer_, prompts, *args, **kwargs)

    monkeypatch.setattr(ppo_module, "make_experience", record)
    config = small_config(iterations=4, rollout_batch_size=4, **GROUPS)
    _, full, models = train(tiny_dir, tokenizer, tmp_path / "full", config)
    assert models.value_model is None
    assert all(len(batch) == 4 and batch[0] == batch[1] and batch[2] == batch[3] for batch in seen)
    assert not any(key.startswith(("ppo/loss/value", "ppo/value/lr")) for step in full.values() for key in step)
    assert [step for step in sorted(full) if full[step].get("ppo/updated_policy")] == [1, 2, 3, 4]
    resumed = killed_and_resumed(tiny_dir, tokenizer, tmp_path / "resumed", config, [])
    assert sorted(resumed) == [4]
    for key, value in full[4].items():
        if not key.startswith("ppo/time/"):
            assert resumed[4][key] == pytest.approx(value, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"advantage_estimator": "ppo"}, "must be gae, rloo or grpo, got 'ppo'"),
        ({"samples_per_prompt": 1}, "compares the samples of one prompt: set ppo.samples_per_prompt to 2 or more"),
        ({"value_clip": 0.2}, "ppo.value_clip is 0.2, but ppo.advantage_estimator rloo has no value model"),
        ({"value_pretrain_iterations": 1}, "set value_pretrain_iterations: 0, or use gae"),
        ({"samples_per_prompt": 3}, "rollout_batch_size 8 counts responses: it must be a multiple of"),
    ],
)
def test_a_group_estimator_refuses_settings_it_cannot_serve(overrides, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(**{**GROUPS, **overrides})


def test_the_stages_last_lines_say_which_kl_is_which():
    from tasks.ppo import summary_lines

    summary = {"ppo/iterations": 4, "ppo/policy_iterations": 3, "ppo/validation/kl": -0.054, "ppo/last/kl": -0.053}
    _, shipped = summary_lines(summary, 0)
    assert "on the validation prompts: reward nan, EOS rate nan, KL -0.054;" in shipped
    assert "last rollout: reward nan, EOS rate nan, KL -0.053 (ppo/last/kl, the headline's)" in shipped
