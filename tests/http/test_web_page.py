"""The web page at `/`, in a real browser (Debian's headless Chromium driven by Selenium): a message sent in
the playground streams back the model's greedy answer with its figures, and the live view counts it; the JSON-schema
and tool modes answer in their form; with API keys on, the page asks for one and keeps it to itself."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
import yaml

from serve_app import InferenceEngine
from serve_app.http.tenants import TenantDirectory, load_keys
from tests.browser import needs_chromium
from tests.inprocess import MODEL, InProcessServer, engine_server, openai_client

pytestmark = needs_chromium


def _requests_in_live_view(browser) -> int | None:
    """The in-process replica's request count in the live view, read in one script call: the table is re-rendered
    every few seconds, so an element found by one WebDriver call may be gone by the next."""
    cells = browser.execute_script(
        "for (const row of document.querySelectorAll('#replicas tbody tr')) {"
        "  const cells = [...row.querySelectorAll('td')].map(td => td.innerText.trim());"
        "  if (cells.length && cells[0] === 'in-process') return cells;"
        "} return null;"
    )
    return int(cells[-1]) if cells else None


def _waiting(browser, seconds: float):
    """A wait that polls again when the element it read was re-rendered under it."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, seconds, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))


def test_a_message_streams_back_and_the_live_view_counts_it(server: InProcessServer, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    browser.get(f"{server.url}/")
    wait = _waiting(browser, 120)
    wait.until(lambda b: MODEL in [o.text for o in Select(b.find_element(By.ID, "model")).options])
    wait.until(lambda b: _requests_in_live_view(b) is not None)
    before = _requests_in_live_view(browser)
    for field, value in (("temperature", "0"), ("max-tokens", "12")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys("Name three colours.")
    browser.find_element(By.ID, "send").click()
    figures = wait.until(lambda b: [f for f in b.find_elements(By.CSS_SELECTOR, "#conversation .figures") if f.text])
    answer = browser.find_elements(By.CSS_SELECTOR, "#conversation .msg.assistant")[-1].text
    expected = openai_client(server.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], temperature=0, max_tokens=12
    )
    assert answer == expected.choices[0].message.content.strip() or answer == expected.choices[0].message.content
    text = figures[-1].text
    assert text.startswith("TTFT ") and f"· {expected.usage.completion_tokens} tokens ·" in text, text
    assert "cached prompt tokens" in text and "tokens/s" in text
    wait.until(lambda b: (_requests_in_live_view(b) or 0) >= before + 1)


def test_the_json_schema_and_tool_modes_answer_in_their_form(server: InProcessServer, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(f"{server.url}/")
    wait = _waiting(browser, 120)
    wait.until(lambda b: MODEL in [o.text for o in Select(b.find_element(By.ID, "model")).options])
    for field, value in (("temperature", "0"), ("max-tokens", "100")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)

    def ask(mode: str, text: str, answers: int) -> str:
        Select(browser.find_element(By.ID, "mode")).select_by_value(mode)
        browser.find_element(By.ID, "prompt").send_keys(text)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda b: len([f for f in b.find_elements(By.CSS_SELECTOR, "#conversation .figures") if f.text]) == answers)
        return browser.find_elements(By.CSS_SELECTOR, "#conversation .msg.assistant")[-1].text

    person = json.loads(ask("json_schema", "Describe a person.", 1))  # the page's example schema
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    call = re.fullmatch(r"get_weather\((\{.*\})\)", ask("tools_required", "What is the weather in Paris?", 2))
    assert call is not None and isinstance(json.loads(call.group(1))["city"], str)


@pytest.fixture(scope="module")
def keyed(engine: InferenceEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(yaml.safe_dump({"page-user": {"tenant": "acme"}, "page-admin": {"tenant": "ops", "role": "admin"}}))
    with engine_server(engine, tenants=TenantDirectory(load_keys(keys), "s")) as server:
        yield server


def test_with_api_keys_the_page_asks_for_one_and_keeps_it_in_the_page(keyed: InProcessServer, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    browser.get(f"{keyed.url}/")
    wait = _waiting(browser, 60)
    wait.until(lambda b: "401" in b.find_element(By.ID, "live-error").text)
    assert Select(browser.find_element(By.ID, "model")).options == []
    key = browser.find_element(By.ID, "api-key")
    key.send_keys("page-user", Keys.TAB)  # a user's key: the model list, not the live view (admin routes)
    wait.until(lambda b: MODEL in [o.text for o in Select(b.find_element(By.ID, "model")).options])
    wait.until(lambda b: "403" in b.find_element(By.ID, "live-error").text)
    browser.find_element(By.ID, "prompt").send_keys("Hello")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda b: [f for f in b.find_elements(By.CSS_SELECTOR, "#conversation .figures") if f.text])
    key.clear()
    key.send_keys("page-admin", Keys.TAB)
    wait.until(lambda b: _requests_in_live_view(b) is not None)
    assert browser.find_element(By.ID, "live-error").text == ""
    assert browser.execute_script("return localStorage.length + sessionStorage.length + document.cookie.length") == 0
