"""deepshard.comm.distributed.resolve_dist_env: rank and rendezvous from the environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepshard.comm.distributed import DEFAULT_PORT, DistEnv, export_contract, resolve_dist_env
from deepshard.errors import UsageError


def test_module_does_not_import_torch_at_module_level():
    code = ("import sys, deepshard.comm.distributed as d; "
            "d.resolve_dist_env({'RANK': '0', 'WORLD_SIZE': '1'}); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# --- contract / torchrun -------------------------------------------------------------------


def test_contract_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node-a", "MASTER_PORT": "29512", "NODE_RANK": "1"}
    assert resolve_dist_env(env) == DistEnv(5, 8, 1, 4, "node-a", 29512, "contract")


def test_contract_defaults():
    assert resolve_dist_env({"RANK": "0", "WORLD_SIZE": "2"}) == DistEnv(
        0, 2, 0, 2, "127.0.0.1", DEFAULT_PORT, "contract")


def test_empty_master_port_means_default():
    assert resolve_dist_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": ""}).master_port \
        == DEFAULT_PORT


def test_contract_wins_over_slurm_and_mpi():
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "16",
           "SLURM_JOB_NODELIST": "n[1-4]", "OMPI_COMM_WORLD_RANK": "3",
           "OMPI_COMM_WORLD_SIZE": "4"}
    got = resolve_dist_env(env)
    assert (got.source, got.rank, got.world_size) == ("contract", 1, 2)


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "3", "MASTER_PORT": "1234"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE is set but RANK is not"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside the world of 2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "rank -1 is outside the world of 2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0 is not positive"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "MASTER_PORT 99999 is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT 0 is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": ""}, "MASTER_ADDR is empty"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "2", "MASTER_ADDR": "n1"}, "rank 4 is outside"),
])
def test_partial_or_impossible_values_are_errors_not_hangs(env, message):
    with pytest.raises(UsageError) as info:
        resolve_dist_env(env)
    assert message in str(info.value) and "HINT:" in str(info.value)


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": ""}, "LOCAL_WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"MASTER_PORT": "29500x"}, "MASTER_PORT"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "many", "SLURM_JOB_NODELIST": "n1"},
         "SLURM_NTASKS"),
        ({"SLURM_PROCID": "p", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"},
         "SLURM_PROCID"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "x"}, "OMPI_COMM_WORLD_SIZE"),
    ],
)
def test_non_integer_is_a_usage_error(env, key):
    with pytest.raises(UsageError) as info:
        resolve_dist_env(env)
    assert info.value.where == "environment"
    assert info.value.message.startswith(f"{key}=")
    assert f"unset {key}" in str(info.value)


# --- SLURM ---------------------------------------------------------------------------------


def slurm(**extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "123456",
           "SLURM_TASKS_PER_NODE": "2(x3)"}
    env.update(extra)
    return env


def test_slurm_variables():
    assert resolve_dist_env(slurm()) == DistEnv(
        rank=3, world_size=6, local_rank=1, local_world_size=2, master_addr="node07",
        master_port=15000 + 123456 % 20000, source="slurm")


def test_slurm_port_from_job_id_is_stable_and_in_range():
    ports = {resolve_dist_env(slurm(SLURM_JOB_ID=str(j))).master_port for j in (0, 1, 19999)}
    assert ports == {15000, 15001, 34999}


def test_slurm_master_port_wins():
    assert resolve_dist_env(slurm(MASTER_PORT="4242")).master_port == 4242


def test_slurm_master_addr_wins():
    assert resolve_dist_env(slurm(MASTER_ADDR="10.0.0.9")).master_addr == "10.0.0.9"


def test_slurm_step_nodelist_preferred():
    env = slurm(SLURM_STEP_NODELIST="gpu-b[3-4],gpu-a1")
    assert resolve_dist_env(env).master_addr == "gpu-b3"


def test_slurm_cartesian_nodelist_first_host():
    assert resolve_dist_env(slurm(SLURM_JOB_NODELIST="rack[2-3]-n[05-06]")).master_addr \
        == "rack2-n05"


def test_slurm_without_job_id_uses_default_port():
    env = slurm()
    del env["SLURM_JOB_ID"]
    assert resolve_dist_env(env).master_port == 15000


def test_slurm_non_numeric_job_id_uses_default_port():
    assert resolve_dist_env(slurm(SLURM_JOB_ID="123_4")).master_port == DEFAULT_PORT


@pytest.mark.parametrize(
    ("extra", "local_world"),
    [
        ({"SLURM_TASKS_PER_NODE": "4"}, 4),
        ({"SLURM_TASKS_PER_NODE": "3(x2),1"}, 3),
        ({"SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NTASKS_PER_NODE": "5"}, 5),
        ({"SLURM_TASKS_PER_NODE": ""}, 6),
        ({"SLURM_TASKS_PER_NODE": "garbage"}, 6),
    ],
)
def test_slurm_local_world_size(extra, local_world):
    assert resolve_dist_env(slurm(**extra)).local_world_size == local_world


def test_slurm_defaults_local_rank_zero():
    env = slurm()
    del env["SLURM_LOCALID"], env["SLURM_TASKS_PER_NODE"]
    got = resolve_dist_env(env)
    assert (got.local_rank, got.local_world_size) == (0, 6)


def test_slurm_without_nodelist_or_master():
    with pytest.raises(UsageError) as info:
        resolve_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert "MASTER_ADDR" in str(info.value)


def test_slurm_malformed_nodelist():
    with pytest.raises(UsageError) as info:
        resolve_dist_env(slurm(SLURM_JOB_NODELIST="node[07-"))
    assert info.value.where == "SLURM_JOB_NODELIST"


@pytest.mark.parametrize("nodelist", [",", " "])
def test_slurm_nodelist_naming_no_host(nodelist):
    # BUG: expand_hostlist returns [] for these and resolve_dist_env indexes [0]: IndexError
    # instead of a UsageError (errors.py: every mistake in an env variable is a UsageError).
    with pytest.raises(UsageError):
        resolve_dist_env(slurm(SLURM_JOB_NODELIST=nodelist))


# --- Open MPI ------------------------------------------------------------------------------


def test_mpi_variables():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "head", "MASTER_PORT": "6000"}
    assert resolve_dist_env(env) == DistEnv(2, 4, 0, 2, "head", 6000, "mpi")


def test_mpi_without_master_addr_is_an_error_when_world_above_one():
    with pytest.raises(UsageError) as info:
        resolve_dist_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert "MASTER_ADDR" in str(info.value) and "-x" in str(info.value)


def test_mpi_world_of_one_needs_no_master():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert resolve_dist_env(env) == DistEnv(0, 1, 0, 1, "127.0.0.1", DEFAULT_PORT, "mpi")


def test_slurm_wins_over_mpi():
    env = {**slurm(), "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    assert resolve_dist_env(env).source == "slurm"


# --- single process ------------------------------------------------------------------------


def test_single_with_port():
    assert resolve_dist_env({"MASTER_PORT": "7000"}) == DistEnv(
        0, 1, 0, 1, "127.0.0.1", 7000, "single")


def test_single_picks_a_free_port():
    got = resolve_dist_env({})
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size, got.source) == (
        0, 1, 0, 1, "single")
    assert 0 < got.master_port < 65536


def test_export_contract_roundtrips():
    dist_env = DistEnv(3, 8, 1, 4, "node07", 15123, "slurm")
    environ: dict[str, str] = {"UNRELATED": "x"}
    export_contract(dist_env, environ)
    assert environ["UNRELATED"] == "x"
    assert resolve_dist_env(environ) == DistEnv(3, 8, 1, 4, "node07", 15123, "contract")
