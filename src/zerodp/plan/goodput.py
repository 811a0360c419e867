"""Goodput under failures: restart every rank from a checkpoint, or heal one replica group from a
live peer (docs/reliability.md, "Goodput under failures"; issue 52).

Goodput here is committed training work per second of wall time, as a fraction of what the same
cluster does with no failure at all (1.0). Both paths see the same failures:

* every node fails independently, a Poisson process of rate 1/M_node (``mtbf_node_s``, the mean
  time between failures of *one* node); a job on n nodes then fails at rate n/M_node, its MTBF
  is M = M_node/n.

**Restart from a checkpoint** (today's path: the watchdog ends the job, the launcher starts every
rank again from the newest checkpoint). The job computes τ seconds, then writes a checkpoint
for C seconds (blocking); a failure at any moment — while computing, while writing, while
restarting — throws away everything since the last complete checkpoint and costs a restart of
R seconds (failure detected, processes started again, the checkpoint read). With exponential
failures the expected wall time per τ of work is exactly (Daly 2006, eq. 9)

    T(τ) = M · e^{R/M} · (e^{(τ+C)/M} − 1),      goodput G_restart(τ) = τ / T(τ).

Young's interval τ_Y = √(2·C·M) (Young 1974) is the first-order optimum, what most schedulers
use; the exact optimum τ* solves d/dτ ln G = 0, i.e. M·(1 − e^{−(τ+C)/M}) = τ (one root, found
by bisection), and Daly's higher-order estimate (:func:`daly_interval`) lies within a fraction of
a percent of it.

**Heal from a peer** (torchft's quorum: the replica groups are separate jobs; a failure ends only
the groups on the failed node). The nodes form *failure domains*, the smallest sets of nodes that
fail together: with shard groups of g GPUs and p GPUs per node, a domain is one replica group of
g/p nodes when g ≥ p, or one node (holding p/g groups) when g < p; d domains in all, each doing
1/d of the work. A domain fails at rate λ_d = (nodes in it)/M_node while it is up and is down
for D = R + S/B (its processes restart, then every rank fetches its S bytes of state from the
rank with the same shard index in a live group at B bytes/s). Meanwhile the survivors step on
at (d−1)/d of the rate (the global batch shrinks; committed tokens per second fall with it). Each
domain is an alternating renewal process, up for a mean 1/λ_d, down for D, so in steady state

    A = 1 / (1 + λ_d·D)                 the mean fraction of domains up (exact),
    ν = d · λ_d · A                     failures per second (as many rejoins),

every failure costs the survivors the step in flight (not committed) and a new quorum, t + q,
every rejoin a new quorum q (t the step time, q the quorum time: detection, lighthouse quorum,
process-group reconfiguration), while the live fraction is what it is at that moment: on average
(d−1)·A/d after a failure (the failed domain gone, each other one up with probability A) and
(1 + (d−1)·A)/d after a rejoin, so

    G_heal ≈ (A − ν·[(t + q)·(d−1)·A + q·(1 + (d−1)·A)] / d) · G_loss,

neglecting overlaps of two stalls (second order in ν). G_loss covers what a peer
cannot heal: every domain holding a copy of some shard down at once (all d domains), a rate
λ_loss ≈ d · λ_d · A · (1 − A)^{d−1}, recovered from a checkpoint as above,
G_loss = G_restart(τ*_loss) at M = 1/λ_loss, its own optimal interval.

Assumptions, to hold the comparison fair: the same R for a whole job and for one group (a group's
restart is not made faster than the job's, although it reads nothing from storage); checkpoint
writes block; spare nodes (or the scheduler) replace a failed node within R. Everything is in
seconds and bytes; :func:`goodput_plan` prices both paths for one cluster size,
:func:`goodput_table` for several.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.plan._common import InputError, ToDict, check_count, check_positive

HOUR = 3600.0
#: Llama 3 405B (Dubey et al. 2024, §3.3.4): 419 unexpected interruptions in a 54-day snapshot
#: on 16,384 H100 (2,048 nodes of 8): a job MTBF of 3.1 h, 6,335 h per node — every cause
#: counted (GPUs, HBM, network, software), which is what a restart pays for
LLAMA3_NODE_MTBF_H = 54 * 24 * 2048 / 419
#: the defaults of ``zerodp plan goodput`` (seconds): a blocking checkpoint write, a restart from
#: failure to the first new step (detect, reschedule, start, initialise, read the checkpoint),
#: a torchft quorum change (the lighthouse's heartbeat timeout, 5 s, plus the quorum and the
#: process groups' reconfiguration), a training step
CKPT_S = 60.0
RESTART_S = 600.0
QUORUM_S = 10.0
STEP_S = 5.0


# ---------------------------------------------------------------------------------------------
def young_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval √(2·C·M), seconds of compute between checkpoints."""
    return math.sqrt(2.0 * check_positive("ckpt_s", ckpt_s, allow_zero=True)
                     * check_positive("mtbf_s", mtbf_s))


