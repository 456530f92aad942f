"""The source stage: each input file's fingerprint through fsspec, so prepare reruns exactly when one changes.

Remote sources are reached through a local HTTP server (127.0.0.1, free port) and a test fsspec protocol
(``testhub://``, answering ``info()`` as the hub's filesystem does: a git blob id), never the real hub.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import gzip
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading

import fsspec
import pytest
import yaml
from fsspec.implementations.memory import MemoryFileSystem

from tasks import source
from tasks.kit import paths

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_PAIRS = os.path.join(os.path.dirname(REPO), "shared", "data", "hh-rlhf", "harmless-base", "pairs.jsonl.gz")


class FakeHub(MemoryFileSystem):
    """In memory, with ``info()`` like ``HfFileSystem``'s: a git ``blob_id`` of the content, ``lfs`` and a
    ``last_commit`` that says nothing about the content."""

    protocol = "testhub"
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("testhub://"))

    def info(self, path, **kwargs):
        out = super().info(path, **kwargs)
        if out["type"] == "file":
            data = self.cat_file(path)
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            out.update(blob_id=blob, lfs=None, last_commit=object())
        return out


fsspec.register_implementation("testhub", FakeHub, clobber=True)


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def http_server(folder):
    """Serve ``folder`` on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def write(path, data: bytes, mtime: float | None = None) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def test_sources_are_every_file_prepare_reads_with_the_storage_options_prepare_uses():
    params = {
        "source": "s3://b/a.jsonl",
        "storage_options": {"anon": True},
        "more_sources": [{"source": "hf://datasets/x/y/b.jsonl"}, {"source": "c.jsonl", "storage_options": {"k": 1}}],
        "ptx_source": "https://example.com/p.jsonl",
        "max_rows": 5,
    }
    assert source.sources(params) == [
        ("data.source", "s3://b/a.jsonl", {"anon": True}),
        ("data.more_sources[0].source", "hf://datasets/x/y/b.jsonl", None),
        ("data.more_sources[1].source", "c.jsonl", {"k": 1}),
        ("data.ptx_source", "https://example.com/p.jsonl", {"anon": True}),
    ]
    with pytest.raises(ValueError, match=r"data\.more_sources\[0\]\.source must be a path or URL, got None"):
        source.sources({"source": "a.jsonl", "more_sources": [{"format": "hh"}]})


def test_a_local_file_is_fingerprinted_by_its_content_not_its_time(tmp_path):
    path = tmp_path / "a.jsonl"
    write(path, b'{"a": 1}\n', mtime=1_000_000)
    first = source.fingerprint(str(path))
    assert first == {"size": 9, "sha256": hashlib.sha256(b'{"a": 1}\n').hexdigest()}
    os.utime(path, (2_000_000, 2_000_000))
    assert source.fingerprint(str(path)) == first  # touched, same content
    write(path, b'{"a": 2}\n')  # same size, other content
    assert source.fingerprint(str(path)) == {"size": 9, "sha256": hashlib.sha256(b'{"a": 2}\n').hexdigest()}


def test_a_hub_like_source_is_fingerprinted_by_its_blob_id_without_reading_it():
    fs = fsspec.filesystem("testhub")
    fs.pipe("/datasets/org/name/pairs.jsonl", b'{"x": 1}\n')
    url = "testhub://datasets/org/name/pairs.jsonl"
    assert source.fingerprint(url) == {"size": 9, "blob_id": git_blob(b'{"x": 1}\n')}  # no lfs: None, no last_commit
    fs.pipe("/datasets/org/name/pairs.jsonl", b'{"x": 2}\n')
    assert source.fingerprint(url) == {"size": 9, "blob_id": git_blob(b'{"x": 2}\n')}


def test_a_filesystem_that_reports_no_identity_gets_the_content_hash():
    fs = fsspec.filesystem("memory")
    fs.pipe("/sources-test/p.jsonl", b"{}\n")
    try:
        assert source.fingerprint("memory://sources-test/p.jsonl") == {
            "size": 3,
            "sha256": hashlib.sha256(b"{}\n").hexdigest(),
        }  # memory's info holds only "created", which is no content's identity
    finally:
        fs.rm("/sources-test", recursive=True)


