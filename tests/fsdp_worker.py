"""SFT training, its resume and the trained model's gathering, through the product's code, under any launch.

tests/test_distributed.py calls :func:`measure` in its own process (one process, the model whole) and runs this
file under ``accelerate launch --config_file infra/accelerate/fsdp.yaml --num_processes 2`` (gloo on CPU):
``python fsdp_worker.py <tiny model folder> <work folder> <out.pt>``. What is measured:

- ``uninterrupted/*``: the weights after 4 AdamW steps of :func:`rlhf.sft.train_sft` (batch 3 in passes of 1,
  a resume checkpoint after step 2 by every process, rank 0 writing), gathered by
  :func:`rlhf.sharding.whole_model`;
- ``resumed/*``: the same run started again from that checkpoint (model, optimiser state, schedule);
- ``kept/*``: the trained weights :func:`rlhf.checkpoint.save_kept_policy` wrote, read back by
  :func:`rlhf.checkpoint.load_kept_policy`.

Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import sys

import torch
from split_worker import EXAMPLES

from rlhf.checkpoint import Checkpointer, load_kept_policy, save_kept_policy
from rlhf.device import Runtime
from rlhf.distributed import Ranks
from rlhf.models import load_causal_lm, load_tokenizer
from rlhf.sft import SFTConfig, train_sft
from rlhf.sharding import sharding_from_environ, whole_model
from rlhf.training import no_log

CONFIG = SFTConfig(steps=4, batch_size=3, micro_batch_size=1, lr=1e-3, warmup_steps=0, checkpoint_every=2)


def train(folder: str, root: str, runtime: Runtime) -> torch.nn.Module | None:
    """Train the tiny model from ``folder`` with resume checkpoints in ``root``; the whole model on rank 0."""
    model = runtime.place(load_causal_lm(folder))
    checkpointer = Checkpointer(root, ranks=runtime.ranks)
    train_sft(model, load_tokenizer(folder), EXAMPLES, CONFIG, no_log, runtime, checkpointer, progress=False)
    return whole_model(model, runtime.ranks.main)


def measure(folder: str, work: str, runtime: Runtime) -> dict[str, torch.Tensor]:
    """Everything the test compares (rank 0; ``{}`` elsewhere)."""
    root = os.path.join(work, "checkpoints")
    model = train(folder, root, runtime)
    runtime.ranks.barrier()
    resumed = train(folder, root, runtime)  # from step 2, the checkpoint the first run left
    out = {}
    if runtime.ranks.main:
        out |= {f"uninterrupted/{name}": value for name, value in model.state_dict().items()}
        out |= {f"resumed/{name}": value for name, value in resumed.state_dict().items()}
    policy = runtime.place(load_causal_lm(folder))
    train_sft(policy, load_tokenizer(folder), EXAMPLES, CONFIG, no_log, runtime, progress=False)
    kept = os.path.join(work, "kept")
    save_kept_policy(policy, kept, {"iteration": 4}, runtime.ranks)
    if runtime.ranks.main:
        out |= {f"kept/{name}": value for name, value in load_kept_policy(folder, kept).state_dict().items()}
    return out


if __name__ == "__main__":
    from accelerate import PartialState

    state = PartialState(cpu=True)  # gloo on CPU
    torch.set_num_threads(1)
    here = Runtime(ranks=Ranks(state.process_index, state.num_processes), sharding=sharding_from_environ())
    results = measure(sys.argv[1], sys.argv[2], here)
    if here.ranks.main:
        launch = {"world_size": torch.tensor(here.ranks.world_size), "sharded": torch.tensor(here.sharding is not None)}
        torch.save({**launch, **results}, sys.argv[3])
