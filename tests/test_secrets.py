"""Credentials never enter params.yaml, MLflow or dvc.lock; every param value reaches MLflow as something it accepts."""

from __future__ import annotations

import hashlib
import os

import pytest
import yaml

from tasks.kit.mlflow_params import MLFLOW_KEY_MAX, MLFLOW_VALUE_MAX, mlflow_params
from tasks.kit.params import read_params, stage_params
from tasks.kit.secrets import check_no_secrets, find_secrets, is_secret_key

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzz"  # looks like nothing in particular: only its key gives it away

SECRET_KEYS = [
    "key", "secret", "token", "password", "passwd", "pwd", "api_key", "apiKey", "x-api-key", "access_key_id",
    "aws_access_key_id", "secret_access_key", "AWS_SECRET_ACCESS_KEY", "session_token", "aws_session_token",
    "credentials", "auth", "Authorization", "client_secret", "account_key", "sas_token", "connection_string",
    "private_key", "use_auth_token", "hf_token", "passphrase", "pkey", "secretAccessKey", "cookie",
]  # fmt: skip
NOT_SECRET_KEYS = [
    "endpoint_url", "anon", "client_kwargs", "region_name", "profile", "max_new_tokens", "max_prompt_tokens",
    "max_ptx_tokens", "eos_token", "pad_token_id", "max_token_length", "sort_key", "key_filename", "tokenizer",
    "author", "monkey", "keyboard", "secretary", "use_ssl", "requester_pays", "version_aware", "SSEKMSKeyId",
    "tracking_uri", "source", "mapping", "storage_options",
]  # fmt: skip


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_a_secret_looking_key_is_refused_anywhere_naming_the_place_and_where_credentials_go(key):
    assert is_secret_key(key)
    params = {"profile": "tiny", "data": {"source": "s3://b/f.jsonl", "storage_options": {key: SECRET}}}
    with pytest.raises(ValueError) as err:
        check_no_secrets(params, "params.yaml")
    message = str(err.value)
    assert f"params.yaml holds credentials at data.storage_options.{key} (a secret-looking key)" in message
    for where in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "~/.aws/credentials", "HF_TOKEN"):
        assert where in message
    assert SECRET not in message  # the message names places, never the value


@pytest.mark.parametrize("key", NOT_SECRET_KEYS)
def test_settings_that_are_not_secrets_stay_allowed(key):
    assert not is_secret_key(key)
    check_no_secrets(
        {"data": {"storage_options": {key: "x", "client_kwargs": {"region_name": "eu-west-1"}}}}, "params.yaml"
    )


def test_every_depth_and_section_is_read_lists_and_profiles_included():
    params = {
        "profile": "tiny",
        "mlflow": {"tracking_uri": "sqlite:///mlflow.db", "password": SECRET},
        "data": {
            "source": "hf://datasets/a/b/c.jsonl",
            "storage_options": {"anon": False, "endpoint_url": "http://127.0.0.1:9000"},
            "more_sources": [
                {"source": "s3://b/one.jsonl", "storage_options": {"anon": True}},
                {"source": "s3://b/two.jsonl", "storage_options": {"client_kwargs": {"aws_session_token": SECRET}}},
            ],
            "profiles": {"tiny": {"ptx_source": "s3://b/p.jsonl", "storage_options": {"key": SECRET}}},
        },
        "ppo": {"presets": {"x": {"nested": [[{"api_key": SECRET}]]}}},
        "sft": {"headers": [{"Authorization": SECRET}]},
    }
    assert find_secrets(params) == [
        "mlflow.password (a secret-looking key)",
        "data.more_sources[1].storage_options.client_kwargs.aws_session_token (a secret-looking key)",
        "data.profiles.tiny.storage_options.key (a secret-looking key)",
        "ppo.presets.x.nested[0][0].api_key (a secret-looking key)",
        "sft.headers[0].Authorization (a secret-looking key)",
    ]


