"""Stage base_model: load ``model.source`` (GGUF, HF folder or hub id), save it as safetensors in ``models/base/``."""

from __future__ import annotations

from typing import Any

from rlhf.models import load_base_model
from tasks.common import StageRun, atomic_dir, cli, setup_torch, stage_params, write_metrics

OUT_DIR = "models/base"


def run(params: dict[str, Any]) -> dict[str, float]:
    """Load, convert and save the base model; returns its size. ``model.seed`` seeds a ``random_init`` model."""
    unknown = sorted(set(params) - {"source", "random_init", "seed"})
    if unknown:
        raise ValueError(f"params.yaml: section 'model' has unknown keys {unknown}; known: random_init, seed, source")
    model, tokenizer = load_base_model(params["source"], params.get("random_init"), params.get("seed", 0))
    with atomic_dir(OUT_DIR) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return {"base/parameters": float(sum(p.numel() for p in model.parameters()))}


def main() -> None:
    """DVC stage command."""
    params = stage_params("model")
    setup_torch(params.get("seed", 0))
    with StageRun("base_model", params) as stage:
        metrics = run(params)
        stage.log(metrics, 0)
    write_metrics("metrics/base_model.json", {**metrics, "seconds": stage.seconds})


if __name__ == "__main__":
    cli(main)
