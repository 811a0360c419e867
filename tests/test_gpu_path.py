"""The GPU path, as far as a machine without CUDA can check it (guide §13.3): the trace's lazy
resolution of device events (with a fake event class that behaves as CUDA's: a device timeline,
completion, ``elapsed_time`` in float32 milliseconds), the matrix's device option, the device checks,
the CUDA options of the benches, and ``python -m zerodp.bench.gpu_check`` without a GPU."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _matrix
from zerodp.bench import gpu_check
from zerodp.engine.comm import Pending
from zerodp.engine.devices import backend_device_problem, check_devices, shared_gpu_problem
from zerodp.engine.trace import COMM, COMPUTE, DeviceTimer, Recorder

ROOT = Path(__file__).resolve().parent.parent
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


# ---- a fake device: one stream whose position the test sets, completion up to `done` ------------
def f32(x: float) -> float:
    """What cudaEventElapsedTime returns: a float32 (ms)."""
    return struct.unpack("f", struct.pack("f", x))[0]


class FakeDevice:
    def __init__(self):
        self.now = 0.0  # where the current stream's next event will execute (device seconds)
        self.done = 0.0  # every event at or before this time has completed
        self.syncs = 0

    def timer(self) -> DeviceTimer:
        dev = self

        class FakeEvent:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = dev.now

            def query(self):
                return self.t <= dev.done

            def synchronize(self):
                dev.syncs += 1
                dev.done = max(dev.done, self.t)

            def elapsed_time(self, other):
                if not (self.query() and other.query()):
                    raise RuntimeError("device not ready")
                return f32((other.t - self.t) * 1e3)

        def synchronize():
            dev.syncs += 1
            dev.done = dev.now

        return DeviceTimer("cuda:0", event_cls=FakeEvent, synchronize=synchronize)


class HostClock(Recorder):
    """A recorder whose host clock the test sets."""

    host = 100.0

    def clock(self) -> float:
        return self.host


class FakeWork:
    """An NCCL work: wait() makes the current stream wait until the collective is done."""

    def __init__(self, dev: FakeDevice, done_at: float):
        self.dev, self.done_at = dev, done_at

    def wait(self):
        self.dev.now = max(self.dev.now, self.done_at)


def _recorder(**kw):
    dev = FakeDevice()
    dev.now = 5.0  # device clock 5 s ↔ host clock 100 s at the anchor
    return dev, HostClock(0, timer=dev.timer(), **kw)


def _a_step(dev: FakeDevice, rec: HostClock):
    """forward 10 ms on the device (1 ms to enqueue); an AllReduce issued at 5.010 that runs to
    5.060 under backward (5.010-5.045); waited for at 5.045: the stream stalls 15 ms."""
    rec.host = 100.001
    fwd = rec.begin("forward", COMPUTE)  # the first device event: anchors 5.0 ↔ 100.001
    dev.now = 5.010
    rec.host = 100.002
    rec.end(fwd)
    rec.host = 100.003
    coll = rec.begin("all_reduce", COMM, kind="all_reduce", label="bucket 0", bytes=8)
    bwd = rec.begin("backward", COMPUTE)
    dev.now = 5.045
    rec.host = 100.004
    rec.end(bwd)
    pending = Pending(coll, rec, FakeWork(dev, 5.060))
    rec.host = 100.005
    pending.wait()
    rec.host = 100.0051
    return fwd, coll, bwd


def test_device_events_resolve_to_device_times_lazily():
    dev, rec = _recorder()
    fwd, coll, bwd = _a_step(dev, rec)
    assert dev.syncs == 2  # the anchor only: recording never blocks
    assert fwd.args["clock"] == "host" and fwd.duration == pytest.approx(0.001)  # enqueue time until resolved
    dev.done = 5.020  # the forward is done on the device, the rest not yet
    rec.next_step()
    assert dev.syncs == 2, "next_step must not block on the device"
    assert fwd.args["clock"] == "cuda" and coll.args["clock"] == "host" and bwd.args["clock"] == "host"
    assert fwd.start == pytest.approx(100.001, abs=1e-6) and fwd.duration == pytest.approx(0.010, abs=1e-6)
    events = rec.step_events(0)  # a read: blocks until every closed event is resolved
    assert {e.args["clock"] for e in events} == {"cuda"}
    assert coll.start == pytest.approx(100.011, abs=1e-6) and coll.end == pytest.approx(100.061, abs=1e-6)
    assert coll.args["wait_s"] == pytest.approx(0.015, abs=1e-6)  # the stall, not host time (0.1 ms)
    assert bwd.duration == pytest.approx(0.035, abs=1e-6)
    trace = {e["name"]: e for e in rec.chrome_events(0) if e["ph"] == "X"}
    assert trace["all_reduce"]["dur"] == pytest.approx(50_000, abs=1) and trace["all_reduce"]["tid"] == 1
    assert trace["forward"]["ts"] - trace["all_reduce"]["ts"] == pytest.approx(-10_000, abs=1)
    assert rec.to_dicts()[1]["args"]["wait_s"] == pytest.approx(0.015, abs=1e-6)


def test_a_hidden_collective_has_no_wait_and_open_events_wait():
    dev, rec = _recorder()
    ev = rec.begin("all_gather", COMM, kind="all_gather", label="unit 1", bytes=4)
    dev.now = 5.002
    pending = Pending(ev, rec, FakeWork(dev, 5.001))  # done before the stream reaches the wait
    step = rec.begin("step", COMPUTE)  # still open when the trace is read
    pending.wait()
    events = rec.step_events(0)
    assert ev.args["wait_s"] == 0.0 and ev.args["clock"] == "cuda"
    assert step in events and step.end is None and step.args["clock"] == "host"
    dev.now = 5.003
    rec.end(step)
    rec.step_events(0)
    assert step.args["clock"] == "cuda" and step.duration == pytest.approx(0.001, abs=1e-6)


def test_long_runs_keep_microsecond_precision_within_a_step():
    """elapsed_time is float32 ms: offsets of an hour from one anchor are off by up to ~0.1 ms each,
    which would scramble the events of a step; resolving against the nearest earlier resolved event
    keeps the offsets within a step exact, and the whole placement within float32's 1e-7."""
    dev, rec = _recorder(max_events=64, keep_steps=2)
    rec.host = 0.0
    dev.now = 0.0
    rec.begin("warm-up", COMPUTE)  # anchor: device 0 ↔ host 0; never closed
    step_s, gap = 3.6001234567, 0.0123456
    for i in range(1, 1001):
        dev.now = i * step_s
        a = rec.begin("forward", COMPUTE)
        dev.now += 0.001
        rec.end(a)
        dev.now = i * step_s + gap
        b = rec.begin("all_reduce", COMM, kind="all_reduce")
        dev.now += 0.002
        rec.end(b)
        dev.done = dev.now
        rec.next_step()
    t_a, t_b = 1000 * step_s, 1000 * step_s + gap
    naive = (f32(t_b * 1e3) - f32(t_a * 1e3)) / 1e3  # both from the anchor
    assert abs(naive - gap) > 2e-5, "the test's premise: long offsets lose precision"
    assert b.start - a.start == pytest.approx(gap, abs=1e-6)
    assert a.start == pytest.approx(t_a, rel=1e-7) and a.duration == pytest.approx(0.001, abs=1e-6)
    assert b.duration == pytest.approx(0.002, abs=1e-6)
    assert len(rec._refs) <= 257 and list(rec._marks) == [next(iter(rec._marks))]  # only the open one


