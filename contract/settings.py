"""Configuration from SLUICE_* environment variables (pydantic-settings)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_output_url(data_home: str | None = None) -> str:
    """The user's data folder, the same for every process whatever its working directory:
    $XDG_DATA_HOME/sluice/results, else ~/.local/share/sluice/results."""
    data = data_home or str(Path.home() / ".local" / "share")
    return (Path(data).expanduser().resolve() / "sluice" / "results").as_uri()


def adapter_cache(cache_home: str | None = None) -> Path:
    """Where adapters fetched from S3 are kept: $XDG_CACHE_HOME/sluice/adapters, else
    ~/.cache/sluice/adapters."""
    return Path(cache_home or Path.home() / ".cache") / "sluice" / "adapters"


class Settings(BaseSettings):
    """Everything the producer, CLI and worker read from the environment (nothing else reads it)."""

    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    xdg_data_home: str | None = Field(None, validation_alias="XDG_DATA_HOME")
    xdg_cache_home: str | None = Field(None, validation_alias="XDG_CACHE_HOME")
    output_url: str = ""
    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    webhook_allow: str = ""
    webhook_retry_schedule: str = "5s,30s,2m,10m,1h,2h,4h,8h,8h"
    webhook_timeout: float = Field(10.0, gt=0)
    webhook_max_response_bytes: int = Field(64 * 1024, ge=0)
    s3_addressing_style: str = "path"
    dtype: str | None = None
    device: str | None = None
    # the engine's kernel options (EngineConfig.cpu_kernel, cpu_isa, device_path, packed_weights)
    cpu_kernel: bool | None = None
    cpu_isa: str | None = None
    device_path: bool | None = None
    packed_weights: bool | None = None
    demo_model: Path = Path(__file__).resolve().parents[1] / "models" / "sluice-tiny"
    demo_results: Path = Path("results")
    max_line_bytes: int = Field(1_000_000, gt=0)
    max_lines: int = Field(50_000, gt=0)  # OpenAI's limits on one batch's input: 50,000 requests, 200 MB
    max_input_bytes: int = Field(200 * 1000 * 1000, gt=0)
    shard_size: int = Field(256, gt=0, le=10_000)
    max_shard_bytes: int = Field(16 * 1024 * 1024, gt=0)
    completion_window: str = "24h"
    shard_retries: int = Field(3, ge=0)
    finalize_retries: int = Field(5, ge=0)
    retry_backoff: list[int] = Field(default_factory=lambda: [10, 60, 300])
    reaper_interval: float = Field(30.0, gt=0)
    validating_timeout: int = Field(3600, gt=0)
    faults: str = ""
    shard_timeout: int = Field(6 * 3600, gt=0)
    heartbeat_ttl: int = Field(30, ge=3)
    result_ttl: int = Field(3600, gt=0)
    failure_ttl: int = Field(7 * 86400, gt=0)
    model: str | None = None
    served_models: str = ""
    output_roots: str = ""
    cookie_secure: bool = False
    operator_token: SecretStr | None = None
    shard_window: int = Field(8, ge=1)  # shards of one batch queued or running at once (fair share)
    max_enqueued_tokens: int = Field(0, ge=0)  # per project, estimated as JSON bytes / 4; 0: no cap
    json_max_number_digits: int | None = Field(None, gt=0)  # the engine's json_max_number_digits (default 32)
    json_max_string_chars: int | None = Field(None, gt=0)  # the engine's json_max_string_chars (default 8192)
    image_input_roots: str = ""  # file:// and s3:// roots image_url parts may name (none: only data: URLs)
    image_allow_https: bool = False
    image_max_bytes: int = Field(20 * 1024 * 1024, gt=0)
    image_max_pixels: int = Field(40_000_000, gt=0)
    image_max_per_request: int = Field(16, ge=0)
    image_timeout: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _default_output_url(self) -> Settings:
        """SLUICE_OUTPUT_URL unset: the user's data folder (not counted as set, see output_url_if_set)."""
        if not self.output_url:
            self.output_url = default_output_url(self.xdg_data_home)
            self.__pydantic_fields_set__.discard("output_url")
        return self

    def served_model_names(self) -> list[str]:
        """Model names requests may ask for (SLUICE_SERVED_MODELS, else SLUICE_MODEL's folder name)."""
        names = [n.strip() for n in self.served_models.split(",") if n.strip()]
        return names or ([Path(self.model).name] if self.model else [])

    def json_bounds(self) -> dict[str, int]:
        """The engine's JSON value bounds set by SLUICE_JSON_MAX_NUMBER_DIGITS /
        SLUICE_JSON_MAX_STRING_CHARS."""
        bounds = {"json_max_number_digits": self.json_max_number_digits,
                  "json_max_string_chars": self.json_max_string_chars}
        return {k: v for k, v in bounds.items() if v is not None}

    def output_root_urls(self) -> list[str]:
        """Where batches may write, fleet-wide: SLUICE_OUTPUT_ROOTS (comma-separated), else SLUICE_OUTPUT_URL
        (default: the user's data folder, never the working directory, so a server and its workers agree)."""
        roots = [r.strip() for r in self.output_roots.split(",") if r.strip()]
        return roots or [self.output_url]


def default_redis_url() -> str:
    """SLUICE_REDIS_URL (a default for command-line options)."""
    return get_settings().redis_url


def output_url_if_set() -> str | None:
    """SLUICE_OUTPUT_URL when it is set, else None."""
    settings = get_settings()
    return settings.output_url if "output_url" in settings.model_fields_set else None


class WebhookSettings(BaseModel):
    """Webhook configuration; `of(settings)` takes it from Settings' SLUICE_WEBHOOK_* fields."""

    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    webhook_allow: str = ""
    webhook_retry_schedule: str = Settings.model_fields["webhook_retry_schedule"].default
    webhook_timeout: float = Field(Settings.model_fields["webhook_timeout"].default, gt=0)
    webhook_max_response_bytes: int = Field(Settings.model_fields["webhook_max_response_bytes"].default, ge=0)

    @classmethod
    def of(cls, settings: Settings) -> WebhookSettings:
        """The webhook fields of settings (a process reads Settings once at start and passes them here)."""
        return cls(**settings.model_dump(include=set(cls.model_fields)))


def get_settings() -> Settings:
    """Settings read from the current environment."""
    return Settings()


def stay_off_the_hub() -> None:
    """Keep this process off the Hugging Face Hub (for a worker, which serves a model folder on disk):
    otherwise bitsandbytes' CPU backend asks the Hub for a kernel (remote code) at its import where HF
    `kernels` is installed, and transformers checks it in from_pretrained. huggingface_hub reads
    HF_HUB_OFFLINE once, at its import, so call this first; a value the operator set wins."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
