"""The result does not depend on how a batch is split: one pass, micro-batches, or two processes (gloo on CPU),
each holding the whole model (data parallel, infra/accelerate/ddp.yaml) or half of it (FSDP2,
infra/accelerate/fsdp.yaml).

tests/split_worker.py measures one SFT step, one reward-model step, one sharded rollout and one PPO update
through the product's code; these tests compare what it measures under each split with the whole batch
in one process. tests/fsdp_worker.py measures a sharded SFT run, its resume and the gathered model.
Tolerances: gradients, and weights after one SGD step, 1e-6 (fp32; measured up to 1.3e-7);
the rollout buffer (logprobs, values, advantages, returns, scores) and its statistics 1e-5, its sampled
tokens exactly; weights after one AdamW step 1e-4 (measured up to 1.2e-5): Adam's first step is
``lr * g / (|g| + eps)``, which turns a gradient difference of 1e-7 on a gradient near ``eps`` into a
difference of up to ``lr`` (1e-3 here) in the weight.
"""

from __future__ import annotations

import os
import subprocess
import sys

import fsdp_worker
import pytest
import split_worker
import torch

from rlhf.losses import bradley_terry_loss, masked_mean
from rlhf.models.sampling import PerPromptSampling
from rlhf.runtime.device import Runtime
from rlhf.runtime.distributed import Ranks, micro_batches
from rlhf.runtime.sharding import Sharding, sharding_from_environ

HERE = os.path.dirname(os.path.abspath(__file__))
INFRA = os.path.join(os.path.dirname(HERE), "infra", "accelerate")
TOLERANCE = {"grad": 1e-6, "sgd": 1e-6, "adam": 1e-4, "buffer": 1e-5}


@pytest.fixture(scope="module")
def whole(tiny_dir) -> dict[str, torch.Tensor]:
    """The whole batch in one pass, one process."""
    return split_worker.measure(tiny_dir, None, Runtime())


def assert_same(expected: dict[str, torch.Tensor], measured: dict[str, torch.Tensor]) -> None:
    """Every key of ``expected`` in ``measured``, within its group's tolerance (tokens exactly)."""
    compared = {key for key in expected if "ppo/time/" not in key}  # wall-clock seconds
    assert compared <= set(measured), sorted(compared - set(measured))
    for key in sorted(compared):
        want, got = expected[key].double(), measured[key].double()
        if key.endswith("/tokens"):
            assert torch.equal(want, got), key
        elif key.startswith("stats/"):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=key)
        else:
            kind = "buffer" if key.startswith("buffer/") else key.split("/")[1]  # sft/grad/..., ppo/sgd/policy/...
            torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE[kind], msg=key)
    kinds = {key.split("/")[0] for key in compared}
    assert {"sft", "rm", "ppo", "buffer", "stats"} <= kinds


def test_micro_batches_give_the_whole_batch_result(tiny_dir, whole):
    # 7 examples in passes of 2, 2, 2 and 1: every loss is a token (or pair) mean over the whole batch
    assert_same(whole, split_worker.measure(tiny_dir, 2, Runtime()))


def launch(worker: str, config: str, *args: str, reshard: bool = True) -> dict[str, torch.Tensor]:
    """Run ``tests/<worker>`` on two gloo processes with ``infra/accelerate/<config>`` (``fsdp.yaml`` with
    ``fsdp_reshard_after_forward: <reshard>``); what rank 0 saved in the file ``args[-1]``."""
    import yaml

    out, path = args[-1], os.path.join(INFRA, config)
    if not reshard:
        with open(path) as handle:
            settings = yaml.safe_load(handle)
        settings["fsdp_config"]["fsdp_reshard_after_forward"] = False
        path = os.path.join(os.path.dirname(out), "keep-gathered.yaml")
        with open(path, "w") as handle:
            yaml.safe_dump(settings, handle)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", path, "--num_processes", "2",
               "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    result = subprocess.run(
        [*command, os.path.join(HERE, worker), *args], capture_output=True, text=True, timeout=300, cwd=HERE
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = torch.load(out, weights_only=True)
    assert int(measured.pop("world_size")) == 2  # two gloo processes, not one
    assert bool(measured.pop("sharded")) == (config == "fsdp.yaml")
    return measured


@pytest.mark.integration
@pytest.mark.parametrize(
    "config, micro, reshard",
    # FSDP in passes of 1: the ranks hold 4 and 3 rows, so one runs a pass that counts zero (rlhf.runtime.sharding);
    # reshard False: each block keeps its gathered weights from the forward to the backward pass
    [("ddp.yaml", "none", True), ("fsdp.yaml", "1", True), ("fsdp.yaml", "none", False)],
)
def test_two_processes_give_the_whole_batch_result(tiny_dir, whole, tmp_path, config, micro, reshard):
    measured = launch("split_worker.py", config, tiny_dir, micro, str(tmp_path / "two.pt"), reshard=reshard)
    assert_same(whole, measured)


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """What tests/fsdp_worker.py measures on one process."""
    return fsdp_worker.measure(tiny_dir, str(tmp_path_factory.mktemp("one")), Runtime())


