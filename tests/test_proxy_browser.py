"""The proxy's chat page (``GET /``, cipherlm/runtime/proxy_static/index.html) in a real
headless Chromium driven by Selenium: a prompt typed and sent at 1280x800, the streamed
reply (equal to the plaintext executor's greedy answer), the cost panel and "what the
server saw"; then a phone-width viewport (390x844, mobile emulation): no horizontal
overflow, the message box and Send usable, a second reply.  Each viewport leaves a
screenshot in ``$CIPHERLM_SCREENSHOT_DIR`` (default ``build/screenshots/`` in the
repository): ``chat-1280x800.png`` and ``chat-390x844.png``.

The browser is Debian's ``chromium`` with ``chromium-driver`` (`make browser`, which
`make install-test` runs, installs them with apt-get when we are root); Selenium is told
both paths, so Selenium Manager never looks for or downloads a driver.  Without them the
test fails, naming what is missing; ``CIPHERLM_SKIP_BROWSER=1`` turns that into a skip for
machines where no browser can be installed.  ``CIPHERLM_CHROMIUM`` and
``CIPHERLM_CHROMEDRIVER`` override the two paths."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from test_proxy import (RunningProxy, _plain_answer, _serve, chat_dir,  # noqa: F401 (fixtures)
                        monkeypatch_module)

from cipherlm.runtime.offload_server import ModelHost, OffloadServer
from cipherlm.runtime.proxy import ChatTemplate, ProxyApp

REPO = Path(__file__).resolve().parents[1]
SKIP_ENV = "CIPHERLM_SKIP_BROWSER"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_TOKENS = 8


def screenshot_dir() -> Path:
    """Where the screenshots go: $CIPHERLM_SCREENSHOT_DIR, else build/screenshots/ (gitignored)."""
    d = Path(os.environ.get("CIPHERLM_SCREENSHOT_DIR") or REPO / "build" / "screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _executable(env: str, names: tuple[str, ...], fallbacks: tuple[str, ...]) -> str | None:
    if os.environ.get(env):
        p = os.environ[env]
        return p if os.path.isfile(p) and os.access(p, os.X_OK) else None
    for n in names:
        found = shutil.which(n)
        if found:
            return found
    return next((f for f in fallbacks if os.path.isfile(f) and os.access(f, os.X_OK)), None)


def _unavailable(why: str):
    msg = (f"the chat page's browser test needs headless Chromium: {why}. Install it with `make browser` "
           f"(as root: apt-get install chromium chromium-driver), or set {SKIP_ENV}=1 to skip this test")
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(msg)
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium through Selenium, with explicit browser and driver paths."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("the selenium package is not installed (it is in the test extra: pip install -e '.[test]')")
    chromium = _executable("CIPHERLM_CHROMIUM", ("chromium", "chromium-browser"), ("/usr/lib/chromium/chromium",))
    driver_path = _executable("CIPHERLM_CHROMEDRIVER", ("chromedriver",), ("/usr/lib/chromium/chromedriver",))
    if chromium is None:
        _unavailable("no chromium binary (PATH, /usr/lib/chromium, $CIPHERLM_CHROMIUM)")
    if driver_path is None:
        _unavailable("no chromedriver binary (PATH, /usr/lib/chromium, $CIPHERLM_CHROMEDRIVER)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,800", "--hide-scrollbars", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        opts.add_argument(arg)
    try:
        drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    except Exception as exc:  # a broken installation is a failure too, with the reason
        _unavailable(f"{chromium} with {driver_path} did not start ({type(exc).__name__}: "
                     f"{str(exc).splitlines()[0][:300] if str(exc) else ''})")
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def page_proxy(chat_dir):  # noqa: F811 (the fixture imported from test_proxy)
    """An offload server on the tiny Llama and a proxy in front of it (the test template)."""
    server = _serve(OffloadServer(ModelHost(str(chat_dir)), "127.0.0.1", 0, session_timeout=30.0))
    p = RunningProxy(ProxyApp([server.address], "offload",
                              chat_template=ChatTemplate.from_file(chat_dir / "tokenizer_config.json")))
    yield p
    p.stop()
    server.shutdown()


# records every text the assistant bubbles show (each textContent assignment adds a text node)
WATCH_JS = """
window.__texts = [];
new MutationObserver((records) => {
  for (const r of records) {
    if (!(r.target.classList && r.target.classList.contains('assistant'))) continue;
    for (const n of r.addedNodes) if (n.nodeType === 3) window.__texts.push(n.data);
  }
}).observe(document.getElementById('log'), {childList: true, subtree: true});
"""


def _wait(cond, timeout: float, what: str):
    t0 = time.time()
    while True:
        v = cond()
        if v:
            return v
        assert time.time() - t0 < timeout, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.05)


def _chat(drv, text: str) -> dict:
    """Type `text` in the page, send it with the Send button, wait for the reply to finish;
    the last turn's reply, its class, the texts it showed while streaming and its cost panel."""
    from selenium.webdriver.common.by import By

    n_before = len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    box = drv.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    drv.find_element(By.ID, "send").click()
    _wait(lambda: len(drv.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='1']")) > n_before, 60,
          "the streamed reply")
    reply = drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    cost = drv.find_elements(By.CSS_SELECTOR, ".cost")[-1]
    return {"reply": reply, "text": reply.get_attribute("textContent"), "cls": reply.get_attribute("class"),
            "cost": cost, "cost_text": cost.get_attribute("innerText"),
            "texts": drv.execute_script("return window.__texts.splice(0)")}


