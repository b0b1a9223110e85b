"""examples/train_gpt.py --plot: the loss curve PNG, and the one-line exit 2 (before any
training) where matplotlib is missing."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import loss_plot


def _no_matplotlib(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))


def test_without_matplotlib_plot_is_one_line_and_exit_2_before_training(monkeypatch, capsys):
    import train_gpt

    _no_matplotlib(monkeypatch)
    monkeypatch.setattr(train_gpt, "GPT", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exc:
        train_gpt.main(["--plot", "loss.png", "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == loss_plot.MISSING + "\n" and "pip install matplotlib" in err


def test_the_loss_curve_is_a_png_of_readme_width(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = loss_plot.write_loss_plot(tmp_path / "sub" / "loss.png",
                                     [(1, 9.0), (2, 8.7), (3, 8.1)], "a title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[:2] == (400, 800)