@pytest.mark.integration
@pytest.mark.parametrize("reshard", [True, False])
def test_sharded_training_resumes_and_gathers_the_whole_model(tiny_dir, one_process, tmp_path, reshard):
    one = dict(one_process)  # popped below
    out = str(tmp_path / "two.pt")
    sharded = launch("fsdp_worker.py", "fsdp.yaml", tiny_dir, str(tmp_path / "two"), out, reshard=reshard)
    assert set(sharded) == set(one)
    for measured in (one, sharded):  # the second runs started from the checkpoints the first left
        assert int(measured.pop("resumed_from/sft")) == 2 and int(measured.pop("resumed_from/ppo")) == 2
    assert {key.split("/")[0] for key in one} == {"uninterrupted", "resumed", "kept", "ppo"}
    for key in sorted(one):
        ppo = key.startswith("ppo/")
        name = key.split("/", 2)[2] if ppo else key.split("/", 1)[1]
        if not ppo:  # 4 AdamW steps (lr 1e-3) of SFT on two processes against one: measured 1.1e-6
            torch.testing.assert_close(sharded[key], one[key], rtol=0, atol=TOLERANCE["adam"], msg=key)
        # a resumed run, and the kept policy, hold the uninterrupted run's weights exactly, on either launch
        uninterrupted = f"ppo/uninterrupted/{name}" if ppo else f"uninterrupted/{name}"
        for measured in (one, sharded):
            assert torch.equal(measured[key], measured[uninterrupted]), key


def test_the_shares_of_a_batch_sum_to_its_mean():
    values, mask = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[True, True], [True, False]])
    # the whole batch: (1 + 2 + 3) / 3 = 2; the rows as parts of it: 3 / 3 = 1 and 3 / 3 = 1
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    parts = [masked_mean(values[i : i + 1], mask[i : i + 1], count=3) for i in range(2)]
    assert [p.item() for p in parts] == pytest.approx([1.0, 1.0])
    # two pairs, both with equal scores: each -log sigmoid(0) = log 2; one pair's share of the pair mean is log 2 / 2
    share = bradley_terry_loss(torch.zeros(1), torch.zeros(1), count=2)
    assert share.item() == pytest.approx(0.693147 / 2, abs=1e-6)


def test_target_tokens_counts_the_masked_tokens_after_the_first():
    from rlhf.likelihood import target_tokens

    # the first position has no logits predicting it: [T, T, F, T] scores 2 tokens, [F, T, T] scores 2
    assert target_tokens([True, True, False, True]) == 2 and target_tokens([0, 1, 1]) == 2 and target_tokens([]) == 0


