"""Loading models and tokenizers: the base model (any ``model.source``), the project's causal LMs and scalar
models (reward, judge, value), safetensors only and ``trust_remote_code=False``; the tokenizer's pad made
distinct from its EOS and the chat template's default system prompt removed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as transformers_logging

from rlhf.models.kind_heads import KINDS_KEY, head_kinds, output_count
from rlhf.runtime.finite import non_finite_weights

PAD_TOKEN = "<|endoftext|>"
"""A pad token distinct from EOS (``<|im_end|>``), so a mask never hides a real end token."""


_DEFAULT_SYSTEM_BLOCK = re.compile(
    r"\{%-?\s*if loop\.first and messages\[0\]\['role'\] != 'system'\s*-?%\}.*?\{%-?\s*endif\s*-?%\}", re.S
)


def resolve_model_source(source: str) -> tuple[str, str | None]:
    """Turn ``model.source`` into ``(path_or_hub_id, gguf_file)`` for ``from_pretrained``.

    Args:
        source: ``"pypi:<package>"`` (a GGUF shipped in an installed package,
            found with ``importlib.util.find_spec`` without importing it), a
            ``.gguf`` file path, a local HF folder, or a hub id.

    Raises:
        FileNotFoundError: the package is not installed or holds no ``.gguf`` file, a ``.gguf`` path does not
            exist, or a folder is not an HF model folder (no ``config.json``).
    """
    if source.startswith("pypi:"):
        package = source.removeprefix("pypi:").replace("-", "_")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model.source {source!r}: package {package!r} is not installed")
        folder = list(spec.submodule_search_locations)[0]
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if not ggufs:
            raise FileNotFoundError(f"model.source {source!r}: no .gguf file in {folder}")
        return folder, ggufs[0]
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"model.source {source!r}: no such file")
        return os.path.dirname(os.path.abspath(source)), os.path.basename(source)
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json")):
        raise FileNotFoundError(f"model.source {source!r}: a folder, but not an HF model folder (no config.json)")
    return source, None


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token distinct from EOS and drop the chat template's default system prompt.

    SmolLM2's template inserts "You are a helpful AI assistant named SmolLM..."
    when a conversation has no system message; the pipeline leaves it out (a
    conversation that brings its own system message keeps it).

    Args:
        tokenizer: a tokenizer with a chat template.

    Raises:
        ValueError: the tokenizer has no ``<|endoftext|>`` token, or it equals EOS.
    """
    if PAD_TOKEN not in tokenizer.get_vocab():
        raise ValueError(f"tokenizer has no {PAD_TOKEN} token to use as pad")
    tokenizer.pad_token = PAD_TOKEN
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError("pad token equals EOS; masks would hide real end tokens")
    if tokenizer.chat_template:
        tokenizer.chat_template = _DEFAULT_SYSTEM_BLOCK.sub("", tokenizer.chat_template)
    return tokenizer


def load_base_model(
    source: str, random_init: dict[str, Any] | None = None, seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the base causal LM and its tokenizer, ready to save as safetensors.

    A GGUF source is dequantised to float32 and its quantization config removed
    (otherwise it can be neither saved nor trained). With ``random_init`` (a
    dict of ``LlamaConfig`` fields) the weights are a random Llama of that size
    with the source's tokenizer: the ``tiny`` profile.

    Args:
        source: see :func:`resolve_model_source`.
        random_init: ``None`` for the real weights, else LlamaConfig overrides.
        seed: seed of the random initialisation.

    Returns:
        ``(model, tokenizer)``; float32 model, tokenizer from :func:`prepare_tokenizer`.
    """
    path, gguf_file = resolve_model_source(source)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, trust_remote_code=False))
    if random_init is not None:
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **random_init,
        )
        model: PreTrainedModel = LlamaForCausalLM(config)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, gguf_file=gguf_file, dtype=torch.float32, trust_remote_code=False
        )
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model, tokenizer


def _refuse_non_finite(model: PreTrainedModel, path: str) -> PreTrainedModel:
    """Return ``model``, or refuse one whose weights (or a number of its config, e.g. ``reward_offset``) are not
    finite: a diverged run's output. The message names ``path``."""
    numbers = {k: v for k, v in model.config.to_dict().items() if isinstance(v, float)}
    bad = non_finite_weights(model) + [f"config.{k}" for k, v in numbers.items() if not math.isfinite(v)]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ValueError(
            f"{path}: model weights are not finite (NaN or inf in {shown}); refusing to load it: "
            "retrain the stage that wrote it"
        )
    return model


NEW_HEAD = "score."  # a sequence-classification head made for a causal LM's folder (a reward, judge or value model)


UNUSED_HEAD = "lm_head."  # a causal LM's own output layer, which a sequence-classification model has no use for


# a decoder block's weight: model.layers.7.mlp... (Llama and most decoders), transformer.h.7... (GPT-2)
_BLOCK_KEY = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _dropped_block(key: str, first_dropped: int | None) -> bool:
    """Whether ``key`` is a weight of a decoder block at index ``first_dropped`` or above (None: never)."""
    found = _BLOCK_KEY.search(key)
    return first_dropped is not None and found is not None and int(found.group(1)) >= first_dropped


def _from_pretrained(auto: Any, path: str, first_dropped: int | None = None, **kwargs: Any) -> PreTrainedModel:
    """``auto.from_pretrained(path)`` in float32, safetensors only, no remote code; any failure to read the folder
    (a truncated or corrupt ``model.safetensors``, a broken ``config.json``, a missing file) is one ValueError
    naming ``path``, never a loader's traceback.

    transformers' load report is checked here instead of printed: a weight the folder lacks (other than a new
    :data:`NEW_HEAD`, expected when a scalar model starts from a causal LM) or holds that the model does not
    use (other than :data:`UNUSED_HEAD`, and the decoder blocks from ``first_dropped`` on, which a model asked to
    keep fewer blocks leaves unread) is a ValueError naming them.
    """
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the report of a new head alarms a reader; it is checked below
    try:
        model, info = auto.from_pretrained(
            path, dtype=torch.float32, use_safetensors=True, trust_remote_code=False, output_loading_info=True, **kwargs
        )
    except Exception as err:  # SafetensorError, OSError, JSONDecodeError, RuntimeError: the kind varies by loader
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{path}: cannot load the model ({type(err).__name__}: {first}): the folder is incomplete or corrupt; "
            "rerun the stage that wrote it (or download the version again)"
        ) from err
    finally:
        transformers_logging.set_verbosity(verbosity)
    missing = sorted(key for key in info["missing_keys"] if not key.startswith(NEW_HEAD))
    unused = sorted(
        key
        for key in info["unexpected_keys"]
        if not (key.startswith(UNUSED_HEAD) or _dropped_block(key, first_dropped))
    )
    if missing or unused or info["mismatched_keys"]:
        raise ValueError(
            f"{path}: the weights do not fit a {type(model).__name__}: missing {missing[:5]}, unused {unused[:5]}, "
            f"of another shape {sorted(info['mismatched_keys'])[:5]}; the folder holds another architecture"
        )
    return model


