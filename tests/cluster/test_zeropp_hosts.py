"""ZeRO++ and MiCS between real hosts: 2 namespace hosts x 2 ranks started by ds-run over
ssh; the bytes each host sends on its link (its eth0 counter) per step, plain ZeRO-3 against
the variants (the full-size measurement, with tc caps and DeepSpeed, is
``benchmarks/zeropp.py``)."""

from __future__ import annotations

import json
import subprocess

from tests.helpers import ROOT, ds_run_argv

WORKER = str(ROOT / "benchmarks" / "zeropp_worker.py")
SHAPE = {"n_layer": 2, "d_model": 128, "n_head": 4, "vocab_size": 2048, "seq_len": 64}
BASE = {"stage3_max_live_parameters": 50_000, "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 1000}


def cross_host_bytes(cluster, env, zero: dict) -> tuple[float, float]:
    """(bytes crossing hosts per step, rank 0's last loss) of a 2-step job."""
    hostfile = cluster.hostfile(slots=2, names=["dsh1", "dsh2"])
    argv = ds_run_argv("-H", str(hostfile), WORKER, "deepshard",
                       json.dumps({**BASE, **zero}), "2", json.dumps(SHAPE))
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(line.split("RESULT ", 1)[1]) for line in result.stdout.splitlines()
             if "RESULT " in line]
    assert len(ranks) == 4
    sent = [r["host_tx_per_step"] for r in ranks if "host_tx_per_step" in r]
    assert len(sent) == 2  # one figure per host
    return sum(sent), next(r["loss"] for r in ranks if r["rank"] == 0)


def test_variants_keep_their_traffic_inside_the_hosts(cluster, cluster_env):
    plain, loss = cross_host_bytes(cluster, cluster_env, {})
    hpz, hpz_loss = cross_host_bytes(cluster, cluster_env, {"zero_hpz_partition_size": 2})
    every, every_loss = cross_host_bytes(cluster, cluster_env, {
        "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
        "zero_quantized_gradients": True})
    mics, mics_loss = cross_host_bytes(cluster, cluster_env, {"mics_shard_size": 2})
    assert hpz_loss == loss and abs(mics_loss - loss) < 1e-5 * loss
    assert abs(every_loss - loss) < 1e-2 * loss
    # backward's gathers stay home under hpZ: a quarter of plain ZeRO-3's bytes (forward
    # gather 1, backward gather 1, gloo's gradient all-reduce 2, by its ring) is saved
    assert 0.65 * plain < hpz < 0.85 * plain, (hpz, plain)
    assert every < 0.3 * plain, (every, plain)  # int8 gathers, int8 gradients across once
    assert mics < 0.5 * plain, (mics, plain)  # only the replicas' gradient sum crosses
