"""Launch overhead: wall time of a trivial 2-worker job, ds-run against its peers.

Runs each launcher on the same do-nothing script, alternating them round by round so that
machine noise hits all alike, and prints median wall times and the ratio ds-run / peer.
Peers: torchrun (torch's launcher), the ``deepspeed`` launcher when installed, and one
plain ``python`` process (the floor: no launcher, one worker).

    python benchmarks/launch.py [--rounds 15] [--results DIR]

The deepspeed peer is measured when its launcher is in this environment, or beside
``--deepspeed-python`` (default /tmp/dsvenv/bin/python, the side venv the other benchmarks
use), or on PATH, e.g. ``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`` into a
venv that already has torch==2.13.0 (build isolation would fetch a CUDA torch to build it).
The run's record goes to ``benchmarks/results/launch.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from record import RESULTS, Run  # noqa: E402
from timing import time_command  # noqa: E402

TRIVIAL = str(HERE / "trivial.py")
DEFAULT_DS_PYTHON = "/tmp/dsvenv/bin/python"


def launchers(ds_python: str = DEFAULT_DS_PYTHON) -> dict[str, list[str]]:
    """Each peer's command line for the trivial 2-worker job, by name. The ``deepspeed``
    launcher is looked for beside this interpreter, then beside ``ds_python``, then on PATH."""
    bindir = Path(sys.executable).parent
    found = {
        "ds-run": [str(bindir / "ds-run"), "--num_gpus", "2", TRIVIAL],
        "torchrun": [str(bindir / "torchrun"), "--nproc_per_node", "2", TRIVIAL],
        "python (1 process)": [sys.executable, TRIVIAL],
    }
    deepspeed = (shutil.which("deepspeed", path=str(bindir))
                 or shutil.which("deepspeed", path=str(Path(ds_python).parent))
                 or shutil.which("deepspeed"))
    if deepspeed:
        found["deepspeed"] = [deepspeed, "--num_gpus", "2", TRIVIAL]
    return found


def measure(runs: dict[str, list[str]], rounds: int) -> dict[str, list[float]]:
    """Wall times per peer: one warm-up each, then ``rounds`` rounds in alternation."""
    for argv in runs.values():  # warm the page cache and .pyc files
        time_command(argv)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, argv in runs.items():
            times[name].append(time_command(argv))
    return times


def rows(runs: dict[str, list[str]], times: dict[str, list[float]]) -> list[dict]:
    """One row per launcher: its wall times, median, minimum and ds-run / launcher."""
    ours = statistics.median(times["ds-run"])
    return [{"launcher": name, "argv": runs[name], "wall_s": values,
             "median_s": statistics.median(values), "min_s": min(values),
             "ds_run_over": ours / statistics.median(values)}
            for name, values in times.items()]


def table(rows: list[dict]) -> list[str]:
    """The markdown table of ``rows``."""
    lines = ["| launcher | median wall (s) | min (s) | ds-run / launcher |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['launcher']} | {r['median_s']:.3f} | {r['min_s']:.3f} | "
              f"{r['ds_run_over']:.2f} |" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                        help="an interpreter whose bin folder holds the deepspeed launcher")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, launch.json")
    args = parser.parse_args()
    runs = launchers(args.deepspeed_python)
    run = Run("launch", {"rounds": args.rounds, "workers": 2, "script": "benchmarks/trivial.py",
                         "launchers": sorted(runs)})
    result = rows(runs, measure(runs, args.rounds))
    print(f"trivial 2-worker job, median of {args.rounds} alternating rounds; "
          f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print()
    lines = table(result)
    print("\n".join(lines))
    run.write(result, lines, args.results)


if __name__ == "__main__":
    main()
