"""A real S3 endpoint for tests: moto's standalone server on 127.0.0.1:<free port>, reached through
real boto3 (nothing mocked in between), plus helpers that upload adapter folders to it."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# moto's server needs credentials to sign with, and none of the developer's own may be used.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass(frozen=True, slots=True)
class MotoS3:
    endpoint_url: str
    client: Any  # a boto3 S3 client for the test's own uploads and deletions

    def new_bucket(self) -> str:
        bucket = f"adapters-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=bucket)
        return bucket


@contextmanager
def moto_s3_server() -> Iterator[MotoS3]:
    """Start moto's threaded S3 server; the caller must have FAKE_AWS_ENV in os.environ."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint_url = f"http://{host}:{port}"
    try:
        yield MotoS3(endpoint_url, boto3.client("s3", endpoint_url=endpoint_url))
    finally:
        server.stop()


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (the port was free a moment ago)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def upload_adapter(
    s3: MotoS3, bucket: str, key_prefix: str, folder: str, sums: dict[str, str] | None = None
) -> None:
    """Upload every file of `folder` under `key_prefix/`; with `sums`, also a SHA256SUMS object
    listing them (file name -> hex digest, overriding the true digests given there)."""
    digests = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        s3.client.put_object(Bucket=bucket, Key=f"{key_prefix}/{name}", Body=data)
        digests[name] = hashlib.sha256(data).hexdigest()
    if sums is not None:
        digests.update(sums)
        text = "".join(f"{digest}  {name}\n" for name, digest in digests.items())
        s3.client.put_object(Bucket=bucket, Key=f"{key_prefix}/SHA256SUMS", Body=text.encode())
