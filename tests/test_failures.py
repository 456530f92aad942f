"""Failures end cleanly.

Divergence stops every trainer at its first non-finite loss, gradient norm, rollout or weight, with one line
naming the stage and step, and the NaN stays visible in MLflow; a failed or stopped stage leaves its previous
outputs exactly as they were and ends its MLflow run and the pipeline's as FAILED or KILLED; a run left RUNNING
by a process that is gone is closed by the next one, and never a run whose process is alive.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest
import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tasks/ (pytest without -m)

import rlhf.ppo.loop as ppo_module
import rlhf.ppo.update as update_module
import rlhf.runtime.finite as finite_module
from rlhf.data.chat import encode_prompt
from rlhf.models.generation import GenerationSettings
from rlhf.models.loading import load_causal_lm, load_scalar_model
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.loop import train_ppo
from rlhf.ppo.types import PPOModels
from rlhf.reward.trainer import RewardConfig, train_reward_model
from rlhf.runtime.device import Runtime
from rlhf.runtime.finite import non_finite_weights
from rlhf.training.checkpoint import Checkpointer
from rlhf.training.sft import SFTConfig, train_sft
from rlhf.training.supervised import LoopConfig, supervised_loop
from tasks.kit.outputs import StagedOutputs
from tasks.kit.runs import BOOT_TAG, HOST_TAG, PID_TAG, START_TAG, StageRun, Stopped, owner_gone, owner_tags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_PID = 4194305  # one above the largest pid Linux can hand out (pid_max <= 2**22)
NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------------------
# the guard in the supervised loop, on a one-weight model whose values can be worked out by hand:
# loss = w (gradient 1), so AdamW (m_hat = v_hat = 1) moves w by exactly -lr on every step it takes


class Scalar(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))


def toy_loop(plan: dict[int, str], lr: float = 0.1, steps: int = 5, scheduler: str = "constant", scaler_step=None):
    """Run ``supervised_loop`` on :class:`Scalar`; ``plan[step]`` is "nan" (a NaN loss) or "inf_grad"
    (the finite loss w with an infinite gradient: d sqrt(x)/dx at 0). Returns (model, logged, summary or error)."""
    model, logged, calls = Scalar(), {}, []

    def step_fn(part, batch):
        calls.append(part)
        w, kind = model.w, plan.get(len(calls))
        if kind == "nan":
            return w * NAN, {}
        if kind == "inf_grad":
            return torch.sqrt(w - w.detach()) + w.detach(), {}
        return w * 1.0, {}

    def log(metrics, step):
        logged[step] = dict(metrics)

    try:
        config = LoopConfig(
            steps=steps,
            batch_size=1,
            lr=lr,
            warmup_steps=0,
            scheduler=scheduler,
            max_grad_norm=1.0,
            checkpoint_every=0,
            group_by_length=False,  # a toy of no lengths
        )
        summary = supervised_loop(
            model,
            step_fn,
            5,
            config,
            prefix="toy",
            log=log,
            runtime=Runtime(),
            progress=False,
            scaler_step=scaler_step,
        )
    except FloatingPointError as err:
        return model, logged, err
    return model, logged, summary


def test_a_nan_loss_stops_the_loop_before_its_step_and_is_logged():
    model, logged, err = toy_loop({3: "nan"})
    assert str(err) == "toy: non-finite toy/loss (nan) at step 3 of 5; training stopped"
    assert sorted(logged) == [1, 2, 3]
    assert math.isnan(logged[3]["toy/loss"]) and math.isnan(logged[3]["toy/grad_norm"])
    assert model.w.item() == pytest.approx(0.8, abs=1e-6)  # 1 - 0.1 - 0.1: the third step was not taken


def test_an_infinite_gradient_norm_stops_the_loop_before_its_step_and_is_logged():
    model, logged, err = toy_loop({2: "inf_grad"})
    assert str(err) == "toy: non-finite toy/grad_norm (inf) at step 2 of 5; training stopped"
    assert logged[2]["toy/loss"] == pytest.approx(0.9, abs=1e-6) and logged[2]["toy/grad_norm"] == INF
    assert model.w.item() == pytest.approx(0.9, abs=1e-6)


def fake_scaler_step(optimizer) -> bool:
    """What a loss scaler does (torch.amp.GradScaler.step): skip the step when a gradient is not finite."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        return True
    optimizer.step()
    return False


def test_steps_a_loss_scaler_skips_are_counted_and_the_schedule_waits():
    # linear decay from 0.1 over 5 steps; steps 2 and 4 overflow and are skipped, so the schedule steps 3 times:
    # w = 1 - 0.1 - 0.08 - 0.06 = 0.76, and the lr after each step is 0.08, 0.08, 0.06, 0.06, 0.04
    model, logged, summary = toy_loop({2: "inf_grad", 4: "inf_grad"}, scheduler="linear", scaler_step=fake_scaler_step)
    assert summary["toy/skipped_steps"] == 2.0
    assert model.w.item() == pytest.approx(0.76, abs=1e-6)
    assert [logged[s]["toy/lr"] for s in range(1, 6)] == pytest.approx([0.08, 0.08, 0.06, 0.06, 0.04])
    assert [logged[s]["toy/skipped_steps"] for s in range(1, 6)] == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert logged[2]["toy/grad_norm"] == INF  # the skipped step's norm stays visible


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({2: "inf_grad"}, "toy: non-finite toy/grad_norm (inf) at step 2 of 5; training stopped"),
        ({1: "nan"}, "toy: non-finite toy/loss (nan) at step 1 of 5; training stopped"),
    ],
)
def test_with_a_scaler_an_unskipped_overflow_or_a_nan_loss_still_stops(plan, message):
    _, _, err = toy_loop(plan, scaler_step=lambda optimizer: (optimizer.step(), False)[1])  # it never skips
    assert str(err) == message


