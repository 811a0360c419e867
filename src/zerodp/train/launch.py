"""Start the ranks of a training run: locally through PyTorch's elastic launcher, or under torchrun.

``zerodp train --nproc 2`` starts two local ranks with
:func:`torch.distributed.launcher.api.elastic_launch` — the agent ``torchrun`` itself runs: it
hosts a c10d rendezvous, spawns the workers with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` set, watches them, and (with ``--max-restarts``) restarts the whole
group when one fails. Under ``torchrun`` the same command finds those variables already set and
runs as one worker directly, so multi-node runs work unchanged::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m zerodp.cli train --out /shared/run1 --preset gpt2-small

Everything that can be checked in one process (data, batch arithmetic, a checkpoint to resume) is
checked before any rank starts, so bad input ends with one clear line instead of N tracebacks.

SIGTERM and a first SIGINT stop the run gracefully (:mod:`zerodp.train.stop`): the launcher
forwards the signal to the ranks, which finish the step, save a checkpoint and return; the launcher
then raises :class:`Stopped` with the documented exit status. It waits ``--grace-s`` for them and
kills what is left after that; a second SIGINT kills the ranks at once.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import math
import multiprocessing
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from zerodp.train import checkpoint as ckpt
from zerodp.train import stop as stopping
from zerodp.train.config import TrainConfig

DEFAULT_RUNS_DIR = "runs"


class Stopped(Exception):
    """The run ended before its last step; ``code`` is the exit status (zerodp.train.stop), the
    message says why and how to continue (empty on ranks other than 0 under torchrun)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def launched_by_torchrun() -> bool:
    """True inside a worker of torchrun / the elastic agent (the rank variables are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def default_out() -> str:
    return str(Path(DEFAULT_RUNS_DIR) / time.strftime("%Y%m%d-%H%M%S"))


def resolve_backend(cfg: TrainConfig) -> str:
    if cfg.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
    return cfg.backend


def validate(cfg: TrainConfig, world: int) -> None:
    """The checks every rank would make, made once up front (raise ValueError with the fix)."""
    from zerodp.train.loop import check_resume, prepare

    resolve_backend(cfg)
    _, mc, _, _, _ = prepare(cfg, world)
    check_resume(cfg, mc, log=lambda message: None)  # rank 0 prints the notes once it runs
    out = Path(cfg.out) if cfg.out else None
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if out is not None and not cfg.resume and not restarted and (out / "checkpoints").is_dir() and any(
            (out / "checkpoints").iterdir()):
        raise ValueError(f"{out} already holds checkpoints of another run; pass --resume {out} to "
                         "continue it, or choose a new --out (nothing was overwritten)")


def attempt_store(rank: int, world: int, attempt: int, timeout: datetime.timedelta):
    """The rendezvous store of this attempt of the group, as ``env://`` would make it, but with
    its keys under a prefix of their own.

    After an elastic restart the store can still hold the keys the dead attempt wrote (the
    addresses its ranks listened on); a new rank that reads one tries to connect to a process
    that is gone ("Gloo connectFullMesh failed … Connection refused"), or waits for it. A prefix
    per attempt (``TORCHELASTIC_RESTART_COUNT``) makes every attempt start from a clean slate.
    """
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # the agent hosts the store
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    else:  # rank 0 hosts it, as env:// does
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"zerodp/attempt-{attempt}/", store)


@record  # a failing worker's traceback goes where the elastic agent reports it
def worker(cfg_dict: dict, under_agent: bool = False) -> dict:
    """Entry point of one rank: set up the process group and device, train, report (rank 0).

    ``under_agent``: started by our elastic agent (not torchrun). After a stop on a signal the
    process then ends at once with the stop's exit status, instead of returning: the agent is
    shutting the ranks down and does not collect return values any more (a returned value would
    keep the process waiting for it until the agent's timeout). A stop without a signal (a
    checkpoint the filesystem refused) returns, and the launcher raises :class:`Stopped`.
    """
    import warnings

    import torch.distributed as dist

    from zerodp.train.loop import RankContext, train

    # torch 2.13 renamed the tensor collectives (*_into_tensor -> *_single); the old names still
    # work and the warning would print once per rank and call site in the middle of the progress bar.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)
    from zerodp.train.report import write_report

    from zerodp.train.checkpoint import checkpoint_step, complete_checkpoints

    cfg = TrainConfig.from_dict(cfg_dict)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Relayed output (a pipe, a log file, torchrun's --tee) shows each line when it is printed, not
    # when a block buffer fills or the rank ends; progress is a bar on a terminal, else lines.
    sys.stdout.reconfigure(line_buffering=True)
    stopper = stopping.install(rank, cfg.grace_s)  # first, so that no SIGTERM finds the default action
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints where every thread of this rank is
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0 and cfg.out:
        # The agent restarted the group after a failure: continue from the newest complete
        # checkpoint (or from the start when none was completed before the failure).
        found = complete_checkpoints(Path(cfg.out) / "checkpoints")
        if found and checkpoint_step(found[-1]) >= cfg.steps:
            # the failure came after the checkpoint of the last step was complete: the run is done
            if rank == 0:
                print(f"zerodp: restart {restart} of the group after a failure; the run had already "
                      f"completed its last step ({found[-1]}), so there is nothing to redo (no report "
                      "is written)", flush=True)
            stopper.done()
            return {"out": cfg.out} if rank == 0 else {}
        if found:
            cfg = replace(cfg, resume=cfg.out)
        if rank == 0:
            print(f"zerodp: restart {restart} of the group after a failure; "
                  + (f"resuming from {found[-1]}" if found else "no checkpoint was complete, starting over"),
                  flush=True)
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = resolve_backend(cfg)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    dist.init_process_group(backend, store=attempt_store(rank, world, restart, timeout), rank=rank,
                            world_size=world, timeout=timeout,
                            **({"device_id": device} if backend == "nccl" else {}))
    try:
        if cfg.out is None:  # the same new directory on every rank
            name = [default_out() if rank == 0 else None]
            dist.broadcast_object_list(name, src=0)
            cfg = replace(cfg, out=name[0])
        try:
            summary = train(cfg, RankContext(rank, world, local_rank, device))
        except Exception as e:
            if cfg.max_restarts > 0:  # the agent restarts the group and reports nothing: say it here
                print(f"zerodp: rank {rank} (attempt {restart}): {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr, flush=True)
            raise
        stopped = summary.get("stopped")
        if stopped and stopped.get("signal") and under_agent:  # the agent is shutting down
            dist.destroy_process_group()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(stopping.exit_code(signal.Signals[stopped["signal"]]) if stopped["reason"] == "signal"
                     else stopping.EXIT_SAVE_FAILED)
        if stopped:
            return {"out": cfg.out, "stopped": stopped}
        dist.barrier()
    finally:
        dist.destroy_process_group()
        stopper.done()
    if rank == 0:
        # after the process group is gone: the report (plots included) can take longer than
        # --timeout-s on a loaded machine, and no rank should wait for it in a collective
        write_report(summary)
        return {"out": cfg.out}
    return {}


def stopped_outcome(out: str | None, stopped: dict | None, sig: int | None, grace_s: float,
                    since: float = 0.0) -> Stopped | None:
    """What an early end means, as a :class:`Stopped` (None: the run had in fact finished).

    ``stopped`` is what the ranks returned (None when they did not return: the launcher only knows
    it got ``sig`` at wall-clock time ``since``); then the metrics log tells whether they stopped
    cleanly after the signal.
    """

    if stopped is None and out:
        last = _last_record(Path(out) / "metrics.jsonl")
        if last and last.get("time", 0) < since - 1:  # written before the signal: not its answer
            last = None
        if last and last.get("event") == "end":
            return None
        if last and last.get("event") == "stop":
            stopped = last
    if stopped and stopped.get("reason") == "signal":
        name = stopped["signal"]
        return Stopped(f"zerodp train: stopped on {name} after step {stopped['step']}, with a "
                       f"checkpoint of that step: {stopped['checkpoint']}. Continue with: zerodp train "
                       f"--out {out} --resume (with the same options)", stopping.exit_code(signal.Signals[name]))
    if stopped and stopped.get("reason") == "save-error":
        return Stopped(f"zerodp train: stopped after step {stopped['step']} because its checkpoint could "
                       f"not be written: {stopped['error']}. {ckpt.resume_hint(out)}", stopping.EXIT_SAVE_FAILED)
    what = signal.Signals(sig).name if sig else "a stop signal"
    return Stopped(f"zerodp train: {what} received; the ranks ended without a checkpoint of the step in "
                   f"flight (they were still starting, one of them failed, or they did not stop cleanly "
                   f"within --grace-s {grace_s:g} s). {ckpt.resume_hint(out)}", stopping.EXIT_FAILED)


def _last_record(path: Path) -> dict | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return None


class _LauncherSignals:
    """The launcher's SIGTERM/SIGINT handler while the elastic agent runs the ranks.

    The first stop signal raises the agent's ``SignalException``: the agent forwards the signal to
    the ranks and waits up to its shutdown timeout (``--grace-s``) for them to stop. Repeats of
    SIGTERM are ignored (the stop is under way); a second SIGINT kills the ranks at once and ends
    the launcher (a checkpoint save is atomic: the newest complete one is untouched).
    """

    def __init__(self, out: str):
        self.out = out
        self.first: signal.Signals | None = None
        self.at = 0.0  # wall-clock time of the first signal
        self._previous: dict = {}

    def __enter__(self) -> "_LauncherSignals":
        for sig in stopping.STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig = signal.Signals(signum)
        if self.first is None:
            self.first, self.at = sig, time.time()
            raise SignalException(f"zerodp train got {sig.name}", sigval=sig)
        if sig != signal.SIGINT:
            return

        for child in multiprocessing.active_children():  # the ranks (spawned by the agent)
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"\nzerodp train: second interrupt: the ranks were ended at once. {ckpt.resume_hint(self.out)}",
              file=sys.stderr, flush=True)
        os._exit(stopping.EXIT_FAILED)


def launch(cfg: TrainConfig, before_start=None) -> str:
    """Run ``cfg`` on ``cfg.nproc`` local ranks (or as this torchrun worker); return the run dir.

    ``before_start(cfg)``, when given, runs once the input is checked and before any rank starts
    (under torchrun: in each worker; ``zerodp train`` keeps the resolved config there)."""
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        validate(cfg, world)
        if before_start is not None:
            before_start(cfg)
        result = worker(asdict(cfg))
        if result.get("stopped"):
            stop = stopped_outcome(cfg.out, result["stopped"], None, cfg.grace_s)
            raise Stopped(str(stop) if int(os.environ["RANK"]) == 0 else "", stop.code)
        return result.get("out", cfg.out or "")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import elastic_launch

    from zerodp.compat import launch_config, launch_limits
    from zerodp.spawn import free_port

    cfg = cfg if cfg.out else replace(cfg, out=default_out())
    validate(cfg, cfg.nproc)
    if before_start is not None:
        before_start(cfg)
    # A failed worker is reported by `zerodp train` itself: in one line when the error explains
    # itself (a peer died or stalled, inf/NaN, a bad checkpoint), with its traceback otherwise.
    # The launcher would log the same traceback once more, from inside its process machinery.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    config = launch_config(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc, run_id=f"zerodp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=cfg.max_restarts,
        monitor_interval=0.2, start_method="spawn",
        # SIGTERM and SIGINT are ours (_LauncherSignals); the agent waits for the ranks until shortly
        # before --grace-s ends and then kills them, leaving the launcher time to exit within it
        signals_to_handle="SIGHUP,SIGQUIT",
        shutdown_timeout=max(1, math.floor(cfg.grace_s - stopping.margin_s(cfg.grace_s))))
    for limit in launch_limits():  # what this torch's launcher cannot do (zerodp.compat)
        print(f"zerodp train: {limit}", file=sys.stderr)
    with _LauncherSignals(cfg.out) as signals:
        try:
            results = elastic_launch(config, worker)(asdict(cfg), True)
        except SignalException as e:
            if signals.first is None:  # SIGHUP / SIGQUIT: the agent's own handling
                raise
            stop = stopped_outcome(cfg.out, None, e.sigval, cfg.grace_s, since=signals.at)
            if stop is None:
                return cfg.out
            raise stop from None
    stopped = ((results or {}).get(0) or {}).get("stopped")
    if stopped:
        raise stopped_outcome(cfg.out, stopped, None, cfg.grace_s)
    return cfg.out

