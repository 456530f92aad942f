"""Range checks: a setting outside its domain is refused with one line naming it."""

from __future__ import annotations


def check_schedule(section: str, name: str, warmup_steps: int) -> None:
    """Refuse warm-up with the ``constant`` schedule, which would silently ignore it.

    Args:
        section: params.yaml section named in the message (e.g. ``"ppo"``), or ``""``.
        name: schedule name; warmup_steps: optimiser steps of warm-up.

    Raises:
        ValueError: ``warmup_steps > 0`` with ``constant``.
    """
    if warmup_steps and name == "constant":
        prefix = f"{section}." if section else ""
        raise ValueError(
            f"{prefix}warmup_steps is {warmup_steps} but {prefix}scheduler 'constant' has no warm-up: "
            "use constant_with_warmup (or linear, cosine), or set warmup_steps to 0"
        )


_RANGES = {
    "at_least_1": (lambda v: v >= 1, "at least 1"),
    "positive": (lambda v: v > 0, "above 0"),
    "non_negative": (lambda v: v >= 0, "at least 0"),
    "unit": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def check_ranges(section: str, config: object, **rules: tuple[str, ...]) -> None:
    """Refuse a numeric setting outside its domain (a null one, which switches a feature off, passes).

    Args:
        section: params.yaml section named in the message (e.g. ``"ppo"``).
        config: the config whose fields are checked.
        rules: a rule of :data:`_RANGES` (``at_least_1``, ``positive``, ``non_negative``, ``unit``) mapped to
            the field names it applies to.

    Raises:
        ValueError: the first field out of its range, e.g. ``ppo.iterations must be at least 1, got -1``.
    """
    for rule, names in rules.items():
        holds, wording = _RANGES[rule]
        for name in names:
            value = getattr(config, name)
            if value is not None and not holds(value):
                raise ValueError(f"{section}.{name} must be {wording}, got {value}")
