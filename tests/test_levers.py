"""Each speed lever computes what it replaces: on vs off on the same batch, through the product's own code.

The levers: chunked gather-minus-logsumexp logprobs (``likelihood.LOGPROB_CHUNK``), only the response positions
through the LM head (``logits_to_keep`` in ``models.response_logprobs``), bf16 autocast
(``device.mixed_precision: bf16``), bf16 storage of the frozen models (``device.frozen_bf16``) and the fused
AdamW of ``training.make_optimizer`` and the ``gradient_checkpointing`` option of the supervised loop
(the LoRA policy has its own file, ``tests/test_lora.py``).
Each tolerance is stated where it is used, with the figure measured on the tiny model.

bf16 keeps 8 significant bits (7 stored + 1 implicit): a unit roundoff of 2**-8 = 3.9e-3, about 3 significant
decimal digits, per rounding; a forward pass rounds the residual stream, the attention and the MLP outputs
a few times per block, so errors of a few 1e-3 of the output's scale are expected and 1e-2 is the bound.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_ppo import PROMPTS, four_models

from rlhf import likelihood
from rlhf.data.chat import encode_chat, encode_prompt, pad, pad_masks
from rlhf.models.forward import position_ids_from_mask, response_logprobs, sequence_scores, target_logprobs
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.rollout import make_experience, value_predictions
from rlhf.ppo.types import PPOModels
from rlhf.ppo.update import make_optimisers, ppo_update
from rlhf.runtime.device import Runtime
from rlhf.training.sft import SFTConfig, sft_step, train_sft
from rlhf.training.supervised import make_optimizer

FP32, BF16 = Runtime(torch.device("cpu"), "no"), Runtime(torch.device("cpu"), "bf16")
TEMPERATURE = 0.7
RELATIVE_BF16 = 1e-2  # see the module docstring: 2.5 x bf16's unit roundoff


@pytest.fixture(scope="module")
def batch(tokenizer):
    """A rollout-shaped batch: prompts of different lengths left-padded, then 5 response tokens.

    The second response ends (EOS) after 2 tokens, so its attention mask has zeros after it, as a
    rollout's does. Returns ``(input_ids, attention_mask, response_start, response_mask)``.
    """
    prompts = [encode_prompt(tokenizer, p, 32) for p in PROMPTS[:3]]
    ids, attn = pad(tokenizer, prompts, "left", torch.device("cpu"))
    responses = torch.tensor([[100, 200, 300, 400, 500], [150, 2, 0, 0, 0], [7, 77, 777, 7777, 2]])
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return torch.cat([ids, responses], 1), torch.cat([attn, response_mask.long()], 1), ids.shape[1], response_mask


# ---------------------------------------------------------------------------------------------- chunked logprobs


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_chunked_logprobs_equal_log_softmax_and_gather_with_gradients(monkeypatch, temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 40)).requires_grad_()  # 15 positions: chunks of 3 and one of all
    tokens = torch.randint(0, 40, (3, 5))
    weights = torch.randn(3, 5)

    def run(chunk):
        monkeypatch.setattr(likelihood, "LOGPROB_CHUNK", chunk)
        logprobs = likelihood.logprobs_from_logits(logits, tokens, temperature)
        (gradient,) = torch.autograd.grad((logprobs * weights).sum(), logits)
        return logprobs, gradient

    chunked, chunked_grad = run(3)
    whole, whole_grad = run(10**6)
    reference = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    # chunks only split the rows; each row's arithmetic is the same, so chunked == whole bit for bit
    assert torch.equal(chunked, whole) and torch.equal(chunked_grad, whole_grad)
    # log_softmax + gather rounds in another order: fp32 (eps 1.2e-7) on logprobs up to ~17 nats,
    # a few ulp each; 1e-6 absolute plus 1e-6 relative (measured: 9.5e-7 at -17 nats)
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked_grad, reference_grad, rtol=1e-6, atol=1e-6)


def test_logprobs_of_bf16_logits_are_taken_in_float32():
    # bf16 logits are upcast before the logsumexp: the result is the fp32 log-softmax of the same bf16 values
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 40).bfloat16()
    tokens = torch.randint(0, 40, (2, 4))
    logprobs = likelihood.logprobs_from_logits(logits, tokens, TEMPERATURE)
    reference = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, reference, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- logits_to_keep


def test_response_logprobs_with_logits_to_keep_equal_the_full_forward(tiny_dir, batch):
    ids, attn, start, _ = batch
    model = four_models(tiny_dir).policy
    with torch.no_grad():
        logprobs, logits = response_logprobs(model, ids, attn, start, TEMPERATURE, with_logits=True)
        full = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    expected_logits = full[:, start - 1 : -1].float() / TEMPERATURE  # position t - 1 predicts token t
    expected = torch.log_softmax(expected_logits, -1).gather(-1, ids[:, start:, None]).squeeze(-1)
    assert logprobs.shape == ids[:, start:].shape
    # fp32 both ways; the LM head runs on fewer rows, which another GEMM blocking may round otherwise: 1e-5
    # absolute (measured: logits bit-identical, logprobs 9.5e-7 apart: logsumexp vs log_softmax rounding)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_sft_loss_with_the_head_on_targets_equals_the_full_logits_loss_with_gradients(tiny_dir, tokenizer, side):
    # SFT's step runs the LM head only where a response token is predicted (forward.target_logprobs); on the
    # same rows, the full forward's language_model_loss (every position through the head) is the same loss and
    # the same gradients: fp32 both ways, within 1e-6, or 1e-5 of a gradient's largest entry (on the tiny model:
    # bit-identical on the AMX Xeon; on the EPYC the tied embedding's gradient differed by 1.5e-6 of 0.63)
    examples = [
        {"prompt": [{"role": "user", "content": "q" * (3 + 5 * i)}], "chosen": [{"role": "assistant", "content": a}]}
        for i, a in enumerate(["ok", "a longer answer here", "no"])
    ]
    encoded = [encode_chat(tokenizer, e["prompt"], e["chosen"], 64) for e in examples]
    ids, attn = pad(tokenizer, [e.input_ids for e in encoded], side, torch.device("cpu"))
    target = pad_masks([e.response_mask for e in encoded], ids.shape[1], side, torch.device("cpu"))
    count = sum(likelihood.target_tokens(e.response_mask) for e in encoded)
    grads = []
    for lean in (True, False):
        model = load_causal_lm(tiny_dir)
        if lean:
            rows, positions = torch.nonzero(target[:, 1:], as_tuple=True)  # position t predicts target t + 1
            loss = likelihood.target_nll(target_logprobs(model, ids, attn, rows, positions), count)
        else:
            logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
            loss = likelihood.language_model_loss(logits, ids, target, count)
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lean_loss, lean_grads), (full_loss, full_grads) = grads
    assert lean_loss == pytest.approx(full_loss, abs=1e-6)
    for name, grad in full_grads.items():
        scale = float(grad.abs().max())  # summation order: a tied head's gradient sums over every position
        torch.testing.assert_close(lean_grads[name], grad, rtol=0, atol=max(1e-6, 1e-5 * scale), msg=name)
    # and the stage's own step function computes this loss
    step = sft_step(load_causal_lm(tiny_dir), tokenizer, encoded, FP32)
    loss, stats = step([0, 1, 2], [0, 1, 2])
    assert loss.item() == pytest.approx(full_loss, abs=1e-6)
    assert int(stats["sft/tokens"]) == int(target.sum())


# ---------------------------------------------------------------------------------------------- bf16 autocast


def _head_scale(model) -> float:
    """A bound on a scalar head's output: ``||w|| * sqrt(hidden) * max|final norm weight|``.

    Cauchy-Schwarz: ``|w . h| <= ||w|| ||h||``, and the final RMSNorm makes ``||h|| <= sqrt(hidden) *
    max|norm weight|``. So ``|w . dh| / bound <= ||dh|| / ||h||``: the error of the head, on this scale, is at
    most the relative error of the hidden state, which bf16 sets (a few unit roundoffs). The output itself
    is a poor scale: a dot product can cancel to near 0 while its error does not.
    """
    backbone = getattr(model, model.base_model_prefix)
    return (model.score.weight.norm() * model.config.hidden_size**0.5 * backbone.norm.weight.abs().max()).item()


def test_bf16_autocast_matches_fp32_on_the_same_batch(tiny_dir, batch):
    ids, attn, start, mask = batch
    models = four_models(tiny_dir)

    def forward(runtime):
        with torch.no_grad(), runtime.autocast():
            return (
                response_logprobs(models.policy, ids, attn, start, TEMPERATURE)[0][mask],
                sequence_scores(models.reward_model, ids, attn),
                value_predictions(models.value_model, ids, attn, start)[mask],
            )

    exact, fast = forward(FP32), forward(BF16)
    scales = {
        # logprobs: on the scale of the largest (about log(vocab) = 10.8 nats for this random model)
        "logprobs": exact[0].abs().max().item(),
        "scores": _head_scale(models.reward_model),
        "values": _head_scale(models.value_model),  # uncalibrated: V is the head's output
    }
    for (name, scale), a, b in zip(scales.items(), exact, fast, strict=True):
        assert a.dtype == b.dtype == torch.float32, name
        assert not torch.equal(a, b), f"{name}: bf16 autocast changed nothing; is it on?"
        # measured on the tiny model: logprobs 1.3e-4 of 11.2 nats (1.5e-3 nats), scores 8.9e-4 of 33.2
        # (0.029), values 1.9e-3 of 33.2 (0.063); bound RELATIVE_BF16 = 1e-2
        error = (a - b).abs().max().item() / scale
        assert error < RELATIVE_BF16, (name, error)
    # a response's logprob summed over its tokens: the errors do not pile up (measured 1.6e-3 nats on 54)
    sums = [torch.zeros(mask.shape).masked_scatter(mask, lp).sum(-1) for lp in (exact[0], fast[0])]
    assert (sums[1] - sums[0]).abs().max().item() < RELATIVE_BF16 * sums[0].abs().max().item()


@pytest.fixture(scope="module")
def rollout(tiny_dir, tokenizer):
    """``(models, experience)``: one experience buffer sampled and scored under bf16 autocast, from fresh models."""
    models = four_models(tiny_dir)
    prompts = [encode_prompt(tokenizer, p, 32) for p in PROMPTS[:4]]
    settings = GenerationSettings(max_new_tokens=6, temperature=TEMPERATURE)
    experience, _ = make_experience(models, tokenizer, prompts, CONFIG, settings, RewardMoments(), 0.05, BF16)
    return models, experience


CONFIG = PPOConfig(rollout_batch_size=4, minibatch_size=4, ppo_epochs=1)  # one minibatch: the first


def _update(rollout, runtime: Runtime) -> dict[str, float]:
    """``ppo_update`` of copies of the rollout's policy and value model under ``runtime``; its stats."""
    models, experience = rollout
    policy, value_model = copy.deepcopy(models.policy), copy.deepcopy(models.value_model)
    optimisers = make_optimisers(policy, value_model, CONFIG)
    return ppo_update(policy, value_model, optimisers, experience, CONFIG, TEMPERATURE, 0, None, True, runtime)


