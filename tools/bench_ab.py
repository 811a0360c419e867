"""Before/after step time of the engine in one run: ``zerodp bench`` from an earlier commit and from
this tree, alternated, and the ratio per stage and regime.

    python tools/bench_ab.py --before 0e42f36 [--turns 3] [--stages 0,1,2,3] [--regimes 256,16]

The earlier commit is checked out into a temporary git worktree; both trees run with this
checkout's interpreter (``PYTHONPATH`` picks the tree). Turns alternate the order (before, after;
after, before; ...) so that a load that drifts over the run shifts both alike. Each cell is ours'
median step over the same run's no-communication floor — the floor divides out the machine's
drift between runs — as the median over the turns; ``after/before`` is their ratio, and the
geometric mean over the cells is printed last. On a shared 2-core machine one run of one cell
varies by tens of %: read the table for large changes, not for a few %.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(src: Path, args) -> dict:
    cmd = [sys.executable, "-c", "import sys, zerodp.cli as c; sys.exit(c.main(sys.argv[1:]))", "bench",
           "--stages", args.stages, "--model", args.model, "--regimes", args.regimes, "--steps", str(args.steps),
           "--json", "--out", tempfile.mkdtemp(prefix="bench-ab-")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(src)),
                          timeout=1800)
    if done.returncode:
        sys.exit(f"bench_ab: zerodp bench from {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)["bench"]


def cells(run: dict) -> dict[tuple[str, int], float]:
    """(regime, stage) -> ours' median step / the floor's."""
    out = {}
    for r in run["regimes"]:
        c = r["contenders"]
        for key, v in c.items():
            if v.get("role") == "ours" and key == f"ours{v['stage']}":
                out[(r["regime"]["name"], v["stage"])] = v["median_s"] / c["floor"]["median_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--turns", type=int, default=3, help="alternations (default 3)")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--regimes", default="256,16", help="tokens per rank (default 256,16)")
    p.add_argument("--model", default="nano")
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-ab-tree-") as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.before],
                       check=True)
        try:
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            srcs = {"before": tree / "src", "after": ROOT / "src"}
            for turn in range(args.turns):
                for name in ("before", "after") if turn % 2 == 0 else ("after", "before"):
                    runs[name].append(cells(bench(srcs[name], args)))
                    print(f"turn {turn + 1}/{args.turns}: {name} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"ours' median step / the run's no-communication floor, median of {args.turns} alternated runs "
          f"(before: {args.before}, after: this tree)")
    print(f"{'tokens/rank':>11} {'stage':>5} {'before':>8} {'after':>8} {'after/before':>12}")
    ratios = []
    for key in sorted(runs["before"][0]):
        b = statistics.median(r[key] for r in runs["before"])
        a = statistics.median(r[key] for r in runs["after"])
        ratios.append(a / b)
        print(f"{key[0]:>11} {key[1]:>5} {b:>8.3f} {a:>8.3f} {a / b:>12.3f}")
    print(f"geometric mean of after/before over {len(ratios)} cells: "
          f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
