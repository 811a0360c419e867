"""``zerodp plan-auto-regret``: how good is ``zerodp train --plan auto``'s choice, measured.

For each setting (a model preset, a sequence length and a global batch in tokens) on ``--nproc``
local ranks:

1. **The plan-auto choice**, exactly as ``zerodp train --plan auto`` makes it
   (:func:`zerodp.train.autoplan.choose`): calibrate this machine for the setting's preset (or
   take ``--profile``), ask ``recommend`` for its top 3 (and the fastest of a stage they lack,
   when within reach), trial them, keep the measured best.
2. **A separate measurement** of every configuration of the planner's top ``--top`` (K ≥ 3; all
   that fit when fewer do), and of plan-auto's extra candidate when it tried one, so that its pick
   is always measured, with the same trial (:func:`zerodp.train.autoplan.run_trial`: each
   candidate trained a few steps, round-robin, median of the steps after each round's first).
3. **The figures** (:func:`result`), all from measurement 2, so that the choice is judged on
   timings it did not see: *regret* = measured step of plan-auto's pick / best measured step among
   the K; the planner's #1 the same way (what ``--plan auto`` would lose without its trial); the
   *prediction error* of the pick = predicted / measured step − 1.

The table and ``OUT/plan-auto-regret.json`` keep every candidate's timings.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from zerodp.train.autoplan import ROUNDS, TOP, Trial, layout, measured_best

#: model:seq-len:global-batch-tokens, small enough for 2 CPU ranks on gloo (a few minutes in all)
DEFAULT_SETTINGS = "nano:64:4096,nano:32:1024,tiny:64:4096,tiny:128:8192"
DEFAULT_TOP = 6
GOAL = 1.10  # regret the choice should stay within (issue 37)
RESULT_FILE = "plan-auto-regret.json"


@dataclass(frozen=True)
class Setting:
    preset: str
    seq_len: int
    global_batch_tokens: int

    @property
    def label(self) -> str:
        """``tiny 64×128``: preset, sequences × tokens per sequence in a step."""
        return f"{self.preset} {self.global_batch_tokens // self.seq_len}×{self.seq_len}"

    @property
    def slug(self) -> str:
        return f"{self.preset}-s{self.seq_len}-t{self.global_batch_tokens}"


def parse_settings(text: str) -> list[Setting]:
    """``--settings``: comma-separated ``MODEL:SEQ_LEN:GLOBAL_BATCH_TOKENS``."""
    from zerodp.train.config import PRESET_NAMES

    out = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"--settings: {item!r} is not MODEL:SEQ_LEN:GLOBAL_BATCH_TOKENS "
                             "(e.g. nano:64:4096)")
        s = Setting(parts[0], int(parts[1]), int(parts[2]))
        if s.preset not in PRESET_NAMES:
            raise ValueError(f"--settings: unknown model {s.preset!r}; use one of {', '.join(PRESET_NAMES)}")
        if s.seq_len < 1 or s.global_batch_tokens % s.seq_len:
            raise ValueError(f"--settings: {item}: the global batch must be a whole number of "
                             f"sequences of {s.seq_len} tokens")
        out.append(s)
    if not out:
        raise ValueError("--settings is empty")
    if len(set(out)) != len(out):
        raise ValueError(f"--settings lists a setting twice: {text!r}")
    return out


@dataclass(frozen=True)
class Result:
    """One setting: plan-auto's own trial (``choice``: the top 3, and the fastest of a stage they
    lack when within reach) and the separate measurement of the top K and that extra candidate
    (``measured``), each a list of :class:`~zerodp.train.autoplan.Trial`."""

    setting: Setting
    choice: tuple
    measured: tuple
    wall_s: float = float("nan")
    rounds: int = ROUNDS  # of the measurement

    def spread(self, t: Trial) -> float:
        """How far one candidate's rounds disagree: (slowest − fastest round's median step) / its
        measured step (0: the rounds agree; the noise a regret should be read against)."""
        n = len(t.steps) // self.rounds
        if n == 0:
            return float("nan")
        medians = [statistics.median(t.steps[i * n:(i + 1) * n]) for i in range(self.rounds)]
        return (max(medians) - min(medians)) / t.measured_s

    @property
    def noise(self) -> float:
        """The median over the measured candidates of :meth:`spread`."""
        return statistics.median(self.spread(t) for t in self.measured)

    def _in_measured(self, t: Trial) -> Trial:
        return next(m for m in self.measured if (m.stage, m.micro_batch) == (t.stage, t.micro_batch))

    @property
    def pick(self) -> Trial:
        """Plan-auto's choice (the best of its own trial), with its timing from the measurement."""
        return self._in_measured(measured_best(list(self.choice)))

    @property
    def first(self) -> Trial:
        """The planner's #1, as measured."""
        return next(m for m in self.measured if m.rank == 1)

    @property
    def best(self) -> Trial:
        return measured_best(list(self.measured))

    @property
    def regret(self) -> float:
        """Measured step of plan-auto's pick / best measured step of the top K."""
        return self.pick.measured_s / self.best.measured_s

    @property
    def first_regret(self) -> float:
        return self.first.measured_s / self.best.measured_s

    @property
    def prediction_error(self) -> float:
        """Predicted / measured step of the pick − 1 (negative: the planner predicted too short)."""
        return self.pick.predicted_s / self.pick.measured_s - 1

    def to_dict(self) -> dict:
        def trials(ts):
            return [dict(asdict(t), steps=list(t.steps)) for t in ts]

        return dict(setting=asdict(self.setting), label=self.setting.label, wall_s=self.wall_s,
                    regret=self.regret, first_regret=self.first_regret,
                    prediction_error=self.prediction_error, meets_goal=self.regret <= GOAL,
                    rounds=self.rounds, round_spread=self.noise,
                    pick=dict(stage=self.pick.stage, micro_batch=self.pick.micro_batch),
                    best=dict(stage=self.best.stage, micro_batch=self.best.micro_batch),
                    choice=trials(self.choice), measured=trials(self.measured))


