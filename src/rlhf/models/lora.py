"""An optional LoRA policy (``ppo.lora_rank``) whose reference model is the same weights with the adapters off.

Low-rank adapters (Hu et al. 2021, peft's implementation) on every linear layer of
the policy's blocks; the base weights stay frozen. Because the adapters start at
zero (peft initialises ``B = 0``), the policy with its adapters disabled *is* the
SFT model, so PPO's reference needs no copy of its own: one copy of the weights,
one set of gradients and AdamW states the size of the adapters instead of the model.
What ships is a plain causal LM with the adapters folded into the weights.
"""

from __future__ import annotations

import copy
import os

import torch
from transformers import PreTrainedModel

# every linear layer of a Llama block: attention and MLP
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILE = "adapter_model.safetensors"


def add_lora(model: PreTrainedModel, rank: int, alpha: float) -> torch.nn.Module:
    """Wrap a causal LM with LoRA adapters of ``rank`` on :data:`LORA_TARGETS`; only the adapters train.

    The adapter update is ``(alpha / rank) * B A x`` with ``B`` zero at the start, so the
    wrapped model computes exactly what ``model`` did until the first optimiser step.

    Args:
        model: a causal LM whose blocks have the Llama projection names.
        rank: adapter rank (>= 1).
        alpha: LoRA scaling numerator (> 0).

    Returns:
        A ``peft.PeftModel`` (a ``torch.nn.Module``) sharing ``model``'s weights.

    Raises:
        ValueError: ``rank`` < 1 or ``alpha`` <= 0, or the model has none of the target layers.
    """
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 (peft: only LoRA needs it)

    if rank < 1 or alpha <= 0:
        raise ValueError(f"LoRA needs rank >= 1 and alpha > 0, got rank {rank}, alpha {alpha}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS), bias="none")
    return get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft-wrapped (LoRA) model."""
    return type(model).__module__.startswith("peft.")


class AdapterDisabledReference(torch.nn.Module):
    """PPO's reference model as the LoRA policy with its adapters disabled: the frozen SFT weights.

    Calling it runs the policy's forward inside ``disable_adapter()``. The policy is held
    outside the module tree on purpose: ``reference.requires_grad_(False)``, ``.eval()`` or a
    cast of the reference must never reach the policy's adapters. It has no parameters.
    """

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        if not is_lora(policy):
            raise ValueError("AdapterDisabledReference needs a LoRA policy (rlhf.models.lora.add_lora)")
        self.__dict__["policy"] = policy  # not a submodule (see the class docstring)

    def forward(self, *args, **kwargs):
        """The policy's forward with the adapters off; same arguments and outputs."""
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


def merged_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """What ships: a LoRA policy's adapters folded into a copy of its weights (the policy is left as it is).

    A plain model is returned unchanged. The copy costs one model's memory for as long as it lives.
    """
    return copy.deepcopy(policy).merge_and_unload() if is_lora(policy) else policy


def load_adapter_weights(policy: torch.nn.Module, folder: str) -> None:
    """Copy adapters saved by ``policy.save_pretrained(folder)`` into ``policy`` (safetensors only).

    Raises:
        FileNotFoundError: ``folder`` holds no ``adapter_model.safetensors``.
        ValueError: the saved adapters do not match the policy's (another rank or targets).
    """
    from peft.utils import set_peft_model_state_dict  # noqa: PLC0415 (peft: only LoRA needs it)
    from safetensors.torch import load_file  # noqa: PLC0415 (safetensors.torch imports torch)

    path = os.path.join(folder, ADAPTER_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no LoRA adapters saved there")
    try:
        result = set_peft_model_state_dict(policy, load_file(path, device=str(next(policy.parameters()).device)))
    except RuntimeError as error:  # torch's multi-line "size mismatch" list: another rank
        raise ValueError(f"{path}: adapters do not match the policy ({str(error).splitlines()[-1].strip()})") from None
    lora_missing = [key for key in result.missing_keys if "lora_" in key]
    if lora_missing or result.unexpected_keys:
        missing, unexpected = lora_missing[:2], result.unexpected_keys[:2]
        raise ValueError(f"{path}: adapters do not match the policy (missing {missing}, unexpected {unexpected})")