def test_weights_an_update_overflowed_are_never_returned():
    # every loss and gradient norm is finite, but an infinite learning rate sends w to -inf (or NaN)
    _, _, err = toy_loop({}, lr=INF, steps=1)
    assert str(err) == "toy: non-finite weights after step 1 of 1 (1 tensors, first w); training stopped"


# ---------------------------------------------------------------------------------------------------------
# real trainers on the tiny model

ROWS = [
    {
        "id": f"r{i}",
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "chosen": [{"role": "assistant", "content": f"good answer {i}"}],
        "rejected": [{"role": "assistant", "content": f"bad {i}"}],
    }
    for i in range(6)
]


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_a_huge_learning_rate_stops_sft_and_reward_training_at_the_first_non_finite_value(tiny_dir, tokenizer, kind):
    torch.manual_seed(0)
    logged = {}
    if kind == "sft":
        model, train, config = load_causal_lm(tiny_dir), train_sft, SFTConfig
    else:
        model, train, config = load_scalar_model(tiny_dir), train_reward_model, RewardConfig
    # 1e20: the first update takes weights to ~1e20, whose squares overflow float32 in the next forward on any
    # CPU (at 1e8 an AMX Xeon's SFT saturated its softmax: zero gradients, a finite loss, nothing to stop)
    config = config(steps=6, batch_size=2, lr=1e20, warmup_steps=0, scheduler="constant", checkpoint_every=0)
    with pytest.raises(FloatingPointError) as caught:
        train(model, tokenizer, ROWS, config, lambda m, s: logged.update({s: m}), Runtime(), None, progress=False)
    prefix = "sft" if kind == "sft" else "rm"
    match = re.fullmatch(
        rf"{prefix}: non-finite {prefix}/(loss|grad_norm) \((nan|inf|-inf)\) at step (\d) of 6; training stopped",
        str(caught.value),
    )
    assert match, str(caught.value)
    step = int(match.group(3))
    assert sorted(logged) == list(range(1, step + 1))  # it stopped at the first: every earlier step was finite
    assert not math.isfinite(logged[step][f"{prefix}/{match.group(1)}"])
    assert all(math.isfinite(v) for s in range(1, step) for v in logged[s].values())
    assert non_finite_weights(model) == []  # the non-finite gradients never reached the weights


def test_loading_a_model_with_non_finite_weights_is_refused_naming_the_folder(tiny_dir, tmp_path):
    model = load_causal_lm(tiny_dir)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = NAN
    bad = str(tmp_path / "bad")
    model.save_pretrained(bad)
    expected = f"{bad}: model weights are not finite (NaN or inf in model.layers.1.mlp.down_proj.weight); refusing"
    for load in (load_causal_lm, load_scalar_model):
        with pytest.raises(ValueError) as caught:
            load(bad)
        assert str(caught.value).startswith(expected), str(caught.value)
    scalar = load_scalar_model(tiny_dir)
    scalar.config.reward_offset = INF  # a reward model centred on non-finite scores
    scalar.save_pretrained(tmp_path / "offset")
    with pytest.raises(ValueError, match=r"NaN or inf in config\.reward_offset\)"):
        load_scalar_model(str(tmp_path / "offset"))


PROMPTS = [[{"role": "user", "content": t}] for t in ["Hi", "How are you?", "Tell me a joke", "What is 2+2?"]]
SETTINGS = GenerationSettings(max_new_tokens=4, temperature=0.7, no_eos="score", no_eos_value=None)


def ppo_run(tiny_dir, tokenizer, root, scaler_step=None, **overrides):
    """PPO iterations (2) on the tiny model: 4 rollouts, minibatches of 2, one epoch (2 policy + 2 value steps each)."""
    torch.manual_seed(0)
    models = PPOModels(
        load_causal_lm(tiny_dir), load_causal_lm(tiny_dir), load_scalar_model(tiny_dir), load_scalar_model(tiny_dir)
    )
    values = {
        "iterations": 2,
        "value_pretrain_iterations": 0,
        "rollout_batch_size": 4,
        "minibatch_size": 2,
        "ppo_epochs": 1,
        "validate_every": 0,
        "validation_prompts": None,
        "collapse_reward_skew": None,
        "collapse_truncated_share": None,
        "checkpoint_every": 0,
        "ptx_coef": 0.0,
        **overrides,
    }
    prompts = [encode_prompt(tokenizer, p, 24) for p in PROMPTS]
    logged = {}
    result = None
    try:
        result = train_ppo(
            models,
            tokenizer,
            prompts,
            [],
            [],
            PPOConfig(**values),
            SETTINGS,
            lambda m, s: logged.update({s: m}),
            Checkpointer(str(root)),
            Runtime(),
            False,
            scaler_step=scaler_step,
        )
    except FloatingPointError as err:
        return models, logged, err
    return models, logged, result


