"""The result does not depend on how a batch is split: one pass, micro-batches, or two processes (gloo on CPU).

tests/split_worker.py measures one SFT step, one reward-model step, one sharded rollout and one PPO update
through the product's code; these tests compare what it measures under each split with the whole batch
in one process. Tolerances: gradients, and weights after one SGD step, 1e-6 (fp32; measured up to 1.3e-7);
the rollout buffer (logprobs, values, advantages, returns, scores) and its statistics 1e-5, its sampled
tokens exactly; weights after one AdamW step 1e-4 (measured up to 1.2e-5): Adam's first step is
``lr * g / (|g| + eps)``, which turns a gradient difference of 1e-7 on a gradient near ``eps`` into a
difference of up to ``lr`` (1e-3 here) in the weight.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import split_worker
import torch

from rlhf.device import Runtime
from rlhf.distributed import Ranks, micro_batches
from rlhf.losses import bradley_terry_loss, masked_mean
from rlhf.sampling import PerPromptSampling

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = {"grad": 1e-6, "sgd": 1e-6, "adam": 1e-4, "buffer": 1e-5}


@pytest.fixture(scope="module")
def whole(tiny_dir) -> dict[str, torch.Tensor]:
    """The whole batch in one pass, one process."""
    return split_worker.measure(tiny_dir, None, Runtime())


def assert_same(expected: dict[str, torch.Tensor], measured: dict[str, torch.Tensor]) -> None:
    """Every key of ``expected`` in ``measured``, within its group's tolerance (tokens exactly)."""
    compared = {key for key in expected if not key.startswith("stats/ppo/time/")}  # wall-clock seconds
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


@pytest.mark.integration
def test_two_processes_give_the_whole_batch_result(tiny_dir, whole, tmp_path):
    out = tmp_path / "two.pt"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    result = subprocess.run(
        [*launch, os.path.join(HERE, "split_worker.py"), tiny_dir, str(out), "none"],
        capture_output=True, text=True, timeout=300, cwd=HERE,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    measured = torch.load(out, weights_only=True)
    assert int(measured.pop("world_size")) == 2  # two gloo processes, not one
    assert_same(whole, measured)


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
    from rlhf.losses import target_tokens

    # the first position has no logits predicting it: [T, T, F, T] scores 2 tokens, [F, T, T] scores 2
    assert target_tokens([True, True, False, True]) == 2 and target_tokens([0, 1, 1]) == 2 and target_tokens([]) == 0


def test_a_sharded_launch_done_by_hand_is_refused_too(monkeypatch):
    from rlhf.device import runtime_from_params

    for name in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        monkeypatch.setenv(f"ACCELERATE_USE_{name}", "true")
        with pytest.raises(ValueError, match=f"accelerate launched with {name}: the trainers run data parallel only"):
            runtime_from_params({"mixed_precision": "no", "cpu": True, "frozen_bf16": False})
        monkeypatch.delenv(f"ACCELERATE_USE_{name}")


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
    from rlhf.ppo_config import PPOConfig
    from rlhf.sft import SFTConfig
    from tasks.launch import other_rank

    with pytest.raises(ValueError, match=r"sft.micro_batch_size must be at least 1 or null, got 0"):
        SFTConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match=r"ppo.micro_batch_size must be at least 1 or null, got -1"):
        PPOConfig(micro_batch_size=-1)
    with pytest.raises(FileNotFoundError, match=r"device.accelerate_config infra/none.yaml: no such file"):
        other_rank({"num_processes": 2, "accelerate_config": "infra/none.yaml", "mixed_precision": "no"}, "m", id, id)
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text("distributed_type: FSDP\nnum_processes: 2\n")
    with pytest.raises(ValueError, match=r"distributed_type FSDP is not supported: the trainers run data parallel"):
        other_rank({"num_processes": 2, "accelerate_config": str(fsdp), "mixed_precision": "no"}, "m", None, None)
    for bad in (0, "2", True, 1.5):
        with pytest.raises(ValueError, match=r"device.num_processes must be an integer of at least 1"):
            other_rank({"num_processes": bad, "mixed_precision": "no"}, "tasks.sft", lambda: None, lambda: None)

    def bad_params():
        raise ValueError("sft.micro_batch_size must be at least 1 or null, got 0")

    with pytest.raises(ValueError, match=r"micro_batch_size"):  # checked before any process starts
        other_rank({"num_processes": 2, "mixed_precision": "no"}, "tasks.sft", lambda: None, bad_params)


def test_one_process_runs_the_stage_itself(monkeypatch):
    from tasks.launch import other_rank

    monkeypatch.delenv("RANK", raising=False)
    trained = []
    one = {"num_processes": 1, "mixed_precision": "no"}
    assert other_rank(one, "tasks.sft", lambda: trained.append(1), lambda: None) is False
    monkeypatch.setenv("LOCAL_RANK", "1")  # under the launcher, rank 1 trains and stops
    monkeypatch.setenv("RANK", "1")
    two = {"num_processes": 2, "mixed_precision": "no"}
    assert other_rank(two, "tasks.sft", lambda: trained.append(1), lambda: None) is True
    assert trained == [1]


@pytest.mark.integration
def test_a_failing_rank_ends_the_launch_with_its_one_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run([sys.executable, "-m", "launch_probe"], capture_output=True, text=True, timeout=120,
                            cwd=HERE, env=env)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count("[launch_probe] error: ValueError: launch_probe: rank 0 refuses") == 1, output
    assert "Traceback" not in output and "ChildFailedError" not in output, output
