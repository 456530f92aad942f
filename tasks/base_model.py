"""Stage base_model: load ``model.source`` (GGUF, HF folder or hub id), save it as safetensors in ``models/base/``."""

from __future__ import annotations

from typing import Any

from rlhf.models import load_base_model
from tasks.common import cli, setup_torch
from tasks.outputs import StagedOutputs, write_metrics
from tasks.params import stage_params
from tasks.runs import StageRun

OUT_DIR = "models/base"


def run(params: dict[str, Any], outputs: StagedOutputs) -> dict[str, float]:
    """Load and convert the base model, stage it in ``outputs``; returns its size.

    ``model.seed`` seeds a ``random_init`` model.
    """
    unknown = sorted(set(params) - {"source", "random_init", "seed"})
    if unknown:
        raise ValueError(f"params.yaml: section 'model' has unknown keys {unknown}; known: random_init, seed, source")
    try:
        model, tokenizer = load_base_model(params["source"], params.get("random_init"), params.get("seed", 0))
    except FileNotFoundError:
        raise
    except OSError as err:  # a hub id the hub does not know, or no network: transformers' message is a page long
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        source = params["source"]
        raise FileNotFoundError(f"model.source {source!r}: not a local path, and loading it failed: {first}") from None
    folder = outputs.folder(OUT_DIR)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
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
