"""The sluice CLI: human output by default, --json for scripts, clear failures."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from sluice.cli.main import app

runner = CliRunner()


def write_batch(path, n: int, bad: bool = False) -> str:
    lines = [
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
        )
        for i in range(n)
    ]
    if bad:
        lines.insert(1, '{"custom_id": "x", "method": "POST"}')
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_submit_status_list_json(redis_url, tmp_path):
    path = write_batch(tmp_path / "in.jsonl", 5)
    out = runner.invoke(
        app, ["submit", path, "--output", tmp_path.as_uri(), "--priority", "low", "-m", "team=ml", "--json"]
    )
    assert out.exit_code == 0, out.output
    batch = json.loads(out.output)
    assert (
        batch["status"] == "in_progress"
        and batch["priority"] == "low"
        and batch["metadata"] == {"team": "ml"}
    )
    status = runner.invoke(app, ["status", batch["id"], "--redis-url", redis_url, "--json"])
    assert json.loads(status.output)["request_counts"]["total"] == 5
    listed = runner.invoke(app, ["list", "--json"])
    assert [b["id"] for b in json.loads(listed.output)] == [batch["id"]]
    human = runner.invoke(app, ["status", batch["id"]])
    assert batch["id"] in human.output and "in_progress" in human.output and "0/5 completed" in human.output


def test_invalid_file_exits_2_with_line_errors(redis_url, tmp_path):
    path = write_batch(tmp_path / "bad.jsonl", 3, bad=True)
    out = runner.invoke(app, ["submit", path])
    assert out.exit_code == 2
    assert "failed" in out.output and "line 2" in out.output and "invalid_request" in out.output


def test_a_file_mixing_urls_exits_2_naming_the_line_and_both_urls(redis_url, tmp_path):
    path = tmp_path / "mixed.jsonl"
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]}}
    write_batch(path, 2)
    path.write_text(path.read_text() + json.dumps(chat) + "\n")
    out = runner.invoke(app, ["submit", str(path), "--json"])
    assert out.exit_code == 2, out.output
    batch = json.loads(out.output)
    assert batch["status"] == "failed" and batch["request_counts"]["total"] == 3
    [error] = batch["errors"]
    assert (error["line"], error["code"], error["param"]) == (3, "invalid_url", "url")
    assert "'/v1/chat/completions'" in error["message"] and "'/v1/completions' of line 1" in error["message"]


def test_unknown_batch_and_missing_file_fail_clearly(redis_url, tmp_path):
    missing = runner.invoke(app, ["status", "batch_nope"])
    assert missing.exit_code == 1 and "no such batch" in missing.output
    nofile = runner.invoke(app, ["submit", str(tmp_path / "absent.jsonl")])
    assert nofile.exit_code == 1 and "no such file" in nofile.output


def test_cancel_from_cli(redis_url, tmp_path):
    path = write_batch(tmp_path / "in.jsonl", 3)
    batch = json.loads(runner.invoke(app, ["submit", path, "--json", "--output", tmp_path.as_uri()]).output)
    out = runner.invoke(app, ["cancel", batch["id"], "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["status"] == "cancelling"


def test_results_of_a_cancelled_batch(redis_url, tmp_path):
    from sluice.worker.finalize import finalize_batch

    path = write_batch(tmp_path / "in.jsonl", 2)
    batch = json.loads(runner.invoke(app, ["submit", path, "--json", "--output", tmp_path.as_uri()]).output)
    runner.invoke(app, ["cancel", batch["id"]])
    finalize_batch(batch["id"])
    human = runner.invoke(app, ["results", batch["id"], "--errors"])
    assert human.exit_code == 0 and "r0" in human.output and "batch_cancelled" in human.output
    records = [
        json.loads(x)
        for x in runner.invoke(app, ["results", batch["id"], "--errors", "--json"]).output.splitlines()
    ]
    assert sorted(r["custom_id"] for r in records) == ["r0", "r1"]
    assert runner.invoke(app, ["results", batch["id"]]).output == ""