def _save_png(drv, name: str) -> Path:
    path = screenshot_dir() / name
    if path.exists():
        path.unlink()
    assert drv.save_screenshot(str(path)), "the browser took no screenshot"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return path


def _png_size(path: Path) -> tuple[int, int]:
    d = path.read_bytes()
    return int.from_bytes(d[16:20], "big"), int.from_bytes(d[20:24], "big")


def _load(drv, url: str) -> None:
    from selenium.webdriver.common.by import By

    drv.get(url + "/")
    _wait(lambda: drv.find_elements(By.CSS_SELECTOR, "#model option"), 30, "the model list")
    drv.execute_script(WATCH_JS)
    drv.find_element(By.ID, "maxtokens").send_keys(str(MAX_TOKENS))


def _check_reply(got: dict, want: str, prompt: str, proxy: RunningProxy) -> None:
    assert "error" not in got["cls"] and "pending" not in got["cls"], got["text"]
    assert got["text"] == want  # the plaintext executor's greedy answer
    # it streamed: the bubble showed growing prefixes of the answer, one per delta
    texts = got["texts"]
    assert texts and texts[-1] == want
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:])), texts
    if len(want) > 1:
        assert len(texts) > 1, "the reply arrived in one piece, not streamed"
    cost = got["cost_text"]
    for needle in ("Cost of this reply", "mode", "offload", "bytes up", "bytes down", "rounds", "first token",
                   "per later token", "What the server saw", "messages", "ciphertexts", "setup", "plaintext"):
        assert needle in cost, (needle, cost)
    res = proxy.proxy.last_result["cost"]
    units = r"\d+(\.\d)? (B|KB|MB|GB)"
    assert re.search(r"bytes up\s+" + units, cost) and re.search(r"bytes down\s+" + units, cost), cost
    assert re.search(rf"rounds\s+{res['rounds']}\b", cost), cost
    assert re.search(rf"ciphertexts\s+{res['server_saw']['ciphertexts']}\b", cost), cost
    assert re.search(r"per later token\s+\d+(\.\d+)? m?s", cost), cost
    assert re.search(r"plaintext\s+none", cost), cost
    assert prompt not in cost  # the panel shows counts, never text
    if len(want.strip()) >= 6:  # (a very short answer could occur in the labels by chance)
        assert want not in cost


