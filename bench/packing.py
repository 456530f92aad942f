"""Sequence packing against padded, length-grouped batches for SFT: same loss, and which is faster here.

Packing concatenates a batch's examples into one row whose position ids restart at each example, with no
attention mask: transformers then builds a block-diagonal causal mask from the position ids
(``masking_utils.find_packed_sequence_indices``), so no example attends to another and the token-mean loss
over the response tokens is the padded batch's. On a GPU with a variable-length attention kernel that
saves the padded positions; with a dense attention mask (SDPA on a CPU) the row's attention is quadratic in
the whole packed length. This measures both on SmolLM2-135M at the demo's SFT shapes.

Usage (after ``python -m bench.speed`` has written ``bench/out/speed/{base,inputs.json}``):
    python -m bench.packing [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import statistics
import time

import torch
import typer

from bench.speed_setup import BASE, load_inputs
from rlhf.data.chat import encode_chat, pad, pad_masks
from rlhf.likelihood import language_model_loss
from rlhf.models.forward import position_ids_from_mask
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.runtime.device import Runtime
from rlhf.training.supervised import minibatch_indices


def padded_loss(model, tokenizer, batch, runtime: Runtime) -> tuple[torch.Tensor, int]:
    """The product's SFT step (rlhf.training.sft): right-padded batch; returns ``(loss, positions computed)``."""
    ids, attn = pad(tokenizer, [e.input_ids for e in batch], "right", runtime.device)
    target = pad_masks([e.response_mask for e in batch], ids.shape[1], "right", runtime.device)
    with runtime.autocast():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    return language_model_loss(logits, ids, target), ids.numel()


def packed_loss(model, batch, runtime: Runtime) -> tuple[torch.Tensor, int]:
    """The same examples packed in one row, position ids restarting per example, no attention mask."""
    ids = torch.tensor([[t for e in batch for t in e.input_ids]], device=runtime.device)
    positions = torch.tensor([[p for e in batch for p in range(len(e.input_ids))]], device=runtime.device)
    target = torch.tensor([[bool(m) for e in batch for m in e.response_mask]], device=runtime.device)
    with runtime.autocast():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    # the logit of an example's last token predicts the next example's first token, a prompt token: not a target
    return language_model_loss(logits, ids, target), ids.numel()


def main(batch: int = 8, repeats: int = 3, max_length: int = 256) -> None:
    """Print loss agreement and seconds per forward+backward, padded vs packed, fp32 and bf16."""
    torch.manual_seed(0)
    tokenizer, model = load_tokenizer(BASE), load_causal_lm(BASE)
    examples = [row["example"] for row in load_inputs()["sft"]]
    encoded = [encode_chat(tokenizer, ex["prompt"], ex["chosen"], max_length) for ex in examples]
    lengths = [len(e.input_ids) for e in encoded]
    for precision in ("no", "bf16"):
        runtime = Runtime(torch.device("cpu"), precision)
        figures = {"padded": [], "packed": []}
        for step in range(repeats + 1):  # the first of each is a warm-up
            chosen = [encoded[i] for i in minibatch_indices(step, len(encoded), batch, 0, lengths)]
            losses = {}
            for name in ("padded", "packed"):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                loss, positions = (
                    padded_loss(model, tokenizer, chosen, runtime)
                    if name == "padded"
                    else packed_loss(model, chosen, runtime)
                )
                loss.backward()
                seconds = time.perf_counter() - start
                losses[name] = loss.item()
                if step:
                    figures[name].append((seconds, positions))
            print(f"[{precision}] step {step}: loss padded {losses['padded']:.6f} packed {losses['packed']:.6f}")
        for name, runs in figures.items():
            seconds = statistics.median(s for s, _ in runs)
            print(f"[{precision}] {name}: {seconds:.2f} s per forward+backward, {runs[0][1]} positions in the first")


if __name__ == "__main__":
    typer.run(main)
