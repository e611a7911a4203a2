"""Storage: file:// and s3:// (a real moto server over HTTP) behind one interface."""

from __future__ import annotations

import os

import pytest

from sluice.contract.settings import Settings
from sluice.contract.storage import S3_STYLE, FileStorage, MiB, S3Storage, open_storage, read_url, split_url


def exercise(storage) -> None:
    url = storage.put("b1/shards/0.jsonl", b"first\n")
    assert storage.get("b1/shards/0.jsonl") == b"first\n"
    storage.put("b1/shards/0.jsonl", b"second\n")
    storage.put("b1/shards/1.jsonl", b"other\n")
    storage.put("b2/output.jsonl", b"x")
    assert storage.get("b1/shards/0.jsonl") == b"second\n"
    assert storage.keys("b1/") == ["b1/shards/0.jsonl", "b1/shards/1.jsonl"]
    assert storage.exists("b2/output.jsonl") and not storage.exists("b2/missing.jsonl")
    assert storage.size("b1/shards/1.jsonl") == 6 and storage.size("nope") is None
    assert read_url(url) == b"second\n"
    with pytest.raises(FileNotFoundError):
        storage.get("b2/missing.jsonl")
    exercise_streams_and_delete(storage)


def exercise_streams_and_delete(storage) -> None:
    """chunks, open, writer and delete: the rest of the Storage interface, the same on every
    implementation."""
    body = bytes(range(256)) * 41  # 10496 bytes: two whole chunks of 4096 and a short one
    storage.put("b3/input.jsonl", body)
    pieces = list(storage.chunks("b3/input.jsonl", 4096))
    assert b"".join(pieces) == body and len(pieces) == 3 and all(len(p) <= 4096 for p in pieces)
    with storage.open("b3/input.jsonl") as stream:
        assert stream.read(5) == body[:5]
    with pytest.raises(FileNotFoundError):
        list(storage.chunks("b3/missing.jsonl"))
    with storage.writer("b3/streamed.jsonl") as out:
        out.write(b"a\n")
        out.write(b"b\n")
        assert not storage.exists("b3/streamed.jsonl"), "nothing visible before commit"
        out.commit()
    assert storage.get("b3/streamed.jsonl") == b"a\nb\n"
    storage.delete("b3/input.jsonl")
    storage.delete("b3/input.jsonl")  # absent: nothing to do
    assert not storage.exists("b3/input.jsonl") and storage.keys("b3/") == ["b3/streamed.jsonl"]
    assert storage.exists("b1/shards/0.jsonl"), "delete removes only its key"


def test_file_storage_overwrites_and_lists(tmp_path):
    storage = open_storage((tmp_path / "out").as_uri())
    assert isinstance(storage, FileStorage)
    exercise(storage)
    assert not list((tmp_path / "out" / "b1" / "shards").glob(".*")), "no temp files left behind"
    with pytest.raises(ValueError, match="escapes"):
        storage.put("../evil", b"x")


def test_s3_storage_against_moto_server(s3_bucket):
    storage = open_storage(f"s3://{s3_bucket}/runs/nightly")
    assert isinstance(storage, S3Storage) and storage.url == f"s3://{s3_bucket}/runs/nightly"
    exercise(storage)
    listed = storage.client.list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert {o["Key"] for o in listed} >= {"runs/nightly/b1/shards/0.jsonl", "runs/nightly/b2/output.jsonl"}


def test_s3_large_file_goes_multipart(s3_bucket, tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"y" * (17 * MiB))
    storage = open_storage(f"s3://{s3_bucket}")
    storage.put_file("big.jsonl", path)
    head = storage.client.head_object(Bucket=s3_bucket, Key="big.jsonl")
    assert head["ContentLength"] == 17 * MiB
    assert head["ETag"].strip('"').endswith("-2"), "uploaded in two parts"


def test_bad_urls_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unsupported"):
        open_storage("ftp://host/x")
    with pytest.raises(ValueError, match="bucket"):
        open_storage("s3:///prefix")
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"z" * 100)
    with pytest.raises(ValueError, match="limit"):
        read_url(str(big), max_bytes=10)


def exercise_writer(storage, temp_dir) -> None:
    """A streamed object appears whole on commit, a failed or uncommitted one never, and no temp file
    stays."""
    storage.put("b/out.jsonl", b"old\n")
    with pytest.raises(OSError), storage.writer("b/out.jsonl") as out:
        out.write(b"half")
        raise OSError(28, "No space left on device")
    with storage.writer("b/errors.jsonl") as out:
        out.write(b"never committed\n")
    assert storage.get("b/out.jsonl") == b"old\n" and not storage.exists("b/errors.jsonl")
    with storage.writer("b/out.jsonl") as out:
        for i in range(3):
            out.write(b"line %d\n" % i)
        url = out.commit()
    assert read_url(url) == b"line 0\nline 1\nline 2\n"
    assert not list(temp_dir.glob(".*")), "no temp files left behind"


def test_file_storage_streams_writes_through_a_temp_file(tmp_path):
    storage = open_storage((tmp_path / "out").as_uri())
    exercise_writer(storage, tmp_path / "out" / "b")


def test_s3_storage_streams_writes_through_a_local_temp_file(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    exercise_writer(open_storage(f"s3://{s3_bucket}/streamed"), tmp_path)


def test_an_output_no_retry_can_write_is_told_from_one_that_can(s3_bucket, tmp_path):
    """A missing bucket or a read-only folder is a PermissionError naming why; a writable bucket keeps no
    probe."""
    from sluice.worker.terminal import output_problem

    S3Storage(s3_bucket, "out").check_writable()
    assert S3Storage(s3_bucket).keys() == []
    with pytest.raises(PermissionError, match="NoSuchBucket"):
        S3Storage(f"{s3_bucket}-missing", "out").check_writable()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    FileStorage(tmp_path / "free" / "out").check_writable()
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(PermissionError, match="not a writable folder"):
            FileStorage(locked / "out").check_writable()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match="not a writable folder"):
        FileStorage(blocker / "out").check_writable()
    missing = f"s3://{s3_bucket}-missing/out"
    assert "NoSuchBucket" in output_problem(missing, [f"s3://{s3_bucket}-missing"], "path")
    assert output_problem(f"s3://{s3_bucket}/out", [f"s3://{s3_bucket}"], "path") is None


def test_the_s3_addressing_style_is_the_one_passed_down_never_the_environment(s3_bucket, monkeypatch):
    """A storage's S3 client addresses buckets in the style its caller passes (Settings' field, read at the
    entry point); the environment changed afterwards changes nothing; the default is Settings' default."""
    monkeypatch.setenv("SLUICE_S3_ADDRESSING_STYLE", "virtual")
    style = lambda storage: storage.client.meta.config.s3["addressing_style"]  # noqa: E731
    assert style(open_storage(f"s3://{s3_bucket}/out")) == "path" == S3_STYLE
    assert style(open_storage(f"s3://{s3_bucket}/out", s3_style="virtual")) == "virtual"
    assert style(split_url(f"s3://{s3_bucket}/out/a.jsonl", s3_style="auto")[0]) == "auto"
    assert style(S3Storage(s3_bucket, "out", s3_style="virtual")) == "virtual"
    assert Settings.model_fields["s3_addressing_style"].default == S3_STYLE
    assert Settings().s3_addressing_style == "virtual"
