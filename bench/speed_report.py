"""Speed benchmark, the report: medians, ratios, utilisation and the tables (console, Markdown, JSON).

Conventions (repeated in the notes of every table):

- a run's step time is the median over its timed steps (the first step, the warm-up, is left out);
  a row's figure is the median over rounds; a ratio is the median of the round-by-round ratios of
  the runs that alternated (A B);
- PPO: seconds per iteration, ratio = TRL's / ours; SFT and reward: real (non-pad) tokens per
  second over the timed steps, ratio = ours / TRL's; either way > 1 means we are faster;
- training utilisation = model FLOPs / time / the matmul peak of the precision that ran, with
  model FLOPs = (2 N + 4 N_trainable) x real tokens, N the weights of every ``nn.Linear`` (a tied
  LM head counts, embeddings do not): 6 N x tokens when every layer trains. A PPO iteration counts
  generation, reference, reward and value forwards (2 N x tokens each) and ``epochs`` training
  passes of policy and value model; rollout logprobs of the policy are not counted (TRL reuses the
  generation logits for them, we recompute them).
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

PHASES = ("generation", "reference", "reward", "values", "policy_logprobs", "update")
# the fair rows freeze the same lower blocks in both; the lever rows compare with ours fp32, never with TRL
SETTINGS = ("fp32", "best", "fair_fp32", "fair_best", "lever", "lora")
LABELS = {"ppo": "PPO iteration (s/iteration)", "reward": "Reward model (tokens/s)", "sft": "SFT (tokens/s)"}


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if value != value else f"{value:.{digits}f}"


def _ok(runs: list[dict[str, Any]], row: str, impl: str) -> dict[int, dict[str, Any]]:
    """``{round: result}`` of the successful runs of ``row`` by ``impl``."""
    return {
        r["round"]: r["result"] for r in runs if r["row"] == row and r["impl"] == impl and "error" not in r["result"]
    }


def _peak(result: dict[str, Any], peak: dict[str, float]) -> float:
    """The matmul peak (FLOP/s) of the precision the run actually used."""
    return peak["bf16" if result["precision_applied"].startswith("bf16") else "fp32"] * 1e9


def _flops_per_token(params: dict[str, int]) -> float:
    return 2 * params["matmul"] + 4 * params["matmul_trainable"]


def _timed(result: dict[str, Any]) -> list[dict[str, Any]]:
    iterations = result.get("iterations", [])
    return iterations[1:] or iterations


def ppo_flops(result: dict[str, Any], iteration: dict[str, Any]) -> float:
    """Model FLOPs of one PPO iteration (see the module docstring)."""
    policy, value = result["params"]["policy"], result["params"]["value"]
    tokens = iteration["prompt_tokens"] + iteration["batch"] * iteration["new_tokens"]
    forwards = 2 * (2 * policy["matmul"] + 2 * value["matmul"]) * tokens  # generation + reference, reward + values
    update = result["spec"]["epochs"] * (_flops_per_token(policy) + _flops_per_token(value)) * tokens
    return forwards + update


def figures(result: dict[str, Any], peak: dict[str, float]) -> dict[str, float]:
    """The figures of one run: ``value`` (s/iteration or tokens/s), ``utilisation``, memory, generation."""
    out = {"peak_gib": result["peak_rss_mb"] / 1024, "step_s": result["step_s_median"]}
    if result["task"] == "ppo":
        timed = _timed(result)
        out["value"] = result["step_s_median"]
        flops = statistics.fmean(ppo_flops(result, it) for it in timed)
        out["utilisation"] = flops / result["step_s_median"] / _peak(result, peak)
        out["gen_tokens"] = statistics.fmean(it["new_tokens"] for it in result["iterations"])
        seconds = sum(it["generation_s"] for it in timed)
        out["gen_tok_s"] = sum(it["new_tokens"] * it["batch"] for it in timed) / seconds
    else:
        out["value"] = result["tokens_per_s"]
        out["utilisation"] = result["tokens_per_s"] * _flops_per_token(result["params"]["model"]) / _peak(result, peak)
    return out


def _pair_row(runs: list[dict[str, Any]], figure: str, setting: str, peak: dict[str, float]) -> list[str]:
    """One table row of a figure at a setting, ours against TRL (or our lever row against ours fp32)."""
    raw_ours, raw_trl = _ok(runs, f"{figure}/{setting}", "ours"), _ok(runs, f"{figure}/{setting}", "trl")
    ours = {k: figures(v, peak) for k, v in raw_ours.items()}
    trl = {k: figures(v, peak) for k, v in raw_trl.items()}
    digits = 2 if figure == "ppo" else 0

    def med(table: dict[int, dict[str, float]], key: str) -> float:
        return _median([f.get(key, float("nan")) for f in table.values()])

    def applied(table: dict[int, dict[str, Any]], impl: str) -> str:
        tried = any(r["row"] == f"{figure}/{setting}" and r["impl"] == impl for r in runs)
        return "/".join(sorted({r["precision_applied"] for r in table.values()})) or ("failed" if tried else "not run")

    def faster(ours_value: float, trl_value: float) -> float:
        return trl_value / ours_value if figure == "ppo" else ours_value / trl_value

    if setting in ("lever", "lora"):
        base = {k: figures(v, peak) for k, v in _ok(runs, f"{figure}/fp32", "ours").items()}
        speedup = _median([faster(ours[k]["value"], base[k]["value"]) for k in ours if k in base])
        spec = next(iter(raw_ours.values()))["spec"] if raw_ours else {}
        lever = f"trainable_layers={spec.get('trainable_layers', '?')}"
        lever = f"LoRA policy rank {spec.get('lora_rank', '?')}" if setting == "lora" else lever
        name, trl_value = f"{LABELS[figure]}, ours {lever} (fp32)", "-"
        ratio, precision = f"n/a ({_fmt(speedup)}x ours fp32)", applied(raw_ours, "ours")
    else:
        kind = "fp32 both" if setting.endswith("fp32") else "best: ours bf16 / TRL bf16 autocast"
        if setting.startswith("fair"):
            spec = next(iter(raw_ours.values()))["spec"] if raw_ours else {}
            kind = f"both trainable_layers={spec.get('trainable_layers', '?')}, {kind}"
        name, trl_value = f"{LABELS[figure]}, {kind}", _fmt(med(trl, "value"), digits)
        ratio = _fmt(_median([faster(ours[k]["value"], trl[k]["value"]) for k in ours if k in trl]))
        precision = f"{applied(raw_ours, 'ours')}; {applied(raw_trl, 'trl')}"
    memory = _median([ours[k]["peak_gib"] / trl[k]["peak_gib"] for k in ours if k in trl])
    generation = ["-", "-"]
    if figure == "ppo":
        generation = [
            f"{_fmt(med(ours, 'gen_tokens'), 1)} / {_fmt(med(trl, 'gen_tokens'), 1)}",
            f"{_fmt(med(ours, 'gen_tok_s'), 1)} / {_fmt(med(trl, 'gen_tok_s'), 1)}",
        ]
    return [
        name,
        _fmt(med(ours, "value"), digits),
        trl_value,
        ratio,
        f"{_fmt(100 * med(ours, 'utilisation'), 1)}% / {_fmt(100 * med(trl, 'utilisation'), 1)}%",
        f"{_fmt(med(ours, 'peak_gib'))} / {_fmt(med(trl, 'peak_gib'))} ({_fmt(memory)}x)",
        *generation,
        precision,
    ]


def _phase_row(label: str, iterations: list[dict[str, Any]], result: dict[str, Any], peak: dict[str, float]) -> list:
    """Median seconds per phase over ``iterations`` of one of our PPO runs, and what the phases leave out."""
    seconds = _median([it["seconds"] for it in iterations])
    phases = {p: _median([it["phases"][p] for it in iterations]) for p in PHASES}
    other = seconds - sum(phases.values())
    gen = sum(it["new_tokens"] * it["batch"] for it in iterations) / sum(it["generation_s"] for it in iterations)
    update_flops = _median(
        [
            result["spec"]["epochs"]
            * (_flops_per_token(result["params"]["policy"]) + _flops_per_token(result["params"]["value"]))
            * (it["prompt_tokens"] + it["batch"] * it["new_tokens"])
            / it["phases"]["update"]
            for it in iterations
        ]
    )
    return [
        label,
        _fmt(seconds),
        *[_fmt(phases[p]) for p in PHASES],
        _fmt(other),
        _fmt(gen, 1),
        f"{_fmt(100 * update_flops / _peak(result, peak), 1)}%",
    ]


def _machine(runs: list[dict[str, Any]]) -> str:
    cpu = platform.processor() or "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    threads = sorted({r["result"].get("threads") for r in runs if "threads" in r["result"]})
    import torch
    import transformers

    return (
        f"{cpu}, {os.cpu_count()} logical cores, torch threads {threads}; python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, TRL 1.12.0 (bench/out/trl-1.12.0)"
    )


def build_report(results: dict[str, Any]) -> dict[str, Any]:
    """Tables and notes from the raw runs of :func:`bench.speed.main`."""
    runs, peak, settings = results["runs"], results["peak_gflops"], results["settings"]
    planned = {r["row"] for r in runs}
    main_rows = [
        _pair_row(runs, f, s, peak) for f in ("ppo", "reward", "sft") for s in SETTINGS if f"{f}/{s}" in planned
    ]
    phase_rows = []
    for setting in SETTINGS:
        for round_, result in sorted(_ok(runs, f"ppo/{setting}", "ours").items()):
            spec = result["spec"]
            label = f"{setting}, round {round_ + 1}, batch {spec['batch']}, response {spec['response']}"
            phase_rows.append(_phase_row(label, _timed(result), result, peak))
    scaling_rows = []
    for result in _ok(runs, "ppo/scaling", "ours").values():
        timed = result["iterations"][1:]
        sizes = [(b, r) for b, r in result["spec"]["sizes"]]
        base = [it for it in timed if (it["batch"], it["response"]) == sizes[0]]
        base_s = _median([it["seconds"] for it in base])
        for b, r in sizes:
            its = [it for it in timed if (it["batch"], it["response"]) == (b, r)]
            row = _phase_row(f"{result['precision_applied']}, batch {b}, response {r}", its, result, peak)
            growth = b / sizes[0][0] if r == sizes[0][1] else r / sizes[0][1]
            scaling_rows.append([*row, f"{_fmt(_median([it['seconds'] for it in its]) / base_s)}x / {growth:g}x"])
    bf16_fallback = [r for r in runs if r["impl"] == "ours" and r["spec"]["precision"] == "bf16"]
    bf16_fallback = [r for r in bf16_fallback if not r["result"].get("precision_applied", "bf16").startswith("bf16")]
    failed = [f"{r['row']} {r['impl']} round {r['round'] + 1}" for r in runs if "error" in r["result"]]
    notes = [
        f"Machine: {_machine(runs)}. Matmul peak measured in the same run: fp32 {peak['fp32']:.0f} GFLOP/s, "
        f"bf16 {peak['bf16']:.0f} GFLOP/s (best of square matmuls n = 1024, 2048, 4096).",
        f"Each measurement is its own process (peak memory = its ru_maxrss); ours and TRL's alternate, "
        f"{settings['repeats']} round(s). The first step of every run is a warm-up and is not timed; a run's "
        "figure is the median of its timed steps, a row's the median over rounds, a ratio the median of "
        "round-by-round ratios. Ratio > 1: we are faster (PPO: TRL s / ours s; SFT, reward: ours tokens/s / TRL's).",
        f"Same model (SmolLM2-135M-Instruct; PPO: policy, reference, reward and value model), same HH-RLHF "
        f"harmless-base prompts and pairs (bench/out/speed/inputs.json, tokenised once by our chat encoder), "
        f"every layer trainable in both (the lever row aside). PPO: {settings['batch']} prompts x "
        f"{settings['response']} new tokens, {settings['epochs']} PPO epochs x {settings['minibatches']} "
        f"minibatch(es), temperature 0.7; SFT and reward: {settings['train_batch']} examples (pairs) per step.",
        "Response length is forced in both: every generate call gets min_new_tokens = max_new_tokens (EOS masked "
        "until the last token), TRL runs with stop_token=None; the generated tokens per response are in the table.",
        "TRL settings changed from its defaults to match ours: gradient_checkpointing=False (TRL default True), "
        "bf16 only in the best rows (TRL default True; use_cpu=True, which TRL requires for bf16 on a CPU; "
        "PPOTrainer builds its own Accelerator(), so its bf16 is set through ACCELERATE_MIXED_PRECISION=bf16, "
        "as accelerate launch --mixed_precision bf16 does), report_to none, no saving, no sample generations.",
        "Not equal by design of each implementation: TRL's PPO takes the rollout logprobs from the generation "
        "logits (ours runs a policy forward), trains policy and value in one forward/backward and one AdamW "
        "over both and clips no gradients (ours: one step per model, each clipped at norm 1.0); TRL's trainers "
        "use adamw_torch_fused, as ours do (torch.optim.AdamW fused=True), and SFTTrainer computes "
        "entropy and token accuracy every step. Ours best = Runtime(mixed_precision='bf16'): bf16 autocast, "
        "fp32 master weights, frozen PPO models in fp32 (the demo's frozen_bf16: false); TRL best = bf16 autocast.",
        "Utilisation: model FLOPs / time / peak of the precision that ran; model FLOPs = (2 N + 4 N_trainable) x "
        "real tokens, N = weights of every nn.Linear (tied LM head included, embeddings not): 6 N x tokens when "
        "every layer trains. PPO iteration: generation, reference, reward and value forwards (2 N each) plus the "
        "PPO epochs of policy and value training; the policy's rollout logprobs are not counted. Generation is "
        "reported as tokens/s (new tokens of all responses / seconds inside generate). A LoRA policy's "
        "N_trainable is its adapters: the input gradients its backward still computes through the frozen "
        "weights (2 N) are not model FLOPs by this count, so that row's utilisation reads low.",
    ]
    sizes = {}
    for r in runs:
        params = r["result"].get("params", {})
        if "policy" in params and not r["spec"].get("lora_rank"):  # a LoRA policy adds its adapters to N
            sizes = {"causal LM": params["policy"]["matmul"], "scalar model": params["value"]["matmul"]}
    if sizes:
        notes.append("N (matmul weights): " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in sizes.items()) + ".")
    if bf16_fallback:
        notes.append(
            "WARNING: some of our bf16 rows did not run in bf16: "
            + "; ".join(sorted({r["result"]["precision_applied"] for r in bf16_fallback}))
        )
    if failed:
        notes.append("FAILED runs (see bench/out/speed/logs/): " + ", ".join(failed))
    phase_columns = ["run", "s/iter", *[f"{p} s" for p in PHASES], "other s", "gen tok/s", "update util"]
    return {
        "tables": [
            {
                "title": "Ours against TRL 1.12.0",
                "columns": [
                    "figure",
                    "ours",
                    "TRL",
                    "ratio (>1: ours faster)",
                    "utilisation ours / TRL",
                    "peak memory GiB ours / TRL",
                    "gen tokens/response ours / TRL",
                    "gen tok/s ours / TRL",
                    "precision that ran (ours; TRL)",
                ],
                "rows": main_rows,
            },
            {
                "title": "Our PPO iteration by phase (median of timed iterations)",
                "columns": phase_columns,
                "rows": phase_rows,
            },  # fmt: skip
            {
                "title": "Our PPO iteration by batch size and response length (one process, one warm-up)",
                "columns": [*phase_columns, "time x / size x"],
                "rows": scaling_rows,
            },
        ],
        "notes": notes,
    }


def write_markdown(report: dict[str, Any], path: str) -> None:
    """Write the tables and notes as Markdown (for docs/results.md)."""
    lines = []
    for table in report["tables"]:
        lines += [f"**{table['title']}**", "", "| " + " | ".join(table["columns"]) + " |"]
        lines.append("|" + "---|" * len(table["columns"]))
        lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in table["rows"]]
        lines.append("")
    lines += [f"- {note}" for note in report["notes"]]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def print_report(report: dict[str, Any]) -> None:
    """Print the tables (rich) and the notes."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    for spec in report["tables"]:
        table = Table(title=spec["title"], show_lines=False)
        for column in spec["columns"]:
            table.add_column(column, overflow="fold")
        for row in spec["rows"]:
            table.add_row(*[str(c) for c in row])
        console.print(table)
    for note in report["notes"]:
        console.print(f"- {note}", highlight=False)