def daly_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate: √(2CM)·(1 + x/3 + x²/9) − C, x = √(C/2M), for C < 2M; M
    beyond (Daly 2006, eq. 37)."""
    c, m = check_positive("ckpt_s", ckpt_s, allow_zero=True), check_positive("mtbf_s", mtbf_s)
    if c >= 2 * m:
        return m
    x = math.sqrt(c / (2 * m))
    return math.sqrt(2 * c * m) * (1 + x / 3 + x * x / 9) - c


def restart_goodput(interval_s: float, ckpt_s: float, restart_s: float, mtbf_s: float) -> float:
    """The fraction of wall time that is kept work when every failure restarts the job from its
    newest checkpoint: τ / (M·e^{R/M}·(e^{(τ+C)/M} − 1)) (module docstring). ``mtbf_s`` may be
    ``inf`` (no failures: τ/(τ+C))."""
    tau = check_positive("interval_s", interval_s)
    c = check_positive("ckpt_s", ckpt_s, allow_zero=True)
    r = check_positive("restart_s", restart_s, allow_zero=True)
    if mtbf_s == math.inf:
        return tau / (tau + c)
    m = check_positive("mtbf_s", mtbf_s)
    return tau / (m * math.exp(r / m) * math.expm1((tau + c) / m))


def best_interval(ckpt_s: float, mtbf_s: float) -> float:
    """The interval τ* that maximises :func:`restart_goodput` (it does not depend on R): the one
    root of M·(1 − e^{−(τ+C)/M}) − τ, a decreasing function, by bisection on [0, M]."""
    c, m = check_positive("ckpt_s", ckpt_s, allow_zero=True), check_positive("mtbf_s", mtbf_s)
    if c == 0:
        return 0.0
    lo, hi = 0.0, m
    for _ in range(200):
        mid = (lo + hi) / 2
        if m * -math.expm1(-(mid + c) / m) - mid > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Domains(ToDict):
    """How the nodes fail together: ``count`` domains of ``nodes_each`` nodes (module docstring)."""

    count: int
    nodes_each: int
    groups_each: int
    what: str


def failure_domains(nodes: int, gpus_per_node: int, shard_size: int) -> Domains:
    """The failure domains of R = N/g replica groups of g GPUs on ``nodes`` nodes of p GPUs: one
    group of g/p nodes each when p divides g, one node of p/g groups each when g divides p."""
    nodes = check_count("nodes", nodes)
    p = check_count("gpus_per_node", gpus_per_node)
    g = check_count("shard_size", shard_size)
    n = nodes * p
    if n % g:
        raise InputError(f"the shard size {g} does not divide the {n:,} GPUs ({nodes:,} nodes of "
                         f"{p}): replica groups are equal", "shard_size")
    if g % p == 0:
        dom = Domains(count=n // g, nodes_each=g // p, groups_each=1,
                      what=f"a replica group of {g // p} node{'s' if g // p != 1 else ''}")
    elif p % g == 0:
        dom = Domains(count=nodes, nodes_each=1, groups_each=p // g,
                      what=f"a node of {p // g} replica groups")
    else:
        raise InputError(f"a shard group of {g} GPUs neither fills whole nodes of {p} nor fits "
                         f"a whole number of times in one: choose a multiple or a divisor of {p}",
                         "shard_size")
    if dom.count < 2:
        raise InputError(f"{dom.count} failure domain ({dom.what}): healing from a peer needs at "
                         f"least two replica groups on different nodes; lower the shard size below "
                         f"{g} or add nodes", "shard_size")
    return dom


@dataclass(frozen=True)
class HealGoodput(ToDict):
    """Heal from a peer (module docstring): every term of G_heal."""

    domains: int
    domain_rate: float       # λ_d, failures per second of one domain while up
    down_s: float            # D = restart + transfer
    live_fraction: float     # A
    failures_per_s: float    # ν
    stall_loss: float        # ν·[(t+q)(d−1)A + q(1+(d−1)A)]/d, work lost to stalls
    loss_rate: float         # λ_loss, per second
    loss_interval_s: float   # τ* against λ_loss (inf: none needed)
    loss_goodput: float      # G_loss
    goodput: float


def heal_goodput(domains: int, domain_rate: float, down_s: float, step_s: float, quorum_s: float,
                 ckpt_s: float, restart_s: float) -> HealGoodput:
    """G_heal = (A − stall loss)·G_loss for ``domains`` domains, each failing at
    ``domain_rate`` per second while up and down for ``down_s`` (module docstring)."""
    d = check_count("domains", domains, 2)
    lam = check_positive("domain_rate", domain_rate, allow_zero=True)
    down = check_positive("down_s", down_s, allow_zero=True)
    t = check_positive("step_s", step_s, allow_zero=True)
    q = check_positive("quorum_s", quorum_s, allow_zero=True)
    a = 1.0 / (1.0 + lam * down)
    nu = d * lam * a
    stall = nu * ((t + q) * (d - 1) * a + q * (1 + (d - 1) * a)) / d
    loss = d * lam * a * (1.0 - a) ** (d - 1)
    if loss > 0 and math.isfinite(1.0 / loss):
        tau = best_interval(ckpt_s, 1.0 / loss)
        g_loss = restart_goodput(tau, ckpt_s, restart_s, 1.0 / loss) if tau > 0 else 1.0
    else:
        tau, g_loss = math.inf, 1.0
    return HealGoodput(domains=d, domain_rate=lam, down_s=down, live_fraction=a,
                       failures_per_s=nu, stall_loss=stall, loss_rate=loss,
                       loss_interval_s=tau, loss_goodput=g_loss,
                       goodput=max(0.0, a - stall) * g_loss)


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Goodput(ToDict):
    """Both paths on one cluster (:func:`goodput_plan`)."""

    nodes: int
    gpus_per_node: int
    gpus: int
    shard_size: int
    replicas: int
    domains: Domains
    mtbf_node_s: float
    job_mtbf_s: float
    ckpt_s: float
    restart_s: float
    quorum_s: float
    step_s: float
    state_bytes: float       # per GPU, fetched from the peer when a group heals
    transfer_bw: float       # bytes/s per GPU of that fetch
    transfer_s: float
    young_interval_s: float
    daly_interval_s: float
    best_interval_s: float
    interval_s: float        # the one priced: given, else Young's
    restart_goodput: float   # at interval_s
    restart_best_goodput: float
    heal: HealGoodput

    @property
    def gain(self) -> float:
        """G_heal − G_restart at the best interval (a fraction of the cluster)."""
        return self.heal.goodput - self.restart_best_goodput

    def to_dict(self) -> dict:
        return dict(super().to_dict(), gain=self.gain,
                    gpu_hours_saved_per_day=self.gain * self.gpus * 24)


def goodput_plan(nodes: int, gpus_per_node: int, shard_size: int, mtbf_node_s: float,
                 state_bytes: float, transfer_bw: float, ckpt_s: float = CKPT_S,
                 restart_s: float = RESTART_S, quorum_s: float = QUORUM_S, step_s: float = STEP_S,
                 interval_s: float | None = None) -> Goodput:
    """Restart from a checkpoint against heal from a peer on ``nodes`` nodes of ``gpus_per_node``
    GPUs in replica groups of ``shard_size`` GPUs (module docstring). ``state_bytes``: what one GPU
    fetches from its peer to heal (parameters and optimizer state of its shard); ``transfer_bw``:
    bytes/s per GPU of that fetch; ``interval_s``: the restart path's checkpoint interval
    (default Young's)."""
    dom = failure_domains(nodes, gpus_per_node, shard_size)
    m_node = check_positive("mtbf_node_s", mtbf_node_s)
    for name, v in (("ckpt_s", ckpt_s), ("restart_s", restart_s), ("quorum_s", quorum_s),
                    ("step_s", step_s), ("state_bytes", state_bytes)):
        check_positive(name, v, allow_zero=True)
    check_positive("transfer_bw", transfer_bw)
    m_job = m_node / nodes
    young = young_interval(ckpt_s, m_job)
    best = best_interval(ckpt_s, m_job)
    tau = young if interval_s is None else check_positive("interval_s", interval_s)
    if tau <= 0:  # C = 0: checkpoints are free, the limit τ → 0 keeps every second
        g_restart = g_best = math.exp(-restart_s / m_job)
    else:
        g_restart = restart_goodput(tau, ckpt_s, restart_s, m_job)
        g_best = restart_goodput(best, ckpt_s, restart_s, m_job) if best > 0 else g_restart
    transfer = state_bytes / transfer_bw
    heal = heal_goodput(dom.count, dom.nodes_each / m_node, restart_s + transfer, step_s,
                        quorum_s, ckpt_s, restart_s)
    return Goodput(nodes=nodes, gpus_per_node=gpus_per_node, gpus=nodes * gpus_per_node,
                   shard_size=shard_size, replicas=nodes * gpus_per_node // shard_size, domains=dom,
                   mtbf_node_s=m_node, job_mtbf_s=m_job, ckpt_s=ckpt_s, restart_s=restart_s,
                   quorum_s=quorum_s, step_s=step_s, state_bytes=state_bytes,
                   transfer_bw=transfer_bw, transfer_s=transfer, young_interval_s=young,
                   daly_interval_s=daly_interval(ckpt_s, m_job), best_interval_s=best,
                   interval_s=tau, restart_goodput=g_restart, restart_best_goodput=g_best,
                   heal=heal)


def goodput_table(nodes_list, **kw) -> list[Goodput]:
    """:func:`goodput_plan` for each cluster size in ``nodes_list`` (the other arguments shared)."""
    return [goodput_plan(n, **kw) for n in nodes_list]


def fmt_duration(s: float) -> str:
    """Seconds as the table shows them: 45 s, 12.5 min, 3.1 h, 41 d, "never"."""
    if not math.isfinite(s):
        return "never"
    if s < 100:
        return f"{s:.3g} s"
    if s < 100 * 60:
        return f"{s / 60:.3g} min"
    if s < 100 * HOUR:
        return f"{s / HOUR:.3g} h"
    if s < 1000 * 24 * HOUR:
        return f"{s / (24 * HOUR):.3g} d"
    return f"{s / (365.25 * 24 * HOUR):,.0f} y"
