"""Where batch files live: a local folder (file://) or any S3-compatible bucket (s3://), one interface."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import tempfile
from collections.abc import Callable, Iterator
from io import BytesIO
from pathlib import Path
from typing import BinaryIO, Protocol
from urllib.parse import unquote, urlsplit

MiB = 1024 * 1024
COPY_CHUNK = MiB
S3_STYLE = "path"  # S3 addressing style where none is passed: Settings.s3_addressing_style's default


class ObjectWriter:
    """An object written as a stream into a local temp file; commit() publishes it whole, else it is removed.

    Use as a context manager: leaving it without commit() (an exception, or nothing worth publishing)
    deletes the temp file, so a failed write leaves nothing behind and never a partial object.
    """

    def __init__(self, directory: Path | None, prefix: str, publish: Callable[[Path], str]) -> None:
        fd, name = tempfile.mkstemp(dir=directory, prefix=prefix)
        self.path = Path(name)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self._publish = publish
        self.url: str | None = None

    def write(self, data: bytes) -> None:
        """Append data to the object."""
        self.file.write(data)

    def commit(self) -> str:
        """Publish what was written under the key (atomically on file://); return the object's URL."""
        self.file.close()
        try:
            self.url = self._publish(self.path)
        finally:
            self.discard()
        return self.url

    def discard(self) -> None:
        """Drop what was written (nothing is published)."""
        self.file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


WRITE_PROBE = ".sluice-write-check"
# S3 error codes no retry can mend: the output location is wrong or this process may not write it
PERMANENT_S3_ERRORS = {"AccessDenied", "AllAccessDisabled", "NoSuchBucket", "InvalidAccessKeyId",
                       "SignatureDoesNotMatch", "InvalidBucketName", "AccountProblem"}


class KeyOutsideRoot(ValueError):
    """A key that would resolve outside its storage root."""


class OutputNotAllowed(ValueError):
    """An output location outside every allowed output root (SLUICE_OUTPUT_ROOTS)."""


class Storage(Protocol):
    """A flat key → bytes store rooted at one URL; writes overwrite (idempotent)."""

    url: str

    def put(self, key: str, data: bytes) -> str:
        """Write data under key, replacing what was there; return the object's URL."""
        ...

    def put_file(self, key: str, path: Path) -> str:
        """Upload a local file under key; return the object's URL."""
        ...

    def writer(self, key: str) -> ObjectWriter:
        """A stream to write the object under key through; nothing is visible under key until commit()."""
        ...

    def get(self, key: str) -> bytes:
        """The bytes under key (FileNotFoundError if absent)."""
        ...

    def open(self, key: str) -> BinaryIO:
        """A binary stream of the object under key (FileNotFoundError if absent)."""
        ...

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object under key (FileNotFoundError if absent)."""
        ...

    def exists(self, key: str) -> bool:
        """Whether key holds an object."""
        ...

    def size(self, key: str) -> int | None:
        """Size in bytes of the object under key, None if absent."""
        ...

    def chunks(self, key: str, size: int = COPY_CHUNK) -> Iterator[bytes]:
        """The object under key as successive pieces of at most size bytes, never all in memory."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object under key; nothing to do when it is absent."""
        ...

    def keys(self, prefix: str = "") -> list[str]:
        """Keys under prefix, sorted."""
        ...

    def check_writable(self) -> None:
        """PermissionError naming the reason when this process can never write here (a transient failure is
        not)."""
        ...


class FileStorage:
    """Objects as files under a local directory; writes go through a temp file and an atomic rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise KeyOutsideRoot(f"key escapes the storage root {self.url}: {key!r}")
        return path

    def check_writable(self) -> None:
        """PermissionError unless the root, or the nearest folder above it that exists, is a writable
        folder."""
        existing = next((p for p in (self.root, *self.root.parents) if p.exists()), self.root)
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"{existing} is not a writable folder")

    def writer(self, key: str) -> ObjectWriter:
        """A temp file next to the object's path, renamed onto it (atomically) by commit()."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)

        def publish(tmp: Path) -> str:
            os.replace(tmp, path)
            return path.as_uri()

        return ObjectWriter(path.parent, f".{path.name}.", publish)

    def put(self, key: str, data: bytes) -> str:
        with self.writer(key) as out:
            out.write(data)
            return out.commit()

    def put_file(self, key: str, path: Path) -> str:
        with self.writer(key) as out, path.open("rb") as src:
            while chunk := src.read(COPY_CHUNK):
                out.write(chunk)
            return out.commit()

    def open(self, key: str) -> BinaryIO:
        return self._path(key).open("rb")

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def read_range(self, key: str, start: int, end: int) -> bytes:
        with self.open(key) as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def chunks(self, key: str, size: int = COPY_CHUNK) -> Iterator[bytes]:
        return read_chunks(self.open(key), size)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

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

    def __init__(self, bucket: str, prefix: str = "", s3_style: str = S3_STYLE) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = s3_client(s3_style)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> str:
        self.client.upload_fileobj(BytesIO(data), self.bucket, self._key(key), Config=transfer_config())
        return f"s3://{self.bucket}/{self._key(key)}"

    def put_file(self, key: str, path: Path) -> str:
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=transfer_config())
        return f"s3://{self.bucket}/{self._key(key)}"

    def check_writable(self) -> None:
        """PermissionError when a probe object cannot be written for good (no such bucket, access denied, bad
        credentials); the probe is removed again where deleting is allowed."""
        from botocore.exceptions import ClientError

        key = self._key(WRITE_PROBE)
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=b"")
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in PERMANENT_S3_ERRORS:
                raise PermissionError(f"s3://{self.bucket}/{key}: {code}") from None
            raise
        with contextlib.suppress(ClientError):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def writer(self, key: str) -> ObjectWriter:
        """A local temp file, uploaded by commit() (multipart when large) and then removed."""
        return ObjectWriter(None, ".sluice-upload.", lambda tmp: self.put_file(key, tmp))

    def get(self, key: str) -> bytes:
        with self.open(key) as body:
            return body.read()

    def open(self, key: str) -> BinaryIO:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except self.client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(f"s3://{self.bucket}/{self._key(key)}") from exc

    def chunks(self, key: str, size: int = COPY_CHUNK) -> Iterator[bytes]:
        return read_chunks(self.open(key), size)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """One ranged GET (HTTP Range: bytes=start-(end-1))."""
        if end <= start:
            return b""
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}"
            )
        except self.client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(f"s3://{self.bucket}/{self._key(key)}") from exc
        with response["Body"] as body:
            return body.read()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

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


