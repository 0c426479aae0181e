"""A real S3 API on 127.0.0.1 for tests: moto in server mode, credentials only through the environment.

Usage from a test module (the fixture is registered once, in conftest.py)::

    def test_x(moto_s3):
        storage = Storage(moto_s3.root("case"), moto_s3.endpoint)

``moto_s3`` starts one server per test session on a free port (on first use), exports dummy ``AWS_*`` credentials
and ``QK_S3_ENDPOINT_URL`` (restored afterwards), and creates a bucket. :meth:`MotoS3.root` hands out
a fresh ``s3://bucket/<prefix>`` root per call so tests never see each other's objects.
"""

from __future__ import annotations

import contextlib
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
    with pytest.MonkeyPatch.context() as env:  # the environment as it was, after the session
        for k, v in CREDENTIALS.items():
            env.setenv(k, v)
        env.delenv("AWS_ENDPOINT_URL", raising=False)
        server, endpoint = start_server()
        env.setenv("QK_S3_ENDPOINT_URL", endpoint)
        s3 = MotoS3(endpoint)
        s3.client().create_bucket(Bucket=s3.bucket)
        try:
            yield s3
        finally:
            server.stop()


class CountingProxy:
    """A TCP relay on 127.0.0.1 in front of the moto server that counts the bytes it returns to clients.

    ``Storage(root, proxy.endpoint)`` talks S3 through it; ``proxy.received`` is the number of bytes the
    server sent (HTTP headers and bodies), i.e. what a read really transferred.
    """

    def __init__(self, target: str) -> None:
        import threading

        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.received = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(32)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(65536):
                if count:
                    with self._lock:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def reset(self) -> int:
        with self._lock:
            n, self.received = self.received, 0
        return n

    def close(self) -> None:
        self._sock.close()
