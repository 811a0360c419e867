"""Calls made on some ranks only (guide §12.9, docs/porting.md): served where well defined, else
every rank ends, named, and exits.

Each case runs two gloo ranks as a script under torchrun would: rank 0 makes a call alone while
rank 1 trains on. DDP's habit — ``if rank == 0: torch.save({"model": model.state_dict(),
"optimizer": optimizer.state_dict()})`` — is served at every stage: rank 0 gets the same dicts
as a call on every rank, rank 1 serves them from inside its next step's collectives, and both
train on exactly as without the checkpoint. A call that cannot be served (a load, a gradient norm,
a stage-3 evaluation) makes every rank raise the engine's one-line message — naming the call and
its fix — within seconds (an announced call) or about ``timeout_s`` (a per-step one), and every
process exits within seconds of it: no hang, no backend abort with a generic message, no pairing
with the other rank's collectives, no process held at exit by its process group's destructor.

Two pairs of spawned ranks run the cases one after another, each case on a process group of its
own (the groups of a case that failed are left as the engine left them), and end as a script ends
after their last case (an exception that is not caught, no ``destroy_process_group``); the time
from each rank's last message to its process's exit is watched from here with a wall-clock limit.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import zerodp
from _engine_common import Net, once, regression_batch, same_state, shard
from zerodp.spawn import free_port

pytestmark = pytest.mark.dist

TIMEOUT_S = 3.0  # the engine's timeout_s in every case
WORLD = 2
ROWS = 4
LIMIT_S = 150.0  # the whole file: two pairs of ranks, cases of at most a few limits each
MESSAGE_S = 2 * TIMEOUT_S + 6  # the call's start to its message on every rank: the limit, the ranks' posts
EXIT_S = 10.0  # a rank's last message to its process's exit (interpreter teardown on a busy machine)


def _batch(step: int, rank: int):
    x, y = regression_batch(700 + step, WORLD * ROWS)
    return shard(x, rank, ROWS), shard(y, rank, ROWS)


def _engine(stage: int, group):
    return zerodp.parallelize(Net(), optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2), stage=stage,
                              timeout_s=TIMEOUT_S, group=group)


def _train_step(engine, step: int, rank: int) -> None:
    engine(*_batch(step, rank)).backward()
    engine.step()
    engine.zero_grad()


def _trained(stage: int, rank: int, group, checkpoint_on_rank0: bool, clock: dict) -> tuple[dict, bool | None]:
    """Four steps; after the first, with ``checkpoint_on_rank0``, rank 0 alone saves the model's
    and the optimizer's state dicts (compared with the same dicts taken on every rank just before)."""
    engine = _engine(stage, group)
    _train_step(engine, 0, rank)
    same = None
    if checkpoint_on_rank0:
        everyone = {"model": engine.state_dict(), "optimizer": engine.optimizer.state_dict()}
        clock["call"] = time.time()
        if rank == 0:
            alone = {"model": engine.state_dict(), "optimizer": engine.optimizer.state_dict()}
            with tempfile.TemporaryDirectory() as tmp:
                torch.save(alone, os.path.join(tmp, "ckpt.pt"))
            same = same_state(everyone, alone)
    for step in range(1, 4):
        _train_step(engine, step, rank)
    return engine.state_dict(), same


def _rank0_checkpoint_served(stage: int, rank: int, group, clock: dict) -> list:
    """Rank 0 checkpoints alone after step 1 while rank 1 trains on; the final model is compared
    bitwise with a run of the same steps that never checkpointed."""
    with_ckpt, same = _trained(stage, rank, group, True, clock)
    served_s = time.time() - clock["call"]
    without, _ = _trained(stage, rank, group, False, {})
    return [same, same_state(with_ckpt, without), served_s]


