"""zerodp.ft.goodput's arithmetic on written logs (the schedule itself runs in make chaos): the
restart path keeps the step it stands at (steps thrown away by a restart do not count), the
replica groups count each committed step once with the groups that took part; bad input is one
line."""

import json

from zerodp.ft import goodput


def _bare(cls, out):
    run = object.__new__(cls)
    run.out = out
    return run


def test_restart_path_progress_is_the_step_it_stands_at(tmp_path):
    # steps 1..5, a failure, resumed from the checkpoint of step 3: 4, 5, 6
    recs = [dict(event="step", time=float(t), step=s) for t, s in enumerate([1, 2, 3, 4, 5, 4, 5, 6], start=10)]
    recs.insert(3, dict(event="checkpoint", time=12.5, step=3))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = _bare(goodput._RestartRun, tmp_path)
    assert run.first_step_t() == 10.0
    assert run.position(10.0) == 1 and run.position(14.0) == 5 and run.position(15.0) == 4
    assert run.position(17.0) - run.position(10.0) == 5  # six steps' worth kept, not eight taken


def test_replica_groups_count_each_committed_step_once(tmp_path):
    logs = tmp_path / "ft-logs"
    logs.mkdir()
    rows = {(0, 0): [(0, True, 2, 1.0), (1, True, 2, 2.0), (2, False, 2, 3.0), (2, True, 1, 4.0), (3, True, 2, 5.0)],
            (1, 0): [(0, True, 2, 1.0), (1, True, 2, 2.0), (3, True, 2, 5.0)]}
    for (g, a), steps in rows.items():
        for r in (0, 1):
            lines = [json.dumps(dict(event="step", step=s, committed=c, participants=p, t=t)) for s, c, p, t in steps]
            (logs / f"g{g}-r{r}-a{a}.jsonl").write_text("\n".join(lines) + "\n")
    run = _bare(goodput._FtRun, tmp_path)
    assert run.first_step_t() == 1.0
    assert run.committed_tokens(0.0, 10.0, 100) == (2 + 2 + 1 + 2) * 100
    assert run.committed_tokens(1.5, 4.5, 100) == (2 + 1) * 100


def test_bad_schedule_is_one_line(capsys):
    assert goodput.main(["--every-s", "0"]) == 2
    assert goodput.main(["--micro-batch", "24"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("python -m zerodp.ft.goodput: error:") for line in err)