def _no_overflow(drv) -> dict:
    m = drv.execute_script("return {sw: document.documentElement.scrollWidth, bw: document.body.scrollWidth, "
                           "iw: window.innerWidth, ih: window.innerHeight}")
    assert max(m["sw"], m["bw"]) <= m["iw"], f"horizontal overflow: {m}"
    return m


def _in_view(drv, elem, m: dict, what: str) -> None:
    assert elem.is_displayed() and elem.is_enabled(), what
    r = drv.execute_script("const r = arguments[0].getBoundingClientRect(); "
                           "return {l: r.left, r: r.right, t: r.top, b: r.bottom, w: r.width, h: r.height}", elem)
    assert r["l"] >= 0 and r["r"] <= m["iw"] + 0.5 and r["t"] >= 0 and r["b"] <= m["ih"] + 0.5, (what, r, m)
    assert r["w"] >= 40 and r["h"] >= 24, (what, r)  # big enough to tap


def test_chat_page_in_headless_chromium(browser, page_proxy, chat_dir):  # noqa: F811
    from selenium.webdriver.common.by import By

    drv = browser
    prompt = "zebras?"
    want, _, _ = _plain_answer(chat_dir, [{"role": "user", "content": prompt}], MAX_TOKENS)
    assert want

    # ---- desktop, 1280x800
    drv.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    _load(drv, page_proxy.url)
    assert drv.title.startswith("cipherlm")
    got = _chat(drv, prompt)
    _check_reply(got, want, prompt, page_proxy)
    m = _no_overflow(drv)
    assert m["iw"] == 1280 and m["ih"] == 800, m
    # the cost panel sits beside the reply at this width
    reply_r, cost_r = (drv.execute_script("return arguments[0].getBoundingClientRect().toJSON()", e)
                       for e in (got["reply"], got["cost"]))
    assert cost_r["left"] >= reply_r["right"], (reply_r, cost_r)
    desk = _save_png(drv, "chat-1280x800.png")
    assert _png_size(desk) == (1280, 800)

    # ---- phone width, 390x844 (mobile emulation: the page's viewport meta applies)
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True})
    _load(drv, page_proxy.url)
    m = _no_overflow(drv)
    assert m["iw"] == 390, m
    box, send = drv.find_element(By.ID, "prompt"), drv.find_element(By.ID, "send")
    _in_view(drv, box, m, "the message box")
    _in_view(drv, send, m, "the Send button")
    prompt2 = "quokka!"
    want2, _, _ = _plain_answer(chat_dir, [{"role": "user", "content": prompt2}], MAX_TOKENS)
    got2 = _chat(drv, prompt2)
    _check_reply(got2, want2, prompt2, page_proxy)
    m = _no_overflow(drv)  # a reply and its cost panel do not widen the page either
    reply_r, cost_r = (drv.execute_script("return arguments[0].getBoundingClientRect().toJSON()", e)
                       for e in (got2["reply"], got2["cost"]))
    assert cost_r["top"] >= reply_r["bottom"] and cost_r["right"] <= m["iw"], (reply_r, cost_r)  # under it
    # the reply is not hidden behind the fixed message bar once scrolled to the end
    drv.execute_script("window.scrollTo(0, document.documentElement.scrollHeight)")
    footer_top = drv.execute_script("return document.querySelector('footer').getBoundingClientRect().top")
    cost_bottom = drv.execute_script("return arguments[0].getBoundingClientRect().bottom", got2["cost"])
    assert cost_bottom <= footer_top + 0.5, (cost_bottom, footer_top)
    _in_view(drv, drv.find_element(By.ID, "send"), m, "the Send button after a reply")
    phone = _save_png(drv, "chat-390x844.png")
    assert _png_size(phone) == (780, 1688)  # 390x844 CSS pixels at device scale 2
