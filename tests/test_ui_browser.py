"""The page in headless Chromium (Debian's package, driven by Playwright).

One browser for the module; one server started with a trace for the interactions, one without
for the screenshots. Sliders are moved with the keyboard, as a person without a mouse would, and
every figure asserted is read from the page. Screenshots go to out/screenshots/; set
ZERODP_SCREENSHOTS=docs/img to refresh the ones the README and docs/ui.md show.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import serve

pytestmark = pytest.mark.browser

# Screenshots go to out/screenshots (ignored by git); ZERODP_SCREENSHOTS=docs/img refreshes the README's.
IMG_DIR = Path(os.environ.get("ZERODP_SCREENSHOTS", Path(__file__).resolve().parents[1] / "out" / "screenshots"))
DATA = Path(__file__).resolve().parent / "data"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PANELS = ("memory", "overlap", "roofline", "batch")  # the panels with charts (and recommend, a table)
ALL_READY = ("() => window.Plotly && [...document.querySelectorAll('section.panel')]"
             ".every(s => s.getAttribute('aria-busy') === 'false')")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a Chrome trace shaped like the engine's (test_ui_api reads a real one), so the measured
    # timeline is drawn too
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "comm"}},
        {"name": "backward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 9e3, "args": {}},
        {"name": "all_reduce", "ph": "X", "pid": 0, "tid": 1, "ts": 5e3, "dur": 6e3,
         "args": {"label": "bucket 0", "bytes": 1 << 20}},
    ]}))
    yield from serve(trace=str(trace))


@pytest.fixture(scope="module")
def plain_server():
    """No trace: the page as a first-time user sees it, for the screenshots."""
    yield from serve()


@pytest.fixture(scope="module")
def browser():
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("Chromium is not installed: run 'apt-get install chromium' (Debian's package; "
                    "'make test' does it when run as root). These tests use that browser, not one "
                    "that 'playwright install' downloads.")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: pip install -e '.[dev]'")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Visit:
    """A page with its console errors and every request it made."""

    def __init__(self, browser, url, viewport):
        self.url = url
        self.context = browser.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.errors, self.requests = [], []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(url)
        self.page.wait_for_function(ALL_READY, timeout=30_000)

    def settle(self, panel):
        self.page.wait_for_selector(f"#{panel}[aria-busy='false']", timeout=15_000)

    def number(self, selector) -> float:
        return float(self.page.get_attribute(selector, "data-value"))

    def press(self, slider, key, panel="overlap"):
        self.page.press(slider, key)
        self.settle(panel)

    def sweep_buckets(self) -> list[float]:
        """Exposed communication at the bucket slider's smallest value, ten PageUps, its largest."""
        self.press("#bucket", "Home")
        readings = [self.number("#exposed")]
        while self.page.eval_on_selector("#bucket", "el => Number(el.value) < Number(el.max)"):
            self.press("#bucket", "PageUp")
            readings.append(self.number("#exposed"))
            assert len(readings) < 30, "PageUp does not reach the end of the bucket slider"
        return readings

    def close(self):
        self.context.close()


@pytest.fixture(scope="module")
def desktop(server, browser):
    visit = Visit(browser, server.url, DESKTOP)
    yield visit
    visit.close()


def test_page_loads_clean_and_local(desktop, server):
    assert desktop.errors == []
    assert desktop.requests and all(u.startswith(server.url) for u in desktop.requests), desktop.requests
    assert any(u.endswith("/plotly.min.js") for u in desktop.requests)
    for panel in PANELS:  # every panel drew its charts
        assert desktop.page.locator(f"#{panel} .js-plotly-plot").count() >= 1, panel
        assert desktop.page.locator(f"#{panel} .error").inner_text() == ""
    # the trace the server was started with is drawn next to the simulation
    desktop.page.wait_for_selector("#measured-lanes.js-plotly-plot", timeout=10_000)
    assert "trace.json" in desktop.page.inner_text("#measured-source")


def test_every_control_is_labelled_and_sliders_are_native(desktop):
    unlabelled = desktop.page.eval_on_selector_all(
        "form input, form select", "els => els.filter(e => !e.labels || !e.labels.length).map(e => e.name)")
    assert unlabelled == []
    sliders = desktop.page.eval_on_selector_all(
        "input[type=range]", "els => els.map(e => [e.name, e.getAttribute('aria-valuetext')])")
    assert len(sliders) >= 5 and all(text for _, text in sliders), sliders


