"""``ds-compat install|uninstall|status``: the explicit, reversible install of deepshard as
``deepspeed`` into an environment (a scratch ``site-packages``/scripts pair here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepshard.compat import distribution
from deepshard.compat import environment as env
from deepshard.contract import deepspeed_distributions
from deepshard.errors import UsageError


@pytest.fixture
def target(tmp_path: Path) -> env.Target:
    return env.Target(tmp_path / "site", tmp_path / "bin")


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_install_writes_the_shim_the_distribution_and_the_command(target, tmp_path):
    written = env.install(target)
    info = target.purelib / distribution.dist_info_name()
    assert set(written) == {target.purelib / "deepspeed" / "__init__.py",
                            *(info / n for n in ("METADATA", "INSTALLER", "top_level.txt",
                                                 "entry_points.txt", "RECORD")),
                            target.scripts / "deepspeed", target.purelib / env.PTH}
    assert (info / "METADATA").read_text() == distribution.metadata_text()
    record = (info / "RECORD").read_text().splitlines()
    assert len(record) == len(written) and record[-1].endswith("RECORD,,")
    assert all(",sha256=" in row for row in record[:-1])
    script = target.scripts / "deepspeed"
    assert script.stat().st_mode & 0o111 and script.read_text().startswith(f"#!{sys.executable}")
    assert deepspeed_distributions([str(target.purelib)]) == [
        (distribution.version(), str(target.purelib.resolve()), True)]
    assert env.describe(target).startswith("active: deepspeed ")


def test_uninstall_removes_exactly_what_install_wrote(target, tmp_path):
    target.purelib.mkdir(parents=True)
    (target.purelib / "other.py").write_text("x = 1\n")
    before = files(tmp_path)
    written = env.install(target)
    removed = env.uninstall(target)
    assert sorted(map(str, removed)) == sorted(str(p.resolve()) for p in written)
    assert files(tmp_path) == before
    assert not (target.purelib / "deepspeed").exists()
    assert env.uninstall(target) == []
    assert env.describe(target).startswith("not installed")


def test_install_again_replaces_the_earlier_install(target):
    env.install(target)
    again = env.install(target)
    assert len(again) == 8 and len(list(target.purelib.glob("deepspeed-*.dist-info"))) == 1


def fake_real_deepspeed(site: Path) -> None:
    info = site / "deepspeed-0.19.8.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n"
                                   "Summary: DeepSpeed library\n")
    (site / "deepspeed").mkdir()
    (site / "deepspeed" / "__init__.py").write_text("")


def test_install_refuses_over_a_real_deepspeed_and_writes_nothing(target, tmp_path):
    fake_real_deepspeed(target.purelib)
    before = files(tmp_path)
    with pytest.raises(UsageError) as info:
        env.install(target)
    assert "DeepSpeed 0.19.8 is installed" in str(info.value)
    assert "pip uninstall deepspeed" in str(info.value)
    assert files(tmp_path) == before
    assert env.describe(target).startswith("not installed: DeepSpeed 0.19.8")


def test_install_refuses_over_a_foreign_deepspeed_package(target):
    (target.purelib / "deepspeed").mkdir(parents=True)
    (target.purelib / "deepspeed" / "__init__.py").write_text("")
    with pytest.raises(UsageError, match="not deepshard's"):
        env.install(target)


def test_the_command_line_says_one_line_with_exit_code_2():
    command = Path(sys.executable).with_name("ds-compat")
    bad = subprocess.run([str(command), "instal"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "HINT" in bad.stderr
    status = subprocess.run([str(command), "status"], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0 and status.stdout.startswith(("not installed", "active"))
