"""An exported folder that any current transformers loads: the 5.x files this project writes, with the keys the
4.x line (4.57, its last) reads beside them.

transformers 5 names the tokenizer class ``TokenizersBackend`` (4.x: ``PreTrainedTokenizerFast``, the same
``tokenizer.json``) and keeps RoPE's base in ``rope_parameters`` (4.x reads ``rope_theta`` at the top of the config
and, finding none, silently uses 10,000: SmolLM2's is 100,000). Both readers ignore the other's keys.
"""

from __future__ import annotations

import json
import os
from typing import Any

FAST_TOKENIZER = "PreTrainedTokenizerFast"  # the class both lines load a tokenizer.json with
LOAD_TIME_KEYS = ("is_local", "local_files_only")  # where the tokenizer was read from: not the tokenizer's


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` with 4.x's RoPE and dtype keys added beside 5.x's (``rope_theta``, ``rope_scaling`` from
    ``rope_parameters``; ``torch_dtype`` from ``dtype``); a config without ``rope_parameters`` is returned as is.

    e.g. ``{"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}`` gains ``"rope_theta": 1e5,
    "rope_scaling": null``.
    """
    config = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        config.setdefault("rope_scaling", None if scaling.get("rope_type", "default") == "default" else scaling)
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    return config


def portable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json`` naming a class both lines have (:data:`FAST_TOKENIZER` for 5.x's
    ``TokenizersBackend``), without the keys that only record where it was loaded from."""
    config = {key: value for key, value in config.items() if key not in LOAD_TIME_KEYS}
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = FAST_TOKENIZER
        config.pop("backend", None)
    return config


def make_portable(folder: str) -> None:
    """Rewrite ``folder``'s ``config.json`` and ``tokenizer_config.json`` with :func:`portable_config` and
    :func:`portable_tokenizer_config` (a file that is not there is left so).

    Raises:
        ValueError: a file is not a JSON object (names it).
    """
    for name, rewrite in (("config.json", portable_config), ("tokenizer_config.json", portable_tokenizer_config)):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
        if not isinstance(content, dict):
            raise ValueError(f"{path}: not a JSON object")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(rewrite(content), handle, indent=2, sort_keys=True)
            handle.write("\n")