def test_memory_panel_shows_the_zero_paper_table_and_the_whole_bill(desktop):
    page = desktop.page
    states = [page.inner_text(f"#memory small.states[data-stage='{s}']")
              for s in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert states == ["model states 120 GB", "model states 31.4 GB", "model states 16.6 GB",
                      "model states 1.88 GB"]  # guide §9.4
    # the headline figure is the total "fits" compares: ZeRO-3 adds its two gathered units
    status, api = _api(desktop, "memory")
    for s in api["stages"]:
        dd = f"#memory dd[data-stage='{s['stage_name']}']"
        assert page.inner_text(dd) == s["total_label"]
        assert page.get_attribute(dd, "data-fits") == str(s["fits"]).lower()
        assert ("over" in (page.get_attribute(dd, "class") or "")) == (not s["fits"])
    assert "gathered units" in page.inner_text("#memory-includes")
    assert "no shape" in page.inner_text("#memory-warnings")  # the units rest on an assumed shape
    # the HBM label sits right of the plot, on no bar
    x = page.evaluate("document.getElementById('memory-bars').layout.annotations[0].x")
    assert x > 1


def _api(visit, endpoint, **params):
    import urllib.request
    from urllib.parse import urlencode
    try:
        with urllib.request.urlopen(visit.url + f"api/{endpoint}?{urlencode(params)}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_bucket_slider_goes_high_low_high_and_few_tokens_stay_high(desktop):
    page = desktop.page
    backward = desktop.number("#overlap output[data-field='labels.backward']")
    exposed = desktop.sweep_buckets()
    print("exposed (s), bucket slider Home → End, 4096 tokens/GPU:", [f"{e:.3g}" for e in exposed])
    low = min(exposed)
    i = exposed.index(low)
    assert 0 < i < len(exposed) - 1, exposed  # the sweet spot is inside the range
    assert low < 0.1 * backward, (low, backward)  # only a small tail shows
    assert exposed[0] > 10 * low and exposed[-1] > 3 * low, exposed  # latency / last bucket
    assert list(exposed[: i + 1]) == sorted(exposed[: i + 1], reverse=True), exposed
    assert page.inner_text("#exposed").endswith("s")  # a readable time, not a raw number

    # fewer tokens per GPU: backward shrinks, gradients do not, so no bucket size hides them
    for _ in range(4):  # 4096 → 256 tokens per GPU
        desktop.press("#tokens", "ArrowLeft")
    assert page.get_attribute("#tokens", "aria-valuetext") == "256"
    short_backward = desktop.number("#overlap output[data-field='labels.backward']")
    few = desktop.sweep_buckets()
    print("exposed (s), bucket slider Home → End, 256 tokens/GPU:", [f"{e:.3g}" for e in few],
          f"backward {short_backward:.3g} s")
    assert short_backward < backward / 10
    assert all(e > short_backward for e in few), (few, short_backward)  # comm-bound everywhere
    assert min(few) > 5 * low, (few, low)
    for _ in range(4):
        desktop.press("#tokens", "ArrowRight")


def test_bad_input_shows_the_servers_sentence_next_to_the_field(desktop):
    page = desktop.page
    before = list(desktop.errors)
    page.fill("#memory input[name=params]", "-5")
    desktop.settle("memory")
    _, api = _api(desktop, "memory", model="custom", params="-5")
    note = page.locator("#memory .field-error")
    assert note.count() == 1 and note.inner_text() == api["error"]  # the API's very sentence
    assert page.get_attribute("#memory input[name=params]", "aria-invalid") == "true"
    field = page.locator("#memory input[name=params]").bounding_box()
    box = note.bounding_box()
    assert 0 <= box["y"] - (field["y"] + field["height"]) < 40, (field, box)  # right under it
    assert page.inner_text("#memory p.error") == ""
    assert desktop.errors == before  # a refused value is an answer, not a console error
    page.select_option("#memory select[name=model]", "zero-7.5b")
    desktop.settle("memory")
    assert page.locator("#memory .field-error").count() == 0
    assert page.inner_text("#memory small.states[data-stage='ZeRO-3']").endswith("1.88 GB")


def test_seq_without_a_shape_and_mbs_without_seq_are_refused_at_their_field(desktop):
    page = desktop.page
    page.select_option("#memory select[name=model]", "zero-7.5b")
    page.fill("#memory input[name=micro_batch]", "4")
    desktop.settle("memory")
    assert "seq" in page.inner_text("#memory .field-error")
    assert page.get_attribute("#memory input[name=seq]", "aria-invalid") == "true"
    page.fill("#memory input[name=micro_batch]", "1")
    desktop.settle("memory")
    assert page.locator("#memory .field-error").count() == 0


def test_a_config_json_from_the_file_picker_and_the_paste_box(desktop):
    page = desktop.page
    page.set_input_files("#config-file", str(DATA / "mixtral-8x7b" / "config.json"))
    desktop.settle("memory")
    page.wait_for_function("() => document.getElementById('memory-model').textContent.includes('46.7B')")
    assert page.input_value("#memory select[name=model]") == "custom"
    assert page.get_attribute("#memory input[name=experts]", "placeholder") == "8"
    assert float(page.get_attribute("#memory-model", "data-params")) == pytest.approx(46.7e9, rel=0.005)
    page.fill("#memory textarea[name=config]", (DATA / "deepseek-v3" / "config.json").read_text())
    desktop.settle("memory")
    page.wait_for_function("() => document.getElementById('memory-model').textContent.includes('671B')")
    assert "37.6B active" in page.inner_text("#memory-model")
    page.fill("#memory textarea[name=config]", "{ not json")
    desktop.settle("memory")
    assert "not valid JSON" in page.inner_text("#memory .field-error")
    page.select_option("#memory select[name=model]", "zero-7.5b")
    desktop.settle("memory")


def test_editing_a_presets_shape_makes_it_custom(desktop):
    page = desktop.page
    page.select_option("#memory select[name=model]", "llama3-8b")
    desktop.settle("memory")
    assert page.get_attribute("#memory input[name=layers]", "placeholder") == "32"
    eight = float(page.get_attribute("#memory-model", "data-params"))
    page.fill("#memory input[name=layers]", "64")
    desktop.settle("memory")
    assert page.input_value("#memory select[name=model]") == "custom"
    assert page.input_value("#memory input[name=hidden]") == "4096"  # the rest of the shape kept
    sixty_four = float(page.get_attribute("#memory-model", "data-params"))
    emb = 2 * 128256 * 4096
    assert sixty_four - emb == pytest.approx(2 * (eight - emb), rel=1e-6)
    page.select_option("#memory select[name=model]", "zero-7.5b")
    desktop.settle("memory")


def test_default_bucket_is_the_clis(plain_server, browser):
    import contextlib
    import io

    from zerodp.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "simulate", "--json"]) == 0
    cli = json.loads(out.getvalue())["timeline"]
    visit = Visit(browser, plain_server.url, DESKTOP)
    try:
        # 25 MiB, DDP's bucket_cap_mb and zerodp train's --bucket-mb 25 (zerodp.plan.defaults)
        assert visit.number("#overlap output[data-field='labels.buckets']") == cli["num_buckets"] == 613
        assert visit.page.inner_text("#overlap output[for=bucket]") == "26.2 MB"
    finally:
        visit.close()


