"""A registered version as an MLflow Model: a pyfunc written as models from code, what ``mlflow.pyfunc.load_model``,
``mlflow models serve --env-manager local`` and ``mlflow.models.get_model_info`` read.

A version's artifacts (``model/``) hold ``MLmodel``, the code file :data:`CODE` (it builds a :class:`ServedModel`:
nothing is pickled), the environment files, and the model's ``save_pretrained`` safetensors folder, the
:data:`WEIGHTS` artifact: the folder the pipeline registered, byte for byte (its content hash is the version's
``rlhf.model_sha256`` tag; :func:`weights_folder` finds it in a download).

What ``predict`` takes and returns (the signature in ``MLmodel`` says the same):

- a reward model: columns ``prompt`` (the user's message), ``response`` (the assistant's answer) and, optionally,
  ``kind`` (the kind of data, e.g. ``helpful``, read with that kind's score; empty: the kind gate's mix); returns
  the reward of each row (float, centred on the demonstrations as PPO reads it);
- a policy: a column ``prompt``; returns each row's sampled response; params ``max_new_tokens`` (128),
  ``temperature`` (0.7), ``greedy`` (false), ``seed`` (0).

Serving needs this project installed (``make setup``): the code file imports :mod:`tasks.kit.served` and
:mod:`rlhf`, hence ``--env-manager local``.
"""

from __future__ import annotations

import json
import os
import warnings
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files
from typing import Any

import pandas as pd
import yaml
from mlflow.pyfunc import PythonModel

CODE = str(files("tasks.kit") / "templates" / "mlflow_model.py")
WEIGHTS = "weights"  # the artifact name of the safetensors folder in the MLflow Model
MAX_PROMPT_TOKENS = 1024  # a longer prompt loses its oldest tokens
REQUIREMENTS = ("rlhf-pipeline", "torch", "transformers", "safetensors", "mlflow", "pandas")


def role(folder: str) -> str:
    """``reward`` for a sequence-classification folder, ``policy`` for a causal LM (its ``config.json``).

    Raises:
        ValueError: the folder holds neither (the message names it).
    """
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        architectures = json.load(handle).get("architectures") or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "reward"
    if any(name.endswith("ForCausalLM") for name in architectures):
        return "policy"
    raise ValueError(f"{folder}: neither a reward model nor a policy ({', '.join(architectures) or 'no architecture'})")


def signature(kind: str):
    """The ``ModelSignature`` of a reward model or a policy (:func:`role`), as the module docstring says."""
    from mlflow.models import ModelSignature  # noqa: PLC0415 (only where a model is saved)
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema  # noqa: PLC0415 (as above)

    if kind == "reward":
        inputs = Schema([ColSpec("string", "prompt"), ColSpec("string", "response"), ColSpec("string", "kind", False)])
        return ModelSignature(inputs=inputs, outputs=Schema([ColSpec("double", "reward")]))
    params = ParamSchema(
        [
            ParamSpec("max_new_tokens", "long", 128),
            ParamSpec("temperature", "double", 0.7),
            ParamSpec("greedy", "boolean", False),
            ParamSpec("seed", "long", 0),
        ]
    )
    return ModelSignature(Schema([ColSpec("string", "prompt")]), Schema([ColSpec("string", "response")]), params)


def requirements() -> list[str]:
    """The pip requirements written beside the model: this environment's versions of what serving imports."""
    pinned = []
    for name in REQUIREMENTS:
        try:
            pinned.append(f"{name}=={version(name)}")
        except PackageNotFoundError:  # not installed as a distribution (a source checkout on the path)
            pinned.append(name)
    return pinned


def save(folder: str, path: str) -> None:
    """Write the MLflow Model of the model ``folder`` into ``path`` (a folder that does not exist yet): ``MLmodel``,
    the code, the environment and a copy of ``folder`` (the :data:`WEIGHTS` artifact). Nothing is loaded or inferred.

    Raises:
        ValueError: ``folder`` is neither a reward model nor a policy.
    """
    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    with warnings.catch_warnings():  # "add type hints", "no input example": the signature above says it all
        warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow\.")
        mlflow.pyfunc.save_model(
            path,
            python_model=CODE,
            artifacts={WEIGHTS: folder},
            signature=signature(role(folder)),
            pip_requirements=requirements(),
            metadata={"rlhf.role": role(folder)},
        )
    # MLflow records the code file's absolute path on this machine; loading reads only its name
    written = mlflow.models.Model.load(path)
    written.flavors["python_function"]["model_code_path"] = os.path.basename(CODE)
    written.save(os.path.join(path, "MLmodel"))