def test_unread_events_stay_bounded():
    dev, rec = _recorder(max_events=8)
    for _ in range(50):
        rec.end(rec.begin("forward", COMPUTE))  # never completes on the device, never read
    assert len(rec._marks) <= 8 and len(rec.events) == 8


def test_disabled_recorder_records_no_device_events():
    dev, rec = _recorder(enabled=False)
    ev = rec.begin("forward", COMPUTE)
    rec.end(ev)
    assert dev.syncs == 0 and not rec._marks and not rec.events


def test_cpu_recorder_keeps_the_host_clock():
    rec = HostClock(0)
    assert rec.timer is None and rec.clock_name == "host"  # no process group: host clock
    rec.host = 1.0
    ev = rec.begin("all_reduce", COMM, kind="all_reduce")
    mark = rec.mark()
    rec.host = 1.25
    rec.end_wait(ev, mark)
    assert ev.args == {"kind": "all_reduce", "wait_s": 0.25} and ev.end == 1.25 and not rec._marks
    with pytest.raises(ValueError, match="unsupported device"):
        rec.set_device("tpu")


# ---- the matrix's device option --------------------------------------------------------------
def test_matrix_device_defaults_to_cpu(monkeypatch):
    monkeypatch.delenv(_matrix.DEVICE_ENV, raising=False)
    assert _matrix.matrix_device(1) == torch.device("cpu") and _matrix.matrix_backend() == "gloo"
    monkeypatch.setenv(_matrix.DEVICE_ENV, "cuda")
    assert _matrix.matrix_device(1) == torch.device("cuda", 1) and _matrix.matrix_backend() == "nccl"
    assert _matrix.matrix_device(1, "cpu") == torch.device("cpu")
    monkeypatch.setenv(_matrix.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="use cpu or cuda"):
        _matrix.matrix_device(0)