def test_a_credential_key_that_holds_none_and_a_mappings_field_names_are_allowed():
    check_no_secrets(
        {
            "data": {
                "storage_options": {"token": None, "key": "", "use_auth_token": False, "auth": True},
                "more_sources": [{"source": "gs://b/f.jsonl", "storage_options": {"token": "anon"}}],
                "mapping": {"key": "prompt", "token": "chosen", "password": "rejected"},  # a source's field names
            }
        },
        "params.yaml",
    )
    assert find_secrets({"data": {"mapping": {"q": "s3://u:p@b/x"}}}) == [
        "data.mapping.q (a URL with a user and password)"  # a mapping's values are still read
    ]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("https://user:hunter2@example.com/data.jsonl", "a URL with a user and password"),
        ("postgresql://mlflow:hunter2@db:5432/mlflow", "a URL with a user and password"),
        ("http://:hunter2@127.0.0.1:5000", "a URL with a user and password"),
        ("see s3://AKIDEXAMPLE:abc/def@bucket/x.jsonl.gz", "a URL with a user and password"),
        ("https://b.s3.amazonaws.com/f.jsonl?X-Amz-Algorithm=A&X-Amz-Signature=abc", "a URL whose query holds X-Amz-"),
        ("https://a.blob.core.windows.net/c/f.jsonl?sv=2022&sig=abc", "a URL whose query holds sig"),
        ("https://example.com/f.jsonl?api_key=abc", "a URL whose query holds api_key"),
        ("AKIAIOSFODNN7EXAMPLE", "an AWS access key id"),
        ("hf_" + "a" * 34, "a Hugging Face token"),
        ("ghp_" + "A1" * 18, "a GitHub token"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMII...", "a private key"),
        ("Bearer eyJhbGciOiJIUzI1NiJ9", "a bearer token"),
    ],
)
def test_a_value_that_carries_a_credential_is_refused_under_any_key(value, why):
    found = find_secrets({"mlflow": {"tracking_uri": value}})
    assert len(found) == 1 and found[0].startswith(f"mlflow.tracking_uri ({why}"), found
    with pytest.raises(ValueError, match=r"mlflow\.tracking_uri") as err:
        check_no_secrets({"mlflow": {"tracking_uri": value}}, "params.yaml")
    assert "hunter2" not in str(err.value) and "MLFLOW_TRACKING_PASSWORD" in str(err.value)


@pytest.mark.parametrize(
    "value",
    [
        "sqlite:///mlflow.db",
        "http://127.0.0.1:5000",
        "http://[::1]:8080/pairs.jsonl",
        "http://127.0.0.1:8080/users/@me/pairs.jsonl",  # host:port, then an "@" in the path
        "ssh://git@example.com/repo.git",  # a user alone is no credential
        "s3://bucket/path/pairs.jsonl.gz",
        "hf://datasets/Anthropic/hh-rlhf/harmless-base/test.jsonl.gz",
        "https://example.com/f.jsonl?download=1&revision=main",
        "../shared/data/hh-rlhf/harmless-base/pairs.jsonl.gz",
        "the key is in the environment",
    ],
)
def test_urls_and_values_without_credentials_are_allowed(value):
    assert find_secrets({"data": {"source": value, "more_sources": [{"source": value}]}}) == []


def test_the_shipped_params_file_holds_none_and_reads():
    with open(os.path.join(REPO, "params.yaml"), encoding="utf-8") as handle:
        assert find_secrets(yaml.safe_load(handle)) == []
    assert read_params(os.path.join(REPO, "params.yaml"))["data"]["source"]


