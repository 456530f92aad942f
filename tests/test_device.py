"""Every trainer keeps its tensors on the chosen device and gathers its figures once per optimiser step.

Each trainer runs on the tiny model under :class:`device_check.DeviceCheck` with the chosen device
``torch.device("cpu")``. The check fails on a tensor factory called by our code without ``device=`` (it
would land on the default device, the CPU, whatever the runtime says), so these tests fail on a CPU-only
machine for a tensor that would be misplaced on a GPU. Host round trips (``.item()``, ``float(t)``,
``.tolist()``, ...) made by our code are counted with their ``file:line``.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter

import pytest
import torch
from device_check import SRC_RLHF, SYNCS, DeviceCheck
from test_ppo import PROMPTS, four_models, small_config
from torch.overrides import TorchFunctionMode

from rlhf.data.chat import encode_chat, encode_prompt
from rlhf.evaluation.evaluator import EvalConfig, Sampling, Scorers, evaluate_policy
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model
from rlhf.models.shared_prompt import score_sequences
from rlhf.ppo.loop import train_ppo
from rlhf.ppo.moments import RewardMoments
from rlhf.ppo.rollout import make_experience
from rlhf.reward.metrics import evaluate_reward_model
from rlhf.reward.trainer import RewardConfig, train_reward_model
from rlhf.runtime.device import PhaseTimer, Runtime, timed
from rlhf.runtime.finite import to_host
from rlhf.training.checkpoint import Checkpointer
from rlhf.training.sft import SFTConfig, train_sft

CPU = torch.device("cpu")
HERE = os.path.abspath(__file__)
RUNTIMES = {
    "fp32": Runtime(CPU, "no"),
    "bf16": Runtime(CPU, "bf16"),
    "bf16+frozen_bf16": Runtime(CPU, "bf16", frozen_bf16=True),
}
SETTINGS = GenerationSettings(max_new_tokens=3, temperature=0.7, no_eos="score", no_eos_value=None)
EXAMPLES = [
    {
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "chosen": [{"role": "assistant", "content": f"good answer {i}"}],
        "rejected": [{"role": "assistant", "content": f"bad {i}"}],
    }
    for i in range(4)
]


def placed_models(folder, runtime: Runtime):
    """The four PPO models placed as tasks/ppo.py places them: trained ones float32, frozen ones per runtime."""
    models = four_models(folder)
    models.policy, models.value_model = runtime.place(models.policy), runtime.place(models.value_model)
    models.reference, models.reward_model = runtime.frozen(models.reference), runtime.frozen(models.reward_model)
    return models


# ---------------------------------------------------------------------------------------------- the check itself


class Recorder(TorchFunctionMode):
    """Every function that reaches ``__torch_function__``, by name (no attribution)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "expression, name",
    [
        (lambda s, t, b, i: s.item(), "item"),
        (lambda s, t, b, i: t.tolist(), "tolist"),
        (lambda s, t, b, i: float(s), "__float__"),
        (lambda s, t, b, i: math.isfinite(s), "__float__"),
        (lambda s, t, b, i: int(i), "__int__"),
        (lambda s, t, b, i: bool(b), "__bool__"),
        (lambda s, t, b, i: 1 if b else 0, "__bool__"),
        (lambda s, t, b, i: [0, 1, 2, 3][i], "__index__"),
        (lambda s, t, b, i: f"{s:.3f}", "__format__"),
        (lambda s, t, b, i: complex(s), "__complex__"),
        (lambda s, t, b, i: t.numpy(), "numpy"),
        (lambda s, t, b, i: __import__("numpy").asarray(t), "__array__"),
        (lambda s, t, b, i: t.cpu(), "cpu"),
        (lambda s, t, b, i: t.to("cpu"), "to"),
    ],
)
def test_probe_which_methods_reach_torch_function(expression, name):
    # the premise of DeviceCheck's host-round-trip count (torch 2.13): each of these reaches the mode
    scalar, vector, flag, index = torch.tensor(2.0), torch.ones(3), torch.tensor(True), torch.tensor(3)
    with Recorder() as recorder:
        expression(scalar, vector, flag, index)
    assert name in recorder.names
    assert name in {f.__name__ for f in SYNCS} | {"to"}


def test_check_fails_on_a_factory_without_device_and_names_the_line():
    # "our code" is this test file here, so the calls below are ours
    with DeviceCheck(CPU, ours=(HERE,)) as check:
        torch.zeros(3)  # no device=: lands on the default device (fine on a CPU-only machine; wrong on a GPU)
        line = test_check_fails_on_a_factory_without_device_and_names_the_line.__code__.co_firstlineno + 3
    assert [(v.kind, v.func, v.where) for v in check.violations] == [
        ("factory", "zeros", f"{os.path.relpath(HERE, os.path.dirname(os.path.dirname(HERE)))}:{line}")
    ]


