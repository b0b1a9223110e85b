"""ds-run names a straggler: a rank SIGSTOPped for part of every step of a synchronous
loop, whose step rate is the same as everyone's (the all-reduce waits for it)."""

from __future__ import annotations

import json
import os
import re

from tests.helpers import SCRIPTS, run_ds


def test_a_rank_stopped_for_part_of_each_step_is_named(tmp_path):
    summary = tmp_path / "job.json"
    result = run_ds("--live", "--num_gpus", "3", "--summary_json", str(summary),
                    str(SCRIPTS / "straggler.py"), timeout=90,
                    env={**os.environ, "COLUMNS": "160"})  # rich: no cell cut short
    assert result.returncode == 0, result.stderr
    named = [line for line in result.stderr.splitlines() if "straggler" in line]
    assert len(named) == 1, result.stderr  # once, and never cleared
    assert named[0].startswith("ds-run: straggler: rank 1 on localhost (localhost:1) ")
    # the live view as drawn last (rich, no terminal: its rows are plain text lines)
    states = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│|┃]", line) if c.strip()]
        if len(cells) == 9 and cells[0].isdigit():
            states[int(cells[0])] = cells[2]
    assert states[0] == states[2] == "done", result.stdout
    assert re.fullmatch(r"done, slow \d+\.\dx", states[1]), result.stdout

    data = json.loads(summary.read_text())
    assert (data["exit_code"], data["failure"], data["stragglers"]) == (0, None,
                                                                        ["localhost:1"])
    ranks = data["ranks"]
    assert sorted(ranks) == ["0", "1", "2"]
    for stats in ranks.values():
        assert stats["step_s"]["count"] >= 20 and stats["own_work_s"]["count"] >= 20
        assert 0 < stats["step_s"]["median"] <= stats["step_s"]["p90"] <= stats["step_s"]["max"]
    # every rank's step takes as long (the collective waits); only rank 1 works longer
    own = {r: s["own_work_s"]["median"] for r, s in ranks.items()}
    assert own["1"] > 2 * max(own["0"], own["2"]), own
    assert [ranks[r]["straggler"] for r in "012"] == [False, True, False]
    (verdict,) = data["verdicts"]
    assert (verdict["host"], verdict["rank"], verdict["straggler"]) == ("localhost", 1, True)


def test_summary_is_written_when_the_job_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('bye', flush=True)\nsys.exit(3)\n")
    summary = tmp_path / "job.json"
    result = run_ds("--summary_json", str(summary), str(script), timeout=60)
    assert result.returncode == 3
    data = json.loads(summary.read_text())
    assert data["exit_code"] == 3 and data["succeeded"] is False
    assert data["failure"]["rank"] == 0 and data["failure"]["reason"] == "exit code 3"
    assert data["stragglers"] == []
