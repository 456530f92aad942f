"""PPO trainer behaviour on a tiny random Llama.

Ratio at the start, PPO-ptx gradient, normaliser, collapse guard, resume.
"""

import json
import os

import pytest
import torch
from conftest import Killed

from rlhf.losses import language_model_loss, ppo_clip_loss
from rlhf.models import encode_prompt, load_causal_lm, load_scalar_model, response_logprobs
from rlhf.ppo import Optimisers, PPOConfig, RunningMoments, detect_collapse, make_experience, ppo_update, train_ppo
from rlhf.training import Checkpointer, make_optimizer, make_scheduler

PROMPTS = [
    [{"role": "user", "content": text}]
    for text in ["Hi", "How are you?", "Tell me a joke", "What is 2+2?", "Name a colour", "Say yes"]
]


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


def four_models(folder):
    torch.manual_seed(0)
    policy, reference = load_causal_lm(folder), load_causal_lm(folder)
    reward_model, value_model = load_scalar_model(folder), load_scalar_model(folder)
    torch.nn.init.normal_(reward_model.score.weight, std=1.0)
    value_model.score.weight.data.copy_(reward_model.score.weight.data)
    return policy, reference, reward_model, value_model


def test_ppo_ratio_is_one_on_first_minibatch_with_dropout_in_config(dropout_dir, tokenizer):
    policy, reference, reward_model, value_model = four_models(dropout_dir)
    assert policy.config.attention_dropout == 0.0
    policy.train()  # even in train mode nothing may drop out
    config = PPOConfig(rollout_batch_size=4, minibatch_size=4, ppo_epochs=1, max_new_tokens=6, temperature=0.7)
    prompts = [encode_prompt(tokenizer, p, 32) for p in PROMPTS[:4]]
    experience, _ = make_experience(
        policy, reference, reward_model, value_model, tokenizer, prompts, config, RunningMoments(), 0.05
    )
    opt = Optimisers(make_optimizer(policy, 1e-3), make_optimizer(value_model, 1e-3), None, None)
    opt.policy_schedule, opt.value_schedule = (
        make_scheduler(opt.policy, "constant", 0, 1),
        make_scheduler(opt.value, "constant", 0, 1),
    )
    stats = ppo_update(
        policy, value_model, opt, experience, config, torch.Generator().manual_seed(0), None, update_policy=True
    )
    assert stats["ppo/policy/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ppo/policy/clipfrac"] == 0.0


def test_ptx_term_adds_exactly_lambda_times_lm_gradient(tiny_dir, tokenizer):
    policy = load_causal_lm(tiny_dir)
    ids = torch.tensor([encode_prompt(tokenizer, PROMPTS[0], 16) + [5, 6, 2]])
    attn = torch.ones_like(ids)
    start = ids.shape[1] - 3
    mask = torch.ones(1, 3, dtype=torch.bool)
    ptx = torch.tensor([[10, 11, 12, 13, 14]])
    coef = 0.3

    def grads(with_ptx: bool):
        policy.zero_grad()
        logprobs, _ = response_logprobs(policy, ids, attn, start)
        loss, _ = ppo_clip_loss(logprobs, logprobs.detach() - 0.1, torch.tensor([[1.0, -0.5, 2.0]]), mask, 0.2)
        if with_ptx:
            loss = loss + coef * language_model_loss(
                policy(input_ids=ptx).logits, ptx, torch.ones_like(ptx, dtype=torch.bool)
            )
        loss.backward()
        return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])

    def lm_grad():
        policy.zero_grad()
        language_model_loss(policy(input_ids=ptx).logits, ptx, torch.ones_like(ptx, dtype=torch.bool)).backward()
        return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])

    difference = grads(True) - grads(False)
    assert torch.allclose(difference, coef * lm_grad(), atol=1e-6)


def test_running_moments_population_stats_and_clip():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0]))
    moments.update(torch.tensor([4.0]))
    # population mean and std of [1, 2, 3, 4]: 2.5 and sqrt(1.25)
    assert moments.mean == pytest.approx(2.5)
    assert moments.std == pytest.approx(1.25**0.5)
    out = moments.normalize(torch.tensor([-100.0, 2.5, 3.0, 100.0]), clip=0.5)
    assert out.min() >= -0.5 and out.max() <= 0.5
    assert out[1].item() == pytest.approx(0.0)


def test_running_moments_refuse_to_pass_rewards_through_without_statistics():
    with pytest.raises(RuntimeError, match="no reward statistics"):
        RunningMoments().normalize(torch.tensor([1.0]), clip=1.0)


