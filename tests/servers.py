"""Servers for integration tests, each a subprocess on a free port of 127.0.0.1: moto's S3 (with IAM credentials
checked, so a wrong one is refused) and an MLflow tracking server. Nothing here reaches another address."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

BIN = os.path.dirname(sys.executable)
BUCKET = "rlhf"
REGION = "us-east-1"
ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quiet_env(folder: str, **extra: str) -> dict[str, str]:
    """The environment of a test's subprocesses: no telemetry, no proxy, no AWS credential or config of this
    machine's (an empty AWS config file in ``folder`` instead of ``~/.aws``; no instance metadata lookups), plus
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_")) and "proxy" not in k.lower()}
    empty = os.path.join(folder, "aws-config")
    open(empty, "a").close()
    return {
        **env,
        "PATH": BIN + os.pathsep + os.environ["PATH"],
        "NO_PROXY": "127.0.0.1,localhost",
        "AWS_CONFIG_FILE": empty,
        "AWS_SHARED_CREDENTIALS_FILE": empty,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": REGION,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "DVC_NO_ANALYTICS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        **extra,
    }


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str], log: str, ready_url: str, seconds: float = 90) -> Iterator[None]:
    """Run ``args`` (output to ``log``) until the block ends; first wait until ``ready_url`` answers.

    Raises:
        RuntimeError: the server exited or did not answer within ``seconds`` (the message ends with its log).
    """
    with open(log, "w") as handle:
        process = subprocess.Popen(args, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + seconds
        while True:
            try:
                urllib.request.urlopen(ready_url, timeout=2)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    with open(log) as handle:
                        raise RuntimeError(f"{args[0]} did not start at {ready_url}: {handle.read()[-2000:]}") from None
                time.sleep(0.3)
        yield
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the server and the workers it started
            try:
                process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@dataclass(frozen=True)
class S3:
    """A moto S3 endpoint with bucket :data:`BUCKET` and one IAM user's credentials (anything else is refused)."""

    endpoint: str
    key_id: str
    secret: str

    def env(self) -> dict[str, str]:
        """The variables that give a client these credentials and this endpoint (s3fs/DVC, boto3, MLflow)."""
        return {
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint,
        }

    def keys(self, prefix: str) -> list[str]:
        """The object keys of the bucket under ``prefix``."""
        pages = self.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def client(self, service: str):
        """A boto3 client of ``service`` at this endpoint with these credentials."""
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=self.key_id,
                            aws_secret_access_key=self.secret)  # fmt: skip


@contextlib.contextmanager
def moto_s3(folder: str) -> Iterator[S3]:
    """moto's S3 server on a free port: an IAM user allowed everything, its access key, bucket :data:`BUCKET`;
    then authentication is switched on (``/moto-api/reset-auth``), so a wrong key or secret is refused."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    args = [f"{BIN}/moto_server", "-H", "127.0.0.1", "-p", str(port)]
    with serving(args, quiet_env(folder), os.path.join(folder, "moto.log"), f"{endpoint}/moto-api/"):
        boot = S3(endpoint, "testing", "testing")  # any key passes until authentication is on
        iam = boot.client("iam")
        iam.create_user(UserName="rlhf")
        iam.put_user_policy(UserName="rlhf", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL))
        key = iam.create_access_key(UserName="rlhf")["AccessKey"]
        boot.client("s3").create_bucket(Bucket=BUCKET)
        auth_on = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", b"0", {"Content-Type": "text/plain"})
        urllib.request.urlopen(auth_on)  # from now on every request is checked
        yield S3(endpoint, key["AccessKeyId"], key["SecretAccessKey"])


@contextlib.contextmanager
def mlflow_server(folder: str, s3: S3) -> Iterator[str]:
    """An ``mlflow server`` on a free port (SQLite store in ``folder``) whose artifacts it serves from
    ``s3://<bucket>/mlflow`` with ``s3``'s credentials (its clients need none for MLflow); yields its URI."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    args = [f"{BIN}/mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{folder}/mlflow-server.db",
            "--artifacts-destination", f"s3://{BUCKET}/mlflow"]  # fmt: skip
    with serving(args, quiet_env(folder, **s3.env()), os.path.join(folder, "mlflow-server.log"), f"{uri}/health"):
        yield uri
