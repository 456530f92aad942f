"""What every trainer shares: optimiser and schedule, minibatch order, gradient clipping, the supervised loop.

Trainers take a ``log(metrics: dict[str, float], step: int)`` callback and
import nothing of Prefect, MLflow or DVC.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

import torch
from transformers import PreTrainedModel, get_scheduler
from transformers.trainer_pt_utils import get_length_grouped_indices

from rlhf.ranges import check_ranges, check_schedule
from rlhf.runtime.device import Runtime
from rlhf.runtime.distributed import Ranks
from rlhf.runtime.finite import FiniteGuard, NonFiniteError, ScalerStep, check_finite_weights, to_host
from rlhf.runtime.sharding import is_sharded, load_optimizer_state, optimizer_state, shard
from rlhf.training.checkpoint import Checkpointer

LogFn = Callable[[dict[str, float], int], None]


def no_log(metrics: dict[str, float], step: int) -> None:
    """A ``log`` callback that drops everything (for tests and benchmarks)."""


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters of ``model``, fused (one kernel for all parameters, CPU and CUDA).

    torch's default AdamW on CPU loops over the tensors: 8.3 s for one step of SmolLM2-135M here against
    1.3 s fused (the same arithmetic; tests/test_levers.py checks the weights agree). TRL uses the fused one too.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def make_scheduler(
    optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """A transformers learning-rate schedule (``constant_with_warmup``, ``linear``, ``cosine``, ...).

    Args:
        optimizer: the optimiser whose learning rate the schedule sets.
        name: a transformers ``SchedulerType`` name.
        warmup_steps: optimiser steps of linear warm-up.
        total_steps: optimiser steps of the whole run.

    Raises:
        ValueError: see :func:`check_schedule`.
    """
    check_schedule("", name, warmup_steps)
    return get_scheduler(
        name, optimizer=optimizer, num_warmup_steps=warmup_steps, num_training_steps=max(total_steps, 1)
    )


def minibatch_indices(
    step: int,
    n: int,
    batch_size: int,
    seed: int,
    lengths: list[int] | None = None,
    strata: Sequence[Hashable] | None = None,
) -> list[int]:
    """Example indices of minibatch ``step``: epoch ``e`` visits ``range(n)`` in an order seeded by ``seed + e``.

    A pure function of the step, so a resumed run sees exactly the batches the
    uninterrupted run would have seen. With ``lengths`` the epoch's order is
    grouped by length (transformers' ``get_length_grouped_indices``, the
    ``group_by_length`` of its Trainer): shuffled, cut into mega-batches, sorted by
    length within each, so a batch holds examples of similar length and little of
    its compute goes to padding; each example is still seen once per epoch.
    With ``strata`` (each example's group, e.g. its kind of data) each group is ordered so apart and the groups
    are interleaved in proportion to their sizes (:func:`interleave`): every batch holds each group's share of the
    examples, within one example, instead of whichever group a length or a shuffle brought together.

    Args:
        step: 0-based optimiser step.
        n: number of examples.
        batch_size: > 0 (the last batch of an epoch may be shorter).
        seed: base seed.
        lengths: tokens of each example (``n`` of them), or None for a plain shuffle.
        strata: each example's group label, any hashable (``n`` of them), or None: one group.

    Raises:
        ValueError: ``n`` is 0, or ``lengths`` or ``strata`` does not have ``n`` entries.
    """
    if n == 0:
        raise ValueError("no examples to train on")
    for name, values in (("lengths", lengths), ("strata", strata)):
        if values is not None and len(values) != n:
            raise ValueError(f"{len(values)} {name} for {n} examples")
    per_epoch = -(-n // batch_size)
    epoch, index = divmod(step, per_epoch)
    groups = [list(range(n))] if strata is None else [[i for i in range(n) if strata[i] == g] for g in set(strata)]
    groups.sort(key=lambda members: members[0])  # host-side bookkeeping: no tensor, no device
    orders = []
    for g, members in enumerate(groups):  # each group its own seed (one group: seed + epoch, as before strata)
        if lengths is None:
            orders.append(random.Random(seed + epoch + g * 7919).sample(members, len(members)))
        else:
            generator = torch.Generator().manual_seed(seed + epoch + g * 7919)
            grouped = get_length_grouped_indices([lengths[i] for i in members], batch_size, generator=generator)
            orders.append([members[i] for i in grouped])
    order = interleave(orders)
    return order[index * batch_size : (index + 1) * batch_size]


def interleave(orders: list[list[int]]) -> list[int]:
    """One sequence of every element of ``orders``, each list's in its own order, spread in proportion to its size:
    the ``j``-th element of a list of ``m`` takes the place ``(j + 1/2) / m`` of the whole (ties: the earlier list),
    so any run of ``k`` consecutive elements holds each list's share of ``k``, within one. One list: itself."""
    keyed = [((j + 0.5) / len(order), g, x) for g, order in enumerate(orders) for j, x in enumerate(order)]
    return [x for _, _, x in sorted(keyed)]


@dataclasses.dataclass
class LoopConfig:
    """The settings every supervised trainer shares (SFT, the reward model and the judge).

    Subclasses name their params.yaml ``section``, add their own fields and set the defaults where their sections
    differ: every default is the value in params.yaml (``tests/test_defaults.py``). A warm-up the schedule would
    ignore is refused when the config is built (:func:`check_schedule`).
    """

    section: ClassVar[str] = ""
    min_steps: ClassVar[int] = 1  # SFT allows 0: no fine-tuning at all
    steps: int = 40  # optimiser steps
    batch_size: int = 4  # examples per optimiser step, over all processes together
    micro_batch_size: int | None = None  # at most this many per forward/backward pass (None: a process's share)
    lr: float = 2e-5
    warmup_steps: int = 0  # optimiser steps
    scheduler: str = "cosine"  # a transformers schedule
    max_grad_norm: float | None = 1.0  # global gradient-norm clipping (None: measure only)
    checkpoint_every: int = 25  # steps between resume checkpoints, each the model and its optimiser (0: never)
    trainable_layers: int | None = None  # train only the top N blocks, the final norm and the head; None: all
    group_by_length: bool = True  # batches of similar length (less padding); still every example once per epoch
    gradient_checkpointing: bool = False  # recompute each block's activations in the backward: less memory, slower
    seed: int = 0  # minibatch order and any new head's initialisation

    def __post_init__(self) -> None:
        """Refuse a warm-up the schedule would ignore, and a count or rate outside its domain.

        Raises:
            ValueError: see :func:`check_schedule`; ``steps`` below ``min_steps``, ``batch_size`` or
                ``micro_batch_size`` below 1,
                ``max_grad_norm`` not above 0, ``lr``, ``warmup_steps``, ``checkpoint_every`` or
                ``trainable_layers`` below 0 (:func:`check_ranges`, naming the key).
        """
        check_schedule(self.section, self.scheduler, self.warmup_steps)
        steps = ("steps",)
        check_ranges(
            self.section,
            self,
            at_least_1=("batch_size", "micro_batch_size", *(steps if self.min_steps == 1 else ())),
            positive=("max_grad_norm",),
            non_negative=(
                "lr",
                "warmup_steps",
                "checkpoint_every",
                "trainable_layers",
                *(steps if not self.min_steps else ()),
            ),
        )


def supervised_loop(
    model: PreTrainedModel,
    step_fn: Callable[[list[int], list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    num_examples: int,
    config: LoopConfig,
    *,
    prefix: str,
    log: LogFn,
    runtime: Runtime,
    lengths: list[int] | None = None,
    strata: Sequence[Hashable] | None = None,
    checkpointer: Checkpointer | None = None,
    progress: bool = True,
    scaler_step: ScalerStep | None = None,
) -> dict[str, float]:
    """Run ``steps`` optimiser steps of a supervised objective; resumable from ``checkpointer``.

    Shared by SFT and reward-model training, so both resume the same way: the
    model, optimiser, scheduler, RNG states and step counter are checkpointed
    every ``checkpoint_every`` steps and restored on start.

    ``step_fn(part, batch)`` runs inside ``runtime.autocast()`` on ``part``, some examples of the optimiser
    step's ``batch``, and returns the part's *share* of the batch's loss and figures (its terms summed and
    divided by the whole batch's count: ``count=`` of :mod:`rlhf.losses`) as tensors on the device. The batch
    is split over the processes (:meth:`rlhf.runtime.distributed.Ranks.shard`) and each process's rows into passes of
    ``micro_batch_size``; the shares' gradients and figures are summed over passes and processes, so a step's
    gradient is the whole batch's however it was split. Under FSDP (``runtime.sharding``) the model is sharded
    here (:func:`rlhf.runtime.sharding.shard`) and stays sharded: the caller gathers it
    (:func:`rlhf.runtime.sharding.whole_model`).
    The figures (loss, gradient norm and the rest) reach the host in one round trip per optimiser step
    (:func:`rlhf.runtime.finite.to_host`).

    The first non-finite loss or gradient norm stops the run (:class:`FiniteGuard`)
    before its optimiser step, after logging that step's figures (the NaN or inf
    included), with one line such as ``sft: non-finite sft/loss (nan) at step 3 of
    4; training stopped``; so do non-finite weights after the last step.

    Args:
        model: the model to train (dropout already off).
        step_fn: maps ``(part, batch)`` example indices to ``(loss, metrics)``: 0-dim shares (see above).
        num_examples: size of the training set.
        config: :class:`LoopConfig` (steps, batch size, learning rate and schedule, clipping, seed,
            ``checkpoint_every``).
        prefix: metric prefix, e.g. ``"sft"``.
        log: ``log(metrics, step)`` callback.
        runtime: device and precision (:class:`rlhf.runtime.device.Runtime`); ``model`` already placed on it.
        lengths: tokens of each example; the batches are grouped by length when ``config.group_by_length``.
        strata: each example's group (e.g. its kind): every batch holds each group's share (:func:`minibatch_indices`);
            None: one group.
        checkpointer: where to save (every rank calls it; rank 0 writes) and resume (every rank); None: neither.
        progress: show a tqdm bar.
        scaler_step: a mixed-precision loss scaler's step (see :class:`FiniteGuard`); None: no scaler.
            The steps it skips are counted (``{prefix}/skipped_steps``), not fatal.

    Returns:
        Summary: ``{prefix}/loss_first``, ``{prefix}/loss_last`` (mean of the last 10 steps), ``{prefix}/steps``,
        ``{prefix}/skipped_steps``.

    Raises:
        NonFiniteError: (a ``FloatingPointError``) a non-finite loss, gradient norm or final weight.
        ValueError: ``config.group_by_length`` without ``lengths``.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415 (tqdm: only a training loop needs it)

    if config.group_by_length and lengths is None:
        raise ValueError(f"{prefix}: group_by_length needs the examples' lengths")
    grouping = lengths if config.group_by_length else None

    steps, seed, checkpoint_every = config.steps, config.seed, config.checkpoint_every
    torch.manual_seed(seed)
    resume = checkpointer.latest() if checkpointer else None
    if resume:
        checkpointer.load_model_weights(resume, "model", model)
    shard(model, runtime.sharding)  # FSDP: after the resume weights, before the optimiser
    optimizer = make_optimizer(model, config.lr)
    schedule = make_scheduler(optimizer, config.scheduler, config.warmup_steps, steps)
    guard = FiniteGuard(prefix, scaler_step)
    start, losses = 0, []
    if resume:
        state = checkpointer.load_state(resume)
        load_optimizer_state(model, optimizer, state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        start, losses = state["step"], list(state["losses"])
        guard.skipped = state.get("skipped_steps", 0)
    model.eval()  # dropout off; gradients still flow
    if config.gradient_checkpointing:
        # transformers recomputes activations only in train mode; the loaders zero every dropout, so train mode
        # computes exactly what eval mode does (tests/test_levers.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    shown = progress and runtime.ranks.main  # one bar, however many processes
    for step in tqdm(range(start, steps), desc=prefix, initial=start, total=steps, disable=not shown):
        where = f"step {step + 1} of {steps}"
        batch = minibatch_indices(step, num_examples, config.batch_size, seed, grouping, strata)
        optimizer.zero_grad(set_to_none=True)
        figures = batch_gradients(model, step_fn, batch, config.micro_batch_size, prefix, runtime)
        grad_norm = guard.clip(model, config.max_grad_norm)
        row = to_host({**figures, f"{prefix}/grad_norm": grad_norm})
        try:
            guard.check_loss(f"{prefix}/loss", row[f"{prefix}/loss"], where)
            guard.step(optimizer, schedule, row[f"{prefix}/grad_norm"], f"{prefix}/grad_norm", where)
        except NonFiniteError as err:
            log({**row, **err.metrics}, step + 1)
            raise
        losses.append(row[f"{prefix}/loss"])
        row[f"{prefix}/lr"] = schedule.get_last_lr()[0]
        if scaler_step is not None:
            row[f"{prefix}/skipped_steps"] = float(guard.skipped)
        log(row, step + 1)
        if checkpointer and checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < steps:
            state = {
                "optimizer": optimizer_state(model, optimizer, runtime.ranks.main),
                "scheduler": schedule.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step + 1,
                "losses": losses,
                "skipped_steps": guard.skipped,
            }
            checkpointer.save(step + 1, {"model": model}, state)  # every rank: a sharded model is gathered
    check_finite_weights(model, prefix, f"after step {steps} of {steps}")
    tail = losses[-10:]
    return {
        f"{prefix}/loss_first": losses[0] if losses else float("nan"),
        f"{prefix}/loss_last": sum(tail) / max(len(tail), 1),
        f"{prefix}/steps": float(steps),
        f"{prefix}/skipped_steps": float(guard.skipped),
    }


def batch_gradients(
    model: torch.nn.Module,
    step_fn: Callable[[list[int], list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    batch: list[int],
    micro_batch_size: int | None,
    prefix: str,
    runtime: Runtime,
) -> dict[str, torch.Tensor]:
    """Accumulate into ``model``'s ``.grad`` the gradient of the whole ``batch``'s loss, however it is split.

    This rank's rows of ``batch`` (:meth:`rlhf.runtime.distributed.Ranks.shard`) go through ``step_fn(part, batch)``
    in passes of ``micro_batch_size``, each backward adding its share; the gradients are then summed over
    ranks. The caller zeroes the gradients before and steps the optimiser after.

    Returns:
        ``{prefix}/loss`` and ``step_fn``'s figures: each the sum of its shares over passes and ranks, a 0-dim
        tensor on ``runtime.device``, the same on every rank.
    """
    figures: dict[str, torch.Tensor] = {}
    together = runtime.device if is_sharded(model) else None  # FSDP: every rank runs as many passes
    passes = runtime.ranks.passes(runtime.ranks.shard(batch), micro_batch_size, batch[:1], together)
    for part, counted in passes:
        with runtime.autocast():
            loss, metrics = step_fn(part, batch)
        (loss if counted else loss * 0.0).backward()  # not counted: FSDP's pass for the busiest rank's sake
        for key, value in {f"{prefix}/loss": loss, **metrics}.items() if counted else ():
            figures[key] = figures.get(key, 0.0) + value.detach().float()
    runtime.ranks.sum_gradients(model)
    return summed_over_ranks(figures, runtime.ranks, runtime.device)


def summed_over_ranks(
    figures: dict[str, torch.Tensor | float], ranks: Ranks, device: torch.device
) -> dict[str, torch.Tensor]:
    """Each figure (a 0-dim share) summed over ranks in one all-reduce; a rank that ran no pass (its share of a
    short batch was empty) adds 0 to each."""
    keys = ranks.union(figures)
    stacked = torch.stack([torch.as_tensor(figures.get(key, 0.0), dtype=torch.float32, device=device) for key in keys])
    return dict(zip(keys, ranks.sum(stacked).unbind(), strict=True))


def freeze_lower_layers(model: PreTrainedModel, trainable_layers: int | None) -> int:
    """Train only the top ``trainable_layers`` transformer blocks (plus the final norm and the head).

    A CPU budget knob: backward stops at the first trainable block, so with a
    third of the blocks trainable a step costs about half. ``None`` trains
    everything. Embeddings stay frozen when any block is frozen (with tied
    embeddings the LM head is then frozen too).

    Args:
        model: a causal LM or sequence-classification model whose backbone has ``layers``.
        trainable_layers: number of top blocks to train, or None.

    Returns:
        The number of trainable parameters.

    Raises:
        ValueError: the backbone has no ``layers`` list, or ``trainable_layers`` < 0.
    """
    if trainable_layers is not None:
        backbone = getattr(model, model.base_model_prefix)
        layers = getattr(backbone, "layers", None)
        if layers is None or trainable_layers < 0:
            raise ValueError("trainable_layers needs a backbone with a `layers` list and a value >= 0")
        model.requires_grad_(False)
        for block in list(layers)[len(layers) - trainable_layers :] if trainable_layers else []:
            block.requires_grad_(True)
        for name in ("norm",):
            if hasattr(backbone, name):
                getattr(backbone, name).requires_grad_(True)
        for head in ("score", "lm_head"):
            module = getattr(model, head, None)
            if module is not None and not (head == "lm_head" and getattr(model.config, "tie_word_embeddings", False)):
                module.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
