"""The dashboard at `/`: the project's batches with live progress, outputs, and the fleet's queues and workers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from sluice.producer.server import fleet
from sluice.producer.server.batches import INDEX, BatchApi
from sluice.producer.server.context import COOKIE, ApiKey, api_key, context
from sluice.producer.server.errors import APIError

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
    """What the page shows: the project's newest batches (with percent done) and the fleet."""
    api = BatchApi(context(request))
    ids = [i.decode() for i in api.connection.zrevrange(INDEX + key.project, 0, ROWS - 1)]
    rows = []
    for batch_id in ids:
        batch = api.public(*api.get(key.project, batch_id))
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        batch["percent"] = (
            100 if batch["status"] == "completed" else int(100 * done / max(1, counts["total"]))
        )
        rows.append(batch)
    return {
        "project": key.project,
        "batches": rows,
        "queues": fleet.queues(api.connection),
        "workers": fleet.workers(api.connection),
        "poll_ms": POLL_MS,
    }


def current_key(request: Request) -> ApiKey | None:
    try:
        return api_key(request)
    except APIError:
        return None


def login_page(error: str | None = None, status: int = 200) -> HTMLResponse:
    return HTMLResponse(templates.get_template("login.html").render(error=error), status_code=status)


def with_cookie(secret: str) -> RedirectResponse:
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, secret, httponly=True, samesite="strict", max_age=7 * 86400)
    return response


@router.get("/")
def index(request: Request, key: str | None = None) -> Response:
    """The dashboard; `?key=` (or the login form) stores the key in a cookie and drops it from the URL."""
    if key is not None:
        return with_cookie(key) if context(request).keys.lookup(key) else login_page("Unknown API key.", 401)
    found = current_key(request)
    if found is None:
        return login_page()
    return HTMLResponse(templates.get_template("dashboard.html").render(**view(request, found)))


@router.post("/login")
async def login(request: Request) -> Response:
    secret = str((await request.form()).get("key", "")).strip()
    if not secret or context(request).keys.lookup(secret) is None:
        return login_page("Unknown API key.", 401)
    return with_cookie(secret)


@router.get("/logout")
def logout() -> Response:
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(COOKIE)
    return response


@router.get("/dashboard/live")
def live(request: Request, key: ApiKey = Depends(api_key)) -> HTMLResponse:
    """The page's live part (batches and fleet), polled by its inline script."""
    return HTMLResponse(templates.get_template("live.html").render(**view(request, key)))
