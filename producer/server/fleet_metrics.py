"""The server's /metrics (fleet totals, never per project): queue depths and registries per queue, live
workers, batches by status (read at scrape)."""

from __future__ import annotations

import hmac
from collections.abc import Iterator

import redis
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sluice.producer.server import fleet
from sluice.producer.server.errors import APIError


class FleetCollector(Collector):
    """Reads the fleet's state from Redis on every scrape."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("sluice_queue_depth", "Jobs waiting in each queue.", labels=["queue"])
        started = GaugeMetricFamily(
            "sluice_queue_started", "Jobs claimed by workers, per queue.", labels=["queue"]
        )
        failed = GaugeMetricFamily(
            "sluice_queue_failed", "Jobs in each queue's failed registry.", labels=["queue"]
        )
        for q in fleet.queues(self.connection):
            depth.add_metric([q.name], q.queued)
            started.add_metric([q.name], q.started)
            failed.add_metric([q.name], q.failed)
        yield from (depth, started, failed)
        workers = fleet.workers(self.connection)
        yield GaugeMetricFamily("sluice_workers", "Live workers.", value=len(workers))
        batches = GaugeMetricFamily("sluice_batches", "Batches in each status.", labels=["status"])
        for status, count in fleet.batches_by_status(self.connection).items():
            batches.add_metric([status], count)
        yield batches


def registry_for(connection: redis.Redis) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetCollector(connection))
    return registry


def metrics(request: Request) -> Response:
    """Prometheus text exposition of the fleet: totals only, no project names; with SLUICE_OPERATOR_TOKEN set,
    only for `Authorization: Bearer <token>`."""
    token = request.app.state.context.settings.operator_token
    if token is not None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token.get_secret_value()):
            raise APIError(401, "/metrics needs the operator token (SLUICE_OPERATOR_TOKEN).",
                           code="invalid_token")
    registry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
