"""Typed configs from params.yaml sections: the one place a section's keys and value types are checked.

The core's dataclasses (``SFTConfig``, ``PPOConfig``, ``GateCriteria``, ...) stay free of params.yaml; a stage
reads its section with :func:`tasks.params.stage_params` and builds its config here. Imports nothing heavy, so a
data stage that builds a config does not pay for torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def config_from_params(cls: type, params: dict[str, Any], section: str) -> Any:
    """Build the dataclass ``cls`` from a params.yaml section, checking keys and types.

    A typed field takes a number written as a string too (``"3e-5"`` for a float, ``"8"`` for an int: a YAML 1.1
    reader, or a quoted value); int fields take whole numbers only, bool fields true/false; ``None`` is accepted
    where the field allows it.

    Raises:
        ValueError: a key that is not a field of ``cls``, or a value of the
            wrong type (names the section and key).
    """
    fields = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ValueError(f"params.yaml: section {section!r} has unknown keys {unknown}; known: {sorted(fields)}")
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
    return cls(**values)