@pytest.mark.parametrize("key", ["policy_lr", "value_lr"])
def test_a_huge_learning_rate_stops_ppo_at_the_first_non_finite_value(tiny_dir, tokenizer, tmp_path, key):
    models, logged, err = ppo_run(tiny_dir, tokenizer, tmp_path, iterations=1, **{key: 1e8})
    model = "policy" if key == "policy_lr" else "value"
    assert re.fullmatch(
        rf"ppo: non-finite ppo/(loss/{model}|{model}/grad_norm) \((nan|inf)\) at iteration 1, PPO epoch 1, "
        r"minibatch 2; training stopped",
        str(err),
    ), str(err)
    assert non_finite_weights(models.policy) == non_finite_weights(models.value_model) == []


def test_ppo_stops_at_a_non_finite_value_loss_and_logs_that_iteration(tiny_dir, tokenizer, tmp_path, monkeypatch):
    real, calls = update_module.value_predictions, []

    def values(*args, **kwargs):
        calls.append(1)
        out = real(*args, **kwargs)
        return out * NAN if len(calls) == 2 else out  # the second value step of iteration 1

    monkeypatch.setattr(update_module, "value_predictions", values)
    _, logged, err = ppo_run(tiny_dir, tokenizer, tmp_path, iterations=1)
    assert str(err) == "ppo: non-finite ppo/loss/value (nan) at iteration 1, PPO epoch 1, minibatch 2; training stopped"
    assert math.isnan(logged[1]["ppo/loss/value"])
    assert "ppo/reward/mean" in logged[1] and "ppo/loss/policy" in logged[1]  # the rollout's and the step's figures


def test_ppo_stops_at_an_infinite_policy_gradient_norm_before_the_step(tiny_dir, tokenizer, tmp_path, monkeypatch):
    real = finite_module.clip_gradients
    policies = []

    def clip(model, max_norm):
        norm = real(model, max_norm)
        return INF if model is policies[0] else norm

    original = load_causal_lm(tiny_dir).state_dict()
    monkeypatch.setattr(finite_module, "clip_gradients", clip)
    monkeypatch.setattr(ppo_module, "make_optimisers", spy(ppo_module.make_optimisers, policies))
    models, logged, err = ppo_run(tiny_dir, tokenizer, tmp_path, iterations=1)
    assert str(err) == (
        "ppo: non-finite ppo/policy/grad_norm (inf) at iteration 1, PPO epoch 1, minibatch 1; training stopped"
    )
    assert logged[1]["ppo/policy/grad_norm"] == INF
    for name, tensor in models.policy.state_dict().items():
        assert torch.equal(tensor, original[name]), name  # no policy step was taken


def spy(make_optimisers, policies, value_models=None):
    """``make_optimisers`` that remembers the models it was given."""

    def wrapped(policy, value_model, *args, **kwargs):
        policies.append(policy)
        (value_models if value_models is not None else []).append(value_model)
        return make_optimisers(policy, value_model, *args, **kwargs)

    return wrapped


def test_ppo_stops_at_a_non_finite_rollout(tiny_dir, tokenizer, tmp_path, monkeypatch):
    real, calls = ppo_module.make_experience, []

    def make_experience(*args, **kwargs):
        calls.append(1)
        experience, stats = real(*args, **kwargs)
        if len(calls) == 2:
            experience.raw_scores[1] = NAN
        return experience, stats

    monkeypatch.setattr(ppo_module, "make_experience", make_experience)
    _, logged, err = ppo_run(tiny_dir, tokenizer, tmp_path)
    assert str(err) == "ppo: non-finite rollout at iteration 2: raw_scores (1 of 4 non-finite); training stopped"
    assert sorted(logged) == [0, 1, 2] and "ppo/reward/mean" in logged[2]


def test_ppo_counts_the_value_steps_a_loss_scaler_skips(tiny_dir, tokenizer, tmp_path, monkeypatch):
    value_models = []

    def scaler_step(optimizer):  # a fake scaler that skips every step of the value model
        if any(optimizer.param_groups[0]["params"][0] is p for p in value_models[0].parameters()):
            return True
        optimizer.step()
        return False

    monkeypatch.setattr(ppo_module, "make_optimisers", spy(ppo_module.make_optimisers, [], value_models))
    start = load_scalar_model(tiny_dir).state_dict()
    _, _, result = ppo_run(tiny_dir, tokenizer, tmp_path, scaler_step=scaler_step, iterations=1)
    assert result.summary["ppo/value/skipped_steps"] == 2.0  # 1 iteration x 2 minibatches
    assert result.summary["ppo/policy/skipped_steps"] == 0.0
    trained = value_models[0].state_dict()
    assert all(torch.equal(trained[name], start[name]) for name in start if name != "score.weight")


# ---------------------------------------------------------------------------------------------------------
# outputs written together, at the end


def read(path: str, mode: str = "r"):
    with open(path, mode) as handle:
        return handle.read()