def test_bf16_autocast_matches_fp32_on_a_ppo_step(rollout):
    # the same buffer, the same weights: one policy and one value step under each precision
    exact, fast = _update(rollout, FP32), _update(rollout, BF16)
    # measured: policy loss -1.5206 vs -1.5215 (6e-4 relative), its gradient norm 4.5e-4, the value loss
    # 1.2e-3, its gradient norm 9e-5: all well inside RELATIVE_BF16
    for key in ("ppo/loss/policy", "ppo/policy/grad_norm", "ppo/loss/value", "ppo/value/grad_norm"):
        assert fast[key] != exact[key], f"{key}: bf16 autocast changed nothing; is it on?"
        assert fast[key] == pytest.approx(exact[key], rel=RELATIVE_BF16), key


def test_ppo_ratio_is_one_on_the_first_minibatch_under_bf16(rollout):
    # rollout and update logprobs come from the same function on the same weights under the same autocast:
    # exactly 1 on this CPU; 1e-4 leaves room for kernels that differ with the batch shape (GPUs)
    stats = _update(rollout, BF16)
    assert stats["ppo/policy/ratio"] == pytest.approx(1.0, abs=1e-4)
    assert stats["ppo/policy/approx_kl"] < 1e-9
    assert stats["ppo/policy/clipfrac"] == 0.0
    # the same check sees an update computed otherwise than its rollout: bf16 logprobs updated in fp32 are
    # off by a few 1e-4 nats a token (approx_kl = 0.5 E[log(rho)^2] measured 2.1e-7, mean ratio 1 - 6e-5)
    assert _update(rollout, FP32)["ppo/policy/approx_kl"] > 1e-8


