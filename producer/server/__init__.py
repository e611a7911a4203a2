"""`sluice serve`: an OpenAI-compatible Batch API, a dashboard and metrics over the Redis/rq pipeline."""

from sluice.producer.server.app import create_app

__all__ = ["create_app"]
