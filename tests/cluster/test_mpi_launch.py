"""ds-run --launcher openmpi|mpich on the sshd hosts: a real mpirun starts every rank.

The ranks train with deepshard (gloo) from the variables their MPI gives them, and end with
the weights of one plain process on the same batches; a rank that fails and a Ctrl-C end
the job on every host, leaving no process (the cluster fixture checks every namespace).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, ds_run_argv, require, run_ds

STEPS = 3
TRAIN = '''
import json, os, socket, sys
import torch
import deepshard
from tests.cluster.elastic_train import data, model

net = model()
engine, _, loader, _ = deepshard.initialize(
    model=net, model_parameters=net.parameters(), training_data=data(),
    config={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.05, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 1}})
# results go to files beside the script (the namespace hosts share this filesystem):
# mpirun's forwarded stdout may splice lines of different ranks
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, f"rankinfo-{engine.global_rank}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
        | {"host": socket.gethostname(), "args": sys.argv[1:]}, f)
batches = iter(loader)
while engine.global_steps < int(sys.argv[1]):
    x, y = next(batches)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
if engine.global_rank == 0:
    print("FINAL " + json.dumps({k: v.tolist() for k, v in engine.module.state_dict().items()}),
          flush=True)
    with open(os.path.join(here, "final.json"), "w") as f:
        json.dump({k: v.tolist() for k, v in engine.module.state_dict().items()}, f)
'''
SLEEP = '''
import os, subprocess, sys, time
import torch.distributed as dist
import deepshard
deepshard.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
open(os.path.join(sys.argv[1], f"{rank}.pid"), "w").write(str(os.getpid()))
if rank != int(sys.argv[2]):
    # a child in the rank's process group: mpirun's teardown must reach it too (an exited
    # rank's orphans are another matter: see docs/launcher.md)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
while True:  # the ranks talk, as training does: a rank's death fails the others' barrier
    dist.barrier()
    if rank == int(sys.argv[2]):
        if sys.argv[3] == "kill":
            os.kill(os.getpid(), 9)
        sys.exit(3)
    time.sleep(0.2)
'''


@functools.cache
def one_process(script_text: str, steps: int) -> dict:
    """The final weights of the same script as one plain process (a world of one)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(script_text)
        env = {k: v for k, v in os.environ.items() if k not in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        done = subprocess.run([sys.executable, str(script), str(steps)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line[6:] for line in done.stdout.splitlines()
                           if line.startswith("FINAL ")))


torch = pytest.importorskip("torch")


@pytest.fixture(params=["openmpi", "mpich"])
def mpi(request, cluster, cluster_env, tmp_path):
    """(launcher, env, launcher_args) for ds-run with that MPI's mpirun first on PATH."""
    flavor = request.param
    binary = shutil.which(f"mpirun.{flavor}")
    require([] if binary else [f"mpirun.{flavor}"], f"the {flavor} tests",
            "openmpi-bin libopenmpi-dev mpich")
    assert binary is not None
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "mpirun").symlink_to(binary)
    # hydra looks for its proxy next to the mpirun it was started as
    proxy = shutil.which("hydra_pmi_proxy")
    if flavor == "mpich" and proxy:
        (bindir / "hydra_pmi_proxy").symlink_to(proxy)
    home = cluster.home
    ssh_opts = f"-F {home}/.ssh/config -o UserKnownHostsFile={home}/.ssh/known_hosts"
    # OpenSSH reads the account's ~/.ssh, not $HOME: each mpirun is told the test's
    ssh = tmp_path / "bin" / "cluster-ssh"
    ssh.write_text(f'#!/bin/sh\nexec ssh {ssh_opts} "$@"\n')
    ssh.chmod(0o755)
    env = {**cluster_env, "PATH": f"{bindir}{os.pathsep}{cluster_env['PATH']}",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    bridge = f"198.18.{cluster.subnet}.0/24"
    if flavor == "openmpi":
        args = (f"--mca plm_rsh_agent {ssh} --mca plm_rsh_no_tree_spawn 1 "
                f"--mca oob_tcp_if_include {bridge}")
    else:  # hydra's proxies call back to this machine, which the hosts know by address only
        args = f"-launcher ssh -launcher-exec {ssh} -localhost 198.18.{cluster.subnet}.1"
    return flavor, env, args


def test_four_ranks_train_like_one_process(cluster, mpi, tmp_path):
    flavor, env, args = mpi
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # Open MPI places by the hostfile's slots; MPICH runs -ppn ranks on every host
    hostfile = cluster.hostfile(slots=[2, 1, 1]) if flavor == "openmpi" else \
        cluster.hostfile(slots=2, names=["dsh1", "dsh2"])
    result = run_ds("-H", str(hostfile), "--launcher", flavor, "--launcher_args", args,
                    str(script), str(STEPS), env=env, timeout=90)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    infos = [json.loads((tmp_path / f"rankinfo-{r}.json").read_text()) for r in range(4)]
    by_rank = {int(i["RANK"]): i for i in infos}
    hosts = ["dsh1", "dsh1", "dsh2", "dsh3"] if flavor == "openmpi" else \
        ["dsh1", "dsh1", "dsh2", "dsh2"]
    assert [by_rank[r]["host"] for r in range(4)] == hosts
    assert [by_rank[r]["LOCAL_RANK"] for r in range(4)] == (
        ["0", "1", "0", "0"] if flavor == "openmpi" else ["0", "1", "0", "1"])
    assert {i["WORLD_SIZE"] for i in infos} == {"4"}
    assert {i["MASTER_ADDR"] for i in infos} == {cluster.address(1)}
    assert all(i["args"] == [str(STEPS)] for i in infos)  # no --local_rank, as DeepSpeed
    final = json.loads((tmp_path / "final.json").read_text())
    for key, value in one_process(TRAIN, STEPS).items():
        assert torch.allclose(torch.tensor(final[key]), torch.tensor(value), atol=1e-6), key


def _wait_for(pid_dir: Path, count: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(list(pid_dir.glob("*.pid"))) < count:
        assert proc.poll() is None, f"ds-run ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, "ranks did not start in time"
        time.sleep(0.05)


def test_a_failed_rank_and_ctrl_c_leave_no_process(cluster, mpi, tmp_path):
    flavor, env, args = mpi
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    hostfile = cluster.hostfile(slots=1)
    (tmp_path / "a").mkdir()
    # MPICH's hydra ends the job when a rank dies of a signal, not when one exits with an
    # error code (the others run on until their collectives fail: see docs/launcher.md)
    how = "exit" if flavor == "openmpi" else "kill"
    failed = run_ds("-H", str(hostfile), "--launcher", flavor, "--launcher_args", args,
                    str(script), str(tmp_path / "a"), "1", how, env=env, timeout=60)
    if flavor == "openmpi":  # Open MPI names the first failed rank
        assert failed.returncode == 3, failed.stderr
        assert "rank 1 on dsh2 failed first: exit code 3" in failed.stderr
    else:
        assert failed.returncode == 1, failed.stderr
        assert "failed first: mpirun ended with exit code" in failed.stderr
        assert "RUNNING AT dsh2" in failed.stdout  # hydra's words, passed through
    assert not cluster.wait_no_strays(timeout=15)

    (tmp_path / "b").mkdir()
    proc = subprocess.Popen(ds_run_argv("-H", str(hostfile), "--launcher", flavor,
                                        "--launcher_args", args, str(script),
                                        str(tmp_path / "b"), "-1", "exit"),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "b", 3, proc)
    assert set(cluster.stray_pids()) == {"dsh1", "dsh2", "dsh3"}
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not cluster.wait_no_strays(timeout=15)