# ---------------------------------------------------------------------------------------------- frozen_bf16


@pytest.mark.parametrize("frozen_bf16", [False, True])
def test_frozen_bf16_reference_costs_a_small_kl_at_the_start(tiny_dir, tokenizer, batch, frozen_bf16):
    # policy and reference start equal; under frozen_bf16 the reference's weights are stored in bf16
    runtime = Runtime(torch.device("cpu"), "bf16", frozen_bf16=frozen_bf16)
    models = four_models(tiny_dir)
    policy, reference = runtime.place(models.policy), runtime.frozen(models.reference)
    assert reference.dtype == (torch.bfloat16 if frozen_bf16 else torch.float32)
    ids, attn, start, mask = batch
    with torch.no_grad(), runtime.autocast():
        logratio = response_logprobs(policy, ids, attn, start, TEMPERATURE)[0]
        logratio = logratio - response_logprobs(reference, ids, attn, start, TEMPERATURE)[0]
    kl = torch.where(mask, logratio, 0.0).sum(-1)  # k1 per response, nats (what PPO penalises)
    # and through the rollout: PPO's own ppo/kl (mean over responses of the summed k1) and its k3
    torch.manual_seed(0)
    prompts = [encode_prompt(tokenizer, p, 32) for p in PROMPTS[:2]]
    settings = GenerationSettings(max_new_tokens=4, temperature=TEMPERATURE)
    models = PPOModels(policy, reference, runtime.frozen(models.reward_model), runtime.place(models.value_model))
    _, stats = make_experience(models, tokenizer, prompts, CONFIG, settings, RewardMoments(), 0.05, runtime)
    if not frozen_bf16:
        # the same weights, dtype and autocast: the reference computes exactly as the policy
        assert torch.equal(kl, torch.zeros_like(kl))
        assert stats["ppo/kl"] == 0.0 and stats["ppo/kl_k3"] == 0.0
        return
    # The documented cost of frozen_bf16, measured on the tiny model (2 blocks, hidden 32; measure it again
    # on the real model): |k1| per token up to 2.8e-3 nats, per response (2-5 tokens) up to 4.1e-3 nats;
    # in the rollout (2 responses of 4 tokens) PPO's ppo/kl 1.9e-4 (signed k1: it mostly cancels), ppo/kl_k3 1.5e-6.
    # Bounds: 1e-2 nats per token, 2e-2 per response: 3.5x and 5x the measured figures, and still 2 orders
    # of magnitude below a KL a PPO run notices (kl_target is nats per response, e.g. 6 in params.yaml).
    per_token = torch.where(mask, logratio, 0.0).abs().max().item()
    assert 0.0 < per_token < 1e-2
    assert 0.0 < kl.abs().max().item() < 2e-2
    assert stats["ppo/kl_k3"] > 0.0 and abs(stats["ppo/kl"]) < 2e-2