def test_chart_labels_say_what_the_marker_shows(desktop):
    page = desktop.page
    page.fill("#batch input[name=dp]", "4096")  # GPU-rich: the exact grad_acc is 0.125
    desktop.settle("batch")
    chart = "document.getElementById('batch-sweep')"
    marker = page.evaluate(f"{chart}.data[2]")
    # the chart stops at grad_acc 1 (the CLI refuses less): the marker sits on that floor and
    # says the exact value as zerodp plan batch prints it
    assert marker["y"] == [1] and "exact 0.125" in marker["text"][0]
    assert marker["textposition"] == "middle left"  # the right half: the label goes left
    ok, rich = page.evaluate(f"{chart}.data.slice(0, 2).map(d => [d.name, d.y])")
    assert min(ok[1]) >= 1 and set(rich[1]) == {1} and "GPU-rich" in rich[0] and "red" in rich[0]
    assert page.evaluate(f"{chart}.layout.showlegend") is True
    page.fill("#batch input[name=dp]", "128")
    desktop.settle("batch")
    sweep = page.evaluate("document.getElementById('overlap-sweep')")
    label = page.evaluate("document.getElementById('overlap-sweep').layout.annotations[0]")
    assert label["x"] < 0.1 and label["yanchor"] == "top"  # backward's label: left, under its line
    assert page.evaluate("document.getElementById('overlap-sweep').data[1].cliponaxis") is False
    assert sweep is not None
    # the marker's label opens towards the middle: right of the smallest bucket, left of the largest
    position = "document.getElementById('overlap-sweep').data[1].textposition"
    desktop.press("#bucket", "Home")
    assert page.evaluate(position) == "top right"
    desktop.press("#bucket", "End")
    assert page.evaluate(position) == "top left"


