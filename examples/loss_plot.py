"""The loss curve PNG of ``train_gpt.py --plot PATH``: matplotlib only when asked.

``require_matplotlib`` runs before training starts (on every rank, without importing it),
so a missing matplotlib costs one line and exit status 2, not a trained model with no
plot; ``write_loss_plot`` imports it, with the Agg backend, on rank 0 at the end.
"""

from __future__ import annotations

import datetime
import importlib.util
import sys
from pathlib import Path

MISSING = ("train_gpt.py: --plot needs matplotlib, which is not installed: "
           "pip install matplotlib (or pip install 'deepshard[plot]')")


def require_matplotlib() -> None:
    """Exit with status 2 and one line on stderr when matplotlib cannot be imported."""
    if importlib.util.find_spec("matplotlib") is None:
        print(MISSING, file=sys.stderr, flush=True)
        raise SystemExit(2)


def write_loss_plot(path: str | Path, losses: list[tuple[int, float]], title: str) -> Path:
    """Draw ``(step, loss)`` pairs as a line, 800 px wide, into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    steps = [step for step, _ in losses]
    ax.plot(steps, [loss for _, loss in losses], "o-" if len(steps) < 40 else "-",
            markersize=3, color="#1f77b4")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig.text(0.01, 0.01, f"examples/train_gpt.py, {len(steps)} steps, {when}", fontsize=7,
             color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
