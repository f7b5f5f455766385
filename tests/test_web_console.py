"""The web console: its stream of engine stats (unit tests of what a sample holds, and a real server's stream), the
security headers of its responses, and the page itself in a real browser (headless Chromium from the system's
packages, driven by Selenium) against a running server: chat, stop, and the engine view under a burst."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
import requests

from pagedserve.core.contracts import EngineCoreOutput, SchedulerStats, StepRecord
from pagedserve.engine.engine_view import EngineView
from pagedserve.engine.latency_window import RELATIVE_WIDTH, RecentLatencies
from pagedserve.engine.metrics import EngineMetrics
from tests.server_utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "console-key"
SECRET_PROMPT = "the secret prompt of a console test"
# What Debian's chromium and chromium-driver packages install (scripts/setup.sh installs them for the tests).
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
OUTPUT_DIR = Path(os.environ.get("PAGEDSERVE_TEST_OUTPUT", Path(__file__).resolve().parents[1] / "test-output")) / "web_console"


# ---- the stats a viewer samples -----------------------------------------------------------------------------


def test_recent_latencies_are_the_nearest_rank_percentiles_of_the_window_within_a_bucket():
    rng = random.Random(3)
    recent = RecentLatencies(window_s=30.0)
    for _ in range(50):
        recent.observe(10.0, rng.uniform(5, 10))  # outside the last 30 s at time 100
    new = [math.exp(rng.uniform(math.log(1e-4), math.log(20.0))) for _ in range(1001)]  # five orders of magnitude
    for index, value in enumerate(new):
        recent.observe(75.0 + index / 100, value)
    percentiles = recent.percentiles(100.0, (0.5, 0.9, 0.99))
    ordered = sorted(new)
    for name, rank in (("p50", 500), ("p90", 900), ("p99", 990)):
        assert percentiles[name] == pytest.approx(ordered[rank], rel=RELATIVE_WIDTH / 2 + 1e-9)
    assert recent.percentiles(500.0, (0.5,)) == {"p50": None}  # all of them older than the window
    recent.observe(500.0, 0.25)
    assert recent.percentiles(500.0, (0.5,))["p50"] == pytest.approx(0.25, rel=RELATIVE_WIDTH / 2)


def _record(decodes: int, chunks: list[tuple[str, int, int, int]], seconds: float = 0.05, limit: float | None = 0.1) -> StepRecord:
    return StepRecord(time.time(), seconds, decodes, sum(chunk[2] for chunk in chunks), limit, chunks)


def test_each_step_reaches_a_viewer_once_with_its_prompt_chunks_and_no_prompt_text_by_default():
    metrics = EngineMetrics(MODEL)
    view = EngineView(metrics, prompt_of=lambda request_id: SECRET_PROMPT)
    early = view.new_cursor()
    view.record_step(0, _record(0, [("a", 0, 64, 100)], limit=None))
    late = view.new_cursor()  # a viewer that starts now still sees the steps kept so far
    view.record_step(0, _record(1, [("a", 64, 36, 100), ("b", 0, 10, 10)]))
    first = view.sample(early)
    assert [(s["number"], s["decode_tokens"], s["prefill_tokens"], s["stall_limit_s"]) for s in first["steps"]] == [
        (1, 0, 64, None), (2, 1, 46, 0.1)]
    assert first["steps"][1]["chunks"] == [{"request_id": "a", "start": 64, "tokens": 36, "of": 100},
                                           {"request_id": "b", "start": 0, "tokens": 10, "of": 10}]
    assert [s["number"] for s in view.sample(late)["steps"]] == [1, 2]
    assert view.sample(early)["steps"] == []  # nothing new since
    view.record_step(0, _record(2, []))
    assert [s["number"] for s in view.sample(early)["steps"]] == [3]
    assert SECRET_PROMPT not in json.dumps(first)


def test_prompts_reach_the_viewer_only_when_the_server_shows_them():
    view = EngineView(EngineMetrics(MODEL), prompt_of={"a": "x" * 500 + SECRET_PROMPT}.get, show_prompts=True)
    cursor = view.new_cursor()
    view.record_step(0, _record(0, [("a", 0, 64, 100), ("unknown", 0, 5, 5)]))
    chunks = view.sample(cursor)["steps"][0]["chunks"]
    assert chunks[0]["prompt"].endswith(SECRET_PROMPT) and len(chunks[0]["prompt"]) < 200  # the prompt's end: its latest turn
    assert chunks[1]["prompt"] is None


def test_a_sample_has_the_schedulers_state_and_the_token_rates_since_the_viewers_last():
    """Prompt tokens/s: what the steps since the viewer's last sample computed (not the steps before it joined);
    generated tokens/s: the tokens that reached the front end meanwhile."""
    metrics = EngineMetrics(MODEL, num_engines=2)
    view = EngineView(metrics, prompt_of=lambda request_id: None)
    view.record_step(1, _record(0, [("old", 0, 500, 500)]))  # before the viewer came
    time.sleep(0.01)
    cursor = view.new_cursor()
    start = time.monotonic()
    metrics.request_added("r", start, num_prompt_tokens=40)
    view.record_step(1, _record(0, [("r", 0, 32, 40)]))
    view.record_step(1, _record(0, [("r", 32, 8, 40)]))
    metrics.record_outputs([EngineCoreOutput("r", [5])], SchedulerStats(3, 2, 0.25, 100, 40, 1), start + 0.2, engine=1)
    metrics.record_outputs([EngineCoreOutput("r", [6, 7])], None, start + 0.3, engine=1)
    time.sleep(0.05)
    sample = view.sample(cursor)
    elapsed = time.monotonic() - start
    assert sample["engines"][1] == {"running": 3, "waiting": 2, "kv_cache_usage": 0.25, "prefix_cache_hit_rate": 0.4, "preemptions": 1}
    assert sample["engines"][0]["prefix_cache_hit_rate"] is None  # no lookups yet
    assert len(sample["steps"]) == 3  # the viewer still sees the earlier step, but its tokens are not in the rate
    assert sample["prompt_tokens_per_s"] == pytest.approx(40 / elapsed, rel=0.2)
    assert sample["generation_tokens_per_s"] == pytest.approx(3 / elapsed, rel=0.2)
    assert sample["ttft_s"]["p50"] == pytest.approx(0.2, abs=0.05) and sample["itl_s"]["p99"] == pytest.approx(0.1, abs=0.05)
    later = view.sample(cursor)
    assert later["generation_tokens_per_s"] == 0.0 and later["prompt_tokens_per_s"] == 0.0  # none since the last sample


# ---- a real server: headers, the key, the stream ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(default_model_dir):
    server = RemoteServer("--max-model-len", "1024", "--max-num-batched-tokens", "64", api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.log_text()[-2000:]


@pytest.mark.slow
def test_the_page_is_open_and_forbids_inline_scripts_while_the_stats_need_the_key(server):
    for path, media_type in (("/", "text/html"), ("/console/console.js", "text/javascript"), ("/console/console.css", "text/css")):
        response = requests.get(server.url + path, timeout=30)  # no key: the page asks for it
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type)
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy and "default-src 'none'" in policy
        assert response.headers["x-content-type-options"] == "nosniff"
    assert requests.get(server.url + "/console/stats", timeout=30).status_code == 401
    assert requests.get(server.url + "/console/server", timeout=30).status_code == 401
    assert requests.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert server.get("/console/server").json() == {"runner": "generate", "tasks": ["generate"]}
    page = requests.get(server.url + "/", timeout=30).text
    assert "<script>" not in page and "http" not in page.replace("http-equiv", "")  # no inline script, nothing fetched elsewhere


def _events(server, seconds: float, interval: float, until: threading.Event | None = None) -> list[dict]:
    """The stream's samples for `seconds`, or, given `until`, until `seconds` after it is set."""
    samples = []
    with requests.get(server.url + f"/console/stats?interval={interval}", headers=server.headers(), stream=True, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        deadline = None if until is not None else time.monotonic() + seconds
        for line in response.iter_lines():
            if line.startswith(b"data: "):
                samples.append(json.loads(line[6:]))
            if deadline is None and until.is_set():
                deadline = time.monotonic() + seconds
            if deadline is not None and time.monotonic() > deadline:
                break
    return samples


@pytest.mark.slow
def test_the_stats_stream_samples_at_its_interval_and_shows_a_prompt_prefilled_in_chunks_without_its_text(server):
    prompt = SECRET_PROMPT + " " + "and a long tail of words to prefill " * 20
    submitted_at = time.time()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        answered = threading.Event()  # the stream samples until a second after the request, however long it takes
        samples_future = pool.submit(_events, server, 1.0, 0.2, answered)
        time.sleep(0.5)
        completion = server.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 48, "ignore_eos": True})
        answered.set()
        samples = samples_future.result()
        elapsed = time.monotonic() - started
    assert completion.status_code == 200
    assert elapsed / 0.2 - 4 <= len(samples) <= elapsed / 0.2 + 2  # one sample every interval
    assert max(sample["engines"][0]["running"] for sample in samples) == 1
    steps = [step for sample in samples for step in sample["steps"]]
    assert [step["number"] for step in steps] == sorted({step["number"] for step in steps})  # each step once, in order
    steps = [step for step in steps if step["ended_at"] > submitted_at]  # this test's request's steps
    chunks = [chunk for step in steps for chunk in step["chunks"]]
    num_prompt_tokens = completion.json()["usage"]["prompt_tokens"]
    assert len(chunks) >= num_prompt_tokens // 64 and all(chunk["of"] == num_prompt_tokens for chunk in chunks)
    assert [chunk["start"] for chunk in chunks] == list(range(0, num_prompt_tokens, 64))  # the budget's chunks, in order
    assert sum(step["decode_tokens"] for step in steps) == 47  # the first token comes with the prompt's last chunk
    assert all(step["seconds"] > 0 for step in steps) and samples[-1]["ttft_s"]["p50"] > 0
    assert SECRET_PROMPT not in json.dumps(samples) and "prompt" not in chunks[0]