def tree(path: str) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of the file), by relative name."""
    if os.path.isfile(path):
        return {"": hashlib.sha256(read(path, "rb")).hexdigest()}
    files = [os.path.relpath(os.path.join(root, n), path) for root, _, names in os.walk(path) for n in names]
    return {name: hashlib.sha256(read(os.path.join(path, name), "rb")).hexdigest() for name in files}


def previous_outputs(root) -> tuple[list[str], dict]:
    model, report, metrics = str(root / "models" / "m"), str(root / "reports" / "r"), str(root / "metrics" / "m.json")
    os.makedirs(model)
    os.makedirs(report)
    os.makedirs(os.path.dirname(metrics))
    for path, text in ((f"{model}/w", "old weights"), (f"{report}/p.png", "old plot"), (metrics, '{"old": 1}')):
        with open(path, "w") as handle:
            handle.write(text)
    paths = [model, report, metrics]
    return paths, {p: tree(p) for p in paths}


def stage_new(outputs: StagedOutputs, paths: list[str]) -> None:
    model, report, metrics = paths
    with open(os.path.join(outputs.folder(model), "w"), "w") as handle:
        handle.write("new weights")
    with open(os.path.join(outputs.folder(report), "p.png"), "w") as handle:
        handle.write("new plot")
    with open(outputs.file(metrics), "w") as handle:
        handle.write('{"new": 1}')


def leftovers(root) -> list[str]:
    """Staging folders left under ``root``."""
    names = [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files]
    return [n for n in names if ".tmp-" in os.path.basename(n) or ".old-" in os.path.basename(n)]


def contents(paths: list[str]) -> list[str]:
    return [read(p) for p in (f"{paths[0]}/w", f"{paths[1]}/p.png", paths[2])]


def test_staged_outputs_replace_every_output_together(tmp_path):
    paths, _ = previous_outputs(tmp_path)
    cleared = []
    with StagedOutputs() as outputs:
        stage_new(outputs, paths)
        outputs.on_commit(lambda: cleared.append(True))
        assert read(f"{paths[0]}/w") == "old weights"  # nothing moves before the end
    assert contents(paths) == ["new weights", "new plot", '{"new": 1}']
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(paths[0]).st_mode & 0o777 == 0o777 & ~umask
    assert cleared == [True] and leftovers(tmp_path) == []


def test_a_failure_before_the_end_leaves_every_previous_output(tmp_path):
    paths, before = previous_outputs(tmp_path)
    cleared = []
    with pytest.raises(ValueError, match="plotting failed"), StagedOutputs() as outputs:
        stage_new(outputs, paths)
        outputs.on_commit(lambda: cleared.append(True))
        raise ValueError("plotting failed")
    assert {p: tree(p) for p in paths} == before and cleared == [] and leftovers(tmp_path) == []


def test_a_rename_failing_halfway_puts_every_previous_output_back(tmp_path, monkeypatch):
    import tasks.kit.outputs as outputs_module

    paths, before = previous_outputs(tmp_path)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if dst == paths[1] and ".tmp-" in src:  # the second new output cannot be moved in
            raise OSError("disk trouble")
        real(src, dst)

    monkeypatch.setattr(outputs_module.os, "replace", replace)
    with pytest.raises(OSError, match="disk trouble"), StagedOutputs() as outputs:
        stage_new(outputs, paths)
    monkeypatch.undo()
    assert {p: tree(p) for p in paths} == before and leftovers(tmp_path) == []


def test_a_stop_signal_during_the_renames_waits_until_all_are_done(tmp_path, monkeypatch):
    import tasks.kit.outputs as outputs_module

    paths, _ = previous_outputs(tmp_path)
    real = os.replace

    def replace(src, dst):
        if dst == paths[0] and ".tmp-" in src:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first output is moved in
        real(src, dst)

    def stop(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        monkeypatch.setattr(outputs_module.os, "replace", replace)
        with pytest.raises(Stopped), StagedOutputs() as outputs:
            stage_new(outputs, paths)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert contents(paths) == ["new weights", "new plot", '{"new": 1}']
    assert leftovers(tmp_path) == []


def test_an_unwritten_output_or_a_dead_process_leftover(tmp_path):
    paths, before = previous_outputs(tmp_path)
    with pytest.raises(RuntimeError, match="never written"), StagedOutputs() as outputs:
        outputs.folder(paths[0])
        outputs.file(paths[2])  # never written
    assert {p: tree(p) for p in paths} == before and leftovers(tmp_path) == []
    host = socket.gethostname()
    dead = tmp_path / "models" / f".m.tmp-{host}-{NO_PID}-abcd1234"
    alive = tmp_path / "models" / f".m.tmp-{host}-{os.getpid()}-abcd1234"
    elsewhere = tmp_path / "models" / f".m.tmp-elsewhere-{NO_PID}-abcd1234"
    for folder in (dead, alive, elsewhere):
        folder.mkdir()
    outputs = StagedOutputs()
    outputs.folder(paths[0])
    outputs.discard()
    assert not dead.exists() and alive.exists() and elsewhere.exists()


# ---------------------------------------------------------------------------------------------------------
# who owns a run


def test_owner_gone_only_when_the_process_surely_is():
    mine = owner_tags()
    assert mine[PID_TAG] == str(os.getpid()) and mine[HOST_TAG] == socket.gethostname() and mine[START_TAG]
    assert not owner_gone(mine)
    assert owner_gone({**mine, PID_TAG: str(NO_PID)})  # no such process
    assert owner_gone({**mine, START_TAG: str(int(mine[START_TAG]) + 1)})  # the pid now names another process
    assert owner_gone({**mine, BOOT_TAG: "another-boot"}) == bool(mine[BOOT_TAG])  # rebooted since
    assert not owner_gone({**mine, PID_TAG: str(NO_PID), HOST_TAG: "elsewhere"})  # cannot tell: left alone
    assert not owner_gone({})
    child = subprocess.Popen(["true"])
    try:
        deadline = time.time() + 10
        while read(f"/proc/{child.pid}/stat").rsplit(")", 1)[1].split()[0] != "Z" and time.time() < deadline:
            time.sleep(0.01)
        assert owner_gone({**mine, PID_TAG: str(child.pid), START_TAG: ""})  # exited, not yet reaped
    finally:
        child.wait()


# ---------------------------------------------------------------------------------------------------------
# MLflow runs (a real sqlite store)


@pytest.fixture(scope="module")
def store(tmp_path_factory, empty_db):
    folder = tmp_path_factory.mktemp("store")
    (folder / "params.yaml").write_text("profile: tiny\nmlflow: {experiment: failures}\n")
    shutil.copy(empty_db, folder / "mlflow.db")
    return folder


def use_store(monkeypatch, folder, pipeline: str):
    monkeypatch.chdir(folder)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{folder}/mlflow.db")
    monkeypatch.setenv("RLHF_PIPELINE_RUN_ID", pipeline)
    import mlflow

    return mlflow.MlflowClient()


def status(client, run_id: str) -> str:
    return client.get_run(run_id).info.status


@pytest.mark.integration
def test_stage_and_pipeline_runs_end_as_the_stage_ends(store, monkeypatch):
    client = use_store(monkeypatch, store, "statuses")
    handler = signal.getsignal(signal.SIGTERM)
    with StageRun("a", {}) as a:
        assert status(client, a.parent_id) == "RUNNING"
    assert (status(client, a.run.info.run_id), status(client, a.parent_id)) == ("FINISHED", "FINISHED")
    with pytest.raises(RuntimeError), StageRun("b", {}) as b:
        assert status(client, b.parent_id) == "RUNNING"  # reopened by a later stage of the same pipeline
        raise RuntimeError("bug")
    assert (status(client, b.run.info.run_id), status(client, b.parent_id)) == ("FAILED", "FAILED")
    with pytest.raises(Stopped, match="stopped by SIGTERM"), StageRun("c", {}) as c:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the main thread handles it between two bytecodes
            time.sleep(0.1)
    assert (status(client, c.run.info.run_id), status(client, c.parent_id)) == ("KILLED", "KILLED")
    assert signal.getsignal(signal.SIGTERM) == handler and a.parent_id == b.parent_id == c.parent_id
    # a FINISHED stage leaves the parent RUNNING while another stage of the pipeline still runs
    other = client.create_run(
        a.run.info.experiment_id, tags={"rlhf.kind": "stage", "mlflow.parentRunId": a.parent_id, **owner_tags()}
    )
    with StageRun("d", {}):
        pass
    assert status(client, a.parent_id) == "RUNNING"
    client.set_terminated(other.info.run_id)


@pytest.mark.integration
def test_a_stage_whose_adopted_parent_goes_starts_under_the_oldest(store, monkeypatch):
    # stages starting together: the parent one adopted is deleted by its creator, who saw an older one (then
    # start_run refuses it), or an older parent shows up just after the stage started (the run moves to it)
    client = use_store(monkeypatch, store, "adopt")
    with StageRun("first", {}) as first:
        oldest = first.parent_id
    eid = first.run.info.experiment_id
    later = {"rlhf.kind": "pipeline", "rlhf.pipeline_run_id": "adopt"}
    adopt = StageRun._adopt_parent

    def gone_at_once(self, client_, pipeline):
        monkeypatch.setattr(StageRun, "_adopt_parent", adopt)
        doomed = client.create_run(eid, tags=later).info.run_id
        client.delete_run(doomed)
        return doomed

    monkeypatch.setattr(StageRun, "_adopt_parent", gone_at_once)
    with StageRun("second", {}) as second:
        pass
    younger = client.create_run(eid, tags=later).info.run_id
    monkeypatch.setattr(StageRun, "_adopt_parent", lambda self, client_, pipeline: younger)
    with StageRun("third", {}) as third:
        pass
    tags = [client.get_run(s.run.info.run_id).data.tags["mlflow.parentRunId"] for s in (second, third)]
    assert tags == [oldest, oldest] and second.parent_id == third.parent_id == oldest


@pytest.mark.integration
def test_non_finite_metrics_stay_visible(store, monkeypatch):
    client = use_store(monkeypatch, store, "log")
    with StageRun("log", {}) as stage:
        stage.log({"x/nan": NAN, "x/inf": INF, "x/ninf": -INF, "x/ok": 2}, 3)
    run = client.get_run(stage.run.info.run_id)
    history = {k: client.get_metric_history(run.info.run_id, k)[0] for k in ("x/nan", "x/inf", "x/ninf", "x/ok")}
    assert [h.step for h in history.values()] == [3, 3, 3, 3]
    assert all(math.isnan(history[k].value) for k in ("x/nan", "x/inf", "x/ninf")) and history["x/ok"].value == 2.0
    tags = run.data.tags
    assert tags["rlhf.non_finite.x/inf"] == "inf at step 3" and tags["rlhf.non_finite.x/ninf"] == "-inf at step 3"
    assert tags["rlhf.non_finite.x/nan"] == "nan at step 3" and "rlhf.non_finite.x/ok" not in tags


@pytest.mark.integration
def test_a_run_left_running_by_a_process_that_is_gone_is_closed_as_killed(store, monkeypatch):
    client = use_store(monkeypatch, store, "stale-next")
    experiment = client.get_experiment_by_name("failures") or client.get_experiment(
        client.create_experiment("failures")
    )
    eid = experiment.experiment_id
    pipeline = client.create_run(eid, tags={"rlhf.kind": "pipeline", "rlhf.pipeline_run_id": "stale-old"})
    mine = owner_tags()

    def stage(**tags):
        parent = {"mlflow.parentRunId": pipeline.info.run_id}
        return client.create_run(eid, tags={"rlhf.kind": "stage", **parent, **mine, **tags}).info.run_id

    killed = stage(**{PID_TAG: str(NO_PID)})  # SIGKILLed: its process is gone
    alive = stage()  # this very process: alive beside the next run
    elsewhere = stage(**{PID_TAG: str(NO_PID), HOST_TAG: "elsewhere"})  # another host: nothing here can tell
    with StageRun("next", {}):
        assert status(client, killed) == "KILLED"
    assert status(client, alive) == "RUNNING" and status(client, elsewhere) == "RUNNING"
    assert status(client, pipeline.info.run_id) == "RUNNING"  # two of its stages may still run
    client.set_terminated(alive)
    client.set_terminated(elsewhere)
    stage(**{PID_TAG: str(NO_PID)})
    with StageRun("next", {}):
        pass
    assert status(client, pipeline.info.run_id) == "KILLED"  # its last stage was killed and none runs


# ---------------------------------------------------------------------------------------------------------
# real stages on a tiny project


def tiny_project(root, tiny_dir, db: str, sft=None, reward=None, judge=None) -> str:
    """A project folder with the repository's params on the tiny profile (``sft``/``reward``/``judge``: tiny overrides),
    validated splits, models/base, previous outputs of sft and reward to keep, and a copy of the store ``db``."""
    with open(os.path.join(REPO, "params.yaml")) as handle:
        params = yaml.safe_load(handle)
    params["profile"] = "tiny"
    params["mlflow"] = {"experiment": "rlhf"}
    params["sft"]["profiles"]["tiny"].update(sft or {})
    params["reward"]["profiles"]["tiny"].update(reward or {})
    params["judge"]["profiles"]["tiny"].update(judge or {})
    with open(os.path.join(root, "params.yaml"), "w") as handle:
        yaml.safe_dump(params, handle)
    os.makedirs(os.path.join(root, "data", "validated"))
    for split in ("sft", "rm_train", "rm_eval", "judge_train", "judge_eval"):
        with open(os.path.join(root, "data", "validated", f"{split}.jsonl"), "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in ROWS)
    for name in ("base", "sft", "reward"):
        shutil.copytree(tiny_dir, os.path.join(root, "models", name))
    os.makedirs(os.path.join(root, "metrics"))
    os.makedirs(os.path.join(root, "reports"))
    for path, text in (("metrics/sft.json", '{"old": 1}\n'), ("metrics/reward.json", '{"old": 2}\n')):
        with open(os.path.join(root, path), "w") as handle:
            handle.write(text)
    with open(os.path.join(root, "reports/reward_margins.png"), "wb") as handle:
        handle.write(b"old figure")
    shutil.copy(db, os.path.join(root, "mlflow.db"))
    return str(root)


def stage_process(project: str, stage: str, pipeline: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "RLHF_PIPELINE_RUN_ID": pipeline,
        "MLFLOW_TRACKING_URI": f"sqlite:///{project}/mlflow.db",
    }
    return subprocess.Popen(
        [sys.executable, "-m", f"tasks.{stage}"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def runs(project: str) -> list[tuple[str, str]]:
    """``(stage name or 'pipeline', status)`` of every run in the project's MLflow store, oldest first."""
    with sqlite3.connect(os.path.join(project, "mlflow.db")) as db:
        names = dict(db.execute("select run_uuid, value from tags where key = 'rlhf.stage'").fetchall())
        rows = db.execute("select run_uuid, status from runs order by start_time, run_uuid").fetchall()
    return [(names.get(uuid, "pipeline"), state) for uuid, state in rows]