def _rank0_eval_served(rank: int, group, clock: dict) -> list:
    """Stage 3: after each of three steps, rank 0 alone evaluates (through the engine and through
    ``engine.module``) while rank 1 trains on; each equals the same evaluation made on every rank
    just before, and the training ends where it ends without the evaluations."""
    engine = _engine(3, group)
    x_eval = _batch(9, 0)[0]
    same = []
    for step in range(3):
        _train_step(engine, step, rank)
        with torch.no_grad():
            everyone = engine(x_eval, torch.zeros(ROWS, 3))
        clock.setdefault("call", time.time())
        if rank == 0:
            with torch.no_grad():
                same.append(torch.equal(everyone, engine(x_eval, torch.zeros(ROWS, 3)))
                            and torch.equal(everyone, engine.module(x_eval, torch.zeros(ROWS, 3))))
    _train_step(engine, 3, rank)
    with_eval = engine.state_dict()
    served_s = time.time() - clock["call"]
    again = _engine(3, group)
    for step in range(4):
        _train_step(again, step, rank)
    return [all(same) if rank == 0 else None, same_state(with_eval, again.state_dict()), served_s]


def _rank0_load_alone(rank: int, group, clock: dict) -> None:
    """Stage 2: rank 0 loads a state dict alone (a load cannot be served: every rank must copy
    its part) while rank 1 trains on."""
    engine = _engine(2, group)
    _train_step(engine, 0, rank)
    saved = engine.state_dict()
    clock["call"] = time.time()
    if rank == 0:
        engine.load_state_dict(saved)
        raise AssertionError("load_state_dict on rank 0 alone returned")
    for step in range(1, 4):
        _train_step(engine, step, rank)
    raise AssertionError("rank 1 trained on while rank 0 was in a call of its own")


def _grad_norm_logged_on_rank0(rank: int, group, clock: dict) -> None:
    """Stage 3: every rank's backward; rank 0 alone logs one gradient's norm; then the step."""
    engine = _engine(3, group)
    engine(*_batch(0, rank)).backward()
    params = list(engine.parameters())  # every rank: the sharded gradients on the parameters
    clock["call"] = time.time()
    if rank == 0:
        print(f"grad norm {params[0].grad.norm().item():.4f}")
    engine.step()
    engine.zero_grad()
    _train_step(engine, 1, rank)
    raise AssertionError("the step after a norm taken on rank 0 alone went through")


def _eval_on_rank0(rank: int, group, clock: dict) -> None:
    """Stage 3: rank 0 evaluates alone; rank 1 is elsewhere for a while (a long host-side task),
    then trains on."""
    engine = _engine(3, group)
    _train_step(engine, 0, rank)
    clock["call"] = time.time()
    if rank == 0:
        with torch.no_grad():
            engine(*_batch(9, rank))
        raise AssertionError("an evaluation on rank 0 alone returned")
    time.sleep(2 * TIMEOUT_S)
    _train_step(engine, 1, rank)
    raise AssertionError("rank 1 trained on after rank 0 ended")


def _different_calls(rank: int, group, clock: dict) -> list[str]:
    """Rank 0 takes the state dict while rank 1 takes the optimizer's: both hear of both at once,
    and the group stays usable — the same calls on every rank then work."""
    engine = _engine(3, group)
    _train_step(engine, 0, rank)
    clock["call"] = time.time()
    said = []
    try:
        engine.state_dict() if rank == 0 else engine.optimizer.state_dict()
    except RuntimeError as e:
        said.append(f"{time.time() - clock['call']:.2f}|{e}")
    sd = engine.state_dict()
    osd = engine.optimizer.state_dict()
    grads = engine.full_grad_dict()
    with tempfile.TemporaryDirectory() as tmp:
        engine.export_chrome_trace(os.path.join(tmp, "trace.json"))
    _train_step(engine, 1, rank)
    said.append(f"ok {len(sd)} {len(osd['state'])} {len(grads)}")
    return said


