"""Storage faults while saving a checkpoint: a full disk (ENOSPC), no permission (EACCES), an I/O
error (EIO) and the save's directory removed while it is written. For each: every rank reports the
same one sentence naming the rank, the path and the error; the previous checkpoint stays intact and
loadable; and training stops cleanly (the default, ``--on-save-error stop``: exit status 74) or,
with ``--on-save-error continue``, goes on and saves at the next interval, ending bitwise where a
run without the fault ends.

The faults come from the checkpoint writer's test hook (``zerodp.train.checkpoint.fault_hook``),
set from ``ZERODP_TEST_FAULT`` (``enospc:R:S`` and so on, zerodp.train.faults). ENOSPC, EACCES and
EIO are raised by the hook at the write (or the fsync) of rank R's shard — a test cannot fill the
disk or, as root, be refused permission — while ``rmdir`` really removes the directory and the
write that follows really fails.
"""

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zerodp.spawn import run_local
from zerodp.train import checkpoint as ckpt
from zerodp.train.chaos import RUN, Launch, compare, env_with
from zerodp.train.config import TrainConfig

pytestmark = pytest.mark.dist

BASE = TrainConfig(preset="nano", seq_len=32, global_batch_tokens=256, micro_batch=4, steps=6,
                   eval_every=0, eval_batches=1, ckpt_every=2, keep_checkpoints=3, progress=False,
                   stage=2, timeout_s=60)
# (fault, the rank that meets it, what that rank's sentence says)
CASES = [("enospc", 1, "No space left on device (ENOSPC)"), ("eacces", 0, "Permission denied (EACCES)"),
         ("eio", 1, "Input/output error (EIO)"), ("rmdir", 0, "No such file or directory (ENOENT)")]
STARTUP_S = 120


def _runs(rank, world, root):
    from zerodp.train.loop import RankContext, train

    ctx = RankContext(rank, world, rank, torch.device("cpu"))
    got = {}
    for kind, victim, _ in CASES:
        os.environ["ZERODP_TEST_FAULT"] = f"{kind}:{victim}:4"
        got[kind] = train(replace(BASE, out=f"{root}/{kind}"), ctx).get("stopped")
    os.environ["ZERODP_TEST_FAULT"] = "eio:1:4"
    summary = train(replace(BASE, out=f"{root}/continue", on_save_error="continue"), ctx)
    got["continue"] = (summary.get("stopped"), summary.get("save_errors"))
    del os.environ["ZERODP_TEST_FAULT"]
    got["straight"] = train(replace(BASE, out=f"{root}/straight"), ctx).get("stopped")
    return got


def test_each_storage_fault_is_reported_by_every_rank_and_leaves_the_previous_checkpoint(tmp_path, capfd):
    # the same through `zerodp train`, side by side: the launcher's message and exit status 74
    cli = Launch([*RUN, "--steps", "6", "--ckpt-every", "2", "--out", str(tmp_path / "cli")],
                 env_with("enospc:1:4"), [])
    ranks = run_local(_runs, 2, str(tmp_path), timeout=600)
    printed = capfd.readouterr().err
    for kind, victim, error in CASES:
        out = tmp_path / kind
        stops = [r[kind] for r in ranks]
        assert stops[0] == stops[1], "the ranks disagree on what happened"
        stop = stops[0]
        assert stop["reason"] == "save-error" and stop["step"] == 4
        sentence = stop["error"]
        shard = out / "checkpoints" / ".tmp-step_00000004" / ckpt.rank_file(victim)
        assert f'rank {victim} met "{error}" at {shard}' in sentence, sentence
        assert sentence.startswith("the checkpoint of step 4 was not saved: ")
        assert sentence.endswith(f"the previous checkpoint {out / 'checkpoints' / 'step_00000002'} is intact")
        assert "\n" not in sentence
        for rank in (0, 1):  # every rank says it
            assert f"zerodp: rank {rank}: {sentence}" in printed, (kind, rank)
        # the previous checkpoint: the newest, loadable (every file's SHA-256), equal to the same
        # step of a run without the fault; nothing of the failed save is left behind
        assert ckpt.find(out) == out / "checkpoints" / "step_00000002"
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
        a = ckpt.Checkpoint.open(out / "checkpoints" / "step_00000002")
        b = ckpt.Checkpoint.open(tmp_path / "straight" / "checkpoints" / "step_00000002")
        assert all(torch.equal(a.full(n, k), b.full(n, k)) for n in a.names() for k in a.kinds(n))
        assert '"event": "stop"' in (out / "metrics.jsonl").read_text().splitlines()[-1]

    # --on-save-error continue: step 4's save fails, training goes on, step 6 is saved, and the run
    # ends bitwise where the run without the fault ends
    stopped, errors = ranks[0]["continue"]
    assert stopped is None and len(errors) == 1 and 'rank 1 met "Input/output error (EIO)"' in errors[0]
    names = sorted(p.name for p in (tmp_path / "continue" / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000006"]
    step, diff = compare(tmp_path / "straight", tmp_path / "continue")
    assert step == 6 and not diff, diff

    rc = cli.wait(3 * STARTUP_S)
    text = "\n".join(ln.text for ln in cli.lines)
    assert rc == 74, text[-3000:]
    shard = tmp_path / "cli" / "checkpoints" / ".tmp-step_00000004" / ckpt.rank_file(1)
    assert (f'zerodp train: stopped after step 4 because its checkpoint could not be written: the '
            f'checkpoint of step 4 was not saved: rank 1 met "No space left on device (ENOSPC)" at {shard}') in text
    assert "Traceback" not in text
    assert ckpt.Checkpoint.open(ckpt.find(tmp_path / "cli")).step == 2