def kept(project: str, paths: list[str]) -> dict[str, dict[str, str]]:
    return {p: tree(os.path.join(project, p)) for p in paths}


@pytest.mark.integration
def test_sigterm_mid_training_kills_the_stage_and_its_runs_and_keeps_the_outputs(tmp_path, tiny_dir, empty_db):
    project = tiny_project(tmp_path, tiny_dir, empty_db, sft={"steps": 100000, "checkpoint_every": 0})
    outputs = ["models/sft", "metrics/sft.json"]
    before = kept(project, outputs)
    process = stage_process(project, "sft", "sigterm-test")
    deadline = time.time() + 120
    step = 0
    while step < 2:
        assert process.poll() is None, process.communicate()
        assert time.time() < deadline, "no training step logged in time"
        time.sleep(0.2)
        try:
            with sqlite3.connect(os.path.join(project, "mlflow.db")) as db:
                step = db.execute("select max(step) from metrics where key = 'sft/loss'").fetchone()[0] or 0
        except sqlite3.Error:
            pass
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "[sft] stopped by SIGTERM" and "Traceback" not in err
    assert "[sft] KILLED in" in out
    assert sorted(runs(project)) == [("pipeline", "KILLED"), ("sft", "KILLED")]
    assert kept(project, outputs) == before and leftovers(os.path.join(project, "models")) == []


