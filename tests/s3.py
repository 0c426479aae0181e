"""A real S3 API on 127.0.0.1 for tests: moto in server mode, credentials only through the environment.

Usage from a test module::

    from s3 import moto_s3  # noqa: F401  (session fixture)

    def test_x(moto_s3):
        storage = Storage(moto_s3.root("case"), moto_s3.endpoint)

``moto_s3`` starts one server per test session on a free port, exports dummy ``AWS_*`` credentials
and ``QK_S3_ENDPOINT_URL`` (restored afterwards), and creates a bucket. :meth:`MotoS3.root` hands out
a fresh ``s3://bucket/<prefix>`` root per call so tests never see each other's objects.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "qk-test"
# Dummy values: moto accepts any credentials. They exist only in this process's environment.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAQKTESTONLY000001",
    "AWS_SECRET_ACCESS_KEY": "qk-test-secret-never-in-metadata",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class MotoS3:
    endpoint: str
    bucket: str = BUCKET

    def root(self, name: str = "") -> str:
        """A fresh, empty storage root inside the test bucket."""
        return f"s3://{self.bucket}/{name or 'root'}-{uuid.uuid4().hex[:8]}"

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (read directly through boto3, bypassing Storage)."""
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


def start_server() -> tuple[object, str]:
    """Start a threaded moto server on a free local port; return (server, endpoint URL)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """One moto S3 server for the session, with credentials in the environment and a bucket."""
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "QK_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"]}
    os.environ.update(CREDENTIALS)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    server, endpoint = start_server()
    os.environ["QK_S3_ENDPOINT_URL"] = endpoint
    s3 = MotoS3(endpoint)
    s3.client().create_bucket(Bucket=s3.bucket)
    try:
        yield s3
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
