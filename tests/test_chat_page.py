"""The chat page at `/`, driven in a real headless Chromium (Debian's chromium and chromium-driver, through
selenium), and `pdserve chat`, the terminal REPL, driven through its stdin; both against a live server and
checked against the same conversation asked through the official openai client."""
from __future__ import annotations

import asyncio
import shutil
import sys

import aiohttp
import pytest

from tests.test_server_api import client, engines, serve  # noqa: F401  (fixtures)

QUESTION = "Say something about disaggregated inference."
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage")


async def answer(base: str, model: str, messages: list[dict], max_tokens: int) -> str:
    return (await reply(base, model, messages, max_tokens)).content


async def reply(base: str, model: str, messages: list[dict], max_tokens: int):
    async with client(base) as c:
        whole = await c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return whole.choices[0].message


async def test_the_page_is_served_whole_with_its_policy(engines, serve):
    base = await serve(engines("colocated"))
    async with aiohttp.ClientSession() as session, session.get(base + "/") as response:
        page = await response.text()
    assert response.status == 200 and response.content_type == "text/html"
    assert "connect-src 'self'" in response.headers["Content-Security-Policy"]
    assert 'fetch("v1/chat/completions"' in page and "http://" not in page and "https://" not in page  # no CDN


def drive_chromium(base: str, user_data_dir: str) -> dict:
    """Send QUESTION from the page at temperature 0 and 12 tokens; what the page shows once the answer is in."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    try:
        driver.get(base + "/")
        WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        for field, value in (("temperature", "0"), ("max_tokens", "12")):
            driver.find_element(By.ID, field).clear()
            driver.find_element(By.ID, field).send_keys(value)
        driver.find_element(By.ID, "input").send_keys(QUESTION)
        driver.find_element(By.ID, "send").click()
        reply = WebDriverWait(driver, 120).until(lambda d: [m for m in d.find_elements(
            By.CSS_SELECTOR, ".msg.assistant") if m.get_attribute("data-state") != "streaming"])[0]
        return {"state": reply.get_attribute("data-state"), "chunks": int(reply.get_attribute("data-chunks")),
                "text": driver.execute_script("return arguments[0].querySelector('.content').textContent", reply),
                "reasoning": driver.execute_script(
                    "const r = arguments[0].querySelector('.reasoning'); return r ? r.textContent : null", reply),
                "model": driver.find_element(By.ID, "model").get_attribute("value"),
                "send_enabled": driver.find_element(By.ID, "send").is_enabled()}
    finally:
        driver.quit()


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
@pytest.mark.parametrize("reasoning_parser", [None, "deepseek_r1"])
async def test_the_page_streams_an_answer_in_headless_chromium(engines, serve, tiny_model_dir, tmp_path,
                                                              reasoning_parser):
    pytest.importorskip("selenium")
    base = await serve(engines("colocated"), reasoning_parser=reasoning_parser)
    shown = await asyncio.to_thread(drive_chromium, base, str(tmp_path / "chromium"))
    expected = await reply(base, tiny_model_dir.name, [{"role": "user", "content": QUESTION}], 12)
    assert shown["state"] == "done" and shown["send_enabled"] and shown["model"] == tiny_model_dir.name
    assert shown["chunks"] > 2                                       # the answer came in pieces
    if reasoning_parser is None:
        assert shown["text"] == expected.content and shown["reasoning"] is None
    else:       # the random model writes no </think>: deepseek_r1 makes its whole output reasoning, shown apart
        assert shown["reasoning"] == expected.reasoning_content and expected.reasoning_content
        assert shown["text"] == "" and expected.content is None


async def test_pdserve_chat_streams_each_answer_of_a_conversation(engines, serve, tiny_model_dir):
    base, model = await serve(engines("colocated")), tiny_model_dir.name
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.server.cli", "chat", "--url", base, "--system", "You are terse.",
        "--temperature", "0", "--max-tokens", "8", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(b"Hello there\n\nAnd then?\n/reset\nHello there\n")
    assert proc.returncode == 0, err.decode()
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    first = await answer(base, model, history, 8)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = await answer(base, model, history, 8)
    assert out.decode() == f"{first}\n{second}\n{first}\n"           # after /reset, the first answer again


async def test_pdserve_chat_says_why_it_cannot_chat(engines, serve):
    base = await serve(engines("colocated"), api_key="secret")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.server.cli", "chat", "--url", base, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate(b"Hello\n")
    assert proc.returncode == 1 and "401" in err.decode() and "API key" in err.decode()
