"""The web API over HTTP: every endpoint answers from the planner, bad input gets 422 + a message.

Expected figures are the guide's (guide §9.4 and the sections it draws on), not re-derived from the code under test.
"""

import json
import math
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlencode

import pytest

from zerodp.cli import build_parser, main
from zerodp.engine.trace import COMM, Recorder, write_chrome_trace
from zerodp.ui.server import make_server, serve_in_thread


def fetch(srv, path, **params):
    """(status, decoded body) of a GET; ``params`` become the query string."""
    url = srv.url.rstrip("/") + path + ("?" + urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            status, body, ctype = r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as err:
        status, body, ctype = err.code, err.read(), err.headers["Content-Type"]
    return status, (json.loads(body) if ctype == "application/json" else body)


def test_memory_defaults_are_the_zero_paper_example(server):
    status, d = fetch(server, "/api/memory")
    assert status == 200
    assert d["model"]["params"] == 7.5e9
    by_stage = {s["stage_name"]: s for s in d["stages"]}
    assert [by_stage[s]["label"] for s in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")] == \
        ["120 GB", "31.4 GB", "16.6 GB", "1.88 GB"]
    assert by_stage["DP"]["model_state_bytes"] == pytest.approx(120e9)
    assert by_stage["ZeRO-3"]["model_state_bytes"] == pytest.approx(1.875e9)
    assert d["hbm_bytes"] == 80e9 and d["activations"] is None
    assert not by_stage["DP"]["fits"] and by_stage["ZeRO-1"]["fits"]


def test_memory_custom_model_fp32_accumulation_and_activations(server):
    # guide §9.4: 70B on 64 GPUs with ZeRO-2 still needs more than 140 GB
    _, d = fetch(server, "/api/memory", model="custom", params="70G", n=64)
    assert d["stages"][2]["model_state_bytes"] > 140e9
    _, acc = fetch(server, "/api/memory", fp32_grad_acc="true")
    assert acc["stages"][0]["grad_acc_bytes"] == pytest.approx(4 * 7.5e9)  # +4Ψ for DP
    _, shaped = fetch(server, "/api/memory", model="llama3-8b", seq=4096, micro_batch=1)
    assert shaped["activations"]["total_bytes"] > 0
    assert shaped["stages"][3]["gathered_unit_bytes"] > 0  # ZeRO-3 holds two gathered units
    curve = shaped["curve"]
    assert 64 in curve["n"] and len(curve["bytes"]["ZeRO-3"]) == len(curve["n"])


def test_overlap_bucket_regimes(server):
    # guide §4: tiny buckets → latency dominates; huge → last bucket exposed; a sweet spot between
    exposed = {}
    for size in (50e3, 25e6, 10e9):
        status, d = fetch(server, "/api/overlap", bucket_bytes=size)
        assert status == 200
        exposed[size] = d["timeline"]["exposed_comm_s"]
    assert exposed[50e3] > 3 * exposed[25e6] and exposed[10e9] > 3 * exposed[25e6]
    assert d["model"] == "llama3-8b" and d["timeline"]["num_buckets"] <= 2
    sweep = d["sweep"]["points"]
    assert sweep[0]["bucket_bytes"] <= 1e5 and sweep[-1]["bucket_bytes"] >= 1e9
    # few tokens per GPU: the backward is short, no bucket size hides the communication
    _, few = fetch(server, "/api/overlap", tokens_per_gpu=256)
    assert few["sweep"]["best_exposed_comm_s"] > few["sweep"]["backward_s"]


def test_overlap_timeline_is_drawable(server):
    _, d = fetch(server, "/api/overlap", bucket_bytes="25MB")
    t = d["timeline"]
    assert t["num_buckets"] == len(t["buckets"]) > 100  # 16 GB in 25 MB buckets, listed one by one
    assert t["compute"][0]["start_s"] == 0 and t["compute"][-1]["end_s"] == pytest.approx(t["backward_s"])
    _, tiny = fetch(server, "/api/overlap", bucket_bytes="10kB")
    assert tiny["timeline"]["num_buckets"] > 1000 and tiny["timeline"]["buckets"] == []  # runs instead
    assert sum(r["count"] for r in tiny["timeline"]["runs"]) == tiny["timeline"]["num_buckets"]


def test_roofline_seed_numbers(server):
    _, d = fetch(server, "/api/roofline", hardware="H100", n="")  # empty: at scale
    assert d["threshold"]["threshold_tokens"] == pytest.approx(2475, rel=0.01)
    assert d["threshold"]["min_batch_tokens"] is None and d["nodes"] is None
    _, llama = fetch(server, "/api/roofline", hardware="H100", n=16384, batch_tokens="16M")
    assert llama["nodes"] == 2048
    assert llama["threshold"]["min_batch_tokens"] == pytest.approx(40e6, rel=0.03)
    assert llama["max_devices"]["max_devices"] < 16384  # 16M tokens cannot keep 16K GPUs busy
    _, two_nodes = fetch(server, "/api/roofline", hardware="h100", n=16)
    assert two_nodes["threshold"]["threshold_tokens"] == pytest.approx(1900, rel=0.03)
    assert two_nodes["threshold"]["bottleneck"] == "intra"
    _, moe = fetch(server, "/api/roofline", hardware="H800", n="", experts=256, experts_per_token=8)
    assert moe["threshold"]["threshold_tokens"] == pytest.approx(138e3, rel=0.02)
    _, tpu = fetch(server, "/api/roofline", hardware="TPU v5p", n=8960, axes=3)
    assert tpu["threshold"]["min_batch_tokens"] == pytest.approx(7.6e6, rel=0.02)
    assert max(tpu["curve"]["n"]) == 8960  # one ICI domain: the curve stops at the pod


def test_batch_seed_example(server):
    _, d = fetch(server, "/api/batch")
    assert (d["plan"]["samples"], d["plan"]["grad_acc"], d["plan"]["gpu_rich"]) == (1024, 4, False)
    _, more = fetch(server, "/api/batch", dp=512)
    assert more["plan"]["grad_acc"] == 1
    _, rich = fetch(server, "/api/batch", dp=4096)
    assert rich["plan"]["gpu_rich"] and rich["plan"]["warnings"]
    i = d["sweep"]["dp"].index(128)
    assert d["sweep"]["grad_acc"][i] == 4 and d["sweep"]["gpu_rich"][-1]


def test_schema_presets_and_static_files(server):
    _, schema = fetch(server, "/api/schema")
    assert set(schema) >= {"memory", "overlap", "roofline", "batch"}
    defaults = {p["name"]: p["default"] for p in schema["memory"]["params"]}
    assert (defaults["k"], defaults["precision"], defaults["n"], defaults["model"]) == \
        (None, "bf16", 64, "zero-7.5b")  # k empty: the precision's own (12 for bf16)
    assert all(p["label"] and p["expected"] for e in schema.values() for p in e["params"])
    _, presets = fetch(server, "/api/presets")
    assert {"H100", "TPU v5p"} <= {h["name"] for h in presets["hardware"]}
    assert "llama3-8b" in {m["name"] for m in presets["models"]}
    assert fetch(server, "/api/measured")[1] == {"available": False, "profile": None, "trace": None}
    status, page = fetch(server, "/")
    assert status == 200 and b'src="/plotly.min.js"' in page
    assert not re.search(rb'(src|href)="(https?:)?//', page)  # nothing from elsewhere
    status, js = fetch(server, "/plotly.min.js")
    assert status == 200 and len(js) > 1_000_000
    assert fetch(server, "/static/app.js")[0] == 200
    assert fetch(server, "/static/../server.py")[0] == 404
    assert fetch(server, "/api/nothing")[0] == 404


@pytest.mark.parametrize("endpoint, params, field", [
    ("memory", {"n": 0}, "n"),
    ("memory", {"n": -4}, "n"),
    ("memory", {"model": "custom", "params": -7.5e9}, "params"),
    ("memory", {"k": "twelve"}, "k"),
    ("memory", {"n": "1e30"}, "n"),
    ("memory", {"seq": 0}, "seq"),
    ("memory", {"micro_batch": 4}, "seq"),  # would change nothing without seq
    ("memory", {"recompute": "full"}, "seq"),
    ("memory", {"model": "zero-7.5b", "seq": 4096}, "seq"),  # no shape for activations
    ("memory", {"model": "llama3-8b", "layers": 4}, "layers"),  # a preset fixes the shape
    ("memory", {"model": "custom", "config": "{not json"}, "config"),
    ("memory", {"model": "custom", "config": "{}"}, "config"),
    ("memory", {"model": "custom"}, "params"),
    ("memory", {"precision": "fp32", "fp32_grad_acc": "true"}, "fp32_grad_acc"),
    ("memory", {"precision": "int4"}, "precision"),
    ("memory", {"k": 1000}, "k"),
    ("overlap", {"bucket_bytes": 1000}, "bucket_bytes"),  # 16 million buckets: over the cap
    ("overlap", {"bucket_bytes": "1B"}, "bucket_bytes"),
    ("memory", {"model": "gpt-9"}, "model"),
    ("memory", {"hardware": "Z100"}, "hardware"),
    ("memory", {"fp32_grad_acc": "maybe"}, "fp32_grad_acc"),
    ("overlap", {"bucket_bytes": -1}, "bucket_bytes"),
    ("overlap", {"bucket_bytes": 0}, "bucket_bytes"),
    ("overlap", {"tokens_per_gpu": "-256"}, "tokens_per_gpu"),
    ("overlap", {"bandwidth": "0"}, "bandwidth"),
    ("overlap", {"n": 1}, "n"),
    ("overlap", {"model": "zero-7.5b"}, "model"),  # no transformer shape to simulate
    ("overlap", {"collective": "broadcast"}, "collective"),
    ("roofline", {"n": 0}, "n"),
    ("roofline", {"hardware": "/etc/passwd"}, "hardware"),  # names only, never a file
    ("roofline", {"hardware": "TPU v5p", "axes": 4}, "axes"),
    ("roofline", {"experts": 4, "experts_per_token": 8}, "experts_per_token"),
    ("roofline", {"batch_tokens": "-16M"}, "batch_tokens"),
    ("roofline", {"hardware": "TPU v5p", "n": 20000}, "n"),  # beyond one pod, no network
    ("batch", {"dp": 0}, "dp"),
    ("batch", {"seq": 2.5}, "seq"),
    ("batch", {"target_tokens": 100, "seq": 4096}, "target_tokens"),
    ("batch", {"micro_batch": -2}, "micro_batch"),
    ("batch", {"gbs": 1}, "gbs"),  # unknown parameter
])
def test_bad_input_is_422_naming_the_field(server, endpoint, params, field):
    status, d = fetch(server, f"/api/{endpoint}", **params)
    assert status == 422, d
    assert d["field"] == field, d
    assert field in d["error"] and len(d["error"]) > len(field) + 10, d


def test_measured_trace_and_profile(tmp_path):
    # two ranks recorded by the engine's own Recorder, written as `zerodp train --trace` does
    events = []
    for rank in (0, 1):
        rec = Recorder(rank=rank)
        with rec.span("backward"):
            comm = rec.begin("all_reduce", COMM, bytes=4096, label="bucket 0")
        time.sleep(0.002)
        rec.end(comm)
        events += rec.chrome_events()
    trace = write_chrome_trace(tmp_path / "trace.json", events)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"hardware": {
        "name": "calibrated-box", "flops": 1e11, "hbm_bytes": 16e9, "intra_bw": 2e9,
        "devices_per_node": 2, "alpha": 5e-5}, "calibration": {}}))
    srv = make_server(port=0, profile=str(profile), trace=trace)
    serve_in_thread(srv)
    try:
        _, m = fetch(srv, "/api/measured")
        spans = m["trace"]["spans"]
        assert [(s["rank"], s["lane"], s["name"]) for s in spans] == [
            (r, lane, name) for r in (0, 1) for lane, name in (("comm", "all_reduce"), ("compute", "backward"))]
        for comm, backward in (spans[:2], spans[2:]):
            assert backward["start_s"] == 0 and comm["start_s"] < backward["end_s"] < comm["end_s"]
            assert comm["end_s"] - backward["end_s"] >= 0.002  # the exposed tail, as recorded
            assert comm["args"]["label"] == "bucket 0"
        assert m["profile"]["hardware"]["name"] == "calibrated-box"
        # the calibrated machine is simulated by default, with its own α′ and bandwidth
        _, schema = fetch(srv, "/api/schema")
        defaults = {p["name"]: p["default"] for p in schema["overlap"]["params"]}
        assert defaults["hardware"] == "calibrated-box" and defaults["bandwidth"] == 2e9
        assert math.isclose(defaults["latency"], 2 * (2 - 1) * 5e-5)
        status, d = fetch(srv, "/api/overlap")
        assert status == 200 and d["hardware"] == "calibrated-box"
    finally:
        srv.shutdown()
        srv.server_close()


