"""The explorer page in a real browser: headless Chromium through selenium loads the page from a
uvicorn server, types text, and checks the token count and the top next token against the API; then
moves the temperature slider and checks the distribution shown is the one generate.sampling
computes; and against a server with an API key, that the page sends the key given in its address
(/#key=KEY) or its field. Screenshots go to tmp_path (or to $LOGITLAB_SCREENSHOTS when set). Skips, with the
reason, where selenium, chromium or chromedriver is missing."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
uvicorn = pytest.importorskip("uvicorn")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

# How long a wait may take: it ends as soon as the page shows what it waits for, so a long bound only
# matters on a loaded machine, where one generation has taken over 30 s.
WAIT_S = 180

from logitlab.generate import SampleConfig, process_logits  # noqa: E402
from logitlab.model import ModelConfig, Transformer  # noqa: E402
from logitlab.serve.app import create_app  # noqa: E402
from logitlab.tokenizer.core import Tokenizer  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no chromium and chromedriver on PATH (Debian: apt-get install chromium "
                                       "chromium-driver)")
TEXT = "the other theme there"


KEY = "sk-page-test"


def _start(model, tok, api_key=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(model, tok, name="tiny", api_key=api_key), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def site():
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"t", b"h"), (b"th", b"e"), (b" ", b"the"), (b"e", b"r")]
    for k, (a, b) in enumerate(merges):
        vocab[256 + k] = a + b
    tok = Tokenizer(vocab, merges, special_tokens={"<|endoftext|>": 256 + len(merges)})
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2,
                                    n_heads=4)).eval()
    server, thread, url = _start(model, tok)
    keyed, keyed_thread, keyed_url = _start(model, tok, api_key=KEY)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,1800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield dict(driver=driver, url=url, keyed_url=keyed_url, model=model, tok=tok)
    driver.quit()
    for s, t in ((server, thread), (keyed, keyed_thread)):
        s.should_exit = True
        t.join(timeout=10)


def _shot(driver, tmp_path: Path, name: str) -> None:
    folder = Path(os.environ.get("LOGITLAB_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(folder / f"explorer-{name}.png"))


def _bars(driver) -> dict[int, float]:
    """token id -> the sampler probability the page shows, read in one script (the page may be
    redrawing the bars while they are read)."""
    pairs = driver.execute_script("return Array.from(document.querySelectorAll('#bars rect[data-id]'))"
                                  ".map((r) => [r.dataset.id, r.dataset.probability]);")
    return {int(i): float(p) for i, p in pairs}


def test_the_page_shows_tokens_and_reshapes_the_distribution_as_the_sampler_does(site, tmp_path):
    driver, model, tok = site["driver"], site["model"], site["tok"]
    driver.get(site["url"])
    box = driver.find_element(By.ID, "text")
    box.clear()
    box.send_keys(TEXT)
    driver.find_element(By.ID, "look").click()
    wait = WebDriverWait(driver, WAIT_S)
    ids = tok.encode(TEXT)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tokens span")) == len(ids))
    assert driver.find_element(By.ID, "summary").text.startswith(f"{len(ids)} tokens")
    wait.until(lambda d: _bars(d))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, -1:].float()                           # (1, V)
    assert next(iter(_bars(driver))) == int(logits.argmax())                         # the model's top next token
    _shot(driver, tmp_path, "tokens")

    shown = _bars(driver)
    driver.execute_script("const s = document.getElementById('temperature'); s.value = '0.5';"
                          "s.dispatchEvent(new Event('input'));")
    wait.until(lambda d: _bars(d) != shown)
    want = process_logits(logits, SampleConfig(temperature=0.5))[0]
    for token, p in _bars(driver).items():
        assert p == pytest.approx(float(want[token]), abs=1e-4)
    driver.execute_script("const s = document.getElementById('top_k'); s.value = '3';"
                          "s.dispatchEvent(new Event('input'));")
    wait.until(lambda d: d.find_element(By.ID, "next-title").get_attribute("data-kept") == "3")
    kept = {t: p for t, p in _bars(driver).items() if p > 0}
    want = process_logits(logits, SampleConfig(temperature=0.5, top_k=3))[0]
    assert set(kept) == set(want.nonzero()[:, 0].tolist())
    _shot(driver, tmp_path, "sampler")
    lens_rows = driver.find_elements(By.CSS_SELECTOR, "#lens tr")
    assert len(lens_rows) == model.config.n_layers + 2                               # a header, then L + 1 layers
    driver.find_elements(By.CSS_SELECTOR, "#tokens span")[1].click()                # the token " " (id 32)
    wait.until(lambda d: d.find_element(By.ID, "neighbours").text.startswith('" " (32):'))
    assert driver.find_element(By.ID, "next-title").text.startswith("next token after position 1 ")


def test_the_page_sends_the_api_key_from_the_address_or_its_field(site, tmp_path):
    driver, tok = site["driver"], site["tok"]
    wait = WebDriverWait(driver, WAIT_S)
    driver.get(site["keyed_url"])
    driver.find_element(By.ID, "look").click()
    wait.until(lambda d: "API key" in d.find_element(By.ID, "summary").text)
    assert driver.find_element(By.ID, "summary").text.startswith("error: You didn't provide an API key")
    driver.get("about:blank")
    driver.get(site["keyed_url"] + "#key=" + KEY)
    assert driver.find_element(By.ID, "api-key").get_attribute("value") == KEY
    assert driver.execute_script("return location.hash") == ""            # taken out of the address bar
    driver.find_element(By.ID, "look").click()
    ids = tok.encode(driver.find_element(By.ID, "text").get_attribute("value"))
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tokens span")) == len(ids))
    driver.find_element(By.ID, "generate").click()
    wait.until(lambda d: d.find_element(By.ID, "generated").text.strip())
    assert not driver.find_element(By.ID, "generated").text.startswith("error")
    field = driver.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys("wrong")
    driver.find_element(By.ID, "look").click()
    wait.until(lambda d: "Incorrect API key" in d.find_element(By.ID, "summary").text)
    _shot(driver, tmp_path, "api-key")


def test_the_page_shows_attention_weights_attribution_bars_and_the_patching_heatmap(site, tmp_path):
    from logitlab.inspect.attribution import direct_logit_attribution
    from logitlab.inspect.patching import activation_patching, logit_difference

    driver, model, tok = site["driver"], site["model"], site["tok"]
    wait = WebDriverWait(driver, WAIT_S)
    driver.get(site["url"])
    box = driver.find_element(By.ID, "text")
    box.clear()
    box.send_keys(TEXT)
    driver.find_element(By.ID, "look").click()
    ids = tok.encode(TEXT)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attribution rect.part")) > 0)
    with torch.no_grad():
        logits, weights = model.forward_with_attention(torch.tensor([ids]))
    want = direct_logit_attribution(model, ids, int(logits[0, -1].argmax()))
    shown = dict(driver.execute_script("return Array.from(document.querySelectorAll('#attribution rect.part'))"
                                       ".map((r) => [r.dataset.name, Number(r.dataset.value)]);"))
    assert shown == pytest.approx(want.parts, abs=1e-5)
    assert float(driver.find_element(By.ID, "attribution-title").get_attribute("data-logit")) == pytest.approx(
        want.logit, abs=1e-5)
    canvas = driver.find_element(By.ID, "attention")            # hover the cell of query T-1, key 0 in layer 0 head 0
    T = len(ids)
    size = canvas.size["width"]
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).move_to_element_with_offset(canvas, int(-size / 2 + size / T / 2),
                                                     int(size / 2 - size / T / 2)).perform()
    wait.until(lambda d: d.find_element(By.ID, "attention-value").get_attribute("data-weight"))
    assert driver.find_element(By.ID, "attention-value").text.startswith(f"query {T - 1} ")
    assert float(driver.find_element(By.ID, "attention-value").get_attribute("data-weight")) == pytest.approx(
        float(weights[0][0, 0, T - 1, 0]), abs=1e-4)
    corrupt = TEXT.replace("theme", "thene")                      # one byte token changed
    assert len(tok.encode(corrupt)) == T
    for field, value in (("patch-corrupt", corrupt), ("patch-token", "h"), ("patch-other", "t")):
        driver.find_element(By.ID, field).send_keys(value)
    driver.find_element(By.ID, "patch").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#patch-grid td[data-score]"))
    cells = driver.execute_script("return Array.from(document.querySelectorAll('#patch-grid td[data-score]'))"
                                  ".map((c) => Number(c.dataset.score));")
    expected = activation_patching(model, ids, tok.encode(corrupt), logit_difference(ord("h"), ord("t")))
    assert cells == pytest.approx(expected.scores.flatten().tolist(), abs=1e-3)
    _shot(driver, tmp_path, "interpret")


def test_the_page_shows_each_tokens_first_expert_and_the_load_of_an_moe(site, tmp_path):
    """Against an MoE model the experts grid holds, per MoE layer and position, the expert the
    router sends the token to first with its weight, and each expert's load; the dense model's page
    says it has none."""
    from logitlab.inspect.experts import expert_routing

    driver, tok = site["driver"], site["tok"]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2, n_heads=4,
                                    norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, n_experts=4,
                                    n_experts_per_token=2, moe_d_ff=16)).eval()
    server, thread, url = _start(model, tok)
    try:
        wait = WebDriverWait(driver, WAIT_S)
        driver.get(url)
        box = driver.find_element(By.ID, "text")
        box.clear()
        box.send_keys(TEXT)
        driver.find_element(By.ID, "look").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#experts td[data-expert]"))
        cells = driver.execute_script("return Array.from(document.querySelectorAll('#experts td[data-expert]'))"
                                      ".map((c) => [Number(c.dataset.expert), Number(c.dataset.weight)]);")
        loads = driver.execute_script("return Array.from(document.querySelectorAll('#experts td[data-load]'))"
                                      ".map((c) => c.dataset.load);")
        _shot(driver, tmp_path, "experts")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    want = expert_routing(model, tok.encode(TEXT))
    assert [e for e, _ in cells] == [row[0] for r in want for row in r.experts]
    assert [w for _, w in cells] == pytest.approx([row[0] for r in want for row in r.weights], abs=1e-4)
    assert loads == [",".join(map(str, r.load)) for r in want]
    driver.get(site["url"])                                      # the dense model
    box = driver.find_element(By.ID, "text")
    box.clear()
    box.send_keys(TEXT)
    driver.find_element(By.ID, "look").click()
    WebDriverWait(driver, WAIT_S).until(lambda d: d.find_element(By.ID, "experts-none").text)
    assert "no mixture-of-experts layer" in driver.find_element(By.ID, "experts-none").text
