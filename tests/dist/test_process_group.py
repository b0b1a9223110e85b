"""Real gloo process groups formed by ds-run workers, checked against local arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepshard.launcher.cli import free_port
from tests.helpers import ROOT, run_ds, tagged_json

SCRIPT = str(ROOT / "tests" / "dist" / "scripts" / "allreduce.py")


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_group_across_ds_run_workers(world):
    result = run_ds("--num_gpus", str(world), SCRIPT, timeout=180)
    assert result.returncode == 0, result.stderr
    tagged = tagged_json(result.stdout, "RESULT")
    assert all(head == f"[localhost:{rank}]" for rank, (head, _) in tagged.items())
    results = {rank: data for rank, (_, data) in tagged.items()}
    assert sorted(results) == list(range(world))
    for rank, data in results.items():
        assert data["world"] == world
        assert data["env_rank"] == rank and data["local_rank"] == rank
        assert data["source"] == "contract"
        assert data["again"] is True
        assert data["backend"] == "gloo"
        assert data["sum"] == world * (world + 1) / 2
        assert data["gathered"] == [float(r * r) for r in range(world)]
    assert len({d["pid"] for d in results.values()}) == world


@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
def test_init_distributed_from_scheduler_variables(launcher, tmp_path):
    """Two processes started the way srun / mpirun start them (no RANK/WORLD_SIZE)."""

    port = str(free_port("127.0.0.1"))
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        if launcher == "slurm":
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                       SLURM_JOB_NODELIST="localhost", SLURM_TASKS_PER_NODE="2",
                       MASTER_PORT=port)
        else:
            env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                       OMPI_COMM_WORLD_LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, SCRIPT], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, err
        data = json.loads(out.split("RESULT ", 1)[1])
        assert data["rank"] == rank and data["world"] == 2
        assert data["source"] == launcher
        assert data["sum"] == 3.0


def test_init_distributed_with_deepspeed_arguments():
    """deepspeed.init_distributed()'s keywords: init_method, rank and world_size overrides."""

    port = free_port("127.0.0.1")
    code = (
        "import sys, torch, torch.distributed as dist, deepshard\n"
        "r = int(sys.argv[1])\n"
        f"env = deepshard.init_distributed(dist_backend='gloo', init_method='tcp://127.0.0.1:{port}',"
        " rank=r, world_size=2, verbose=False)\n"
        "t = torch.tensor([r + 1.0]); dist.all_reduce(t)\n"
        "print(env.rank, dist.get_world_size(), t.item())\n"
    )
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.split() == [str(rank), "2", "3.0"]


def test_a_rank_raising_with_a_collective_in_flight_fails_the_job_promptly():
    """Its exit must not wait for the collective (destructing a gloo group joins its
    threads, and that all-reduce never completes): ds-run reports rank 1's error."""
    script = str(ROOT / "tests" / "dist" / "scripts" / "raise_in_flight.py")
    result = run_ds("--num_gpus", "2", script, timeout=120)
    assert "IN_FLIGHT" in result.stdout, result.stderr
    assert result.returncode == 1, result.stderr
    assert "rank 1" in result.stderr and "rank 1 failed mid-step" in result.stderr