def weights_folder(path: str) -> str:
    """The model's safetensors folder in a downloaded version: the MLflow Model's :data:`WEIGHTS` artifact, else
    ``path`` itself (a version registered before versions were MLflow Models)."""
    if not os.path.isfile(os.path.join(path, "MLmodel")):
        return path
    with open(os.path.join(path, "MLmodel"), encoding="utf-8") as handle:
        artifacts = yaml.safe_load(handle)["flavors"]["python_function"].get("artifacts") or {}
    return os.path.join(path, artifacts[WEIGHTS]["path"]) if WEIGHTS in artifacts else path


class ServedModel(PythonModel):
    """The pyfunc of a registered version: a reward model scores prompt + response rows, a policy answers prompts
    (see the module docstring)."""

    def load_context(self, context) -> None:
        import torch  # noqa: PLC0415 (the code file builds this class before anything loads)

        from rlhf.models.loading import load_causal_lm, load_scalar_model, load_tokenizer  # noqa: PLC0415 (as above)

        folder = context.artifacts[WEIGHTS]
        self.role, self.tokenizer = role(folder), load_tokenizer(folder)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        loader = load_scalar_model if self.role == "reward" else load_causal_lm
        self.model = loader(folder).to(self.device).eval()

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list:
        """Rewards (``list[float]``) or responses (``list[str]``), one per row of ``model_input`` (a DataFrame).

        Raises:
            ValueError: a column the role needs is missing.
        """
        rows = model_input.to_dict("records")
        needed = ("prompt", "response") if self.role == "reward" else ("prompt",)
        missing = [name for name in needed if name not in model_input.columns]
        if missing:
            raise ValueError(f"a {self.role} model needs the column(s) {', '.join(missing)}")
        if self.role == "reward":
            return self._rewards(rows)
        return self._responses(rows, params or {})

    def _rewards(self, rows: list[dict[str, Any]]) -> list[float]:
        from rlhf.data.chat import encode_chat  # noqa: PLC0415 (imports torch)
        from rlhf.models.shared_prompt import score_sequences  # noqa: PLC0415 (as above)
        from rlhf.runtime.device import Runtime  # noqa: PLC0415 (as above)

        length = int(getattr(self.model.config, "reward_max_length", None) or MAX_PROMPT_TOKENS)
        sequences = [
            encode_chat(
                self.tokenizer,
                [{"role": "user", "content": str(row["prompt"])}],
                [{"role": "assistant", "content": str(row["response"])}],
                length,
            ).input_ids
            for row in rows
        ]
        kinds = [row.get("kind") if isinstance(row.get("kind"), str) and row.get("kind") else "" for row in rows]
        scores = score_sequences(self.model, self.tokenizer, sequences, 8, Runtime(self.device), kinds)
        return [float(score) for score in scores.tolist()]

    def _responses(self, rows: list[dict[str, Any]], params: dict[str, Any]) -> list[str]:
        import torch  # noqa: PLC0415 (the code file builds this class before anything loads)

        from rlhf.data.chat import encode_prompt  # noqa: PLC0415 (imports torch)

        max_new_tokens = int(params.get("max_new_tokens", 128))
        torch.manual_seed(int(params.get("seed", 0)))
        positions = getattr(self.model.config, "max_position_embeddings", None) or MAX_PROMPT_TOKENS + max_new_tokens
        budget = max(1, min(MAX_PROMPT_TOKENS, positions - max_new_tokens))
        prompts = [
            encode_prompt(self.tokenizer, [{"role": "user", "content": str(row["prompt"])}], budget) for row in rows
        ]
        temperature, greedy = float(params.get("temperature", 0.7)), bool(params.get("greedy", False))
        return respond(self.model, self.tokenizer, prompts, max_new_tokens, temperature, greedy)


def respond(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float, greedy: bool):
    """Sample one response per prompt (token lists) with :func:`rlhf.models.sampling.sample` (stops at EOS); returns the
    decoded texts, special tokens left out."""
    from rlhf.models.sampling import sample  # noqa: PLC0415 (imports torch)

    rollout = sample(model, tokenizer, prompts, max_new_tokens, temperature, greedy)
    responses, masks = rollout.input_ids[:, rollout.response_start :], rollout.response_mask
    return [tokenizer.decode(r[m], skip_special_tokens=True).strip() for r, m in zip(responses, masks, strict=True)]
