"""Headless Debian chromium driven through chromium-driver by selenium, for the view's test and benchmark.

selenium comes with the `dev` extra and `scripts/browser.sh` installs chromium and chromium-driver; the driver
binary is named explicitly, so selenium never looks one up or downloads one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 60


def chromium_paths() -> tuple[str, str] | None:
    """(chromium, chromedriver) when both are installed, else None."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def headless_chromium(profile: Path, width: int = 1500, height: int = 1000) -> Any:
    """A selenium WebDriver on a fresh headless chromium profile in `profile`, recording network and console logs."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = chromium_paths()
    if paths is None:
        raise RuntimeError("chromium and chromium-driver are not installed (bash scripts/browser.sh installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(service=Service(paths[1]), options=options)


def open_view(driver: Any, page: Path, fragment: str = "") -> float:
    """Load the page afresh (about:blank first, so no state is kept) and wait until it has drawn its first view;
    returns the page's own milliseconds from navigation start to that moment."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get("about:blank")
    driver.get(page.resolve().as_uri() + fragment)
    WebDriverWait(driver, READY_TIMEOUT_S).until(lambda d: d.execute_script("return document.body.dataset.ready"))
    state = driver.execute_script("return document.body.dataset.ready")
    if state != "true":
        raise RuntimeError(f"{page}: the page did not unpack its data ({state})")
    return float(driver.execute_script("return window.KV.readyAt"))