def s3_client(s3_style: str):
    """A boto3 S3 client with retries and backoff, addressing buckets in s3_style (path, virtual or auto:
    Settings.s3_addressing_style); AWS_ENDPOINT_URL(_S3) selects the server, through boto3's own config."""
    import boto3  # slow to import: only when S3 is used
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": 8, "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        s3={"addressing_style": s3_style},
    )
    return boto3.client("s3", config=config)


def transfer_config():
    """Multipart above 16 MiB, in 16 MiB parts."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, use_threads=True)


def _local_path(url: str) -> Path:
    """The path of a file:// URL or bare path; a file:// URL naming a host (file://tmp/out) is refused."""
    parts = urlsplit(url)
    if parts.scheme != "file":
        return Path(url).expanduser().resolve()
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"file URL {url!r} names host {parts.netloc!r}; write file:///{parts.netloc}{parts.path}"
        )
    return Path(unquote(parts.path)).resolve()


def open_storage(url: str, s3_style: str = S3_STYLE) -> Storage:
    """Storage for a file:// or s3:// URL (a bare path means a local folder); S3 addressed in s3_style."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"s3 URL needs a bucket: {url!r}")
        return S3Storage(parts.netloc, unquote(parts.path), s3_style)
    if parts.scheme in ("file", ""):
        return FileStorage(_local_path(url))
    raise ValueError(f"unsupported storage URL {url!r}: use file:///dir or s3://bucket/prefix")


def split_url(url: str, s3_style: str = S3_STYLE) -> tuple[Storage, str]:
    """The storage holding an object URL and the object's key in it."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        return S3Storage(parts.netloc, s3_style=s3_style), unquote(parts.path.lstrip("/"))
    path = _local_path(url)
    return FileStorage(path.parent), path.name


