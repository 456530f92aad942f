"""One SFT, reward-model and PPO step on fixed data, through the product's code, under any number of processes.

tests/test_distributed.py calls :func:`measure` in its own process (the whole batch in one pass, and in
micro-batches) and runs this file under ``accelerate launch --multi_gpu --num_processes 2`` (gloo on CPU),
and under ``--config_file infra/accelerate/fsdp.yaml`` (the trained models sharded, :mod:`rlhf.runtime.sharding`):
``python split_worker.py <tiny model folder> <micro_batch_size or none> <out.pt>``. Rank 0 writes what it
measured; every tensor is keyed so that the runs can be compared key by key.

Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import copy
import sys

import torch
from torch.distributed.tensor import DTensor

from rlhf.data.chat import encode_chat, encode_prompt, pad
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer
from rlhf.models.sampling import prompt_seed
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.rollout import make_experience
from rlhf.ppo.types import PPOModels
from rlhf.ppo.update import Optimisers, make_optimisers, ppo_update
from rlhf.reward.trainer import RewardConfig, encode_pairs, reward_step
from rlhf.runtime.device import Runtime
from rlhf.runtime.distributed import Ranks
from rlhf.runtime.sharding import shard, sharding_from_environ
from rlhf.training.sft import sft_step
from rlhf.training.supervised import batch_gradients, freeze_lower_layers, make_optimizer

TEXTS = [
    ("Is it safe?", "Yes.", "No, never do that at all."),
    ("How do I bake bread at home without yeast?", "Use baking soda and buttermilk; bake it hot.", "Buy it."),
    ("Hi", "Hello! How can I help you today?", "Go away."),
    ("What is 2+2?", "4", "It is 5, as everybody knows from school."),
    ("Tell me a joke about cats and dogs", "A cat and a dog walk into a bar; the dog pays.", "No."),
    ("Why is the sky blue?", "Sunlight scatters off air; blue scatters most.", "Because it is."),
    ("Name a colour", "Green, like grass in spring after the rain.", "Red"),
]
EXAMPLES = [
    {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }
    for prompt, chosen, rejected in TEXTS
]
SETTINGS = GenerationSettings(max_new_tokens=6, temperature=0.9, no_eos="score", no_eos_value=None)
PPO = {
    "rollout_batch_size": len(TEXTS),
    "minibatch_size": 3,  # minibatches of 3, 3 and 1 rollouts: on two ranks some hold 1 of 3, one holds none
    "ppo_epochs": 1,
    "reward_normalize": "per_kind",  # running statistics over every rank's scores, per kind
    "advantage_normalize": True,  # whitened over every rank's tokens
    "entropy_coef": 0.01,
    "ptx_coef": 0.5,
    "ptx_batch_size": 3,
    "value_clip": 0.2,
    "collapse_reward_skew": None,
    "collapse_truncated_share": None,
}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``, gathered from every process when it is sharded (collective)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def trainable(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """``{prefix/name: a copy}`` of each trainable parameter's value."""
    return {f"{prefix}/{n}": whole(p) for n, p in model.named_parameters() if p.requires_grad}


