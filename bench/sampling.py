"""Sampling against the machine's limit: memory bandwidth, the weight-reading bound, and the product's sampling.

Decoding one token for every row of a batch reads every weight of the model once, so a decoding step costs at
least ``weight bytes / memory bandwidth`` and a batch of ``B`` rows decodes at most ``B x bandwidth / weight
bytes`` tokens a second. This measures the bandwidth (a STREAM-like read and copy of a 1 GiB float32 array, best
of 5) and the product's own sampling path (:func:`rlhf.models.sampling.sample`, one generator a prompt, as PPO,
validation and evaluation call it; under bf16 autocast with each weight cast once, as the stages run it) on the
speed benchmark's HH prompts and model, for each batch size, precision and KV cache:

- ``prefill_s``: one call with one new token (the prompt's pass);
- ``decode_tok_s``: ``B x (T - 1)`` tokens over the seconds the other ``T - 1`` steps took (EOS is held off
  until the last token, as in :mod:`bench.speed`'s PPO rows, so every row decodes every step);
- ``bound_tok_s``: ``B x bandwidth / weight bytes`` (float32: 4 bytes a weight, bf16: 2; a tied LM head counts
  once), and ``x_bound``: how many times slower than the bound the decoding ran.

Usage:
    python -m bench.sampling                      # batches 4 and 32, fp32 and (where native) bf16, both caches
    python -m bench.sampling --batches 4 --new-tokens 32 --out bench/out/speed/sampling.json

``--product`` measures instead what the loop's levers give at the product's shapes (128 new tokens, responses
ending at their EOS, bf16 where native): ``distinct`` (16 different prompts, as evaluation and PPO batch them) and
``best-of-16`` (one prompt 16 times, as best-of-N and k samples a prompt): :func:`rlhf.models.sampling.sample`
against ``model.generate`` with the same per-row sampler (what ``sample`` ran before the loop), the seconds of each
(best of 2) and whether they sampled the same tokens.

``python -m bench.speed`` runs it after its rounds and puts its rows in ``results.json`` and ``table.md``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import typer

from bench.speed_setup import BASE, ensure_base_model, ensure_inputs, load_inputs
from bench.speed_worker import GenerationLog, force_full_length

GIB = 1 << 30


def memory_bandwidth(repeats: int = 5, size: int = GIB) -> dict[str, float]:
    """This machine's memory bandwidth in GB/s: ``read`` (a sum over ``size`` bytes of float32, 1 GiB: far beyond
    any cache) and ``copy`` (``size`` read and ``size`` written, counted as twice), each the best of ``repeats``."""
    source = torch.ones(size // 4)
    target = torch.empty_like(source)
    best = {"read": 0.0, "copy": 0.0}
    for _ in range(repeats):
        start = time.perf_counter()
        source.sum()
        best["read"] = max(best["read"], size / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        target.copy_(source)
        best["copy"] = max(best["copy"], 2 * size / (time.perf_counter() - start) / 1e9)
    return best


def weight_bytes(model: torch.nn.Module, precision: str) -> int:
    """Bytes a decoding step reads: every parameter once (shared tensors once), 4 bytes each in fp32, 2 in bf16."""
    unique = {id(p): p.numel() for p in model.parameters()}
    return sum(unique.values()) * (2 if precision == "bf16" else 4)


def _timed_sample(model, tokenizer, prompts: list[list[int]], new_tokens: int, cache: str) -> tuple[float, int]:
    from rlhf.models.sampling import prompt_seed, sample

    seeds = [prompt_seed(0, 0, i) for i in range(len(prompts))]
    start = time.perf_counter()
    rollout = sample(model, tokenizer, prompts, new_tokens, 0.7, seeds=seeds, cache=cache)
    return time.perf_counter() - start, rollout.input_ids.shape[1] - rollout.response_start


def measure(
    batch: int, precision: str, cache: str, new_tokens: int, bandwidth: float, prompts: list[list[int]]
) -> dict[str, Any]:
    """One row: ``batch`` of the prompts (repeated as needed) sampled ``new_tokens`` tokens each under
    ``precision`` (fp32 | bf16) with the ``cache``; the best of two calls of each length."""
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    tokenizer, model = load_tokenizer(BASE), load_causal_lm(BASE).eval()
    force_full_length(model, GenerationLog())  # every row decodes all its steps: the figure is per step
    rows = (prompts * (batch // len(prompts) + 1))[:batch]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        _timed_sample(model, tokenizer, rows[:2], 2, cache)  # warm-up: thread pool, kernels
        prefill = min(_timed_sample(model, tokenizer, rows, 1, cache)[0] for _ in range(2))
        whole, steps = min(_timed_sample(model, tokenizer, rows, new_tokens, cache) for _ in range(2))
    decode_tok_s = batch * (steps - 1) / (whole - prefill)
    bound = batch * bandwidth * 1e9 / weight_bytes(model, precision)
    return {
        "batch": batch,
        "precision": precision,
        "cache": cache,
        "prompt_tokens": max(map(len, rows)),
        "steps": steps,
        "prefill_s": prefill,
        "decode_tok_s": decode_tok_s,
        "bound_tok_s": bound,
        "x_bound": bound / decode_tok_s,
    }


def generate_reference(model, tokenizer, prompts: list[list[int]], new_tokens: int, seeds: list[int], cache: str):
    """The tokens ``model.generate`` samples with :class:`rlhf.models.sampling.PerPromptSampling`: ``(B, P + R)``."""
    from transformers import GenerationConfig, LogitsProcessorList

    from rlhf.data.chat import pad
    from rlhf.models.sampling import PerPromptSampling, cast_once

    ids, attn = pad(tokenizer, prompts, "left", model.device)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        cache_implementation=None if cache == "dynamic" else cache,
    )
    processors = LogitsProcessorList([PerPromptSampling(seeds, 0.7, model.device)])
    with torch.no_grad(), cast_once(model):
        return model.generate(input_ids=ids, attention_mask=attn, generation_config=config, logits_processor=processors)


def measure_product(shape: str, precision: str, cache: str, prompts: list[list[int]]) -> dict[str, Any]:
    """One ``--product`` row: ``shape`` (distinct | best-of-16), 128 new tokens ending at EOS; ``sample`` against
    ``model.generate``, each the best of two calls."""
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.models.sampling import sample

    tokenizer, model = load_tokenizer(BASE), load_causal_lm(BASE).eval()
    rows = prompts[:16] if shape == "distinct" else [prompts[0]] * 16
    rows = (rows * 16)[:16]
    seeds = list(range(16))
    timed: dict[str, tuple[float, torch.Tensor]] = {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        sample(model, tokenizer, rows[:2], 2, 0.7, seeds=seeds[:2], cache=cache)  # warm-up
        for name, call in (
            ("generate", lambda: generate_reference(model, tokenizer, rows, 128, seeds, cache)),
            ("loop", lambda: sample(model, tokenizer, rows, 128, 0.7, seeds=seeds, cache=cache).input_ids),
        ):
            runs = []
            for _ in range(2):
                start = time.perf_counter()
                tokens = call()
                runs.append((time.perf_counter() - start, tokens))
            timed[name] = min(runs, key=lambda run: run[0])
    ours = timed["loop"][1]
    ended = (ours[:, max(map(len, rows)) :] == tokenizer.eos_token_id).any(1)
    return {
        "shape": shape,
        "precision": precision,
        "cache": cache,
        "generate_s": timed["generate"][0],
        "loop_s": timed["loop"][0],
        "speedup": timed["generate"][0] / timed["loop"][0],
        "ended": float(ended.float().mean()),
        "same_tokens": bool(torch.equal(ours, timed["generate"][1])),
    }


def product_table(rows: list[dict[str, Any]]) -> list[str]:
    """The ``--product`` rows as Markdown lines."""
    lines = [
        "| prompts | precision | KV cache | generate s | loop s | speed-up | ended with EOS | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {row['precision']} | {row['cache']} | {row['generate_s']:.2f} | {row['loop_s']:.2f} "
            f"| {row['speedup']:.2f} | {row['ended']:.2f} | {'yes' if row['same_tokens'] else 'no'} |"
        )
    return lines


def table(result: dict[str, Any]) -> list[str]:
    """The rows as Markdown lines, the bandwidth first."""
    bandwidth = result["bandwidth_gbs"]
    lines = [
        f"Memory bandwidth: read {bandwidth['read']:.1f} GB/s, copy {bandwidth['copy']:.1f} GB/s "
        f"(the bound uses read); {result['threads']} threads.",
        "",
        "| batch | precision | KV cache | prompt tokens | prefill s | decode tokens/s | weight-reading bound "
        "| x bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['batch']} | {row['precision']} | {row['cache']} | {row['prompt_tokens']} | "
            f"{row['prefill_s']:.2f} | {row['decode_tok_s']:.1f} | {row['bound_tok_s']:.0f} | {row['x_bound']:.2f} |"
        )
    return lines


def main(
    batches: str = typer.Option("4,32", help="batch sizes, comma-separated"),
    precisions: str = typer.Option("", help="fp32,bf16 (default: fp32, and bf16 where the CPU computes it natively)"),
    caches: str = typer.Option("dynamic,static", help="KV caches (generation.cache)"),
    new_tokens: int = typer.Option(64, help="tokens decoded per row"),
    out: str = typer.Option("", help="also write the rows as JSON here"),
    product: bool = typer.Option(False, help="the loop against model.generate at the product's shapes instead"),
) -> None:
    """Measure the bandwidth and the sampling rows; print them as a Markdown table."""
    from rlhf.runtime.device import native_bf16

    torch.set_num_threads(max(os.cpu_count() or 1, 1))
    ensure_base_model()
    ensure_inputs()
    prompts = load_inputs()["prompts"]
    chosen = precisions.split(",") if precisions else ["fp32"] + (["bf16"] if native_bf16(torch.device("cpu")) else [])
    if product:
        shapes = ("distinct", "best-of-16")
        rows = [measure_product(s, p, c, prompts) for s in shapes for p in chosen for c in caches.split(",")]
        if out:
            with open(out, "w", encoding="utf-8") as handle:
                json.dump(rows, handle, indent=1)
        print("\n".join(product_table(rows)))
        return
    bandwidth = memory_bandwidth()
    rows = [
        measure(int(b), p, c, new_tokens, bandwidth["read"], prompts)
        for b in batches.split(",")
        for p in chosen
        for c in caches.split(",")
    ]
    result = {"bandwidth_gbs": bandwidth, "threads": torch.get_num_threads(), "rows": rows}
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    print("\n".join(table(result)))


if __name__ == "__main__":
    typer.run(main)