CASES = {
    **{f"checkpoint_stage{s}": functools.partial(_rank0_checkpoint_served, s) for s in range(4)},
    "load_alone_stage2": _rank0_load_alone,
    "grad_norm_stage3": _grad_norm_logged_on_rank0,
    "eval_stage3": _eval_on_rank0,
    "eval_served_stage3": _rank0_eval_served,
    "different_calls": _different_calls,
}
#: Each pair's cases in order; the last one's exit is the process's.
PAIRS = (("different_calls", "checkpoint_stage0", "checkpoint_stage1", "checkpoint_stage2", "load_alone_stage2"),
         ("checkpoint_stage3", "eval_served_stage3", "grad_norm_stage3", "eval_stage3"))


def _rank(cases: tuple[str, ...], rank: int, port: int, results) -> None:
    """One rank running ``cases``, each on a new process group; ended as a script ends: what the
    last case raised reaches the interpreter's exit."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=90))
    for case in cases:
        group = dist.new_group(list(range(WORLD)), backend="gloo", timeout=datetime.timedelta(seconds=60))
        clock: dict = {}
        try:
            out = CASES[case](rank, group, clock)
        except BaseException as e:
            results.put((case, rank, clock.get("call"), time.time(), f"{type(e).__name__}: {e}",
                         traceback.format_exc()))
            if case == cases[-1]:
                raise
            continue
        results.put((case, rank, clock.get("call"), time.time(), out, None))
    dist.destroy_process_group()


def _run_all() -> dict:
    """Both pairs at once; per case and rank: the call's start, the message's time, the message,
    and for each pair's last case the process's exit time (None: still alive at the limit)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = {}
    for cases in PAIRS:
        port = free_port()
        for r in range(WORLD):
            procs[cases[-1], r] = ctx.Process(target=_rank, args=(cases, r, port, results), daemon=True)
    for p in procs.values():
        p.start()
    out: dict = {(case, r): {"exit": None, "said": None} for case in CASES for r in range(WORLD)}

    def collect(wait_s: float) -> bool:
        try:
            case, rank, called, at, said, tb = results.get(timeout=wait_s)
        except queue.Empty:
            return False
        out[case, rank].update(call=called, at=at, said=said, traceback=tb)
        return True

    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline and any(p.is_alive() for p in procs.values()):
        collect(0.05)
        for key, p in procs.items():
            if out[key]["exit"] is None and not p.is_alive():
                out[key]["exit"] = time.time()
    while collect(0.5):
        pass
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    return out


def results() -> dict:
    return once(_run_all)


def _check_ended(case: str, names: tuple[str, ...], fix: str) -> list[str]:
    """Every rank raised the engine's message naming the call and its fix within MESSAGE_S of the
    call, and (a pair's last case) its process exited within EXIT_S of it. Returns the messages."""
    out = results()
    messages = []
    for rank in range(WORLD):
        got = out[case, rank]
        said = got["said"]
        assert said is not None, f"{case}: rank {rank} said nothing within {LIMIT_S:.0f} s (a hang)"
        assert said.startswith("CollectiveTimeout"), f"{case}, rank {rank}: {said}\n{got['traceback']}"
        assert all(n in said for n in names) and fix in said, f"{case}, rank {rank}: {said}"
        waited = got["at"] - got["call"]
        assert waited < MESSAGE_S, f"{case}, rank {rank}: the message came {waited:.1f} s after the call"
        if any(case == cases[-1] for cases in PAIRS):  # the rank's last case: its process ends after it
            assert got["exit"] is not None, (f"{case}: rank {rank}'s process did not exit within {LIMIT_S:.0f} s "
                                             f"(its message came {waited:.1f} s after the call): {said}")
            lingered = got["exit"] - got["at"]
            assert lingered < EXIT_S, f"{case}: rank {rank}'s process exited {lingered:.1f} s after its message"
        messages.append(said)
    return messages


STATE_DICT_FIX = "take the state dict on every rank, save it on rank 0"
OPTIMIZER_FIX = "take the optimizer state dict on every rank, save it on rank 0"


