"""Stage base_model: load ``model.source`` (GGUF, HF folder or hub id), save it as safetensors in ``models/base/``."""

from __future__ import annotations

from typing import Any

from tasks.kit import paths
from tasks.kit.backbones import save_source
from tasks.kit.common import cli, setup_torch
from tasks.kit.outputs import StagedOutputs, write_metrics
from tasks.kit.params import stage_params
from tasks.kit.runs import StageRun

OUT_DIR = paths.BASE


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
        write_metrics(outputs.file(paths.metrics("base_model")), metrics, stage)


if __name__ == "__main__":
    cli(main)
