"""The chat page of ``tnlg serve`` in a real browser: Debian's Chromium, headless, driven by Selenium 4 through
chromedriver. The page loads, a message sent streams a reply into the conversation (the same text the API gives
for that conversation), the tokens/s line fills in, and a screenshot of it is written to the test's folder.
Skipped with the install commands where Chromium, chromedriver or Selenium is missing."""

from __future__ import annotations

import shutil

import pytest

from tests.hf_reference import random_gpt2
from tests.served import Server

CHROMIUM, DRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver") or "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver"

pytestmark = [pytest.mark.needs_package("fastapi", "uvicorn", "openai", "selenium"),
              pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                                 reason=f"needs Debian's chromium and chromedriver ({INSTALL})")]

# as root on a machine without a network: no sandbox, no GPU, no first-run or background connections
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1000,700"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tnlg.data.tokenizer import load_tokenizer
    folder = tmp_path_factory.mktemp("page")
    eod = load_tokenizer("builtin").eod_id
    random_gpt2(4096, 128, 5, bos_token_id=eod, eos_token_id=eod, pad_token_id=0).save_pretrained(folder)
    s = Server(folder)
    yield s
    s.stop()


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_the_chat_page_streams_a_reply(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_element(By.ID, "model").text == "served")
    for field, value in (("temperature", "0"), ("max-tokens", "12")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys("Who goes there?")
    browser.find_element(By.ID, "send").click()
    reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done='true']"))
    stats = browser.find_element(By.ID, "stats").text
    shot = tmp_path / "chat.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 1000
    # the page showed what the API answers for the same conversation (greedy, 12 tokens)
    want = server.client().chat.completions.create(
        model="served", messages=[{"role": "user", "content": "Who goes there?"}], max_tokens=12, temperature=0)
    assert reply.text.strip() == want.choices[0].message.content.strip() and reply.text.strip()
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Who goes there?"
    assert "tokens/s" in stats and stats.split()[0] == str(want.usage.completion_tokens)
    # a second turn carries the conversation: its prompt holds the first reply
    browser.find_element(By.ID, "prompt").send_keys("And then?")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg[data-done='true']")) == 2)
    second = browser.find_elements(By.CSS_SELECTOR, ".msg[data-done='true']")[1].text
    assert not second.startswith("error:"), second
    want = server.client().chat.completions.create(model="served", max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "Who goes there?"},
        {"role": "assistant", "content": want.choices[0].message.content},
        {"role": "user", "content": "And then?"}])
    assert second.strip() == want.choices[0].message.content.strip()
    browser.save_screenshot(str(shot))
