"""Typed configs from params.yaml sections: the one place a section's keys and value types are checked.

The core's dataclasses (``SFTConfig``, ``PPOConfig``, ``GateCriteria``, ...) stay free of params.yaml; a stage
reads its section with :func:`tasks.kit.params.stage_params` and builds its config here. Imports nothing heavy, so a
data stage that builds a config does not pay for torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DERIVED = {  # (section, field) -> the key of another section whose value it takes: one value, written once
    ("validate", "max_length"): "reward.max_length",  # validation cuts pairs as the reward model reads them
    ("evaluate", "judge_max_length"): "judge.max_length",  # the judge scores at the length it was trained at
    ("evaluate", "ptx_max_length"): "ppo.ptx_max_length",  # the alignment tax reads ptx rows as PPO-ptx trains on them
    ("evaluate", "max_prompt_length"): "ppo.max_prompt_length",  # the policy is evaluated on prompts as it trained
    # the judge's length floor is the reward gate's: below it a scorer ranks by length
    ("evaluate", "judge_min_length_accuracy"): "registry.reward_gate.min_length_accuracy",
}


def derived_values(section: str, stage_params) -> dict[str, tuple[str, Any]]:
    """The fields of ``section`` that :data:`DERIVED` takes from other sections: field -> (source key, its value),
    each source section read by ``stage_params`` (profile and preset applied)."""
    found = {}
    for (owner, field), source in DERIVED.items():
        if owner == section:
            first, *rest = source.split(".")
            value = stage_params(first)
            for key in rest:
                value = value[key]
            found[field] = (source, value)
    return found


def config_from_params(
    cls: type, params: dict[str, Any], section: str, derived: dict[str, tuple[str, Any]] | None = None
) -> Any:
    """Build the dataclass ``cls`` from a params.yaml section, checking keys and types.

    A typed field takes a number written as a string too (``"3e-5"`` for a float, ``"8"`` for an int: a YAML 1.1
    reader, or a quoted value); int fields take whole numbers only, bool fields true/false; ``None`` is accepted
    where the field allows it. ``derived`` (:func:`derived_values`): fields whose value another section's key
    holds; the section itself must not set them.

    Raises:
        ValueError: a key that is not a field of ``cls``, a derived key set in the section (names both keys),
            or a value of the wrong type (names the section and key).
    """
    fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(f"params.yaml: section {section!r} has unknown keys {unknown}; known: {sorted(fields)}")
    for key, (source, value) in (derived or {}).items():
        if key in params:
            raise ValueError(
                f"params.yaml: {section}.{key} ({params[key]!r}) is derived from {source} ({value!r}): remove it "
                f"and set {source}"
            )
    params = {**params, **{key: value for key, (_, value) in (derived or {}).items()}}
    values = dict(params)
    for key, value in params.items():
        kind = fields[key]
        if value is None:
            if "None" not in kind:
                raise ValueError(f"params.yaml: {section}.{key} must be set (got null)")
        elif kind.startswith("float"):
            try:
                if isinstance(value, bool):
                    raise TypeError
                values[key] = float(value)
            except (ValueError, TypeError):
                raise ValueError(f"params.yaml: {section}.{key} must be a number, got {value!r}") from None
        elif kind.startswith("int"):
            if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
                values[key] = value = int(value)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"params.yaml: {section}.{key} must be an integer, got {value!r}")
        elif kind.startswith("bool") and not isinstance(value, bool):
            raise ValueError(f"params.yaml: {section}.{key} must be true or false, got {value!r}")
        elif kind.startswith("str") and not isinstance(value, str):
            raise ValueError(f"params.yaml: {section}.{key} must be a string, got {value!r}")
    try:
        return cls(**values)
    except ValueError as error:  # the config's own rules (ranges, choices) name the key but not the file
        text = str(error)
        raise ValueError(text if text.startswith("params.yaml") else f"params.yaml: {text}") from None


def longest_response(stage_params) -> tuple[str, int]:
    """The longest response a reward model or the judge scores, ``(key, tokens)``: ``generation.max_new_tokens``
    (PPO's rollouts and, by default, evaluation's samples) or ``evaluate.max_new_tokens`` where it is larger.
    ``stage_params(section)`` reads a section (profile applied)."""
    rollouts, evaluated = stage_params("generation")["max_new_tokens"], stage_params("evaluate").get("max_new_tokens")
    if evaluated is not None and int(evaluated) > int(rollouts):
        return "evaluate.max_new_tokens", int(evaluated)
    return "generation.max_new_tokens", int(rollouts)
