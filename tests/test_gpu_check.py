"""The GPU check's CPU fallback (bench.gpu_check): every step runs on the tiny model, so the check cannot rot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from bench.gpu_check import _run, render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assets_like_the_folder(tiny_dir, folder) -> str:
    """What bench.gpu_prepare writes, from the tiny model: its config and tokenizer (no weights, so a random model
    of the config's shape), params.yaml, and the speed rows' inputs.json, made by the benchmark's own code."""
    from bench.speed_setup import inputs_from
    from rlhf.models.loading import load_tokenizer

    shutil.copytree(tiny_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copy(os.path.join(ROOT, "params.yaml"), folder)
    examples = [
        {
            "prompt": [{"role": "user", "content": f"How do I water basil, case {i}?"}],
            "chosen": [{"role": "assistant", "content": f"When the soil is dry, case {i}."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        }
        for i in range(8)
    ]
    inputs = inputs_from(load_tokenizer(str(tiny_dir)), examples, ((0, 10**6), (0, 10**6)), 8)
    (folder / "inputs.json").write_text(json.dumps(inputs))
    return str(folder)


@pytest.mark.integration
def test_every_step_runs_on_the_cpu_from_a_config_and_a_tokenizer(tiny_dir, tmp_path):
    from bench.speed_setup import ensure_trl

    ensure_trl()  # TRL 1.12.0 into bench/out (pip, once): the speed rows' other side
    assets = assets_like_the_folder(tiny_dir, tmp_path / "assets")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bench.gpu_check", "--assets", str(assets), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["ok"] and smoke["figures"]["precision"] == "no", smoke
    figures = smoke["figures"]
    assert figures["off_device"] == 0 and figures["non_finite"] == 0
    assert figures["resume_figures_compared"] > 20 and figures["resume_max_rel_diff"] <= 1e-5  # fp32 repeats itself
    decode = json.loads((out / "decode.json").read_text())["figures"]
    assert decode["same_tokens"] is True  # a static cache samples exactly what the dynamic one does, in fp32
    assert decode["dynamic_tokens_per_s"] > 0 and decode["static_tokens_per_s"] > 0
    assert json.loads((out / "env.json").read_text())["figures"]["sizes"] == "cpu"
    for stage in ("sft", "reward", "ppo"):  # the gpu profile's stages, at the fallback's sizes
        figures = json.loads((out / f"stage_{stage}.json").read_text())["figures"]
        assert 0 < figures["peak_gb"] < figures["estimate_gb"] == 16.0, (stage, figures)
    assert json.loads((out / "stage_ppo.json").read_text())["figures"]["epochs"] == 4  # the profile's, read as ppo does
    speed = json.loads((out / "speed.json").read_text())["figures"]
    for impl in ("ours", "trl"):
        assert speed[f"ppo/{impl}/step_s"] > 0 and speed[f"ppo/{impl}/gen_tokens_per_s"] > 0, speed
        assert speed[f"sft/{impl}/tokens_per_s"] > 0 and speed[f"reward/{impl}/utilisation"] > 0, speed
    assert speed["ppo/ours/generation_s"] > 0  # our per-phase seconds
    assert (out / "table.md").read_text() in done.stdout and "| smoke | resume_max_rel_diff |" in done.stdout


@pytest.mark.integration
def test_a_failed_step_is_recorded_in_one_line_and_the_next_one_runs(tmp_path):
    out, names = tmp_path / "out", ("env", "smoke", "stage_sft")
    command = [sys.executable, "-m", "bench.gpu_check", "--assets", str(tmp_path / "missing"), "--out", str(out)]
    done = subprocess.run([*command, "--only", ",".join(names)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in names}
    assert results["env"]["ok"]  # needs no model
    for name in names[1:]:
        assert not results[name]["ok"] and "missing" in results[name]["error"] and "\n" not in results[name]["error"]
    assert "| smoke | FAILED after" in done.stdout


def test_a_step_left_without_budget_is_not_run_and_the_table_says_so():
    result = _run("smoke", "anywhere", timeout_s=0.5)
    assert result == {"ok": False, "seconds": 0.0, "error": "not run: the budget was spent"}
    table = render(
        {"smoke": result, "env": {"ok": True, "seconds": 1.25, "figures": {"torch": "2.13.0", "x": 0.123456}}}
    )
    assert table.splitlines()[2:] == [
        "| smoke | FAILED after 0 s | not run: the budget was spent |",
        "| env | seconds | 1.2 |",
        "| env | torch | 2.13.0 |",
        "| env | x | 0.1235 |",
    ]


def test_the_folder_carries_every_bench_module_the_check_imports():
    from bench.gpu_prepare import CODE
    from bench.speed import WORKERS

    code = "import sys, bench.gpu_check; print(' '.join(m for m in sys.modules if m.startswith('bench.')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    imported = {f"bench/{name.split('.', 1)[1]}.py" for name in done.stdout.split()}
    imported |= {f"{module.replace('.', '/')}.py" for module in WORKERS.values()}  # run as processes
    assert imported and imported <= set(CODE), sorted(imported - set(CODE))


def test_an_unknown_step_is_refused_naming_the_steps(tmp_path):
    import typer
    from typer.testing import CliRunner

    from bench.gpu_check import main

    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, ["--assets", str(tmp_path), "--out", str(tmp_path), "--only", "env,smok"])
    assert result.exit_code == 2 and "no step smok; the steps: env, smoke, decode" in " ".join(result.output.split())
