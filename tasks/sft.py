"""Stage sft: fine-tune the base model on the chosen responses of the sft split.

Writes ``models/sft/`` and ``metrics/sft.json`` together, after everything that can fail
(:class:`tasks.outputs.StagedOutputs`): a failed or stopped run leaves the previous ones as they were.
"""

from __future__ import annotations

from typing import Any

from rlhf.data import load_jsonl
from rlhf.models import load_causal_lm, load_tokenizer, save_tokenizer
from rlhf.sft import SFTConfig, train_sft
from rlhf.sharding import whole_model
from rlhf.training import no_log
from tasks.common import cli, setup_torch, stage_runtime
from tasks.configs import config_from_params
from tasks.launch import other_rank
from tasks.outputs import StagedOutputs, write_metrics
from tasks.params import stage_params
from tasks.resume import run_checkpointer
from tasks.runs import StageRun

DATA = "data/validated/sft.jsonl"
BASE = "models/base"
OUT_DIR, METRICS = "models/sft", "metrics/sft.json"


def run(
    params: dict[str, Any], log, outputs: StagedOutputs | None, device: dict[str, Any] | None = None
) -> dict[str, float]:
    """Train the SFT model and stage it as ``models/sft/`` in ``outputs`` (written when they commit).

    In a training process other than rank 0 (``device.num_processes``) it only trains: ``outputs`` is None.

    ``device``: the params.yaml ``device`` section (None: read from params.yaml).

    Returns:
        The summary metrics.

    Raises:
        FloatingPointError: training diverged (:func:`rlhf.training.supervised_loop`).
    """
    config = config_from_params(SFTConfig, params, "sft")
    setup_torch(config.seed)  # before the model is built: the seed owns any new head's initialisation
    tokenizer, model = load_tokenizer(BASE), load_causal_lm(BASE)
    runtime = stage_runtime("sft", device)
    model = runtime.place(model)
    checkpointer = run_checkpointer("sft", params, [DATA, BASE], runtime)
    metrics = train_sft(model, tokenizer, load_jsonl(DATA), config, log, runtime, checkpointer)
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

    def check() -> None:  # the params, one line each, before any process starts
        config_from_params(SFTConfig, params, "sft")

    if other_rank(device, "tasks.sft", lambda: run(params, no_log, None, device), check):
        return
    with StageRun("sft", {**params, "device": device}) as stage, StagedOutputs() as outputs:
        metrics = run(params, stage.log, outputs, device)
        write_metrics(outputs.file(METRICS), metrics, stage)


if __name__ == "__main__":
    cli(main)
