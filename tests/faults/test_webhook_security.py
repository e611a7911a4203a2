"""Webhook security and delivery faults against real HTTP servers on loopback and a real redis-server."""

from __future__ import annotations

import functools
import json
import logging
import shutil
import socket
import subprocess
import threading
import time
import tracemalloc
from urllib.parse import urlsplit

import pytest
from redis import Redis
from urllib3.util import parse_url

from sluice.contract.events import delivery_log, notify
from sluice.contract.schemas import Batch, BatchStatus
from sluice.contract.signing import (
    Target,
    UnsafeWebhookURL,
    WebhookSettings,
    check_url,
    generate_secret,
    resolve_target,
)
from sluice.worker.webhooks import _post, attempt, run
from tests.services import free_port, wait_for_port

SECRET = generate_secret()
SSRF_FORMS = [
    "http://127.0.0.1:5393\\@8.8.8.8/x",  # urllib3 connects to 127.0.0.1, urlsplit sees 8.8.8.8
    "http://8.8.8.8\\@127.0.0.1/x",
    "http://user:pw@8.8.8.8/x",
    "http://8.8.8.8@127.0.0.1/x",
    "http://[::ffff:0:7f00:1]/",  # IPv4-translated loopback
    "http://[::ffff:127.0.0.1]/",  # IPv4-mapped
    "http://[::127.0.0.1]/",  # IPv4-compatible
    "http://[64:ff9b::7f00:1]/",  # NAT64
    "http://[64:ff9b:1::a00:1]/",  # NAT64 local use, 10.0.0.1
    "http://[2002:7f00:1::]/",  # 6to4 of 127.0.0.1
    "http://[2002:a9fe:a9fe::]/",  # 6to4 of the metadata address
    "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/",  # Teredo, client 127.0.0.1
    "http://2130706433/",  # decimal 127.0.0.1
    "http://0x7f.1/",
    "http://0/",
    "http://169.254.169.254/latest/meta-data/",
    "http://metadata.google.internal/",
    "http://localhost./",
    "http://[::1]/",
    "http://[fe80::1]/",
    "http://10.0.0.1/",
    "http://example.com/a b",
    "http://example.com/\x00",
    "ftp://8.8.8.8/",
    "file:///etc/passwd",
]


def settings(**overrides) -> WebhookSettings:
    values = dict(webhook_secret=SECRET, webhook_allow="127.0.0.0/8", webhook_retry_schedule="0.2s",
                  webhook_timeout=1.5)  # fmt: skip
    return WebhookSettings(**{**values, **overrides})


@pytest.mark.parametrize("url", SSRF_FORMS)
def test_internal_targets_are_refused_in_every_form(url):
    with pytest.raises(UnsafeWebhookURL):
        check_url(url, allow="")


def test_backslash_form_is_the_bypass_it_was():
    url = SSRF_FORMS[0]
    assert urlsplit(url).hostname == "8.8.8.8" and parse_url(url).host == "127.0.0.1"


def test_public_targets_pass_and_keep_their_host_for_the_connection():
    target = resolve_target("https://93.184.215.14:8443/hook?token=abc", allow="")
    assert (target.address, target.host, target.port, target.request_uri) == (
        "93.184.215.14", "93.184.215.14", 8443, "/hook?token=abc")  # fmt: skip


class Server:
    """A raw TCP server on loopback running one behaviour per connection, recording what it received."""

    def __init__(self, behave) -> None:
        self.behave, self.received = behave, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            self.received.append(conn.recv(65536))
            try:
                self.behave(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def trickle(conn: socket.socket) -> None:
    for byte in b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n":
        conn.sendall(bytes([byte]))
        time.sleep(1.0)


def hang(conn: socket.socket) -> None:
    time.sleep(8)


HUGE_BODY = 300 * 2**20


def huge_body(tally: dict, conn: socket.socket) -> None:
    """Send HUGE_BODY bytes, counting in tally["sent"] what the client took before hanging up; then close
    cleanly (our side shut, the request drained), so a client that reads it all gets all of it, not a
    reset."""
    try:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % HUGE_BODY)
        chunk = b"\0" * 2**20
        for _ in range(HUGE_BODY // len(chunk)):
            conn.sendall(chunk)
            tally["sent"] += len(chunk)
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):
            pass
    finally:
        tally["done"].set()


