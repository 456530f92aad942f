"""params.yaml as the stages read it: sections with preset and profile, refused credentials, MLflow-safe values."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import urllib.parse
from typing import Any

import yaml

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


def load_yaml(path: str, written_by_dvc: bool = False) -> Any:
    """A YAML file as DVC reads it (:class:`Yaml12Loader`), refusing values the YAML 1.1 readers take otherwise.

    ``written_by_dvc``: ``dvc.lock``, which DVC writes for YAML 1.2 readers (a string ``on`` unquoted): read, not
    checked.

    Raises:
        FileNotFoundError: no file.
        ValueError: a plain value that YAML 1.1 reads as a number or boolean and YAML 1.2 otherwise (``1_000``,
            ``1:30``, ``017``, ``yes``; names the file, line and key).
    """
    with open(path, encoding="utf-8") as handle:
        loader = Yaml12Loader(handle.read())
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if not written_by_dvc:
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
        check_no_secrets(params)
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


# Credentials never enter params.yaml: it is committed, DVC copies its params into dvc.lock (committed too) and
# every stage logs its params to MLflow. fsspec/s3fs, huggingface_hub and MLflow read credentials themselves
# from the environment or their own files.
SECRET_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "token",
        "credential",
        "credentials",
        "creds",
        "auth",
        "authorization",
        "apikey",
        "accesskey",
        "secretkey",
        "privatekey",
        "pkey",
        "sessiontoken",
        "accesstoken",
        "cookie",
        "cookies",
        "signature",
        "sig",
        "sas",
        "bearer",
    }
)
KEY_QUALIFIERS = frozenset(  # "<qualifier>_key" names a key that opens something ("sort_key" does not)
    {
        "api",
        "access",
        "secret",
        "private",
        "account",
        "master",
        "client",
        "sas",
        "shared",
        "signing",
        "encryption",
        "storage",
        "subscription",
        "auth",
        "ssh",
        "service",
    }
)
TOKENIZER_WORDS = frozenset(  # "eos_token", "pad_token_id", "max_token_length": a tokenizer's tokens, not secrets
    {"pad", "eos", "bos", "unk", "sep", "cls", "mask", "special", "end", "start", "stop", "max", "min", "num", "new"}
)
NOT_A_CREDENTIAL = {"", "anon", "anonymous", "cloud", "google_default", "cache", "browser"}  # modes, not secrets
SECRET_VALUES = (  # well-known credential formats, wherever they stand
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "an AWS access key id"),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}"), "a Hugging Face token"),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{20,})"), "a GitHub token"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\bBearer\s+\S{8,}", re.IGNORECASE), "a bearer token"),
)
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
USERINFO = re.compile(r"[^:]+://[^/@:]*:([^@]+)@")  # scheme://user:password@ (a "/" may stand in the password)
WHERE_CREDENTIALS_GO = (
    "Give credentials through the environment or the usual credential files, which fsspec/s3fs, huggingface_hub "
    "and MLflow read themselves: S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, or "
    "~/.aws/credentials (AWS_PROFILE, or storage_options.profile, picks the profile); Hugging Face: HF_TOKEN or "
    "`hf auth login`; GCS: GOOGLE_APPLICATION_CREDENTIALS; Azure: AZURE_STORAGE_CONNECTION_STRING, "
    "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN; an MLflow server: MLFLOW_TRACKING_USERNAME and "
    "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN (and the MLFLOW_TRACKING_URI variable for a URI with a "
    "database password); https with a password: ~/.netrc with storage_options.client_kwargs.trust_env: true. "
    "Settings that are not secrets (endpoint_url, anon, client_kwargs, region_name, profile) may stay."
)


def _no_credential(value: Any) -> bool:
    """A credential key's value that holds none: null, a switch (HF's ``token: true`` uses the saved token), empty,
    or a mode such as gcsfs's ``token: anon``."""
    return value is None or isinstance(value, bool) or (isinstance(value, str) and value in NOT_A_CREDENTIAL)


