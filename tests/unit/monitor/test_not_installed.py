"""Each monitor whose package is missing is refused with one line naming the key, the
package and the install command (the subprocess run of initialize, exit code 2, is in
test_tensorboard.py; here the line of each)."""

from __future__ import annotations

import sys
import types

import pytest

from deepshard.errors import UsageError
from deepshard.monitor.config import get_monitor_config
from deepshard.monitor.monitor import MonitorMaster

CASES = [
    ("tensorboard", "tensorboard", "pip install tensorboard (or pip install "
                                   "'deepshard[monitor]')"),
    ("wandb", "wandb", "pip install wandb"),
    ("comet", "comet_ml", "pip install 'comet_ml>=3.41.0'"),
]


@pytest.mark.parametrize(("section", "package", "install"), CASES)
@pytest.mark.parametrize("rank", [0, 1])
def test_missing_package_is_one_line_on_every_rank(section, package, install, rank,
                                                   monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    cfg = get_monitor_config({section: {"enabled": True}})
    with pytest.raises(UsageError) as info:
        MonitorMaster(cfg, rank=rank)
    err = info.value
    assert err.where == f"{section}.enabled"
    assert err.message == f"the {package} package this monitor needs is not installed"
    assert install in err.hint and f"set {section}.enabled to false" in err.hint
    assert "\n" not in str(err)


def test_an_old_comet_is_refused(monkeypatch):
    old = types.ModuleType("comet_ml")  # not the real one: importing comet_ml patches torch
    old.__version__ = "3.40.2"
    monkeypatch.setitem(sys.modules, "comet_ml", old)
    with pytest.raises(UsageError) as info:
        MonitorMaster(get_monitor_config({"comet": {"enabled": True}}), rank=0)
    assert info.value.message == "comet.enabled needs comet_ml >= 3.41.0, found 3.40.2"
