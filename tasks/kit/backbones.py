"""A backbone from any ``model.source`` form (GGUF, Hugging Face folder or hub id) saved as a safetensors folder:
the base_model stage's output, and the judge's own backbone (``judge.source``)."""

from __future__ import annotations

from rlhf.models.loading import load_base_model, save_tokenizer
from tasks.kit.common import one_line


def save_source(source: str, folder: str, random_init: dict | None = None, seed: int = 0, key: str = "model.source"):
    """Load ``source`` (the ``model.source`` forms) and save it with its tokenizer as safetensors in ``folder``.

    Returns the model. ``key`` names the setting in errors (``judge.source`` for the judge's backbone).

    Raises:
        FileNotFoundError: the source is not a local path and loading it failed (one line).
    """
    try:
        model, tokenizer = load_base_model(source, random_init, seed)
    except FileNotFoundError:
        raise
    except OSError as err:  # a hub id the hub does not know, or no network: transformers' message is a page long
        first = one_line(str(err)) or type(err).__name__
        raise FileNotFoundError(f"{key} {source!r}: not a local path, and loading it failed: {first}") from None
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    return model
