"""1-bit Adam and 0/1 Adam against Adam on slow links: step time and bytes on the wire.

Two real hosts (network namespaces on this machine with their own sshd: the cluster fixture
of the tests, ``tests/cluster/simcluster.py``; needs root, iproute2 with ``tc`` and
openssh-server), one rank each, started by ds-run's ssh backend from a hostfile. Each
host's link is capped by ``tc`` (a ``tbf`` qdisc on both ends of its veth: the host's
``eth0`` for what it sends, the bridge side for what it receives), first at 1 Gbit/s, then
at 200 Mbit/s; a timed gloo all-reduce of 25 MB between the hosts checks the cap and its
measured throughput is printed.

On each link two models of ~27M fp32 parameters train (one thread per rank, ZeRO stage 0):
the reference GPT of ``examples/gpt.py`` (micro-batch 2 x 128 tokens) and a wide
few-FLOP model (two Linear layers 4096 -> 3328 -> 4096 with a GeLU, micro-batch 1: its
step is its communication), each with Adam, ``OneBitAdam`` and ``ZeroOneAdam`` (the worker is
``benchmarks/onebit_worker.py``). The compressed optimizers first run ``--freeze-step``
steps (1-bit Adam's uncompressed warm-up, 0/1 Adam's ``var_freeze_step``), then
``--warmup`` untimed and ``--steps`` timed steps; Adam runs the warm-up and timed steps
only. Every timed step has a barrier before and after it. Reported per row:

* s/step: rank 0's median over the timed steps; for 0/1 Adam, whose steps after the
  variance froze alternate between local steps and synchronising ones, the mean over the
  timed window instead (marked ``mean``);
* bytes/step: ``tx_bytes`` of both hosts' ``eth0`` (``/sys/class/net/eth0/statistics``,
  read in the host) over the timed window, divided by its steps: everything both hosts put
  on the wire, the ssh channel of the launcher included;
* the ratios to Adam on the same model and link, and whether the targets are met (at
  200 Mbit/s: compressed steps at least 5x faster than Adam on the wide model and 2x on
  the GPT; bytes at most 1/20 of Adam's).

This measures time and bytes, not convergence: with the variance frozen after two steps,
elements whose early gradients were small get large compressed updates, and the loss of the
1-bit rows can grow within a few steps (every row's last loss is printed). 0/1 Adam's
synchronisation interval reaches 4 steps on the first frozen steps (``ZOADAM``): with
``--warmup 2``, ``--steps`` a multiple of 4 times whole periods, one sync step in four.

    sudo .venv/bin/python benchmarks/onebit.py [--steps 4] [--warmup 2] [--freeze-step 2]
        [--links 1gbit,200mbit] [--models gpt,wide] [--optimizers adam,onebit,zoadam]

The record goes to ``benchmarks/results/onebit.json`` (``benchmarks/record.py``). The caps,
the hosts and every process in them are removed on exit, on failure and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster.simcluster import SimCluster, missing_tools  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from record import RESULTS, Run, loadavg  # noqa: E402

WORKER = str(ROOT / "benchmarks" / "onebit_worker.py")
OPTIMIZERS = {"adam": "Adam", "onebit": "OneBitAdam", "zoadam": "ZeroOneAdam"}
MODULES = {"onebit": "adam.py", "zoadam": "zoadam.py"}  # in deepshard/runtime/optim/onebit/
TBF = ("burst", "256kb", "latency", "100ms")
PROBE_MB = 25
ZOADAM = {"var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 4}
"""0/1 Adam's other params: the interval between synchronisations grows fast (to 4 steps)."""


class JobFailed(Exception):
    """A ds-run job that exited non-zero or wrote no result; the message says why."""


# ---------------------------------------------------------------- the links