def test_cli_prints_the_url_and_serves():
    # python -m zerodp.ui is `zerodp ui` without importing the other subcommands (and torch)
    proc = subprocess.Popen([sys.executable, "-m", "zerodp.ui", "--port", "0", "--no-open"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert url, line + proc.stderr.read()
        with urllib.request.urlopen(url.group(0) + "api/batch?dp=512", timeout=30) as r:
            assert json.loads(r.read())["plan"]["grad_acc"] == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_zerodp_ui_subcommand(tmp_path, capsys):
    args = build_parser().parse_args(["ui"])
    assert (args.host, args.open_browser, args.profile, args.trace) == ("127.0.0.1", False, None, None)
    assert main(["ui", "--port", "0", "--trace", str(tmp_path / "nope.json")]) == 2
    assert "zerodp train --trace" in capsys.readouterr().err
    assert main(["ui", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint, params", [
    ("memory", {"micro_batch": 4}),
    ("memory", {"model": "zero-7.5b", "seq": 4096}),
    ("memory", {"precision": "fp32", "fp32_grad_acc": "true"}),
    ("memory", {"n": "1e30"}),
    ("overlap", {"bucket_bytes": 1000}),
    ("roofline", {"experts": 4, "experts_per_token": 8}),
    ("roofline", {"hardware": "TPU v5p", "n": 20000}),
    ("batch", {"target_tokens": 100, "seq": 4096}),
    ("batch", {"target_tokens": "1e15", "seq": 1, "micro_batch": 1, "dp": 1}),
])
def test_refusals_come_in_chinese_too(server, endpoint, params):
    status, d = fetch(server, f"/api/{endpoint}", **params)
    assert status == 422
    zh = d["error_zh"]
    assert re.search(r"[\u4e00-\u9fff]", zh) and "输入无法计算" not in zh, zh  # a real sentence


@pytest.mark.parametrize("argv, endpoint, params, rename", [
    (["plan", "memory", "--seq-len", "0"], "memory", {"seq": "0"}, ("seq-len", "seq")),
    (["plan", "memory", "--k", "1000"], "memory", {"k": "1000"}, None),
    (["plan", "memory", "--gpus", "1e30"], "memory", {"n": "1e30"}, ("gpus", "n")),
    (["plan", "batch", "--global-batch-tokens", "4M", "--seq-len", "0", "--micro-batch", "1",
      "--gpus", "8"], "batch", {"seq": "0"}, ("seq-len", "seq")),
    (["plan", "memory", "--model", "llama3-8b", "--mbs", "4"], "memory",
     {"model": "llama3-8b", "micro_batch": "4"}, None),
    (["plan", "simulate", "--bucket", "1000"], "overlap", {"bucket_bytes": "1000"}, None),
])
def test_the_cli_and_the_api_refuse_with_the_same_sentence(server, capsys, argv, endpoint, params,
                                                           rename):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    sentence = re.sub(r"^zerodp [a-z ]+: error: (argument --[a-z-]+: )?", "", err)
    sentence = re.sub(r" \(see zerodp [a-z ]+ -h\)$", "", sentence)
    status, d = fetch(server, f"/api/{endpoint}", **params)
    assert status == 422
    expected = d["error"] if rename is None else d["error"].replace(rename[1], rename[0], 1)
    assert sentence == expected


def test_roofline_pairs_are_the_clis_strings(capsys):
    """The page showed 0.4998 where the rest of the planner rounds to three digits: one formatter
    (plan.roofline.labels) now writes both."""
    from zerodp.cli import main
    from zerodp.ui.api import Api

    d = Api().handle("roofline", {"hardware": "H100", "n": "16384"})
    assert d["labels"]["sync"] == "3.5, 0.5"
    assert main(["plan", "roofline", "--hardware", "H100", "--gpus", "16384"]) == 0
    out = capsys.readouterr().out
    assert f"{d['labels']['sync']}  B" in out and f"{d['labels']['wire']}  B" in out


def test_recommend_endpoint_gives_the_clis_table():
    from zerodp.plan.recommend import recommend, text
    from zerodp.ui.api import Api

    d = Api().handle("recommend", {"nodes": "2", "gpus_per_node": "8", "seq": "4096"})
    r = recommend("llama3-8b", "H100", nodes=2, gpus_per_node=8, global_batch_tokens=4 * 2**20, seq=4096)
    assert d["rows"][0][-1] == "first pick: fastest" and len(d["rows"]) == len(r.candidates)
    assert d["text"].split("\nsearched in")[0] == text(r).split("\nsearched in")[0]
    assert d["columns"][0] == "#" and d["candidates"][0]["stage"] == r.best.stage