def gradients(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """``{prefix/name: a copy}`` of each trainable parameter's gradient."""
    return {f"{prefix}/{n}": whole(p.grad) for n, p in model.named_parameters() if p.requires_grad}


def supervised(name: str, build, make_step, micro: int | None, runtime: Runtime) -> dict[str, torch.Tensor]:
    """The gradient of the whole batch, the weights after one SGD step (lr 1) and after one AdamW step."""
    model = shard(build(), runtime.sharding)
    batch = list(range(len(EXAMPLES)))
    batch_gradients(model, make_step(model), batch, micro, name, runtime)
    out = gradients(model, f"{name}/grad")
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    out |= trainable(model, f"{name}/sgd")
    model = shard(build(), runtime.sharding)
    optimizer = make_optimizer(model, lr=1e-3)  # the trainers' own AdamW
    batch_gradients(model, make_step(model), batch, micro, name, runtime)
    optimizer.step()
    return out | trainable(model, f"{name}/adam")


def rollout_and_update(
    folder: str, tokenizer, micro: int | None, runtime: Runtime, trainable_layers: int | None = None, name: str = ""
) -> dict[str, torch.Tensor]:
    """The experience buffer of one sharded rollout (per global row) and the weights after one PPO update of
    the policy and value model from it, with SGD (lr 1: the change is minus the gradient) and with AdamW.

    ``trainable_layers: 1`` freezes block 0 of policy and value model: all four models then share it, computed
    once (rlhf.models.trunk) on one process and under DDP, while FSDP's sharded models take the plain path; ``name``
    marks those keys."""
    ranks = runtime.ranks
    config = PPOConfig(**PPO, micro_batch_size=micro)
    torch.manual_seed(0)
    policy, reference = load_causal_lm(folder), load_causal_lm(folder)
    reward_model, value_model = load_scalar_model(folder), load_scalar_model(folder)
    torch.nn.init.normal_(reward_model.score.weight, std=1.0)
    models = PPOModels(*(m.eval() for m in (policy, reference, reward_model, value_model)))
    reference.requires_grad_(False)
    reward_model.requires_grad_(False)
    for model in (policy, value_model):
        freeze_lower_layers(model, trainable_layers)
    policy, value_model = shard(policy, runtime.sharding), shard(value_model, runtime.sharding)
    prompts = [encode_prompt(tokenizer, e["prompt"], 32) for e in EXAMPLES]
    seeds = [prompt_seed(0, 0, j) for j in range(len(prompts))]
    # per-kind normalisation: each rank's kinds must meet its scores in the global order (not rank after rank)
    kinds = ["harmless" if j % 3 == 0 else "helpful" for j in range(len(prompts))]
    experience, stats = make_experience(
        models, tokenizer, ranks.shard(prompts), config, SETTINGS, RewardMoments(), 0.05, runtime,
        seeds=ranks.shard(seeds), kinds=ranks.shard(kinds),
    )  # fmt: skip
    out = {f"stats/{name}{key}": torch.tensor(value, dtype=torch.float64) for key, value in stats.items()}
    out |= {key.replace("buffer/", f"buffer/{name}"): value for key, value in buffer_rows(experience, ranks).items()}
    ptx = pad(tokenizer, [encode_chat(tokenizer, e["prompt"], e["chosen"], 48).input_ids for e in EXAMPLES[:3]],
              "right", runtime.device)  # fmt: skip
    start = {"policy": copy.deepcopy(policy.state_dict()), "value": copy.deepcopy(value_model.state_dict())}
    for kind in ("sgd", "adam"):
        policy.load_state_dict(start["policy"])
        value_model.load_state_dict(start["value"])
        if kind == "sgd":
            sgd = [
                torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0) for m in (policy, value_model)
            ]
            constant = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0) for o in sgd]
            optimisers = Optimisers(sgd[0], sgd[1], constant[0], constant[1])
        else:
            optimisers = make_optimisers(policy, value_model, config)
        ppo_update(policy, value_model, optimisers, experience, config, SETTINGS.temperature, 0, [ptx], True, runtime)
        out |= trainable(policy, f"ppo/{kind}/{name}policy") | trainable(value_model, f"ppo/{kind}/{name}value")
    return out


def buffer_rows(experience, ranks: Ranks) -> dict[str, torch.Tensor]:
    """Each rollout's response tokens, logprobs, values, advantages, returns and score, keyed by its global row."""
    rows = {}
    for k in range(experience.input_ids.shape[0]):
        mask = experience.mask[k]
        row = {
            "tokens": experience.input_ids[k, experience.response_start :][mask],
            **{name: getattr(experience, name)[k][mask] for name in ("logprobs", "values", "advantages", "returns")},
            "score": experience.raw_scores[k],
        }
        rows |= {f"buffer/{ranks.rank + k * ranks.world_size}/{key}": value for key, value in row.items()}
    if ranks.world_size == 1:
        return rows
    parts: list = [None] * ranks.world_size
    torch.distributed.all_gather_object(parts, rows)
    return {key: value for part in parts for key, value in part.items()}


def measure(folder: str, micro: int | None, runtime: Runtime) -> dict[str, torch.Tensor]:
    """Everything the test compares, measured under ``runtime``'s processes with passes of ``micro`` rows."""
    tokenizer = load_tokenizer(folder)
    encoded = [encode_chat(tokenizer, e["prompt"], e["chosen"], 64) for e in EXAMPLES]
    pairs = encode_pairs(tokenizer, EXAMPLES, 64)

    def scalar_model():
        torch.manual_seed(0)  # the new head's initialisation
        return load_scalar_model(folder).eval()

    out = supervised("sft", lambda: load_causal_lm(folder).eval(),
                     lambda model: sft_step(model, tokenizer, encoded, runtime), micro, runtime)  # fmt: skip
    # the length expert's term is a sum over pairs and splits like the rest; the preference term is a function of
    # each pass (rlhf.reward.length_bias.debiased_pair_loss), so it is off here
    config = RewardConfig(lm_coef=0.5, length_decorrelation=0.0, trainable_layers=None)
    out |= supervised("rm", scalar_model,
                      lambda model: reward_step(model, tokenizer, pairs, config, runtime, expert_weight=-0.7),
                      micro, runtime)  # fmt: skip
    out |= rollout_and_update(folder, tokenizer, micro, runtime)
    return out | rollout_and_update(folder, tokenizer, micro, runtime, trainable_layers=1, name="trunk/")


if __name__ == "__main__":
    from accelerate import PartialState

    state = PartialState(cpu=True)  # gloo on CPU (accelerate launch --multi_gpu --num_processes 2)
    torch.set_num_threads(1)
    here = Runtime(ranks=Ranks(state.process_index, state.num_processes), sharding=sharding_from_environ())
    results = measure(sys.argv[1], None if sys.argv[2] == "none" else int(sys.argv[2]), here)
    if here.ranks.main:
        launch = {"world_size": torch.tensor(here.ranks.world_size), "sharded": torch.tensor(here.sharding is not None)}
        torch.save({**launch, **results}, sys.argv[3])
