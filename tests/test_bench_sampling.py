"""bench.sampling's arithmetic: the bytes a decoding step reads, the bandwidth figures, the table."""

from __future__ import annotations

from bench.sampling import memory_bandwidth, product_table, table, weight_bytes
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


def test_forcing_full_length_makes_our_loop_decode_every_step_and_never_sample_eos(tiny_dir, tokenizer):
    from bench.speed_worker import GenerationLog, force_full_length
    from rlhf.data.chat import encode_prompt, pad
    from rlhf.models import sampling

    model = load_causal_lm(tiny_dir).eval()
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": text}], 64) for text in ("Hi", "What is rain?")]
    ids, attn = pad(tokenizer, prompts, "left", model.device)
    sampler = sampling.PerPromptSampling([5, 6], 0.05, model.device)
    first = int(sampling.decode(model, ids, attn, 1, sampler, -1, tokenizer.pad_token_id)[0, 0])
    ends_at_once = sampling.decode(
        model, ids, attn, 6, sampling.PerPromptSampling([5, 6], 0.05, model.device), first, 0
    )
    assert (ends_at_once[0, 1:] == 0).all()  # with row 0's first token as its end, row 0 ends at once
    log, original = GenerationLog(), sampling.decode
    try:
        force_full_length(model, log)
        forced = sampling.decode(model, ids, attn, 6, sampling.PerPromptSampling([5, 6], 0.05, model.device), first, 0)
        rollout = sampling.sample(model, tokenizer, prompts, 6, 0.7, seeds=[1, 2])
    finally:
        sampling.decode = original
    assert (
        forced.shape == (2, 6) and not (forced == first).any() and log.new_tokens == [6, 6] and log.responses == [2, 2]
    )
    assert rollout.response_mask.all() and not rollout.ended.any()
    assert log.prompt_tokens[0] == int(attn.sum())


def test_product_table_says_whether_the_loop_sampled_the_same_tokens():
    row = {"shape": "best-of-16", "precision": "bf16", "cache": "static", "generate_s": 9.91, "loop_s": 7.16}
    row |= {"speedup": 9.91 / 7.16, "ended": 0.75, "same_tokens": False}
    assert product_table([row])[-1] == "| best-of-16 | bf16 | static | 9.91 | 7.16 | 1.38 | 0.75 | no |"
