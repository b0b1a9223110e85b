"""SSH fan-out at scale: a trivial job on 8, 32, 64 and 128 hosts, four ways.

The hosts are real: network namespaces on this machine, each with its own sshd (the
cluster fixture of the tests, ``tests/cluster/simcluster.py``; needs root, iproute2 and
openssh-server). One worker per host (``benchmarks/trivial.py``), started by

* ``flat``: ds-run's ssh backend contacting every host itself (``--fanout 0``);
* ``tree``: ds-run through ``ceil(sqrt(N))`` relays (``--fanout K``), each starting its
  share of the hosts (:mod:`deepshard.launcher.tree`);
* ``pdsh``: ``pdsh -R ssh -f 256`` running the worker directly;
* ``mpirun``: Open MPI's ``mpirun`` over ssh (its default tree spawn of ``orted``),
  running the worker directly;

alternated in the same run (mpirun in the first ``--mpirun_rounds`` only, without a
warm-up: Open MPI 4.1.4's launch here grows by ~0.7 s per host from 16 hosts up, in its
daemons' wire-up rather than ssh, with or without its tree spawn). Each run's wall time
(start to every worker started and back) and the coordinator's own CPU seconds (the
launcher process and the local processes it waits for: pdsh's and mpirun's ssh clients;
ds-run's ssh is in-process) are recorded; the table gives medians and the ratios to pdsh.
A least-squares model of the coordinator's CPU per host (flat: ``a + b N``; tree:
``a + b K + c N``) projects 1,024 and 4,096 hosts.

    sudo python benchmarks/fanout.py [--rounds 3] [--hosts 8,32,64,128] [--results DIR]

The run's record goes to ``benchmarks/results/fanout.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster.simcluster import SimCluster, missing_tools  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from record import RESULTS, Run  # noqa: E402

TRIVIAL = str(ROOT / "benchmarks" / "trivial.py")
MODES = ("flat", "tree", "pdsh", "mpirun")
PROJECT = (1024, 4096)


def cluster_env(home: Path) -> dict[str, str]:
    """The environment every launcher runs in: the cluster's HOME, its ssh config for pdsh."""
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["HOME"] = str(home)
    # pdsh's ssh reads the same config and known_hosts as ds-run
    env["PDSH_SSH_ARGS_APPEND"] = (f"-F {home}/.ssh/config "
                                   f"-o UserKnownHostsFile={home}/.ssh/known_hosts")
    return env


def ssh_wrapper(home: Path) -> Path:
    """An ssh that reads the cluster's config (mpirun's plm_rsh_agent; OpenSSH reads the
    account's ~/.ssh, not $HOME). The hosts share this filesystem: orted's tree spawn from
    one host to the next uses it too."""
    path = home / "cluster-ssh"
    path.write_text(f'#!/bin/sh\nexec ssh -F {home}/.ssh/config '
                    f'-o UserKnownHostsFile={home}/.ssh/known_hosts "$@"\n')
    path.chmod(0o755)
    return path


def relays(n: int) -> int:
    return math.ceil(math.sqrt(n))


def commands(cluster: SimCluster, n: int) -> dict[str, list[str]]:
    """Each launcher's command for the first ``n`` hosts."""
    ds_run = str(Path(sys.executable).with_name("ds-run"))
    names = [h.name for h in cluster.hosts[:n]]
    hostfile = cluster.hostfile(slots=1, names=names)
    return {
        "flat": [ds_run, "-H", str(hostfile), "--fanout", "0", TRIVIAL],
        "tree": [ds_run, "-H", str(hostfile), "--fanout", str(relays(n)), TRIVIAL],
        "pdsh": ["pdsh", "-R", "ssh", "-f", "256", "-w", ",".join(names),
                 f"{sys.executable} {TRIVIAL}"],
        "mpirun": ["mpirun", "--allow-run-as-root", "--mca", "plm_rsh_agent",
                   str(ssh_wrapper(cluster.home)), "--mca", "oob_tcp_if_include",
                   f"198.18.{cluster.subnet}.0/24", "-H", ",".join(f"{h}:1" for h in names),
                   "-np", str(n), sys.executable, TRIVIAL],
    }


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and the children it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({result.returncode}): {result.stderr[-800:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure_hosts(cluster: SimCluster, n: int, rounds: int, env: dict[str, str],
                  modes: tuple[str, ...], mpirun_rounds: int) -> dict:
    """One row: every launcher on the first ``n`` hosts, alternated round by round."""
    runs = {m: argv for m, argv in commands(cluster, n).items() if m in modes}
    walls: dict[str, list[float]] = {m: [] for m in runs}
    cpus: dict[str, list[float]] = {m: [] for m in runs}
    for mode, argv in runs.items():
        if mode != "mpirun":  # it takes minutes here (see the module docstring)
            timed(argv, env)  # warm-up
            cluster.wait_no_strays(timeout=30)
    for round_ in range(rounds):
        for mode, argv in runs.items():
            if mode == "mpirun" and round_ >= mpirun_rounds:
                continue
            wall, cpu = timed(argv, env)
            walls[mode].append(wall)
            cpus[mode].append(cpu)
            cluster.wait_no_strays(timeout=30)  # the next run starts on quiet hosts
        print(f"  {n} hosts: " + ", ".join(f"{m} {walls[m][-1]:.2f} s / {cpus[m][-1]:.2f} "
                                           "CPU s" for m in runs if walls[m]), flush=True)
    return row(n, walls, cpus)


def row(n: int, walls: dict[str, list[float]], cpus: dict[str, list[float]]) -> dict:
    """The record's row for ``n`` hosts from each launcher's wall and CPU times."""
    out: dict = {"hosts": n, "relays": relays(n)}
    for mode in walls:
        out[f"{mode}_s"] = statistics.median(walls[mode])
        out[f"{mode}_cpu_s"] = statistics.median(cpus[mode])
        out[f"{mode}_wall_s"] = walls[mode]
        out[f"{mode}_cpus_s"] = cpus[mode]
    return out


def fit(rows: list[dict]) -> dict[str, list[float]]:
    """Least-squares coefficients of the coordinator's CPU: flat ``[a, b]`` for
    ``a + b N``, tree ``[a, b, c]`` for ``a + b K + c N`` (K = ceil(sqrt(N)))."""
    import numpy as np

    n = np.array([r["hosts"] for r in rows], dtype=float)
    k = np.array([r["relays"] for r in rows], dtype=float)
    out = {}
    flat = np.array([r["flat_cpu_s"] for r in rows])
    out["flat"] = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), flat, rcond=None)[0]
    tree = np.array([r["tree_cpu_s"] for r in rows])
    out["tree"] = np.linalg.lstsq(np.stack([np.ones_like(n), k, n], 1), tree, rcond=None)[0]
    return {name: [float(c) for c in coef] for name, coef in out.items()}


