"""One CLI vocabulary (docs/planner.md, "one vocabulary"): every subcommand's ``--help`` is parsed
and no concept shows under two names anywhere; old spellings still parse but stay hidden; the
flags ``plan recommend`` prints for its first pick are ones ``zerodp train`` takes, and (make fuzz)
a recommend row pasted into ``zerodp train`` runs."""

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.cli import build_parser, main

#: make fuzz sets these (Makefile): the pasted training run below
MORE = bool(os.environ.get("ZERODP_ENGINE_FUZZ") or os.environ.get("ZERODP_ALL_WORLDS"))

#: every spelling of one concept; at most one of each may show in any --help
CONCEPTS = {
    "sequence length": {"--seq", "--seq-len", "--sequence-length"},
    "micro-batch": {"--mbs", "--micro-batch", "--micro-batch-size"},
    "global batch in tokens": {"--tokens", "--batch-tokens", "--global-batch-tokens",
                               "--target-tokens"},
    "precision": {"--precision", "--mixed-precision", "--dtype-train"},
    "ranks per node": {"--nproc", "--gpus-per-node", "--nproc-per-node"},
    "bucket size": {"--bucket", "--bucket-mb", "--bucket-bytes"},
    "stage": {"--stage"},
    # bench and predict compare several: a comma-separated list (--stage 3 there is a list of one)
    "stages compared": {"--stages"},
    "bytes on the wire": {"--compress", "--quantize", "--reduce-dtype"},
    "tokens per rank": {"--tokens-per-gpu", "--tokens-per-rank"},
    "model preset": {"--model", "--preset"},
    "new tokens sampled": {"--max-new-tokens", "--tokens"},
}
#: what each concept's one visible name is
CANONICAL = {"sequence length": "--seq-len", "micro-batch": "--micro-batch",
             "global batch in tokens": "--global-batch-tokens", "precision": "--mixed-precision",
             "ranks per node": "--nproc", "bucket size": "--bucket-mb", "stage": "--stage",
             "stages compared": "--stages",
             "bytes on the wire": "--compress", "tokens per rank": "--tokens-per-rank",
             "model preset": "--model", "new tokens sampled": "--max-new-tokens"}
OLD = [("plan", "memory", "--seq", "4096"), ("plan", "memory", "--mbs", "2"),
       ("plan", "memory", "--precision", "fp32"), ("plan", "batch", "--tokens", "4M"),
       ("plan", "roofline", "--batch-tokens", "16M"), ("plan", "recommend", "--gpus-per-node", "8"),
       ("plan", "simulate", "--bucket", "25MB"), ("plan", "simulate", "--tokens-per-gpu", "4096"),
       ("train", "--quantize", "params"), ("train", "--reduce-dtype", "bf16"),
       ("train", "--preset", "nano"), ("bench", "--stage", "3"), ("calibrate", "--tokens", "32")]


def _helps():
    """(command words, --help text) of every subcommand, recursively."""
    out = []

    def walk(parser, words):
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if words:
            out.append((words, parser.format_help()))
        for action in sub:
            for name, child in action.choices.items():
                walk(child, words + [name])

    walk(build_parser(), [])
    return out


def _options(help_text: str) -> set[str]:
    """The long options --help lists (its option lines, not its prose)."""
    found = set()
    for line in help_text.splitlines():
        m = re.match(r"^\s{2}(?:-\w[ ,][^-]*)?(--[a-z0-9][a-z0-9-]*)", line)
        if m:
            found.add(m.group(1))
    return found


def test_one_name_per_concept_across_every_subcommand():
    helps = _helps()
    assert len(helps) >= 12  # plan's seven, train, sample, export, bench, calibrate, predict, ui, ...
    shown: dict[str, dict[str, list[str]]] = {c: {} for c in CONCEPTS}
    for words, text in helps:
        for flag in _options(text):
            for concept, names in CONCEPTS.items():
                if flag in names:
                    shown[concept].setdefault(flag, []).append(" ".join(words))
    two = {c: v for c, v in shown.items() if len(v) > 1}
    assert not two, f"two names for one concept: {two}"
    for concept, flags in shown.items():
        assert set(flags) <= {CANONICAL[concept]}, (concept, flags)


@pytest.mark.parametrize("argv", OLD, ids=[" ".join(a[:-1]) for a in OLD])
def test_old_spellings_parse_and_stay_hidden(argv):
    parser = build_parser()
    parser.parse_args(list(argv))  # parses (a SystemExit would fail the test)
    words = [w for w in argv[:-2]]
    text = dict((tuple(w), t) for w, t in _helps())[tuple(words)]
    assert argv[-2] not in _options(text) or argv[-2] in CANONICAL.values()


def test_top_level_help_lists_recommend():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["-h"])
    assert "recommend" in out.getvalue()
    plan_help = dict((tuple(w), t) for w, t in _helps())[("plan",)]
    assert "recommend" in plan_help


def _recommend(*argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "recommend", "--json", *argv]) == 0
    return json.loads(out.getvalue())


PASTE = ("--model", "nano", "--gpus", "2", "--global-batch-tokens", "4096", "--seq-len", "64")


def test_a_recommend_row_is_zerodp_train_options():
    """The first pick's flags parse as zerodp train's and make a valid TrainConfig with the same
    stage, micro-batch, batch and compression."""
    from zerodp.train.cli import config_from_args

    d = _recommend(*PASTE)
    flags = d["train_flags"].split()
    assert flags and flags[0] == "--nproc"
    args = build_parser().parse_args(["train", "--model", "nano", *flags])
    cfg = config_from_args(args)
    best = d["candidates"][0]
    assert (cfg.stage, cfg.micro_batch, cfg.seq_len, cfg.nproc) == (
        best["stage"], best["micro_batch"], 64, 2)
    assert cfg.global_batch_tokens == d["samples"] * d["seq"]
    compress = {"none": (None, None), "int8": ("both",), "int8-params": ("params",),
                "int8-grads": ("grads",)}
    if best["compress"] in compress and best["compress"] != "none":
        assert str(cfg.quantize) == compress[best["compress"]][0]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(["plan", "recommend", *PASTE])
    assert "zerodp train " + d["train_flags"] in text.getvalue()


def test_the_hybrid_and_multi_node_flags_name_the_group():
    d = _recommend("--model", "mixtral-8x7b", "--nodes", "8")
    flags = d["train_flags"]
    assert "--nproc 8" in flags and f"--shard-size {d['candidates'][0]['shard_size']}" in flags


@pytest.mark.fuzz
@pytest.mark.skipif(not MORE, reason="make fuzz: a real 2-rank training run (about a minute on 2 CPUs)")
def test_a_pasted_recommend_row_trains(tmp_path):
    d = _recommend(*PASTE)
    exe = Path(sys.executable).with_name("zerodp")  # the console script next to this Python
    cmd = [str(exe), "train", "--model", "nano", *d["train_flags"].split(),
           "--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
           "--out", str(tmp_path / "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