def test_check_accepts_the_chosen_device_and_inherited_devices():
    x = torch.ones(3)
    with DeviceCheck(CPU, ours=(HERE,)) as check:
        torch.zeros(3, device="cpu")
        torch.arange(4, device=CPU)
        torch.tensor([1.0, 2.0], device=x.device)
        torch.as_tensor(x)  # tensor data keeps its device
        torch.zeros_like(x)
        x.new_zeros(2)
        x.to(CPU)
    assert check.violations == []


def test_check_records_wrong_devices_moves_and_host_round_trips():
    x = torch.ones(3)
    with DeviceCheck(CPU, ours=(HERE,)) as check:
        torch.tensor([1.0])  # Python data without device=
        torch.full((2,), 1.0, device="meta")  # another device named
        x.to("meta")  # moved off the chosen device
        torch.zeros_like(x, device="meta")
        x.sum().item()
        float(x[0])
        if x[0] > 0:  # __bool__
            x.tolist()
        x[x > 0]  # data-dependent shape
    kinds = [(v.kind, v.func) for v in check.violations]
    assert ("factory", "tensor") in kinds
    assert ("factory", "full") in kinds and ("move", "full") in kinds
    assert ("move", "to") in kinds
    assert ("factory", "zeros_like") in kinds
    assert [s.func for s in check.syncs] == ["item", "__float__", "__bool__", "tolist"]
    assert [s.func for s in check.implicit_syncs] == ["__getitem__"]
    assert all(s.where.startswith("tests/test_device.py:") for s in check.syncs)


def test_check_ignores_other_callers_and_torch_internals():
    # AdamW's first step makes its step counter with torch.tensor() (no device, on purpose) and reads it
    # with .item(): torch's business. Only our code's calls count; with another "ours" nothing is ours.
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param])
    with Recorder() as recorder:
        optimizer.step()
    assert {"tensor", "item"} <= set(recorder.names)
    with DeviceCheck(CPU, ours=(HERE,)) as check:
        optimizer.step()
        torch.nn.utils.clip_grad_norm_([param], 1.0)
    with DeviceCheck(CPU, ours=(HERE + ".elsewhere",)) as elsewhere:
        torch.zeros(3)
        torch.ones(()).item()
    assert (check.violations, check.syncs, elsewhere.violations, elsewhere.syncs) == ([], [], [], [])


def test_to_host_is_one_round_trip_and_equals_item():
    values = {
        "fp32": torch.tensor(1.2345678),
        "bf16": torch.tensor(3.14159, dtype=torch.bfloat16),
        "fp16": torch.tensor(-0.333, dtype=torch.float16),
        "tokens": torch.tensor(1234),  # an int64 count (sft/tokens)
        "nan": torch.tensor(float("nan")),
        "inf": torch.tensor(-float("inf")),
        "host": 0.5,
    }
    with DeviceCheck(CPU) as check:
        host = to_host(values)
    assert [s.func for s in check.syncs] == ["tolist"] and check.syncs[0].where.startswith(
        "src/rlhf/runtime/finite.py:"
    )
    for key, value in values.items():
        expected = value.item() if isinstance(value, torch.Tensor) else value
        # bf16, fp16 and int64 (below 2**24) are exact in float32, which to_host stacks them in
        assert host[key] == expected or (math.isnan(host[key]) and math.isnan(expected)), key
        assert type(host[key]) is float


# ---------------------------------------------------------------------------------------------- the trainers


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sft", "reward", "reward_blocks"])
def test_supervised_trainers_stay_on_device_and_sync_once_per_step(tiny_dir, tokenizer, kind, precision):
    runtime = RUNTIMES[precision]
    steps = 2
    if kind == "sft":
        model, train, config = load_causal_lm(tiny_dir), train_sft, SFTConfig(steps=steps, batch_size=2)
    else:  # the head alone on states computed once (the default), or every block trained each step
        blocks = {"trainable_layers": None} if kind == "reward_blocks" else {}
        config = RewardConfig(steps=steps, batch_size=2, **blocks)
        model, train = load_scalar_model(tiny_dir), train_reward_model
    model = runtime.place(model)
    at_log: list[int] = []
    with DeviceCheck(runtime.device) as check:
        train(model, tokenizer, EXAMPLES, config, lambda m, s: at_log.append(len(check.syncs)), runtime, progress=False)
    assert check.violations == [], check.report()
    assert check.implicit_syncs == [], check.report()
    # between two log calls lies one optimiser step: exactly one host round trip, the step's to_host
    assert at_log == list(range(1, steps + 1)), check.report()
    assert all(s.chain[-1] == "to_host" for s in check.syncs[:steps]), check.report()
    # after the loop: check_finite_weights, one round trip for every weight tensor together
    after = check.syncs[steps:]
    assert len(after) == 1 and "check_finite_weights" in after[0].chain, check.report()


