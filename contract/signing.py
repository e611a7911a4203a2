"""Standard Webhooks signing and verification, and the safety check for webhook target URLs."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import re
import secrets
import socket
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

SECRET_PREFIX = "whsec_"
METADATA_HOSTS = {"metadata", "metadata.google.internal", "metadata.goog"}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


class WebhookSettings(BaseSettings):
    """Webhook configuration from SLUICE_WEBHOOK_* environment variables."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    webhook_allow: str = ""
    webhook_retry_schedule: str = "5s,30s,2m,10m,1h,2h,4h,8h,8h"
    webhook_timeout: float = Field(10.0, gt=0)


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


def secret_key(secret: str | bytes) -> bytes:
    """The HMAC key inside a 'whsec_' + base64 secret."""
    if isinstance(secret, bytes):
        return secret
    raw = secret.removeprefix(SECRET_PREFIX)
    key = base64.b64decode(raw + "=" * (-len(raw) % 4))
    if not key:
        raise ValueError("webhook secret may not be empty")
    return key


def sign(secret: str | bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The 'v1,<base64 HMAC-SHA256>' signature of '{id}.{timestamp}.{body}'."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


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


def verify(secret: str | bytes, headers: Mapping[str, str], body: bytes | str, tolerance: int = 300) -> Any:
    """Check a delivery's signature and timestamp; return the parsed JSON payload or raise."""
    body = body.encode() if isinstance(body, str) else body
    lower = {k.lower(): v for k, v in headers.items()}
    msg_id, stamp, signatures = (
        lower.get(h) for h in ("webhook-id", "webhook-timestamp", "webhook-signature")
    )
    if not (msg_id and stamp and signatures):
        raise WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature header")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not an integer") from None
    if abs(time.time() - timestamp) > tolerance:
        raise WebhookVerificationError("webhook-timestamp outside the tolerance window")
    expected = sign(secret, msg_id, timestamp, body)
    if not any(hmac.compare_digest(expected, candidate) for candidate in signatures.split()):
        raise WebhookVerificationError("no matching v1 signature")
    return json.loads(body)


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


def _is_internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return not address.is_global or address.is_multicast


def _resolve(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise UnsafeWebhookURL(f"webhook host {host!r} does not resolve: {exc}") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def check_url(url: str, allow: str | None = None) -> str:
    """Return url if it is http(s) and every address it resolves to is public or allow-listed."""
    allow = WebhookSettings().webhook_allow if allow is None else allow
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UnsafeWebhookURL(f"webhook URL must be http or https, not {parts.scheme or 'empty'!r}")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise UnsafeWebhookURL("webhook URL has no host")
    hosts, networks = parse_allow(allow)
    if host in hosts:
        return url
    if host in METADATA_HOSTS:
        raise UnsafeWebhookURL(f"webhook host {host!r} is a cloud metadata service")
    for address in _resolve(host, parts.port or (443 if parts.scheme == "https" else 80)):
        if _is_internal(address) and not any(
            address in net for net in networks if net.version == address.version
        ):
            raise UnsafeWebhookURL(
                f"webhook host {host!r} resolves to internal address {address}; allow it with SLUICE_WEBHOOK_ALLOW"
            )
    return url
