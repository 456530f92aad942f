"""params.yaml as the stages read it: YAML 1.2 as DVC reads it, sections with preset and profile, credentials
refused (:mod:`tasks.kit.secrets`)."""

from __future__ import annotations

import copy
import hashlib
import os
import re
from typing import Any

import yaml

from tasks.kit.secrets import check_no_secrets

PARAMS_FILE = "params.yaml"


_BOOL, _INT, _FLOAT, _NULL, _STR = (f"tag:yaml.org,2002:{kind}" for kind in ("bool", "int", "float", "null", "str"))


_CORE_SCALARS = (
    (_NULL, re.compile(r"^(?:~|null|Null|NULL|)$"), "~nN"),
    (_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), "tTfF"),
    (_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), "-+0123456789"),
    (
        _FLOAT,
        re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        "-+.0123456789",
    ),
)
"""The YAML 1.2 core schema's plain scalars: tag, pattern, the characters they may start with."""


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading plain scalars by the YAML 1.2 core schema, as DVC (ruamel.yaml) does.

    PyYAML implements YAML 1.1: ``1e-05`` and ``1.0e9`` (what ``dvc exp run -S`` writes) are strings there,
    while ``017`` is octal 15, ``1_000`` is 1000, ``1:30`` is 90 and ``yes``/``off`` are booleans, none of which
    YAML 1.2 reads so. Here ints are ``[-+]?[0-9]+``, ``0o..`` and ``0x..``; floats ``1.5``, ``.5``, ``1e-05``,
    ``1.0e9``, ``.inf``, ``.nan``; booleans ``true``/``false``; null ``~``, ``null`` or nothing.
    """

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        value = self.construct_scalar(node)
        return int(value, 16) if value.startswith("0x") else int(value[2:], 8) if value.startswith("0o") else int(value)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = self.construct_scalar(node).lower()
        return float(value.replace(".inf", "inf").replace(".nan", "nan"))

    def construct_yaml_bool(self, node: yaml.ScalarNode) -> bool:
        return self.construct_scalar(node).lower() == "true"


Yaml12Loader.yaml_implicit_resolvers = {}


for _tag, _pattern, _first in _CORE_SCALARS:
    Yaml12Loader.add_implicit_resolver(_tag, _pattern, list(_first) + ([""] if _tag == _NULL else []))  # "a:" is null


for _tag, _pattern in yaml.SafeLoader.yaml_implicit_resolvers.get(
    "<", []
) + yaml.SafeLoader.yaml_implicit_resolvers.get("=", []):
    if _tag not in (_BOOL, _INT, _FLOAT, _NULL):  # merge keys and "=" values keep PyYAML's reading
        Yaml12Loader.add_implicit_resolver(_tag, _pattern, None)


for _tag, _method in ((_INT, "construct_yaml_int"), (_FLOAT, "construct_yaml_float"), (_BOOL, "construct_yaml_bool")):
    Yaml12Loader.add_constructor(_tag, getattr(Yaml12Loader, _method))


def _same_reading(old: Any, new: Any) -> bool:
    return type(old) is type(new) and (old == new or old != old and new != new)  # NaN reads as NaN


def _check_portable(node: yaml.Node, key: str, where: str, loader: Yaml12Loader) -> None:
    """Refuse a plain scalar that YAML 1.1 reads as a number or boolean and YAML 1.2 reads otherwise.

    Raises:
        ValueError: names the file, line and key, the value and how each version reads it.
    """
    if isinstance(node, yaml.MappingNode):
        for name, value in node.value:
            _check_portable(value, f"{key}.{name.value}" if key else str(name.value), where, loader)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_portable(item, f"{key}[{index}]", where, loader)
    elif isinstance(node, yaml.ScalarNode) and node.style is None:
        try:
            old = yaml.safe_load(node.value)  # PyYAML's YAML 1.1 reading of the same plain text
        except yaml.YAMLError:
            return
        new = loader.construct_object(node)
        if isinstance(old, (bool, int, float)) and not _same_reading(old, new):
            raise ValueError(
                f"{where}:{node.start_mark.line + 1}: {key} is {node.value}, which YAML 1.1 reads as {old!r} and "
                f"YAML 1.2 (DVC) as {new!r}: write it so both agree (a number as 1000 or 1.0e-5, a boolean as "
                f"true or false, a string in quotes)"
            )


def _check_unique_keys(node: yaml.Node, key: str, where: str) -> None:
    """Refuse a mapping that gives a key twice: PyYAML keeps the last silently, DVC (ruamel.yaml) refuses the file.

    Raises:
        ValueError: names the file, both lines and the key.
    """
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for name, value in node.value:
            here = f"{key}.{name.value}" if key else str(name.value)
            if isinstance(name, yaml.ScalarNode) and name.value != "<<":  # merge keys may repeat
                if name.value in seen:
                    raise ValueError(
                        f"{where}:{name.start_mark.line + 1}: {here} is given twice (first on line "
                        f"{seen[name.value]}); YAML keeps one of them silently and DVC refuses the file: delete one"
                    )
                seen[name.value] = name.start_mark.line + 1
            _check_unique_keys(value, here, where)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, f"{key}[{index}]", where)


def load_yaml(path: str, written_by_dvc: bool = False) -> Any:
    """A YAML file as DVC reads it (:class:`Yaml12Loader`), refusing values the YAML 1.1 readers take otherwise.

    ``written_by_dvc``: ``dvc.lock``, which DVC writes for YAML 1.2 readers (a string ``on`` unquoted): read, not
    checked.

    Raises:
        FileNotFoundError: no file.
        ValueError: text that is not YAML (names the file, line and column and what the parser expected), a key
            given twice in one mapping (names both lines), or a plain value that YAML 1.1 reads as a number or
            boolean and YAML 1.2 otherwise (``1_000``, ``1:30``, ``017``, ``yes``; names the file, line and key).
    """
    with open(path, encoding="utf-8") as handle:
        loader = Yaml12Loader(handle.read())
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            at = f"{mark.line + 1}:{mark.column + 1}" if mark else "?"
            problem = "; ".join(part for part in (error.context, error.problem) if part)
            raise ValueError(f"{path}:{at}: not valid YAML: {problem}") from None
        if node is None:
            return None
        if not written_by_dvc:
            _check_unique_keys(node, "", path)
            _check_portable(node, "", path, loader)
        return loader.construct_document(node)
    finally:
        loader.dispose()


_READ: dict[tuple[str, str], dict[str, Any]] = {}  # (real path, sha256 of its bytes) -> the checked params


def read_params(path: str = PARAMS_FILE) -> dict[str, Any]:
    """Read params.yaml as DVC does (:func:`load_yaml`: YAML 1.2 numbers), refusing credentials in it
    (:func:`check_no_secrets`) before any stage writes anything.

    The file is parsed and checked once per process while its content stays the same (its bytes are hashed at
    each call, a fraction of the parse); each call returns its own copy, so a caller may change what it gets.

    Raises:
        FileNotFoundError: no params file.
        ValueError: the file holds a credential (the message names where, never the value), or a value that
            YAML 1.1 and 1.2 read differently (:func:`load_yaml`).
    """
    with open(path, "rb") as handle:
        key = (os.path.realpath(path), hashlib.sha256(handle.read()).hexdigest())
    if key not in _READ:
        params = load_yaml(path)
        check_no_secrets(params, path)
        _READ.clear()
        _READ[key] = params
    return copy.deepcopy(_READ[key])


def stage_params(section: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The params of one section with its preset (if any) and then the active profile's overrides applied.

    A section may hold ``preset`` + ``presets: {name: overrides}`` and
    ``profiles: {name: overrides}``; both keys are removed from the result.
    A key that a preset sets lives only in ``presets``: the same key at the
    section's top level would read as the value in effect and silently not be
    (a profile may still override it: profiles are applied last, by design).

    Raises:
        ValueError: the section, preset or profile does not exist, or a key of a
            preset also stands at the section's top level (names both places), or
            the params hold a credential (:func:`check_no_secrets`).
    """
    if not params:
        params = read_params()
    else:
        check_no_secrets(params, PARAMS_FILE)
    if section not in params:
        raise ValueError(f"{PARAMS_FILE}: no section {section!r}")
    values = copy.deepcopy(params[section])
    presets = values.pop("presets", {}) or {}
    preset = values.pop("preset", None)
    for name, overrides in sorted(presets.items(), key=lambda item: item[0] != preset):  # the active one first
        clash = sorted(set(overrides or {}) & set(values) - {"profiles"})
        if clash:
            raise ValueError(
                f"{PARAMS_FILE}: {section}.{clash[0]} is set both at the top of section {section!r} and in "
                f"{section}.presets.{name}; a preset's keys live only in the preset (edit it there, or drop it "
                f"from every preset to set it at the top)"
            )
    if preset is not None:
        if preset not in presets:
            raise ValueError(f"{PARAMS_FILE}: {section}.preset is {preset!r}; known presets: {sorted(presets)}")
        values.update(presets[preset])
    profiles = values.pop("profiles", {})
    profile = params.get("profile", DEFAULT_PROFILE)
    if profile not in known_profiles(params):
        raise ValueError(f"{PARAMS_FILE}: profile is {profile!r}; known profiles: {sorted(known_profiles(params))}")
    values.update((profiles or {}).get(profile, {}))
    return values


DEFAULT_PROFILE = "demo"  # the embedded defaults: the sections' own values, no overrides


def known_profiles(params: dict[str, Any]) -> set[str]:
    """The default profile and every profile that some section's ``profiles`` names."""
    named = {name for section in params.values() if isinstance(section, dict) for name in section.get("profiles") or {}}
    return {DEFAULT_PROFILE} | named
