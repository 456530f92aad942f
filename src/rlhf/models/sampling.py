"""Sampling responses: ``model.generate`` with temperature only, one random stream per prompt.

:func:`sample` draws one response per left-padded prompt and marks where each ends (:class:`Rollout`).
``model.generate`` samples every row from one global generator, so the tokens
a prompt gets depend on the rows beside it and on how the prompts were split
across processes. :class:`PerPromptSampling` draws each row's token by the
Gumbel-max trick from that row's own ``torch.Generator``: ``argmax(z / T + G)``
with ``G = -log(-log U)``, ``U ~ Uniform(0, 1)``, is an exact sample from
``softmax(z / T)`` (Gumbel 1954; Maddison et al. 2014), and greedy decoding over
the perturbed scores is that sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhf.data.chat import pad
from rlhf.runtime.sharding import is_sharded


def prompt_seed(seed: int, iteration: int, position: int) -> int:
    """The seed of the generator of prompt ``position`` (0-based, in the global batch) of rollout ``iteration``."""
    return (seed * 1_000_003 + iteration) * 100_003 + position


class PerPromptSampling(LogitsProcessor):
    """Turn greedy decoding into temperature sampling with one generator per row (see the module docstring).

    Args:
        seeds: one seed per row of the batch ``generate`` runs on.
        temperature: > 0.
        device: where the scores live (the generators draw there).
    """

    def __init__(self, seeds: list[int], temperature: float, device: torch.device):
        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``scores / T`` plus one Gumbel draw per vocabulary entry from each row's own generator.

        Raises:
            ValueError: a batch with another number of rows than seeds.
        """
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows to sample but {len(self.generators)} seeds")
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(uniform.dtype).tiny)))
        return scores.float() / self.temperature + gumbel


@dataclass
class Rollout:
    """Sampled responses for a batch of left-padded prompts.

    ``input_ids``/``attention_mask``: ``(B, P + R)``; ``response_mask``: ``(B, R)``
    bool, True up to and including the first EOS (or on every token when no EOS
    was generated); ``response_start`` = ``P``; ``ended``: ``(B,)`` bool, EOS generated.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    response_start: int
    ended: torch.Tensor


def response_mask_from_tokens(responses: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real response tokens: everything up to and including the first EOS.

    Tokens after the first EOS are padding whatever their id (generation
    pads with the pad id, which may equal a token the model can also sample).

    Args:
        responses: ``(B, R)`` int64 sampled tokens.
        eos_token_id: the end-of-turn id.

    Returns:
        ``(mask (B, R) bool, ended (B,) bool)``.
    """
    is_eos = responses == eos_token_id
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    return eos_before == 0, is_eos.any(dim=-1)


@contextmanager
def cast_once(model: PreTrainedModel) -> Iterator[None]:
    """Under autocast, let every weight be cast to the autocast dtype once per block of work, not at each use.

    torch's autocast caches the cast copy only of weights that require grad; a frozen weight (the policy's
    lower blocks, every weight of the reference or of evaluate's models) is cast again at every matmul of every
    decoding step. Inside this context the frozen weights require grad (nothing here computes gradients: call it
    under ``torch.no_grad``), so each is cast once; they are frozen again on the way out. The cast copies are the
    same either way, so the outputs are too (``tests/test_models.py``). Does nothing without autocast or on a
    sharded (FSDP) model. Measured on this CPU: 64 tokens x 8 prompts in 4.9 s instead of 7.1-7.6 s.
    """
    enabled = torch.is_autocast_enabled(model.device.type) and not is_sharded(model)
    frozen = [p for p in model.parameters() if not p.requires_grad] if enabled else []
    for parameter in frozen:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    greedy: bool = False,
    seeds: list[int] | None = None,
    cache: str = "dynamic",
) -> Rollout:
    """Sample one response per prompt from the policy: temperature only (no top-k, top-p or min length).

    Args:
        model: causal LM (dropout off).
        tokenizer: its tokenizer (pad differs from EOS).
        prompts: token lists from :func:`encode_prompt`.
        max_new_tokens: response length limit.
        temperature: sampling temperature (> 0).
        greedy: decode greedily instead (evaluation only).
        seeds: one per prompt: each prompt's tokens come from its own generator
            (:class:`rlhf.models.sampling.PerPromptSampling`), whatever batch or process it is in; None: torch's
            global generator.
        cache: the KV cache ``generate`` keeps: ``dynamic`` (grows each step) or ``static`` (preallocated for the
            longest sequence; transformers compiles its decode step on CUDA). Both sample the same tokens
            (``tests/test_models.py``, float32); which is faster depends on the device (``bench.gpu_check``).

    Returns:
        :class:`Rollout`.
    """
    input_ids, attention_mask = pad(tokenizer, prompts, "left", model.device)
    per_prompt = seeds is not None and not greedy
    sampled = not greedy and not per_prompt  # model.generate's own sampling, from the global generator
    config = GenerationConfig(
        do_sample=sampled,
        temperature=temperature if sampled else None,
        top_k=0 if sampled else None,
        top_p=1.0 if sampled else None,
        min_new_tokens=0,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        cache_implementation=None if cache == "dynamic" else cache,
    )
    processors = LogitsProcessorList([PerPromptSampling(seeds, temperature, model.device)] if per_prompt else [])
    with cast_once(model):
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=processors,
            synced_gpus=is_sharded(model),  # FSDP: a process that has finished keeps stepping until all have
        )
    start = input_ids.shape[1]
    mask, ended = response_mask_from_tokens(sequences[:, start:], tokenizer.eos_token_id)
    return Rollout(
        input_ids=sequences,
        attention_mask=torch.cat([attention_mask, mask.long()], dim=1),
        response_mask=mask,
        response_start=start,
        ended=ended,
    )
