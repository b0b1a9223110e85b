"""A worker's errors as a user meets them: catchable ``UsageError``s, one line and exit
code 2 when uncaught (also from inside an autograd hook), and a checkpoint save that
hits a full or read-only file system (a real tmpfs of a few hundred KiB) failing on every
rank with one line, leaving no partial directory and the previous tag loadable."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest

import deepshard
from tests.helpers import ROOT, run_ds

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "save_errors.py")


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "deepshard: error:" in line]


def _result(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if " RESULT " in x)
    return json.loads(line.partition(" RESULT ")[2])


@contextlib.contextmanager
def small_filesystem(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (needs root, as CI has)."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: mounting a tmpfs must work")
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_caught_usage_error_lets_the_script_go_on(tmp_path):
    result = run_ds("--num_gpus", "2", SCRIPT, "caught", str(tmp_path / "ckpt"), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    found = _result(result.stdout)
    assert "checkpoint tag 'latest' cannot be a directory name" in found["caught"]
    assert found["steps"] == 2 and not _errors(result.stderr)


def test_an_error_inside_an_autograd_hook_is_one_line_and_exit_2(tmp_path):
    result = run_ds("--num_gpus", "2", SCRIPT, "twice-in-backward", str(tmp_path),
                    timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = _errors(result.stderr)
    assert lines and all("got its gradient twice in one backward" in x for x in lines)
    assert "Traceback" not in result.stderr


def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_last_tag(tmp_path):
    with small_filesystem(tmp_path / "fs", "400k") as fs:
        ckpt = fs / "ckpt"
        good = run_ds("--num_gpus", "2", SCRIPT, "save", str(ckpt), "good", "0", timeout=120)
        assert good.returncode == 0, good.stderr[-2000:]
        full = run_ds("--num_gpus", "2", SCRIPT, "save", str(ckpt), "big", "2", timeout=120)
        assert full.returncode == 2, full.stderr[-2000:]
        lines = _errors(full.stderr)  # every rank raises it; ds-run may stop rank 1 first
        assert lines, full.stderr[-2000:]
        for line in lines:
            assert f"error: {ckpt}/.big.partial/model_states.pt: cannot write the checkpoint: " \
                   "No space left on device. HINT: free space" in line
        assert "Traceback" not in full.stderr
        assert sorted(p.name for p in ckpt.iterdir()) == ["good", "latest", "zero_to_fp32.py"]
        assert (ckpt / "latest").read_text() == "good"
        assert set(deepshard.get_fp32_state_dict(ckpt)) == {"weight", "bias"}


def test_a_read_only_file_system_fails_the_save_with_one_line(tmp_path):
    with small_filesystem(tmp_path / "fs", "2m") as fs:
        ckpt = fs / "ckpt"
        good = run_ds("--num_gpus", "2", SCRIPT, "save", str(ckpt), "good", "0", timeout=120)
        assert good.returncode == 0, good.stderr[-2000:]
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        again = run_ds("--num_gpus", "2", SCRIPT, "save", str(ckpt), "next", "0", timeout=120)
        assert again.returncode == 2, again.stderr[-2000:]
        lines = _errors(again.stderr)
        assert lines and all("cannot write the checkpoint: Read-only file system" in x
                             for x in lines)
        assert sorted(p.name for p in ckpt.iterdir()) == ["good", "latest", "zero_to_fp32.py"]
        assert set(deepshard.get_fp32_state_dict(ckpt)) == {"weight", "bias"}


def test_ranks_saving_into_different_directories_is_one_line(tmp_path):
    # DeepSpeed 0.19.8 writes such a checkpoint split over the directories
    result = run_ds("--num_gpus", "2", SCRIPT, "per-rank-dir", str(tmp_path), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = _errors(result.stderr)
    assert lines and all(f"rank 0 saves into {tmp_path}/rank0 but rank 1 into "
                         f"{tmp_path}/rank1" in x for x in lines)
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())