def test_a_launch_done_by_hand_is_checked_too(monkeypatch):
    from rlhf.runtime.device import runtime_from_params

    device = {"mixed_precision": "no", "cpu": True, "frozen_bf16": False}
    for name in ("DEEPSPEED", "MEGATRON_LM"):
        monkeypatch.setenv(f"ACCELERATE_USE_{name}", "true")
        with pytest.raises(ValueError, match=f"accelerate launched with {name}: the trainers run data parallel or"):
            runtime_from_params(device)
        monkeypatch.delenv(f"ACCELERATE_USE_{name}")
    # what runtime_from_params reads (an Accelerator made here would fix accelerate's state for the session)
    assert sharding_from_environ() is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert sharding_from_environ() == Sharding(reshard_after_forward=True)
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert sharding_from_environ() == Sharding(reshard_after_forward=False)
    for name, value in [("FSDP_VERSION", "1"), ("FSDP_OFFLOAD_PARAMS", "true"), ("FSDP_ACTIVATION_CHECKPOINTING",
                        "true"), ("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")]:  # fmt: skip
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"accelerate FSDP setting {name}={value} is not implemented"):
            sharding_from_environ()
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"fsdp_version": 1}, r"fsdp_config.fsdp_version: 1 is not implemented"),
        ({"fsdp_version": None}, r"fsdp_config.fsdp_version must be set to 2"),
        ({"fsdp_cpu_ram_efficient_loading": None}, r"fsdp_cpu_ram_efficient_loading must be set to false"),
        ({"fsdp_activation_checkpointing": True}, r"set <stage>.gradient_checkpointing in params.yaml instead"),
        ({"fsdp_cpu_ram_efficient_loading": True}, r"fsdp_cpu_ram_efficient_loading: True is not implemented"),
        ({"fsdp_offload_params": True}, r"fsdp_config.fsdp_offload_params: True is not implemented"),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, r"fsdp_auto_wrap_policy: 'SIZE_BASED_WRAP' is not impl"),
    ],
)
def test_fsdp_settings_the_trainers_do_not_implement_are_refused_before_launch(tmp_path, edit, message):
    import yaml

    from tasks.kit.launch import check_accelerate_config

    shipped = os.path.join(INFRA, "fsdp.yaml")
    check_accelerate_config(shipped)  # the shipped file passes
    with open(shipped) as handle:
        config = yaml.safe_load(handle)
    for key, value in edit.items():
        config["fsdp_config"].pop(key) if value is None else config["fsdp_config"].__setitem__(key, value)
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=message):
        check_accelerate_config(str(path))


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"), [(True, False, "bf16"), (False, True, "bf16"), (False, False, "no")]
)
def test_auto_precision_is_bf16_only_where_the_cpu_computes_it_natively(
    monkeypatch, capsys, amx, avx512_bf16, expected
):
    from accelerate.state import AcceleratorState

    from rlhf.runtime.device import mixed_precision
    from tasks.kit.common import stage_runtime

    def fresh_accelerator() -> None:  # a stage process builds one; reset as accelerate's own tests do
        AcceleratorState._reset_state(reset_partial_state=True)

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    auto = {"mixed_precision": "auto", "cpu": True, "frozen_bf16": False}
    assert mixed_precision(auto) == expected
    fresh_accelerator()
    assert stage_runtime("sft", auto).mixed_precision == expected
    assert f"[sft] device cpu, mixed precision {expected} (auto)" in capsys.readouterr().out
    # bf16 asked by name is honoured, with a warning where it is only emulated
    fresh_accelerator()
    stage_runtime("sft", {**auto, "mixed_precision": "bf16"})
    fresh_accelerator()
    warned = "[sft] WARNING: cpu has no native bf16" in capsys.readouterr().out
    assert warned == (expected == "no")


def test_what_a_launch_cannot_run_is_refused_before_it_starts(tmp_path):
    from rlhf.ppo.config import PPOConfig, check_processes
    from rlhf.runtime.device import mixed_precision
    from tasks.kit.launch import distributed_type

    assert mixed_precision({"mixed_precision": False}) == "no"  # YAML reads an unquoted no as false
    with pytest.raises(ValueError, match=r"device.mixed_precision 'fp16': use one of auto, no, bf16"):
        mixed_precision({"mixed_precision": "fp16"})
    assert distributed_type({"accelerate_config": None}) == "MULTI_GPU"
    assert distributed_type({"accelerate_config": os.path.join(INFRA, "fsdp.yaml")}) == "FSDP"
    config = PPOConfig(rollout_batch_size=3, minibatch_size=3, lora_rank=4, trainable_layers=None)
    check_processes(config, 3, 3, False)  # one prompt each; LoRA data parallel
    with pytest.raises(ValueError, match=r"ppo.rollout_batch_size is 3: each of the 4 training processes needs"):
        check_processes(config, None, 4, False)
    with pytest.raises(ValueError, match=r"ppo.validation_prompts is 2: each of the 3 training processes needs"):
        check_processes(config, 2, 3, False)
    with pytest.raises(ValueError, match=r"ppo.lora_rank with FSDP is not implemented"):
        check_processes(config, None, 2, True)


def test_passes_pad_a_rank_to_the_busiest_only_for_a_sharded_model():
    one = Ranks()
    assert one.passes([4, 6, 8], 2, [4], None) == [([4, 6], True), ([8], True)]
    assert one.passes([], 2, [0], torch.device("cpu")) == []  # one process: nobody to wait for
    assert one.passes([4, 6, 8], None, [4], torch.device("cpu")) == [([4, 6, 8], True)]


def test_ranks_shard_rows_and_split_passes():
    rows = list(range(7))
    assert Ranks(0, 2).shard(rows) == [0, 2, 4, 6] and Ranks(1, 2).shard(rows) == [1, 3, 5]
    assert Ranks(1, 2).shard_of([5, 2, 3]) == [5, 3]
    assert micro_batches([0, 2, 4, 6], 3) == [[0, 2, 4], [6]]
    assert micro_batches([0, 2], None) == [[0, 2]] and micro_batches([], 2) == []


