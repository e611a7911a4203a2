"""Operations: JSON logs with batch/shard/job ids and no secrets, and the Kubernetes probes wired to them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from sluice.contract.logs import JsonFormatter, PlainFormatter, redact

ROOT = Path(__file__).resolve().parents[1]


def record(message: str, *args) -> logging.LogRecord:
    return logging.LogRecord("rq.worker", logging.INFO, __file__, 1, message, args, None)


def test_json_log_lines_carry_ids_and_hide_secrets():
    batch = "batch_" + "ab" * 16
    line = json.loads(JsonFormatter().format(record("default: %s shard done", f"{batch}-shard-3")))
    assert line["batch_id"] == batch and line["shard"] == 3 and line["job_id"] == f"{batch}-shard-3"
    assert line["level"] == "INFO" and line["logger"] == "rq.worker"
    described = json.loads(
        JsonFormatter().format(record(f"Successfully completed {batch} shard 12 (4 requests)"))
    )
    assert described["job_id"] == f"{batch}-shard-12" and described["shard"] == 12
    finalize = json.loads(JsonFormatter().format(record(f"finalize {batch}-finalize")))
    assert finalize["job_id"] == f"{batch}-finalize" and "shard" not in finalize
    secret = "sk-sluice-" + "x" * 43
    text = redact(f"redis://:hunter2@redis:6379/0 key {secret} whsec_abcDEF123 Authorization: Bearer tok123")
    assert "hunter2" not in text and secret not in text and "abcDEF123" not in text and "tok123" not in text
    assert "redis://:***@redis:6379/0" in text


def test_plain_log_lines_escape_control_characters():
    """A hostile custom_id or path cannot forge a log line or write a NUL or a terminal escape."""
    line = PlainFormatter().format(record("request %s failed", "a\nforged ERROR line\x00\x1b[31m"))
    assert "\n" not in line and "\x00" not in line and "\x1b" not in line
    assert line.endswith("request a\\nforged ERROR line\\x00\\x1b[31m failed")
    assert "\n" in json.loads(JsonFormatter().format(record("request %s", "a\nb")))["message"]  # JSON escapes


def test_probes_point_at_the_health_endpoints():
    worker = yaml.safe_load((ROOT / "infra/k8s/worker.yaml").read_text())
    container = worker["spec"]["template"]["spec"]["containers"][0]
    port = int(container["args"][container["args"].index("--metrics-port") + 1])
    assert container["ports"][0]["containerPort"] == port
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    deployment, service = yaml.safe_load_all((ROOT / "infra/k8s/server.yaml").read_text())
    server = deployment["spec"]["template"]["spec"]["containers"][0]
    assert (
        server["command"] == ["sluice", "serve"] and server["readinessProbe"]["httpGet"]["path"] == "/readyz"
    )
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
