"""Storage faults while saving a checkpoint: a full disk (ENOSPC), no permission (EACCES), an I/O
error (EIO) and the save's directory removed while it is written. For each: every rank reports the
same one sentence naming the rank, the path and the error; the previous checkpoint stays intact and
loadable; and training stops cleanly (the default, ``--on-save-error stop``: exit status 74) or,
with ``--on-save-error continue``, goes on and saves at the next interval, ending bitwise where a
run without the fault ends.

The faults come from the run's hooks object, which the loop passes to the checkpoint writer
(``Hooks.before_fs``, zerodp.train.hooks), built from ``ZERODP_TEST_FAULT`` (``enospc:R:S`` and so
on, zerodp.train.faults). ENOSPC, EACCES and EIO are raised by the hook at the write (or the fsync)
of rank R's shard — a test cannot fill the
disk or, as root, be refused permission — while ``rmdir`` really removes the directory and the
write that follows really fails.
"""

import os
from dataclasses import replace

import pytest
import torch

from _engine_common import spawn_once
from _train_common import cpu_context
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
    import sys

    from zerodp.train.loop import train

    sys.stderr = open(f"{root}/stderr-rank{rank}.txt", "w", buffering=1)  # what this rank says
    ctx = cpu_context(rank, world)
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every fault in one group of two ranks (one after the other), the same run without a fault,
    and — side by side — one run through `zerodp train` that meets ENOSPC."""
    root = tmp_path_factory.mktemp("storage")
    cli = Launch([*RUN, "--steps", "6", "--ckpt-every", "2", "--out", str(root / "cli")],
                 env_with("enospc:1:4"), [])
    ranks = spawn_once(_runs, 2, str(root), timeout=600)
    said = [(root / f"stderr-rank{r}.txt").read_text() for r in (0, 1)]
    return root, ranks, said, cli


@pytest.mark.parametrize("kind,victim,error", CASES, ids=[c[0] for c in CASES])
def test_a_storage_fault_is_one_sentence_on_every_rank_and_the_previous_checkpoint_stays(runs, kind, victim, error):
    root, ranks, said, _ = runs
    out = root / kind
    stops = [r[kind] for r in ranks]
    assert stops[0] == stops[1], "the ranks disagree on what happened"
    stop = stops[0]
    assert stop["reason"] == "save-error" and stop["step"] == 4  # stopped cleanly: the default
    sentence = stop["error"]
    shard = out / "checkpoints" / ".tmp-step_00000004" / ckpt.rank_file(victim)
    assert f'rank {victim} met "{error}" at {shard}' in sentence, sentence
    assert sentence.startswith("the checkpoint of step 4 was not saved: ")
    assert sentence.endswith(f"the previous checkpoint {out / 'checkpoints' / 'step_00000002'} is intact")
    assert "\n" not in sentence
    for rank in (0, 1):  # every rank says it
        assert f"zerodp: rank {rank}: {sentence}\n" in said[rank], (kind, rank, said[rank][-2000:])
    # the previous checkpoint: the newest, loadable (every file's SHA-256), equal to the same step
    # of a run without the fault; nothing of the failed save is left behind
    assert ckpt.find(out) == out / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    a = ckpt.Checkpoint.open(out / "checkpoints" / "step_00000002")
    b = ckpt.Checkpoint.open(root / "straight" / "checkpoints" / "step_00000002")
    assert all(torch.equal(a.full(n, k), b.full(n, k)) for n in a.names() for k in a.kinds(n))
    assert '"event": "stop"' in (out / "metrics.jsonl").read_text().splitlines()[-1]


def test_with_on_save_error_continue_training_goes_on_and_ends_bitwise(runs):
    """Step 4's save fails (EIO), training goes on, step 6 is saved, and the run ends bitwise
    where the run without the fault ends."""
    root, ranks, _, _ = runs
    stopped, errors = ranks[0]["continue"]
    assert stopped is None and len(errors) == 1 and 'rank 1 met "Input/output error (EIO)"' in errors[0]
    names = sorted(p.name for p in (root / "continue" / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000006"]
    step, diff = compare(root / "straight", root / "continue")
    assert step == 6 and not diff, diff


def test_zerodp_train_stops_with_status_74_and_one_line(runs):
    root, _, _, cli = runs
    rc = cli.wait(3 * STARTUP_S)
    text = "\n".join(ln.text for ln in cli.lines)
    assert rc == 74, text[-3000:]
    shard = root / "cli" / "checkpoints" / ".tmp-step_00000004" / ckpt.rank_file(1)
    assert (f'zerodp train: stopped after step 4 because its checkpoint could not be written: the '
            f'checkpoint of step 4 was not saved: rank 1 met "No space left on device (ENOSPC)" at {shard}') in text
    assert "Traceback" not in text
    assert ckpt.Checkpoint.open(ckpt.find(root / "cli")).step == 2