def project(model: dict[str, list[float]], n: int) -> dict:
    """The model's coordinator CPU seconds at ``n`` hosts."""
    a, b = model["flat"]
    ta, tb, tc = model["tree"]
    k = relays(n)
    return {"hosts": n, "relays": k, "flat_cpu_s": a + b * n,
            "tree_cpu_s": ta + tb * k + tc * n}


def table(rows: list[dict], projected: list[dict]) -> list[str]:
    """The markdown table of ``rows`` and the projection."""
    lines = ["| hosts | relays | flat ssh (s) | tree (s) | pdsh -R ssh (s) | mpirun (s) | "
             "tree / pdsh | coordinator CPU s: flat | tree | pdsh | mpirun | tree / flat |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['hosts']} | {r['relays']} | {r['flat_s']:.2f} | {r['tree_s']:.2f} | "
            f"{r['pdsh_s']:.2f} | {r['mpirun_s']:.2f} | {r['tree_s'] / r['pdsh_s']:.2f} | "
            f"{r['flat_cpu_s']:.2f} | {r['tree_cpu_s']:.2f} | {r['pdsh_cpu_s']:.2f} | "
            f"{r['mpirun_cpu_s']:.2f} | {r['tree_cpu_s'] / r['flat_cpu_s']:.2f} |")
    for p in projected:
        lines.append(f"| {p['hosts']} (projected) | {p['relays']} | | | | | | "
                     f"{p['flat_cpu_s']:.1f} | {p['tree_cpu_s']:.1f} | | | "
                     f"{p['tree_cpu_s'] / p['flat_cpu_s']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hosts", default="8,32,64,128")
    parser.add_argument("--mpirun_rounds", type=int, default=1,
                        help="rounds of mpirun (the first ones; it takes minutes here)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, fanout.json")
    args = parser.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    missing = missing_tools() + [t for t in ("pdsh", "mpirun") if not shutil.which(t)]
    if missing:
        raise SystemExit(f"fanout.py needs {', '.join(missing)}")
    run = Run("fanout", {"rounds": args.rounds, "hosts": counts, "workers_per_host": 1,
                         "script": "benchmarks/trivial.py", "pdsh": "pdsh -R ssh -f 256",
                         "tree_relays": "ceil(sqrt(hosts))",
                         "mpirun": "Open MPI mpirun, rsh (ssh) launcher, tree spawn",
                         "mpirun_rounds": args.mpirun_rounds})
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SimCluster(max(counts), Path(tmp) / "cluster", prefix="dsb", subnet=9)
        try:
            cluster.start()
            env = cluster_env(cluster.home)
            rows = [measure_hosts(cluster, n, args.rounds, env, MODES, args.mpirun_rounds)
                    for n in counts]
        finally:
            cluster.stop()
    model = fit(rows)
    projected = [project(model, n) for n in PROJECT]
    print(f"trivial job, one worker per host, median of {args.rounds} alternating rounds; "
          f"{os.cpu_count()} cores (sshd, agents and workers of every host on this machine "
          "too); coordinator CPU = the launcher and the local children it waits for")
    print(f"model of the coordinator's CPU (s): flat {model['flat'][0]:.3f} + "
          f"{model['flat'][1]:.4f} N; tree {model['tree'][0]:.3f} + {model['tree'][1]:.4f} K "
          f"+ {model['tree'][2]:.4f} N")
    print()
    lines = table(rows, projected)
    print("\n".join(lines))
    run.settings["cpu_model"] = model
    run.settings["projected"] = projected
    run.write(rows, lines, args.results)


if __name__ == "__main__":
    main()
