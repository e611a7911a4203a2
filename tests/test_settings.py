"""Settings is the one reader of the environment, and each SLUICE_* default it holds takes effect."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from typer.testing import CliRunner

from sluice.cli.main import app
from sluice.producer import Client

ROOT = Path(__file__).resolve().parents[1]
READERS = {("os", "environ"), ("os", "getenv"), ("os", "getenvb")}


def lines(n: int) -> list[dict]:
    body = {"prompt": "hi", "max_tokens": 2}
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            for i in range(n)]


def test_shard_size_and_completion_window_come_from_the_environment(redis_url, monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_SHARD_SIZE", "2")
    monkeypatch.setenv("SLUICE_COMPLETION_WINDOW", "2h")
    client = Client(redis_url)
    batch = client.submit_batch(lines(5), output=tmp_path.as_uri())
    assert batch.num_shards == 3 and batch.completion_window == "2h"
    assert batch.expires_at - batch.created_at == 7200
    assert client.submit_batch(lines(5), output=tmp_path.as_uri(), shard_size=5).num_shards == 1
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines(4)))
    out = CliRunner().invoke(app, ["submit", str(path), "--output", tmp_path.as_uri(), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["num_shards"] == 2


def test_nothing_but_settings_reads_the_environment():
    found = []
    for package in ("contract", "producer", "worker", "cli"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "contract" / "settings.py":  # settings itself (and stay_off_the_hub's default)
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    if (node.value.id, node.attr) in READERS:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} os.{node.attr}")
                if isinstance(node, ast.keyword) and node.arg in ("envvar", "auto_envvar_prefix"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.arg}=")
                if isinstance(node, ast.ImportFrom) and node.module == "os":
                    found += [f"{path.relative_to(ROOT)}:{node.lineno} from os import {a.name}"
                              for a in node.names if a.name in ("environ", "getenv")]  # fmt: skip
    assert found == []


def test_webhook_settings_come_from_settings(monkeypatch):
    from pydantic_settings import BaseSettings

    from sluice.contract.settings import Settings
    from sluice.contract.signing import WebhookSettings

    monkeypatch.setenv("SLUICE_WEBHOOK_TIMEOUT", "3.5")
    monkeypatch.setenv("SLUICE_WEBHOOK_ALLOW", "127.0.0.1")
    assert not issubclass(WebhookSettings, BaseSettings)
    webhook = WebhookSettings.of(Settings())
    assert (webhook.webhook_timeout, webhook.webhook_allow) == (3.5, "127.0.0.1")
    assert WebhookSettings().webhook_timeout == 10.0


def test_the_default_output_url_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    from sluice.contract.settings import Settings, output_url_if_set

    monkeypatch.delenv("SLUICE_OUTPUT_URL", raising=False)
    monkeypatch.delenv("SLUICE_OUTPUT_ROOTS", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    urls = set()
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        urls.add(Settings().output_url)
        assert Settings().output_root_urls() == [Settings().output_url]
    assert urls == {(tmp_path / "home" / ".local" / "share" / "sluice" / "results").as_uri()}
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert Settings().output_url == (tmp_path / "data" / "sluice" / "results").as_uri()
    assert output_url_if_set() is None
    monkeypatch.setenv("SLUICE_OUTPUT_URL", "s3://bucket/out")
    assert Settings().output_url == output_url_if_set() == "s3://bucket/out"
