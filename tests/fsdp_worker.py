"""SFT training, its resume and the trained model's gathering, through the product's code, under any launch.

tests/test_distributed.py calls :func:`measure` in its own process (one process, the model whole) and runs this
file under ``accelerate launch --config_file infra/accelerate/fsdp.yaml --num_processes 2`` (gloo on CPU):
``python fsdp_worker.py <tiny model folder> <work folder> <out.pt>``. What is measured:

- ``uninterrupted/*``: the weights after 4 AdamW steps of :func:`rlhf.training.sft.train_sft` (batch 3 in passes of 1,
  a resume checkpoint after step 2 by every process, rank 0 writing), gathered by
  :func:`rlhf.runtime.sharding.whole_model`;
- ``resumed/*``: the same run started again from that checkpoint (model, optimiser state, schedule);
- ``kept/*``: the trained weights :func:`rlhf.training.checkpoint.save_kept_policy` wrote, read back by
  :func:`rlhf.training.checkpoint.load_kept_policy`;
- ``ppo/uninterrupted/*`` and ``ppo/resumed/*``: the policy after a critic pre-training iteration and 2 policy
  iterations of :func:`rlhf.ppo.loop.train_ppo` (policy and value model sharded, a checkpoint after each rollout
  with both optimisers' states, the first while the policy's has none), and after the same run resumed from
  its last checkpoint (after rollout 2).

Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import sys

import torch
from split_worker import EXAMPLES, SETTINGS, TEXTS

from rlhf.data.chat import encode_prompt
from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.loop import train_ppo
from rlhf.ppo.types import PPOModels
from rlhf.runtime.device import Runtime
from rlhf.runtime.distributed import Ranks
from rlhf.runtime.sharding import sharding_from_environ, whole_model
from rlhf.training.checkpoint import Checkpointer, load_kept_policy, save_kept_policy
from rlhf.training.sft import SFTConfig, train_sft
from rlhf.training.supervised import no_log

CONFIG = SFTConfig(steps=4, batch_size=3, micro_batch_size=1, lr=1e-3, warmup_steps=0, checkpoint_every=2)
PPO = {"iterations": 2, "rollout_batch_size": 3, "minibatch_size": 2, "value_pretrain_iterations": 1,
       "validate_every": 0, "validation_prompts": None, "checkpoint_every": 1, "ptx_coef": 0.0,
       "reward_normalize": "per_kind", "policy_lr": 1e-3, "value_lr": 1e-3, "collapse_reward_skew": None,
       "collapse_truncated_share": None}  # fmt: skip


def train(folder: str, root: str, runtime: Runtime) -> torch.nn.Module | None:
    """Train the tiny model from ``folder`` with resume checkpoints in ``root``; the whole model on rank 0."""
    model = runtime.place(load_causal_lm(folder))
    checkpointer = Checkpointer(root, ranks=runtime.ranks)
    train_sft(model, load_tokenizer(folder), EXAMPLES, CONFIG, no_log, runtime, checkpointer, progress=False)
    return whole_model(model, runtime.ranks.main)


def ppo(folder: str, root: str, runtime: Runtime) -> torch.nn.Module | None:
    """PPO from the tiny model with resume checkpoints in ``root``; the whole policy on rank 0."""
    tokenizer = load_tokenizer(folder)
    torch.manual_seed(0)
    reward_model = load_scalar_model(folder)
    torch.nn.init.normal_(reward_model.score.weight, std=1.0)
    models = PPOModels(
        runtime.place(load_causal_lm(folder)),
        load_causal_lm(folder),
        reward_model,
        runtime.place(load_scalar_model(folder)),
    )
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": text}], 32) for text, _, _ in TEXTS]
    train_ppo(models, tokenizer, prompts, [], [], PPOConfig(**PPO), SETTINGS, no_log,
              Checkpointer(root, ranks=runtime.ranks), runtime, progress=False)  # fmt: skip
    return whole_model(models.policy, runtime.ranks.main)


def step_of(checkpoint: str | None) -> torch.Tensor:
    """The step of a checkpoint folder (``.../step-00000002``: 2), -1 for none."""
    return torch.tensor(int(checkpoint.rsplit("-", 1)[1]) if checkpoint else -1)


def measure(folder: str, work: str, runtime: Runtime) -> dict[str, torch.Tensor]:
    """Everything the test compares (rank 0; ``{}`` elsewhere)."""
    root = os.path.join(work, "checkpoints")
    model = train(folder, root, runtime)
    runtime.ranks.barrier()
    out = {"resumed_from/sft": step_of(Checkpointer(root).latest())}
    resumed = train(folder, root, runtime)  # from step 2, the checkpoint the first run left
    if runtime.ranks.main:
        out |= {f"uninterrupted/{name}": value for name, value in model.state_dict().items()}
        out |= {f"resumed/{name}": value for name, value in resumed.state_dict().items()}
    policy = runtime.place(load_causal_lm(folder))
    train_sft(policy, load_tokenizer(folder), EXAMPLES, CONFIG, no_log, runtime, progress=False)
    kept = os.path.join(work, "kept")
    save_kept_policy(policy, kept, {"iteration": 4}, runtime.ranks)
    if runtime.ranks.main:
        out |= {f"kept/{name}": value for name, value in load_kept_policy(folder, kept).state_dict().items()}
    for run in ("uninterrupted", "resumed"):  # the second resumes from the first's checkpoint after rollout 2
        if run == "resumed":
            out["resumed_from/ppo"] = step_of(Checkpointer(os.path.join(work, "ppo")).latest())
        policy = ppo(folder, os.path.join(work, "ppo"), runtime)
        runtime.ranks.barrier()
        if runtime.ranks.main:
            out |= {f"ppo/{run}/{name}": value for name, value in policy.state_dict().items()}
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