@pytest.mark.integration
def test_sft_with_zero_steps_writes_the_base_model_as_it_is(tmp_path, tiny_dir, empty_db, monkeypatch, capsys):
    # no SFT (sft.steps 0): PPO, the reward model and the evaluation start from the base model, byte for byte
    import tasks.sft as sft
    from tasks.kit.common import cli

    project = tiny_project(tmp_path, tiny_dir, empty_db, sft={"steps": 0})
    with open(os.path.join(project, "models", "sft", "stale.txt"), "w") as handle:
        handle.write("a file of the previous SFT model")
    use_store(monkeypatch, project, "no-sft")
    cli(sft.main)
    assert tree(os.path.join(project, "models", "sft")) == tree(os.path.join(project, "models", "base"))
    with open(os.path.join(project, "metrics", "sft.json")) as handle:
        metrics = json.load(handle)
    assert (metrics["sft/steps"], metrics["sft/epochs"], metrics["sft/examples"]) == (0.0, 0.0, float(len(ROWS)))
    assert "[sft] sft.steps is 0: no fine-tuning, models/sft is the base model" in capsys.readouterr().out
    assert sorted(runs(project)) == [("pipeline", "FINISHED"), ("sft", "FINISHED")]


@pytest.mark.integration
def test_sft_sources_trains_on_those_rows_only_and_a_source_without_rows_stops_before_writing(
    tmp_path, tiny_dir, empty_db, monkeypatch, capsys
):
    import tasks.sft as sft
    from tasks.kit.common import cli

    project = tiny_project(tmp_path, tiny_dir, empty_db, sft={"steps": 2, "sources": ["helpful-base"]})
    sources = ["harmless-base"] * 4 + ["helpful-base"] * 2
    with open(os.path.join(project, "data", "validated", "sft.jsonl"), "w") as handle:
        handle.writelines(json.dumps({**row, "source": name}) + "\n" for row, name in zip(ROWS, sources, strict=True))
    use_store(monkeypatch, project, "sft-sources")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # setup_torch would take every core of CI
    cli(sft.main)
    with open(os.path.join(project, "metrics", "sft.json")) as handle:
        assert json.load(handle)["sft/examples"] == 2.0  # the two helpful-base rows of six
    outputs = ["models/sft", "metrics/sft.json"]
    before = kept(project, outputs)
    with open(os.path.join(project, "params.yaml")) as handle:
        params = yaml.safe_load(handle)
    params["sft"]["profiles"]["tiny"]["sources"] = ["helpful-online"]
    with open(os.path.join(project, "params.yaml"), "w") as handle:
        yaml.safe_dump(params, handle)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        cli(sft.main)
    assert exit_code.value.code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "[sft] error: ValueError: data/validated/sft.jsonl: sft.sources names ['helpful-online'], which have no row "
        "here; its sources: ['harmless-base', 'helpful-base']"
    ), err
    assert kept(project, outputs) == before and leftovers(os.path.join(project, "models")) == []


