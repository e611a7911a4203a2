"""The `sluice serve` application: OpenAI's Files, Batches and Models APIs, the dashboard, metrics and
health."""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from sluice.contract.logs import escape_control
from sluice.contract.settings import Settings, get_settings
from sluice.producer.client import Client
from sluice.producer.server import batches, dashboard, files, fleet_metrics, model_list
from sluice.producer.server.context import Context, ServerLimits
from sluice.producer.server.errors import REDIS_DOWN, error_response, install
from sluice.producer.server.keys import KeyStore
from sluice.producer.server.session import security_headers

log = logging.getLogger("sluice.server")


def create_app(settings: Settings | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """A FastAPI app over the Redis/rq/storage pipeline configured by settings."""
    settings = settings or get_settings()
    client = Client(settings=settings)
    app = FastAPI(title="Sluice", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.context = Context(settings, client, KeyStore(client.connection), limits or ServerLimits())
    install(app)
    for module in (files, batches, model_list, dashboard):
        app.include_router(module.router)
    app.middleware("http")(security_headers)
    app.middleware("http")(access_log)
    app.state.metrics_registry = fleet_metrics.registry_for(client.connection)
    app.add_api_route("/metrics", fleet_metrics.metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["GET"], include_in_schema=False)
    return app


async def access_log(request: Request, call_next):
    """One log line per request: method, path (never the query string, which may hold a key), status, time."""
    start = time.perf_counter()
    response = await call_next(request)
    ms = (time.perf_counter() - start) * 1000
    extra = {"project": getattr(request.state, "project", None), "status": response.status_code}
    path = escape_control(request.url.path)  # a NUL or newline in a path must not reach the log raw
    log.info("%s %s %d %.1f ms", escape_control(request.method), path, response.status_code, ms, extra=extra)
    return response


def healthz() -> PlainTextResponse:
    """Liveness: the process answers."""
    return PlainTextResponse("ok")


def readyz(request: Request) -> Response:
    """Readiness: Redis answers."""
    try:
        request.app.state.context.connection.ping()
    except Exception:  # any Redis failure means not ready
        return error_response(503, REDIS_DOWN, code="service_unavailable", headers={"Retry-After": "5"})
    return PlainTextResponse("ready")
