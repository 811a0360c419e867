"""The misuse cases of issue 9 ("bad input"): one list that both the test and the docs table use.

Each case is an input a user could plausibly get wrong (configuration, CLI, data, checkpoint,
API) and the exact message it produces. ``tests/test_reliability_input.py`` runs every case and
compares the message with ``expected`` character for character (temporary paths shown as
``<tmp>``), and checks that the table in ``docs/reliability.md`` is the one :func:`render_table`
makes from this list, so the docs cannot drift from the behaviour. Regenerate the table with::

    .venv/bin/python tests/_misuse_cases.py --write
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
START, END = "<!-- misuse-table:start -->", "<!-- misuse-table:end -->"
NANO_RUN = ["--preset", "nano", "--seq-len", "64", "--global-batch-tokens", "1024", "--micro-batch", "4"]


@dataclass(frozen=True)
class Case:
    id: str
    area: str  # configuration | CLI | data | checkpoint | API
    input: str  # what the user did, as markdown
    run: Callable[[Path], str]  # does it in a temporary directory; returns the message
    expected: str


# ------------------------------------------------------------------------------- how to run them
def cli(*argv: str) -> Callable[[Path], str]:
    """Run ``zerodp ARGV`` in-process; the message is its one stderr line (it must be one line)."""

    def run(tmp: Path) -> str:
        from zerodp.cli import main

        args = [a.replace("<tmp>", str(tmp)) for a in argv]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(args)
        lines = [l for l in err.getvalue().splitlines() if l.strip()]
        assert rc == 2 and len(lines) == 1, f"exit code {rc}, stderr: {err.getvalue()!r}"
        return lines[0]

    return run


def setup_then(prepare: Callable[[Path], None], run: Callable[[Path], str]) -> Callable[[Path], str]:
    def both(tmp: Path) -> str:
        prepare(tmp)
        return run(tmp)

    return both


def api(call: Callable[[Path], object], group: bool = True) -> Callable[[Path], str]:
    """Call ``call(tmp)``, inside a one-rank gloo process group unless ``group=False``; the message is
    ``ExceptionType: text`` of what it raised (it must raise)."""

    def run(tmp: Path) -> str:
        with one_rank_group(tmp) if group else contextlib.nullcontext():
            try:
                call(tmp)
            except Exception as e:  # noqa: BLE001 - the message is what we test
                return f"{type(e).__name__}: {e}"
        raise AssertionError("no error was raised")

    return run


@contextlib.contextmanager
def one_rank_group(tmp: Path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ files to misuse
def write(name: str, data: bytes) -> Callable[[Path], None]:
    def prepare(tmp: Path) -> None:
        (tmp / name).write_bytes(data)

    return prepare


def checkpoint(preset: str = "nano", step: int = 5, damage: str | None = None) -> Callable[[Path], None]:
    """A one-rank checkpoint of a fresh GPT under ``<tmp>/old``, optionally damaged."""

    def prepare(tmp: Path) -> None:
        import torch

        from zerodp.train import checkpoint as ckpt
        from zerodp.train.model import GPT, PRESETS

        torch.manual_seed(0)
        model = GPT(PRESETS[preset])
        pieces = [type("P", (), dict(name=n, kind="param", start=0, stop=p.numel(), shape=tuple(p.shape),
                                     tensor=p.detach().reshape(-1))) for n, p in model.named_parameters()]
        path = ckpt.save(pieces, tmp / "old" / "checkpoints", step,
                         {"model": model.cfg.to_dict(), "stage": 0,
                          "scalars": {"kinds": [], "groups": [{}]}, "data": {"kind": "bytes"}})
        shard = path / ckpt.rank_file(0)
        if damage == "truncated":
            shard.write_bytes(shard.read_bytes()[:-100])
        elif damage == "flipped":
            b = bytearray(shard.read_bytes())
            b[len(b) // 2] ^= 0x01
            shard.write_bytes(bytes(b))
        elif damage == "missing":
            shard.unlink()
        elif damage == "incomplete":
            (path / ckpt.COMPLETE).unlink()
        elif damage == "foreign":
            m = json.loads((path / ckpt.MANIFEST).read_text())
            m["format"] = "someone-elses-checkpoint"
            (path / ckpt.MANIFEST).write_text(json.dumps(m))

    return prepare


def resume_checkpoint(*extra: str, damage: str | None = None,
                      path: str = "<tmp>/old") -> Callable[[Path], str]:
    """``zerodp train`` (the nano run, ``extra`` options) resuming ``path``: a :func:`checkpoint`,
    optionally damaged, written first."""
    return setup_then(checkpoint(damage=damage), cli("train", *NANO_RUN, *extra, "--resume", path, "--out", "<tmp>/r"))


# ------------------------------------------------------------------------------- API call sites
def _gpt():
    import torch

    from zerodp.train.model import GPT, PRESETS

    torch.manual_seed(0)
    return GPT(PRESETS["nano"])


def _adamw(groups):
    import torch

    return torch.optim.AdamW(groups, lr=1e-3)


def _parallelize(**kw):
    import zerodp

    return zerodp.parallelize(_gpt(), optimizer=kw.pop("optimizer", _adamw), **kw)


def _optimizer_subclass(tmp):
    import torch

    import zerodp

    class LARS(torch.optim.SGD):
        pass

    zerodp.parallelize(_gpt(), optimizer=lambda groups: LARS(groups, lr=0.1))


def _no_params(tmp):
    import torch

    import zerodp

    zerodp.parallelize(torch.nn.ReLU(), optimizer=_adamw)


def _clip_l1(tmp):
    _parallelize(stage=0).clip_grad_norm_(1.0, norm_type=1)


def _negative_tokens(tmp):
    _parallelize(stage=0, average_by_tokens=True).count_tokens(-3)


# ------------------------------------------------------------------------------------- the list
CASES: list[Case] = [
    # configuration and CLI
    Case("unknown-stage", "configuration", "`zerodp train --stage 4`", cli("train", "--stage", "4", "--out", "<tmp>/r"),
         "zerodp train: error: unknown --stage 4: stages are 0 (DP), 1 (ZeRO-1), 2 (ZeRO-2), 3 (ZeRO-3/FSDP)"),
    Case("batch-not-whole-sequences", "configuration", "`--global-batch-tokens 8192 --seq-len 100`",
         cli("train", "--global-batch-tokens", "8192", "--seq-len", "100", "--out", "<tmp>/r"),
         "zerodp train: error: --global-batch-tokens 8192 is not a multiple of --seq-len 100: the global batch is a whole number of sequences; try 8200"),
    Case("batch-not-divisible", "configuration", "`--micro-batch 24` (64 sequences on 2 ranks)",
         cli("train", "--micro-batch", "24", "--out", "<tmp>/r"),
         "zerodp train: error: the global batch of 64 sequences (8192 tokens / 128) is not divisible by --micro-batch 24 × 2 ranks = 48: choose --global-batch-tokens 6144 or a micro-batch that divides 32"),
    Case("too-many-ranks", "configuration", "`--global-batch-tokens 1024 --nproc 2` (8 sequences, micro-batch 16)",
         cli("train", "--global-batch-tokens", "1024", "--out", "<tmp>/r"),
         "zerodp train: error: the global batch of 8 sequences is smaller than --micro-batch 16 × 2 ranks = 32, so grad_acc would be below 1 (too many ranks for this batch, guide §6.1): lower --micro-batch, use fewer ranks, or raise --global-batch-tokens to 4096"),
    Case("zero-steps", "CLI", "`--steps 0`", cli("train", "--steps", "0", "--out", "<tmp>/r"),
         "zerodp train: error: --steps must be >= 1, got 0"),
    Case("zero-lr", "CLI", "`--lr 0`", cli("train", "--lr", "0", "--out", "<tmp>/r"),
         "zerodp train: error: --lr must be positive, got 0.0"),
    Case("lr-ratio", "CLI", "`--min-lr-ratio 2`", cli("train", "--min-lr-ratio", "2", "--out", "<tmp>/r"),
         "zerodp train: error: --min-lr-ratio must be in [0, 1], got 2.0"),
    Case("zero-timeout", "CLI", "`--timeout-s 0`", cli("train", "--timeout-s", "0", "--out", "<tmp>/r"),
         "zerodp train: error: --timeout-s must be a positive number of seconds, got 0.0"),
    Case("zero-skips", "CLI", "`--max-skipped-steps 0`", cli("train", "--max-skipped-steps", "0", "--out", "<tmp>/r"),
         "zerodp train: error: --max-skipped-steps must be >= 1, got 0"),
    Case("zero-grace", "CLI", "`--grace-s 0`", cli("train", "--grace-s", "0", "--out", "<tmp>/r"),
         "zerodp train: error: --grace-s must be a number of seconds from 1 to 86400, got 0.0"),
    Case("resume-where", "CLI", "`zerodp train --resume` without `--out`", cli("train", "--resume"),
         "zerodp train: error: --resume without a checkpoint needs --out DIR (the run to continue)"),
    Case("nccl-on-cpu", "CLI", "`--backend nccl` on a machine without GPUs",
         cli("train", "--backend", "nccl", "--out", "<tmp>/r"),
         "zerodp train: error: --backend nccl needs CUDA GPUs and none is visible; use --backend gloo"),
    Case("overwrite-run", "CLI", "`--out DIR` where DIR holds another run's checkpoints, no `--resume`",
         setup_then(checkpoint(), cli("train", *NANO_RUN, "--out", "<tmp>/old")),
         "zerodp train: error: <tmp>/old already holds checkpoints of another run; pass --resume <tmp>/old to continue it, or choose a new --out (nothing was overwritten)"),
    # data
    Case("missing-data", "data", "`--data` names a file that does not exist",
         cli("train", "--data", "<tmp>/missing.txt", "--out", "<tmp>/r"),
         "zerodp train: error: data file <tmp>/missing.txt does not exist; pass --data with a text file or a uint16 .bin token file, or leave it out for the bundled corpus"),
    Case("data-is-dir", "data", "`--data` names a directory", cli("train", "--data", "<tmp>", "--out", "<tmp>/r"),
         "zerodp train: error: --data <tmp> is a directory; give a text file or a .bin token file"),
    Case("data-too-short", "data", "a 280-byte text file with `--seq-len 512`",
         setup_then(write("short.txt", b"a tiny corpus " * 20),
                    cli("train", "--data", "<tmp>/short.txt", "--seq-len", "512", "--global-batch-tokens", "4096",
                        "--micro-batch", "4", "--out", "<tmp>/r")),
         "zerodp train: error: the training split of <tmp>/short.txt holds 252 tokens, fewer than seq_len + 1 = 513: lower --seq-len or give more data"),
    Case("odd-bin", "data", "a `.bin` token file with an odd number of bytes",
         setup_then(write("tokens.bin", b"abc"), cli("train", "--data", "<tmp>/tokens.bin", "--out", "<tmp>/r")),
         "zerodp train: error: <tmp>/tokens.bin has 3 bytes, an odd number: a .bin token file holds uint16 ids (2 bytes each); for text, give the file another suffix"),
    Case("one-byte", "data", "a text file of one byte", setup_then(write("one.txt", b"x"),
         cli("train", "--data", "<tmp>/one.txt", "--out", "<tmp>/r")),
         "zerodp train: error: data <tmp>/one.txt holds 1 token; a language model needs at least 2 (an input and the next token to predict)"),
    Case("empty-bin", "data", "an empty `.bin` token file",
         setup_then(write("tokens.bin", b""), cli("train", "--data", "<tmp>/tokens.bin", "--out", "<tmp>/r")),
         "zerodp train: error: <tmp>/tokens.bin is empty: a .bin token file holds uint16 token ids (2 bytes each)"),
    # checkpoints
    Case("resume-missing", "checkpoint", "`--resume` a path that does not exist",
         cli("train", *NANO_RUN, "--resume", "<tmp>/nowhere", "--out", "<tmp>/r"),
         "zerodp train: error: checkpoint <tmp>/nowhere does not exist"),
    Case("another-model", "checkpoint", "`--resume` a checkpoint of another model (`nano`) with `--preset tiny`",
         setup_then(checkpoint(), cli("train", "--preset", "tiny", "--resume", "<tmp>/old", "--out", "<tmp>/r")),
         "zerodp train: error: <tmp>/old/checkpoints/step_00000005/manifest.json is a checkpoint of another model (d_model: checkpoint 32, this run 128; n_head: checkpoint 2, this run 4; n_layer: checkpoint 2, this run 4; seq_len: checkpoint 64, this run 128): start a new run, or resume with the same model settings"),
    Case("out-of-vocabulary", "checkpoint",
         "`--resume` a byte-level (`nano`, 256 ids) checkpoint with a `.bin` file holding token id 300",
         setup_then(checkpoint(), setup_then(write("tokens.bin", b"".join(
                        n.to_bytes(2, "little") for n in [*(i % 256 for i in range(800)), 300])),
                                             cli("train", *NANO_RUN, "--data", "<tmp>/tokens.bin", "--resume",
                                                 "<tmp>/old", "--out", "<tmp>/r"))),
         "zerodp train: error: --data <tmp>/tokens.bin holds token id 300, outside the vocabulary of the model in <tmp>/old/checkpoints/step_00000005 (ids 0-255): resume with data of the tokenizer that model was trained with"),
    Case("nothing-left", "checkpoint", "`--resume` a checkpoint at step 5 with `--steps 5`",
         resume_checkpoint("--steps", "5"),
         "zerodp train: error: <tmp>/old/checkpoints/step_00000005 is at step 5 and --steps is 5: nothing left to do; raise --steps to train further"),
    Case("truncated-shard", "checkpoint", "`--resume` a checkpoint whose shard file lost its last 100 bytes",
         resume_checkpoint(damage="truncated"),
         "zerodp train: error: <tmp>/old/checkpoints/step_00000005/rank00000.safetensors has 182612 bytes but the manifest says 182712: the file is truncated or was overwritten"),
    Case("corrupted-shard", "checkpoint", "`--resume` a checkpoint whose shard file has one flipped bit",
         resume_checkpoint(damage="flipped"),
         "zerodp train: error: <tmp>/old/checkpoints/step_00000005/rank00000.safetensors fails its SHA-256 check: the file is corrupt"),
    Case("missing-shard", "checkpoint", "`--resume` a checkpoint whose rank 0 shard file was deleted",
         resume_checkpoint(damage="missing"),
         "zerodp train: error: <tmp>/old/checkpoints/step_00000005/rank00000.safetensors is missing: the checkpoint was saved by 1 rank and rank 0's shard file is gone; copy it back, or resume from another checkpoint"),
    Case("foreign-manifest", "checkpoint", "`--resume` a directory whose manifest is not a zerodp manifest",
         resume_checkpoint(damage="foreign"),
         "zerodp train: error: <tmp>/old/checkpoints/step_00000005/manifest.json is not a zerodp-checkpoint version 1 manifest"),
    Case("incomplete", "checkpoint", "`--resume` a checkpoint directory whose save never finished (no `COMPLETE`)",
         resume_checkpoint(damage="incomplete", path="<tmp>/old/checkpoints/step_00000005"),
         "zerodp train: error: checkpoint <tmp>/old/checkpoints/step_00000005 is incomplete (no COMPLETE marker): its save was interrupted; use an earlier checkpoint"),
    Case("export-suffix", "checkpoint", "`zerodp export RUN model.pt`",
         setup_then(checkpoint(), cli("export", "<tmp>/old", "<tmp>/model.pt")),
         "zerodp export: error: export writes safetensors: give an output path ending in .safetensors, got <tmp>/model.pt"),
    # API
    Case("no-process-group", "API", "`zerodp.parallelize(...)` before `torch.distributed.init_process_group()`",
         api(lambda tmp: _parallelize(stage=0), group=False),
         "RuntimeError: torch.distributed is not initialized: launch with torchrun (which sets RANK and WORLD_SIZE) and call torch.distributed.init_process_group(), or use zerodp.spawn.run_local for local ranks"),
    Case("optimizer-subclass", "API", "`parallelize(..., optimizer=lambda groups: LARS(groups))` with `class LARS(torch.optim.SGD)`",
         api(_optimizer_subclass),
         "ValueError: LARS subclasses SGD, and a subclass may read whole tensors: ZeRO runs the optimizer on 1/N slices of flattened parameters, which is exact only when each element's update depends on that element alone (factored or matrix-wise optimizers such as Adafactor, Muon or LARS read whole rows, tensors or matrices). Use one of: ASGD, Adadelta, Adagrad, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Rprop, SGD; if its update is elementwise, declare it with parallelize(..., elementwise_optimizer=True); if it reads each tensor whole but no other tensor, declare it with parallelize(..., optimizer_layout='owner') (each rank steps whole tensors)."),
    Case("api-stage", "API", "`parallelize(..., stage=5)`", api(lambda tmp: _parallelize(stage=5)),
         "ValueError: stage=5 is not a ZeRO stage; use 0 (DDP), 1, 2 or 3 (FSDP)"),
    Case("mixed-precision", "API", "`parallelize(..., mixed_precision=\"fp8\")`",
         api(lambda tmp: _parallelize(stage=0, mixed_precision="fp8")),
         "ValueError: mixed_precision='fp8' is not a dtype I know; use one of ['bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32']"),
    Case("no-parameters", "API", "`parallelize(torch.nn.ReLU(), ...)`", api(_no_params),
         "ValueError: the model has no parameters: there is nothing to train data-parallel"),
    Case("norm-type", "API", "`engine.clip_grad_norm_(1.0, norm_type=1)`", api(_clip_l1),
         "ValueError: norm_type=1: only the 2-norm is supported across shards"),
    Case("negative-tokens", "API", "`engine.count_tokens(-3)`", api(_negative_tokens),
         "ValueError: token count must be >= 0, got -3"),
    Case("skip-limit", "API", "`parallelize(..., max_nonfinite_skips=0)`",
         api(lambda tmp: _parallelize(stage=0, max_nonfinite_skips=0)),
         "ValueError: max_nonfinite_skips=0: give the number of consecutive steps with inf/NaN gradients to skip before training stops, an integer >= 1 (or None to turn the check off)"),
]


def normalise(message: str, tmp: Path) -> str:
    """Temporary paths as ``<tmp>``; the rest exactly as produced."""
    out = message.replace(str(tmp.resolve()), "<tmp>").replace(str(tmp), "<tmp>")
    return re.sub(r"\s+$", "", out)


def render_table() -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    rows = ["| # | area | input | message |", "|---|---|---|---|"]
    rows += [f"| {i} | {c.area} | {esc(c.input)} | `{esc(c.expected)}` |" for i, c in enumerate(CASES, 1)]
    return "\n".join(rows)


def doc_table() -> str:
    text = DOC.read_text()
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def write_doc() -> None:
    """Rewrite the table between the markers in docs/reliability.md (its one place)."""
    text = DOC.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{START}\n{render_table()}\n{END}{tail}")


if __name__ == "__main__":
    if "--print" in sys.argv:  # run every case and show what it says (for writing `expected`)
        import tempfile

        for c in CASES:
            with tempfile.TemporaryDirectory() as d:
                print(f"{c.id}\t{normalise(c.run(Path(d)), Path(d))}")
    if "--write" in sys.argv:
        write_doc()
        print(f"wrote the table of {len(CASES)} cases into {DOC}")
