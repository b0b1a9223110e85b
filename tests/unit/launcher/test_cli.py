"""The ds-run command line is a public surface: a new or changed flag must be a decision.

When a change to the flags is intended, regenerate the snapshot with
``UPDATE_SNAPSHOTS=1 python -m pytest tests/unit/launcher/test_cli.py`` and review its diff.
"""

from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner

from deepshard.launcher.cli import ds_run
from deepshard.launcher.spawn import likely_local_run

SNAPSHOT = Path(__file__).parent / "snapshots" / "ds_run_help.txt"


def test_help_matches_snapshot():
    result = CliRunner().invoke(ds_run, ["--help"], prog_name="ds-run", terminal_width=100)
    assert result.exit_code == 0
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(result.output)
    assert result.output == SNAPSHOT.read_text()


def test_deepspeed_flag_names_are_accepted():
    """DeepSpeed users' command lines parse unchanged (checked with --dry_run's parser)."""
    names = {opt for p in ds_run.params for opt in getattr(p, "opts", [])}
    for flag in ("-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--num_nodes",
                 "--num_gpus", "--num_accelerators", "--master_port", "--master_addr",
                 "--launcher", "--module", "--no_python", "--no_local_rank",
                 "--bind_cores_to_rank", "--enable_each_rank_log"):
        assert flag in names


def test_early_agent_only_for_local_looking_command_lines():
    assert likely_local_run(["--num_gpus", "2", "train.py", "--lr", "1"])
    assert not likely_local_run(["--hostfile", "hosts", "train.py"])
    assert not likely_local_run(["-H=hosts", "train.py"])
    assert not likely_local_run(["--dry_run", "train.py"])
    assert not likely_local_run(["--help"])