@pytest.mark.parametrize("n", (1, 2, 4))
def test_gpu_matrix_cases_fit_the_gpus(n):
    cases = gpu_check.gpu_cases(_matrix, n)
    assert cases and all(c.ranks_needed <= n for c in cases)
    assert {c.stage for c in cases} == {0, 1, 2, 3}
    assert {c.usage for c in cases} >= set(_matrix.USAGES) - {"reshard"}
    assert any(c.usage == "reshard" for c in cases) == (n >= 2)


# ---- device checks ---------------------------------------------------------------------------
def test_backend_device_problems():
    assert "needs NCCL" in backend_device_problem("cuda", "gloo")
    assert backend_device_problem("cuda", "nccl") is None
    assert backend_device_problem("cuda", "cpu:gloo,cuda:nccl") is None
    assert "uses NCCL" in backend_device_problem("cpu", "nccl")
    assert backend_device_problem("cpu", "cpu:gloo,cuda:nccl") is None
    assert backend_device_problem("cpu", "gloo") is None


def test_every_rank_on_cuda0_is_refused():
    assert "set_device" in shared_gpu_problem(0, 1, 2, 2)
    assert shared_gpu_problem(1, 1, 2, 2) is None
    assert shared_gpu_problem(0, 1, 2, 1) is None  # one GPU visible per rank (CUDA_VISIBLE_DEVICES)
    assert shared_gpu_problem(0, None, None, 8) is None  # not launched with LOCAL_RANK
    with pytest.raises(ValueError, match="local rank 1 of 2"):
        check_devices(torch.device("cuda", 0), backend="nccl", env={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                      device_count=2)
    with pytest.raises(ValueError, match="needs NCCL"):
        check_devices(torch.device("cuda", 0), backend="gloo", env={}, device_count=1)
    check_devices(torch.device("cpu"), backend="gloo")


# ---- the benches' CUDA options, without CUDA -------------------------------------------------
def test_bench_spec_device():
    from zerodp.bench.spec import BenchSpec, Device

    assert BenchSpec().device is Device.CPU and BenchSpec(device="cuda", world_size=1).device is Device.CUDA
    with pytest.raises(ValueError, match=">= 2"):
        BenchSpec(world_size=1)
    assert BenchSpec(world_size=1, device="cuda").world_size == 1
    with pytest.raises(ValueError, match="device must be one of"):
        BenchSpec(device="tpu")


@no_cuda
def test_memory_bench_refuses_cuda_without_gpus():
    from zerodp.bench.memory import run

    with pytest.raises(ValueError, match="needs 1 GPUs, 0 visible"):
        run(1, "nano", "cuda")


# ---- gpu_check ---------------------------------------------------------------------------------
@no_cuda
def test_gpu_check_without_gpu_prints_one_line_and_runs_nothing(tmp_path):
    out = tmp_path / "gpu.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "zerodp.bench.gpu_check", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("\n") == 1 and p.stdout.startswith("gpu-check: no CUDA GPU present")
    assert "matrix" in p.stdout and "docs/gpu.md" in p.stdout and not out.exists()


def test_gpu_check_refuses_an_unknown_phase(capsys):
    assert gpu_check.main(["--phases", "matrix,warp"]) == 2
    assert "unknown phases ['warp']" in capsys.readouterr().err


def test_gpu_report_has_the_command_and_every_phase(tmp_path):
    phases = [gpu_check.Phase("matrix", True, 12.0, ["| stage | cases | failed |"]),
              gpu_check.Phase("bench", False, 3.0, [], "RankFailure: 1 of 1 ranks failed:\n--- rank 0 ---\nTraceback"),
              gpu_check.Phase("trace", True, 0.0, skipped="not asked for")]
    run = gpu_check.Setup("cuda", 1, "small")
    path = gpu_check.write_report(tmp_path / "gpu.md", run, phases, 15.0, ["- GPUs: 1 × test"])
    text = path.read_text()
    assert "make gpu-check" in text and "| matrix | ok | 12 |" in text and "| bench | FAILED | 3 |" in text
    assert "| trace | not run: not asked for | 0 |" in text and "Not run: not asked for" in text
    assert "--- rank 0 ---\nTraceback" in text and "| stage | cases | failed |" in text  # the whole error
    assert "collectives between ranks" in text  # world 1 says what it cannot check


def test_error_text_keeps_every_rank_and_its_end():
    from zerodp.spawn import RankFailure

    ranks = "\n".join(f"--- rank {r} ---\nTraceback\n" + "  frame\n" * 400 + f"ValueError: rank {r} broke"
                      for r in range(2))
    text = gpu_check.error_text(RankFailure(f"2 of 2 ranks failed:\n{ranks}"), limit=2000)
    assert len(text) < 2100 and text.startswith("RankFailure: 2 of 2 ranks failed:\n--- rank 0 ---")
    assert text.endswith("ValueError: rank 1 broke") and "characters left out" in text
    short = gpu_check.error_text(RuntimeError("one\ntwo"))
    assert short == "RuntimeError: one\ntwo"


def test_cpu_run_never_writes_docs_gpu_md_by_default():
    assert gpu_check.DEFAULT_CPU_OUT != gpu_check.DEFAULT_OUT and gpu_check.DEFAULT_CPU_OUT.parent.name == "out"


def test_cpu_cases_cover_every_stage_with_a_bf16_case():
    cases = gpu_check.cpu_cases(_matrix, 2)
    assert sorted(c.stage for c in cases) == [0, 1, 2, 3] and all(c.ranks_needed <= 2 for c in cases)
    assert any(c.usage == "bf16" for c in cases) and len({c.usage for c in cases}) == len(cases)


# ---- the memory phase's checks, on figures given by hand ----------------------------------------
def _row(stage=0, acc=False, psi=1000, world=2, **kw):
    from zerodp.engine.stats import formula_by_kind

    f = formula_by_kind(stage, psi, world, acc)
    gap = 2 * psi // world if acc and stage >= 2 else 0
    memory = {"params": int(f["params"]), "grads": int(f["grads"]) - gap, "master": int(f["master"]),
              "optimizer_states": int(f["optimizer_states"]) + 4, "gathered": 0, "comm_buffers": 4096}
    stats = {"stage": stage, "rank": 0, "world_size": world, "num_params": psi, "param_dtype": "bfloat16",
             "step": 1, "memory": memory, "layout": {"padding": 0}}
    held = {"kinds": {}, "engine": 9000, "outside": 0, "buffers": 0, "placeholders": 40, "batch": 512,
            "blocks": 5, "scalar_states": 4}
    return {"stage": stage, "fp32_accum": acc, "stats": stats, "held": held, "alive_before": [], **kw}


@pytest.mark.parametrize("stage,acc", [(0, False), (2, True), (3, True)])
def test_memory_checks_hold_and_a_skewed_figure_fails(stage, acc):
    from zerodp.bench.memory import evaluate, row_ok

    row = _row(stage, acc)
    checks = evaluate(row, 2, "nano", cuda=False)
    assert row_ok(checks) and [c.ok for c in checks][-2:] == [None, None]  # the allocator's: CUDA only
    for side in ("engine", "formula"):
        bad = {c.name: c.ok for c in evaluate(row, 2, "nano", cuda=False, skew=(side, 1.0))}
        assert bad["engine vs planner"] is False, side


def test_memory_checks_catch_leftovers_and_outside_bytes():
    from zerodp.bench.memory import evaluate

    row = _row(alive_before=["GPT"])
    row["held"]["outside"] = 41  # more than one element per parameter
    got = {c.name: c.ok for c in evaluate(row, 2, "nano", cuda=False)}
    assert got["clean"] is False and got["outside the engine"] is False


def test_memory_checks_on_cuda_figures():
    """The allocator's bounds (CUDA only) on figures given by hand: at rest the held bytes plus the
    rounding; the peak between the engine's model states + batch and the planner's total."""
    from zerodp.bench.memory import ALLOC_ROUND, evaluate

    held = 9000 + 512
    states = sum(_row()["stats"]["memory"][k] for k in ("params", "grads", "master", "optimizer_states"))
    for at_rest, peak, ok_rest, ok_peak in [(held + 100, states + 600, True, True),
                                            (held - 1, states + 600, False, True),
                                            (held + ALLOC_ROUND * 64, states + 600, False, True),
                                            (held, states, True, False),
                                            (held, 10 ** 9, True, False)]:
        got = {c.name: c.ok for c in evaluate(_row(at_rest=at_rest, peak=peak, leftover=0), 2, "nano", cuda=True)}
        assert (got["allocator at rest"], got["allocator peak"]) == (ok_rest, ok_peak), (at_rest, peak)
        assert got["clean"] is True
    got = {c.name: c.ok for c in evaluate(_row(at_rest=held, peak=states + 600, leftover=512), 2, "nano", cuda=True)}
    assert got["clean"] is False


def test_memory_skew_is_parsed():
    from zerodp.bench.memory import parse_skew

    assert parse_skew("engine:5") == ("engine", 5.0) and parse_skew(None) is None
    with pytest.raises(ValueError, match="engine:PCT"):
        parse_skew("allocator:5")


# ---- the whole harness on CPU (gloo), as make test runs it ---------------------------------------
def _gpu_check_cpu(tmp_path, *extra):
    out = tmp_path / "report.md"
    p = subprocess.run([sys.executable, "-m", "zerodp.bench.gpu_check", "--device", "cpu", "--out", str(out), *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=400)
    return p, (out.read_text() if out.exists() else "")


@pytest.mark.dist
def test_gpu_check_on_cpu_runs_every_phase(tmp_path):
    p, text = _gpu_check_cpu(tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert f"torch {torch.__version__}, backend gloo" in p.stdout and "not checked here:" in p.stdout
    for name in gpu_check.PHASES:
        assert f"| {name} | ok |" in text, name
    assert "| all | 4 | 0 |" in text  # the matrix: one case per stage, none failed
    assert "expected the host clock only" not in text and "| 3 |" in text  # the trace, every stage
    assert "Bounds, per row:" in text and "residual +" in text and "(bound 0…" in text  # the memory ledger
    assert text.count("| ok |") >= 8 + 4  # eight memory rows, four phases
    assert "not on CPU: no allocator counter" in text and "Not checked by this run:" in text
    assert "zerodp stage 3" in text and "FSDP" in text  # the bench, both groups


@pytest.mark.dist
def test_a_wrong_memory_figure_fails_the_memory_phase(tmp_path):
    p, text = _gpu_check_cpu(tmp_path, "--phases", "memory", "--memory-skew", "engine:5")
    assert p.returncode == 1, p.stdout[-4000:] + p.stderr[-4000:]
    assert "phase 1/1 memory: FAILED" in p.stdout and "| memory | FAILED |" in text
    assert "Test seam on" in text and "engine vs planner: engine" in text