def load_causal_lm(path: str) -> PreTrainedModel:
    """Load a causal LM saved by this project (safetensors only, no remote code), dropout off.

    Raises:
        ValueError: the folder cannot be read (:func:`_from_pretrained`), or a weight is NaN or infinite (the
            message names ``path``).
    """
    return disable_dropout(_refuse_non_finite(_from_pretrained(AutoModelForCausalLM, path), path))


def load_scalar_model(
    path: str, kinds: list[str] | None = None, num_hidden_layers: int | None = None
) -> PreTrainedModel:
    """Load a reward or value model (a sequence-classification head), dropout off.

    From a causal-LM folder the head is new (initialised by transformers): one output, or with ``kinds`` a score
    and a gate logit per kind (:mod:`rlhf.models.kind_heads`); from a reward-model folder it is the trained head, with
    the kinds its config keeps. ``num_hidden_layers`` keeps only the folder's first that many decoder blocks (the
    ones above are not loaded; ``reward.num_hidden_layers``): the model reads with a shallower backbone and is
    saved so; None keeps them all.

    Raises:
        ValueError: the folder cannot be read (:func:`_from_pretrained`), a weight is NaN or infinite (the
            message names ``path``), or ``num_hidden_layers`` is more than the folder's blocks.
    """
    kinds = list(kinds or []) or _stored_kinds(path)
    depth: dict[str, Any] = {}
    if num_hidden_layers is not None:
        stored = block_count(path)
        if stored is not None and num_hidden_layers > stored:
            raise ValueError(f"{path}: num_hidden_layers {num_hidden_layers} is more than the model's {stored} blocks")
        depth = {"num_hidden_layers": num_hidden_layers, "first_dropped": num_hidden_layers}
    model = _from_pretrained(AutoModelForSequenceClassification, path, num_labels=output_count(kinds), **depth)
    if kinds:
        setattr(model.config, KINDS_KEY, kinds)
    return disable_dropout(_refuse_non_finite(model, path))


def block_count(path: str) -> int | None:
    """The decoder blocks of a saved model, as its config names them (``num_hidden_layers``, GPT-2's ``n_layer``);
    None when the folder's config cannot be read (loading it then says why)."""
    try:
        return int(AutoConfig.from_pretrained(path, trust_remote_code=False).num_hidden_layers)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _stored_kinds(path: str) -> list[str]:
    """The head kinds a saved model's ``config.json`` keeps (``[]``: none, or no readable config to say)."""
    try:
        with open(os.path.join(path, "config.json")) as handle:
            return head_kinds(json.load(handle))
    except (OSError, ValueError, AttributeError):  # _from_pretrained reports an unreadable folder
        return []


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved with a model folder; checks the pad token is distinct from EOS.

    Raises:
        ValueError: pad equals EOS.
    """
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"{path}: tokenizer pad token must be set and differ from EOS")
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str) -> None:
    """Save ``tokenizer`` into a model folder with its chat template where every consumer looks.

    transformers writes the template to ``chat_template.jinja`` only; tools that read ``tokenizer_config.json``
    (older transformers, llama.cpp's converter, vLLM's and TGI's loaders of a given version) then find none
    and fall back to a default template. The same text also goes into ``tokenizer_config.json``'s
    ``chat_template`` key.
    """
    tokenizer.save_pretrained(folder)
    if isinstance(tokenizer.chat_template, str):
        config_path = os.path.join(folder, "tokenizer_config.json")
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
        config["chat_template"] = tokenizer.chat_template
        with open(config_path, "w", encoding="utf-8") as file:
            json.dump(config, file, indent=2, ensure_ascii=False)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Switch every dropout of ``model`` off (RLHF trains without dropout: it breaks the PPO ratio).

    Sets the probability of each ``nn.Dropout`` to 0 and every float config
    field or module attribute whose name ends in ``dropout`` to 0.0 (Llama's
    attention reads ``attention_dropout`` from the module, not a Dropout layer).
    """
    config = getattr(model, "config", None)
    for key, value in config.to_dict().items() if config is not None else []:
        if key.endswith("dropout") and isinstance(value, float):
            setattr(config, key, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if name.endswith("dropout") and isinstance(value, float):
                setattr(module, name, 0.0)
    return model