def ok(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")


@pytest.fixture
def server():
    made = []

    def make(behave):
        made.append(Server(behave))
        return made[-1]

    yield make
    for s in made:
        s.close()


def loopback(port: int, host: str = "127.0.0.1") -> Target:
    return Target(f"http://{host}:{port}/hook", "http", host, port, "/hook", "127.0.0.1")


@pytest.mark.parametrize("behave", [trickle, hang], ids=["trickling", "hanging"])
def test_slow_receivers_get_a_total_deadline(server, behave):
    s = server(behave)
    started = time.monotonic()
    status, error = _post(loopback(s.port), b"{}", {}, timeout=1.5, max_bytes=65536)
    took = time.monotonic() - started
    assert status is None and error.startswith("Timeout") and took < 3.0, (took, error)


def test_a_huge_response_body_is_not_buffered(server):
    """The peak of what Python allocated during the call (tracemalloc: this call's own buffers, not the
    process's lifetime peak) stays far below the 300 MiB the server sends, and the client hangs up after
    max_bytes: the server gets to send no more than what the sockets' buffers hold."""
    tally = {"sent": 0, "done": threading.Event()}
    s = server(functools.partial(huge_body, tally))
    started = time.monotonic()
    tracemalloc.start()
    try:
        status, error = _post(loopback(s.port), b"{}", {}, timeout=10, max_bytes=65536)
        peak_mib = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert (status, error) == (200, None)
    assert time.monotonic() - started < 5 and peak_mib < 8, peak_mib
    assert tally["done"].wait(10), "the server saw the client hang up"
    assert tally["sent"] < HUGE_BODY // 4, tally["sent"]


def test_the_connection_goes_to_the_checked_address_without_a_second_lookup(server):
    """rebind.example cannot resolve (reserved name): a second lookup would fail, a rebinding one could
    differ."""
    s = server(ok)
    status, error = _post(loopback(s.port, host="rebind.example"), b"{}", {}, timeout=5, max_bytes=1024)
    assert (status, error) == (204, None)
    assert f"host: rebind.example:{s.port}".encode() in s.received[0].lower()


def batch(url: str, batch_id: str = "batch_sec") -> Batch:
    return Batch(id=batch_id, status=BatchStatus.completed, webhook=url)


def test_url_tokens_stay_out_of_delivery_logs_and_worker_logs(redis_url, server, caplog):
    s = server(hang)
    connection = Redis.from_url(redis_url)
    url = f"http://127.0.0.1:{s.port}/hooks/tok3nSECRET?token=qSECRET"
    event_id = notify(connection, batch(url), settings=settings())
    with caplog.at_level(logging.DEBUG):
        assert attempt(connection, event_id, settings(webhook_timeout=0.5)) == "retry"
        closed = free_port()
        notify(
            connection,
            batch(f"http://127.0.0.1:{closed}/x/SECRET2?k=SECRET3", "batch_b"),
            settings=settings(),
        )
        run(connection, settings(webhook_retry_schedule=""), burst=True, poll_s=0.05)
    logged = json.dumps(delivery_log(connection, "batch_sec") + delivery_log(connection, "batch_b"))
    assert "SECRET" not in logged and "SECRET" not in caplog.text
    assert f"127.0.0.1:{s.port}/hooks/***?token=***" in logged


def test_the_delivery_loop_survives_bad_records_and_a_redis_restart(tmp_path, server):
    binary = shutil.which("redis-server")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(tmp_path)]  # fmt: skip
    redis_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    wait_for_port(port)
    connection, stop, s = Redis(port=port), threading.Event(), server(ok)
    connection.zadd("sluice:webhooks:due", {"evt_broken": 0})
    connection.hset("sluice:webhooks:delivery:evt_broken", "url", "http://x/")
    loop = threading.Thread(target=run, args=(connection, settings()), kwargs={"poll_s": 0.05, "stop": stop})
    loop.start()
    try:
        redis_proc.kill()
        redis_proc.wait()
        time.sleep(0.5)
        redis_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        wait_for_port(port)
        assert loop.is_alive()
        notify(connection, batch(f"http://127.0.0.1:{s.port}/hook"), settings=settings())
        deadline = time.monotonic() + 15
        while not [e for e in delivery_log(connection, "batch_sec") if e.get("outcome") == "delivered"]:
            assert time.monotonic() < deadline, "event not delivered after the restart"
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join(10)
        redis_proc.kill()
        redis_proc.wait()
