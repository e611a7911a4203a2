"""The one place Redis clients are built: `redis://`, `rediss://`, `unix://` and `redis+sentinel://` URLs.

`redis+sentinel://h1:26379,h2:26379,h3:26379/<service>/<db>?password=...&sentinel_password=...&ssl=true`
asks the sentinels for the service's primary and returns a client whose pool asks again whenever a connection
fails, so every process (producer, server, cron, reaper, workers, rq's queues and registries) follows a
failover on its next command, without a restart. Options in the query: `password`, `username`,
`sentinel_password`, `sentinel_username`, `ssl` (TLS to the primary), `sentinel_ssl`, `ssl_ca_certs`,
`ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`, `socket_timeout`, `socket_connect_timeout` (seconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEME = "redis+sentinel"
SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_SOCKET_TIMEOUT_S = (
    10.0  # a primary that stops answering (partition) fails commands instead of hanging
)
NO_REPLICA_RETRY_S = 10.0
TRUE = {"1", "true", "yes", "on"}
FLOATS = {"socket_timeout", "socket_connect_timeout"}
STRINGS = {"password", "username", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}
SENTINEL_ONLY = {"sentinel_password", "sentinel_username", "sentinel_ssl"}


_no_replica_until: dict[int, float] = {}  # a Sentinel pool's id -> until when WAIT is skipped


class RedisURLError(ValueError):
    """A Redis URL this factory cannot read (the message names what is wrong, never a password)."""


@dataclass
class SentinelURL:
    """The parts of a `redis+sentinel://` URL."""

    hosts: list[tuple[str, int]]
    service: str
    db: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_options: dict[str, Any] = field(default_factory=dict)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Split `redis+sentinel://h1:p1,h2:p2/<service>[/<db>]?opts` into hosts, service, db and options."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise RedisURLError(f"not a {SENTINEL_SCHEME}:// URL (scheme {parts.scheme!r})")
    netloc = parts.netloc.rsplit("@", 1)[-1]
    hosts = [_host_port(h) for h in netloc.split(",") if h.strip()]
    if not hosts:
        raise RedisURLError("a redis+sentinel:// URL names at least one sentinel host")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise RedisURLError("a redis+sentinel:// URL's path is /<service> or /<service>/<db>")
    db = _int(path[1], "db") if len(path) == 2 else 0
    options, sentinel_options = _options(parse_qsl(parts.query, keep_blank_values=True))
    return SentinelURL(hosts, unquote(path[0]), db, options, sentinel_options)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or host.endswith(":"):  # no port (a bare IPv6 address keeps its colons)
        return text.strip().strip("[]"), DEFAULT_SENTINEL_PORT
    return host.strip("[]"), _int(port, "sentinel port")


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise RedisURLError(f"the {what} in a redis+sentinel:// URL must be a number, not {text!r}") from None


def _options(pairs: list[tuple[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Client options for the primary and for the sentinels, from the URL's query."""
    options: dict[str, Any] = {}
    sentinel: dict[str, Any] = {}
    for name, value in pairs:
        if name == "ssl":
            options["ssl"] = value.lower() in TRUE
        elif name in FLOATS:
            try:
                options[name] = float(value)
            except ValueError:
                raise RedisURLError(f"{name} must be a number of seconds, not {value!r}") from None
        elif name in STRINGS:
            options[name] = value
        elif name in SENTINEL_ONLY:
            key = name.removeprefix("sentinel_")
            sentinel[key] = value.lower() in TRUE if key == "ssl" else value
        else:
            raise RedisURLError(f"unknown option {name!r} in a redis+sentinel:// URL")
    options.setdefault("socket_timeout", SENTINEL_SOCKET_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", options["socket_timeout"])
    for name in FLOATS:
        if name in options:
            sentinel.setdefault(name, options[name])
    return options, sentinel


def connect(url: str, **overrides: Any) -> redis.Redis:
    """A Redis client for url (redis://, rediss://, unix://, redis+sentinel://); overrides: client options."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise RedisURLError(
            f"a Redis URL starts with one of {', '.join(s + '://' for s in SCHEMES)}, not {scheme!r}"
        )
    if scheme != SENTINEL_SCHEME:
        return redis.Redis.from_url(url, **overrides)
    parsed = parse_sentinel_url(url)
    options = {**parsed.options, **overrides}
    sentinel_kwargs = {
        k: v for k, v in parsed.sentinel_options.items() if k in FLOATS | {"password", "username"}
    }
    if parsed.sentinel_options.get("ssl"):
        sentinel_kwargs["ssl"] = True
    sentinel = Sentinel(parsed.hosts, sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(parsed.service, db=parsed.db, **options)


def follows_sentinel(connection: redis.Redis) -> bool:
    """Whether connection reaches its primary through sentinels (so replicas exist to WAIT for)."""
    return isinstance(connection.connection_pool, SentinelConnectionPool)


def wait_for_replica(connection: redis.Redis, timeout_ms: int = 1000) -> int:
    """Wait until the writes so far reached a replica (WAIT 1), for commit points that must survive failover;
    the number of replicas that acknowledged (0 without sentinels: a lone server has none to wait for).

    After a WAIT that no replica answered (the primary left alone, as after a failover), the next ones are
    skipped for NO_REPLICA_RETRY_S instead of each costing timeout_ms: there is nothing to wait for."""
    pool = connection.connection_pool
    skip_until = _no_replica_until.get(id(pool), 0.0)
    if not isinstance(pool, SentinelConnectionPool) or time.monotonic() < skip_until:
        return 0
    acknowledged = int(connection.execute_command("WAIT", 1, timeout_ms))
    if not acknowledged:
        _no_replica_until[id(pool)] = time.monotonic() + NO_REPLICA_RETRY_S
    return acknowledged
