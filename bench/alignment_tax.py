"""The alignment tax with and without PPO-ptx (a benchmark, not a stage): perplexity on held-out ptx text.

Trains the policy twice from ``models/sft`` against ``models/reward_champion`` with the pipeline's ppo params,
once as they are (``ptx_coef`` of the preset, 0.5 for ppo_max) and once with ``ptx_coef: 0``, the same seed
and iterations, then measures the perplexity of the SFT model and of both policies on
``data/validated/ptx_heldout.jsonl`` (:func:`rlhf.evaluation.evaluator.ptx_perplexity`; InstructGPT section 3.5: PPO-ptx
exists to pay less of this tax). Needs a pipeline run first (``make pipeline``). Writes
``reports/alignment_tax.json`` and an MLflow run "alignment-tax", and prints the table.

Usage:
    python -m bench.alignment_tax --iterations 12
"""

from __future__ import annotations

import os

import typer

from bench.ablation import overrides
from rlhf.data.reading import load_jsonl
from rlhf.evaluation.evaluator import EvalConfig, ptx_perplexity
from rlhf.files import write_json
from rlhf.models.loading import load_causal_lm, load_tokenizer
from tasks import ppo
from tasks.evaluate import PTX_HELDOUT, SFT
from tasks.kit.common import stage_runtime
from tasks.kit.params import stage_params
from tasks.kit.runs import StageRun

OUT = "reports/alignment_tax.json"


def main(
    iterations: int = typer.Option(12, help="policy iterations of each run"),
    set_: list[str] = typer.Option([], "--set", help="override of the ppo params for both runs, key=value"),
) -> None:
    """Train with and without PPO-ptx and print the held-out ptx perplexity of SFT and both policies."""
    generation, evaluate = stage_params("generation"), stage_params("evaluate")
    config = EvalConfig(batch_size=evaluate["batch_size"], ptx_max_length=stage_params("ppo")["ptx_max_length"])
    heldout, tokenizer, runtime = load_jsonl(PTX_HELDOUT), load_tokenizer(SFT), stage_runtime("evaluate")
    base = {**stage_params("ppo"), "iterations": iterations, **overrides(set_)}
    os.environ["RLHF_PIPELINE_RUN_ID"] = os.environ.get("RLHF_PIPELINE_RUN_ID") or "alignment-tax"
    figures = {"sft": ptx_perplexity(runtime.place(load_causal_lm(SFT)), tokenizer, heldout, config, runtime)}
    for name, ptx_coef in (("with_ptx", base["ptx_coef"]), ("without_ptx", 0.0)):
        params = {**base, "ptx_coef": ptx_coef}
        out_dir = os.path.join("bench", "out", "alignment_tax", name)
        with StageRun(f"alignment-tax-{name}", params) as stage:
            ppo.run(params, generation, stage.log, out_dir=out_dir, checkpoint_name=f"alignment-tax-{name}")
            policy = runtime.place(load_causal_lm(out_dir))
            figures[name] = ptx_perplexity(policy, tokenizer, heldout, config, runtime)
            stage.log({"tax/ptx_perplexity": figures[name]}, 0)
    result = {"iterations": iterations, "ptx_coef": base["ptx_coef"], "heldout_rows": len(heldout), **figures}
    write_json(OUT, result)
    print(f"held-out ptx perplexity over {len(heldout)} rows after {iterations} policy iterations:")
    for name in ("sft", "with_ptx", "without_ptx"):
        print(f"  {name:12s} {figures[name]:10.3f}")


if __name__ == "__main__":
    typer.run(main)
