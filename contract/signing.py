"""Standard Webhooks signing and verification (through the `standardwebhooks` library), and the safety check
for webhook target URLs."""

from __future__ import annotations

import base64
import ipaddress
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook
from standardwebhooks.webhooks import WebhookVerificationError as StandardWebhooksError
from urllib3.exceptions import LocationParseError
from urllib3.util import Url, parse_url

from sluice.contract.settings import WebhookSettings

__all__ = ["WebhookSettings"]  # defined beside Settings, kept importable from here

SECRET_PREFIX = "whsec_"
METADATA_HOSTS = {"metadata", "metadata.google.internal", "metadata.goog"}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


class WebhookVerificationError(ValueError):
    """A delivery whose headers or signature do not check out."""


class UnsafeWebhookURL(ValueError):
    """A webhook target that is not http(s) or resolves to an internal address."""


def parse_duration(text: str) -> float:
    """Seconds in '500ms', '5s', '15m', '2h', '1d' or a bare number of seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 15m, 2h)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_schedule(text: str) -> list[float]:
    """Retry delays in seconds from a comma-separated list of durations."""
    return [parse_duration(part) for part in text.split(",") if part.strip()]


def generate_secret() -> str:
    """A fresh 'whsec_' + base64 secret of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _webhook(secret: str | bytes) -> Webhook:
    """The Standard Webhooks signer for a 'whsec_' + base64 secret (or the raw key bytes)."""
    try:
        return Webhook(secret)
    except EmptyWebhookSecretError:
        raise ValueError("webhook secret may not be empty") from None


def sign(secret: str | bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The 'v1,<base64 HMAC-SHA256>' signature of '{id}.{timestamp}.{body}'."""
    return _webhook(secret).sign(msg_id, datetime.fromtimestamp(timestamp, UTC), body)


def sign_headers(
    secret: str | bytes, msg_id: str, body: bytes, timestamp: int | None = None
) -> dict[str, str]:
    """The three Standard Webhooks headers for one delivery attempt of body."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


def verify(secret: str | bytes, headers: Mapping[str, str], body: bytes | str) -> Any:
    """Check a delivery's signature and timestamp (within Standard Webhooks' tolerance); the parsed JSON
    body."""
    try:
        return _webhook(secret).verify(body, dict(headers))
    except StandardWebhooksError as exc:
        raise WebhookVerificationError(str(exc)) from None


def parse_allow(allow: str) -> tuple[set[str], list[ipaddress.IPv4Network | ipaddress.IPv6Network]]:
    """Host names and networks from a comma-separated SLUICE_WEBHOOK_ALLOW value."""
    hosts, networks = set(), []
    for entry in (e.strip() for e in allow.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            hosts.add(entry.lower().rstrip("."))
    return hosts, networks


_EMBEDDING = [
    (ipaddress.ip_network("::/96"), 0),  # IPv4-compatible (deprecated)
    (ipaddress.ip_network("::ffff:0:0/96"), 0),  # IPv4-mapped
    (ipaddress.ip_network("::ffff:0:0:0/96"), 0),  # IPv4-translated (SIIT)
    (ipaddress.ip_network("64:ff9b::/96"), 0),  # NAT64 well-known prefix
    (ipaddress.ip_network("64:ff9b:1::/48"), 0),  # NAT64 local-use prefix
    (ipaddress.ip_network("2002::/16"), 80),  # 6to4
]


@dataclass(frozen=True)
class Target:
    """A checked webhook target: the URL's parts as the sender parses them and the address to connect to."""

    url: str
    scheme: str
    host: str
    port: int
    request_uri: str
    address: str

    @property
    def host_header(self) -> str:
        """The Host header: the name from the URL (bracketed if IPv6), with a non-default port."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address inside an IPv6 one (mapped, translated, NAT64, 6to4, Teredo), if any."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.teredo:
        return address.teredo[1]
    for network, shift in _EMBEDDING:
        if address in network:
            return ipaddress.IPv4Address((int(address) >> shift) & 0xFFFFFFFF)
    return None


def is_internal(address: IPAddress) -> bool:
    """True for any address that is not plain public unicast, looking through embedded IPv4 too."""
    inner = embedded_ipv4(address)
    if inner is not None and is_internal(inner):
        return True
    return not address.is_global or address.is_multicast


def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise UnsafeWebhookURL(f"webhook host {host!r} does not resolve: {exc}") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def _parse(url: str) -> Url:
    if not url.isprintable() or any(c in url for c in "\\ "):
        raise UnsafeWebhookURL("webhook URL may not contain backslashes, spaces or control characters")
    try:
        parts = parse_url(url)
    except LocationParseError as exc:
        raise UnsafeWebhookURL(f"webhook URL does not parse: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise UnsafeWebhookURL(f"webhook URL must be http or https, not {parts.scheme or 'empty'!r}")
    if parts.auth is not None or "@" in (parts.netloc or ""):
        raise UnsafeWebhookURL(
            "webhook URL may not carry user:password@ (put credentials in the path or query)"
        )
    if not parts.host:
        raise UnsafeWebhookURL("webhook URL has no host")
    return parts


def resolve_target(url: str, allow: str) -> Target:
    """Parse url as the sender (urllib3) does and pick the address to connect to, refusing internal ones.

    Every address the host resolves to must be public (IPv4 inside IPv6 included) or allow-listed; the sender
    then connects to the returned address, so a second lookup cannot be rebound to another one.
    """
    parts = _parse(url)
    host = parts.host.strip("[]").lower().rstrip(".")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    hosts, networks = parse_allow(allow)
    if host in METADATA_HOSTS and host not in hosts:
        raise UnsafeWebhookURL(f"webhook host {host!r} is a cloud metadata service")
    addresses = _resolve(host, port)
    if host not in hosts:
        for address in addresses:
            if is_internal(address) and not any(
                address in n for n in networks if n.version == address.version
            ):
                inner = embedded_ipv4(address)
                shown = f"{address} (IPv4 {inner} inside)" if inner else str(address)
                raise UnsafeWebhookURL(
                    f"webhook host {host!r} resolves to internal address {shown}; allow it with "
                    "SLUICE_WEBHOOK_ALLOW"
                )
    return Target(url, parts.scheme, host, port, parts.request_uri, str(addresses[0]))


def check_url(url: str, allow: str) -> str:
    """Return url if it is http(s) and every address it resolves to is public or allow-listed (allow:
    Settings.webhook_allow, SLUICE_WEBHOOK_ALLOW)."""
    resolve_target(url, allow)
    return url


_URL_IN_TEXT = re.compile(r"(?i)\bhttps?://[^\s'\"<>]+")
_PLAIN_SEGMENT = re.compile(r"[a-z_.~-]{0,24}")


def redact_url(url: str) -> str:
    """url without what may be a secret: no user:password, query values and token-like path segments as
    ***."""
    try:
        parts = parse_url(url)
    except LocationParseError:
        return "<unparseable URL>"
    path = "/".join(seg if _PLAIN_SEGMENT.fullmatch(seg) else "***" for seg in (parts.path or "").split("/"))
    query = "&".join(f"{p.partition('=')[0]}=***" for p in parts.query.split("&")) if parts.query else None
    return Url(scheme=parts.scheme, host=parts.host, port=parts.port, path=path or None, query=query).url


def redact_urls(text: str) -> str:
    """text with every http(s) URL in it redacted (for logs and delivery records)."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