@pytest.mark.parametrize("precision", ["fp32", "bf16+frozen_bf16"])
def test_ppo_stays_on_device_and_syncs_once_per_policy_and_value_step(tiny_dir, tokenizer, tmp_path, precision):
    runtime = RUNTIMES[precision]
    prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS]
    # one rollout of 2 responses, minibatches of 1: 2 policy and 2 value steps; ptx and the entropy bonus on,
    # so every branch of policy_step runs; validation before and after (fp32 only: the bf16 path of the same
    # generation and logprobs runs in the rollout and in test_evaluation_and_reward_scoring_stay_on_device)
    config = small_config(
        iterations=1,
        value_pretrain_iterations=0,
        rollout_batch_size=2,
        minibatch_size=1,
        validate_every=1,
        checkpoint_every=0,
        ptx_coef=0.5,
        ptx_batch_size=1,
        entropy_coef=0.01,
    )
    models = placed_models(tiny_dir, runtime)
    with DeviceCheck(runtime.device) as check:
        result = train_ppo(
            models,
            tokenizer,
            prompts[:4],
            prompts[5:] if precision == "fp32" else [],
            [[10, 11, 12, 2], [20, 21, 2]],
            config,
            SETTINGS,
            lambda m, s: None,
            Checkpointer(str(tmp_path)),
            runtime,
            False,
        )
    assert result.summary["ppo/policy_iterations"] == 1.0
    assert check.violations == [], check.report()
    policy, value = check.syncs_in("policy_step"), check.syncs_in("value_step")
    assert len(policy) == 2 and len(value) == 2, check.report()
    assert all(s.chain[-1] == "to_host" for s in policy + value), check.report()
    # nothing else in the update loop reaches the host, and no data-dependent shapes
    steps = [s for s in check.syncs if "policy_step" in s.chain or "value_step" in s.chain]
    assert check.syncs_in("ppo_update") == steps, check.report()
    assert [s for s in check.implicit_syncs if "ppo_update" in s.chain] == [], check.report()


def test_rollout_host_round_trips_do_not_grow_with_the_batch(tiny_dir, tokenizer):
    runtime = RUNTIMES["fp32"]
    counts = []
    for rows in (1, 2):
        models = placed_models(tiny_dir, runtime)
        prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS[:rows]]
        config = small_config(rollout_batch_size=rows, minibatch_size=rows)
        with DeviceCheck(runtime.device) as check:
            make_experience(models, tokenizer, prompts, config, SETTINGS, RewardMoments(), 0.05, runtime)
        assert check.violations == [], check.report()
        counts.append(Counter(e.where for e in check.syncs + check.implicit_syncs))
    # the same host round trips for 1 and 2 responses (none per response)
    assert counts[1] - counts[0] == Counter(), counts[1] - counts[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16+frozen_bf16"])
def test_evaluation_and_reward_scoring_stay_on_device(tiny_dir, tokenizer, precision):
    runtime = RUNTIMES[precision]
    models = placed_models(tiny_dir, runtime)
    sequences = [encode_chat(tokenizer, e["prompt"], e["chosen"], 64).input_ids for e in EXAMPLES]
    with DeviceCheck(runtime.device) as check:
        scorers = Scorers(models.reward_model, models.reward_model, tokenizer)
        config = EvalConfig(batch_size=2, bootstrap_resamples=10)
        sampling = Sampling(scorers, tokenizer, config, SETTINGS, runtime)
        metrics, _ = evaluate_policy(models.reference, models.policy, PROMPTS[:2], [], sampling)
        scores = score_sequences(models.reward_model, tokenizer, sequences, 3, runtime)
    assert scores.device.type == runtime.device.type and metrics["eval/prompts"] == 2.0
    assert check.violations == [], check.report()
    assert [s for s in check.syncs if "score_sequences" in s.chain] == [], check.report()


def test_reward_model_evaluation_stays_on_device(tiny_dir, tokenizer):
    runtime = RUNTIMES["fp32"]
    model = runtime.frozen(load_scalar_model(tiny_dir))
    with DeviceCheck(runtime.device) as check:
        metrics, margins = evaluate_reward_model(model, tokenizer, EXAMPLES, 64, 4, runtime)
    assert margins.shape == (len(EXAMPLES),) and "rm/accuracy" in metrics
    assert check.violations == [], check.report()


def test_src_rlhf_is_where_the_check_looks():
    # the default "our code" is the library: a typo here would make every trainer test pass vacuously
    assert os.path.isfile(os.path.join(SRC_RLHF, "training", "supervised.py"))
    assert os.path.isfile(os.path.join(SRC_RLHF, "runtime", "finite.py"))


def test_timed_records_a_phase_with_a_timer_and_nothing_without_one():
    timer = PhaseTimer(Runtime())
    for _ in range(2):
        with timed(timer, "generation"):
            time.sleep(0.01)
    with timed(None, "reward"):
        time.sleep(0.01)
    assert list(timer.seconds) == ["generation"]
    assert timer.seconds["generation"] >= 0.02  # both repeats summed