def _short(t: Trial) -> str:
    """``#2 s1 mb32``: the planner's rank, stage and micro-batch per rank."""
    return f"#{t.rank} s{t.stage} mb{t.micro_batch}"


def table(results: list[Result]) -> str:
    """The regret and prediction-error table (times in ms per step)."""
    from zerodp.plan._common import table as plain_table

    rows = []
    for r in results:
        rows.append([r.setting.label, len(r.measured), _short(r.first), _short(r.pick), _short(r.best),
                     f"{r.pick.measured_s * 1e3:.1f}", f"{r.best.measured_s * 1e3:.1f}",
                     f"{r.regret:.3f}", f"{r.first_regret:.3f}", f"{r.pick.predicted_s * 1e3:.1f}",
                     f"{r.prediction_error * 100:+.1f}%", f"{r.noise * 100:.0f}%",
                     "yes" if r.regret <= GOAL else "NO"])
    head = ("plan auto, measured: regret = measured step of its pick / best measured step of the "
            "planner's top K (times: ms per step)")
    text = plain_table(["setting", "K", "planner #1", "plan-auto pick", "measured best", "pick ms",
                        "best ms", "regret", "#1 regret", "pick predicted ms", "pred. error",
                        "round spread", f"regret <= {GOAL:.2f}"], rows, title=head, align="lrllllrrrrrrrl")
    legend = ("setting: model, sequences × tokens per sequence per step; #r sS mbM: the planner's "
              "rank r, stage S, micro-batch M per rank; pred. error: predicted / measured step of "
              "the pick - 1; round spread: median over the K of (slowest - fastest round) / the "
              "candidate's step, the noise to read the regret against")
    return text + "\n" + legend


def measure(setting: Setting, nproc: int, top: int, out: Path, profile: str | None = None,
            say=print, rounds: int = ROUNDS) -> Result:
    """Steps 1-2 of the module docstring for one setting; trial directories go under ``out``.
    ``rounds``: of the measurement (plan-auto's own trial keeps its :data:`ROUNDS`)."""
    from zerodp.train import autoplan
    from zerodp.train.config import TrainConfig
    from zerodp.train.launch import validate

    t0 = time.perf_counter()
    cfg = TrainConfig(preset=setting.preset, seq_len=setting.seq_len,
                      global_batch_tokens=setting.global_batch_tokens, nproc=nproc, profile=profile,
                      out=str(out), progress=False)
    validate(replace(cfg, micro_batch=1), nproc)  # the batch's own checks, before calibration
    say(f"== {setting.label}: the plan-auto choice (zerodp train --plan auto --model {setting.preset} "
        f"--seq-len {setting.seq_len} --global-batch-tokens {setting.global_batch_tokens} --nproc {nproc})")
    _, record = autoplan.choose(cfg, out, say=say, progress=f"  [{setting.label}] plan-auto trial ")
    choice = tuple(_trial(c) for c in record["candidates"])
    rec, trials = autoplan.candidates(cfg, record["profile"], top=top)
    # plan-auto also tries the fastest of a stage its top lacks (autoplan step 3): measured too,
    # so that its pick is always among the measured candidates
    ranked = {(t.stage, t.micro_batch) for t in trials}
    extra = [replace(t, measured_s=float("nan"), steps=()) for t in choice if (t.stage, t.micro_batch) not in ranked]
    trials += extra
    say(f"== {setting.label}: measuring the planner's top {len(trials) - len(extra)} of {rec.searched}"
        + "".join(f" and #{t.rank}" for t in extra) + " with the same trial"
        + (f", {rounds} rounds" if rounds != ROUNDS else ""))
    measured = autoplan.run_trial(cfg, trials, out, progress=f"  [{setting.label}] measurement ", rounds=rounds)
    result = Result(setting, choice, tuple(measured), time.perf_counter() - t0, rounds)
    say(f"== {setting.label}: pick {layout(result.pick)}, regret {result.regret:.3f}, "
        f"prediction error {result.prediction_error * 100:+.1f}% ({result.wall_s:.0f} s)")
    return result


def _trial(d: dict) -> Trial:
    return Trial(**dict(d, steps=tuple(d.get("steps", ()))))


def machine() -> str:
    """``2 cores, load 1.9/2.2/1.5 (1/5/15 min), backend gloo``: what the timings ran on."""
    import torch

    load = "/".join(f"{v:.1f}" for v in os.getloadavg())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return f"{os.cpu_count()} cores, load {load} (1/5/15 min), backend {backend}"


def run(settings: list[Setting], nproc: int, top: int, out: Path, profile: str | None = None,
        say=print, rounds: int = ROUNDS) -> list[Result]:
    """Every setting in turn; writes ``out/plan-auto-regret.json``."""
    if top < TOP:
        raise ValueError(f"--top must be >= {TOP}: the measurement covers at least plan-auto's own candidates")
    if rounds < 2:
        raise ValueError("--rounds must be >= 2: the round spread compares rounds")
    out.mkdir(parents=True, exist_ok=True)
    start = machine()
    t0 = time.perf_counter()
    results = [measure(s, nproc, top, out / s.slug, profile, say, rounds) for s in settings]
    record = dict(nproc=nproc, top=top, rounds=rounds, goal=GOAL, machine_before=start, machine_after=machine(),
                  wall_s=time.perf_counter() - t0, results=[r.to_dict() for r in results])
    (out / RESULT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return results
