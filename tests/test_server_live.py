"""The dashboard in a real headless Chromium (selenium) and Prometheus metrics, while a batch runs on a real
worker."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.server_stack import completion, jsonl, wait_http, wait_status

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page: (name, sorted labels) → value."""
    text = requests.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


ROW_STATE = """
const r = document.getElementById(arguments[0]);
if (!r) return null;
return {status: r.dataset.status, percent: Number(r.dataset.percent),
        shown: r.querySelector('.status').textContent,
        completed: Number(r.querySelector('.completed-count').textContent),
        width: r.querySelector('.bar span').style.width,
        output: (r.querySelector('a.output') || {}).href || null};
"""


def row_state(browser, batch_id: str) -> dict | None:
    """The batch's row as the page shows it now (read in one script, so a refresh in between cannot
    interfere)."""
    return browser.execute_script(ROW_STATE, batch_id)


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.fail(
            "chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,700",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def submit(client, requests_count: int, max_tokens: int, **metadata: str):
    """A completions batch of `requests_count` requests that each generate `max_tokens` tokens."""
    lines = [completion(i, max_tokens=max_tokens, ignore_eos=True) for i in range(requests_count)]
    return client.batches.create(
        input_file_id=client.files.create(file=jsonl(lines), purpose="batch").id,
        endpoint="/v1/completions",
        completion_window="24h",
        **({"metadata": metadata} if metadata else {}),
    )


def log_in(browser, wait, url: str, secret: str, project: str) -> None:
    """A wrong key is refused with a message; the right one opens the project's page."""
    from selenium.webdriver.common.by import By

    browser.get(url + "/")
    browser.find_element(By.ID, "key").send_keys("sk-sluice-wrong")
    browser.find_element(By.ID, "login").click()
    assert "Unknown API key" in wait.until(lambda d: d.find_elements(By.ID, "error"))[0].text
    browser.find_element(By.ID, "key").send_keys(secret)
    browser.find_element(By.ID, "login").click()
    assert wait.until(lambda d: d.find_elements(By.ID, "project"))[0].text == project


def check_partial_progress(browser, batch_id: str, tmp_path) -> None:
    """Mid-batch: a partly filled bar, the one live worker and the project's shards in its queue."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    partial = WebDriverWait(browser, 180, 0.2).until(
        lambda d: (s := row_state(d, batch_id)) and 0 < s["percent"] < 100 and s
    )
    assert partial["status"] == partial["shown"] == "in_progress"
    assert 0 < partial["completed"] < 24 and partial["width"] == f"{partial['percent']}%"
    assert browser.find_element(By.CSS_SELECTOR, "#workers .live-workers").text == "1", "the fleet's size"
    running = browser.find_element(By.CSS_SELECTOR, "#queues tr[data-queue=default]").text.split()
    assert int(running[1]) + int(running[2]) > 0, "the project's own shards wait or run in its queue"
    browser.save_screenshot(str(tmp_path / "dashboard-running.png"))


def check_output_link(browser, wait, link: str, secret: str) -> None:
    """The output link serves the batch's lines to the session's cookie only, and no longer after logout."""
    from selenium.webdriver.common.by import By

    fetched = browser.execute_async_script("fetch(arguments[0]).then(r => r.text()).then(arguments[1])", link)
    assert sorted(json.loads(line)["custom_id"] for line in fetched.splitlines()) == sorted(
        f"r{i}" for i in range(24)
    )
    assert requests.get(link).status_code == 401, "output links need the session too"
    cookie = browser.get_cookie("sluice_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and secret not in cookie["value"]
    assert requests.get(link, cookies={"sluice_session": cookie["value"]}).status_code == 200
    api_link = link.replace("/dashboard/files/", "/v1/files/")
    assert requests.get(api_link,
                        cookies={"sluice_session": cookie["value"]}).status_code == 401, "API: header only"
    browser.find_element(By.ID, "logout").click()
    wait.until(lambda d: d.find_elements(By.ID, "key"))
    assert requests.get(link,
                        cookies={"sluice_session": cookie["value"]}).status_code == 401, "logout ends it"


def test_dashboard_shows_live_progress(stack, browser, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    secret = stack.key("dash")
    client = stack.openai(secret)
    wait = WebDriverWait(browser, 30, 0.2)
    log_in(browser, wait, stack.url, secret, "dash")
    browser.execute_script("window.sameDocument = true")
    batch = submit(client, 24, 120, run="dashboard")
    first = wait.until(lambda d: row_state(d, batch.id))
    assert first["status"] in ("validating", "in_progress") and first["percent"] < 100
    check_partial_progress(browser, batch.id, tmp_path)
    done = WebDriverWait(browser, 180, 0.3).until(
        lambda d: (s := row_state(d, batch.id)) and s["status"] == "completed" and s
    )
    assert done["percent"] == 100 and done["completed"] == 24 and done["shown"] == "completed"
    assert browser.execute_script("return window.sameDocument") is True, "updated in place, no reload"
    check_output_link(browser, wait, done["output"], secret)


def wait_until_running(worker_url: str, timeout: float = 60) -> float:
    """The worker's sluice_requests_running once it is above zero (zero if it never is within `timeout`)."""
    deadline, busy = time.monotonic() + timeout, 0.0
    while time.monotonic() < deadline and busy == 0:
        busy = value(scrape(worker_url), "sluice_requests_running")
        time.sleep(0.1)
    return busy


def test_metrics_and_health_change_as_a_batch_runs(stack):
    worker_url, client = stack.metrics_url, stack.openai(stack.key("metrics"))
    wait_http(worker_url + "/healthz", 60)  # up once the worker's imports are done (seconds on a loaded host)
    wait_http(worker_url + "/readyz", 60)
    before, server_before = scrape(worker_url), scrape(stack.url)
    assert value(before, "sluice_worker_ready") == 1 and value(before, "sluice_time_to_ready_seconds") > 0
    batch = submit(client, 40, 64)
    during = scrape(stack.url)
    assert (
        value(during, "sluice_queue_depth", queue="default")
        + value(during, "sluice_queue_started", queue="default")
        > 0
    )
    assert (
        value(during, "sluice_batches", status="in_progress")
        >= value(server_before, "sluice_batches", status="in_progress") + 1
    )
    assert wait_until_running(worker_url) > 0, "the worker reports running requests mid-batch"
    wait_status(client, batch.id, {"completed"})
    after, server_after = scrape(worker_url), scrape(stack.url)
    grown = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    assert grown("sluice_generation_tokens_total") == 40 * 64
    assert grown("sluice_prompt_tokens_total") > 0
    assert grown("sluice_requests_total", outcome="length") == 40
    assert grown("sluice_shards_total", outcome="completed") == 10
    assert grown("sluice_step_seconds_count") >= 64
    assert value(after, "sluice_requests_running") == 0 and value(after, "sluice_kv_cache_usage_ratio") == 0
    assert value(server_after, "sluice_queue_depth", queue="default") == 0
    assert (
        value(server_after, "sluice_batches", status="completed")
        >= value(server_before, "sluice_batches", status="completed") + 1
    )
    assert value(server_after, "sluice_workers") == 1
    assert requests.get(stack.url + "/readyz").status_code == 200
