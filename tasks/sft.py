"""Stage sft: fine-tune the base model on the chosen responses of the sft split (``sft.steps`` 0: no fine-tuning,
``models/sft`` is the base model as it is, and PPO starts from it).

Writes ``models/sft/`` and ``metrics/sft.json`` together, after everything that can fail
(:class:`tasks.kit.outputs.StagedOutputs`): a failed or stopped run leaves the previous ones as they were.
"""

from __future__ import annotations

import shutil
from typing import Any

from rlhf.data.reading import load_jsonl
from rlhf.models.loading import load_causal_lm, load_tokenizer, save_tokenizer
from rlhf.runtime.sharding import whole_model
from rlhf.training.sft import SFTConfig, rows_of_sources, train_sft
from tasks.kit import paths
from tasks.kit.common import cli, setup_torch, stage_runtime
from tasks.kit.configs import config_from_params
from tasks.kit.console import progress_bars
from tasks.kit.outputs import StagedOutputs, write_headline, write_metrics
from tasks.kit.params import stage_params
from tasks.kit.resume import run_checkpointer
from tasks.kit.stage import training_stage

DATA, BASE = paths.split("sft"), paths.BASE
OUT_DIR, METRICS = paths.SFT, paths.metrics("sft")


def run(
    params: dict[str, Any], log, outputs: StagedOutputs | None, device: dict[str, Any] | None = None
) -> dict[str, float]:
    """Train the SFT model and stage it as ``models/sft/`` in ``outputs`` (written when they commit); with
    ``sft.steps`` 0 stage a copy of ``models/base`` instead, untrained.

    In a training process other than rank 0 (``device.num_processes``) it only trains: ``outputs`` is None.

    ``device``: the params.yaml ``device`` section (None: read from params.yaml).

    Returns:
        The summary metrics.

    Raises:
        FloatingPointError: training diverged (:func:`rlhf.training.supervised.supervised_loop`).
    """
    config = config_from_params(SFTConfig, params, "sft")
    if config.steps == 0:  # no SFT: what PPO starts from is the base model, byte for byte
        if outputs is not None:
            shutil.copytree(BASE, outputs.folder(OUT_DIR), dirs_exist_ok=True)
        print("[sft] sft.steps is 0: no fine-tuning, models/sft is the base model", flush=True)
        return {"sft/steps": 0.0, "sft/examples": float(len(load_jsonl(DATA))), "sft/epochs": 0.0}
    setup_torch(config.seed)  # before the model is built: the seed owns any new head's initialisation
    tokenizer, model = load_tokenizer(BASE), load_causal_lm(BASE)
    runtime = stage_runtime("sft", device)
    model = runtime.place(model)
    checkpointer = run_checkpointer("sft", params, [DATA, BASE], runtime)
    metrics = train_sft(
        model,
        tokenizer,
        rows_of_sources(load_jsonl(DATA), config.sources, DATA),
        config,
        log=log,
        runtime=runtime,
        checkpointer=checkpointer,
        progress=progress_bars(),
    )
    model = whole_model(model, runtime.ranks.main)  # FSDP: gathered on rank 0
    if not runtime.ranks.main:
        return metrics  # rank 0 writes the model
    folder = outputs.folder(OUT_DIR)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    outputs.on_commit(checkpointer.clear)  # a failure before the commit resumes from the checkpoints
    return metrics


def main() -> None:
    """DVC stage command."""
    params, device = stage_params("sft"), stage_params("device")

    def finish(stage, outputs: StagedOutputs, metrics: dict[str, float]) -> list[str]:
        write_metrics(outputs.file(METRICS), metrics, stage)
        write_headline(outputs, "sft", metrics)
        return []

    training_stage(
        "sft",
        {**params, "device": device},
        device,
        lambda: config_from_params(SFTConfig, params, "sft"),  # the params, one line each, before any process starts
        lambda log, outputs: run(params, log, outputs, device),
        finish,
    )


if __name__ == "__main__":
    cli(main)
