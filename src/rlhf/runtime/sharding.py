"""Fully sharded data parallel (FSDP2): each process holds 1/W of every model it trains.

Under accelerate's ``distributed_type: FSDP`` (infra/accelerate/fsdp.yaml) the trainers shard the models
they train (the SFT model, the reward model, PPO's policy and value model) with torch's ``fully_shard``
(:func:`shard`): one unit per decoder block and one for the rest, so each process keeps 1/W of their float32
weights, gradients and AdamW moments (16 bytes per trained parameter; 16/W per process) and gathers one
block's weights at a time for a forward or backward pass. Nothing else changes: a process takes the same
rows as in plain data parallel (:mod:`rlhf.runtime.distributed`) and each pass's loss is its share of the whole
batch's mean, so FSDP's reduce-scatter *sums* the gradients (divide factor 1, sum-only collectives, which
gloo runs too) and the gradient is the whole batch's however it was split (tests/test_distributed.py).
The models PPO never trains (reference, reward model) stay whole on every process.

Gathers are collective, so under FSDP every process must make the same calls in the same order:

- every process runs as many forward passes per step as the busiest one
  (:meth:`rlhf.runtime.distributed.Ranks.passes`: the extra ones count zero);
- generation runs with ``synced_gpus`` (:func:`rlhf.models.sampling.sample`): a process that has finished keeps
  stepping until all have;
- whole-model reads and writes go through the functions here on every process: :func:`full_state_dict`,
  :func:`load_full_state_dict`, :func:`optimizer_state`, :func:`load_optimizer_state`, :func:`whole_model`;
  so do the gradient norm and the check for non-finite weights (:mod:`rlhf.runtime.finite`).

With one process, or without FSDP, each function here does what the plain model or optimiser does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# accelerate's FSDP settings (FSDP_* variables, from the config's fsdp_config) and the only values the
# trainers implement; anything else is refused by name rather than ignored
HONOURED = {
    "FSDP_VERSION": ("2",),
    "FSDP_OFFLOAD_PARAMS": ("false",),
    "FSDP_ACTIVATION_CHECKPOINTING": ("false",),
    "FSDP_CPU_RAM_EFFICIENT_LOADING": ("false",),  # true: transformers loads real weights on rank 0 alone
}


@dataclass(frozen=True)
class Sharding:
    """How trained models are sharded (accelerate's ``fsdp_config``).

    Attributes:
        reshard_after_forward: free each block's gathered weights after its forward pass (ZeRO-3; less memory)
            rather than keeping them for the backward pass (ZeRO-2-like; one gather fewer per step).
    """

    reshard_after_forward: bool = True


def sharding_from_environ() -> Sharding | None:
    """The :class:`Sharding` of an ``accelerate launch`` with FSDP (``ACCELERATE_USE_FSDP``), or None.

    Raises:
        ValueError: an FSDP setting the trainers do not implement (FSDP version 1, parameter offload,
            accelerate's activation checkpointing: use ``<stage>.gradient_checkpointing``; weights loaded on
            rank 0 alone, which the trainers would have to broadcast).
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true":
        return None
    for name, allowed in HONOURED.items():
        value = os.environ.get(name, allowed[0]).lower()
        if value not in allowed:
            raise ValueError(
                f"accelerate FSDP setting {name}={value} is not implemented: the trainers shard with FSDP2 "
                f"(fully_shard) and need {name}={allowed[0]} (see infra/accelerate/fsdp.yaml)"
            )
    return Sharding(os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true")


def shard(model: torch.nn.Module, sharding: Sharding | None) -> torch.nn.Module:
    """Shard a model that will be trained, in place, across the process group; returns it (as is without FSDP).

    Call it after the model is placed, its lower layers frozen and any resume weights loaded, and before its
    optimiser is built (the optimiser must hold the sharded parameters). A model with a scalar head is called as
    backbone plus head (:func:`rlhf.models.forward.token_scores`), so its backbone and its head are units of their own.

    Raises:
        ValueError: a LoRA model (its adapters would be sharded with their frozen base; not implemented; PPO
            refuses ``ppo.lora_rank`` under FSDP before this, :func:`rlhf.ppo.config.check_processes`).
    """
    if sharding is None:
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: PLC0415 (torch: seconds to import)

    if hasattr(model, "peft_config"):
        raise ValueError("a LoRA model cannot be sharded (not implemented): train it data parallel")
    backbone = getattr(model, model.base_model_prefix)
    for block in backbone.layers:
        fully_shard(block, reshard_after_forward=sharding.reshard_after_forward)
    # the outer units are roots, which keep their weights from the forward to the backward pass (None: FSDP's
    # choice for a root): the reward model's LM term reads the embeddings after the backbone's forward
    for unit in (backbone, model.score) if hasattr(model, "score") else (model,):
        fully_shard(unit, reshard_after_forward=None if sharding.reshard_after_forward else False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the losses are whole-batch shares already: sum them
            module.set_force_sum_reduction_for_comms(True)  # SUM, not NCCL's PREMUL_SUM (gloo has none)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model`` was sharded across processes (:func:`shard`), whether its units hold their shards
    or, gathered, their whole weights at the moment."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 (torch: seconds to import)

    return any(isinstance(module, FSDPModule) for module in model.modules())


def model_class(model: torch.nn.Module) -> type:
    """``model``'s own class (e.g. ``LlamaForCausalLM``), not the subclass ``fully_shard`` gives a sharded one."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 (torch: seconds to import)

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def _full_options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # noqa: PLC0415 (torch: seconds to import)

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A sharded model's whole ``state_dict`` on rank 0 (on the CPU; ``{}`` elsewhere); None for a model that is
    not sharded (its own ``state_dict()`` is whole). Collective: every process calls it."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415 (torch: seconds to import)

    _reshard(model)
    return get_model_state_dict(model, options=_full_options(cpu_offload=True))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole ``state_dict`` (every process holds it, e.g. read from a checkpoint) into ``model``,
    sharded or not. Collective for a sharded model."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict  # noqa: PLC0415 (torch: seconds to import)

    _reshard(model)
    set_model_state_dict(model, state, options=_full_options())


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, main: bool) -> dict[str, Any]:
    """The optimiser's state to checkpoint: ``optimizer.state_dict()``; for a sharded model, on rank 0 (``main``),
    ``{"state": {parameter name: {"step": ..., "exp_avg": whole tensor, ...}}, "param_groups": [...]}`` on the
    CPU (``{}`` of state elsewhere). Collective for a sharded model: each state tensor is gathered in turn."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (torch: seconds to import)

    _reshard(model)
    names = {id(param): name for name, param in model.named_parameters()}
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:  # the same order on every process
            for key, value in optimizer.state.get(param, {}).items():
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                if main:
                    state.setdefault(names[id(param)], {})[key] = whole.cpu() if torch.is_tensor(whole) else whole
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Restore :func:`optimizer_state` (every process holds ``state``, read from the checkpoint): each process
    takes its shard of each tensor.

    Raises:
        ValueError: the state names parameters ``model`` does not have, or holds another number of parameter
            groups than ``optimizer``.
    """
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    _reshard(model)
    names = {id(param): name for name, param in model.named_parameters()}
    unknown = sorted(set(state["state"]) - set(names.values()))
    if unknown:
        raise ValueError(f"optimiser state for parameters the model does not have: {unknown[:3]}")
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update(saved)
        on_device = group.get("fused") or group.get("capturable")  # else torch keeps Adam's step count on the CPU
        for param in group["params"]:
            values = state["state"].get(names[id(param)], {})
            optimizer.state[param] = {key: _like(value, param, on_device) for key, value in values.items()}


def _like(value: Any, param: torch.Tensor, on_device: bool) -> Any:
    """An optimiser state value read back for ``param``: a whole tensor becomes this process's shard of it (each
    process holds the whole, so no data moves), a 0-dim one (the step count) goes where torch keeps it."""
    from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415 (torch: seconds to import)

    if not torch.is_tensor(value):
        return value
    if not value.dim():
        return value.to(param.device if on_device else "cpu")
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def _reshard(model: torch.nn.Module) -> None:
    """Put back the sharded parameters of every unit (a unit that keeps its weights after a forward pass,
    ``reshard_after_forward: false``, holds whole ones until its next backward)."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 (torch: seconds to import)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def whole_model(model: torch.nn.Module, main: bool) -> torch.nn.Module | None:
    """After training: ``model`` itself when it is not sharded; else, on rank 0 (``main``), a new unsharded model
    with its weights on its device (float32), and None on the other processes. Collective for a sharded model.

    Rank 0 then scores, evaluates and writes the trained model alone, as with one process.
    """
    if not is_sharded(model):
        return model
    state = full_state_dict(model)
    if not main:
        return None
    with torch.device("meta"):
        copy = model_class(model)(model.config)
    copy = copy.to_empty(device=next(model.parameters()).device)  # a shard's device
    copy.load_state_dict(state, strict=True)
    for name, buffer in model.named_buffers():  # rotary frequencies and other buffers: never sharded
        copy.get_buffer(name).copy_(buffer)
    copy.tie_weights()
    return copy.eval()
