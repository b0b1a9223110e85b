"""Elastic training: seconds from a node's death to steps on the survivors, and from its
return to steps on every host, ds-run --elastic_training beside torchrun (c10d rendezvous).

The hosts are real: network namespaces on this machine, each with its own sshd, address and
hostname (the cluster fixture of the tests, ``tests/cluster/simcluster.py``; needs root,
iproute2 and openssh-server), one slot each. Both jobs run the same kind of script
(``benchmarks/elastic_worker.py``): a ``Linear(4, 1)`` with Adam at a constant global batch
(``lcm(N-1, N)`` samples, micro batch 1, so the accumulation follows the world size) that
checkpoints after every step and resumes from its latest checkpoint when started again:

* ds-run: ``ds-run -H hostfile --elastic_training --min_elastic_nodes N-1`` from this
  machine (its ssh backend, one agent per host); the script is a deepshard script
  (``save_checkpoint`` / ``load_checkpoint``: deepshard reshards to the new world size).
* torchrun: one ``torchrun --nnodes N-1:N --nproc-per-node 1 --rdzv-backend c10d
  --rdzv-endpoint <host 1>:29400 --max-restarts 10`` per host, started over ssh as a torchrun
  user starts them, with its rendezvous defaults (``--rdzv-conf`` adds options); the script
  is plain torch DDP over gloo that ``torch.save``-s model, optimizer and step itself.
  Its workers get ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's default (the
  workers' process group on the agents' shared TCPStore, ``--share-store``) the survivors'
  next round reads the previous round's gloo addresses from that store and fails to
  connect, round after round (pytorch/pytorch#135712), so the job never shrinks.

Each run: start the job on N hosts and wait for step 3 on all N; kill every process of
host 2 at once, its sshd too (``SimCluster.kill_host``: the node is gone); **shrink** is
the time from the kill to the first ``STEP`` line of the job at world N-1. After two more
steps host 2 returns: its sshd starts again (``restart_sshd``) and, for torchrun, its
torchrun is started again over ssh (what a node restart brings back; ds-run finds the
node itself by probing it every ``--probe-interval`` s); **grow** is the time from that
return to the first ``STEP`` line at world N. Then two more steps, and the job is ended
through a stop file that every rank sees at the same step (every launcher must exit 0 and
leave no process behind on any host). The times are taken in this process when the
line arrives: both jobs' lines come over the same kind of ssh channel.

Also reported: the launcher's part of each phase (until rank 0 of the new world prints
``BOOT``, before it imports torch: detection, teardown, re-rendezvous, process start; the
rest is the script's own start: imports, process group, checkpoint load, a step), the
seconds the resumed job's ``load_checkpoint`` / ``torch.load`` took
(rank 0's), the steps run again after the kill (the checkpoint's step against the last
step seen: 0 means nothing lost), and for ds-run when it logged the node's departure
and return (``ds-run: elastic: ... left`` / ``joined``). The target: shrink within
``--monitor_timeout`` + 5 s + the checkpoint load, and faster than torchrun's. The
monitor timeout is not on the shrink's path (a killed host's ssh channel is seen to close
within milliseconds); its 10 s default is above ds-run's 5 s stop grace because before
commit 538d1db the coordinator declared survivors that were busy stopping their workers
lost too when it was shorter.

    sudo .venv/bin/python benchmarks/elastic.py [--hosts 3,8] [--launchers ds-run,torchrun]
        [--monitor-timeout 10] [--probe-interval 1] [--delay 0.1] [--rdzv-conf KEY=V,...]

The record goes to ``benchmarks/results/elastic.json`` (``benchmarks/record.py``); the
hosts and every process in them are removed on exit, on failure and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster.simcluster import SimCluster, SimHost, missing_tools  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from record import RESULTS, Run  # noqa: E402

WORKER = str(ROOT / "benchmarks" / "elastic_worker.py")
STEP = re.compile(r"\bSTEP (\d+) world (\d+)\b")
RESUMED = re.compile(r"\bRESUMED step (\d+) load_s ([0-9.]+)")
START_CPU = re.compile(r"\bSTARTCPU ([0-9.]+)")
RDZV_PORT = 29400
WARM_STEP = 3
"""The job is measured once it reached this step on all hosts."""


class JobFailed(Exception):
    """A job that did not get where the run needs it in time; the message says where."""


# ---------------------------------------------------------------- output, timestamped

class Log:
    """Every line of a job's processes with the monotonic time it arrived."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def follow(self, proc: subprocess.Popen, source: str) -> None:
        for stream in (proc.stdout, proc.stderr):
            reader = threading.Thread(target=self._read, args=(stream, source), daemon=True)
            reader.start()
            self._readers.append(reader)

    def _read(self, stream, source: str) -> None:
        for line in stream:
            with self._lock:
                self.lines.append((time.monotonic(), source, line.rstrip("\n")))

    def note(self, text: str) -> None:
        """A line of the benchmark's own in the log (what it did, when)."""
        with self._lock:
            self.lines.append((time.monotonic(), "bench", text))

    def snapshot(self) -> list[tuple[float, str, str]]:
        with self._lock:
            return list(self.lines)

    def steps(self, after: float = 0.0) -> list[tuple[float, int, int]]:
        """(time, step, world) of every STEP line that arrived after ``after``."""
        return [(t, int(m[1]), int(m[2])) for t, _, line in self.snapshot()
                if t >= after and (m := STEP.search(line))]

    def wait_step(self, world: int, after: float, timeout: float, least: int = 0,
                  what: str = "") -> tuple[float, int]:
        """The first (time, step) at ``world`` after ``after`` whose step is >= ``least``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [(t, s) for t, s, w in self.steps(after) if w == world and s >= least]
            if hits:
                return hits[0]
            time.sleep(0.02)
        raise JobFailed(f"no step at world {world} within {timeout:.0f} s ({what}); "
                        f"last lines: {self.tail()}")

    def tail(self, n: int = 6) -> str:
        return " | ".join(line[-160:] for _, _, line in self.snapshot()[-n:])

    def first(self, pattern: str, after: float) -> float | None:
        return next((t for t, _, line in self.snapshot() if t >= after and pattern in line),
                    None)

    def start_cpu(self, after: float) -> float | None:
        """The first ``STARTCPU`` seconds after ``after``: the new world's workers' CPU time
        until their first step, summed over the ranks."""
        return next((float(m.group(1)) for t, _, line in self.snapshot()
                     if t >= after and (m := START_CPU.search(line))), None)

    def loads(self, after: float) -> list[tuple[float, int, float]]:
        """(time, step, seconds) of every RESUMED line after ``after``."""
        return [(t, int(m[1]), float(m[2])) for t, _, line in self.snapshot()
                if t >= after and (m := RESUMED.search(line))]


def popen(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def cluster_env(home: Path) -> dict[str, str]:
    """Both launchers' environment: the cluster's HOME, no ssh agent, one thread."""
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    return env


# ---------------------------------------------------------------- the two launchers

class DsRunJob:
    """ds-run --elastic_training over the first ``n`` hosts from this machine."""

    name = "ds-run"

    def __init__(self, cluster: SimCluster, n: int, work: Path, args: argparse.Namespace):
        self.cluster, self.n, self.work, self.args = cluster, n, work, args
        self.log = Log()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        config = self.work / "ds_config.json"
        config.write_text(json.dumps({
            "train_batch_size": math.lcm(self.n - 1, self.n),
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 1}}))
        hostfile = self.cluster.hostfile(slots=1, names=[h.name for h in
                                                         self.cluster.hosts[:self.n]])
        a = self.args
        argv = [a.ds_run, "-H", str(hostfile),
                "--no_live", "--elastic_training", "--min_elastic_nodes", str(self.n - 1),
                "--elastic_probe_interval", str(a.probe_interval),
                "--monitor_timeout", str(a.monitor_timeout), "--max_restarts", "2",
                WORKER, str(self.work), "--runtime", "deepshard",
                "--deepspeed_config", str(config), "--delay", str(a.delay)]
        self.proc = popen(argv, cluster_env(self.cluster.home))
        self.log.follow(self.proc, "ds-run")

    def returned(self, host: SimHost) -> None:
        """Nothing to do: ds-run probes the node and takes it back by itself."""

    def finish(self, timeout: float) -> list[int]:
        assert self.proc is not None
        return [self.proc.wait(timeout=timeout)]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def events(self, t_kill: float, t_return: float) -> dict:
        left = self.log.first("ds-run: elastic: ", t_kill)
        joined = self.log.first(" joined (", t_return)
        return {"left_logged_s": None if left is None else left - t_kill,
                "rejoin_logged_s": None if joined is None else joined - t_return}


class TorchrunJob:
    """One torchrun per host over ssh, c10d rendezvous on the first host."""

    name = "torchrun"

    def __init__(self, cluster: SimCluster, n: int, work: Path, args: argparse.Namespace):
        self.cluster, self.n, self.work, self.args = cluster, n, work, args
        self.log = Log()
        self.procs: dict[str, list[subprocess.Popen]] = {}

    def command(self) -> str:
        first = self.cluster.hosts[0].name
        argv = [str(Path(sys.executable).with_name("torchrun")), "--nnodes",
                f"{self.n - 1}:{self.n}", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{first}:{RDZV_PORT}", "--rdzv-id", f"bench{self.n}",
                "--max-restarts", "10"]
        if self.args.rdzv_conf:
            argv += ["--rdzv-conf", self.args.rdzv_conf]
        argv += [WORKER, str(self.work), "--runtime", "torch", "--train-batch",
                 str(math.lcm(self.n - 1, self.n)), "--delay", str(self.args.delay)]
        env = "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1"
        if not self.args.share_store:  # pytorch/pytorch#135712: see the module docstring
            env += " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        return f"cd {shlex.quote(str(ROOT))} && exec env {env} {shlex.join(argv)}"

    def _ssh(self, host: SimHost) -> None:
        ssh = self.cluster.home / ".ssh"
        argv = ["ssh", "-F", str(ssh / "config"), "-o", f"UserKnownHostsFile={ssh}/known_hosts",
                "-o", "BatchMode=yes", host.name, self.command()]
        proc = popen(argv, cluster_env(self.cluster.home))
        self.procs.setdefault(host.name, []).append(proc)
        self.log.follow(proc, host.name)

    def start(self) -> None:
        for host in self.cluster.hosts[:self.n]:
            self._ssh(host)

    def returned(self, host: SimHost) -> None:
        """The node is back: start its torchrun again, as its user (or boot) would."""
        self._ssh(host)

    def finish(self, timeout: float) -> list[int]:
        """The exit codes of the torchruns alive at the end (the killed one's is left out)."""
        deadline = time.monotonic() + timeout
        return [procs[-1].wait(timeout=max(1.0, deadline - time.monotonic()))
                for procs in self.procs.values()]

    def kill(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    def events(self, t_kill: float, t_return: float) -> dict:
        return {}


JOBS = {"ds-run": DsRunJob, "torchrun": TorchrunJob}


# ---------------------------------------------------------------- one run

def scenario(job, cluster: SimCluster, n: int, timeout: float) -> dict:
    """Start, lose host 2, get it back, stop; the times of each phase."""
    victim, log = cluster.hosts[1], job.log
    t_start = time.monotonic()
    job.start()
    t_warm, _ = log.wait_step(n, t_start, timeout, least=WARM_STEP, what="start")
    t_kill = time.monotonic()
    cluster.kill_host(victim)
    log.note(f"killed {victim.name} in {time.monotonic() - t_kill:.3f} s")
    t_shrunk, shrunk_step = log.wait_step(n - 1, t_kill, timeout, what="after the kill")
    log.wait_step(n - 1, t_kill, timeout, least=shrunk_step + 2, what="on the survivors")
    t_return = time.monotonic()
    cluster.restart_sshd(victim)
    log.note(f"sshd of {victim.name} listening after {time.monotonic() - t_return:.3f} s")
    job.returned(victim)
    t_grown, grown_step = log.wait_step(n, t_return, timeout, what="after the return")
    log.wait_step(n, t_return, timeout, least=grown_step + 2, what="on all hosts again")
    (job.work / "stop").touch()
    codes = job.finish(timeout)
    if any(codes):
        raise JobFailed(f"{job.name} exited {codes}; last lines: {log.tail()}")
    stray = cluster.wait_no_strays()
    if stray:
        raise JobFailed(f"processes left behind on the hosts: {stray}")
    loads = log.loads(t_kill)
    boot_shrink, boot_grow = log.first("BOOT", t_kill), log.first("BOOT", t_return)
    before = max(s for t, s, w in log.steps() if w == n and t < t_shrunk)
    last_small = max(s for t, s, w in log.steps(t_kill) if w == n - 1 and t < t_grown)
    return {"status": "ok", "startup_s": t_warm - t_start,
            "shrink_s": t_shrunk - t_kill, "grow_s": t_grown - t_return,
            "relaunch_shrink_s": None if boot_shrink is None else boot_shrink - t_kill,
            "relaunch_grow_s": None if boot_grow is None else boot_grow - t_return,
            "start_cpu_shrink_s": log.start_cpu(t_kill), "start_cpu_grow_s":
            log.start_cpu(t_return),
            "load_shrink_s": next((s for t, _, s in loads if t <= t_shrunk), None),
            "load_grow_s": next((s for t, _, s in loads if t > t_return), None),
            "steps_redone_shrink": before + 1 - shrunk_step,
            "steps_redone_grow": last_small + 1 - grown_step,
            "step_at_kill": before, "first_step_shrunk": shrunk_step,
            "first_step_grown": grown_step, **job.events(t_kill, t_return)}


def measure(cluster: SimCluster, launcher: str, n: int, args: argparse.Namespace,
            tmp: Path) -> dict:
    """One row: ``launcher`` on the first ``n`` hosts, or why it failed."""
    work = tmp / f"{launcher}-{n}"
    work.mkdir(parents=True)
    job = JOBS[launcher](cluster, n, work, args)
    print(f"{n} hosts: {launcher} ...", file=sys.stderr, flush=True)
    base = {"hosts": n, "launcher": launcher, "train_batch": math.lcm(n - 1, n),
            "victim": cluster.hosts[1].name}
    started = time.monotonic()
    try:
        row = {**base, **scenario(job, cluster, n, args.timeout)}
    except (JobFailed, subprocess.TimeoutExpired, RuntimeError) as exc:
        print(f"  failed: {exc}", file=sys.stderr, flush=True)
        row = {**base, "status": f"failed: {exc}"}
    finally:
        job.kill()
        recover(cluster)
    row["wall_s"] = time.monotonic() - started
    (tmp / f"{launcher}-{n}.log").write_text("".join(
        f"{t - started:9.3f} [{src}] {line}\n" for t, src, line in job.log.snapshot()))
    return row


def recover(cluster: SimCluster) -> None:
    """Every host up again with its sshd and nothing else running (after a failure)."""
    for host in cluster.hosts:
        for pid in host.pids():
            if host.sshd is None or pid != host.sshd.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if host.sshd is None or host.sshd.poll() is not None:
            cluster.restart_sshd(host)


# ---------------------------------------------------------------- table

def _s(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(row: dict, peer: dict | None, key: str) -> str:
    if peer is None or row["launcher"] == "torchrun":
        return ""
    return f" ({row[key] / peer[key]:.2f}x torchrun)"


def _cpu(row: dict, phase: str) -> str:
    """The new world's CPU seconds to its first step, and that over this machine's cores:
    the least wall time the script's start can take when every host shares them."""
    cpu = row.get(f"start_cpu_{phase}_s")
    return "-" if cpu is None else f"{cpu:.1f} ({cpu / (os.cpu_count() or 1):.1f})"


def table_line(row: dict, rows: list[dict], monitor_timeout: float) -> str:
    """One row of the table; ds-run's with its ratios to torchrun's on as many hosts."""
    if row["status"] != "ok":
        return f"| {row['hosts']} | {row['launcher']} | {row['status'][:80]} | | | | | | |"
    peer = next((p for p in rows if p["hosts"] == row["hosts"] and p["status"] == "ok"
                 and p["launcher"] == "torchrun"), None)
    load = row["load_shrink_s"] or 0.0
    target = "-" if row["launcher"] == "torchrun" else \
        ("met" if row["shrink_s"] <= monitor_timeout + 5 + load else "missed")
    return (f"| {row['hosts']} | {row['launcher']} | {_s(row['shrink_s'])}"
            f"{_ratio(row, peer, 'shrink_s')} | {_s(row['grow_s'])}"
            f"{_ratio(row, peer, 'grow_s')} | {_s(row['relaunch_shrink_s'])} / "
            f"{_s(row['relaunch_grow_s'])} | {_cpu(row, 'shrink')} / {_cpu(row, 'grow')} | "
            f"{load:.3f} / {row['load_grow_s'] or 0:.3f} | "
            f"{row['steps_redone_shrink']} / {row['steps_redone_grow']} | {target} |")


def table(rows: list[dict], monitor_timeout: float) -> list[str]:
    """The markdown table: one line per host count and launcher."""
    return ["| hosts | launcher | node lost -> steps on N-1 (s) | node back -> steps on N "
            "(s) | of which until rank 0 starts: lost / back (s) | workers' CPU s to their "
            f"first step (/ {os.cpu_count()} cores): lost / back | checkpoint load: lost / "
            "back (s) | steps redone: lost / back | shrink <= "
            f"{monitor_timeout:g} s + 5 s + load |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|"] + [
        table_line(r, rows, monitor_timeout) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="3,8", help="host counts, comma-separated")
    parser.add_argument("--launchers", default="ds-run,torchrun")
    parser.add_argument("--monitor-timeout", type=float, default=10.0,
                        help="ds-run's --monitor_timeout (more than its 5 s stop grace)")
    parser.add_argument("--probe-interval", type=float, default=1.0,
                        help="ds-run's --elastic_probe_interval")
    parser.add_argument("--delay", type=float, default=0.1, help="sleep after each step")
    parser.add_argument("--rdzv-conf", default="", help="torchrun's --rdzv-conf")
    parser.add_argument("--share-store", action="store_true",
                        help="leave torchrun's workers on the agents' shared TCPStore "
                        "(torch's default; see pytorch/pytorch#135712)")
    parser.add_argument("--ds-run", default=str(Path(sys.executable).with_name("ds-run")),
                        help="the ds-run to measure")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per phase")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder for the run's record, elastic.json")
    parser.add_argument("--logs", type=Path, help="keep every job's timestamped output here")
    args = parser.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    bad = [x for x in launchers if x not in JOBS] + [str(n) for n in counts if n < 2]
    if bad:
        parser.error(f"unknown launcher or host count below 2: {bad[0]}")
    if missing_tools():
        raise SystemExit(f"elastic.py needs {', '.join(missing_tools())}")
    run = Run("elastic", {k: v for k, v in vars(args).items()
                          if k not in ("results", "logs", "ds_run")}
              | {"hosts": counts, "launchers": launchers, "slots_per_host": 1,
                 "warm_step": WARM_STEP, "victim": "host 2", "script":
                 "benchmarks/elastic_worker.py", "torchrun": "--nnodes N-1:N --rdzv-backend "
                 "c10d --max-restarts 10, one per host over ssh"})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SimCluster(max(counts), Path(tmp) / "cluster", prefix="dse", subnet=11)
        try:
            cluster.start()
            rows = [measure(cluster, launcher, n, args, Path(tmp) / "jobs")
                    for n in counts for launcher in launchers]
        finally:
            cluster.stop()
            if args.logs:
                shutil.copytree(Path(tmp) / "jobs", args.logs, dirs_exist_ok=True)
    print(f"one slot per host, host 2 killed (every process, its sshd too) after step "
          f"{WARM_STEP}; {os.cpu_count()} cores (every host's sshd and workers on this machine)")
    print()
    lines = table(rows, args.monitor_timeout)
    print("\n".join(lines))
    run.write(rows, lines, args.results)


if __name__ == "__main__":
    main()
