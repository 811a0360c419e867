"""One uninterrupted ``zerodp train`` run per configuration, shared by the test modules that compare
an interrupted run with it (test_preempt.py, test_chaos_short.py): started in the background the
first time a test asks for it, waited for when a test needs its result."""

from zerodp.train.chaos import RUN, Launch, env_with

STEPS = 60
CKPT_EVERY = 10
_RUNS: dict = {}


def straight(tmp_path_factory, limit_s: float = 360):
    """A function that waits for the uninterrupted run (``RUN``, ``STEPS`` steps) and returns its
    run directory."""
    if "run" not in _RUNS:
        out = tmp_path_factory.mktemp("straight") / "run"
        _RUNS["run"] = out, Launch([*RUN, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
                                    "--out", str(out)], env_with(None), [])
    out, launch = _RUNS["run"]

    def wait():
        if launch.ended is None:
            rc = launch.wait(limit_s)
            assert rc == 0, "\n".join(ln.text for ln in launch.lines)[-3000:]
        assert launch.proc.returncode == 0
        return out
    return wait
