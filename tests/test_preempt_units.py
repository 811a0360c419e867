"""The stop request each rank keeps (zerodp.train.stop), without processes: which signals count,
the debounce of a Ctrl-C that arrives twice, the grace-period deadline, the agreed decision, and
the replica-group rule (a stop ends the rank at once; tests/test_ft_train.py runs it in processes)."""

import io
import signal
import time

from zerodp.train import stop


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _request(grace_s=30.0):
    ended, clock = [], _Clock()
    req = stop.StopRequest(rank=0, grace_s=grace_s, exit=ended.append, out=io.StringIO(), clock=clock)
    return req, ended, clock


def test_sigterm_requests_a_stop_once_and_repeats_change_nothing():
    req, ended, clock = _request()
    assert not req.requested and req.votes() == (0.0, 0.0)
    req.handle(signal.SIGTERM)
    clock.now += 5
    req.handle(signal.SIGTERM)
    assert req.signal == signal.SIGTERM and req.votes() == (1.0, 0.0) and ended == []
    req.done()


def test_a_ctrl_c_delivered_twice_at_once_is_one_interrupt_and_a_later_one_aborts():
    req, ended, clock = _request()
    req.handle(signal.SIGINT)
    clock.now += 0.05  # the terminal's copy and the launcher's forwarded copy
    req.handle(signal.SIGINT)
    assert req.signal == signal.SIGINT and req.votes() == (0.0, 1.0) and ended == []
    clock.now += stop.DEBOUNCE_S
    req.handle(signal.SIGINT)  # the user pressed Ctrl-C again
    assert ended == [stop.EXIT_FAILED]
    req.done()


def test_sigint_after_sigterm_is_a_first_interrupt_not_an_abort():
    req, ended, clock = _request()
    req.handle(signal.SIGTERM)
    clock.now += 10
    req.handle(signal.SIGINT)
    assert ended == [] and req.signal == signal.SIGTERM
    req.done()


def test_the_grace_period_ends_a_rank_that_did_not_finish_and_only_then():
    req, ended, _ = _request(grace_s=1.0)
    req.handle(signal.SIGTERM)  # the deadline runs on real time: grace - margin = 0.75 s
    time.sleep(0.3)
    assert ended == []
    time.sleep(1.5)
    assert ended == [stop.EXIT_FAILED]
    done, ended2, _ = _request(grace_s=1.0)
    done.handle(signal.SIGTERM)
    done.done()  # the stop completed in time
    time.sleep(1.5)
    assert ended2 == []


def test_the_agreed_stop_and_its_exit_status():
    assert stop.decided(0, 0) is None
    assert stop.decided(0, 2) == signal.SIGINT
    assert stop.decided(1, 1) == signal.SIGTERM  # any SIGTERM makes it a SIGTERM stop
    assert stop.exit_code(signal.SIGTERM) == 143 and stop.exit_code(signal.SIGINT) == 130
    assert stop.margin_s(30) == 5.0 and stop.margin_s(12) == 3.0


def test_under_replica_groups_a_stop_signal_ends_the_rank_at_once_with_one_line():
    # zerodp.ft's rule: the state lives in the live peer groups, so nothing waits for a checkpoint
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        ended, out = [], io.StringIO()
        req = stop.StopRequest(rank=1, grace_s=30.0, exit=ended.append, out=out, saves=False, who="group 1 rank 1")
        req.handle(sig)
        req.handle(signal.SIGTERM)  # a repeat (or the main thread's copy): nothing more
        assert ended == [code] and req.signal == sig
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"zerodp: group 1 rank 1: {sig.name} received: ending now, "
                                                       "without a checkpoint"), lines
