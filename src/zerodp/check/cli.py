"""``zerodp check``: the command line of :mod:`zerodp.check` (docs/check.md, guide §12.3).

Exit status 0 when every row passes, 1 when one fails (or a rank fails), 2 on bad input (one
line naming the option).
"""

from __future__ import annotations

import argparse
import os
import sys


def _ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def _kwargs(text: str) -> dict:
    """``lr=1e-2,weight_decay=0.1,betas=(0.9,0.95)`` → keyword arguments (values as Python literals)."""
    import ast
    import re

    out = {}
    for part in re.split(r",(?![^()]*\))", text):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        if not eq or not key.strip().isidentifier():
            raise argparse.ArgumentTypeError(f"{part!r} is not name=value")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{part!r}: {value!r} is not a number, tuple or string literal") from None
    return out


def add_parser(sub) -> None:
    from zerodp.check.spec import STOCK

    p = sub.add_parser(
        "check", help="prove sharding exact on your own model and optimizer, and what it costs",
        description="Train your model a few steps at each stage and world size on local ranks (gloo on CPU, "
                    "NCCL with CUDA) against the same model and optimizer in one process on the whole batch: "
                    "gradient accumulation under no_sync, clipping, optional bf16, a checkpoint saved at one "
                    "stage and world size and loaded at another. Prints, per row, the largest gradient, "
                    "parameter and optimizer-state difference against its tolerance (from the dtype and the "
                    "magnitude), PASS/FAIL, memory and bytes per step against the planner's. Exit status 1 on "
                    "any FAIL. docs/check.md says what it proves and what it cannot.")
    p.add_argument("--model", metavar="PKG.MODULE:FN", help="a function returning the nn.Module (the current "
                   "directory is on the path)")
    p.add_argument("--config", metavar="CONFIG", help="a Hugging Face config.json (or its directory), built with "
                   "random weights by AutoModelForCausalLM.from_config")
    p.add_argument("--optimizer", default="adamw", help=f"a stock optimizer: {', '.join(STOCK)} (default adamw)")
    p.add_argument("--optimizer-args", type=_kwargs, default={"lr": 1e-2}, metavar="K=V,...",
                   help="its keyword arguments (default lr=1e-2)")
    p.add_argument("--optimizer-factory", metavar="PKG.MODULE:FN", help="instead: fn(model) returns one optimizer "
                   "or a list over disjoint parameters (Muon + AdamW)")
    p.add_argument("--batch", metavar="PKG.MODULE:FN", help="fn(step, micro, rows) returns the global micro-batch: "
                   "a tuple of forward's arguments or a dict of keyword arguments, with `rows` rows")
    p.add_argument("--loss", metavar="PKG.MODULE:FN", help="fn(output, batch) returns the loss (default: the output "
                   "if a scalar, its .loss, else the mean square of the output)")
    p.add_argument("--input-shape", type=_ints, default=None, metavar="D,...",
                   help="generated batches: one row's shape (default: none, give --vocab, --config or --batch)")
    p.add_argument("--vocab", type=int, default=0, help="generated batches of token ids below VOCAB")
    p.add_argument("--seq-len", dest="seq", type=int, default=32,
                   help="tokens per row of the batches generated for --config (default 32)")
    p.add_argument("--seq", dest="seq", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old spelling
    p.add_argument("--units", metavar="ATTR", help="stage 3 units: the ModuleList at this attribute path "
                   "(default: the ModuleList holding the most parameters)")
    p.add_argument("--stages", type=_ints, default=(0, 1, 2, 3), metavar="S,...", help="default 0,1,2,3")
    p.add_argument("--worlds", type=_ints, default=(2,), metavar="N,...", help="world sizes (default 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per row (default 3)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step, all but the last under "
                   "no_sync (default 2)")
    p.add_argument("--rows", type=int, default=2, help="rows per rank per micro-batch (default 2)")
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ before each step (0: none; default 1)")
    p.add_argument("--mixed-precision", dest="precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: mixed precision with an fp32 master (default fp32)")
    p.add_argument("--precision", dest="precision", default=argparse.SUPPRESS, choices=("fp32", "bf16"),
                   help=argparse.SUPPRESS)  # old spelling
    p.add_argument("--no-reshard", action="store_true", help="skip the checkpoint saved at one stage and world "
                   "size and loaded at another")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the batches and the ranks (default 0)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda (NCCL) when a GPU is present, else cpu (gloo) (default auto)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole check (default 900)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--perturb-lr", type=float, default=0.0, help=argparse.SUPPRESS)  # the check of the check
    p.set_defaults(func=run_check)


def run_check(args) -> int:
    from zerodp.check import CheckConfig, CheckInputError, run
    from zerodp.spawn import RankFailure

    if os.getcwd() not in sys.path:  # --model pkg.module:fn from the current directory, as python -m does
        sys.path.insert(0, os.getcwd())
    cfg = CheckConfig(model=args.model, config=args.config, optimizer=args.optimizer,
                      optimizer_args=args.optimizer_args, optimizer_factory=args.optimizer_factory,
                      batch=args.batch, loss=args.loss, input_shape=args.input_shape or (), vocab=args.vocab,
                      seq=args.seq, units=args.units, stages=args.stages, worlds=args.worlds, steps=args.steps,
                      micro_batches=args.micro_batches, rows=args.rows, clip=args.clip or None,
                      precision=args.precision, reshard=not args.no_reshard, seed=args.seed, device=args.device,
                      timeout=args.timeout, perturb_lr=args.perturb_lr)
    try:
        cfg.validate()
        for ref, what in ((cfg.model, "--model"), (cfg.optimizer_factory, "--optimizer-factory"),
                          (cfg.batch, "--batch"), (cfg.loss, "--loss")):
            if ref is not None:
                from zerodp.check.spec import resolve

                resolve(ref, what)
        result = run(cfg)
    except CheckInputError as e:
        raise ValueError(str(e)) from None
    except RankFailure as e:
        text = str(e)
        wrong = [line for line in text.splitlines() if "CheckInputError: " in line]
        if wrong:
            raise ValueError(wrong[0].split("CheckInputError: ", 1)[1]) from None
        print(text, file=sys.stderr)
        # the cause: a rank's own error, not a peer's "connection closed" that followed it
        ends = [[line for line in part.splitlines() if line.strip()][-1:] for part in text.split("--- rank ")]
        ends = [e[0] for e in ends if e]
        last = next((e for e in ends if "peer" not in e), ends[-1])
        print(f"zerodp check: error: a rank failed ({last.strip()}); its traceback is above", file=sys.stderr)
        return 1
    if args.json:
        from zerodp.check.report import to_json

        print(to_json(result.rows, {"seconds": result.seconds, "ranks": cfg.ranks}))
    else:
        print(result.table())
        print(f"{'PASS' if result.ok else 'FAIL'}: {len(result.rows)} rows in {result.seconds:.1f} s")
    return 0 if result.ok else 1
