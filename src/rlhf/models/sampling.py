"""Sampling responses: our own decoding loop over the model's forward pass, temperature only, one random stream
per prompt.

:func:`sample` draws one response per left-padded prompt and marks where each ends (:class:`Rollout`).
``model.generate`` samples every row from one global generator, so the tokens
a prompt gets would depend on the rows beside it and on how the prompts were split
across processes. :class:`PerPromptSampling` draws each row's token by the
Gumbel-max trick from that row's own ``torch.Generator``: ``argmax(z / T + G)``
with ``G = -log(-log U)``, ``U ~ Uniform(0, 1)``, is an exact sample from
``softmax(z / T)`` (Gumbel 1954; Maddison et al. 2014), and greedy decoding over
the perturbed scores is that sample.

The loop (:func:`decode`) computes what ``model.generate`` computes for these settings, the same tokens in
float32 (``tests/test_models.py``), and two things it cannot: a row that has sampled EOS leaves the batch (its KV
cache rows are dropped, so later steps cost only the rows still writing), and rows with the same prompt (best-of-N,
k samples a prompt) share one prefill, its KV cache copied to each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import Cache, DynamicCache, LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase, StaticCache

from rlhf.data.chat import pad
from rlhf.runtime.sharding import is_sharded


def prompt_seed(seed: int, iteration: int, position: int) -> int:
    """The seed of the generator of prompt ``position`` (0-based, in the global batch) of rollout ``iteration``."""
    return (seed * 1_000_003 + iteration) * 100_003 + position


class PerPromptSampling(LogitsProcessor):
    """Temperature sampling with one generator per row (see the module docstring); also a ``LogitsProcessor``
    that turns ``model.generate``'s greedy decoding into this sampling.

    Args:
        seeds: one seed per row of the batch.
        temperature: > 0.
        device: where the scores live (the generators draw there).
    """

    def __init__(self, seeds: list[int], temperature: float, device: torch.device):
        self.temperature = temperature
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def perturb(self, scores: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """``scores / T`` plus one Gumbel draw per vocabulary entry from each row's own generator.

        Args:
            scores: ``(R, V)`` logits of ``R`` rows.
            rows: which rows of the batch (indices into ``seeds``) they are; None: all, in order.

        Returns:
            ``(R, V)`` float32: its argmax is each row's sample.

        Raises:
            ValueError: another number of rows than ``rows`` (or than seeds) names.
        """
        generators = self.generators if rows is None else [self.generators[r] for r in rows]
        if scores.shape[0] != len(generators):
            raise ValueError(f"{scores.shape[0]} rows to sample but {len(generators)} seeds")
        uniform = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device) for g in generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(uniform.dtype).tiny)))
        return scores.float() / self.temperature + gumbel

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """:meth:`perturb` over every row (the ``LogitsProcessor`` interface)."""
        return self.perturb(scores)


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


def select_rows(cache: Cache, index: torch.Tensor) -> None:
    """Keep (or repeat) the batch rows ``index`` of every layer of a dynamic or static KV cache, in place.

    Args:
        cache: a :class:`transformers.DynamicCache` or :class:`transformers.StaticCache` after its first update.
        index: ``(R,)`` int64 rows of the current batch, in their new order; a row may appear several times.
    """
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[index], layer.values[index]


def _unique_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The distinct prompts of a left-padded batch (ids, mask) and each row's index among them, or None when every
    row differs."""
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if len(unique) == len(rows):
        return None
    width = input_ids.shape[1]
    return unique[:, :width], unique[:, width:].to(attention_mask.dtype), inverse


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    sampler: PerPromptSampling | None,
    eos_token_id: int,
    pad_token_id: int,
    cache: str = "dynamic",
) -> torch.Tensor:
    """Decode up to ``max_new_tokens`` tokens a row with the KV cache, as ``model.generate`` does.

    Rows that share a prompt share its prefill. A row leaves the batch at its EOS; its later tokens are
    ``pad_token_id``. A sharded (FSDP) model keeps every row and steps until every process's rows have ended
    (each forward pass is collective). The loop stops when every row has ended.

    Args:
        model: causal LM, in the caller's autocast context.
        input_ids: ``(B, P)`` int64 left-padded prompts; ``attention_mask``: ``(B, P)`` 0/1.
        max_new_tokens: at least 1.
        sampler: each row's sampler (:class:`PerPromptSampling`), or None for greedy decoding (argmax).
        eos_token_id: where a row ends; ``pad_token_id``: what follows it.
        cache: ``dynamic`` (grows each step) or ``static`` (allocated for ``P + max_new_tokens`` positions).

    Returns:
        ``(B, R)`` int64 sampled tokens, ``R <= max_new_tokens`` the steps taken.
    """
    batch, length = input_ids.shape
    sharded = is_sharded(model)  # FSDP: every process runs every forward pass; rows are not dropped
    if cache == "static":
        kv = StaticCache(config=model.config, max_cache_len=length + max_new_tokens)
    else:
        kv = DynamicCache(config=model.config)
    shared = None if sharded else _unique_rows(input_ids, attention_mask)
    prefill_ids, prefill_mask = (input_ids, attention_mask) if shared is None else shared[:2]
    positions = (prefill_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=prefill_ids,
        attention_mask=prefill_mask,
        position_ids=positions,
        cache=kv,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    if shared is not None:
        select_rows(kv, shared[2])
        logits, positions = logits[shared[2]], positions[shared[2]]
    mask, position = attention_mask, positions[:, -1]
    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=input_ids.device)
    rows = torch.arange(batch, device=input_ids.device)  # the batch rows still decoding
    active = list(range(batch))  # the same rows on the host: whose generators draw
    ended = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        scores = logits if sampler is None else sampler.perturb(logits, active)
        next_tokens = scores.argmax(-1)
        if sharded:  # every row stays in the batch: an ended row writes padding
            next_tokens = torch.where(ended, pad_token_id, next_tokens)
        tokens[rows, step] = next_tokens
        ended[rows] |= next_tokens == eos_token_id
        if step == max_new_tokens - 1:
            break
        if sharded:
            if _all_processes_ended(ended):
                break
        else:
            writing = ~ended[rows]
            left = int(writing.sum())  # a step's one host round trip (generate's too); one more when rows end
            if left == 0:
                break
            if left < len(active):
                keep = writing.nonzero().squeeze(1)
                select_rows(kv, keep)
                rows, next_tokens, mask, position = rows[keep], next_tokens[keep], mask[keep], position[keep]
                active = rows.tolist()
        mask, position = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1), position + 1
        logits = model(
            input_ids=next_tokens[:, None],
            attention_mask=mask,
            position_ids=position[:, None],
            cache=kv,
            use_cache=True,
        ).logits[:, -1]
    return tokens[:, : step + 1]


