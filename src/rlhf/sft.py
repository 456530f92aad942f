"""Stage 1: supervised fine-tuning on the chosen responses (tutorial, stage 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.chat import encode_chat, pad, pad_masks
from rlhf.losses import language_model_loss
from rlhf.models import position_ids_from_mask
from rlhf.training import Checkpointer, LogFn, check_schedule, freeze_lower_layers, supervised_loop


@dataclass
class SFTConfig:
    """SFT hyperparameters (params.yaml section ``sft``)."""

    steps: int = 40
    batch_size: int = 4
    lr: float = 2e-5
    warmup_steps: int = 4
    scheduler: str = "cosine"
    max_grad_norm: float = 1.0
    max_length: int = 256
    checkpoint_every: int = 10
    trainable_layers: int | None = None  # train only the top N blocks (CPU budget); None: all
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse a warm-up the schedule would ignore (:func:`rlhf.training.check_schedule`)."""
        check_schedule("sft", self.scheduler, self.warmup_steps)


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[dict[str, Any]],
    config: SFTConfig,
    log: LogFn,
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
        checkpointer: resume point (see :func:`rlhf.training.supervised_loop`).

    Returns:
        Summary metrics (``sft/loss_first``, ``sft/loss_last``, ``sft/steps``, ``sft/examples``).

    Raises:
        ValueError: no examples.
    """
    encoded = [encode_chat(tokenizer, ex["prompt"], ex["chosen"], config.max_length) for ex in examples]
    freeze_lower_layers(model, config.trainable_layers)

    def step(indices: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        batch = [encoded[i] for i in indices]
        input_ids, attention_mask = pad(tokenizer, [e.input_ids for e in batch], "right")
        target = pad_masks([e.response_mask for e in batch], input_ids.shape[1], "right")
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        ).logits
        return language_model_loss(logits, input_ids, target), {"sft/tokens": float(target.sum())}

    summary = supervised_loop(
        model,
        step,
        len(encoded),
        steps=config.steps,
        batch_size=config.batch_size,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        scheduler=config.scheduler,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        prefix="sft",
        log=log,
        checkpointer=checkpointer,
        checkpoint_every=config.checkpoint_every,
        progress=progress,
    )
    return {**summary, "sft/examples": float(len(encoded))}