def _key_words(key: Any) -> list[str]:
    """A key's words: ``secretAccessKey`` -> ``secret, access, key``; ``X-Amz-Signature`` -> ``x, amz, signature``."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key))
    return [word for word in re.split(r"[^A-Za-z0-9]+", text.lower()) if word]


def is_secret_key(key: Any) -> bool:
    """Whether a params key (or a URL's query parameter) names a credential.

    Secret: a word of :data:`SECRET_WORDS` (``token``, ``password``, ``auth``, ...; ``tokens`` is a
    count), ``key`` alone or after a qualifier (``api_key``, ``access_key_id``, ``account_key``;
    not ``sort_key``), ``connection_string``. Not secret: a tokenizer's ``token`` (``eos_token``,
    ``pad_token_id``, ``max_token_length``).
    """
    words = _key_words(key)
    for i, word in enumerate(words):
        before = words[i - 1] if i else ""
        after = words[i + 1] if i + 1 < len(words) else ""
        if word == "token" and (before in TOKENIZER_WORDS or after in {"id", "ids", "length", "len", "count"}):
            continue
        if word in SECRET_WORDS or (word == "key" and (len(words) == 1 or before in KEY_QUALIFIERS)):
            return True
        if word == "connection" and after == "string":
            return True
    return False


def _url_credentials(text: str) -> str | None:
    """What credential a string's URL carries (a user and password, a signing query parameter), or None."""
    for match in URL.finditer(text):
        try:
            parts = urllib.parse.urlsplit(match.group(0))
            password = parts.password
        except ValueError:  # e.g. a malformed IPv6 host: not a URL fsspec could open either
            continue
        # a password with a "/" (AWS secrets have them) ends urlsplit's netloc early: read the text up to "@"
        userinfo = USERINFO.match(match.group(0))
        if password or (userinfo and not re.fullmatch(r"\d+(/.*)?", userinfo.group(1))):  # not host:port/path@
            return "a URL with a user and password"
        names = [name for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)]
        secret = next((name for name in names if is_secret_key(name)), None)
        if secret:
            return f"a URL whose query holds {secret}"
    return None


def find_secrets(params: Any, where: str = "") -> list[str]:
    """Every place of ``params`` (any section, any depth, lists included) that holds a credential, and why.

    A key that names a credential (:func:`is_secret_key`) is refused unless its value holds none
    (null, true/false, empty, or an anonymous mode such as gcsfs's ``token: anon``); any string is refused
    when it holds a URL with a user and password or a signing query parameter (a presigned URL), or
    a well-known credential format (:data:`SECRET_VALUES`). The keys of a ``mapping`` are a source's
    field names, not settings, so only its values are read.

    Returns:
        e.g. ``["data.storage_options.secret (a secret-looking key)", "mlflow.tracking_uri (a URL with
        a user and password)"]``; never a value.
    """
    found: list[str] = []
    if isinstance(params, dict):
        for key, value in params.items():
            path = f"{where}.{key}" if where else str(key)
            if where.rsplit(".", 1)[-1] != "mapping" and is_secret_key(key) and not _no_credential(value):
                found.append(f"{path} (a secret-looking key)")
                continue
            found += find_secrets(value, path)
    elif isinstance(params, (list, tuple)):
        for i, value in enumerate(params):
            found += find_secrets(value, f"{where}[{i}]")
    elif isinstance(params, str):
        why = _url_credentials(params) or next((what for rule, what in SECRET_VALUES if rule.search(params)), None)
        if why:
            found.append(f"{where or 'a value'} ({why})")
    return found


def check_no_secrets(params: Any, path: str = PARAMS_FILE) -> None:
    """Refuse params that hold credentials (:func:`find_secrets`), naming each place and where credentials go.

    Raises:
        ValueError: e.g. ``params.yaml holds credentials at data.storage_options.key (a secret-looking key);
            ... Give credentials through the environment ...`` (the values are never repeated).
    """
    found = find_secrets(params)
    if found:
        raise ValueError(
            f"{path} holds credentials at {'; '.join(found)}. Credentials never go into {path}: it is committed, "
            f"DVC copies params into dvc.lock and MLflow logs them; remove them. {WHERE_CREDENTIALS_GO}"
        )


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
    ``<redacted>`` (:func:`read_params` has refused such params already; this covers params built
    elsewhere).
    """
    pairs: list[tuple[str, Any]] = []

    def walk(value: Any, key: str, secret: bool) -> None:
        if secret and not _no_credential(value):
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