@pytest.mark.integration
def test_sft_diverging_stops_with_one_line_and_the_next_stage_refuses_its_model(
    tmp_path, tiny_dir, empty_db, monkeypatch, capsys
):
    import tasks.reward as reward
    import tasks.sft as sft
    from tasks.kit.common import cli

    project = tiny_project(tmp_path, tiny_dir, empty_db, sft={"lr": 1.0e8, "warmup_steps": 0, "steps": 6})
    outputs = ["models/sft", "metrics/sft.json"]
    before = kept(project, outputs)
    use_store(monkeypatch, project, "nan-test")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # setup_torch would take every core of CI
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        cli(sft.main)  # as `python -m tasks.sft` runs it
    assert exit_code.value.code == 1
    err = capsys.readouterr().err
    match = re.fullmatch(
        r"\[sft\] error: NonFiniteError: sft: non-finite sft/(loss|grad_norm) \((nan|inf)\) at step (\d) of 6; "
        r"training stopped",
        err.strip().splitlines()[-1],
    )
    assert match and "Traceback" not in err, err
    assert sorted(runs(project)) == [("pipeline", "FAILED"), ("sft", "FAILED")]
    assert kept(project, outputs) == before and leftovers(os.path.join(project, "models")) == []
    with sqlite3.connect(os.path.join(project, "mlflow.db")) as db:
        nan_rows = db.execute(
            "select key, step from metrics where is_nan = 1 and key = ?", (f"sft/{match.group(1)}",)
        ).fetchall()
        tag = db.execute("select value from tags where key = ?", (f"rlhf.non_finite.sft/{match.group(1)}",)).fetchone()
    assert nan_rows == [(f"sft/{match.group(1)}", int(match.group(3)))]
    assert tag == (f"{match.group(2)} at step {match.group(3)}",)
    # a diverged model (written by an older version, or by hand) is refused by the next stage, which keeps its outputs
    model = load_causal_lm(os.path.join(project, "models", "sft"))
    with torch.no_grad():
        model.model.norm.weight.fill_(NAN)
    model.save_pretrained(os.path.join(project, "models", "sft"))
    outputs = ["models/reward", "metrics/reward.json", "reports/reward_margins.png"]
    before = kept(project, outputs)
    with pytest.raises(ValueError) as caught:
        reward.main()
    assert str(caught.value) == (
        "models/sft: model weights are not finite (NaN or inf in model.norm.weight); "
        "refusing to load it: retrain the stage that wrote it"
    )
    assert kept(project, outputs) == before
    assert sorted(runs(project)) == [("pipeline", "FAILED"), ("reward", "FAILED"), ("sft", "FAILED")]


