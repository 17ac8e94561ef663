"""Debian's headless Chromium driven by Selenium, for the tests of the web page: `open_browser` (conftest's
`browser` fixture), and `needs_chromium`, which skips a test, saying why, where no Chromium is installed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no Chromium here: `apt-get install chromium chromium-driver` (Debian's packages; `make test` tries)",
)


def open_browser() -> Iterator:
    """A headless Chromium, quit when the generator is closed."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()
