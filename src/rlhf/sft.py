"""Stage 1: supervised fine-tuning on the chosen responses (tutorial, stage 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.chat import encode_chat, pad, pad_masks
from rlhf.checkpoint import Checkpointer
from rlhf.device import Runtime
from rlhf.losses import language_model_loss
from rlhf.models import position_ids_from_mask
from rlhf.training import LogFn, LoopConfig, freeze_lower_layers, supervised_loop


@dataclass
class SFTConfig(LoopConfig):
    """SFT hyperparameters (params.yaml section ``sft``)."""

    section: ClassVar[str] = "sft"
    steps: int = 40
    lr: float = 2e-5
    warmup_steps: int = 4
    max_length: int = 256


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict[str, Any]],
    config: SFTConfig,
    log: LogFn,
    runtime: Runtime,
    checkpointer: Checkpointer | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Fine-tune ``model`` in place on ``prompt -> chosen`` with the chat template, loss on response tokens only.

    Args:
        model: causal LM, dropout off.
        tokenizer: with chat template and a pad token distinct from EOS.
        examples: rows with ``prompt`` and ``chosen`` message lists.
        config: :class:`SFTConfig`.
        log: ``log(metrics, step)``.
        runtime: device and precision; ``model`` already placed with ``runtime.trained``.
        checkpointer: resume point (see :func:`rlhf.training.supervised_loop`).

    Returns:
        Summary metrics (``sft/loss_first``, ``sft/loss_last``, ``sft/steps``, ``sft/examples``).

    Raises:
        ValueError: no examples.
    """
    encoded = [encode_chat(tokenizer, ex["prompt"], ex["chosen"], config.max_length) for ex in examples]
    freeze_lower_layers(model, config.trainable_layers)

    def step(indices: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch = [encoded[i] for i in indices]
        input_ids, attention_mask = pad(tokenizer, [e.input_ids for e in batch], "right", runtime.device)
        target = pad_masks([e.response_mask for e in batch], input_ids.shape[1], "right", runtime.device)
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        ).logits
        return language_model_loss(logits, input_ids, target), {"sft/tokens": target.sum()}

    summary = supervised_loop(
        model,
        step,
        len(encoded),
        config,
        prefix="sft",
        log=log,
        runtime=runtime,
        lengths=[len(e.input_ids) for e in encoded],
        checkpointer=checkpointer,
        progress=progress,
    )
    return {**summary, "sft/examples": float(len(encoded))}
