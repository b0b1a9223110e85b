"""ZeRO++ and MiCS across hosts: the reference GPT at stage 3 on 2 hosts x 2 ranks whose
links are capped with ``tc``, each variant's step time and the bytes crossing hosts.

The hosts are network namespaces with their own sshd (``tests/cluster/simcluster.py``;
needs root, iproute2, openssh-server); ds-run starts 2 ranks on each over ssh. Both
directions of each host's link are shaped with a token bucket (``tc qdisc ... tbf``) at
each ``--rates`` value; ranks of one host talk over its loopback, uncapped, as GPUs of one
node over NVLink. The model is ``examples/gpt.py``'s reference GPT (27.4M parameters, fp32,
micro-batch 4, sequence 128, AdamW, one thread per rank); every variant and peer trains
the same batches. Variants (deepshard): plain ZeRO-3, hpZ (``zero_hpz_partition_size`` 2),
qwZ+qgZ, all three, MiCS (``mics_shard_size`` 2); peers: DeepSpeed 0.19.8's plain ZeRO-3
and hpZ from a side venv (``--deepspeed_python``; its qwZ and qgZ need CUDA). Bytes
crossing hosts: each host's own ``eth0`` transmit counter over the timed steps, summed over
the hosts, per step.

    sudo python benchmarks/zeropp.py [--steps 2] [--rates 1gbit,200mbit]
                                     [--deepspeed_python /tmp/dsvenv/bin/python]

The run's record goes to ``benchmarks/results/zeropp.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster.simcluster import SimCluster, missing_tools  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from record import RESULTS, Run  # noqa: E402

WORKER = str(ROOT / "benchmarks" / "zeropp_worker.py")
VARIANTS = {
    "ZeRO-3": {},
    "hpZ": {"zero_hpz_partition_size": 2},
    "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "hpZ+qwZ+qgZ": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                    "zero_quantized_gradients": True},
    "MiCS": {"mics_shard_size": 2},
}
DEEPSPEED = ("ZeRO-3", "hpZ")
BASE = {"stage3_max_live_parameters": 3_000_000, "stage3_max_reuse_distance": 0}
"""For every variant and peer: parameters are let go after use, as a model too large to
stay gathered from forward to backward is (otherwise backward gathers nothing here)."""


def shape(cluster: SimCluster, rate: str | None) -> None:
    """Cap both directions of every host's link at ``rate`` (``None``: uncapped)."""
    for host in cluster.hosts:
        for prefix, dev in ((["ip", "netns", "exec", host.netns], "eth0"),
                            ([], f"{host.netns}h")):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, check=False)
            if rate is not None:
                subprocess.run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", rate, "burst", "256kb", "latency", "400ms"],
                               check=True, capture_output=True)


def run_variant(cluster: SimCluster, env: dict[str, str], runtime: str, zero: dict,
                steps: int, python: str) -> dict:
    """One job: every rank's RESULT line."""
    hostfile = cluster.hostfile(slots=2)
    argv = [str(Path(sys.executable).with_name("ds-run")), "-H", str(hostfile),
            "--no_python", "--no_local_rank", python, WORKER, runtime, json.dumps(zero),
            str(steps)]
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1800, check=False)
    if result.returncode != 0:
        return {"status": "failed: " + (result.stderr.strip().splitlines() or ["?"])[-1]}
    ranks = [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines()
             if "RESULT " in line]
    first = next(r for r in ranks if r["rank"] == 0)
    return {"status": "ok", "step_s": statistics.median(first["times"]),
            "times_s": first["times"], "loss": first["loss"],
            "cross_host_bytes": sum(r["host_tx_per_step"] for r in ranks
                                    if "host_tx_per_step" in r)}


def table(rows: list[dict]) -> list[str]:
    lines = ["| link | runtime | variant | s/step | vs ZeRO-3 | MB crossing hosts per step | "
             "vs ZeRO-3 | loss |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['rate']} | {r['runtime']} | {r['variant']} | {r['status']} "
                         "| | | | |")
            continue
        base = next(b for b in rows if b["rate"] == r["rate"] and b["runtime"] == r["runtime"]
                    and b["variant"] == "ZeRO-3")
        ok = base["status"] == "ok"
        lines.append(
            f"| {r['rate']} | {r['runtime']} | {r['variant']} | {r['step_s']:.2f} | "
            f"{r['step_s'] / base['step_s']:.2f} | {r['cross_host_bytes'] / 1e6:.1f} | "
            f"{r['cross_host_bytes'] / base['cross_host_bytes']:.2f} | {r['loss']:.4f} |"
            if ok else f"| {r['rate']} | {r['runtime']} | {r['variant']} | "
            f"{r['step_s']:.2f} | | {r['cross_host_bytes'] / 1e6:.1f} | | {r['loss']:.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rates", default="1gbit,200mbit")
    parser.add_argument("--deepspeed_python", default="/tmp/dsvenv/bin/python",
                        help="a Python with deepspeed 0.19.8 (skipped when absent)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if missing := missing_tools():
        raise SystemExit(f"zeropp.py needs {', '.join(missing)}")
    has_ds = os.access(args.deepspeed_python, os.X_OK)
    rates = args.rates.split(",")
    run = Run("zeropp", {"steps": args.steps, "rates": rates, "hosts": 2, "ranks_per_host": 2,
                         "zero_base": BASE,
                         "model": "examples/gpt.py GPTConfig() (27.4M), fp32, micro 4",
                         "deepspeed": args.deepspeed_python if has_ds else None})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = SimCluster(2, Path(tmp) / "cluster", prefix="dsz", subnet=11)
        env_file = Path(tmp) / "deepspeed_env"
        env_file.write_text("DS_ACCELERATOR=cpu\n")
        try:
            cluster.start()
            env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
            env.update(HOME=str(cluster.home), DS_ENV_FILE=str(env_file))
            for rate in rates:
                shape(cluster, rate)
                jobs = [("deepshard", v, sys.executable) for v in VARIANTS]
                if has_ds:
                    jobs += [("deepspeed", v, args.deepspeed_python) for v in DEEPSPEED]
                for runtime, variant, python in jobs:
                    row = {"rate": rate, "runtime": runtime, "variant": variant,
                           **run_variant(cluster, env, runtime, {**BASE, **VARIANTS[variant]},
                                         args.steps, python)}
                    print(f"  {rate} {runtime} {variant}: " + (
                        f"{row['step_s']:.2f} s/step, {row['cross_host_bytes'] / 1e6:.1f} MB "
                        f"across hosts, loss {row['loss']:.4f}" if row["status"] == "ok"
                        else row["status"]), flush=True)
                    rows.append(row)
        finally:
            shape(cluster, None)
            cluster.stop()
    print()
    lines = table(rows)
    print("\n".join(lines))
    run.write(rows, lines, args.results)


if __name__ == "__main__":
    main()
