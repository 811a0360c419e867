"""DiLoCo over hybrid ZeRO, measured on this machine and set beside the planner (guide §16; docs/diloco.md).

    python tools/diloco_report.py                      # everything (tens of minutes on 2 CPU cores)
    python tools/diloco_report.py --parts bytes,crossover
    python tools/diloco_report.py --parts loss --loss-every 50,100,500 --write-loss-table
    python tools/diloco_report.py --parts loss --loss-every 50 --loss-warmup 100,250 --loss-warmup-every 50,100

Four parts, each printed as a table with its acceptance figure (issue 51):

* ``bytes``: cross-group bytes per step of DDP, hybrid ZeRO-3 and DiLoCo at H = 100 (int8 and fp32),
  counted by the engine over a whole round (``zerodp bench --regimes diloco``,
  :mod:`zerodp.bench.diloco`) and predicted by :func:`zerodp.plan.diloco.diloco_bytes`; the ratio to
  DDP's (≥ 400× int8, ≥ 100× fp32); the outer state per rank against 8Ψ/g;
* ``crossover``: hybrid ZeRO-3 and DiLoCo (H = 1, int8: the one setting whose crossover lies where
  a 2-core machine can time it — the difference of the two steps is the outer step's own work,
  milliseconds) on the simulated link at several bandwidths, in series with this machine's own;
  the bandwidth of that whole link where their steps are equal, fitted, against ``diloco_plan``'s
  on the same link from the measured inner-step and outer times (guide §16.4);
* ``loss``: ``zerodp train`` runs of the ``tiny`` GPT on the bundled corpus at equal tokens, 4 ranks:
  DDP (stage 0), and DiLoCo over ZeRO-3 in 2 groups of 2 at each H of ``--loss-every``; the final
  validation loss (after a sync: the run's steps are a multiple of every H) and its ratio to DDP's
  (≤ 1.03× at H = 50); ``--loss-warmup W`` adds DiLoCo runs that start from the DDP run's
  checkpoint after W steps (``zerodp train --resume`` of it with ``--diloco-every H``: the same
  batches and learning-rate schedule after it); ``--write-loss-table`` puts the rows into
  ``plan/diloco_loss.json`` (a warm-up's with ``"warmup": W``) and ``--plot`` draws the
  validation curves.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("bytes", "crossover", "loss")


def _mb(x: float) -> str:
    from zerodp.plan._common import fmt_bytes

    return fmt_bytes(x)


def part_bytes(args) -> dict:
    """DDP, hybrid ZeRO-3 and DiLoCo at H = args.every (int8), then DiLoCo fp32, over one round each."""
    from zerodp.bench import diloco
    from zerodp.engine.config import DiLoCo

    out = {}
    for compress, who in (("int8", ("ddp", "hybrid", "diloco")), (None, ("diloco",))):
        spec = diloco.DiLoCoBenchSpec(model=args.model, world_size=4, shard_size=2, stage=3,
                                      outer=DiLoCo(every=args.every, compress=compress), steps=args.every, warmup=1,
                                      contenders=who)
        ranks = diloco.run(spec)
        out[compress or "fp32"] = {"spec": spec, "ranks": ranks, "planned": diloco.predicted_bytes(spec, ranks[0])}
    ddp = out["int8"]["ranks"][0]["ddp"]
    ddp_bytes = sum(ddp["cross_bytes"]) / len(ddp["cross_bytes"])
    rows, checks = [], []
    from zerodp.plan._common import table

    for key, name, label in (("int8", "ddp", "DDP (stage 0 over 4 ranks)"),
                             ("int8", "hybrid", "hybrid ZeRO-3 (2 groups of 2)"),
                             ("int8", "diloco", f"DiLoCo over ZeRO-3, H = {args.every}, int8"),
                             ("fp32", "diloco", f"DiLoCo over ZeRO-3, H = {args.every}, fp32")):
        run = out[key]["ranks"][0][name]
        per_rank = [sum(r[name]["cross_bytes"]) / len(r[name]["cross_bytes"]) for r in out[key]["ranks"]]
        got, want = per_rank[0], out[key]["planned"][name]
        state = (f"{run['outer_state_bytes']:,} B / {run['expected_outer_state_bytes']:,} B"
                 if name == "diloco" else "-")
        rows.append([label, _mb(got), _mb(want), "yes" if all(abs(p - want) <= 1e-9 * want for p in per_rank)
                     else "NO", f"{ddp_bytes / got:,.0f}x", state])
        if name == "diloco":
            need = 400 if key == "int8" else 100
            checks.append((f"DDP / DiLoCo {key} >= {need}x", ddp_bytes / got >= need))
            checks.append((f"DiLoCo {key} bytes equal the planner's on every rank",
                           all(abs(p - want) <= 1e-9 * want for p in per_rank)))
            checks.append((f"DiLoCo {key} outer state = 8Ψ/g bytes",
                           run["outer_state_bytes"] == run["expected_outer_state_bytes"]))
    print(table(["method", "cross-group B/step (measured)", "planner", "equal", "DDP / this", "outer state / 8Ψ/g"],
                rows, title=f"cross-group bytes per step and outer state per rank ({args.model}, 4 ranks, "
                            f"counted over {args.every} steps by the engine's accounting)"))
    _checks(checks)
    return {"rows": rows, "checks": checks}


def part_crossover(args) -> dict:
    """Hybrid ZeRO-3 against DiLoCo (H = 1, int8) on the simulated link: measured vs planned crossover."""
    from zerodp.bench import diloco
    from zerodp.engine.config import DiLoCo
    from zerodp.plan._common import parse_quantity, table

    bws = tuple(parse_quantity(w) for w in args.bandwidths.split(","))
    spec = diloco.DiLoCoBenchSpec(model=args.model, world_size=4, shard_size=2, stage=3,
                                  outer=DiLoCo(every=1, compress="int8"), steps=args.crossover_steps, warmup=2,
                                  bandwidths=bws, contenders=("hybrid", "diloco"))
    ranks = diloco.run(spec)
    cross = diloco.crossover(spec, ranks)
    print(diloco.table(spec, ranks))
    rows = [[f"{1 / x / 1e6:,.0f} MB/s", f"{y * 1e3:+.2f} ms", f"{q * 1e3:+.2f} ms"]
            for (x, y), (_, q) in zip(cross["points"], cross["planned_points"])]
    print(table(["simulated bandwidth", "hybrid − DiLoCo step, measured", "planner"], rows,
                title="the step-time difference on the simulated link"))
    print("\n".join(diloco.crossover_lines(cross)))
    m, p = cross["measured_link_bytes_per_s"], cross["planned_link_bytes_per_s"]
    real = diloco.unthrottled_waits(ranks[0])
    print(f"unthrottled, the steps waited {real['hybrid'] * 1e3:.2f} ms for hybrid ZeRO-3's cross-group collectives "
          f"and {real['diloco'] * 1e3:.2f} ms for DiLoCo's; the simulated link adds its bytes / W after each "
          "collective's real end")
    ok = bool(m and p and abs(m / p - 1) <= 0.2)
    _checks([("measured crossover (the whole link's bandwidth) within 20% of the planner's", ok)])
    return {"crossover": cross, "ok": ok, "own_link_s_per_step": real}


def _warmups(args) -> list[int]:
    return [int(w) for w in args.loss_warmup.split(",") if w.strip()]


def _train(args, name: str, extra: list[str], need: Path | None = None) -> dict:
    """One ``zerodp train`` run into ``--out``/``name`` (reused when its metrics exist, unless
    ``--rerun``; ``need``: a file the reused run must also have left, else it runs again). The
    DDP run keeps a checkpoint at every evaluation when ``--loss-warmup`` asks for any: the
    warm-ups' starting points."""
    out = Path(args.out) / name
    ckpt = ["--ckpt-every", "0"]
    if name == "ddp" and _warmups(args):
        ckpt = ["--ckpt-every", str(args.eval_every), "--keep-checkpoints", str(args.loss_steps // args.eval_every)]
    cmd = [sys.executable, "-m", "zerodp.cli", "train", "--model", args.model, "--nproc", "4",
           "--steps", str(args.loss_steps), "--global-batch-tokens", str(args.tokens_per_step),
           "--micro-batch", str(args.tokens_per_step // 4 // 128), "--seq-len", "128",
           "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
           *ckpt, "--no-progress", "--seed", str(args.seed), "--out", str(out), *extra]
    if not (out / "metrics.jsonl").exists() or args.rerun or (need is not None and not need.exists()):
        if out.exists():
            import shutil

            shutil.rmtree(out)
        t0 = time.time()
        print(f"$ {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(e["step"], e["val_loss"]) for e in evals if e.get("event") == "eval"]
    return {"name": name, "evals": evals, "final": evals[-1][1], "command": "zerodp " + " ".join(cmd[3:])}


def _loss_row(args, h: int, run: dict, ddp: dict, warmup: int = 0) -> dict:
    """One row of ``plan/diloco_loss.json``: DiLoCo at H = ``h`` (from DDP's checkpoint after
    ``warmup`` steps, 0: from the first step) against the DDP run, with the command that measured it."""
    cmd = (f"python tools/diloco_report.py --parts loss --model {args.model} --loss-steps {args.loss_steps} "
           f"--loss-every {args.loss_every}")
    how = f"zerodp train, bundled corpus, seed {args.seed}, {args.tokens_per_step} tokens per step, 4 CPU ranks"
    if warmup:
        cmd += f" --loss-warmup {args.loss_warmup} --loss-warmup-every {args.loss_warmup_every or args.loss_every}"
        how += f"; the first {warmup} steps DDP's, then --resume of its checkpoint with --diloco-every H"
    return {"model": args.model, "H": h, "compress": "none", "fragments": 1, **({"warmup": warmup} if warmup else {}),
            "loss_ratio_vs_ddp": round(run["final"] / ddp["final"], 4),
            "tokens": args.loss_steps * args.tokens_per_step, "replicas": 2, "shard_size": 2, "stage": 3, "delay": 0,
            "ddp_val_loss": round(ddp["final"], 4), "val_loss": round(run["final"], 4), "steps": args.loss_steps,
            "source": f"{cmd} ({how})", "date": datetime.date.today().isoformat()}


def part_loss(args) -> dict:
    """DDP against DiLoCo at each H, equal tokens, final validation loss."""
    from zerodp.plan._common import table

    everys = [int(h) for h in args.loss_every.split(",") if h.strip()]  # "": warm-up runs only
    if any(args.loss_steps % h for h in everys):
        raise SystemExit(f"--loss-steps {args.loss_steps} must be a multiple of every H in --loss-every")
    warmups = _warmups(args)
    for w in warmups:
        if w % args.eval_every or not 0 < w < args.loss_steps:
            raise SystemExit(f"--loss-warmup {w}: a multiple of --eval-every (the DDP run's checkpoints) below "
                             "--loss-steps")
    first = Path(args.out) / "ddp" / "checkpoints" / f"step_{min(warmups):08d}" if warmups else None
    ddp = _train(args, "ddp", ["--stage", "0"], need=first)
    runs = [ddp]
    rows = [["DDP (stage 0, 4 ranks)", f"{ddp['final']:.4f}", "1.000"]]
    checks, table_rows = [], []
    tokens = args.loss_steps * args.tokens_per_step
    for h in everys:
        r = _train(args, f"diloco-h{h}", ["--stage", "3", "--shard-size", "2", "--diloco-every", str(h)])
        runs.append(r)
        ratio = r["final"] / ddp["final"]
        rows.append([f"DiLoCo H = {h} over ZeRO-3 (2 groups of 2)", f"{r['final']:.4f}", f"{ratio:.3f}"])
        if h == 50:
            checks.append(("DiLoCo H = 50 final validation loss <= 1.03x DDP's", ratio <= 1.03))
        table_rows.append(_loss_row(args, h, r, ddp))
    warm_everys = [int(h) for h in (args.loss_warmup_every or args.loss_every).split(",") if h.strip()]
    for w in warmups:  # DiLoCo from DDP's checkpoint after w steps (the same data order and schedule after it)
        start = Path(args.out) / "ddp" / "checkpoints" / f"step_{w:08d}"
        for h in warm_everys:
            if (args.loss_steps - w) % h:  # the run must end on a sync
                print(f"(no H = {h} run after {w} DDP steps: {args.loss_steps - w} steps are not a multiple of it)")
                continue
            r = _train(args, f"diloco-h{h}-warmup{w}", ["--stage", "3", "--shard-size", "2", "--diloco-every", str(h),
                                                       "--resume", str(start)])
            runs.append(r)
            ratio = r["final"] / ddp["final"]
            rows.append([f"DiLoCo H = {h} after {w} DDP steps", f"{r['final']:.4f}", f"{ratio:.3f}"])
            if h == 50:
                checks.append((f"DiLoCo H = 50 after a {w}-step DDP warm-up: final validation loss <= 1.03x DDP's",
                               ratio <= 1.03))
            table_rows.append(_loss_row(args, h, r, ddp, warmup=w))
    for h in [int(x) for x in args.loss_average_every.split(",") if x.strip()]:
        r = _train(args, f"average-h{h}", ["--stage", "3", "--shard-size", "2", "--diloco-every", str(h),
                                           "--diloco-lr", "1", "--diloco-momentum", "0"])
        runs.append(r)
        rows.append([f"the groups' mean every {h} steps (outer lr 1, momentum 0)", f"{r['final']:.4f}",
                     f"{r['final'] / ddp['final']:.3f}"])
    print(table(["run", "final validation loss", "/ DDP's"], rows,
                title=f"{args.model} at equal tokens ({tokens:,} tokens, {args.loss_steps} steps of "
                      f"{args.tokens_per_step:,}), bundled corpus"))
    _checks(checks)
    if args.write_loss_table:
        path = ROOT / "src/zerodp/plan/diloco_loss.json"
        doc = json.loads(path.read_text())
        keep = [r for r in doc.get("measurements", []) if not (r.get("model") == args.model and any(
            r.get("H") == t["H"] and r.get("compress", "none") == "none" and r.get("fragments", 1) == 1
            and r.get("warmup", 0) == t.get("warmup", 0) for t in table_rows))]
        doc["measurements"] = keep + table_rows
        path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {len(table_rows)} rows into {path.relative_to(ROOT)}")
    if args.plot:
        _plot(runs, Path(args.plot), tokens, args.model)
    return {"rows": rows, "runs": runs, "checks": checks}


def _plot(runs: list[dict], path: Path, tokens: int, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in runs:
        h, _, w = r["name"].split("-h")[-1].partition("-warmup")
        label = "DDP" if r["name"] == "ddp" else (
            f"DiLoCo H = {h}" + (f" after {w} DDP steps" if w else "") if r["name"].startswith("diloco")
            else f"the groups' mean every {h} (lr 1, momentum 0)")
        ax.plot(*zip(*r["evals"]), "o-" if r["name"] == "ddp" else ".-", lw=1.3, ms=3, label=label)
    ax.set_xlabel("step (equal tokens per step)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{model} GPT, 4 CPU ranks, {tokens:,} tokens: DDP vs DiLoCo (2 groups of 2)", fontsize=10)
    low = min(v for r in runs for _, v in r["evals"])
    ax.set_ylim(low - 0.1, min(3.0, max(v for r in runs for _, v in r["evals"])))  # step 0 (5.6) is off the top
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"wrote {path}")


def _checks(checks) -> None:
    for what, ok in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {what}")
    print()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated: bytes, crossover, loss")
    p.add_argument("--model", default="tiny", help="GPT preset (default tiny)")
    p.add_argument("--every", type=int, default=100, help="H of the bytes part (default 100)")
    p.add_argument("--bandwidths", default="50MB,100MB,200MB,400MB,800MB",
                   help="simulated inter-group bandwidths of the crossover part, bytes/s per rank")
    p.add_argument("--crossover-steps", type=int, default=240,
                   help="timed steps per bandwidth and contender (docs/diloco.md: 120 missed the 20%% once)")
    p.add_argument("--loss-every", default="50,100,500",
                   help="the H of the loss part's DiLoCo runs from the first step (\"\": none, only --loss-warmup's)")
    p.add_argument("--loss-steps", type=int, default=500, help="steps of every loss run (a multiple of each H)")
    p.add_argument("--loss-warmup", default="",
                   help="also DiLoCo started from the DDP run's checkpoint after these steps (a data-parallel "
                        "warm-up, as DiLoCo is used from a pretrained model), e.g. 100,250: multiples of "
                        "--eval-every")
    p.add_argument("--loss-warmup-every", default=None, help="the H of the --loss-warmup runs (default --loss-every)")
    p.add_argument("--loss-average-every", default="",
                   help="also these H with outer lr 1 and momentum 0 (the groups' mean: local SGD), e.g. 50")
    p.add_argument("--tokens-per-step", type=int, default=4096,
                   help="global batch in tokens (4 ranks x 128-token rows)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="runs/diloco-report", help="where the loss runs go (reused unless --rerun)")
    p.add_argument("--rerun", action="store_true", help="train the loss runs again even if their metrics exist")
    p.add_argument("--write-loss-table", action="store_true", help="put the loss rows into plan/diloco_loss.json")
    p.add_argument("--plot", default=None,
                   help="draw the loss part's validation curves here (e.g. docs/diloco_loss.png)")
    p.add_argument("--json", default=None, help="also write everything measured to this file")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    done = {}
    for part in parts:
        done[part] = {"bytes": part_bytes, "crossover": part_crossover, "loss": part_loss}[part](args)
    if args.json:
        Path(args.json).write_text(json.dumps(done, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
