"""What every route needs: settings, Redis, the producer Client and the stores; and the caller's key."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from sluice.contract.settings import Settings
from sluice.producer.client import Client
from sluice.producer.server.errors import APIError
from sluice.producer.server.keys import ApiKey, KeyStore
from sluice.producer.server.session import COOKIE, Sessions, cross_site


@dataclass
class ServerLimits:
    """Upload limits (OpenAI's defaults: 200 MB and 50,000 requests per batch file)."""

    max_file_bytes: int = 200 * 1000 * 1000
    max_file_requests: int = 50_000


@dataclass
class Context:
    """The server's shared state, one per app."""

    settings: Settings
    client: Client
    keys: KeyStore
    limits: ServerLimits

    @property
    def connection(self):
        return self.client.connection


def context(request: Request) -> Context:
    return request.app.state.context


def presented_secret(request: Request) -> str | None:
    """The key from `Authorization: Bearer` (the API takes no cookie: the dashboard's cookie is a session
    id)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def api_key(request: Request) -> ApiKey:
    """The caller's key; 401 with OpenAI's error body when missing or unknown."""
    secret = presented_secret(request)
    if secret is None:
        raise APIError(
            401,
            "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY` "
            "(create one with `sluice keys create PROJECT`).",
        )
    key = context(request).keys.lookup(secret)
    if key is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    request.state.project = key.project
    return key


def session_key(request: Request) -> ApiKey | None:
    """The key behind the dashboard's session cookie, None without a live session or when another site
    started the request."""
    if cross_site(request):
        return None
    ctx = context(request)
    key = Sessions(ctx.connection, ctx.keys).lookup(request.cookies.get(COOKIE))
    if key is not None:
        request.state.project = key.project
    return key


def dashboard_key(request: Request) -> ApiKey:
    """session_key for the dashboard's own routes; 401 without a session."""
    key = session_key(request)
    if key is None:
        raise APIError(401, "Sign in at / first (no dashboard session).", code="no_session")
    return key
