"""bench.sampling's arithmetic: the bytes a decoding step reads, the bandwidth figures, the table."""

from __future__ import annotations

from bench.sampling import memory_bandwidth, table, weight_bytes
from rlhf.models.loading import load_causal_lm


def test_weight_bytes_count_a_tied_lm_head_once(tiny_dir):
    model = load_causal_lm(tiny_dir)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # SmolLM2 ties them, so does the tiny model
    every = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
    assert weight_bytes(model, "fp32") == 4 * every
    assert weight_bytes(model, "bf16") == 2 * every
    assert every < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))


def test_memory_bandwidth_reports_read_and_copy_in_gb_per_s():
    figures = memory_bandwidth(repeats=2, size=1 << 24)
    assert set(figures) == {"read", "copy"} and all(value > 0 for value in figures.values())


def test_table_puts_the_bandwidth_first_and_the_bound_ratio_last():
    row = {"batch": 4, "precision": "fp32", "cache": "static", "prompt_tokens": 98, "steps": 64, "prefill_s": 0.5}
    row |= {"decode_tok_s": 50.0, "bound_tok_s": 200.0, "x_bound": 4.0}
    lines = table({"bandwidth_gbs": {"read": 25.04, "copy": 20.0}, "threads": 2, "rows": [row]})
    assert lines[0].startswith("Memory bandwidth: read 25.0 GB/s, copy 20.0 GB/s")
    assert lines[-1] == "| 4 | fp32 | static | 98 | 0.50 | 50.0 | 200 | 4.00 |"
