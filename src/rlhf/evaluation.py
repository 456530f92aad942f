"""Stage 4: compare the policy with the SFT model on held-out prompts, judged by the reward model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import losses
from rlhf.models import encode_prompt, response_logprobs, sample, sequence_scores


@dataclass
class EvalConfig:
    """Evaluation settings (params.yaml section ``evaluate``)."""

    max_prompts: int = 32
    batch_size: int = 8
    max_new_tokens: int = 48
    max_prompt_length: int = 192
    temperature: float = 0.7
    greedy: bool = False
    samples_in_table: int = 8  # rows of the Markdown sample table in reports/eval/samples.md
    seed: int = 1234


def win_rate(policy_scores: torch.Tensor, baseline_scores: torch.Tensor) -> float:
    """Share of prompts where the policy's score beats the baseline's; a tie counts one half.

    Args:
        policy_scores, baseline_scores: ``(N,)`` float, paired by prompt.
    """
    wins = (policy_scores > baseline_scores).float() + 0.5 * (policy_scores == baseline_scores).float()
    return float(wins.mean())


@torch.no_grad()
def _generate_and_score(
    model, reference, reward_model, tokenizer, prompts: list[list[int]], config: EvalConfig
) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    scores, kls, lengths, texts = [], [], [], []
    for start in range(0, len(prompts), config.batch_size):
        rollout = sample(
            model,
            tokenizer,
            prompts[start : start + config.batch_size],
            config.max_new_tokens,
            config.temperature,
            greedy=config.greedy,
        )
        ids, attn, begin, mask = (
            rollout.input_ids,
            rollout.attention_mask,
            rollout.response_start,
            rollout.response_mask,
        )
        scores.append(sequence_scores(reward_model, ids, attn))
        temperature = 1.0 if config.greedy else config.temperature
        logprobs, _ = response_logprobs(model, ids, attn, begin, temperature)
        ref_logprobs, _ = response_logprobs(reference, ids, attn, begin, temperature)
        kls.append((losses.kl_k1(logprobs - ref_logprobs) * mask).sum(-1))
        lengths.append(mask.sum(-1).float())
        texts += [tokenizer.decode(ids[i, begin:][mask[i]], skip_special_tokens=True) for i in range(ids.shape[0])]
    return {"scores": torch.cat(scores), "kl": torch.cat(kls), "lengths": torch.cat(lengths), "texts": texts}


def evaluate_policy(
    sft: PreTrainedModel,
    policy: PreTrainedModel,
    reward_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[dict]],
    config: EvalConfig,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate with the SFT model and the policy on the same prompts and compare them.

    The SFT model is also the reference model of PPO, so the policy's KL to the
    reference is measured against ``sft`` (sequence-level k1, nats per response,
    tutorial Eq. 9's estimate on the policy's own samples).

    Args:
        sft, policy, reward_model: dropout off.
        tokenizer: shared tokenizer.
        prompts: message lists (each ends with a user turn).
        config: :class:`EvalConfig`.

    Returns:
        ``(metrics, samples)``: metrics ``eval/sft/reward``, ``eval/policy/reward``,
        ``eval/win_rate``, ``eval/policy/kl``, ``eval/sft/length``,
        ``eval/policy/length``, ``eval/prompts``; samples: every prompt
        with both responses and their scores.

    Raises:
        ValueError: no prompts.
    """
    if not prompts:
        raise ValueError("no evaluation prompts")
    prompts = prompts[: config.max_prompts]
    encoded = [encode_prompt(tokenizer, p, config.max_prompt_length) for p in prompts]
    for model in (sft, policy, reward_model):
        model.eval()
    base = _generate_and_score(sft, sft, reward_model, tokenizer, encoded, config)
    tuned = _generate_and_score(policy, sft, reward_model, tokenizer, encoded, config)
    metrics = {
        "eval/sft/reward": float(base["scores"].mean()),
        "eval/policy/reward": float(tuned["scores"].mean()),
        "eval/win_rate": win_rate(tuned["scores"], base["scores"]),
        "eval/policy/kl": float(tuned["kl"].mean()),
        "eval/sft/length": float(base["lengths"].mean()),
        "eval/policy/length": float(tuned["lengths"].mean()),
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
