"""Resources from a SLURM allocation (pure: environments are dicts)."""

from __future__ import annotations

import pytest

from deepshard.errors import UsageError
from deepshard.launcher.slurm_env import allocation_resources, gpu_slots, in_allocation

ALLOC = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-02]"}


def test_in_allocation_needs_a_job_and_a_node_list():
    assert in_allocation(ALLOC)
    assert not in_allocation({"SLURM_JOB_ID": "42"})
    assert not in_allocation({"SLURM_JOB_NODELIST": "n1"})


@pytest.mark.parametrize(("env", "slots"), [
    ({"SLURM_JOB_GPUS": "4,5,6,7"}, (4, 5, 6, 7)),  # the scheduler's own GPU ids
    ({"SLURM_GPUS_ON_NODE": "2"}, (0, 1)),
    ({"SLURM_JOB_GPUS": "", "SLURM_GPUS_ON_NODE": "3"}, (0, 1, 2)),
    ({}, ()),
])
def test_gpu_slots(env, slots):
    assert gpu_slots(env) == slots


def test_allocation_hosts_get_the_jobs_gpus():
    res = allocation_resources({**ALLOC, "SLURM_JOB_GPUS": "2,3"}, ["gpu01", "gpu02"], None)
    assert res.as_dict() == {"gpu01": [2, 3], "gpu02": [2, 3]}
    assert res.origin == "SLURM job 42"
    narrowed = allocation_resources({**ALLOC, "SLURM_JOB_GPUS": "2,3"}, ["gpu01"], 1)
    assert narrowed.as_dict() == {"gpu01": [2]}


def test_cpu_allocation_gets_num_gpus_cpu_slots():
    assert allocation_resources(ALLOC, ["a", "b"], None).as_dict() == {"a": [0], "b": [0]}
    assert allocation_resources(ALLOC, ["a"], 3).as_dict() == {"a": [0, 1, 2]}


def test_errors():
    with pytest.raises(UsageError, match="asked for 4 GPUs per node but the job has 2"):
        allocation_resources({**ALLOC, "SLURM_GPUS_ON_NODE": "2"}, ["a"], 4)
    with pytest.raises(UsageError, match="names no node"):
        allocation_resources(ALLOC, [], None)
    with pytest.raises(UsageError, match="not a list of GPU ids"):
        gpu_slots({"SLURM_JOB_GPUS": "gpu:a100:2"})

