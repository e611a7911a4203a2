"""The server without a worker: dashboard sessions (never the key in the cookie, POST-only sign-in and
sign-out from the server's own page), security headers, header-only API keys, files list filtering and order,
/metrics behind an operator token, escaped logs, and OpenAI-shaped 503s while Redis is down (real server, real
redis)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from redis import Redis

from sluice.producer.server.files import FileRecord, FileStore
from sluice.producer.server.keys import KeyStore
from tests.server_stack import jsonl, start_server
from tests.services import RedisServer, free_port, stop_worker, wait_for_port, worker_env


@dataclass
class Server:
    url: str
    redis: Redis
    keys: KeyStore
    log: Path

    def key(self, project: str) -> str:
        return self.keys.create(project)[1]


def launch(redis_url: str, tmp: Path, **env: str) -> tuple[subprocess.Popen, str]:
    full = worker_env(redis_url, SLUICE_OUTPUT_URL=tmp.as_uri(), **env)
    return start_server(redis_url, tmp, env=full)


@pytest.fixture(scope="module")
def server(redis_server: RedisServer, tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("security")
    process, url = launch(redis_server.url, tmp)
    try:
        yield Server(url, redis_server.client(), KeyStore(redis_server.client()), tmp / "server.log")
    finally:
        stop_worker(process)


def login(server: Server, secret: str, **headers: str) -> requests.Response:
    return requests.post(server.url + "/login", data={"key": secret}, headers=headers, allow_redirects=False)


def own(server: Server) -> dict[str, str]:
    return {"Origin": server.url}


def test_a_login_from_a_foreign_origin_gets_no_cookie(server):
    secret = server.key("csrf")
    for headers in ({"Origin": "https://evil.example"}, {"Referer": "https://evil.example/x"}, {}):
        answer = login(server, secret, **headers)
        assert answer.status_code == 403 and "set-cookie" not in answer.headers, headers
    assert login(server, secret, **own(server)).status_code == 303
    behind_proxy = login(server, secret, Origin="https://sluice.example.com",
                         **{"X-Forwarded-Host": "sluice.example.com"})
    assert behind_proxy.status_code == 303 and "sluice_session=" in behind_proxy.headers["set-cookie"]


def test_the_cookie_is_a_random_session_id_never_the_key(server):
    secret = server.key("session")
    first, second = login(server, secret, **own(server)), login(server, secret, **own(server))
    header = first.headers["set-cookie"]
    assert secret not in header and "sluice_session=" in header
    assert "HttpOnly" in header and "SameSite=strict" in header and "Secure" not in header  # plain http here
    sid = first.cookies["sluice_session"]
    assert sid != second.cookies["sluice_session"] and len(sid) >= 40
    stored = [k for k in server.redis.scan_iter("sluice:session:*")]
    assert stored and all(sid not in k.decode() and 0 < server.redis.ttl(k) <= 7 * 86400 for k in stored)
    assert all(secret.encode() not in (server.redis.get(k) or b"") for k in stored)
    page = requests.get(server.url + "/", cookies={"sluice_session": sid})
    assert 'id="project">session<' in page.text
    assert requests.get(server.url + "/", cookies={"sluice_session": secret}).text.count('id="key"') == 1


def test_no_sign_in_by_url_and_sign_out_by_post_from_the_page_only(server):
    secret = server.key("logout")
    by_url = requests.get(server.url + "/", params={"key": secret}, allow_redirects=False)
    assert by_url.status_code == 200 and "set-cookie" not in by_url.headers and 'id="key"' in by_url.text
    sid = login(server, secret, **own(server)).cookies["sluice_session"]
    jar = {"sluice_session": sid}
    assert requests.get(server.url + "/logout", cookies=jar).status_code == 405
    foreign = requests.post(server.url + "/logout", cookies=jar, headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "cross_origin"
    assert requests.get(server.url + "/dashboard/live", cookies=jar).status_code == 200
    out = requests.post(server.url + "/logout", cookies=jar, headers=own(server), allow_redirects=False)
    assert out.status_code == 303 and 'sluice_session=""' in out.headers["set-cookie"]
    assert requests.get(server.url + "/dashboard/live", cookies=jar).status_code == 401


def test_the_api_takes_keys_from_the_header_only(server):
    secret = server.key("header")
    sid = login(server, secret, **own(server)).cookies["sluice_session"]
    for jar in ({"sluice_session": sid}, {"sluice_key": secret}):
        answer = requests.get(server.url + "/v1/files", cookies=jar)
        assert answer.status_code == 401 and set(answer.json()["error"]) >= {"message", "type", "code"}
    auth = {"Authorization": f"Bearer {secret}"}
    assert requests.get(server.url + "/v1/files", headers=auth).status_code == 200
    cross = requests.get(server.url + "/dashboard/live", cookies={"sluice_session": sid},
                         headers={"Sec-Fetch-Site": "cross-site"})  # fmt: skip
    assert cross.status_code == 401, "a cookie sent by another site's request is not a session"


def test_pages_forbid_framing_and_carry_a_strict_csp(server):
    for path in ("/", "/v1/files", "/healthz"):
        headers = requests.get(server.url + path).headers
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
        csp = headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp and "unsafe-eval" not in csp
    sid = login(server, server.key("csp"), **own(server)).cookies["sluice_session"]
    page = requests.get(server.url + "/", cookies={"sluice_session": sid})
    nonce = page.headers["content-security-policy"].split("'nonce-")[1].split("'")[0]
    assert f'<script nonce="{nonce}">' in page.text and page.text.count("<script") == 1


def test_secure_cookie_when_configured(redis_server, tmp_path):
    process, url = launch(redis_server.url, tmp_path, SLUICE_COOKIE_SECURE="1")
    try:
        secret = KeyStore(redis_server.client()).create("tls")[1]
        answer = requests.post(url + "/login", data={"key": secret}, headers={"Origin": url},
                               allow_redirects=False)
        assert "Secure" in answer.headers["set-cookie"]
    finally:
        stop_worker(process)


def test_files_list_filters_by_purpose_then_pages_and_honours_order(server):
    secret = server.key("files")
    auth = {"Authorization": f"Bearer {secret}"}
    store, uploaded = FileStore(server.redis), []
    for i in range(3):
        body = jsonl([{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": "x"}}])
        files = {"file": (f"in{i}.jsonl", body.getvalue())}
        uploaded.append(requests.post(server.url + "/v1/files", headers=auth, files=files,
                                      data={"purpose": "batch"}).json()["id"])  # fmt: skip
        for j in range(25):  # newer outputs between and after the uploads
            store.add(FileRecord(id=f"file-out-{i}-{j}", bytes=1,
                                 created_at=int(time.time()) + 1 + i * 30 + j,
                                 filename="o.jsonl", purpose="batch_output", project="files",
                                 url="file:///x"))
        time.sleep(1.1)

    def page(**params) -> dict:
        return requests.get(server.url + "/v1/files", headers=auth, params=params).json()

    first = page(purpose="batch", limit=1)
    assert [f["id"] for f in first["data"]] == [uploaded[-1]] and first["has_more"] is True
    ids, after = [], None
    while True:
        body = page(purpose="batch", limit=1, order="asc", **({"after": after} if after else {}))
        ids += [f["id"] for f in body["data"]]
        after = body["last_id"]
        if not body["has_more"]:
            break
    assert ids == uploaded, "oldest first, every batch file once"
    assert [f["purpose"] for f in page(limit=100)["data"]].count("batch_output") == 75
    assert page(order="sideways")["error"]["param"] == "order"


def test_metrics_hold_no_project_names_and_take_an_operator_token(server, redis_server, tmp_path):
    server.key("secret-project-name")
    text = requests.get(server.url + "/metrics").text
    assert "sluice_batches" in text and "secret-project-name" not in text
    process, url = launch(redis_server.url, tmp_path, SLUICE_OPERATOR_TOKEN="op-token-1")
    try:
        assert requests.get(url + "/metrics").status_code == 401
        wrong = requests.get(url + "/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_token"
        good = requests.get(url + "/metrics", headers={"Authorization": "Bearer op-token-1"})
        assert good.status_code == 200 and "sluice_queue_depth" in good.text
    finally:
        stop_worker(process)


def test_control_characters_in_a_path_are_escaped_in_the_log(server):
    requests.get(server.url + "/v1/files/abc%00def%0Aforged%1B[31m")
    time.sleep(0.5)
    log = server.log.read_bytes()
    assert b"\x00" not in log and b"\x1b" not in log and b"forged" in log
    line = next(line for line in log.splitlines() if b"forged" in line)
    assert b"abc\\x00def" in line and b"forged\\x1b[31m" in line


def test_redis_down_answers_openai_shaped_503s_then_recovers(tmp_path):
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    redis_process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    wait_for_port(port)
    redis_url = f"redis://127.0.0.1:{port}/0"
    secret = KeyStore(Redis.from_url(redis_url)).create("down")[1]
    process, url = launch(redis_url, tmp_path)
    try:
        redis_process.terminate()
        redis_process.wait(10)
        auth = {"Authorization": f"Bearer {secret}"}
        session = {"sluice_session": "some-session-id"}
        for path, headers in (("/v1/files", auth), ("/v1/batches", auth), ("/v1/models", auth),
                              ("/metrics", {}),
                              ("/", {}), ("/readyz", {}), ("/dashboard/live", {})):  # fmt: skip
            answer = requests.get(url + path, headers=headers, cookies=session)
            assert answer.status_code == 503, (path, answer.status_code, answer.text)
            error = answer.json()["error"]
            assert (error["type"] == "server_error" and error["code"] == "service_unavailable"
                    and error["message"])
        redis_process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        wait_for_port(port)
        KeyStore(Redis.from_url(redis_url)).create("down")  # the restarted Redis kept nothing
        assert requests.get(url + "/readyz").status_code == 200
        assert requests.get(url + "/v1/files", headers=auth).status_code == 401  # answers again (key is gone)
    finally:
        stop_worker(process)
        redis_process.terminate()
        redis_process.wait(10)