def test_fused_adamw_takes_the_same_steps_as_the_looped_one(tiny_dir):
    # make_optimizer's fused AdamW against torch's default (a loop over the tensors) on the same gradients:
    # fp32 arithmetic in a different order. An Adam step moves a weight by up to lr = 1e-2; measured: the weights
    # agree to 1.8e-6 after three steps (the first steps divide by sqrt(v) + eps, sensitive for tiny gradients),
    # so atol 1e-5 = a thousandth of one step
    fused_model, looped_model = load_causal_lm(tiny_dir), load_causal_lm(tiny_dir)
    fused = make_optimizer(fused_model, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True
    looped = torch.optim.AdamW(looped_model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.tensor([[1, 28, 105, 9, 2, 77, 31]])
    for _ in range(3):
        for model, optimizer in ((fused_model, fused), (looped_model, looped)):
            optimizer.zero_grad()
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            optimizer.step()
    for (name, a), b in zip(fused_model.state_dict().items(), looped_model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-5), name
    moved = [
        not torch.equal(a, b)
        for a, b in zip(fused_model.parameters(), load_causal_lm(tiny_dir).parameters(), strict=True)
    ]
    assert all(moved)  # every tensor took its steps


def test_gradient_checkpointing_trains_exactly_as_without(tiny_dir, tokenizer):
    # the same two SFT steps with the block activations kept or recomputed in the backward pass: the same
    # arithmetic in the same order, so the losses and the weights agree to fp32 noise (1e-6)
    examples = [
        {"prompt": [{"role": "user", "content": f"question {i}"}], "chosen": [{"role": "assistant", "content": "ok"}]}
        for i in range(4)
    ]
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, logged = load_causal_lm(tiny_dir), []
        config = SFTConfig(
            steps=2,
            batch_size=2,
            lr=1e-2,
            checkpoint_every=0,
            gradient_checkpointing=checkpointing,
            trainable_layers=None,
        )
        log = logged.append
        summary = train_sft(
            model, tokenizer, examples, config, lambda m, s, log=log: log(m["sft/loss"]), FP32, progress=False
        )
        assert summary["sft/epochs"] == 1.0  # 2 steps x 2 of the 4 examples: each once
        assert model.is_gradient_checkpointing == checkpointing
        results.append((logged, model.state_dict()))
    (plain_losses, plain), (checkpointed_losses, checkpointed) = results
    assert checkpointed_losses == pytest.approx(plain_losses, abs=1e-6)
    for name, tensor in plain.items():
        assert torch.allclose(tensor, checkpointed[name], atol=1e-6), name
    assert not torch.equal(plain["lm_head.weight"], load_causal_lm(tiny_dir).state_dict()["lm_head.weight"])
