"""Stage base_model: load ``model.source`` (GGUF, HF folder or hub id), save it as safetensors in ``models/base/``."""

from __future__ import annotations

from typing import Any

from rlhf.models import load_base_model, save_tokenizer
from tasks.common import cli, setup_torch
from tasks.outputs import StagedOutputs, write_metrics
from tasks.params import stage_params
from tasks.runs import StageRun

OUT_DIR = "models/base"


def save_source(source: str, folder: str, random_init: dict | None = None, seed: int = 0, key: str = "model.source"):
    """Load ``source`` (the ``model.source`` forms) and save it with its tokenizer as safetensors in ``folder``.

    Returns the model. ``key`` names the setting in errors (``judge.source`` for the judge's backbone).

    Raises:
        FileNotFoundError: the source is not a local path and loading it failed (one line).
    """
    try:
        model, tokenizer = load_base_model(source, random_init, seed)
    except FileNotFoundError:
        raise
    except OSError as err:  # a hub id the hub does not know, or no network: transformers' message is a page long
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"{key} {source!r}: not a local path, and loading it failed: {first}") from None
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    return model


def run(params: dict[str, Any], outputs: StagedOutputs) -> dict[str, float]:
    """Load and convert the base model, stage it in ``outputs``; returns its size.

    ``model.seed`` seeds a ``random_init`` model.
    """
    unknown = sorted(set(params) - {"source", "random_init", "seed"})
    if unknown:
        raise ValueError(f"params.yaml: section 'model' has unknown keys {unknown}; known: random_init, seed, source")
    model = save_source(params["source"], outputs.folder(OUT_DIR), params.get("random_init"), params.get("seed", 0))
    return {"base/parameters": float(sum(p.numel() for p in model.parameters()))}


def main() -> None:
    """DVC stage command."""
    params = stage_params("model")
    setup_torch(params.get("seed", 0))
    with StageRun("base_model", params) as stage, StagedOutputs() as outputs:
        metrics = run(params, outputs)
        stage.log(metrics, 0)
        write_metrics(outputs.file("metrics/base_model.json"), metrics, stage)


if __name__ == "__main__":
    cli(main)
