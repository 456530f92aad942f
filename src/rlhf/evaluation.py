"""Stage 4: compare the policy with the SFT model on held-out prompts, judged by the reward model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import losses
from rlhf.chat import encode_prompt
from rlhf.device import Runtime
from rlhf.models import response_logprobs
from rlhf.rollout import GenerationSettings, sample_and_score
from rlhf.stats import PairedRate, paired_rate


@dataclass
class EvalConfig:
    """Evaluation settings (params.yaml section ``evaluate``)."""

    max_prompts: int = 32
    batch_size: int = 8
    max_prompt_length: int = 192
    greedy: bool = False  # greedy decoding instead of sampling at generation.temperature
    samples_in_table: int = 8  # rows of the Markdown sample table in reports/eval/samples.md
    seed: int = 1234


def win_rate(policy_scores: torch.Tensor, baseline_scores: torch.Tensor) -> PairedRate:
    """Share of decisive prompts where the policy's score beats the baseline's, with its Wilson 95% interval.

    The product's tie rule (:func:`rlhf.stats.paired_rate`): a prompt where
    both scores are exactly equal is not decisive; it is left out of the rate
    and of ``n``, counted in ``ties``, and a :class:`rlhf.stats.TiesWarning` is
    issued. When every prompt ties the rate and interval are NaN.

    Args:
        policy_scores, baseline_scores: ``(N,)`` float reward-model scores, paired by prompt.

    Returns:
        :class:`rlhf.stats.PairedRate`: ``rate`` (wins / n), ``low``, ``high``
        (Wilson 95%), ``wins``, ``n`` (decisive prompts), ``ties``.

    Raises:
        ValueError: shapes differ or a score is NaN.
    """
    return paired_rate(policy_scores, baseline_scores, what="evaluation prompts")


@torch.no_grad()
def _generate_and_score(
    model,
    reference,
    reward_model,
    tokenizer,
    prompts: list[list[int]],
    config: EvalConfig,
    settings: GenerationSettings,
    runtime: Runtime,
) -> dict[str, Any]:
    """Sample (or decode greedily) and score every prompt as PPO does; KL to ``reference`` per response."""
    torch.manual_seed(config.seed)
    scores, ended, kls, lengths, texts = [], [], [], [], []
    temperature = 1.0 if config.greedy else settings.temperature
    for start in range(0, len(prompts), config.batch_size):
        batch = prompts[start : start + config.batch_size]
        with runtime.autocast():
            scored = sample_and_score(model, reward_model, tokenizer, batch, settings, greedy=config.greedy)
            rollout = scored.rollout
            ids, attn, begin, mask = (
                rollout.input_ids,
                rollout.attention_mask,
                rollout.response_start,
                rollout.response_mask,
            )
            logprobs, _ = response_logprobs(model, ids, attn, begin, temperature)
            ref_logprobs, _ = response_logprobs(reference, ids, attn, begin, temperature)
        kls.append(torch.where(mask, losses.kl_k1(logprobs - ref_logprobs), 0.0).sum(-1))
        scores.append(scored.scores)
        ended.append(rollout.ended)
        lengths.append(mask.sum(-1).float())
        texts += [tokenizer.decode(ids[i, begin:][mask[i]], skip_special_tokens=True) for i in range(ids.shape[0])]
    return {
        "scores": torch.cat(scores),
        "ended": torch.cat(ended),
        "kl": torch.cat(kls),
        "lengths": torch.cat(lengths),
        "texts": texts,
    }


def evaluate_policy(
    sft: PreTrainedModel,
    policy: PreTrainedModel,
    reward_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict]],
    config: EvalConfig,
    settings: GenerationSettings,
    runtime: Runtime,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate with the SFT model and the policy on the same prompts and compare them.

    Responses are sampled and scored with PPO's :class:`rlhf.rollout.GenerationSettings`
    (same length limit, same treatment of a response without EOS). The SFT
    model is also the reference model of PPO, so the policy's KL to the
    reference is measured against ``sft`` (sequence-level k1, nats per response,
    tutorial Eq. 9's estimate on the policy's own samples).

    Args:
        sft, policy, reward_model: dropout off.
        tokenizer: shared tokenizer.
        prompts: message lists (each ends with a user turn).
        config: :class:`EvalConfig`; settings: the shared generation settings.
        runtime: device and precision; the models already on its device.

    Returns:
        ``(metrics, samples)``: metrics ``eval/{sft,policy}/{reward,length,eos_rate}``,
        ``eval/win_rate`` with ``eval/win_rate_low``/``_high`` (Wilson 95%), ``eval/win_rate_n``,
        ``eval/ties``, ``eval/policy/kl``, ``eval/prompts``; samples: every prompt with both
        responses and their scores.

    Raises:
        ValueError: no prompts.
    """
    if not prompts:
        raise ValueError("no evaluation prompts")
    prompts = prompts[: config.max_prompts]
    encoded = [encode_prompt(tokenizer, p, config.max_prompt_length) for p in prompts]
    for model in (sft, policy, reward_model):
        model.eval()
    base = _generate_and_score(sft, sft, reward_model, tokenizer, encoded, config, settings, runtime)
    tuned = _generate_and_score(policy, sft, reward_model, tokenizer, encoded, config, settings, runtime)
    wins = win_rate(tuned["scores"], base["scores"])
    metrics = {
        **{f"eval/{name}/reward": float(run["scores"].mean()) for name, run in (("sft", base), ("policy", tuned))},
        **{
            f"eval/{name}/eos_rate": float(run["ended"].float().mean())
            for name, run in (("sft", base), ("policy", tuned))
        },
        **{f"eval/{name}/length": float(run["lengths"].mean()) for name, run in (("sft", base), ("policy", tuned))},
        "eval/win_rate": wins.rate,
        "eval/win_rate_low": wins.low,
        "eval/win_rate_high": wins.high,
        "eval/win_rate_n": float(wins.n),
        "eval/ties": float(wins.ties),
        "eval/policy/kl": float(tuned["kl"].mean()),
        "eval/prompts": float(len(prompts)),
    }
    samples = [
        {
            "prompt": prompts[i][-1]["content"],
            "sft_response": base["texts"][i],
            "sft_reward": float(base["scores"][i]),
            "policy_response": tuned["texts"][i],
            "policy_reward": float(tuned["scores"][i]),
        }
        for i in range(len(prompts))
    ]
    return metrics, samples
