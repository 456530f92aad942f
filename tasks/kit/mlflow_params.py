"""params as MLflow takes them: flattened, each key and value within MLflow's limits."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from tasks.kit.secrets import is_secret_key, no_credential

MLFLOW_KEY_MAX = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH


MLFLOW_VALUE_MAX = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH


def mlflow_text(value: Any) -> str:
    """A param value as text any MLflow backend stores: no lone surrogate, no NUL, at most 6000 characters.

    A longer value keeps its start and ends with its length and a hash, so two long values stay apart.
    """
    text = value if isinstance(value, str) else str(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    if len(text) <= MLFLOW_VALUE_MAX:
        return text
    tail = f"... [{len(text)} chars, sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}]"
    return text[: MLFLOW_VALUE_MAX - len(tail)] + tail


def _mlflow_key(key: str, taken: set[str]) -> str:
    """``key`` as an MLflow param name: ASCII letters, digits, ``_.- `` only, not a path that normalises to
    another, at most 250 characters, and not one of ``taken`` (a ``-2``, ``-3``... suffix tells them apart)."""
    name = re.sub(r"[^A-Za-z0-9_.\- ]", "_", key)
    if not name.strip(".") or name.startswith(".."):
        name = "_" + name
    if len(name) > MLFLOW_KEY_MAX:
        name = name[: MLFLOW_KEY_MAX - 13] + "-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    base, n = name, 1
    while name in taken:
        n += 1
        name = base[: MLFLOW_KEY_MAX - len(f"-{n}")] + f"-{n}"
    return name


def mlflow_params(params: dict[str, Any], reserved: tuple[str, ...] = ()) -> dict[str, str]:
    """Stage params as MLflow params that every backend accepts, whatever params.yaml holds.

    Nested dicts and lists are flattened (``data.more_sources.0.source``); values become text
    (:func:`mlflow_text`); keys are made valid and unique (:func:`_mlflow_key`), apart from
    ``reserved`` (names logged separately). A value under a credential-looking key is logged as
    ``<redacted>`` (:func:`tasks.kit.params.read_params` has refused such params already; this covers params built
    elsewhere).
    """
    pairs: list[tuple[str, Any]] = []

    def walk(value: Any, key: str, secret: bool) -> None:
        if secret and not no_credential(value):
            pairs.append((key, "<redacted>"))
        elif isinstance(value, dict) and value:
            for sub, item in value.items():
                walk(item, f"{key}.{sub}" if key else str(sub), is_secret_key(sub))
        elif isinstance(value, (list, tuple)) and value:
            for i, item in enumerate(value):
                walk(item, f"{key}.{i}" if key else str(i), False)
        else:
            pairs.append((key, value))

    walk(params, "", False)
    taken, logged = set(reserved), {}
    for key, value in pairs:
        name = _mlflow_key(key, taken)
        taken.add(name)
        logged[name] = mlflow_text(value)
    return logged


def flatten_params(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