def test_read_params_and_stage_params_refuse_before_any_stage_reads_a_section(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(f"profile: demo\ndata:\n  source: s3://b/f.jsonl\n  storage_options:\n    secret: {SECRET}\n")
    with pytest.raises(ValueError, match=r"holds credentials at data\.storage_options\.secret"):
        read_params(str(path))
    params = {"profile": "demo", "sft": {"steps": 1}, "data": {"storage_options": {"token": SECRET}}}
    with pytest.raises(ValueError, match=r"data\.storage_options\.token"):
        stage_params("sft", params)  # any section's reader refuses the whole file


def test_the_flow_refuses_before_it_runs_a_stage(tmp_path, monkeypatch):
    from flows import pipeline

    (tmp_path / "params.yaml").write_text("data:\n  source: https://u:hunter2@example.com/f.jsonl\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipeline, "run_stage", lambda *a: pytest.fail("a stage ran"))
    with pytest.raises(ValueError, match=r"data\.source \(a URL with a user and password\)"):
        pipeline.run_pipeline()


def test_mlflow_params_flatten_lists_and_keep_values_as_text():
    params = {"a": {"b": 1, "c": [1.5, [2, "x"]]}, "d": None, "e": [], "f": {}, "g": True, "h": "ünï ✓"}
    assert mlflow_params(params) == {
        "a.b": "1",
        "a.c.0": "1.5",
        "a.c.1.0": "2",
        "a.c.1.1": "x",
        "d": "None",
        "e": "[]",
        "f": "{}",
        "g": "True",
        "h": "ünï ✓",
    }


def test_mlflow_params_cut_long_values_keeping_them_apart_and_never_fail_on_odd_text():
    one, two = "x" * 7000, "x" * 6990 + "y" * 10
    logged = mlflow_params({"one": one, "two": two, "nul": "a\x00b", "surrogate": "a\ud800b"})
    tail = f"... [7000 chars, sha256 {hashlib.sha256(one.encode()).hexdigest()[:12]}]"
    assert logged["one"] == "x" * (6000 - len(tail)) + tail and len(logged["one"]) == MLFLOW_VALUE_MAX
    assert logged["two"] != logged["one"] and len(logged["two"]) == 6000
    assert logged["nul"] == "a\\x00b" and logged["surrogate"] == "a\\ud800b"
    logged["surrogate"].encode("utf-8")  # storable


def test_mlflow_params_make_keys_valid_unique_and_short():
    long = "k" * 300
    logged = mlflow_params(
        {"a/b:c é": 1, "a_b_c _": 2, "..": 3, "": 4, long: 5, "profile": 6, 7: 8, "s3": {"secret": SECRET}},
        reserved=("profile",),
    )
    digest = hashlib.sha256(long.encode()).hexdigest()[:12]
    assert logged == {
        "a_b_c _": "1",
        "a_b_c _-2": "2",
        "_..": "3",
        "_": "4",
        "k" * 237 + "-" + digest: "5",
        "profile-2": "6",
        "7": "8",
        "s3.secret": "<redacted>",
    }
    from mlflow.utils.validation import _validate_param

    for key, value in logged.items():
        _validate_param(key, value)  # MLflow's own rules: raises on a bad name or length
        assert len(key) <= MLFLOW_KEY_MAX


@pytest.mark.integration
def test_stage_run_logs_any_params_to_a_real_mlflow_store(tmp_path, monkeypatch):
    import mlflow

    from tasks.kit.runs import StageRun

    (tmp_path / "params.yaml").write_text("profile: tiny\nmlflow: {experiment: t}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("RLHF_PIPELINE_RUN_ID", "secrets-test")
    params = {
        "source": "hf://datasets/a/b.jsonl",
        "more_sources": [{"source": "s3://b/x.jsonl", "mapping": {"q/a:é": "prompt"}}],
        "long": "z" * 9000,
        "none": None,
        "odd": "\x00\ud800",
        "profile": "mine",
    }
    with StageRun("t", params) as stage:
        run_id = stage.run.info.run_id
    logged = mlflow.MlflowClient().get_run(run_id).data.params
    assert logged["source"] == "hf://datasets/a/b.jsonl"
    assert logged["more_sources.0.mapping.q_a__"] == "prompt"
    assert len(logged["long"]) == 6000 and logged["none"] == "None" and logged["odd"] == "\\x00\\ud800"
    assert logged["profile"] == "tiny" and logged["profile-2"] == "mine"


def _stage_names() -> list[str]:
    with open(os.path.join(REPO, "dvc.yaml"), encoding="utf-8") as handle:
        return list(yaml.safe_load(handle)["stages"])


@pytest.mark.parametrize("stage", _stage_names())
def test_every_stage_refuses_a_secret_before_it_writes_anything(stage, tmp_path, monkeypatch):
    """Each stage's command reads params first: no MLflow store, no output, no checkpoint is made."""
    import importlib

    (tmp_path / "params.yaml").write_text(
        "profile: tiny\nmlflow: {tracking_uri: sqlite:///mlflow.db}\ndata:\n  source: s3://b/f.jsonl\n"
        f"  more_sources:\n    - {{source: s3://b/g.jsonl, storage_options: {{secret_access_key: {SECRET}}}}}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    main = importlib.import_module(f"tasks.{stage}").main
    with pytest.raises(ValueError, match=r"data\.more_sources\[0\]\.storage_options\.secret_access_key") as err:
        main()
    assert SECRET not in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["params.yaml"]