@pytest.mark.parametrize("stage", range(4))
def test_rank0_checkpoint_is_served_and_equals_every_rank_call(stage):
    """Rank 0's ``state_dict()`` and ``optimizer.state_dict()`` alone equal the same calls on every
    rank (stage 0 local, as DDP's; stages 1-3 served by rank 1 from its next step's collectives),
    and both ranks end bitwise where a run without the checkpoint ends."""
    out = results()
    for rank in range(WORLD):
        got = out[f"checkpoint_stage{stage}", rank]
        said = got["said"]
        assert isinstance(said, list), f"stage {stage}, rank {rank}: {said}\n{got.get('traceback')}"
        same, unperturbed, served_s = said
        assert unperturbed, f"stage {stage}, rank {rank}: the checkpoint changed the training"
        assert served_s < MESSAGE_S, f"stage {stage}, rank {rank}: served in {served_s:.1f} s"
    assert out[f"checkpoint_stage{stage}", 0]["said"][0] is True, "rank 0's dicts differ from every rank's"


def test_load_on_rank0_only_ends_every_rank_within_seconds():
    """A load cannot be served: rank 1, waiting in its step's collectives, reads rank 0's call in
    the store and both end with its name and fix within seconds, not after ``timeout_s``."""
    messages = _check_ended("load_alone_stage2", ("engine.load_state_dict() was called on rank 0 only",),
                            "load on every rank")
    for rank, m in enumerate(messages):
        waited = results()["load_alone_stage2", rank]["at"] - results()["load_alone_stage2", rank]["call"]
        assert waited < TIMEOUT_S, f"rank {rank} ended {waited:.1f} s after the call: {m}"


def test_grad_norm_logged_on_rank0_only_ends_every_rank_stage3():
    messages = _check_ended("grad_norm_stage3", ("the norm of a sharded gradient (p.grad.norm()", "on rank 0 only"),
                            "compute gradient norms on every rank")
    assert "rank 1 was in" in messages[0], messages[0]  # what the other rank was doing meanwhile


def test_rank0_eval_is_served_stage3():
    """nanoGPT's ``if master_process: estimate_loss()`` at stage 3: rank 1, waiting in its next
    step's unit gathers, serves rank 0's (bitwise the evaluation every rank makes)."""
    out = results()
    for rank in range(WORLD):
        got = out["eval_served_stage3", rank]
        said = got["said"]
        assert isinstance(said, list), f"rank {rank}: {said}\n{got.get('traceback')}"
        assert said[1], f"rank {rank}: the evaluations on rank 0 changed the training"
    assert out["eval_served_stage3", 0]["said"][0] is True, "rank 0's evaluation alone differs"


def test_rank0_eval_ends_and_every_process_exits_stage3():
    """Rank 1 is away past the limit (a long host-side task, no collective to serve from): rank 0
    names its evaluation and ends; rank 1, back, learns that rank 0's process ended — or, when its
    own limit runs out first while rank 0's process is still ending (a loaded machine), reads rank
    0's post and names the evaluation too — and ends; both processes exit."""
    out = results()
    first = out["eval_stage3", 0]["said"] or ""
    assert "(an evaluation) was called on rank 0 only" in first and "evaluate on every rank" in first, first
    _check_ended("eval_stage3", ("",), "")
    second = out["eval_stage3", 1]["said"]
    assert ("another rank's process ended" in second or "did not complete" in second
            or "(an evaluation) was called on rank 0 only" in second), second


def test_different_calls_on_different_ranks_are_named_on_both_and_the_group_stays_usable():
    out = results()
    for rank in range(WORLD):
        said = out["different_calls", rank]["said"]
        assert isinstance(said, list) and len(said) == 2, (said, out["different_calls", rank].get("traceback"))
        waited, _, message = said[0].partition("|")
        assert "rank 0 made engine.state_dict() at step 1" in message, message
        assert "rank 1 made engine.optimizer.state_dict()" in message, message
        assert STATE_DICT_FIX in message and OPTIMIZER_FIX in message, message
        assert float(waited) < TIMEOUT_S, waited  # at once: the exchange itself tells them apart
        assert said[1].startswith("ok "), said
