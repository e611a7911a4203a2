"""Where batch files live: a local folder (file://) or any S3-compatible bucket (s3://), one interface."""

from __future__ import annotations

import os
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from contract.settings import get_settings

MiB = 1024 * 1024


class Storage(Protocol):
    """A flat key → bytes store rooted at one URL; writes overwrite (idempotent)."""

    url: str

    def put(self, key: str, data: bytes) -> str:
        """Write data under key, replacing what was there; return the object's URL."""
        ...

    def put_file(self, key: str, path: Path) -> str:
        """Upload a local file under key; return the object's URL."""
        ...

    def get(self, key: str) -> bytes:
        """The bytes under key (FileNotFoundError if absent)."""
        ...

    def exists(self, key: str) -> bool:
        """Whether key holds an object."""
        ...

    def size(self, key: str) -> int | None:
        """Size in bytes of the object under key, None if absent."""
        ...

    def keys(self, prefix: str = "") -> list[str]:
        """Keys under prefix, sorted."""
        ...


class FileStorage:
    """Objects as files under a local directory; writes go through a temp file and an atomic rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        assert path.is_relative_to(self.root.resolve()), f"key escapes the storage root: {key!r}"
        return path

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return path.as_uri()

    def put_file(self, key: str, path: Path) -> str:
        return self.put(key, path.read_bytes())

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    def keys(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        root = self.root.resolve()
        return sorted(
            str(p.relative_to(root)) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")
        )


class S3Storage:
    """Objects in s3://bucket/prefix through boto3 (endpoint and credentials from boto3's own config)."""

    def __init__(self, bucket: str, prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = s3_client()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> str:
        self.client.upload_fileobj(BytesIO(data), self.bucket, self._key(key), Config=transfer_config())
        return f"s3://{self.bucket}/{self._key(key)}"

    def put_file(self, key: str, path: Path) -> str:
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=transfer_config())
        return f"s3://{self.bucket}/{self._key(key)}"

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(f"s3://{self.bucket}/{self._key(key)}") from exc

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def keys(self, prefix: str = "") -> list[str]:
        full = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            out += [obj["Key"][strip:] for obj in page.get("Contents", [])]
        return sorted(out)


def s3_client():
    """A boto3 S3 client with retries and backoff; AWS_ENDPOINT_URL(_S3) selects the server."""
    import boto3  # boto3 costs ~0.5 s to import: only when S3 is used
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 8, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        s3={"addressing_style": get_settings().s3_addressing_style},
    )
    return boto3.client("s3", config=config)


def transfer_config():
    """Multipart above 16 MiB, in 16 MiB parts."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, use_threads=True)


def open_storage(url: str) -> Storage:
    """Storage for a file:// or s3:// URL (a bare path means a local folder)."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"s3 URL needs a bucket: {url!r}")
        return S3Storage(parts.netloc, parts.path)
    if parts.scheme in ("file", ""):
        return FileStorage(Path(unquote(parts.path) if parts.scheme else url).expanduser().resolve())
    raise ValueError(f"unsupported storage URL {url!r}: use file:///dir or s3://bucket/prefix")


def split_url(url: str) -> tuple[Storage, str]:
    """The storage holding an object URL and the object's key in it."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        return S3Storage(parts.netloc), parts.path.lstrip("/")
    path = Path(unquote(parts.path) if parts.scheme == "file" else url).expanduser().resolve()
    return FileStorage(path.parent), path.name


def read_url(url: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a local path, file:// or s3:// object, refusing anything larger than max_bytes."""
    storage, key = split_url(url)
    size = storage.size(key)
    if size is None:
        raise FileNotFoundError(f"no such input: {url}")
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{url} is {size} bytes, over the limit of {max_bytes}")
    return storage.get(key)
