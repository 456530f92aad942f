"""Stage 1: supervised fine-tuning on the chosen responses (tutorial, stage 1)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.chat import Encoded, encode_chat, pad, pad_masks
from rlhf.likelihood import target_nll, target_tokens
from rlhf.models.forward import target_logprobs
from rlhf.ranges import check_ranges
from rlhf.runtime.device import Runtime
from rlhf.training.checkpoint import Checkpointer
from rlhf.training.supervised import LogFn, LoopConfig, freeze_lower_layers, supervised_loop


@dataclass
class SFTConfig(LoopConfig):
    """SFT hyperparameters (params.yaml section ``sft``)."""

    section: ClassVar[str] = "sft"
    min_steps: ClassVar[int] = 0  # 0: no SFT, the base model is what PPO starts from (tasks/sft.py)
    steps: int = 0
    lr: float = 1e-4
    warmup_steps: int = 4
    trainable_layers: int | None = 12
    max_length: int = 256  # tokens of prompt + response (a long prompt is cut from the left)
    sources: tuple[str, ...] | None = None  # train on the sft split's rows of these data sources only; None: all

    def __post_init__(self) -> None:
        """Raises ValueError: the shared loop's checks (:class:`rlhf.training.supervised.LoopConfig`), ``max_length``
        below 1, ``sources`` not a non-empty list of names, or ``sources`` set while ``steps`` is 0 (no SFT: it
        would choose nothing)."""
        super().__post_init__()
        check_ranges(self.section, self, at_least_1=("max_length",))
        if self.sources is not None:
            if isinstance(self.sources, str) or not self.sources or not all(isinstance(s, str) for s in self.sources):
                raise ValueError(f"sft.sources must be null or a non-empty list of source names, got {self.sources!r}")
            if self.steps == 0:
                raise ValueError(
                    f"sft.sources is {list(self.sources)} but sft.steps is 0 (no SFT): set sft.steps or sources: null"
                )
            self.sources = tuple(self.sources)


def rows_of_sources(rows: list[dict[str, Any]], sources: tuple[str, ...] | None, where: str) -> list[dict[str, Any]]:
    """The rows whose ``source`` (the data source's name: ``data.name`` or a ``more_sources`` entry's) is one of
    ``sources``, in their order; all of them when ``sources`` is None.

    Args:
        rows: the sft split's rows, each with ``source``.
        sources: the names to keep (``sft.sources``), or None.
        where: the file the rows came from, for the error.

    Raises:
        ValueError: a named source has no row in ``rows`` (names the file and the sources it has).
    """
    if sources is None:
        return rows
    present = sorted({row["source"] for row in rows})
    missing = [name for name in sources if name not in present]
    if missing:
        raise ValueError(f"{where}: sft.sources names {missing}, which have no row here; its sources: {present}")
    return [row for row in rows if row["source"] in sources]


def sft_step(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, encoded: list[Encoded], runtime: Runtime
) -> Callable[[list[int], list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The SFT ``step_fn(part, batch)`` of :func:`rlhf.training.supervised.supervised_loop` over ``encoded`` examples.

    It returns the part's share of the batch's token-mean NLL of the response tokens (only their positions go
    through the LM head: :func:`rlhf.models.forward.target_logprobs`): the part's NLL summed,
    divided by the response tokens of the *whole* batch (tutorial stage 1; :mod:`rlhf.runtime.distributed`), and the
    part's response tokens (``sft/tokens``).
    """
    targets = [target_tokens(e.response_mask) for e in encoded]

    def step(part: list[int], batch: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = [encoded[i] for i in part]
        input_ids, attention_mask = pad(tokenizer, [e.input_ids for e in rows], "right", runtime.device)
        target = pad_masks([e.response_mask for e in rows], input_ids.shape[1], "right", runtime.device)
        predicting = [(r, t - 1) for r, e in enumerate(rows) for t, keep in enumerate(e.response_mask) if keep and t]
        where = torch.tensor(predicting, dtype=torch.long, device=runtime.device).reshape(-1, 2)
        logprobs = target_logprobs(model, input_ids, attention_mask, where[:, 0], where[:, 1])
        count = sum(targets[i] for i in batch)
        return target_nll(logprobs, count), {"sft/tokens": target.sum()}

    return step


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
        checkpointer: resume point (see :func:`rlhf.training.supervised.supervised_loop`).

    Returns:
        Summary metrics (``sft/loss_first``, ``sft/loss_last``, ``sft/steps``, ``sft/examples``, and
        ``sft/epochs``: ``steps x batch_size / examples``, how much of the split the model saw; 1.0 is each once).

    Raises:
        ValueError: no examples.
    """
    encoded = [encode_chat(tokenizer, ex["prompt"], ex["chosen"], config.max_length) for ex in examples]
    freeze_lower_layers(model, config.trainable_layers)
    step = sft_step(model, tokenizer, encoded, runtime)

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
    epochs = config.steps * config.batch_size / len(encoded)
    return {**summary, "sft/examples": float(len(encoded)), "sft/epochs": epochs}
