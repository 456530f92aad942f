"""Stage sft: fine-tune the base model on the chosen responses of the sft split; writes ``models/sft/``."""

from __future__ import annotations

from typing import Any

from rlhf.data import load_jsonl
from rlhf.models import load_causal_lm, load_tokenizer
from rlhf.sft import SFTConfig, train_sft
from rlhf.training import config_from_params
from tasks.common import (
    StageRun,
    atomic_dir,
    cli,
    run_checkpointer,
    setup_torch,
    stage_params,
    write_metrics,
)

DATA = "data/validated/sft.jsonl"
BASE = "models/base"
OUT_DIR = "models/sft"


def run(params: dict[str, Any], log) -> dict[str, float]:
    """Train and save the SFT model; returns the summary metrics."""
    config = config_from_params(SFTConfig, params, "sft")
    setup_torch(config.seed)  # before the model is built: the seed owns any new head's initialisation
    tokenizer, model = load_tokenizer(BASE), load_causal_lm(BASE)
    checkpointer = run_checkpointer("sft", params, [DATA, BASE])
    metrics = train_sft(model, tokenizer, load_jsonl(DATA), config, log, checkpointer)
    with atomic_dir(OUT_DIR) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    checkpointer.clear()
    return metrics


def main() -> None:
    """DVC stage command."""
    params = stage_params("sft")
    with StageRun("sft", params) as stage:
        metrics = run(params, stage.log)
    write_metrics("metrics/sft.json", {**metrics, "seconds": stage.seconds})


if __name__ == "__main__":
    cli(main)