@pytest.mark.integration
def test_reward_stage_failing_after_training_keeps_its_previous_outputs(tmp_path, tiny_dir, empty_db, monkeypatch):
    import mlflow

    import tasks.reward as reward

    project = tiny_project(tmp_path, tiny_dir, empty_db)
    outputs = ["models/reward", "metrics/reward.json", "reports/reward_margins.png"]
    before = kept(project, outputs)
    use_store(monkeypatch, project, "late-failure")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # setup_torch would take every core of CI
    checkpoints = os.path.join(project, "checkpoints", "reward", "*", "step-*")

    def artifact_store_down(*args, **kwargs):
        raise OSError("artifact store unreachable")

    with monkeypatch.context() as patch:
        patch.setattr(mlflow, "log_figure", artifact_store_down)  # the last thing that can fail
        with pytest.raises(OSError, match="artifact store unreachable"):
            reward.main()
    assert kept(project, outputs) == before and leftovers(os.path.join(project, "models")) == []
    assert sorted(runs(project)) == [("pipeline", "FAILED"), ("reward", "FAILED")]
    assert glob.glob(checkpoints)  # a rerun resumes: the checkpoints go only with a successful commit
    reward.main()
    after = kept(project, outputs)
    assert all(after[p] != before[p] for p in outputs) and not glob.glob(checkpoints)
    assert runs(project)[-1] == ("reward", "FINISHED") and ("pipeline", "FINISHED") in runs(project)


def test_ctrl_c_leaves_the_flow_within_its_grace_even_when_prefect_would_wait_on_its_stopped_server():
    # a stand-in for Prefect's engine after Ctrl-C: it swallows the KeyboardInterrupt and keeps retrying a server
    # the same Ctrl-C stopped (as it did for minutes); the pipeline must still leave, saying so, with exit 130.
    # The Ctrl-C may land while the stand-in is still printing "ready" (under load it did): it swallows it there
    # too, or Python would die of the KeyboardInterrupt (killed by SIGINT, -2) before the grace ran out
    code = (
        "import sys, time\n"
        "from flows.pipeline import leave_soon_after_ctrl_c\n"
        "def retry_forever():\n"
        "    while True:\n"
        "        try:\n"
        "            time.sleep(60)\n"
        "        except KeyboardInterrupt:\n"
        "            print('interrupted', flush=True)\n"
        "leave_soon_after_ctrl_c(grace_s=1.0)\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "retry_forever()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGINT)
    started = time.monotonic()
    assert process.wait(timeout=30) == 130
    assert time.monotonic() - started < 10
    assert process.stdout.read().splitlines() == ["interrupted", "[flow] stopped by Ctrl-C; `make pipeline` resumes "
                                                  "(DVC reruns what is stale, PPO from its checkpoint)"]  # fmt: skip


@pytest.mark.parametrize(
    ("stage", "outputs", "source"),
    [
        ("reward", ["models/reward", "metrics/reward.json", "reports/reward_margins.png"], "models/sft"),
        ("judge", ["models/base", "metrics/reward.json"], "models/base"),
    ],
)
def test_a_scalar_model_keeping_more_blocks_than_its_start_has_stops_before_its_run_opens(
    tmp_path, tiny_dir, empty_db, monkeypatch, stage, outputs, source
):
    module = importlib.import_module(f"tasks.{stage}")
    project = tiny_project(tmp_path, tiny_dir, empty_db, **{stage: {"num_hidden_layers": 3}})  # the tiny model has 2
    before = kept(project, outputs)
    use_store(monkeypatch, project, f"too-deep-{stage}")
    with pytest.raises(ValueError) as caught:
        module.main()
    assert str(caught.value) == (
        f"params.yaml: {stage}.num_hidden_layers 3 is more than the 2 blocks of {source}, which it starts from "
        "(null keeps them all)"
    )
    assert kept(project, outputs) == before and runs(project) == []