def test_an_http_source_is_fingerprinted_by_size_and_last_modified(tmp_path):
    write(tmp_path / "p.jsonl", b'{"a": 1}\n{"a": 2}\n', mtime=1_700_000_000)
    with http_server(tmp_path) as base:
        assert source.fingerprint(f"{base}/p.jsonl") == {
            "size": 18,
            "Last-Modified": email.utils.formatdate(1_700_000_000, usegmt=True),  # Tue, 14 Nov 2023 22:13:20 GMT
        }
        write(tmp_path / "p.jsonl", b'{"a": 1}\n{"a": 3}\n', mtime=1_700_000_060)
        assert source.fingerprint(f"{base}/p.jsonl")["Last-Modified"] == "Tue, 14 Nov 2023 22:14:20 GMT"
        with pytest.raises(FileNotFoundError, match=r"/nope\.jsonl: no such file"):
            source.fingerprint(f"{base}/nope.jsonl")


def test_errors_name_the_source(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl: no such file"):
        source.fingerprint(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"nope://x/y\.jsonl: cannot read its fingerprint"):
        source.fingerprint("nope://x/y.jsonl")
    with pytest.raises(ValueError, match=r"is a folder"):
        source.fingerprint(str(tmp_path))


def test_a_queued_dvc_experiment_reads_a_path_outside_the_project_from_the_project_it_was_queued_in(
    tmp_path, monkeypatch
):
    # dvc exp run --queue runs the stages in <project>/.dvc/tmp/exps/<tmp>/, a copy of the project, with DVC_ROOT the
    # project (seen with dvc 3 by hand): ../shared/... from there is not the file the project names; the copy's own
    # files still come first
    project, shared = tmp_path / "project", tmp_path / "shared"
    copy = project / ".dvc" / "tmp" / "exps" / "tmpab12cd"
    for folder in (shared, copy):
        folder.mkdir(parents=True)
    write(shared / "pairs.jsonl", b'{"a": 1}\n')
    write(copy / "inside.jsonl", b'{"b": 2}\n')
    write(project / "inside.jsonl", b'{"b": 3}\n')
    monkeypatch.chdir(copy)
    monkeypatch.setenv("DVC_ROOT", str(project))
    assert source.fingerprint("../shared/pairs.jsonl") == source.fingerprint(str(shared / "pairs.jsonl"))
    assert paths.data_url("inside.jsonl")[0] == "inside.jsonl"  # the copy's own, not the project's
    with pytest.raises(FileNotFoundError) as raised:
        source.fingerprint("../shared/none.jsonl")
    assert str(raised.value) == (
        f"../shared/none.jsonl: no such file (looked in {copy.parent / 'shared' / 'none.jsonl'}, "
        f"{shared / 'none.jsonl'})"
    )
    monkeypatch.chdir(project)  # dvc repro in the project itself: looked for in one place
    assert paths.data_url("../shared/pairs.jsonl") == ("../shared/pairs.jsonl", [str(shared / "pairs.jsonl")])
    with pytest.raises(FileNotFoundError, match=r"none\.jsonl: no such file \(looked in [^,]*none\.jsonl\)$"):
        source.fingerprint("../shared/none.jsonl")


def test_the_record_changes_exactly_when_a_source_of_any_kind_changes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.jsonl", b'{"a": 1}\n')
    write(tmp_path / "b.jsonl", b'{"b": 1}\n')
    hub = fsspec.filesystem("testhub")
    hub.pipe("/datasets/o/n/ptx.jsonl", b'{"text": "t"}\n')
    params = {
        "source": "a.jsonl",
        "more_sources": [{"source": "b.jsonl"}],
        "ptx_source": "testhub://datasets/o/n/ptx.jsonl",
    }

    def record() -> bytes:
        source.run(params)
        return (tmp_path / "data" / "sources.json").read_bytes()

    first = record()
    assert json.loads(first) == {
        "sources": [
            {"param": "data.source", "url": "a.jsonl", "fingerprint": source.fingerprint("a.jsonl")},
            {"param": "data.more_sources[0].source", "url": "b.jsonl", "fingerprint": source.fingerprint("b.jsonl")},
            {
                "param": "data.ptx_source",
                "url": "testhub://datasets/o/n/ptx.jsonl",
                "fingerprint": {"size": 14, "blob_id": git_blob(b'{"text": "t"}\n')},
            },
        ]
    }
    assert record() == first  # unchanged sources: the same bytes, so DVC leaves prepare up to date
    write(tmp_path / "b.jsonl", b'{"b": 2}\n')
    second = record()
    assert second != first and json.loads(second)["sources"][0] == json.loads(first)["sources"][0]
    hub.pipe("/datasets/o/n/ptx.jsonl", b'{"text": "u"}\n')
    third = record()
    assert json.loads(third)["sources"][2]["fingerprint"]["blob_id"] == git_blob(b'{"text": "u"}\n')
    write(tmp_path / "a.jsonl", b'{"a": 2}\n')
    assert json.loads(record())["sources"][0] != json.loads(third)["sources"][0]


def test_prepare_depends_on_the_fingerprints_never_on_a_source_url():
    with open(os.path.join(REPO, "dvc.yaml"), encoding="utf-8") as handle:
        stages = yaml.safe_load(handle)["stages"]
    deps = [d if isinstance(d, str) else next(iter(d)) for d in stages["prepare"]["deps"]]
    assert source.OUT in deps and not [d for d in deps if "${" in d or "://" in d]
    assert stages["source"]["always_changed"] is True
    assert source.OUT in [o if isinstance(o, str) else next(iter(o)) for o in stages["source"]["outs"]]


@pytest.mark.integration
def test_dvc_repro_reruns_prepare_exactly_when_a_remote_source_changes(tmp_path):
    from test_pipeline import TINY_MORE_SOURCES, make_project, ran_stages, run, set_param

    project = make_project(tmp_path)
    served = tmp_path / "served"
    served.mkdir()
    with gzip.open(SHARED_PAIRS, "rb") as handle:
        lines = handle.read().splitlines(keepends=True)
    write(served / "pairs.jsonl", b"".join(lines[:30]), mtime=1_700_000_000)
    write(served / "more.jsonl", b"".join(lines[30:40]), mtime=1_700_000_000)
    ptx = b"".join(json.dumps({"text": f"Plain text number {i}."}).encode() + b"\n" for i in range(5))
    write(served / "ptx.jsonl", ptx, mtime=1_700_000_000)
    with http_server(served) as base:
        set_param(project, "source: ../shared/data/hh-rlhf/harmless-base/pairs.jsonl.gz", f"source: {base}/pairs.jsonl")
        set_param(project, TINY_MORE_SOURCES, f"      more_sources: [{{source: {base}/more.jsonl}}]")
        set_param(project, "ptx_source: null", f"ptx_source: {base}/ptx.jsonl")

        def prepared() -> dict:
            with open(os.path.join(project, "metrics/prepare.json"), encoding="utf-8") as handle:
                return json.load(handle)

        output = run(project, "dvc", "repro", "prepare")
        assert "Running stage 'source'" in output and ran_stages(output) == ["prepare"]
        with open(os.path.join(project, "data/sources.json"), encoding="utf-8") as handle:
            fingerprints = [entry["fingerprint"] for entry in json.load(handle)["sources"]]
        stamp = email.utils.formatdate(1_700_000_000, usegmt=True)
        assert fingerprints == [
            {"size": len(b"".join(lines[:30])), "Last-Modified": stamp},
            {"size": len(b"".join(lines[30:40])), "Last-Modified": stamp},
            {"size": len(ptx), "Last-Modified": stamp},
        ]
        rows = prepared()["rows_in"]
        assert rows == 30 + 10 + 5

        output = run(project, "dvc", "repro", "prepare")  # the source stage runs again, finds nothing changed
        assert "Running stage 'source'" in output and ran_stages(output) == []

        write(served / "more.jsonl", b"".join(lines[30:41]), mtime=1_700_000_100)  # one more row, same URL
        assert ran_stages(run(project, "dvc", "repro", "prepare")) == ["prepare"]
        assert prepared()["rows_in"] == rows + 1

        # a credential in params: refused before anything runs; dvc.lock and MLflow never see it
        secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzz"
        set_param(project, "  format: auto", f"  storage_options: {{secret: {secret}}}\n  format: auto")
        output = run(project, "dvc", "repro", "prepare", expect_failure=True)
        assert "data.storage_options.secret (a secret-looking key)" in output and secret not in output
        for name in ("dvc.lock", "mlflow.db"):
            with open(os.path.join(project, name), "rb") as handle:
                assert secret.encode() not in handle.read(), name
        set_param(project, f"  storage_options: {{secret: {secret}}}\n", "")

    # a hub source no longer breaks DVC for the whole project ("Unsupported URL type hf://")
    set_param(project, f"source: {base}/pairs.jsonl", "source: hf://datasets/Anthropic/hh-rlhf/harmless-base/x.jsonl")
    command = [sys.executable, "-m", "dvc", "status", "--json", "source", "prepare"]
    status = subprocess.run(command, cwd=project, capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout) == {  # the changed param, as for any param: nothing fails on the URL
        "source": [{"changed deps": {"params.yaml": {"data": "modified"}}}, "always changed"],
        "prepare": [{"changed deps": {"params.yaml": {"data": "modified"}}}],
    }
