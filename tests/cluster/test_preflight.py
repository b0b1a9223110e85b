"""ds_report --hostfile: a preflight of every host over ssh, with one bad host."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT


def ds_report(*args: str, env: dict[str, str], cwd: Path = ROOT):
    exe = str(Path(sys.executable).with_name("ds_report"))
    return subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_preflight_names_the_bad_host_and_fails(cluster, cluster_env, tmp_path):
    cluster.add_alias("dsh-gone", cluster.hosts[0], HostName="198.18.7.99")
    hostfile = cluster.hostfile(slots=1, names=["dsh1", "dsh2", "dsh3", "dsh-gone"])
    # something listens on the master port on the first host
    listener = subprocess.Popen(
        ["ip", "netns", "exec", "dsh1", sys.executable, "-c",
         "import socket, time; s = socket.socket(); s.bind(('', 29511)); s.listen(); "
         "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline() == "up\n"
        result = ds_report("--json", "-H", str(hostfile), "--master_port", "29511",
                           "--timeout", "2", env=cluster_env)
    finally:
        listener.kill()
        listener.wait()
    assert result.returncode == 1, result.stderr
    checks = {c["host"]: c for c in json.loads(result.stdout)["preflight"]}
    assert [checks[h]["ok"] for h in ("dsh1", "dsh2", "dsh3", "dsh-gone")] == \
        [False, True, True, False]
    assert checks["dsh1"]["problems"] == ["master port 29511 in use"]
    assert not checks["dsh-gone"]["reachable"]
    assert "198.18.7.99:22" in checks["dsh-gone"]["problems"][0]
    assert checks["dsh2"]["facts"]["torch"] == checks["dsh3"]["facts"]["torch"]
    assert abs(checks["dsh2"]["facts"]["skew"]) < 1.0


def test_preflight_passes_on_good_hosts_and_reads_like_a_table(cluster, cluster_env):
    hostfile = cluster.hostfile(slots=1)
    start = time.monotonic()
    result = ds_report("-H", str(hostfile), env=cluster_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" ok ") >= 3
    assert "FAIL" not in result.stdout
    print(f"preflight of 3 hosts: {time.monotonic() - start:.2f} s")
