"""Launch overhead: wall time of a trivial 2-worker job, ds-run against its peers.

Runs each launcher on the same do-nothing script, alternating them round by round so that
machine noise hits all alike, and prints median wall times and the ratio ds-run / peer.
Peers: torchrun (torch's launcher), the ``deepspeed`` launcher when installed, and one
plain ``python`` process (the floor: no launcher, one worker).

    python benchmarks/launch.py [--rounds 15]

The deepspeed peer is measured when its launcher is in the same environment, e.g.
``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`` into a venv that already has
torch==2.13.0 (build isolation would fetch a CUDA torch to build it).
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

from timing import time_command  # noqa: E402

TRIVIAL = str(HERE / "trivial.py")


def launchers() -> dict[str, list[str]]:
    bindir = Path(sys.executable).parent
    found = {
        "ds-run": [str(bindir / "ds-run"), "--num_gpus", "2", TRIVIAL],
        "torchrun": [str(bindir / "torchrun"), "--nproc_per_node", "2", TRIVIAL],
        "python (1 process)": [sys.executable, TRIVIAL],
    }
    deepspeed = shutil.which("deepspeed", path=str(bindir)) or shutil.which("deepspeed")
    if deepspeed:
        found["deepspeed"] = [deepspeed, "--num_gpus", "2", TRIVIAL]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    runs = launchers()
    for argv in runs.values():  # warm the page cache and .pyc files
        time_command(argv)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, argv in runs.items():
            times[name].append(time_command(argv))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ours = medians["ds-run"]
    print(f"trivial 2-worker job, median of {args.rounds} alternating rounds; "
          f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print()
    print("| launcher | median wall (s) | min (s) | ds-run / launcher |")
    print("|---|---:|---:|---:|")
    for name, median in medians.items():
        print(f"| {name} | {median:.3f} | {min(times[name]):.3f} | {ours / median:.2f} |")


if __name__ == "__main__":
    main()
