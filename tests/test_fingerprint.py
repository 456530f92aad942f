"""Resume fingerprints hash input contents (not sizes) and say why a stale checkpoint is dropped; file modes."""

import hashlib
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from rlhf.training.checkpoint import Checkpointer, atomic_write_text
from tasks.kit.outputs import load_json
from tasks.kit.resume import MANIFEST, file_sha256, fingerprint_manifest, input_hashes, run_checkpointer


def _model_folder(path, weight: float) -> str:
    """A tiny 'model': one safetensors file (4 float32 weights) and a config; only weight [2] varies."""
    os.makedirs(path, exist_ok=True)
    save_file({"w": torch.tensor([1.0, 2.0, weight, 4.0])}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as handle:
        handle.write('{"hidden_size": 4}\n')
    return str(path)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A project folder with one data file and one model folder; the cwd, so checkpoints/ lands inside it."""
    monkeypatch.chdir(tmp_path)
    with open("prompts.jsonl", "w", encoding="utf-8") as handle:
        handle.write('{"id": 0, "prompt": "hi"}\n')
    _model_folder(tmp_path / "reward", 3.0)
    return tmp_path


def _save_step(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.save(step, {}, {"step": step})


def test_file_sha256_streams_the_content_by_hand(tmp_path):
    path = tmp_path / "abc.txt"
    path.write_bytes(b"abc")
    # FIPS 180-2 test vector: sha256("abc")
    assert file_sha256(str(path)) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_same_sizes_different_weights_give_different_fingerprints(tmp_path):
    a, b = _model_folder(tmp_path / "a", 3.0), _model_folder(tmp_path / "b", 3.5)
    size = os.path.getsize(os.path.join(a, "model.safetensors"))
    assert size == os.path.getsize(os.path.join(b, "model.safetensors"))  # what the old size-only hash saw
    hashes_a, hashes_b = input_hashes(a), input_hashes(b)
    assert hashes_a["config.json"] == hashes_b["config.json"]
    assert hashes_a["model.safetensors"] != hashes_b["model.safetensors"]
    with open(os.path.join(b, "model.safetensors"), "rb") as handle:
        assert hashes_b["model.safetensors"] == hashlib.sha256(handle.read()).hexdigest()
    params = {"lr": 1e-5}
    assert fingerprint_manifest(params, [a])["fingerprint"] != fingerprint_manifest(params, [b])["fingerprint"]
    assert fingerprint_manifest(params, [a])["fingerprint"] == fingerprint_manifest(params, [a])["fingerprint"]
    with pytest.raises(FileNotFoundError, match="missing"):
        fingerprint_manifest(params, [str(tmp_path / "missing")])


def test_same_inputs_resume_and_say_so_in_one_line(workdir, capsys):
    first = run_checkpointer("ppo", {"lr": 0.1}, ["prompts.jsonl", "reward"])
    _save_step(first, 5)
    again = run_checkpointer("ppo", {"lr": 0.1}, ["prompts.jsonl", "reward"])
    assert again.root == first.root and again.latest() == os.path.join(first.root, "step-00000005")
    step = os.path.relpath(again.latest())
    assert capsys.readouterr().out == f"[ppo] resuming from {step} (same params and inputs)\n"
    manifest = load_json(os.path.join(first.root, MANIFEST))
    assert manifest["fingerprint"] == os.path.basename(first.root)
    assert set(manifest["inputs"]) == {"prompts.jsonl", "reward"}


def test_a_retrained_model_of_the_same_shape_starts_fresh_and_says_why(workdir, capsys):
    stale = run_checkpointer("ppo", {"lr": 0.1}, ["prompts.jsonl", "reward"])
    _save_step(stale, 20)
    _model_folder(workdir / "reward", 3.5)  # the reward model is retrained: same shapes, same file sizes
    fresh = run_checkpointer("ppo", {"lr": 0.1}, ["prompts.jsonl", "reward"])
    assert fresh.root != stale.root and fresh.latest() is None
    assert not os.path.exists(stale.root)  # the stale checkpoint folder is removed
    assert capsys.readouterr().out == (
        f"[ppo] stale checkpoint {stale.root} (step-00000020) discarded, starting fresh: "
        "changed since it was written: input reward (model.safetensors)\n"
    )


def test_changed_params_and_data_are_named(workdir, capsys):
    stale = run_checkpointer("sft", {"lr": 0.1, "steps": 10}, ["prompts.jsonl"])
    _save_step(stale, 3)
    with open("prompts.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"id": 1, "prompt": "more"}\n')
    run_checkpointer("sft", {"lr": 0.2, "steps": 10}, ["prompts.jsonl"])
    assert capsys.readouterr().out.endswith(
        "changed since it was written: input prompts.jsonl, param lr (0.1 -> 0.2)\n"
    )


def test_legacy_checkpoint_without_manifest_and_empty_leftovers(workdir, capsys):
    legacy = Checkpointer(os.path.join("checkpoints", "reward", "0123456789abcdef"))  # the old size-based scheme
    _save_step(legacy, 10)
    empty = os.path.join("checkpoints", "reward", "fedcba9876543210")  # killed before its first checkpoint
    os.makedirs(empty)
    fresh = run_checkpointer("reward", {}, ["reward"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line, for the folder that held a checkpoint
    assert "checkpoints/reward/0123456789abcdef (step-00000010) discarded" in out
    assert "no readable manifest" in out
    assert sorted(os.listdir(os.path.join("checkpoints", "reward"))) == [os.path.basename(fresh.root)]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_atomic_write_text_gives_the_usual_file_mode(tmp_path, umask, mode):
    # 0o666 & ~0o022 = 0o644; 0o666 & ~0o027 = 0o640; 0o666 & ~0o002 = 0o664 (mkstemp alone: 0o600)
    previous = os.umask(umask)
    try:
        path = tmp_path / "sub" / "out.json"
        atomic_write_text(str(path), "first\n")
        atomic_write_text(str(path), "second\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert path.read_text(encoding="utf-8") == "second\n"
    assert os.listdir(path.parent) == ["out.json"]  # no temporary file left beside it
