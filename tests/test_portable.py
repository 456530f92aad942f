"""An exported folder that transformers 4.57 (the last 4.x) loads as 5.x does: the keys it reads, by hand, and once
for real in a throwaway environment with 4.57 installed (integration)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tasks.kit.portable import make_portable, portable_config, portable_tokenizer_config


def test_the_config_gains_4x_rope_and_dtype_keys_beside_5x_ones():
    config = {"dtype": "bfloat16", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    assert portable_config(config) == {
        **config,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
    }
    scaled = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    assert portable_config(scaled)["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    assert portable_config({"model_type": "gpt2"}) == {"model_type": "gpt2"}


def test_the_tokenizer_config_names_a_class_both_lines_have():
    written = {"tokenizer_class": "TokenizersBackend", "backend": "tokenizers", "is_local": True, "eos_token": "e"}
    assert portable_tokenizer_config(written) == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "e"}


@pytest.mark.integration
def test_transformers_4_57_loads_an_export_with_its_rope_and_chat_template(tiny_dir, tmp_path):
    """A venv beside the test with transformers 4.57 (uv: the project's installer; torch from the same index)."""
    folder = tmp_path / "export"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 100000.0  # SmolLM2's, which 4.x must not read as 10,000
    (folder / "config.json").write_text(json.dumps(config))
    make_portable(str(folder))
    venv, uv = tmp_path / "t457", os.path.join(os.path.dirname(sys.executable), "uv")
    links = ["--find-links", os.environ["PIP_FIND_LINKS"]] if os.environ.get("PIP_FIND_LINKS") else []
    subprocess.run([uv, "venv", "-q", str(venv), "--python", sys.executable], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([uv, "pip", "install", "-q", "--python", python, *links, "transformers>=4.57,<4.58",
                    "torch==2.13.0"], check=True)  # fmt: skip
    probe = (
        "import sys, transformers; from transformers import AutoModelForCausalLM, AutoTokenizer; "
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
        "print(transformers.__version__, type(t).__name__, m.config.rope_theta, t.eos_token); "
        "print(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, add_generation_prompt=True))"
    )
    result = subprocess.run([python, "-c", probe, str(folder)], capture_output=True, text=True, check=True)
    version, rest = result.stdout.split(" ", 1)
    assert version.startswith("4.57.") and rest.startswith("PreTrainedTokenizerFast 100000.0 <|im_end|>\n"), result
    assert result.stdout.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n\n"), result.stdout
