"""A real S3-compatible server for the tests: moto's server mode on a loopback port.

pyarrow's S3 client talks to it over HTTP exactly as it talks to AWS (no mock of the
client library); credentials and the endpoint reach pyarrow through the environment
variables it reads, so subprocesses started by a test find the server too.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow.fs as pafs
from moto.server import ThreadedMotoServer

__all__ = ["S3_ENV", "closed_port", "make_bucket", "moto_server"]

#: The environment pyarrow's S3 client reads: fake credentials, a region, no EC2
#: metadata lookups (the endpoint is added by :func:`moto_server`).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextmanager
def moto_server(port: int = 0) -> Iterator[str]:
    """Run a moto S3 server on ``127.0.0.1:port`` (0: a free one); yields its endpoint
    URL with ``S3_ENV`` and ``AWS_ENDPOINT_URL`` set in ``os.environ``, restored after."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    host, bound = server.get_host_and_port()
    endpoint = f"http://{host}:{bound}"
    saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_bucket(prefix: str = "rec") -> str:
    """A new empty bucket on the server in ``AWS_ENDPOINT_URL``; returns ``s3://name``."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    fs, _ = pafs.FileSystem.from_uri(f"s3://{name}?allow_bucket_creation=true")
    fs.create_dir(name)
    return f"s3://{name}"


def closed_port() -> int:
    """A loopback port nothing listens on (an unreachable endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
