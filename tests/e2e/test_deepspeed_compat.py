"""``ds-run --deepspeed_compat``: an unedited DeepSpeed script runs on deepshard."""

from __future__ import annotations

from deepshard.compat import distribution
from tests.helpers import SCRIPTS, run_ds, tagged_json

SCRIPT = str(SCRIPTS / "deepspeed_user.py")


def test_a_deepspeed_script_joins_the_job():
    result = run_ds("--num_gpus", "2", "--deepspeed_compat", SCRIPT)
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = tagged_json(result.stdout, "COMPAT")
    assert sorted(ranks) == [0, 1]
    for rank, (prefix, data) in ranks.items():
        assert prefix == f"[localhost:{rank}]"
        assert data == {"rank": rank, "world": 2, "local_rank": rank, "module": "deepshard",
                        "warmup": "deepshard.runtime.lr_schedules",
                        "deepspeed_distribution": distribution.version()}


def test_a_missing_deepspeed_module_is_one_line_per_rank():
    result = run_ds("--num_gpus", "2", "--deepspeed_compat", SCRIPT, "missing")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [x for x in result.stderr.splitlines() if "deepshard: error:" in x]
    expected = "deepspeed.inference.v2: no deepshard counterpart for DeepSpeed-FastGen"
    assert lines and all(expected in x for x in lines)
    assert "Traceback" not in result.stderr
