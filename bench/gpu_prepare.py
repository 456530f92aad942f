"""GPU check, the folder to carry: made here (package registries reachable), run there (no network).

Writes ``<folder>/``:

- ``assets/``: ``params.yaml``, the speed rows' ``inputs.json``, the default base model's tokenizer and
  ``config.json``, no weights (SmolLM2-135M-Instruct's GGUF is 98 MB; the check builds a seeded random model of
  that shape, :func:`bench.gpu_steps.model_folder`);
- ``wheels/``: for the target Python and platform, the product's own wheel and every wheel the check imports
  besides torch and what a CUDA build of torch brings with it (:data:`TORCH_BRINGS`) and what an image carries
  (:data:`THERE`), at the versions of ``infra/constraints.txt`` (resolved by ``uv pip compile`` from :data:`NEEDS`);
- ``bench/``: the check's code (:data:`CODE`: :mod:`bench.gpu_check`, its steps, the speed benchmark's workers);
- ``README.txt``: the two commands to run there.

It refuses a folder over :data:`LIMIT_MIB` (what a lent GPU machine takes from here). docs/gpu.md says how to use it.

Usage: ``make gpu-check-folder`` (``GPU_PYTHON=3.12 GPU_PLATFORM=x86_64-manylinux_2_28``), or
``python -m bench.gpu_prepare --folder dist/gpu-check --python 3.12 --platform x86_64-manylinux_2_28``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import typer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = ("transformers", "accelerate", "peft", "safetensors", "numpy", "tqdm", "typer", "zstandard", "fsspec")
NEEDS += ("trl==1.12.0", "datasets")  # the speed rows (bench.gpu_speed)
"""What the check imports, by name (the core's imports on the check's path); their own needs follow."""
THERE = ("pyarrow", "pandas")
"""Compiled requirements of ``datasets`` (TRL's) a GPU image carries, 55 MB together: not carried, or the folder
would pass :data:`LIMIT_MIB`; without them only the speed step fails."""
TORCH_BRINGS = ("torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "setuptools")
"""A CUDA torch's own requirements (and ``nvidia-*``): there already, so not carried."""
PROJECT = ("pyproject.toml", "README.md", "src", "tasks", "flows")
"""What the product's wheel is built from (pyproject.toml's packages)."""
LIMIT_MIB = 60
CODE = ("bench/__init__.py", "bench/gpu_check.py", "bench/gpu_steps.py", "bench/gpu_stages.py", "bench/gpu_speed.py")
CODE += tuple(f"bench/speed{part}.py" for part in ("", "_report", "_setup", "_worker", "_ours", "_trl"))
README = """The GPU check (docs/gpu.md). On the GPU machine, from this folder, with the Python that holds CUDA torch:

    python3 -m pip install -q --no-index --no-deps --target site wheels/*.whl
    PYTHONPATH=site:. python3 -m bench.gpu_check --assets assets --out results

Results: results/table.md and results/<step>.json.
"""


def main(
    folder: str = typer.Option("dist/gpu-check", help="the folder to write (replaced)"),
    python: str = typer.Option("3.12", help="the GPU machine's Python version"),
    platform: str = typer.Option("x86_64-manylinux_2_28", help="its platform, as uv names it"),
) -> None:
    """Write the folder; print its size."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(folder)) or ".") as work:
        _assets(os.path.join(work, "assets"))
        _wheels(os.path.join(work, "wheels"), python, platform)
        for path in CODE:
            os.makedirs(os.path.join(work, os.path.dirname(path)), exist_ok=True)
            shutil.copy(os.path.join(ROOT, path), os.path.join(work, path))
        with open(os.path.join(work, "README.txt"), "w") as handle:
            handle.write(README)
        mib = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(work) for f in fs) / 2**20
        if mib > LIMIT_MIB:
            raise SystemExit(f"{folder}: {mib:.1f} MiB, over the {LIMIT_MIB} MiB a GPU machine takes")
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(work, folder)
        os.makedirs(work)  # the context manager removes it
    print(f"{folder}: {mib:.1f} MiB (Python {python}, {platform})")


def _assets(folder: str) -> None:
    """The default base model's tokenizer (as the pipeline prepares it) and its config, params.yaml, inputs.json."""
    from transformers import AutoConfig, AutoTokenizer

    from bench.speed_setup import ensure_inputs
    from rlhf.models.loading import load_tokenizer, prepare_tokenizer, resolve_model_source, save_tokenizer
    from tasks.kit.params import stage_params

    path, gguf_file = resolve_model_source(stage_params("model")["source"])
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, trust_remote_code=False))
    save_tokenizer(tokenizer, folder)
    config = AutoConfig.from_pretrained(path, gguf_file=gguf_file, trust_remote_code=False)
    config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(folder)
    load_tokenizer(folder)  # reads back
    shutil.copy(os.path.join(ROOT, "params.yaml"), folder)  # the gpu profile's sizes (bench.gpu_stages)
    shutil.copy(ensure_inputs(), folder)  # the speed rows' tokenised HH-RLHF inputs (bench.gpu_speed)


def _wheels(folder: str, python: str, platform: str) -> None:
    """The product's wheel, and :data:`NEEDS` with their requirements (less :func:`_left_out`) for the target."""
    bin_dir = os.path.dirname(sys.executable)
    uv = os.path.join(bin_dir, "uv")
    needs = os.path.join(folder, "needs.in")
    os.makedirs(folder)
    with open(needs, "w") as handle:
        handle.write("\n".join(NEEDS) + "\n")
    compiled = subprocess.run(
        [uv, "pip", "compile", "-q", needs, "-c", os.path.join(ROOT, "infra", "constraints.txt"), "--no-header"]
        + ["--no-annotate", "--python-version", python, "--python-platform", platform],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    pins = [line for line in compiled if line and not _left_out(line)]
    os.remove(needs)
    pip_platform = platform.split("-", 1)[1] + "_" + platform.split("-", 1)[0]  # x86_64-manylinux_2_28 -> ..._x86_64
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", folder]
    download += ["--python-version", python, "--implementation", "cp", "--platform", pip_platform]
    download += ["--platform", "manylinux2014_" + platform.split("-", 1)[0], "--platform", "any"]
    subprocess.run(download + pins, check=True)
    with tempfile.TemporaryDirectory() as source:  # built from a copy: setuptools writes build/ beside the code
        for name in PROJECT:
            copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
            copy(os.path.join(ROOT, name), os.path.join(source, name))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", folder, source], check=True)


def _left_out(pin: str) -> bool:
    """A pin of what a CUDA torch brings (:data:`TORCH_BRINGS`, ``nvidia-*``, ``cuda-*``) or an image carries."""
    name = pin.split("==", 1)[0].strip().lower()
    return name in TORCH_BRINGS + THERE or name.startswith(("nvidia-", "cuda-"))


if __name__ == "__main__":
    typer.run(main)
