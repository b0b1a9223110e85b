"""SSH fan-out: time to start (and finish) a trivial job on 1, 4, 16 and 32 hosts.

The hosts are real: network namespaces on this machine, each with its own sshd (the
cluster fixture of the tests, ``tests/cluster/simcluster.py``; needs root, iproute2 and
openssh-server). ds-run's ssh backend (one agent per host, which starts the worker) runs
against ``pdsh -R ssh`` running the worker directly, alternated in the same run; the table
gives medians and the ratio ds-run / pdsh.

    sudo python benchmarks/fanout.py [--rounds 5] [--hosts 1,4,16,32] [--results DIR]

The run's record goes to ``benchmarks/results/fanout.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster.simcluster import SimCluster, missing_tools  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from record import RESULTS, Run  # noqa: E402
from timing import time_command  # noqa: E402

TRIVIAL = str(ROOT / "benchmarks" / "trivial.py")


def cluster_env(home: Path) -> dict[str, str]:
    """The environment both launchers run in: the cluster's HOME, its ssh config for pdsh."""
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["HOME"] = str(home)
    # pdsh's ssh reads the same config and known_hosts as ds-run
    env["PDSH_SSH_ARGS_APPEND"] = (f"-F {home}/.ssh/config "
                                   f"-o UserKnownHostsFile={home}/.ssh/known_hosts")
    return env


def measure_hosts(cluster: SimCluster, n: int, rounds: int, env: dict[str, str]) -> dict:
    """One row: wall times of ds-run and pdsh on the first ``n`` hosts, alternated."""
    ds_run = str(Path(sys.executable).with_name("ds-run"))
    names = [h.name for h in cluster.hosts[:n]]
    hostfile = cluster.hostfile(slots=1, names=names)
    runs = {
        "ds-run": [ds_run, "-H", str(hostfile), TRIVIAL],
        "pdsh": ["pdsh", "-R", "ssh", "-f", "256", "-w", ",".join(names),
                 f"{sys.executable} {TRIVIAL}"],
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for argv in runs.values():
        time_command(argv, env=env, cwd=ROOT)  # warm-up
    for _ in range(rounds):
        for name, argv in runs.items():
            times[name].append(time_command(argv, env=env, cwd=ROOT))
    return row(n, times)


def row(n: int, times: dict[str, list[float]]) -> dict:
    """The record's row for ``n`` hosts from both launchers' wall times."""
    ds, pdsh = statistics.median(times["ds-run"]), statistics.median(times["pdsh"])
    return {"hosts": n, "ds_run_s": ds, "pdsh_s": pdsh, "ds_run_over_pdsh": ds / pdsh,
            "ds_run_wall_s": times["ds-run"], "pdsh_wall_s": times["pdsh"]}


def table(rows: list[dict]) -> list[str]:
    """The markdown table of ``rows``."""
    lines = ["| hosts | ds-run ssh (s) | pdsh -R ssh (s) | ds-run / pdsh |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['hosts']} | {r['ds_run_s']:.3f} | {r['pdsh_s']:.3f} | "
              f"{r['ds_run_over_pdsh']:.2f} |" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hosts", default="1,4,16,32")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, fanout.json")
    args = parser.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    missing = missing_tools() + ([] if shutil.which("pdsh") else ["pdsh"])
    if missing:
        raise SystemExit(f"fanout.py needs {', '.join(missing)}")
    run = Run("fanout", {"rounds": args.rounds, "hosts": counts, "workers_per_host": 1,
                         "script": "benchmarks/trivial.py", "pdsh": "pdsh -R ssh -f 256"})
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SimCluster(max(counts), Path(tmp) / "cluster", prefix="dsb", subnet=9)
        try:
            cluster.start()
            env = cluster_env(cluster.home)
            rows = [measure_hosts(cluster, n, args.rounds, env) for n in counts]
        finally:
            cluster.stop()
    print(f"trivial job, one worker per host, median of {args.rounds} alternating rounds; "
          f"{os.cpu_count()} cores (sshd of every host on this machine too)")
    print()
    lines = table(rows)
    print("\n".join(lines))
    run.write(rows, lines, args.results)


if __name__ == "__main__":
    main()
