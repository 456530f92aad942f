"""Credentials kept out of params: a key that names a secret, a known credential format, a URL's password.

Each place found is named, with where credentials go instead; the values are never repeated.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

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


def no_credential(value: Any) -> bool:
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
            if where.rsplit(".", 1)[-1] != "mapping" and is_secret_key(key) and not no_credential(value):
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


def check_no_secrets(params: Any, path: str) -> None:
    """Refuse params that hold credentials (:func:`find_secrets`), naming each place and where credentials go;
    ``path``: the file they came from, as the message names it.

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
