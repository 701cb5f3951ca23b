"""A local S3 server (moto's, from PyPI ``moto[server]``) as durable storage for the embedded
broker: Tansu's ``s3://`` storage keeps topics, records, committed offsets and groups in the
bucket, so a broker stopped and started again on the same bucket finds its data, like a real
Kafka broker after an outage. The broker itself stays the real Tansu binary; only its storage
backend is a local stand-in for S3.

Usage::

    with LocalS3(tmp_path / "s3.log") as s3:
        broker = EmbeddedBroker(storage=s3.storage_url, env=s3.tansu_env())
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = SECRET_KEY = "lpcal-test"  # moto accepts any credentials
REGION = "eu-west-2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalS3:
    """``python -m moto.server`` on a free loopback port, with one bucket (``bucket``)."""

    def __init__(self, log_path: Path, bucket: str = "tansu"):
        self.log_path = Path(log_path)
        self.bucket = bucket
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_url(self) -> str:
        return f"s3://{self.bucket}/"

    def tansu_env(self) -> dict[str, str]:
        """Environment of a Tansu broker that stores its data in this server's bucket."""
        return {"AWS_ENDPOINT": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
                "AWS_ALLOW_HTTP": "true"}

    def start(self, timeout: float = 30.0) -> LocalS3:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1.0):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server not answering on {self.endpoint}")
                time.sleep(0.1)
        self._create_bucket()
        return self

    def _create_bucket(self) -> None:
        import boto3  # installed with moto

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION)
        s3.create_bucket(Bucket=self.bucket,
                         CreateBucketConfiguration={"LocationConstraint": REGION})

    def object_count(self) -> int:
        """Objects in the bucket (the broker's records, offsets and metadata)."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION)
        n = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            n += page.get("KeyCount", 0)
        return n

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def __enter__(self) -> LocalS3:  # noqa: PYI034 - start() returns self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
