"""Checkpoints and the shared supervised loop: atomic writes and exact resume (SFT and reward model)."""

import pytest
import torch
from conftest import Killed

from rlhf.models.loading import load_causal_lm, load_scalar_model
from rlhf.reward.trainer import JudgeConfig, RewardConfig, train_reward_model
from rlhf.runtime.device import Runtime
from rlhf.training.checkpoint import Checkpointer
from rlhf.training.sft import SFTConfig, rows_of_sources, train_sft
from rlhf.training.supervised import interleave, minibatch_indices

EXAMPLES = [
    {
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "chosen": [{"role": "assistant", "content": f"good answer {i}"}],
        "rejected": [{"role": "assistant", "content": f"bad {i}"}],
    }
    for i in range(6)
]


def test_minibatch_indices_cover_each_epoch_once():
    first_epoch = [i for step in range(3) for i in minibatch_indices(step, 5, 2, seed=7)]
    assert sorted(first_epoch) == [0, 1, 2, 3, 4]
    assert minibatch_indices(1, 5, 2, seed=7) == minibatch_indices(1, 5, 2, seed=7)


def test_length_grouped_minibatches_cover_each_epoch_once_with_less_padding():
    # 64 examples of lengths 1..64, batches of 4: padded tokens = batch size x the longest in each batch
    lengths = [(7 * i) % 64 + 1 for i in range(64)]
    steps = 16  # one epoch

    def padded(grouping):
        batches = [minibatch_indices(step, 64, 4, seed=3, lengths=grouping) for step in range(steps)]
        assert sorted(i for batch in batches for i in batch) == list(range(64))  # every example once
        return sum(4 * max(lengths[i] for i in batch) for batch in batches)

    # seed 3: 3440 padded tokens shuffled, 2452 grouped (sorted within 4 mega-batches of 16; 2080 are real)
    assert padded(None) == 3440 and padded(lengths) == 2452
    assert minibatch_indices(5, 64, 4, 3, lengths) == minibatch_indices(5, 64, 4, 3, lengths)  # resumable
    assert minibatch_indices(16, 64, 4, 3, lengths) != minibatch_indices(0, 64, 4, 3, lengths)  # a new epoch
    with pytest.raises(ValueError, match="3 lengths for 64 examples"):
        minibatch_indices(0, 64, 4, 3, [1, 2, 3])


def test_interleave_spreads_each_list_in_proportion_to_its_size():
    # by hand: keys (j + 1/2) / m; a: 1/6, 1/2, 5/6; b: 1/2 (tie with a's 1/2: the earlier list first)
    assert interleave([["a0", "a1", "a2"], ["b0"]]) == ["a0", "a1", "b0", "a2"]
    # 1/8, 3/8, 5/8, 7/8 against 1/4, 3/4
    assert interleave([[0, 1, 2, 3], [10, 11]]) == [0, 10, 1, 2, 11, 3]
    assert interleave([[5, 3, 4]]) == [5, 3, 4]


def test_stratified_minibatches_hold_each_kind_in_proportion_and_cover_each_epoch_once():
    # 96 examples, a quarter of one kind and all of them the shortest: length grouping alone puts them together
    strata = ["harmless" if i % 4 == 0 else "helpful" for i in range(96)]
    lengths = [1 if kind == "harmless" else 100 + i for i, kind in enumerate(strata)]
    grouped = [minibatch_indices(step, 96, 4, 0, lengths) for step in range(24)]
    assert max(sum(strata[i] == "harmless" for i in batch) for batch in grouped) == 4  # batches of harmless only
    for grouping in (None, lengths):
        batches = [minibatch_indices(step, 96, 4, 0, grouping, strata) for step in range(24)]
        assert sorted(i for batch in batches for i in batch) == list(range(96))  # every example once
        assert [sum(strata[i] == "harmless" for i in batch) for batch in batches] == [1] * 24
    assert minibatch_indices(30, 96, 4, 0, lengths, strata) == minibatch_indices(30, 96, 4, 0, lengths, strata)
    with pytest.raises(ValueError, match="3 strata for 96 examples"):
        minibatch_indices(0, 96, 4, 0, None, ["a", "b", "c"])


