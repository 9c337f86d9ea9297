"""The chat page at GET / in headless Chromium (Debian's chromium + chromium-driver, selenium)."""

import shutil
import tempfile
import time

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service
  assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), (
      "chromium and chromium-driver are missing: `make browser` installs them (Debian)")
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  profile = tempfile.mkdtemp(prefix="pijax-chromium-")
  for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
               f"--user-data-dir={profile}"):
    options.add_argument(flag)
  driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
  yield driver
  driver.quit()
  shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page_server():
  """A server of its own with a 2048-token context and a 512-token reply cap: the page sends
  no sampling settings, so replies are sampled and unbounded, and a rambling first reply
  (2000+ tokens once, in a fresh-clone run) left no room for the follow-up."""
  from conftest import spawn_server
  yield from spawn_server("--max_seq_len=2048", "--max_tokens=512", "--host_threads=2")


def _wait(predicate, timeout=300.0):  # A loaded 2-core CI machine is slow, not wrong.
  deadline = time.time() + timeout
  while time.time() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(0.02)
  raise AssertionError("timed out waiting for the page")


def _send(driver, text):
  from selenium.webdriver.common.by import By
  from selenium.webdriver.common.keys import Keys
  box = driver.find_element(By.ID, "input")
  box.send_keys(text)
  box.send_keys(Keys.ENTER)


def _last_reply(driver):
  return driver.execute_script(
      "const r = document.querySelectorAll('.msg.assistant, .msg.error');"
      "const last = r[r.length - 1];"
      "return last ? [last.dataset.state, last.textContent, last.className] : null;")


def test_page_streams_a_reply_and_keeps_the_conversation(browser, page_server):
  from selenium.webdriver.common.by import By
  browser.get(page_server["base"] + "/")
  _wait(lambda: browser.find_element(By.ID, "status").text == page_server["model"])
  # Short enough that the follow-up turn, history included, fits the 2048-token context.
  _send(browser, "Tell me a story about a lighthouse keeper in three sentences.")
  lengths = set()

  def done():
    state = _last_reply(browser)
    if state and state[1]:
      lengths.add(len(state[1]))
    return state and state[0] == "done"

  _wait(done)
  state, text, cls = _last_reply(browser)
  assert cls == "msg assistant" and len(text) > 40
  assert len(lengths) >= 3, "the reply did not arrive in pieces"
  assert browser.execute_script("return messages.length") == 2
  _send(browser, "What was his name?")
  _wait(lambda: (_last_reply(browser) or ["", "", ""])[0] == "done"
        and len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == 4)
  assert _last_reply(browser)[2] == "msg assistant", _last_reply(browser)
  assert browser.execute_script("return messages.length") == 4
  assert browser.execute_script("return messages[2].content") == "What was his name?"


def test_stop_button_stops_the_reply(browser, page_server):
  from selenium.webdriver.common.by import By
  browser.get(page_server["base"] + "/")
  _wait(lambda: browser.find_element(By.ID, "status").text == page_server["model"])
  _send(browser, "Write a very long essay about the history of bridges.")
  _wait(lambda: (_last_reply(browser) or [None, ""])[1])  # Streaming has begun.
  browser.find_element(By.ID, "stop").click()
  _wait(lambda: _last_reply(browser)[0] == "done", timeout=10)
  assert browser.find_element(By.ID, "send").is_enabled()
  assert not browser.find_element(By.ID, "stop").is_enabled()
  text = _last_reply(browser)[1]
  assert text and "error" not in _last_reply(browser)[2]
  # The server is free again: the next message is answered.
  _send(browser, "Hi")
  _wait(lambda: browser.execute_script("return messages.length") == 4)


def test_a_failed_turn_leaves_the_conversation_as_it_was(browser, server):
  from selenium.webdriver.common.by import By
  browser.get(server["base"] + "/")
  _wait(lambda: browser.find_element(By.ID, "status").text == server["model"])
  _send(browser, "x " * 700)  # Longer than the server's 512-token context: a 400.
  _wait(lambda: (_last_reply(browser) or ["", "", ""])[2] == "msg error")
  assert "maximum context length" in _last_reply(browser)[1]
  assert "Press Clear" in _last_reply(browser)[1]
  assert browser.execute_script("return messages.length") == 0
  _send(browser, "Hi")
  _wait(lambda: browser.execute_script("return messages.length") == 2)
  assert _last_reply(browser)[2] == "msg assistant"
