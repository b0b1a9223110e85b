"""ds-run's live view: each rank's step, step rate and loss as the workers report them."""

from __future__ import annotations

import re

from deepshard.launcher.live import StepRate
from tests.helpers import SCRIPTS, run_ds


def test_live_view_shows_each_ranks_loss_and_step_rate():
    result = run_ds("--live", "--num_gpus", "2", str(SCRIPTS / "reporter.py"))
    assert result.returncode == 0, result.stderr
    # the table as drawn last (rich, no terminal: its rows are plain text lines)
    rows = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│|┃]", line) if c.strip()]
        if len(cells) == 9 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    assert sorted(rows) == [0, 1], result.stdout
    for rank, (_, _, state, step, rate, loss, *_rest) in rows.items():
        assert state == "done" and step == "8"
        assert float(loss) == float(f"{0.5 + rank + 8 / 1000:.4g}")
        # 8 steps 0.25 s apart: about 4 steps/s (loose: the 2 cores are shared)
        assert 1.0 < float(rate) < 8.0, rows


def test_step_rate_over_its_window_and_restarts():
    rate = StepRate(window=10.0)
    assert rate.rate() is None
    rate.add(0.0, 0)
    rate.add(0.5, 0)  # the same step again: no new sample
    assert rate.rate() is None
    rate.add(2.0, 4)
    assert rate.rate() == 2.0
    for t in range(3, 30):
        rate.add(float(t), 4 + (t - 2) * 3)
    assert rate.rate() == 3.0  # the first samples fell out of the window
    rate.add(30.0, 1)  # a restarted worker counts from its checkpoint
    assert rate.rate() is None
    rate.add(-5.0, -1)  # no step given: ignored
    rate.add(31.0, 3)
    assert rate.rate() == 2.0