def test_language_switch_chinese_and_back(browser, server):
    visit = Visit(browser, server.url, DESKTOP)
    try:
        page = visit.page
        page.click("nav.lang a[data-lang=zh]")
        for panel in PANELS:
            visit.settle(panel)
        assert "lang=zh" in page.url
        assert page.get_attribute("html", "lang") == "zh-CN" and "数据并行" in page.title()
        assert "张卡" in page.evaluate("document.getElementById('roofline-curve').data[0].hovertemplate")
        assert page.get_attribute("#memory-bars", "aria-label") == "各阶段每卡字节数的堆叠柱状图"
        text = page.inner_text("body")
        for term in ("数据并行", "分桶", "梯度累积", "通信屋顶线", "显存", "优化器状态"):
            assert term in text, term
        page.fill("#batch input[name=dp]", "0")
        visit.settle("batch")
        _, api = _api(visit, "batch", dp="0")
        assert page.inner_text("#batch .field-error") == api["error_zh"] and "应为" in api["error_zh"]
        page.fill("#batch input[name=dp]", "128")
        visit.settle("batch")
        # a reload keeps the language: it is in the URL
        page.reload()
        page.wait_for_function(ALL_READY, timeout=30_000)
        assert page.inner_text("#memory-title span") == "每卡显存"
        page.click("nav.lang a[data-lang=en]")
        visit.settle("memory")
        assert page.inner_text("#memory-title span") == "Memory per GPU" and "lang=en" in page.url
        assert visit.errors == []
    finally:
        visit.close()


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("name, viewport", [("desktop", DESKTOP), ("phone", PHONE)])
def test_screenshots_at_default_values(plain_server, browser, name, viewport, lang):
    """A fresh page at each width and language: no horizontal scrolling, no console errors;
    images for the docs."""
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    suffix = "" if lang == "en" else "-zh"
    visit = Visit(browser, plain_server.url + f"?lang={lang}", viewport)
    try:
        assert visit.errors == []
        width = visit.page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], f"page is {width}px wide in a {viewport['width']}px window"
        assert visit.page.inner_text("#memory-title span") == ("每卡显存" if lang == "zh" else "Memory per GPU")
        visit.page.screenshot(path=IMG_DIR / f"ui-{name}{suffix}.png", full_page=True)
        if lang == "en":
            visit.page.locator("#overlap").screenshot(path=IMG_DIR / f"ui-overlap-{name}.png")
    finally:
        visit.close()
    assert (IMG_DIR / f"ui-{name}{suffix}.png").stat().st_size > 10_000