def test_collapse_detector_flags_each_signal():
    config = PPOConfig(
        collapse_kl_max=10.0, collapse_length_ratio=2.0, collapse_perplexity_ratio=2.0, collapse_reward_skew=2.0
    )
    baseline = {"ppo/response_length": 20.0, "ppo/perplexity": 5.0}
    healthy = {"ppo/kl": 1.0, "ppo/response_length": 25.0, "ppo/perplexity": 6.0, "ppo/reward/skew": 0.1}
    assert detect_collapse(healthy, baseline, config) is None
    assert "KL" in detect_collapse({**healthy, "ppo/kl": 11.0}, baseline, config)
    assert "response_length" in detect_collapse({**healthy, "ppo/response_length": 9.0}, baseline, config)
    assert "perplexity" in detect_collapse({**healthy, "ppo/perplexity": 11.0}, baseline, config)
    assert "long tail" in detect_collapse({**healthy, "ppo/reward/skew": 2.5}, baseline, config)
    off = PPOConfig(
        collapse_kl_max=None, collapse_length_ratio=None, collapse_perplexity_ratio=None, collapse_reward_skew=None
    )
    assert detect_collapse({**healthy, "ppo/kl": 1e9, "ppo/reward/skew": 9.0}, baseline, off) is None


def test_resume_after_kill_matches_uninterrupted_run(tiny_dir, tokenizer, tmp_path):
    config = PPOConfig(
        iterations=5,
        value_pretrain_iterations=1,
        rollout_batch_size=2,
        minibatch_size=2,
        ppo_epochs=1,
        max_new_tokens=4,
        ptx_coef=0.5,
        ptx_batch_size=1,
        validate_every=2,
        validation_prompts=1,
        collapse_reward_skew=None,
        checkpoint_every=1,
    )
    prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS]
    ptx = [[10, 11, 12, 2], [20, 21, 2]]

    def run(root, logged, kill_at=None):
        def log(metrics, step):
            if step == kill_at:
                raise Killed
            logged[step] = metrics

        models = four_models(tiny_dir)
        train_ppo(
            *models, tokenizer, prompts[:5], prompts[5:], ptx, config, log, Checkpointer(str(root)), progress=False
        )
        return logged

    full = run(tmp_path / "full", {})
    resumed = {}
    with pytest.raises(Killed):
        run(tmp_path / "resumed", resumed, kill_at=4)
    assert Checkpointer(str(tmp_path / "resumed")).latest().endswith("step-00000003")
    run(tmp_path / "resumed", resumed)
    assert sorted(resumed) == sorted(full) == [1, 2, 3, 4, 5, 6]
    for step in full:
        for key, value in full[step].items():
            assert resumed[step][key] == pytest.approx(value, abs=1e-6, nan_ok=True), (step, key)


@pytest.mark.parametrize(
    "action, expected_iterations, expected_rollbacks", [("stop", 3, 0), ("rollback", 5, 1), ("warn", 5, 0)]
)
def test_collapse_guard_stops_rolls_back_or_warns(
    tiny_dir, tokenizer, tmp_path, monkeypatch, action, expected_iterations, expected_rollbacks
):
    import rlhf.ppo as ppo_module

    # iteration 1 is critic pre-training, 2 validates and becomes best, 3 and 5 "collapse"
    monkeypatch.setattr(
        ppo_module, "detect_collapse", lambda stats, baseline, config: "planted" if stats["step"] in (3, 5) else None
    )
    real_make_experience = ppo_module.make_experience
    counter = {"step": 0}

    def make_experience(*args, **kwargs):
        experience, stats = real_make_experience(*args, **kwargs)
        counter["step"] += 1
        return experience, {**stats, "step": counter["step"]}

    monkeypatch.setattr(ppo_module, "make_experience", make_experience)
    config = PPOConfig(
        iterations=4,
        value_pretrain_iterations=1,
        rollout_batch_size=2,
        minibatch_size=2,
        ppo_epochs=1,
        max_new_tokens=4,
        policy_lr=1e-2,
        validate_every=2,
        validation_prompts=1,
        on_collapse=action,
        max_rollbacks=1,
        checkpoint_every=1,
    )
    prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS]
    logged = {}
    policy, reference, reward_model, value_model = four_models(tiny_dir)
    checkpointer = Checkpointer(str(tmp_path))
    result = train_ppo(
        policy,
        reference,
        reward_model,
        value_model,
        tokenizer,
        prompts[:5],
        prompts[5:],
        [],
        config,
        lambda m, s: logged.__setitem__(s, m),
        checkpointer,
        progress=False,
    )
    assert max(logged) == expected_iterations
    assert sum(m.get("ppo/rollback", 0.0) for m in logged.values()) == expected_rollbacks
    assert (result.stopped_by is not None) == (action != "warn")
    if action == "stop":
        assert result.best_iteration == 2
    if action != "warn":  # the result is the best policy by validation reward, not the collapsed one
        best = Checkpointer(str(tmp_path / "best")).latest()
        assert best.endswith(f"step-{result.best_iteration:08d}")
        best_weights = type(policy).from_pretrained(os.path.join(best, "policy")).state_dict()
        assert all(torch.equal(best_weights[k], v) for k, v in policy.state_dict().items())
