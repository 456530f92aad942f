"""Resumable checkpoints: what a stage writes survives a crash whole or not at all (single files:
:mod:`rlhf.files`).

A :class:`Checkpointer` stores models with ``save_pretrained`` (safetensors) and
trainer state with ``torch.save``, read back with ``weights_only=True``; a LoRA
policy stores only its adapters (:mod:`rlhf.models.lora`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from rlhf.files import atomic_write_text
from rlhf.models.loading import load_causal_lm
from rlhf.models.lora import add_lora, is_lora, load_adapter_weights, merged_copy
from rlhf.runtime.distributed import Ranks
from rlhf.runtime.sharding import full_state_dict, load_full_state_dict, model_class


class Checkpointer:
    """Atomic, resumable checkpoints of models, optimisers, schedulers and trainer state.

    Layout: ``<root>/step-<n>/`` holds ``<name>/`` (``save_pretrained``,
    safetensors) per model, ``state.pt`` (optimiser and scheduler state dicts,
    RNG states, counters; read back with ``weights_only=True``) and
    ``<root>/latest`` names the newest complete one. A checkpoint is written
    into a temporary folder and renamed into place, and ``latest`` is replaced
    atomically after it, so a crash while writing leaves the previous checkpoint
    intact. Only the newest ``keep`` are kept.

    With several processes every one of them calls :meth:`save` (a sharded model is gathered first,
    :mod:`rlhf.runtime.sharding`) and rank 0 of ``ranks`` writes; every one may read.
    """

    def __init__(self, root: str, keep: int = 1, ranks: Ranks | None = None):
        self.root = root
        self.keep = keep
        self.ranks = ranks or Ranks()

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint, or None."""
        pointer = os.path.join(self.root, "latest")
        if not os.path.exists(pointer):
            return None
        with open(pointer, encoding="utf-8") as handle:
            path = os.path.join(self.root, handle.read().strip())
        return path if os.path.isdir(path) else None

    def save(self, step: int, models: dict[str, PreTrainedModel], state: dict[str, Any]) -> str:
        """Write checkpoint ``step``.

        Args:
            step: the number of completed steps (iterations).
            models: name -> model, saved with ``save_pretrained`` (a LoRA policy: its adapters only).
            state: anything ``torch.save`` can store and ``torch.load(weights_only=True)`` can read
                (tensors, numbers, strings, lists, dicts; optimiser ``state_dict()`` s).

        Returns:
            The checkpoint folder (written by rank 0 only).
        """
        final = os.path.join(self.root, f"step-{step:08d}")
        weights = {name: full_state_dict(model) for name, model in models.items()}  # None: not sharded
        if not self.ranks.main:
            return final
        os.makedirs(self.root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=self.root, prefix=".tmp-")
        for name, model in models.items():
            model.save_pretrained(os.path.join(tmp, name), state_dict=weights[name], safe_serialization=True)
        torch.save(state, os.path.join(tmp, "state.pt"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(os.path.join(self.root, "latest"), os.path.basename(final))
        kept = sorted(d for d in os.listdir(self.root) if d.startswith("step-"))
        for old in kept[: -self.keep]:
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)
        for leftover in (
            d for d in os.listdir(self.root) if d.startswith(".tmp-") and os.path.join(self.root, d) != tmp
        ):
            shutil.rmtree(os.path.join(self.root, leftover), ignore_errors=True)
        return final

    def load_state(self, path: str) -> dict[str, Any]:
        """Read ``state.pt`` of a checkpoint (``weights_only=True``)."""
        return torch.load(os.path.join(path, "state.pt"), weights_only=True)

    def load_model_weights(self, path: str, name: str, model: PreTrainedModel) -> None:
        """Copy the weights of checkpointed model ``name`` into ``model`` (safetensors, no remote code).

        A LoRA policy's checkpoint holds its adapters only (:func:`rlhf.models.lora.load_adapter_weights`).
        """
        if is_lora(model):
            load_adapter_weights(model, os.path.join(path, name))
            return
        saved = model_class(model).from_pretrained(
            os.path.join(path, name), dtype=torch.float32, use_safetensors=True, trust_remote_code=False
        )
        load_full_state_dict(model, saved.state_dict())  # a sharded model: each process keeps its shards

    def clear(self) -> None:
        """Delete every checkpoint (after the stage's final outputs are written)."""
        shutil.rmtree(self.root, ignore_errors=True)


KEPT_WEIGHTS, KEPT_META = "trained.safetensors", "kept.json"


def save_kept_policy(policy: PreTrainedModel, folder: str, meta: dict[str, Any], ranks: Ranks | None = None) -> None:
    """Keep a policy of a PPO run as what it adds to the SFT model: the weights that train, nothing else.

    A plain policy stores its trainable parameters (``requires_grad``; with ``ppo.trainable_layers: 8`` of
    SmolLM2-135M, 28 M of 135 M) as ``trained.safetensors``; a LoRA policy its adapters (``save_pretrained``).
    ``meta`` (JSON: the iteration, ``lora_rank``, ``lora_alpha``) goes to ``kept.json``. Written into a
    temporary folder and renamed, so a folder that exists is complete. Every process calls it (a sharded
    policy is gathered first); rank 0 of ``ranks`` writes.
    """

    whole = full_state_dict(policy)  # None: not sharded
    if ranks is not None and not ranks.main:
        return
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".kept-")
    if is_lora(policy):
        policy.save_pretrained(tmp, safe_serialization=True)
    else:
        values = whole if whole is not None else dict(policy.named_parameters())
        trained = {
            name: values[name].detach().cpu().contiguous() for name, p in policy.named_parameters() if p.requires_grad
        }
        save_file(trained, os.path.join(tmp, KEPT_WEIGHTS))
    atomic_write_text(os.path.join(tmp, KEPT_META), json.dumps(meta, sort_keys=True) + "\n")
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def load_kept_policy(sft: str, folder: str) -> PreTrainedModel:
    """The policy kept by :func:`save_kept_policy` in ``folder``: the SFT model of folder ``sft`` with those weights.

    Returns a plain causal LM (a LoRA policy's adapters folded in), float32.

    Raises:
        FileNotFoundError: ``folder`` is not a kept policy.
        ValueError: its weights do not fit the SFT model (names or shapes).
    """

    meta_path = os.path.join(folder, KEPT_META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{folder}: not a kept policy (no {KEPT_META})")
    with open(meta_path, encoding="utf-8") as handle:
        meta = json.load(handle)
    model = load_causal_lm(sft)
    if meta.get("lora_rank"):
        model = add_lora(model, meta["lora_rank"], meta["lora_alpha"])
        load_adapter_weights(model, folder)
        return merged_copy(model)
    weights = load_file(os.path.join(folder, KEPT_WEIGHTS))
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # a size mismatch: another model
        raise ValueError(f"{folder}: weights do not fit {sft} ({str(error).splitlines()[-1].strip()})") from None
    if result.unexpected_keys:
        raise ValueError(f"{folder}: weights {result.unexpected_keys[:3]} are not in {sft}")
    return model
