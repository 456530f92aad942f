"""Stage source: the fingerprint of every input file prepare reads, so prepare reruns exactly when one changes.

DVC cannot depend on every fsspec URL the data loader reads (``hf://`` is no DVC dependency type, and
``data.more_sources`` and ``data.ptx_source`` would only be params: a new file at the same path would not
rerun prepare). This stage runs every time (``always_changed: true`` in dvc.yaml), asks each source's
filesystem for the file's identity (:func:`fingerprint`) and writes them all to ``data/sources.json``,
which prepare depends on: a changed file changes that file and reruns prepare; an unchanged one
leaves it byte for byte as it was, and prepare up to date.

It logs no MLflow run: it runs on every ``dvc repro`` and holds nothing but the fingerprints.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlhf.files import atomic_write_text
from tasks.kit import paths
from tasks.kit.common import cli
from tasks.kit.params import stage_params

OUT = paths.SOURCES
# fs.info() fields that change when the content does: ETag (S3, HTTP, GCS, Azure), checksums, the hub's git
# blob id and LFS sha256, object versions
CONTENT_FIELDS = {
    "etag",
    "e_tag",
    "content-md5",
    "content_md5",
    "md5",
    "md5hash",
    "crc32c",
    "digest",
    "checksum",
    "sha256",
    "blob_id",
    "lfs",
    "xet_hash",
    "versionid",
    "version_id",
    "generation",
}
TIME_FIELDS = {"last-modified", "lastmodified", "last_modified", "mtime", "updated", "modified"}


def sources(params: dict[str, Any]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """The files prepare reads, as ``(param, url, storage_options)``, with the storage options prepare uses.

    ``data.source`` and ``data.ptx_source`` with ``data.storage_options``; each ``data.more_sources``
    entry with its own ``storage_options``.

    Raises:
        ValueError: a source that is not a string (names the param).
    """
    found = [("data.source", params.get("source"), params.get("storage_options"))]
    for i, spec in enumerate(params.get("more_sources") or []):
        spec = spec if isinstance(spec, dict) else {}
        found.append((f"data.more_sources[{i}].source", spec.get("source"), spec.get("storage_options")))
    if params.get("ptx_source") is not None:
        found.append(("data.ptx_source", params["ptx_source"], params.get("storage_options")))
    for param, url, _ in found:
        if not isinstance(url, str) or not url:
            raise ValueError(f"params.yaml: {param} must be a path or URL, got {url!r}")
    return found


def _content_sha256(fs, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What identifies the content of the file at ``url``, asked of its fsspec filesystem.

    A relative path is looked for as :func:`tasks.kit.paths.data_url` says (in a queued DVC experiment, also in
    the project it was queued from). A local file: its size and content sha256. Elsewhere, from ``fs.info()``:
    the size and whatever changes with the content (:data:`CONTENT_FIELDS`: S3/HTTP/GCS/Azure ETag,
    Content-MD5, the hub's ``blob_id``/``lfs`` sha256, a version id) or, when the filesystem reports none, its
    modification time (HTTP Last-Modified, ``mtime``); with neither, the sha256 of the content (the file is read).

    Returns:
        e.g. ``{"size": 1234, "ETag": "\\"9b2c...\\""}`` or ``{"size": 1234, "sha256": "..."}``
        (JSON-ready: other values become text).

    Raises:
        FileNotFoundError: no file there (a local path: names every place looked).
        ValueError: a folder, or the filesystem cannot be reached or is unknown (names the URL).
    """
    import fsspec  # noqa: PLC0415 (fsspec: only a read source needs it)
    from fsspec.implementations.local import LocalFileSystem  # noqa: PLC0415 (fsspec: only a read source needs it)

    where, looked = paths.data_url(url)
    try:
        fs, path = fsspec.core.url_to_fs(where, **(storage_options or {}))
        info = fs.info(path)
        if info.get("type") == "directory":
            raise IsADirectoryError(path)
        found: dict[str, Any] = {"size": info.get("size")}
        if isinstance(fs, LocalFileSystem):
            found["sha256"] = _content_sha256(fs, path)
        else:
            content = {k: v for k, v in info.items() if k.lower() in CONTENT_FIELDS and v not in (None, "")}
            times = {k: v for k, v in info.items() if k.lower() in TIME_FIELDS and v not in (None, "")}
            found.update(content or times or {"sha256": _content_sha256(fs, path)})
    except IsADirectoryError:
        raise ValueError(f"{url} is a folder; prepare reads one .jsonl or .jsonl.gz file") from None
    except FileNotFoundError as err:
        local = "://" not in url
        raise FileNotFoundError(
            f"{url}: no such file" + (f" (looked in {', '.join(looked)})" if local else f" ({err})")
        ) from err
    except Exception as err:  # unknown protocol, network, permission: one line naming the source, not a traceback
        raise ValueError(f"{url}: cannot read its fingerprint: {type(err).__name__}: {err}") from err
    return json.loads(json.dumps(found, sort_keys=True, default=str))


def run(params: dict[str, Any]) -> dict[str, Any]:
    """Fingerprint every source of the ``data`` params and write them to :data:`OUT` (atomically).

    Returns:
        ``{"sources": [{"param", "url", "fingerprint"}, ...]}`` as written.
    """
    record = {
        "sources": [
            {"param": param, "url": url, "fingerprint": fingerprint(url, options)}
            for param, url, options in sources(params)
        ]
    }
    atomic_write_text(OUT, json.dumps(record, indent=1, sort_keys=True) + "\n")
    for entry in record["sources"]:
        print(f"[source] {entry['param']} {entry['url']}: {json.dumps(entry['fingerprint'], sort_keys=True)}")
    return record


def main() -> None:
    """DVC stage command."""
    run(stage_params("data"))


if __name__ == "__main__":
    cli(main)