def test_crash_while_writing_keeps_previous_checkpoint(tiny_dir, tmp_path, monkeypatch):
    model = load_causal_lm(tiny_dir)
    checkpointer = Checkpointer(str(tmp_path))
    first = checkpointer.save(1, {"model": model}, {"step": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        checkpointer.save(2, {"model": model}, {"step": 2})
    monkeypatch.undo()
    assert checkpointer.latest() == first
    assert checkpointer.load_state(first) == {"step": 1}


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_supervised_training_resumes_exactly(tiny_dir, tokenizer, tmp_path, kind):
    def run(root, logged, kill_at=None):
        def log(metrics, step):
            if step == kill_at:
                raise Killed
            logged[step] = metrics

        torch.manual_seed(0)
        if kind == "sft":
            model, config, train = (
                load_causal_lm(tiny_dir),
                SFTConfig(steps=5, batch_size=2, checkpoint_every=1, lr=1e-3),
                train_sft,
            )
        else:
            model, config, train = (
                load_scalar_model(tiny_dir),
                RewardConfig(steps=5, batch_size=2, checkpoint_every=1, lr=1e-3),
                train_reward_model,
            )
        train(model, tokenizer, EXAMPLES, config, log, Runtime(), Checkpointer(str(root)), progress=False)
        return model

    full_log, resumed_log = {}, {}
    full = run(tmp_path / "full", full_log)
    with pytest.raises(Killed):
        run(tmp_path / "resumed", resumed_log, kill_at=4)
    resumed = run(tmp_path / "resumed", resumed_log)
    assert sorted(resumed_log) == sorted(full_log) == [1, 2, 3, 4, 5]
    for step in full_log:
        assert resumed_log[step]["sft/loss" if kind == "sft" else "rm/loss"] == pytest.approx(
            full_log[step]["sft/loss" if kind == "sft" else "rm/loss"], abs=1e-6
        )
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_rows_of_sources_keeps_the_named_sources_rows_in_order_and_names_a_source_without_rows():
    rows = [{"id": i, "source": name} for i, name in enumerate(["a", "b", "a", "c"])]
    assert rows_of_sources(rows, None, "f.jsonl") is rows
    assert [row["id"] for row in rows_of_sources(rows, ("c", "a"), "f.jsonl")] == [0, 2, 3]
    with pytest.raises(ValueError, match=r"^f.jsonl: sft.sources names \['d'\], which have no row here; its "):
        rows_of_sources(rows, ("a", "d"), "f.jsonl")


def test_sft_sources_must_name_sources_and_needs_sft_steps():
    assert SFTConfig(steps=2, sources=["a", "b"]).sources == ("a", "b")
    for bad in ("helpful-base", [], [1]):
        with pytest.raises(ValueError, match="sft.sources must be null or a non-empty list of source names"):
            SFTConfig(steps=2, sources=bad)
    with pytest.raises(ValueError, match=r"sft.sources is \['a'\] but sft.steps is 0 \(no SFT\)"):
        SFTConfig(steps=0, sources=["a"])


def test_config_from_params_reads_yaml_exponents_and_rejects_unknown_keys():
    from tasks.kit.configs import config_from_params

    config = config_from_params(SFTConfig, {"lr": "3e-5", "steps": 2}, "sft")
    assert config.lr == 3e-5 and config.steps == 2
    with pytest.raises(ValueError, match="sft.lr must be a number"):
        config_from_params(SFTConfig, {"lr": "fast"}, "sft")
    with pytest.raises(ValueError, match="unknown keys \\['stepz'\\]"):
        config_from_params(SFTConfig, {"stepz": 2}, "sft")
    with pytest.raises(ValueError, match="sft.steps must be an integer, got 'ten'"):
        config_from_params(SFTConfig, {"steps": "ten"}, "sft")
    with pytest.raises(ValueError, match="sft.lr must be a number, got True"):
        config_from_params(SFTConfig, {"lr": True}, "sft")
    with pytest.raises(ValueError, match="sft.steps must be set"):
        config_from_params(SFTConfig, {"steps": None}, "sft")
    assert config_from_params(SFTConfig, {"trainable_layers": None}, "sft").trainable_layers is None


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (SFTConfig, {"steps": -1}, r"^sft.steps must be at least 0, got -1$"),  # 0: no SFT
        (RewardConfig, {"steps": 0}, r"^reward.steps must be at least 1, got 0$"),
        (SFTConfig, {"lr": -1e-5}, r"^sft.lr must be at least 0, got -1e-05$"),
        (RewardConfig, {"batch_size": 0}, r"^reward.batch_size must be at least 1, got 0$"),
        (RewardConfig, {"max_grad_norm": 0.0}, r"^reward.max_grad_norm must be above 0, got 0.0$"),
        (
            RewardConfig,
            {"warmup_steps": -2, "scheduler": "linear"},
            r"^reward.warmup_steps must be at least 0, got -2$",
        ),
        (RewardConfig, {"checkpoint_every": -1}, r"^reward.checkpoint_every must be at least 0, got -1$"),
        (SFTConfig, {"max_length": 0}, r"^sft.max_length must be at least 1, got 0$"),
        (RewardConfig, {"lm_coef": -1.0}, r"^reward.lm_coef must be at least 0, got -1.0$"),
        (RewardConfig, {"length_decorrelation": -0.5}, r"^reward.length_decorrelation must be at least 0, got -0.5$"),
        (JudgeConfig, {"center_max_examples": 0}, r"^judge.center_max_examples must be at least 1, got 0$"),
    ],
)
def test_supervised_configs_refuse_counts_and_rates_outside_their_domain(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs)
    assert config(max_grad_norm=None, trainable_layers=None).max_grad_norm is None  # null switches a feature off
