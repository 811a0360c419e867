"""`zerodp plan ...`: the guide's numbers through --json, tables, plots, hardware files, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from zerodp.cli import main


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_json_zero_paper(capsys):
    d = run_json(capsys, "memory", "--params", "7.5e9", "--gpus", "64")
    got = [s["model_state_bytes"] / 1e9 for s in d["stages"]]
    assert [round(got[0]), round(got[1], 1), round(got[2], 1), round(got[3], 2)] == [120, 31.4, 16.6, 1.88]


def test_comm_json_62ms(capsys):
    d = run_json(capsys, "comm", "--bytes", "16e9", "--gpus", "8", "--collective", "all_reduce")
    assert d["results"][0]["bandwidth_s"] * 1e3 == pytest.approx(62, abs=0.5)


def test_roofline_json_thresholds(capsys):
    assert run_json(capsys, "roofline", "--hardware", "H100")["threshold"]["threshold_tokens"] == pytest.approx(2475)
    tpu = run_json(capsys, "roofline", "--hardware", "tpu-v5p", "--axes", "3", "--gpus", "8960",
                   "--batch-tokens", str(9216 * 4096))
    assert tpu["threshold"]["threshold_tokens"] == pytest.approx(850, rel=1e-3)
    assert round(tpu["threshold"]["min_batch_tokens"] / 1e6, 1) == 7.6
    assert tpu["max_devices"]["max_devices"] == pytest.approx(44_000, rel=0.015)
    moe = run_json(capsys, "roofline", "--hardware", "H800", "--model", "deepseek-v3")
    assert moe["threshold"]["threshold_tokens"] == pytest.approx(138_000, rel=0.01)


def test_batch_json(capsys):
    d = run_json(capsys, "batch", "--tokens", "4Mi", "--seq", "4096", "--mbs", "2", "--gpus", "128")
    assert (d["samples"], d["grad_acc"]) == (1024, 4)


def test_report_json_and_text(capsys):
    d = run_json(capsys, "report")
    rows = {r["key"]: r for r in d["rows"]}
    assert rows["min_batch_llama3_405b"]["value"] / 1e6 == pytest.approx(40, rel=0.02)
    assert main(["plan", "report"]) == 0
    out = capsys.readouterr().out
    assert "31.4 GB" in out and "2,475" in out and "bucket demo" in out


def test_tables_have_units(capsys):
    for argv, unit in [(["memory", "--model", "llama3-8b", "--seq", "4096"], "GB"),
                       (["comm", "--bytes", "25MB"], "µs"), (["roofline"], "tokens/device"),
                       (["simulate", "--sweep"], "ms")]:
        assert main(["plan", *argv]) == 0
        assert unit in capsys.readouterr().out


def test_simulate_plot_and_fsdp(tmp_path, capsys):
    png = tmp_path / "t.png"
    d = run_json(capsys, "simulate", "--model", "llama3-8b", "--gpus", "8", "--bucket", "25MB",
                 "--plot", str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert d["timeline"]["num_buckets"] > 100 and len(d["sweep"]["points"]) > 10
    f = run_json(capsys, "simulate", "--fsdp", "--params", "1e9", "--layers", "8")
    assert f["fsdp"]["num_allgathers"] == 15


def test_hardware_files(tmp_path, capsys):
    toml = tmp_path / "hw.toml"
    toml.write_text('name = "lab"\nflops = 1e12\nhbm_bytes = "16GB"\nintra_bw = 1e10\n'
                    'devices_per_node = 4\ninter_bw = 5e9\nsmall_message_latency = 6e-5\n')
    d = run_json(capsys, "roofline", "--hardware", str(toml))
    assert d["threshold"]["threshold_tokens"] == pytest.approx(1e12 / 5e9)
    js = tmp_path / "hw.json"
    js.write_text(json.dumps({"name": "lab2", "flops": 1e12, "hbm_bytes": 1e10, "intra_bw": 1e10,
                              "devices_per_node": 4, "alpha": 1e-5}))
    d = run_json(capsys, "comm", "--bytes", "0", "--gpus", "4", "--hardware", str(js))
    assert d["results"][0]["latency_s"] == pytest.approx(6e-5)  # 2(N−1)α


@pytest.mark.parametrize("argv, needle", [
    (["roofline", "--hardware", "H101"], "H100, H100 96GB, H800"),
    (["memory", "--model", "llama9"], "llama3-8b"),
    (["memory", "--params", "-5"], "--params: params must be between 1 and 1,000T"),
    (["comm", "--bytes", "1e6", "--gpus", "0"], "gpus must be between 1 and 1,000,000"),
    (["roofline", "--hardware", "missing.toml"], "not found"),
    (["roofline", "--hardware", "TPU v5p", "--gpus", "9000"], "no inter-node network"),
])
def test_errors_are_one_line(capsys, argv, needle):
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own errors exit as argparse does, with one line
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_bad_quantity_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "comm", "--bytes", "lots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "cannot read bytes" in err and err.count("\n") == 1 and "usage:" not in err


def test_console_script_subprocess():
    exe = os.path.join(os.path.dirname(sys.executable), "zerodp")
    out = subprocess.run([exe, "plan", "batch", "--tokens", "4Mi", "--seq", "4096", "--mbs", "2",
                          "--gpus", "512", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["grad_acc"] == 1


def test_simulate_names_its_units(capsys):
    """A 32-layer model is "32 blocks + embedding + head", not "34 layers"."""
    assert main(["plan", "simulate", "--config", "tests/data/llama-3.1-8b/config.json"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "32 blocks + embedding + head" in head and "34" not in head, head


@pytest.mark.parametrize("command", ["comm", "roofline", "batch", "simulate", "memory", "recommend"])
def test_every_plan_command_has_a_description(capsys, command):
    with pytest.raises(SystemExit):
        main(["plan", command, "-h"])
    out = capsys.readouterr().out
    body = out.split("\n\n")[1]  # after the usage block: the description
    assert not body.startswith(("options:", "optional arguments:")) and len(body) > 80, out[:600]
