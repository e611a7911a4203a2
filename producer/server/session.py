"""Dashboard sessions: a random id in the cookie, mapped in Redis (with a TTL) to an API key id, never the
key; and the same-origin checks that guard login, logout and cookie-authenticated routes."""

from __future__ import annotations

import hashlib
import secrets
from urllib.parse import urlsplit

import redis
from fastapi import Request
from fastapi.responses import Response

from sluice.producer.server.keys import ApiKey, KeyStore

COOKIE = "sluice_session"
SESSION = "sluice:session:"  # + sha256(session id) -> API key id
SESSION_TTL = 7 * 86400
CSP = (
    "default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def _stored(session_id: str) -> str:
    return SESSION + hashlib.sha256(session_id.encode()).hexdigest()


class Sessions:
    """Create, resolve and end dashboard sessions; a revoked key ends its sessions at once."""

    def __init__(self, connection: redis.Redis, keys: KeyStore) -> None:
        self.connection, self.keys = connection, keys

    def create(self, key: ApiKey) -> str:
        """A new session for key; returns its id (only its hash is stored)."""
        session_id = secrets.token_urlsafe(32)
        self.connection.set(_stored(session_id), key.id, ex=SESSION_TTL)
        return session_id

    def lookup(self, session_id: str | None) -> ApiKey | None:
        """The live key behind a session id, None for an unknown, expired or revoked one."""
        if not session_id:
            return None
        key_id = self.connection.get(_stored(session_id))
        return self.keys.get(key_id.decode()) if key_id is not None else None

    def end(self, session_id: str | None) -> None:
        if session_id:
            self.connection.delete(_stored(session_id))


def same_origin(request: Request) -> bool:
    """Whether a state-changing request comes from a page of this server (Origin, else Referer, must name
    this host, as Host or a proxy's X-Forwarded-Host says; a request naming neither is refused). A browser
    lets no page set these headers for another site, so a forged form cannot pass."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin or origin == "null":
        return False
    hosts = {h.strip().lower() for h in (request.headers.get("x-forwarded-host") or "").split(",")
             if h.strip()}
    hosts.add((request.headers.get("host") or "").lower())
    return urlsplit(origin).netloc.lower() in hosts - {""}


def cross_site(request: Request) -> bool:
    """A browser's word that the request was started by another site (Sec-Fetch-Site, or a foreign Origin)."""
    if request.headers.get("sec-fetch-site") in ("cross-site", "same-site"):
        return True
    return "origin" in request.headers and not same_origin(request)


def set_session_cookie(response: Response, session_id: str, secure: bool) -> None:
    response.set_cookie(
        COOKIE, session_id, max_age=SESSION_TTL, httponly=True, samesite="strict", secure=secure, path="/"
    )


async def security_headers(request: Request, call_next):
    """No framing, no sniffing, no referrer to other sites; HTML answers get a restrictive CSP with a
    nonce."""
    nonce = secrets.token_urlsafe(16)
    request.state.csp_nonce = nonce
    response = await call_next(request)
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Content-Security-Policy"] = CSP.format(nonce=nonce)
    return response
