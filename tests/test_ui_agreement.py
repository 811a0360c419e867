"""Questions asked of the CLI, the API and the page (through the browser): same totals, same
"fits", stage by stage. The first is the one where they used to disagree: Llama 3 70B on 512
GPUs, 8192 tokens, selective recomputation. Later ones add guide §14's levers (shard groups,
compression): the same memory, the same bytes and time per leg, the same roofline threshold; the
last two price tensor ownership (Muon + AdamW, Adafactor; guide §12.3)."""

import contextlib
import io
import json
import math
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import pytest

from test_ui_browser import ALL_READY, DESKTOP, browser, plain_server  # noqa: F401 (fixtures)
from zerodp.cli import main

pytestmark = pytest.mark.browser
DATA = Path(__file__).resolve().parent / "data"

QUESTIONS = [
    dict(model="llama3-70b", n=512, seq=8192, recompute="selective"),
    dict(model="zero-7.5b", n=64),
    dict(model="llama3-8b", n=8, seq=4096, mbs=2),
    dict(model="mixtral-8x7b", n=64, seq=4096, recompute="full", acc=True),
    dict(model="deepseek-v3", n=1024, hardware="H800", seq=4096, recompute="selective"),
    dict(config="qwen2-7b", n=8, seq=2048),
    dict(params="1T", n=4096),
    dict(model="llama3-405b", n=16384, seq=8192, recompute="selective", precision="fp8"),
    dict(shape=dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256), n=16,
         precision="fp32", k=8),
    dict(model="gpt-oss-120b", n=128, hardware="B200", seq=8192, recompute="selective", k=16),
    dict(model="llama3-70b", n=512, seq=8192, recompute="selective", shard=8, compress="int8"),
    dict(model="zero-7.5b", n=64, shard=16, compress="bf16-reduce", precision="fp32", k=8),
    dict(model="llama3-8b", n=8, shard=4, compress="int8-grads"),
    dict(model="llama3-8b", n=64, optimizer="muon", seq=4096),
    dict(config="qwen2-7b", n=16, optimizer="adafactor", shard=8),
]
# The page's recompute select starts at "none"; the CLI's default is "selective" when a sequence is
# given (what FlashAttention-era training stores): every case names it, so all three ask the same.
QUESTIONS = [{"recompute": "none", **q} for q in QUESTIONS]


def _ids(q):
    return q.get("model") or q.get("config") or ("params " + q["params"] if "params" in q else "shape")


