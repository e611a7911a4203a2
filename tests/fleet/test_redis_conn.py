"""The connection factory: URL parsing, and a client that follows a Sentinel failover (real processes on
loopback)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from sluice.contract.redis_conn import (
    RedisURLError,
    connect,
    follows_sentinel,
    parse_sentinel_url,
    wait_for_replica,
)
from tests.fleet.sentinels import SERVICE, loopback_set, wait_for


def test_sentinel_urls_name_hosts_service_db_and_options():
    url = ("redis+sentinel://h1:26379,h2:26380,h3/mysvc/3?password=p%40ss&sentinel_password=s&ssl=true"
           "&socket_timeout=2.5&ssl_ca_certs=/ca.pem")  # fmt: skip
    parsed = parse_sentinel_url(url)
    assert parsed.hosts == [("h1", 26379), ("h2", 26380), ("h3", 26379)]
    assert (parsed.service, parsed.db) == ("mysvc", 3)
    assert parsed.options == {"password": "p@ss", "ssl": True, "socket_timeout": 2.5,
                              "socket_connect_timeout": 2.5, "ssl_ca_certs": "/ca.pem"}  # fmt: skip
    assert parsed.sentinel_options == {"password": "s", "socket_timeout": 2.5, "socket_connect_timeout": 2.5}
    assert parse_sentinel_url("redis+sentinel://h1/svc").db == 0


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel:///svc/0", "at least one sentinel"),
        ("redis+sentinel://h1:26379", "/<service>"),
        ("redis+sentinel://h1:x/svc/0", "sentinel port"),
        ("redis+sentinel://h1/svc/zero", "db"),
        ("redis+sentinel://h1/svc/0?color=red", "unknown option 'color'"),
        ("redis+sentinel://h1/svc/0?socket_timeout=soon", "socket_timeout"),
        ("http://h1/0", "starts with one of"),
    ],
)
def test_bad_redis_urls_get_specific_errors(url, message):
    with pytest.raises(RedisURLError, match=message):
        connect(url)


def test_plain_urls_make_plain_clients(redis_url):
    client = connect(redis_url)
    assert client.ping() and not follows_sentinel(client)
    assert wait_for_replica(client) == 0, "a lone server has no replica to wait for"


def test_a_sentinel_client_follows_a_failover_without_a_restart(tmp_path):
    """One client (and a pubsub on it) keeps working across SIGKILL of the primary: the replica is promoted,
    the client's next commands reach it; writes acknowledged with WAIT survive the failover."""
    servers = loopback_set(tmp_path, sentinels=3)
    servers.start()
    try:
        client = connect(servers.url + "?socket_timeout=2")
        assert follows_sentinel(client)
        client.set("before", "1")
        assert wait_for_replica(client) == 1, "the replica acknowledged the write"
        got: list[bytes] = []
        pubsub = client.pubsub()
        pubsub.subscribe(**{"news": lambda m: got.append(m["data"])})
        thread = pubsub.run_in_thread(sleep_time=0.1, daemon=True, exception_handler=lambda *a: None)
        old = servers.primary.address
        new = servers.fail_over()
        assert new.address != old
        wait_for(lambda: client.set("after", "2"), 30, "a write through the same client")
        assert client.get("before") == b"1" and client.get("after") == b"2"
        assert client.connection_pool.get_master_address() == new.address

        def heard() -> bool:
            client.publish("news", "hello")
            return b"hello" in got

        wait_for(heard, 30, "the pubsub to resubscribe on the new primary")
        thread.stop()
        assert SERVICE in servers.url
    finally:
        servers.stop()


def test_only_the_connection_factory_builds_redis_clients():
    """Every process reaches Redis through contract/redis_conn.connect, so a Sentinel URL works everywhere."""
    root = Path(__file__).resolve().parents[2]
    builders = re.compile(r"\b(from_url|StrictRedis|Sentinel|ConnectionPool|Redis)\(")
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for folder in ("contract", "producer", "worker", "cli", "engine")
        for path in sorted((root / folder).rglob("*.py"))
        if path.name != "redis_conn.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if builders.search(line)
    ]
    assert not found, found


def test_a_primary_left_without_a_replica_does_not_make_every_commit_wait(tmp_path):
    """WAIT that no replica answers costs its timeout once; the next commit points skip it for a while."""
    servers = loopback_set(tmp_path)
    servers.start()
    try:
        client = connect(servers.url)
        assert wait_for_replica(client, 200) == 1
        servers.replica.kill()
        client.set("k", "v")
        assert wait_for_replica(client, 200) == 0
        started = time.monotonic()
        assert [wait_for_replica(client, 2000) for _ in range(5)] == [0] * 5
        assert time.monotonic() - started < 1.0, "skipped, not five 2 s timeouts"
    finally:
        servers.stop()
