"""API keys: one project each, stored in Redis by SHA-256 hash only; per-project webhook settings."""

from __future__ import annotations

import hashlib
import re
import secrets
import time

import redis
from pydantic import BaseModel

KEYS = "sluice:apikeys"  # hash: key id -> ApiKey JSON
BY_HASH = "sluice:apikey:"  # + sha256(secret) -> key id
PROJECTS = "sluice:projects"  # hash: project -> ProjectSettings JSON
PROJECT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ApiKey(BaseModel):
    """A key as listed: never the secret, only its id, project and a recognisable prefix."""

    id: str
    project: str
    name: str = ""
    prefix: str
    created_at: int
    digest: str


class ProjectSettings(BaseModel):
    """What a project configures once for all its batches."""

    webhook_url: str | None = None


def digest(secret: str) -> str:
    """The stored form of a secret (random 256-bit secrets need no slow hash)."""
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """Create, look up, list and revoke API keys; read and write project settings."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection

    def create(self, project: str, name: str = "") -> tuple[ApiKey, str]:
        """A new key for project; returns it and its secret, which is shown once and never stored."""
        if not PROJECT_NAME.match(project):
            raise ValueError(f"project must be 1-64 letters, digits, '_', '.' or '-', got {project!r}")
        key_id, secret = f"key_{secrets.token_hex(8)}", f"sk-sluice-{secrets.token_urlsafe(32)}"
        key = ApiKey(
            id=key_id,
            project=project,
            name=name,
            prefix=secret[:14],
            created_at=int(time.time()),
            digest=digest(secret),
        )
        with self.connection.pipeline() as pipe:
            pipe.hset(KEYS, key_id, key.model_dump_json())
            pipe.set(BY_HASH + key.digest, key_id)
            pipe.execute()
        return key, secret

    def lookup(self, secret: str) -> ApiKey | None:
        """The live key whose secret this is, None for unknown or revoked secrets."""
        key_id = self.connection.get(BY_HASH + digest(secret))
        raw = self.connection.hget(KEYS, key_id) if key_id is not None else None
        return ApiKey.model_validate_json(raw) if raw is not None else None

    def get(self, key_id: str) -> ApiKey | None:
        """The live key with this id, None when unknown or revoked."""
        raw = self.connection.hget(KEYS, key_id)
        return ApiKey.model_validate_json(raw) if raw is not None else None

    def list(self, project: str | None = None) -> list[ApiKey]:
        """Live keys, oldest first, optionally of one project."""
        keys = [ApiKey.model_validate_json(v) for v in self.connection.hvals(KEYS)]
        return sorted((k for k in keys if project in (None, k.project)), key=lambda k: (k.created_at, k.id))

    def revoke(self, key_id: str) -> ApiKey:
        """Delete a key so that its secret stops working at once (KeyError if unknown)."""
        raw = self.connection.hget(KEYS, key_id)
        if raw is None:
            raise KeyError(key_id)
        key = ApiKey.model_validate_json(raw)
        with self.connection.pipeline() as pipe:
            pipe.hdel(KEYS, key_id)
            pipe.delete(BY_HASH + key.digest)
            pipe.execute()
        return key

    def settings(self, project: str) -> ProjectSettings:
        """The project's settings (defaults when never set)."""
        raw = self.connection.hget(PROJECTS, project)
        return ProjectSettings.model_validate_json(raw) if raw is not None else ProjectSettings()

    def set_settings(self, project: str, settings: ProjectSettings) -> None:
        self.connection.hset(PROJECTS, project, settings.model_dump_json())
