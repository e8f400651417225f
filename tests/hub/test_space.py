"""The Spaces demo, tested as a person would use it: start it on localhost, open it in headless Chromium,
submit a prompt, wait for both outputs, check the page, save a screenshot. Also the Space folder build."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.smollm2  # the demo runs the embedded default target and the shipped drafter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the demo exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@pytest.fixture
def demo_url(tmp_path):
    port = free_port()
    # DSpark alone: hybrid rounds are chosen on cost tables profiled where the demo starts, and beside the rest of the
    # suite those can price the drafter out of 24 tokens (plain rounds only), which is lossless but shows no draft
    env = {**os.environ, "DSPARK_DEMO_MAX_NEW_TOKENS": "24", "DSPARK_DEMO_PROMPT_LOOKUP": "0", "GRADIO_ANALYTICS_ENABLED": "False",
           "OMP_NUM_THREADS": "2"}  # fmt: skip
    log = open(tmp_path / "demo.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "hub_cards.space.app", "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{port}/", proc)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def chrome():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, "the browser test needs Debian's chromium and chromium-driver (run.sh installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver, log_output=os.environ.get("DSPARK_CHROMEDRIVER_LOG", os.devnull)), options=options)


def test_demo_in_a_real_browser(demo_url, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chrome()
    try:
        browser.get(demo_url)
        wait = WebDriverWait(browser, 120)
        box = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#prompt textarea")))
        box.clear()
        box.send_keys("What is 7 times 8?")
        browser.find_element(By.CSS_SELECTOR, "#run").click()
        wait.until(lambda b: "speed-up" in b.find_element(By.ID, "stats").text)
        plain = browser.find_element(By.CSS_SELECTOR, "#plain textarea").get_attribute("value")
        spans = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#dspark span.accepted, #dspark span.copied, #dspark span.target")]
        accepted = browser.find_elements(By.CSS_SELECTOR, "#dspark span.accepted, #dspark span.copied")
        stats = browser.find_element(By.ID, "stats").text
        shot = tmp_path / "demo.png"
        browser.save_screenshot(str(shot))
        if os.environ.get("DSPARK_SCREENSHOT"):
            shutil.copy(shot, os.environ["DSPARK_SCREENSHOT"])
    finally:
        browser.quit()
    assert plain.strip(), "the plain output is empty"
    assert spans, "the DSpark output has no coloured tokens"
    assert "".join(spans).strip(), "the DSpark output is empty"
    assert accepted, "no drafted or copied token was accepted: speculation is not in the loop"
    assert "tau" in stats and "tok/s" in stats
    assert shot.stat().st_size > 10_000


def test_space_folder_build(tmp_path):
    from generation.cli import SHIPPED_DRAFTER
    from hub_cards.space.build import ROOT, build_space

    files = build_space(tmp_path / "space")
    assert "README.md" in files and "requirements.txt" in files and "hub_cards/space/app.py" in files
    assert f"{SHIPPED_DRAFTER.relative_to(ROOT).as_posix()}/model.safetensors" in files
    header = (tmp_path / "space" / "README.md").read_text().split("---")[1]
    assert "sdk: gradio" in header and "app_file: hub_cards/space/app.py" in header


def test_demo_refuses_empty_and_overlong_prompts():
    from hub_cards.space.app import MAX_PROMPT_CHARS, prompt_problem

    assert prompt_problem("What is 7 times 8?") is None
    assert prompt_problem("  ") == "Type a prompt first."
    assert f"{MAX_PROMPT_CHARS + 1:,} characters" in prompt_problem("x" * (MAX_PROMPT_CHARS + 1))
