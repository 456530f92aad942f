"""Frozen blocks computed once: the lower blocks that a policy shares with the models scoring its rollouts.

With ``trainable_layers`` the policy trains only its top blocks, and its reference, reward model and value
model often start from the same weights: in the demo blocks 0-21 of 30 are the same in the policy and its
reference, 0-19 in the reward model too (it keeps 20 blocks and trains its score head alone), and 0-11 in all four
(the value model trains the top 8 of the reward model's 20). A
:class:`SharedTrunk` runs those blocks once per rollout and hands each model the hidden states entering its
first block that differs; the model runs only its own blocks from there. Which blocks are shared is decided
from the weights each time a trunk is made (:func:`shared_depth`), never from a setting: a reward model
trained from another SFT, ``frozen_bf16``, LoRA on every block, ``trainable_layers: null`` or sharded (FSDP)
models get depth 0, the plain forward pass. The states live as long as the rollout; they are never saved.

Only Llama backbones take this path: :func:`_run_blocks` repeats :class:`transformers.LlamaModel`'s forward
(the causal mask, the rotary embeddings, the blocks), and the equivalence tests hold it to the plain pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaModel, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from rlhf.runtime.sharding import is_sharded

# what a block computes besides its parameters: two models whose blocks hold the same weights but differ here
# compute differently
_BLOCK_CONFIG = ("_attn_implementation", "rms_norm_eps", "hidden_act", "head_dim", "attention_bias", "mlp_bias")


def _backbone(model: PreTrainedModel) -> torch.nn.Module | None:
    """The model's Llama decoder stack, or None when it is anything else (a PEFT wrapper, another family)."""
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return backbone if isinstance(backbone, LlamaModel) else None


def _frozen(module: torch.nn.Module) -> bool:
    return not any(p.requires_grad for p in module.parameters())


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = list(a.parameters()), list(b.parameters())
    return len(pa) == len(pb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(pa, pb, strict=True)
    )


def frozen_depth(model: PreTrainedModel) -> int:
    """How many of ``model``'s lower blocks (embeddings included) no optimiser can change.

    Returns:
        The number ``d`` of leading decoder blocks with no parameter that requires grad, the embeddings
        frozen too; 0 when the embeddings train, the model is sharded or not a Llama backbone.
    """
    backbone = _backbone(model)
    if backbone is None or is_sharded(model) or not _frozen(backbone.embed_tokens):
        return 0
    depth = 0
    for block in backbone.layers:
        if not _frozen(block):
            break
        depth += 1
    return depth


def shared_depth(policy: PreTrainedModel, model: PreTrainedModel) -> int:
    """How many lower blocks ``model`` computes exactly as ``policy``'s frozen ones, decided from the weights.

    Counts leading blocks that are frozen in both models and hold equal parameters (same dtype, shape and
    values), the embeddings and the rotary frequencies equal too, and the settings a block computes with
    (attention implementation, norm epsilon, activation, head size, biases) the same.

    Returns:
        ``d`` in ``[0, frozen_depth(policy)]``: the hidden states entering ``policy``'s block ``d`` are
        those entering ``model``'s; 0 means the plain path.
    """
    mine, theirs = _backbone(policy), _backbone(model)
    if mine is None or theirs is None or is_sharded(model):
        return 0
    limit = min(frozen_depth(policy), frozen_depth(model) if model is not policy else len(mine.layers))
    if limit == 0:
        return 0
    if model is policy:
        return limit
    if (
        any(getattr(policy.config, key, None) != getattr(model.config, key, None) for key in _BLOCK_CONFIG)
        or not torch.equal(mine.rotary_emb.inv_freq, theirs.rotary_emb.inv_freq)
        or mine.rotary_emb.attention_scaling != theirs.rotary_emb.attention_scaling
        or not _same(mine.embed_tokens, theirs.embed_tokens)
    ):
        return 0
    depth = 0
    while depth < min(limit, len(theirs.layers)) and _same(mine.layers[depth], theirs.layers[depth]):
        depth += 1
    return depth


def _run_blocks(
    backbone: LlamaModel, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, blocks
) -> torch.Tensor:
    """``backbone``'s blocks ``blocks`` (a slice of its layers) over ``hidden``, as its own forward runs them."""
    # no KV cache: the fourth argument, named past_key_values up to transformers 5.23 and cache from 5.24
    mask = create_causal_mask(backbone.config, hidden, attention_mask, None, position_ids=position_ids)
    position_embeddings = backbone.rotary_emb(hidden, position_ids=position_ids)
    for block in blocks:
        hidden = block(hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
    return hidden


@dataclass
class TrunkEntry:
    """The hidden states entering block ``depth`` of a model: ``hidden`` ``(B, T, H)`` (the autocast's dtype)."""

    depth: int
    hidden: torch.Tensor

    def rows(self, index: list[int] | torch.Tensor) -> TrunkEntry:
        """The same states for the batch rows ``index``."""
        return TrunkEntry(self.depth, self.hidden[index])


def last_hidden_state(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    entry: TrunkEntry | None = None,
) -> torch.Tensor:
    """The backbone's final (normed) hidden states ``(B, T, H)``: the plain forward pass when ``entry`` is None,
    else only ``model``'s blocks from ``entry.depth`` on, started from ``entry.hidden``."""
    backbone = getattr(model, model.base_model_prefix)
    if entry is None or entry.depth == 0:
        return backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    hidden = _run_blocks(backbone, entry.hidden, attention_mask, position_ids, backbone.layers[entry.depth :])
    return backbone.norm(hidden)


class SharedTrunk:
    """The policy's frozen lower blocks over one batch, run once for every model that holds them.

    States are computed on demand: :meth:`entry` for a model runs the policy's blocks only as far as that
    model shares them and not yet run (no grad), and keeps the states at each depth asked for.

    Args:
        policy: the model whose frozen blocks are run.
        input_ids, attention_mask, position_ids: ``(B, T)`` the batch every model reads.
    """

    def __init__(
        self, policy: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> None:
        self.policy, self.input_ids, self.attention_mask, self.position_ids = (
            policy,
            input_ids,
            attention_mask,
            position_ids,
        )
        self._states: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def entry(self, model: PreTrainedModel) -> TrunkEntry | None:
        """The states entering ``model``'s first block not shared with the policy, or None (the plain path)."""
        depth = shared_depth(self.policy, model)
        if depth == 0:
            return None
        if depth not in self._states:
            backbone = _backbone(self.policy)
            start = max((d for d in self._states if d < depth), default=0)
            hidden = self._states[start] if start else backbone.embed_tokens(self.input_ids)
            blocks = backbone.layers[start:depth]
            self._states[depth] = _run_blocks(backbone, hidden, self.attention_mask, self.position_ids, blocks)
        return TrunkEntry(depth, self._states[depth])
