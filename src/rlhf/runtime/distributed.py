"""Several training processes (``accelerate launch``): which rows each rank takes, and the sums that span them.

Every trainer's batch is the *global* batch of one optimiser step, whatever the
number of processes: rank ``r`` of ``W`` takes rows ``r, r + W, r + 2W, ...``
(:meth:`Ranks.shard`), splits them into micro-batches, and each micro-batch's
loss is its share of the whole batch's mean (the sum of its terms divided by the
*global* count, ``count=`` of :mod:`rlhf.losses`). The gradients are then summed
over ranks (:meth:`Ranks.sum_gradients`), so the gradient of one optimiser step
is the gradient of the whole batch's mean however the batch was split: one
process or several, one pass or many (tests/test_distributed.py).

This is what DDP's gradient all-reduce does, with two differences on purpose:
DDP *averages* over ranks (right only when every rank holds as many loss terms as
every other, which token-mean losses never do), and it needs each forward pass to
go through its wrapper, while the reward and value models are called as backbone
plus head. With one process every method here is a no-op.

Under FSDP (:mod:`rlhf.runtime.sharding`) the same rows and shares apply; FSDP's reduce-scatter sums a sharded
model's gradients instead of :meth:`Ranks.sum_gradients`, and :meth:`Ranks.passes` gives every rank as many
passes as the busiest one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.runtime.sharding import is_sharded

# accelerate's distributed types the trainers do not implement (FSDP is rlhf.runtime.sharding)
UNSUPPORTED = ("DEEPSPEED", "MEGATRON_LM")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes.

    Attributes:
        rank: 0-based index of this process.
        world_size: number of processes (1: no ``torch.distributed`` call is ever made).
    """

    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        """True on rank 0, the process that logs, writes checkpoints and writes the stage's outputs."""
        return self.rank == 0

    def shard(self, rows: list[Any]) -> list[Any]:
        """This rank's part of ``rows``: positions ``rank, rank + W, ...`` (every row on exactly one rank)."""
        return rows[self.rank :: self.world_size]

    def shard_of(self, positions: list[int]) -> list[int]:
        """The global positions among ``positions`` that this rank holds (``position % W == rank``), in order."""
        return [g for g in positions if g % self.world_size == self.rank]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``tensor`` over ranks (a new tensor; ``tensor`` itself with one process)."""
        if self.world_size == 1:
            return tensor
        total = tensor.detach().clone()
        torch.distributed.all_reduce(total)
        return total

    def union(self, names: Iterable[str]) -> list[str]:
        """The sorted union of every rank's ``names`` (a step's figures: a rank with no rows has none)."""
        if self.world_size == 1:
            return sorted(names)
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, sorted(names))
        return sorted(set().union(*parts))

    def total(self, count: int, device: torch.device) -> int:
        """``count`` summed over ranks (e.g. all ranks' rollouts); no device round trip with one process."""
        if self.world_size == 1:
            return count
        return int(self.sum(torch.tensor(count, device=device)))

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`shard`: every rank's ``(n_r, ...)`` rows, back in global order, on every rank.

        Args:
            rows: this rank's rows, the result of ``shard`` on a global ``(N, ...)`` tensor (any dtype).

        Returns:
            ``(N, ...)``: global row ``i`` is row ``i // W`` of rank ``i % W``.
        """
        if self.world_size == 1:
            return rows
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, rows.detach().cpu())
        total = sum(len(part) for part in parts)
        merged = torch.empty((total, *rows.shape[1:]), dtype=rows.dtype)
        for rank, part in enumerate(parts):
            merged[rank :: self.world_size] = part
        return merged.to(rows.device)

    def most(self, count: int, device: torch.device) -> int:
        """The largest ``count`` of any rank (e.g. the passes of the busiest rank)."""
        if self.world_size == 1:
            return count
        most = torch.tensor(count, device=device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most)

    def passes(
        self, rows: list[Any], size: int | None, filler: list[Any], together: torch.device | None
    ) -> list[tuple[list, bool]]:
        """This rank's forward/backward passes over ``rows`` (its own rows): ``(part, counted)`` pairs.

        ``rows`` in passes of at most ``size`` (:func:`micro_batches`), each counted. With ``together``, the
        device of a sharded model whose gathers every rank must join (None: not sharded), as many passes as the
        busiest rank runs: the extra ones go over ``filler`` (a row this rank can forward) and are not counted,
        so their loss must be multiplied by 0 and their figures left out.
        """
        mine = [(part, True) for part in micro_batches(rows, size)]
        if together is None:
            return mine
        return mine + [(filler, False)] * (self.most(len(mine), together) - len(mine))

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Sum the gradients of ``model``'s trainable parameters over ranks, in place (one all-reduce).

        A parameter without a gradient on this rank (its rows never reached it) counts as zeros. A sharded
        model (:mod:`rlhf.runtime.sharding`) is left alone: FSDP summed its gradients in the backward pass.
        """
        if self.world_size == 1 or is_sharded(model):
            return
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        offset = 0
        for param, grad in zip(params, grads, strict=True):
            param.grad = flat[offset : offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()

    def barrier(self) -> None:
        """Wait until every rank gets here (e.g. rank 0 finished writing a checkpoint the others will read)."""
        if self.world_size > 1:
            torch.distributed.barrier()


def micro_batches(rows: list[Any], size: int | None) -> list[list[Any]]:
    """``rows`` in consecutive passes of at most ``size`` (None: one pass); no pass when ``rows`` is empty."""
    if not rows:
        return []
    step = size or len(rows)
    return [rows[start : start + step] for start in range(0, len(rows), step)]