def _system_cjk_fonts() -> list[str]:
    """CJK fonts installed on this machine (fontconfig's list; empty on a stock Debian)."""
    fc = shutil.which("fc-list")
    if fc is None:
        return []
    import subprocess
    out = subprocess.run([fc, ":lang=zh", "family"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def test_chinese_renders_with_the_shipped_glyphs(plain_server, browser):
    """Chinese headings are drawn with the page's own font (zerodp-cjk.woff2), not the system's:
    Chromium names the font it used for each node's text, and the text's width differs from the
    fallback's (empty boxes when the machine has no CJK font)."""
    visit = Visit(browser, plain_server.url + "?lang=zh", DESKTOP)
    try:
        page = visit.page
        page.evaluate("async () => { await document.fonts.ready; }")
        assert page.evaluate("document.fonts.check('16px \"zerodp CJK\"', '每卡显存')")
        faces = page.evaluate("[...document.fonts].map(f => [f.family, f.status])")
        assert ['"zerodp CJK"', "loaded"] in faces or ["zerodp CJK", "loaded"] in faces, faces
        cdp = visit.context.new_cdp_session(page)
        cdp.send("DOM.enable")
        cdp.send("CSS.enable")
        root = cdp.send("DOM.getDocument")["root"]["nodeId"]
        for selector in ("#memory-title span", "#batch-title small", "#recommend-title span",
                         "nav a[data-lang=zh]"):
            node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
            used = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
            names = {f["familyName"] for f in used}
            assert "zerodp CJK" in names, (selector, used)
        # every character the font claims, drawn by it alone: no glyph falls back to another font
        chars = (Path(__file__).resolve().parents[1] / "src/zerodp/ui/static/zerodp-cjk-chars.txt"
                 ).read_text(encoding="utf-8").strip()
        # laid out and drawn before asking: the browser reports the fonts of text it has shaped
        page.evaluate("""async (t) => {
            const p = Object.assign(document.createElement('p'), {id: 'all-cjk', textContent: t});
            document.body.append(p); p.getBoundingClientRect(); await document.fonts.ready;
            await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r))); }""", chars)
        node = cdp.send("DOM.querySelector", {"nodeId": cdp.send("DOM.getDocument")["root"]["nodeId"],
                                              "selector": "#all-cjk"})["nodeId"]
        used = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
        for _ in range(20):  # a slower machine may shape the new text a few frames later
            if used:
                break
            page.wait_for_timeout(100)
            used = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
        assert [(f["familyName"], f["glyphCount"]) for f in used] == [("zerodp CJK", len(chars))], used
        assert page.inner_text("#batch-title small") == "指南 §6.1"
        assert "guide" not in page.inner_text("header") + "".join(
            page.eval_on_selector_all("h2", "els => els.map(e => e.innerText)"))
        text = page.inner_text("#memory-title span")
        widths = page.evaluate("""(text) => ['"zerodp CJK", sans-serif', '"no such font", sans-serif'].map(f => {
            const s = Object.assign(document.createElement('span'), {textContent: text});
            s.style.font = '20px ' + f; document.body.append(s);
            const w = s.getBoundingClientRect().width; s.remove(); return w; })""", text)
        assert widths[0] == pytest.approx(20 * len(text), abs=1)  # full-width glyphs, 1 em each
        if not _system_cjk_fonts():  # no CJK font here: the fallback draws boxes of another width
            assert abs(widths[0] - widths[1]) > 1, widths
        IMG_DIR.mkdir(parents=True, exist_ok=True)
        page.locator("#memory").screenshot(path=IMG_DIR / "ui-memory-zh.png")
    finally:
        visit.close()


def test_recommend_panel_shows_the_clis_table(desktop):
    page = desktop.page
    desktop.settle("recommend")
    cells = page.eval_on_selector_all("#recommend-table tbody tr:first-child td", "els => els.map(e => e.innerText)")
    from zerodp.plan.recommend import recommend, rows
    r = recommend("llama3-8b", "H100", nodes=1, global_batch_tokens=4 * 2**20, seq=4096)
    assert cells == rows(r)[0] and cells[-1] == "first pick: fastest"
    assert page.locator("#recommend-rejected li").count() == len(r.rejected)
    assert page.inner_text("#recommend-train").endswith("zerodp train " + r.train_flags)


def test_recommend_panel_takes_a_picked_or_pasted_config_json(desktop):
    """A config.json from the file picker, then pasted: the table is the CLI's for that model."""
    from zerodp.plan import load_config
    from zerodp.plan.recommend import recommend, rows

    page = desktop.page
    path = DATA / "llama-3.2-1b" / "config.json"
    r = recommend(load_config(path), "H100", nodes=1, global_batch_tokens=4 * 2**20, seq=4096)
    page.set_input_files("#recommend-config-file", str(path))
    page.wait_for_function("() => document.querySelector('#recommend-table caption')"
                           " && document.querySelector('#recommend-table caption').textContent"
                           ".startsWith('config.json')", timeout=15_000)
    desktop.settle("recommend")
    first = page.eval_on_selector_all("#recommend-table tbody tr:first-child td", "els => els.map(e => e.innerText)")
    assert first == rows(r)[0]
    page.fill("#recommend textarea[name=config]", "")
    desktop.settle("recommend")
    page.fill("#recommend textarea[name=config]", path.read_text())
    desktop.settle("recommend")
    assert page.inner_text("#recommend-table caption").startswith("config.json")
    page.fill("#recommend textarea[name=config]", "{not json")
    desktop.settle("recommend")
    assert "config" in page.inner_text("#recommend .field-error")
    page.fill("#recommend textarea[name=config]", "")
    desktop.settle("recommend")
    assert desktop.errors == []


#: English the Chinese page may show: technical names the guide's Chinese keeps as they are, and
#: every value of a choice (presets, compressions, ...), taken from /api/schema below
TERMS = {"GPU", "GQA", "HBM", "MFU", "MLP", "MiB", "NVLink", "SwiGLU", "TPU", "ZeRO", "AllReduce",
         "ReduceScatter", "token", "config", "json", "grad_acc", "mbs", "seq", "gbs", "zerodp",
         "FLOP", "MAMF", "FlashAttention"}  # units and kernel names the Chinese page keeps as they are


def _english_words(text: str) -> set[str]:
    import re

    text = re.sub(r"zerodp [a-z]+(?: [a-z]+)?(?: --?[a-z0-9-]+(?: [^\s-][^\s]*)?)*", " ", text)
    return set(re.findall(r"[A-Za-z][A-Za-z_]{2,}", text))


def test_chinese_is_complete(plain_server, browser):
    """?lang=zh: no English words in the panels but technical names and choice values; the
    recommend table's cells, its rejected examples and notes too."""
    import re
    import urllib.request

    schema = json.loads(urllib.request.urlopen(plain_server.url + "api/schema").read())
    allowed = set(TERMS)
    for endpoint in schema.values():
        for p in endpoint["params"]:
            for choice in p.get("choices", []):
                allowed |= set(re.findall(r"[A-Za-z][A-Za-z_]{2,}", choice))
    visit = Visit(browser, plain_server.url + "?lang=zh", DESKTOP)
    try:
        page = visit.page
        # a recommend answer with runners-up, rejected regions and a note
        page.fill("#recommend input[name=nodes]", "8")
        page.select_option("#recommend select[name=model]", "mixtral-8x7b")
        visit.settle("recommend")
        texts = page.eval_on_selector_all("section.panel", "els => els.map(e => e.innerText)")
        assert "为何不是首选" in texts[-1] and "并列" in texts[-1] and "显存放不下" in texts[-1]
        left = set().union(*(_english_words(t) for t in texts)) - allowed
        assert not left, f"untranslated English on the Chinese page: {sorted(left)}"
        assert visit.errors == []
    finally:
        visit.close()


def test_an_error_follows_the_language_switch(browser, server):
    """An error shown in English is shown in Chinese right after the switch (and back)."""
    visit = Visit(browser, server.url, DESKTOP)  # English unless the URL says otherwise
    try:
        page = visit.page
        page.fill("#batch input[name=dp]", "0")
        visit.settle("batch")
        _, api = _api(visit, "batch", dp="0")
        assert page.inner_text("#batch .field-error") == api["error"]
        page.click("nav.lang a[data-lang=zh]")
        assert page.inner_text("#batch .field-error") == api["error_zh"]  # at once, no refetch
        visit.settle("batch")
        assert page.inner_text("#batch .field-error") == api["error_zh"]
        page.click("nav.lang a[data-lang=en]")
        visit.settle("batch")
        assert page.inner_text("#batch .field-error") == api["error"]
        page.fill("#batch input[name=dp]", "128")
        visit.settle("batch")
    finally:
        visit.close()


CONTENT_BOTTOM = ("s => Math.max(...[...s.children].filter(c => c.offsetParent)"
                  ".map(c => c.getBoundingClientRect().bottom))")
BOX = "el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; }"


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("viewport", [PHONE, DESKTOP], ids=["390px", "1280px"])
def test_layout_at_390_and_1280_px(plain_server, browser, viewport, lang):
    """The batch legend inside its chart; the recommend table one line per row (it scrolls
    sideways on a phone); at 1280 px no panel is more than a little empty below its content."""
    visit = Visit(browser, plain_server.url + f"?lang={lang}", viewport)
    try:
        page = visit.page
        chart = page.eval_on_selector("#batch-sweep", BOX)
        entries = page.eval_on_selector_all("#batch-sweep .legend .traces", f"els => els.map({BOX})")
        assert entries and all(chart[0] - 1 <= e[0] and e[2] <= chart[2] + 1 for e in entries), (chart, entries)
        heights = page.eval_on_selector_all("#recommend-table tbody tr",
                                            "els => els.map(e => e.getBoundingClientRect().height)")
        assert heights and max(heights) <= 30, heights
        if viewport is DESKTOP:
            for panel in ("memory", "overlap", "roofline", "batch", "recommend"):
                box = page.eval_on_selector(f"#{panel}", BOX)
                bottom = page.eval_on_selector(f"#{panel}", CONTENT_BOTTOM)
                assert box[3] - bottom <= 40, (panel, box, bottom)
        assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
        assert visit.errors == []
    finally:
        visit.close()