@pytest.mark.slow
def test_no_web_console_serves_no_page_and_no_stream(default_model_dir):
    server = RemoteServer("--max-model-len", "256", "--no-web-console")
    try:
        assert server.get("/").status_code == 404 and server.get("/console/stats").status_code == 404
        assert server.get("/v1/models").status_code == 200
    finally:
        assert server.stop() == 0


# ---- the page in a real browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(path), f"{path} is missing: the browser tests drive Debian's chromium and chromium-driver (setup.sh test)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _wait_for(condition, timeout_s: float = 60.0, what: str = "condition"):
    """condition()'s first true value; an element it looks for that is not (or no longer) in the page is a no."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = condition()
        except (NoSuchElementException, StaleElementReferenceException):
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _metric(server, name: str, **labels) -> float:
    text = server.get("/metrics").text
    selector = "".join(f'.*{key}="{value}"' for key, value in labels.items())
    values = [float(match.group(1)) for match in re.finditer(rf"^pagedserve:{name}\{{{selector}.*\}} (\S+)$", text, re.MULTILINE)]
    return sum(values)


def _set(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    element = driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(value)


def _answers(driver):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def _open_with_the_key(driver, url: str) -> None:
    """The page at url, as after a user gave it the key (kept for the browser tab's session)."""
    driver.get(url)
    driver.execute_script("sessionStorage.setItem('pagedserve-api-key', arguments[0])", API_KEY)
    driver.refresh()


def _no_page_errors(driver) -> None:
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE" and "401" not in entry["message"]]
    assert not errors, errors


@pytest.mark.slow
def test_chat_in_a_browser_streams_answers_and_stops_one(server, browser):
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(server.url + "/")
    _wait_for(lambda: driver.find_element(By.ID, "key-panel").is_displayed(), what="the page to ask for the API key")
    _set(driver, "api-key", API_KEY)
    driver.find_element(By.ID, "key-use").click()
    _wait_for(lambda: driver.find_element(By.CSS_SELECTOR, "#model option").get_attribute("value") == MODEL, what="the model list")
    assert not driver.find_element(By.ID, "key-panel").is_displayed()

    # A long greedy answer: its text grows while the request is in flight, and Stop aborts it in the engine.
    aborted_before = _metric(server, "request_success_total", finished_reason="abort")
    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", "700")
    _set(driver, "message", "Write a very long story about a dragon, at least two thousand words.")
    driver.find_element(By.ID, "send").click()
    _wait_for(lambda: len(_answers(driver)) == 1 and len(_answers(driver)[0].find_element(By.CLASS_NAME, "body").text) > 20,
              what="the answer to stream in")
    assert driver.find_element(By.ID, "stop").is_enabled()  # still streaming
    driver.find_element(By.ID, "stop").click()
    _wait_for(lambda: "stopped" in _answers(driver)[0].find_element(By.CLASS_NAME, "meta").text, what="the answer to show it stopped")
    _wait_for(lambda: _metric(server, "request_success_total", finished_reason="abort") == aborted_before + 1, timeout_s=10,
              what="the engine to count the request aborted")
    _wait_for(lambda: _metric(server, "num_requests_running") == 0, timeout_s=10, what="the engine to drop the request")

    # A short answer runs to its end: the page reports its time to first token and its speed, and the curl command.
    _set(driver, "max-tokens", "12")
    _set(driver, "message", "Say hello.")
    driver.find_element(By.ID, "send").click()
    meta = _wait_for(lambda: len(_answers(driver)) == 2 and _answers(driver)[1].find_element(By.CLASS_NAME, "meta").text,
                     what="the second answer to finish")
    assert re.search(r"TTFT \d+\.\d\d s · 12 tokens · \d+\.\d tokens/s · finish: length", meta), meta
    driver.find_element(By.ID, "curl-panel").click()
    curl = driver.find_element(By.ID, "curl").text
    assert '"max_tokens":12' in curl and '"temperature":0' in curl and "$PAGEDSERVE_API_KEY" in curl and API_KEY not in curl
    driver.save_screenshot(str(OUTPUT_DIR / "chat.png"))
    _no_page_errors(driver)


@pytest.mark.slow
def test_markdown_from_the_model_is_shown_as_text_never_run(server, browser):
    """The page renders what the model writes with DOM text nodes: HTML in it stays text and no script of it runs."""
    from selenium.webdriver.common.by import By

    driver = browser
    _open_with_the_key(driver, server.url + "/#chat")
    hostile = ("**bold** `code` <img src=x onerror=\"window.ran=1\"> [link](javascript:window.ran=2)\n\n"
               "```html\n<script>window.ran=3</script>\n```")
    driver.execute_script("const body = document.createElement('div'); body.id = 'probe'; document.body.append(body);"
                          "renderMarkdown(body, arguments[0]);", hostile)
    probe = driver.find_element(By.ID, "probe")
    assert probe.find_element(By.TAG_NAME, "strong").text == "bold" and probe.find_element(By.CSS_SELECTOR, "p code").text == "code"
    assert probe.find_elements(By.TAG_NAME, "img") == [] and probe.find_elements(By.TAG_NAME, "a") == []
    assert "<script>window.ran=3</script>" in probe.find_element(By.CSS_SELECTOR, "pre code").text
    assert driver.execute_script("return window.ran") is None


@pytest.mark.slow
def test_the_engine_view_follows_a_burst_of_requests(server, browser):
    from selenium.webdriver.common.by import By

    driver = browser
    _open_with_the_key(driver, server.url + "/#engine")
    running = driver.find_element(By.ID, "stat-running")
    _wait_for(lambda: running.text == "0", what="the first sample")

    def one(index: int) -> int:
        body = {"model": MODEL, "prompt": f"{index}: " + "a story of many words " * (10 + 3 * index), "max_tokens": 48,
                "temperature": 1.0, "ignore_eos": True}
        return server.post("/v1/completions", json=body).status_code

    generated = driver.find_element(By.ID, "stat-gen-tps")
    rates = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = pool.map(one, range(8))
        _wait_for(lambda: int(running.text) >= 4, what="the running count to rise")
        _wait_for(lambda: rates.append(float(generated.text)) or rates[-1] > 0, what="the generated tokens/s to rise")
        driver.save_screenshot(str(OUTPUT_DIR / "engine.png"))
        assert list(statuses) == [200] * 8
    _wait_for(lambda: running.text == "0", timeout_s=10, what="the running count to fall back to zero")
    # Read in one script: the page redraws the table with each sample, which would leave row elements stale between calls.
    numbers = driver.execute_script(
        "return [...document.querySelectorAll('#steps tbody tr')].map((row) => Number(row.querySelector('td').textContent))")
    assert len(numbers) == 40 and numbers == sorted(numbers, reverse=True)  # the latest steps, newest first
    # The page holds each request's prompt chunks (8 prompts of 56 to 161 tokens, in chunks of the 64-token budget).
    chunks = driver.execute_script("return steps.flatMap((step) => step.chunks)")
    prompts = {chunk["request_id"] for chunk in chunks}
    assert len(prompts) >= 8 and all(chunk["tokens"] <= 64 for chunk in chunks)
    _no_page_errors(driver)


@pytest.mark.slow
def test_on_an_embedding_models_server_the_page_keeps_to_the_engine_view(browser):
    """A server over an embedding model serves no chat: the page says what it serves instead, its Chat tab is disabled,
    and it shows the engine view."""
    from selenium.webdriver.common.by import By

    server = RemoteServer("--runner", "pooling", "--max-model-len", "1024", api_key=API_KEY)
    try:
        assert server.get("/console/server").json() == {"runner": "pooling", "tasks": ["embed", "score"]}
        driver = browser
        _open_with_the_key(driver, server.url + "/#chat")
        _wait_for(lambda: not driver.find_element(By.ID, "tab-chat").is_enabled(), what="the Chat tab to be disabled")
        assert "/v1/embeddings" in driver.find_element(By.ID, "server-status").text
        assert driver.find_element(By.ID, "engine-view").is_displayed() and not driver.find_element(By.ID, "chat-view").is_displayed()
        _wait_for(lambda: driver.find_element(By.ID, "stat-running").text == "0", what="the first sample")
        driver.execute_script("location.hash = '#chat'")  # a link to the chat page still shows the engine view
        time.sleep(0.2)
        assert driver.find_element(By.ID, "engine-view").is_displayed() and not driver.find_element(By.ID, "chat-view").is_displayed()
        _no_page_errors(driver)
    finally:
        assert server.stop() == 0, server.log_text()[-2000:]