def _all_processes_ended(ended: torch.Tensor) -> bool:
    """Whether every row of every process has ended (a collective: every process calls it each step)."""
    unfinished = (~ended).sum().reshape(1)
    dist.all_reduce(unfinished)
    return int(unfinished) == 0


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
            (:class:`rlhf.models.sampling.PerPromptSampling`), whatever batch or process it is in; None: each
            prompt's seed is drawn from torch's global generator (``torch.manual_seed`` repeats them).
        cache: the KV cache of :func:`decode`: ``dynamic`` (grows each step) or ``static`` (preallocated for the
            longest sequence). Both sample the same tokens (``tests/test_models.py``, float32); which is faster
            depends on the device and the batch (``bench.sampling``).

    Returns:
        :class:`Rollout`.
    """
    input_ids, attention_mask = pad(tokenizer, prompts, "left", model.device)
    if seeds is None and not greedy:
        seeds = torch.randint(0, 2**62, (len(prompts),), device="cpu").tolist()  # host integers
    sampler = None if greedy else PerPromptSampling(seeds, temperature, model.device)
    with cast_once(model):
        responses = decode(
            model,
            input_ids,
            attention_mask,
            max_new_tokens,
            sampler,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            cache=cache,
        )
    mask, ended = response_mask_from_tokens(responses, tokenizer.eos_token_id)
    return Rollout(
        input_ids=torch.cat([input_ids, responses], dim=1),
        attention_mask=torch.cat([attention_mask, mask.long()], dim=1),
        response_mask=mask,
        response_start=input_ids.shape[1],
        ended=ended,
    )