def test_gumbel_max_sampling_draws_from_the_softmax():
    # logits log(0.5), log(0.3), log(0.2) at temperature 1: the argmax of logits + Gumbel noise is a sample
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    sampler = PerPromptSampling(list(range(4000)), 1.0, torch.device("cpu"))
    counts = torch.bincount(sampler(None, logits).argmax(-1), minlength=3).float() / 4000
    assert counts.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.03)  # 4 standard errors
    # each row's draw comes from its own seed: the same seed gives the same token in any batch
    in_batch = PerPromptSampling(list(range(4000)), 1.0, torch.device("cpu"))(None, logits)[7].argmax()
    alone = PerPromptSampling([7], 1.0, torch.device("cpu"))(None, logits[:1])[0].argmax()
    assert alone.item() == in_batch.item()


def test_bad_process_and_pass_sizes_are_refused_with_one_line(tmp_path):
    from rlhf.ppo.config import PPOConfig
    from rlhf.training.sft import SFTConfig
    from tasks.kit.launch import other_rank

    with pytest.raises(ValueError, match=r"sft.micro_batch_size must be at least 1, got 0"):
        SFTConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match=r"ppo.micro_batch_size must be at least 1, got -1"):
        PPOConfig(micro_batch_size=-1)
    with pytest.raises(FileNotFoundError, match=r"device.accelerate_config infra/none.yaml: no such file"):
        other_rank({"num_processes": 2, "accelerate_config": "infra/none.yaml", "mixed_precision": "no"}, "m", id, id)
    deepspeed = tmp_path / "deepspeed.yaml"
    deepspeed.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\n")
    with pytest.raises(ValueError, match=r"distributed_type DEEPSPEED is not supported: the trainers run data par"):
        other_rank({"num_processes": 2, "accelerate_config": str(deepspeed), "mixed_precision": "no"}, "m", None, None)
    for bad in (0, "2", True, 1.5):
        with pytest.raises(ValueError, match=r"device.num_processes must be an integer of at least 1"):
            other_rank({"num_processes": bad, "mixed_precision": "no"}, "tasks.sft", lambda: None, lambda: None)

    def bad_params():
        raise ValueError("sft.micro_batch_size must be at least 1 or null, got 0")

    with pytest.raises(ValueError, match=r"micro_batch_size"):  # checked before any process starts
        other_rank({"num_processes": 2, "mixed_precision": "no"}, "tasks.sft", lambda: None, bad_params)


def test_one_process_runs_the_stage_itself(monkeypatch):
    from tasks.kit.launch import other_rank

    monkeypatch.delenv("RANK", raising=False)
    trained = []
    one = {"num_processes": 1, "mixed_precision": "no"}
    assert other_rank(one, "tasks.sft", lambda: trained.append(1), lambda: None) is False
    monkeypatch.setenv("LOCAL_RANK", "1")  # under the launcher, rank 1 trains and stops
    monkeypatch.setenv("RANK", "1")
    two = {"num_processes": 2, "mixed_precision": "no"}
    assert other_rank(two, "tasks.sft", lambda: trained.append(1), lambda: None) is True
    assert trained == [1]


def probe(mode: str, **env: str) -> subprocess.Popen:
    """``python -m launch_probe`` in ``mode`` (tests/launch_probe.py), on two processes, output captured."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)]), "LAUNCH_PROBE": mode, **env}
    env.pop("LOCAL_RANK", None)
    return subprocess.Popen([sys.executable, "-m", "launch_probe"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=HERE, env=env)  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("rank", [0, 1])
def test_a_failing_rank_ends_the_launch_with_its_one_line(rank):
    # rank 1 failing: the launcher then stops rank 0 with SIGTERM, but the status is rank 1's error, not 143
    process = probe(f"rank{rank}")
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 1, output
    assert output.count(f"[launch_probe] error: ValueError: launch_probe: rank {rank} refuses") == 1, output
    assert "Traceback" not in output and "ChildFailedError" not in output, output


@pytest.mark.integration
def test_ranks_do_not_outlive_a_launcher_killed_with_sigkill(tmp_path):
    import signal
    import time

    process = probe("hang", LAUNCH_PROBE_PIDS=str(tmp_path))
    deadline = time.time() + 60
    while len(os.listdir(tmp_path)) < 2 and time.time() < deadline:
        time.sleep(0.2)
    pids = [int((tmp_path / name).read_text()) for name in sorted(os.listdir(tmp_path))]
    assert len(pids) == 2, process.communicate(timeout=10)[0]
    process.send_signal(signal.SIGKILL)  # cannot be forwarded: the kernel kills the ranks (PR_SET_PDEATHSIG)
    process.wait()
    deadline = time.time() + 30
    while any(os.path.exists(f"/proc/{pid}") and "Z" not in state(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}") and "Z" not in state(pid)]


def state(pid: int) -> str:
    """The state letter of process ``pid`` (``Z``: a zombie, gone but not reaped), or ``""`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