def cli_json(q) -> dict:
    argv = ["plan", "memory", "--json", "--gpus", str(q["n"]), "--hardware", q.get("hardware", "H100")]
    if "model" in q:
        argv += ["--model", q["model"]]
    if "config" in q:
        argv += ["--config", str(DATA / q["config"] / "config.json")]
    if "params" in q:
        argv += ["--params", q["params"]]
    for name, v in q.get("shape", {}).items():
        argv += [f"--{name.replace('_', '-')}", str(v)]
    for key, flag in (("seq", "--seq"), ("mbs", "--mbs"), ("recompute", "--recompute"),
                      ("precision", "--precision"), ("k", "--k"), ("optimizer", "--optimizer")):
        if key in q:
            argv += [flag, str(q[key])]
    if q.get("acc"):
        argv.append("--fp32-grad-acc")
    if "shard" in q:
        argv += ["--shard-size", str(q["shard"])]
    if "compress" in q:
        argv += ["--compress", q["compress"]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def cli_answer(q) -> list[dict]:
    return cli_json(q)["stages"]


def api_params(q) -> dict:
    p = {"model": q.get("model", "custom"), "n": q["n"], "hardware": q.get("hardware", "H100")}
    if "config" in q:
        p["config"] = (DATA / q["config"] / "config.json").read_text()
    if "params" in q:
        p["params"] = q["params"]
    p.update(q.get("shape", {}))
    for key, name in (("seq", "seq"), ("mbs", "micro_batch"), ("recompute", "recompute"),
                      ("precision", "precision"), ("k", "k"), ("optimizer", "optimizer")):
        if key in q:
            p[name] = q[key]
    if q.get("acc"):
        p["fp32_grad_acc"] = "true"
    if "shard" in q:
        p["shard_size"] = q["shard"]
    if "compress" in q:
        p["compress"] = q["compress"]
    return p


def api_json(url, endpoint, params) -> dict:
    with urllib.request.urlopen(url + f"api/{endpoint}?" + urlencode(params), timeout=10) as r:
        return json.loads(r.read())


def api_answer(url, q) -> list[dict]:
    return api_json(url, "memory", api_params(q))["stages"]


def page_answer(page, url, q) -> list[dict]:
    """Every memory control set as a person would, on one page kept open between questions."""
    if not page.url.startswith(url):
        page.goto(url)
        page.wait_for_function(ALL_READY, timeout=30_000)
    form = "#memory form"
    page.select_option(f"{form} select[name=model]", "zero-7.5b")  # clears shape and config
    page.select_option(f"{form} select[name=model]", q.get("model", "custom"))
    if "config" in q:
        page.fill(f"{form} textarea[name=config]", (DATA / q["config"] / "config.json").read_text())
    if "params" in q:
        page.fill(f"{form} input[name=params]", q["params"])
    for name, v in q.get("shape", {}).items():
        page.fill(f"{form} input[name={name}]", str(v))
    page.eval_on_selector("#memory-n", "(el, n) => { el.value = Math.log2(n); "
                          "el.dispatchEvent(new Event('input', {bubbles: true})); }", q["n"])
    page.select_option(f"{form} select[name=hardware]", q.get("hardware", "H100"))
    page.select_option(f"{form} select[name=precision]", q.get("precision", "bf16"))
    page.fill(f"{form} input[name=k]", str(q.get("k", "")))
    page.select_option(f"{form} select[name=optimizer]", q.get("optimizer", "adamw"))
    page.set_checked(f"{form} input[name=fp32_grad_acc]", bool(q.get("acc")))
    page.fill(f"{form} input[name=seq]", str(q.get("seq", "")))
    page.fill(f"{form} input[name=micro_batch]", str(q.get("mbs", 1)))
    page.select_option(f"{form} select[name=recompute]", q.get("recompute", "none"))
    page.fill(f"{form} input[name=shard_size]", str(q.get("shard", "")))
    page.select_option(f"{form} select[name=compress]", q.get("compress", "none"))
    page.wait_for_selector("#memory[aria-busy='false']", timeout=15_000)
    assert page.inner_text("#memory .error") == "" and page.locator("#memory .field-error").count() == 0
    return page.eval_on_selector_all("#memory dd[data-stage]", "els => els.map(e => ({"
                                     "stage_name: e.dataset.stage, total_bytes: Number(e.dataset.value),"
                                     "fits: e.dataset.fits === 'true', total_label: e.textContent}))")


@pytest.fixture(scope="module")
def page(browser, plain_server):  # noqa: F811 (fixtures from test_ui_browser)
    context = browser.new_context(viewport=DESKTOP)
    p = context.new_page()
    errors = []
    p.on("console", lambda m: m.type == "error" and errors.append(m.text))
    p.errors = errors
    yield p
    context.close()


@pytest.mark.parametrize("q", QUESTIONS, ids=[_ids(q) for q in QUESTIONS])
def test_cli_api_and_page_agree(q, page, plain_server):  # noqa: F811
    cli = cli_answer(q)
    api = api_answer(plain_server.url, q)
    shown = page_answer(page, plain_server.url, q)
    rows = []
    for c, a, s in zip(cli, api, shown, strict=True):
        assert c["stage_name"] == a["stage_name"] == s["stage_name"]
        assert c["fits"] == a["fits"] == s["fits"], (c["stage_name"], c["fits"], a["fits"], s["fits"])
        assert c["total_bytes"] == a["total_bytes"]
        assert math.isclose(s["total_bytes"], a["total_bytes"], rel_tol=1e-12)
        assert s["total_label"] == a["total_label"]
        rows.append(f"{c['stage_name']} {a['total_label']} {'fits' if c['fits'] else 'no'}")
    print(_ids(q), "|", ", ".join(rows))
    assert page.errors == []


def page_comm(page) -> list[dict]:
    """The per-stage communication line the memory panel shows (guide §14)."""
    return page.eval_on_selector_all("#memory small.comm", "els => els.map(e => ({"
                                     "stage_name: e.dataset.stage, intra_bytes: Number(e.dataset.intra),"
                                     "inter_bytes: Number(e.dataset.inter), time_s: Number(e.dataset.time),"
                                     "text: e.textContent}))")


@pytest.mark.parametrize("q", [q for q in QUESTIONS if "shard" in q], ids=lambda q: f"{_ids(q)}-g{q['shard']}")
def test_step_communication_agrees(q, page, plain_server):  # noqa: F811
    """The memory panel's bytes and time per leg are the CLI's (plan memory --shard-size --compress)."""
    cli = cli_json(q)["comm"]
    api = api_json(plain_server.url, "memory", api_params(q))["comm"]
    page_answer(page, plain_server.url, q)
    shown = page_comm(page)
    for c, a, s in zip(cli, api, shown, strict=True):
        assert c["stage_name"] == a["stage_name"] == s["stage_name"]
        for key in ("intra_bytes", "inter_bytes", "time_s"):
            assert c[key] == a[key]
            assert math.isclose(s[key], a[key], rel_tol=1e-12)
        assert a["labels"]["time"] in s["text"] and a["labels"]["intra_bytes"] in s["text"]
        assert c["shard_size"] == q["shard"] and c["wire"] == a["wire"]
    assert page.errors == []


ROOFLINE_QUESTIONS = [
    dict(hardware="H100", n=1024, shard=8, compress="int8"),
    dict(hardware="H800", n=2048, shard=16, compress="bf16-reduce"),
    dict(hardware="A100", n=64, shard=4, compress="int8-params"),
    dict(hardware="H100", n=16384, compress="int8-grads"),
]


@pytest.mark.parametrize("q", ROOFLINE_QUESTIONS, ids=lambda q: f"{q['hardware']}-{q['n']}-{q['compress']}")
def test_roofline_levers_agree(q, page, plain_server):  # noqa: F811
    argv = ["plan", "roofline", "--json", "--hardware", q["hardware"], "--gpus", str(q["n"]),
            "--compress", q["compress"]] + (["--shard-size", str(q["shard"])] if "shard" in q else [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    cli = json.loads(out.getvalue())["threshold"]
    params = dict(hardware=q["hardware"], n=q["n"], compress=q["compress"], shard_size=q.get("shard", ""))
    api = api_json(plain_server.url, "roofline", params)
    assert cli == api["threshold"]
    if not page.url.startswith(plain_server.url):
        page.goto(plain_server.url)
        page.wait_for_function(ALL_READY, timeout=30_000)
    form = "#roofline form"
    page.select_option(f"{form} select[name=hardware]", q["hardware"])
    page.fill(f"{form} input[name=n]", str(q["n"]))
    page.fill(f"{form} input[name=shard_size]", str(q.get("shard", "")))
    page.select_option(f"{form} select[name=compress]", q["compress"])
    page.wait_for_selector("#roofline[aria-busy='false']", timeout=15_000)
    assert page.inner_text("#roofline .error") == ""
    assert math.isclose(float(page.get_attribute("#threshold", "data-value")), cli["threshold_tokens"],
                        rel_tol=1e-12)
    assert page.inner_text("#threshold") == api["labels"]["threshold"]
    assert page.inner_text("#roofline-wire") == api["labels"]["wire"]
    print(q, "threshold", api["labels"]["threshold"], "tokens/GPU, sync bytes/param", api["labels"]["sync"])
    assert page.errors == []


def test_the_70b_case_does_not_fit_anywhere(plain_server):  # noqa: F811
    """The case that used to disagree: all three now say ZeRO-3 does not fit 80 GB."""
    q = QUESTIONS[0]
    zero3 = [s for s in cli_answer(q) if s["stage_name"] == "ZeRO-3"][0]
    assert not zero3["fits"] and zero3["total_bytes"] > 80e9
    assert zero3["model_state_bytes"] < 3e9  # the states alone (2.2 GB) would have "fit"
