"""The bucket-size choice rule of ``bucket_mb="auto"``, restated from its docstring for the tests.

For every swept size: cost(η) = exposed + (1 − η)·(comm − exposed); its regret at η is
(cost + slack) / (least cost + slack) − 1; its worst regret is the largest over 9 evenly spaced η
in [η − u, η + u] ∩ [0, 1]. The choice is the largest size whose worst regret is within ``tol``
of the least worst regret.
"""


def expected_choice_mib(points, eta: float, u: float, tol: float, slack: float) -> float:
    lo, hi = max(0.0, eta - u), min(1.0, eta + u)
    worst = [0.0] * len(points)
    for i in range(9):
        e = lo + (hi - lo) * i / 8
        cost = [p.exposed_comm_s + (1 - e) * max(0.0, p.comm_s - p.exposed_comm_s) for p in points]
        least = min(cost)
        worst = [max(w, (c + slack) / (least + slack) - 1) for w, c in zip(worst, cost)]
    best = min(worst)
    return max(p.bucket_bytes for p, w in zip(points, worst) if w <= best + tol) / 2**20
