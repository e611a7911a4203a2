"""The dashboard at `/`: the project's batches with live progress, outputs, and the fleet's queues and
workers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from sluice.producer.server import fleet
from sluice.producer.server.batches import INDEX, BatchApi
from sluice.producer.server.context import ApiKey, context, dashboard_key, session_key
from sluice.producer.server.errors import APIError
from sluice.producer.server.files import file_content
from sluice.producer.server.session import COOKIE, Sessions, same_origin, set_session_cookie

ROWS = 50
POLL_MS = 1500
templates = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=select_autoescape(["html"])
)
router = APIRouter(include_in_schema=False)


def ago(ts: int | None) -> str:
    if not ts:
        return "-"
    seconds = max(0, int(time.time()) - ts)
    return (
        f"{seconds} s ago"
        if seconds < 120
        else f"{seconds // 60} min ago"
        if seconds < 7200
        else f"{seconds // 3600} h ago"
    )


templates.filters["ago"] = ago


def view(request: Request, key: ApiKey) -> dict[str, Any]:
    """What the page shows: the project's newest batches (with percent done), its own shards per queue and
    the fleet's size; never another project's activity."""
    api = BatchApi(context(request))
    ids = [i.decode() for i in api.connection.zrevrange(INDEX + key.project, 0, ROWS - 1)]
    rows, mine = [], []
    for batch_id in ids:
        batch, owner = api.get(key.project, batch_id)
        mine.append(batch)
        public = api.public(batch, owner)
        counts = public["request_counts"]
        done = counts["completed"] + counts["failed"]
        public["percent"] = (
            100 if public["status"] == "completed" else int(100 * done / max(1, counts["total"]))
        )
        rows.append(public)
    live, models = fleet.capacity(api.connection)
    return {
        "project": key.project,
        "batches": rows,
        "queues": fleet.project_queues(api.connection, mine),
        "live_workers": live,
        "models": models,
        "poll_ms": POLL_MS,
    }


def login_page(request: Request, error: str | None = None, status: int = 200) -> HTMLResponse:
    html = templates.get_template("login.html").render(error=error)
    return HTMLResponse(html, status_code=status)


def secure_cookies(request: Request) -> bool:
    """Cookies are `Secure` when served over TLS or when SLUICE_COOKIE_SECURE says so (behind a TLS proxy)."""
    return request.url.scheme == "https" or context(request).settings.cookie_secure


@router.get("/")
def index(request: Request) -> Response:
    """The dashboard for a signed-in session, else the sign-in form (a key is never taken from the URL)."""
    found = session_key(request)
    if found is None:
        return login_page(request)
    nonce = request.state.csp_nonce
    return HTMLResponse(templates.get_template("dashboard.html").render(nonce=nonce, **view(request, found)))


@router.post("/login")
async def login(request: Request) -> Response:
    """Sign in with a key from the form (this server's own page only): a new session id in the cookie."""
    if not same_origin(request):
        return login_page(request, "Sign-in refused: the form was not sent from this server's page.", 403)
    secret = str((await request.form()).get("key", "")).strip()
    ctx = context(request)
    key = ctx.keys.lookup(secret) if secret else None
    if key is None:
        return login_page(request, "Unknown API key.", 401)
    response = RedirectResponse("/", status_code=303)
    set_session_cookie(response, Sessions(ctx.connection, ctx.keys).create(key), secure_cookies(request))
    return response


@router.post("/logout")
def logout(request: Request) -> Response:
    """End the session (this server's own page only) and clear the cookie."""
    if not same_origin(request):
        raise APIError(403, "Sign-out refused: not sent from this server's page.", code="cross_origin")
    ctx = context(request)
    Sessions(ctx.connection, ctx.keys).end(request.cookies.get(COOKIE))
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(COOKIE, path="/", secure=secure_cookies(request), httponly=True, samesite="strict")
    return response


@router.get("/dashboard/live")
def live(request: Request, key: ApiKey = Depends(dashboard_key)) -> HTMLResponse:
    """The page's live part (batches and fleet), polled by its script."""
    return HTMLResponse(templates.get_template("live.html").render(**view(request, key)))


@router.get("/dashboard/files/{file_id}/content")
def download(file_id: str, request: Request, key: ApiKey = Depends(dashboard_key)) -> StreamingResponse:
    """A project's file through the dashboard session (the API itself takes keys only from the header)."""
    return file_content(file_id, request, key)