def tc(host, *argv: str, inside: bool, check: bool = True) -> None:
    """``tc`` on the host's end (``eth0``, in its namespace) or the bridge's end of its veth."""
    cmd = ["tc", *argv]
    if inside:
        cmd = ["ip", "netns", "exec", host.netns, *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def cap(cluster: SimCluster, rate: str) -> None:
    """Cap every host's link at ``rate`` in both directions."""
    for host in cluster.hosts:
        tc(host, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, *TBF,
           inside=True)
        tc(host, "qdisc", "replace", "dev", f"{host.netns}h", "root", "tbf", "rate", rate,
           *TBF, inside=False)


def uncap(cluster: SimCluster) -> None:
    for host in cluster.hosts:
        tc(host, "qdisc", "del", "dev", "eth0", "root", inside=True, check=False)
        tc(host, "qdisc", "del", "dev", f"{host.netns}h", "root", inside=False, check=False)


# ---------------------------------------------------------------- jobs

def cluster_env(home: Path) -> dict[str, str]:
    """ds-run's environment: the cluster's HOME (ssh config, key, known_hosts), one thread."""
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def job(cluster: SimCluster, worker_args: list[str], out: Path, timeout: float) -> list[dict]:
    """Run the worker on both hosts with ds-run's ssh backend; each rank's result."""
    ds_run = str(Path(sys.executable).with_name("ds-run"))
    argv = [ds_run, "-H", str(cluster.hostfile(slots=1)), "--no_live", WORKER, *worker_args,
            "--iface", "eth0", "--out", str(out)]
    try:
        done = subprocess.run(argv, env=cluster_env(cluster.home), cwd=ROOT, text=True,
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise JobFailed(f"timed out after {timeout:.0f} s") from None
    stray = cluster.wait_no_strays()
    if stray:
        raise JobFailed(f"processes left behind on the hosts: {stray}")
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines()
                 if line.strip()]
        errors = [line for line in lines if "Error" in line or "error:" in line]
        raise JobFailed(f"ds-run exited {done.returncode}: " + (errors or lines or ["?"])[-1])
    try:
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    except (OSError, ValueError) as exc:
        raise JobFailed(f"no result: {exc}") from None


def probe(cluster: SimCluster, link: str, tmp: Path, timeout: float) -> dict:
    """The link's measured throughput: 3 timed all-reduces of PROBE_MB MB between the hosts."""
    ranks = job(cluster, ["--probe-mb", str(PROBE_MB), "--steps", "3"], tmp / f"probe-{link}",
                timeout)
    first = ranks[0]
    seconds = statistics.median(first["s"])
    sent = statistics.median(first["tx"])
    return {"link": link, "allreduce_mb": PROBE_MB, "allreduce_s": seconds,
            "allreduce_s_all": first["s"], "tx_bytes_per_allreduce": sent,
            "rx_bytes_per_allreduce": statistics.median(first["rx"]),
            "mbit_s_per_direction": sent * 8 / seconds / 1e6}


# ---------------------------------------------------------------- rows

def worker_args(model: str, optimizer: str, args: argparse.Namespace) -> list[str]:
    pre = 0 if optimizer == "adam" else args.freeze_step
    return ["--model", model, "--optimizer", optimizer, "--freeze-step", str(args.freeze_step),
            "--zoadam-params", json.dumps(ZOADAM), "--pre", str(pre),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]


def measure(cluster: SimCluster, model: str, optimizer: str, link: str,
            args: argparse.Namespace, tmp: Path) -> dict:
    """One row: the job's timed window, or why there is none."""
    base = {"model": model, "link": link, "optimizer": OPTIMIZERS[optimizer]}
    module = ROOT / "deepshard" / "runtime" / "optim" / "onebit" / MODULES.get(optimizer, "")
    if optimizer in MODULES and not module.is_file():
        return {**base, "status": f"skipped: {module.relative_to(ROOT)} not in this checkout"}
    print(f"{link}: {model} with {OPTIMIZERS[optimizer]} ...", file=sys.stderr, flush=True)
    try:
        ranks = job(cluster, worker_args(model, optimizer, args),
                    tmp / f"{link}-{model}-{optimizer}", args.timeout)
    except JobFailed as exc:
        print(f"  failed: {exc}", file=sys.stderr, flush=True)
        return {**base, "status": f"failed: {exc}"}
    return {**base, **summarize(ranks, optimizer)}


def summarize(ranks: list[dict], optimizer: str) -> dict:
    """The timed window's numbers: rank 0's step times, both hosts' bytes."""
    first = ranks[0]
    timed = first["steps"][first["timed_from"]:]
    times = [s["s"] for s in timed]
    n = len(timed)
    statistic = "mean" if optimizer == "zoadam" else "median"
    step_s = statistics.mean(times) if statistic == "mean" else statistics.median(times)
    return {"status": "ok", "s_per_step": step_s, "statistic": statistic,
            "median_s": statistics.median(times), "mean_s": statistics.mean(times),
            "min_s": min(times), "max_s": max(times), "step_s": times,
            "cpu_s_median_by_rank": [statistics.median(s["cpu_s"] for s in r["steps"][
                r["timed_from"]:]) for r in ranks],
            "bytes_per_step": sum(r["window_tx"] for r in ranks) / n,
            "rx_bytes_per_step": sum(r["window_rx"] for r in ranks) / n,
            "tx_bytes_per_step_by_rank": [r["window_tx"] / n for r in ranks],
            "step_tx_bytes": [s["tx"] for s in timed],
            "timed_steps": n, "compressed_timed_steps": sum(in_phase(s, optimizer) for s in timed),
            "compressed_by_step": [s["compressed"] for s in first["steps"]],
            "phase_by_step": [s["phase"] for s in first["steps"]],
            "all_step_s": [s["s"] for s in first["steps"]],
            "final_loss": finite(timed[-1]["loss"]), "optimizer_class": first["optimizer_class"],
            "params": first["params"]}


def finite(x: float) -> float | str:
    """``x``, or its name when it is not finite (the record stays strict JSON)."""
    return x if math.isfinite(x) else str(x)


def in_phase(step: dict, optimizer: str) -> bool:
    """Whether ``step`` ran in the optimizer's compressed phase: 1-bit Adam compressing,
    0/1 Adam with its variance frozen (its worker record says both)."""
    if optimizer == "zoadam":
        return bool(step["phase"].get("var_frozen"))
    return bool(step["compressed"])


def add_ratios(rows: list[dict]) -> None:
    """``vs_adam`` (Adam's s/step over this row's: the speed-up) and ``bytes_vs_adam``
    (this row's bytes over Adam's) against Adam on the same model and link."""
    adam = {(r["model"], r["link"]): r for r in rows
            if r["optimizer"] == "Adam" and r["status"] == "ok"}
    for r in rows:
        ref = adam.get((r["model"], r["link"]))
        ok = ref is not None and r["status"] == "ok"
        r["vs_adam"] = ref["s_per_step"] / r["s_per_step"] if ok else None
        r["bytes_vs_adam"] = r["bytes_per_step"] / ref["bytes_per_step"] if ok else None


# ---------------------------------------------------------------- report

def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def table(rows: list[dict]) -> list[str]:
    """The markdown table: one line per (model, link, optimizer)."""
    lines = ["| model | link | optimizer | s/step median | vs Adam | bytes/step | bytes vs Adam |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['model']} | {r['link']} | {r['optimizer']} |"
        if r["status"] != "ok":
            lines.append(f"{head} - | - | - | {r['status']} |")
            continue
        step = f"{r['s_per_step']:.3f}" + (" (mean)" if r["statistic"] == "mean" else "")
        speed = f"{r['vs_adam']:.2f}x" if r["optimizer"] != "Adam" and r["vs_adam"] \
            else "1" if r["optimizer"] == "Adam" else "-"
        share = r["bytes_vs_adam"]
        fraction = ("1" if r["optimizer"] == "Adam" else
                    f"{share:.4f} (1/{1 / share:.0f})" if share else "-")
        lines.append(f"{head} {step} | {speed} | {_mib(r['bytes_per_step'])} | {fraction} |")
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    """Each target, against the compressed rows that it concerns: met or missed, measured."""
    out = []
    for r in rows:
        if r["optimizer"] == "Adam" or r["status"] != "ok" or r["vs_adam"] is None:
            continue
        name = f"{r['model']} {r['link']} {r['optimizer']}"
        if r["link"] == "200mbit":
            need = 5.0 if r["model"] == "wide" else 2.0
            out.append(f"{name}: {r['vs_adam']:.2f}x faster than Adam (target >= {need:g}x): "
                       + ("met" if r["vs_adam"] >= need else "MISSED"))
        out.append(f"{name}: bytes 1/{1 / r['bytes_vs_adam']:.1f} of Adam's (target <= 1/20): "
                   + ("met" if r["bytes_vs_adam"] <= 1 / 20 else "MISSED"))
        if r["compressed_timed_steps"] != r["timed_steps"]:
            out.append(f"{name}: only {r['compressed_timed_steps']} of {r['timed_steps']} "
                       "timed steps were in the compressed phase")
    return out


def notes(rows: list[dict]) -> list[str]:
    """Per row: rank 0's timed steps, its CPU seconds in them, the loss at the end."""
    out = []
    for r in rows:
        if r["status"] != "ok":
            continue
        loss = r["final_loss"]
        out.append(f"{r['model']} {r['link']} {r['optimizer']}: timed steps "
                   f"{', '.join(f'{t:.2f}' for t in r['step_s'])} s; CPU per step (median, "
                   f"rank 0) {r['cpu_s_median_by_rank'][0]:.2f} s; last loss "
                   + (f"{loss:.4g}" if isinstance(loss, float) else loss))
    return out


def link_lines(probes: list[dict]) -> list[str]:
    return [f"link {p['link']}: all-reduce of {p['allreduce_mb']} MB fp32 between the hosts "
            f"in {p['allreduce_s']:.3f} s (median of 3), {p['tx_bytes_per_allreduce'] / 1e6:.1f}"
            f" MB sent per host: {p['mbit_s_per_direction']:.0f} Mbit/s per direction"
            for p in probes]


# ---------------------------------------------------------------- main

def run_links(cluster: SimCluster, args: argparse.Namespace, tmp: Path):
    """Every link in turn (capped, checked), every model and optimizer on it; (probes, rows)."""
    probes, rows = [], []
    for link in args.links:
        cap(cluster, link)
        probes.append(probe(cluster, link, tmp, args.timeout))
        print(link_lines(probes[-1:])[0], file=sys.stderr, flush=True)
        for model in args.models:
            rows += [measure(cluster, model, opt, link, args, tmp) for opt in args.optimizers]
    return probes, rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps before them (after the freeze steps)")
    parser.add_argument("--freeze-step", type=int, default=2,
                        help="OneBitAdam freeze_step and ZeroOneAdam var_freeze_step")
    parser.add_argument("--links", default="1gbit,200mbit", help="tc rates, in order")
    parser.add_argument("--models", default="gpt,wide")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, onebit.json")
    args = parser.parse_args()
    args.links, args.models, args.optimizers = (
        [x for x in value.split(",") if x] for value in (args.links, args.models,
                                                          args.optimizers))
    bad = sorted(set(args.models) - {"gpt", "wide"}) + sorted(set(args.optimizers) -
                                                             set(OPTIMIZERS))
    if bad:
        parser.error(f"unknown model or optimizer {bad[0]!r}")
    return args


def settings(args: argparse.Namespace) -> dict:
    return {"steps": args.steps, "warmup": args.warmup, "freeze_step": args.freeze_step,
            "links": args.links, "models": args.models,
            "optimizers": [OPTIMIZERS[o] for o in args.optimizers], "hosts": 2,
            "ranks_per_host": 1, "threads_per_rank": 1, "lr": 1e-4, "zero_stage": 0,
            "micro_batch": {"gpt": "2 x 128 tokens", "wide": 1},
            "wide_model": "Linear(4096, 3328) -> GeLU -> Linear(3328, 4096), MSE",
            "zoadam_params": ZOADAM, "tc": "tbf rate <link> " + " ".join(TBF)
            + " on eth0 (in the host) and the bridge side of each veth",
            "bytes": "tx_bytes of both hosts' eth0 over the timed window / timed steps",
            "s_per_step": "rank 0's median of the timed steps (ZeroOneAdam: mean)"}


def optimizer_sources() -> list[str]:
    """``git status --porcelain`` of the 1-bit optimizers' folder: what ran that was not
    committed (the record's ``uncommitted`` lists tracked files only)."""
    done = subprocess.run(["git", "status", "--porcelain", "--", "deepshard/runtime/optim/onebit"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    return [line for line in done.stdout.splitlines() if line.strip()]


def main() -> None:
    args = parse_args()
    missing = missing_tools() + ([] if Path("/usr/sbin/tc").exists() else ["tc"])
    if missing:
        raise SystemExit(f"onebit.py needs {', '.join(missing)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up as on Ctrl-C
    run = Run("onebit", {**settings(args), "onebit_sources_not_committed": optimizer_sources()})
    with tempfile.TemporaryDirectory(prefix="onebit-bench-") as tmp:
        cluster = SimCluster(2, Path(tmp) / "cluster", prefix="dsob", subnet=13)
        try:
            cluster.start()
            probes, rows = run_links(cluster, args, Path(tmp))
        finally:
            uncap(cluster)
            cluster.stop()
    add_ratios(rows)
    run.settings["links_measured"] = probes
    print(f"2 hosts (network namespaces, one rank each, 1 thread), {os.cpu_count()} cores, "
          f"load average {' '.join(f'{x:.2f}' for x in run.loadavg_start)} at the start, "
          f"{' '.join(f'{x:.2f}' for x in loadavg())} at the end; {args.steps} timed steps "
          f"after {args.warmup} warm-up (and {args.freeze_step} freeze steps for the 1-bit "
          "optimizers); s/step is rank 0's, bytes are both hosts' tx; vs Adam is Adam's "
          "s/step over the row's (the speed-up), bytes vs Adam the row's bytes over Adam's")
    print("\n".join(link_lines(probes)))
    print()
    lines = table(rows)
    print("\n".join(lines))
    print()
    print("\n".join(verdicts(rows)))
    print()
    print("\n".join(notes(rows)))
    run.write(rows, lines, args.results)


if __name__ == "__main__":
    main()