def _sized(url: str, max_bytes: int | None, s3_style: str) -> tuple[Storage, str]:
    storage, key = split_url(url, s3_style)
    size = storage.size(key)
    if size is None:
        raise FileNotFoundError(f"no such input: {url}")
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{url} is {size} bytes, over the limit of {max_bytes}")
    return storage, key


def read_url(url: str, max_bytes: int | None = None, s3_style: str = S3_STYLE) -> bytes:
    """The bytes of a local path, file:// or s3:// object, refusing anything larger than max_bytes."""
    storage, key = _sized(url, max_bytes, s3_style)
    return storage.get(key)


def url_lines(url: str, max_bytes: int, max_line: int, s3_style: str = S3_STYLE) -> Iterator[bytes]:
    """The lines of an object read a chunk at a time (never whole); a line over max_line is cut to max_line +
    1."""
    storage, key = _sized(url, max_bytes, s3_style)
    with storage.open(key) as stream:
        yield from iter_lines(stream, max_line)


def read_chunks(stream: BinaryIO, size: int) -> Iterator[bytes]:
    """A stream's bytes in pieces of at most size bytes; the stream is closed at the end (or when dropped)."""
    with stream:
        while chunk := stream.read(size):
            yield chunk


def iter_lines(stream: BinaryIO, max_line: int | None = None, chunk: int = MiB) -> Iterator[bytes]:
    """Lines of a binary stream split on newlines, each cut to at most max_line + 1 bytes (None: never
    cut)."""
    cut = slice(None) if max_line is None else slice(max_line + 1)
    head = b""
    while data := stream.read(chunk):
        *done, rest = data.split(b"\n")
        for piece in done:
            yield (head + piece)[cut]
            head = b""
        head = (head + rest)[cut]
    if head:
        yield head


def object_lines(storage: Storage, key: str) -> Iterator[bytes]:
    """The lines of an object, read 256 KiB at a time (never whole)."""
    with storage.open(key) as stream:
        yield from iter_lines(stream, chunk=256 * 1024)


def within(url: str, root: str) -> bool:
    """Whether url lies under root (an s3:// root's bucket may be a glob)."""
    parts, base = urlsplit(url), urlsplit(root)
    if parts.scheme == "s3" or base.scheme == "s3":
        if parts.scheme != base.scheme or not fnmatch.fnmatchcase(parts.netloc, base.netloc):
            return False
        path, prefix = unquote(parts.path).strip("/").split("/"), unquote(base.path).strip("/").split("/")
        return prefix == [""] or path[: len(prefix)] == prefix
    return _local_path(url).is_relative_to(_local_path(root))


def check_output_url(url: str, roots: list[str]) -> str:
    """url if it is a file:// (no host) or s3:// location inside one of roots (s3 buckets may be globs)."""
    open_storage(url)
    if not any(within(url, root) for root in roots):
        raise OutputNotAllowed(
            f"output {url!r} is outside the allowed output roots ({', '.join(roots)}); see "
            "SLUICE_OUTPUT_ROOTS"
        )
    return url


def open_output(url: str, roots: list[str], s3_style: str = S3_STYLE) -> Storage:
    """The storage of a batch's output location, refusing one outside the allowed roots."""
    return open_storage(check_output_url(url, roots), s3_style)
