"""The public surface: DeepSpeed 0.19.8's names and parameter lists (recorded from it), and
the helpers that need no process group."""

from __future__ import annotations

import datetime
import inspect

import pytest
import torch.distributed as dist

import deepshard.comm as comm
from deepshard.comm.process_group import timeout_from_env
from deepshard.errors import UsageError

# inspect.signature of deepspeed.comm's functions (of the op under timed_op), 0.19.8
DS_SIGNATURES = {
    "init_distributed": ("dist_backend", "auto_mpi_discovery", "distributed_port", "verbose",
                         "timeout", "init_method", "dist_init_required", "config", "rank",
                         "world_size"),
    "is_initialized": (), "is_available": (), "get_rank": ("group",),
    "get_world_size": ("group",), "get_local_rank": (), "get_global_rank": ("group", "group_rank"),
    "get_all_ranks_from_group": ("group",), "get_world_group": (), "new_group": ("ranks",),
    "destroy_process_group": ("group",),
    "all_reduce": ("tensor", "op", "group", "async_op", "prof", "log_name", "debug"),
    "inference_all_reduce": ("tensor", "op", "group", "async_op", "prof", "log_name", "debug"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op", "prof", "log_name", "debug"),
    "reduce": ("tensor", "dst", "op", "group", "async_op", "prof", "log_name", "debug"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op", "prof", "log_name",
                       "debug"),
    "reduce_scatter_tensor": ("output_tensor", "tensor", "op", "group", "async_op", "prof",
                              "log_name", "debug"),
    "reduce_scatter_fn": ("output_tensor", "tensor", "op", "group", "async_op", "prof", "debug"),
    "broadcast": ("tensor", "src", "group", "async_op", "prof", "log_name", "debug"),
    "broadcast_object_list": ("object_list", "src", "group", "device", "prof", "log_name",
                              "debug"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op", "prof", "log_name", "debug"),
    "all_gather_object": ("object_list", "obj", "group", "prof", "log_name", "debug"),
    "all_gather_into_tensor": ("output_tensor", "tensor", "group", "async_op", "prof",
                               "log_name", "debug"),
    "allgather_fn": ("output_tensor", "input_tensor", "group", "async_op", "debug"),
    "all_gather_coalesced": ("output_tensors", "input_tensors", "group", "async_op"),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op", "prof", "log_name", "debug"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op", "prof", "log_name",
                "debug"),
    "all_to_all_single": ("output", "tensor", "output_split_sizes", "input_split_sizes", "group",
                          "async_op", "prof", "log_name", "debug"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op", "prof",
                   "log_name", "debug"),
    "barrier": ("group", "async_op", "device_ids", "prof", "log_name", "debug"),
    "monitored_barrier": ("group", "timeout", "wait_all_ranks", "prof", "log_name", "debug"),
    "send": ("tensor", "dst", "group", "tag", "prof", "log_name", "debug"),
    "recv": ("tensor", "src", "group", "tag", "prof", "log_name", "debug"),
    "isend": ("tensor", "dst", "group", "tag", "prof", "log_name", "debug"),
    "irecv": ("tensor", "src", "group", "tag", "prof", "log_name", "debug"),
    "batch_isend_irecv": ("p2p_op_list", "prof", "log_name", "debug"),
    "configure": ("deepspeed_config", "enabled", "prof_all", "prof_ops", "verbose", "debug"),
    "log_summary": ("show_straggler", "return_dict"), "reset_log": (), "has_comm_data": (),
    "get_comm_operation_count": (), "get_logged_comm_ops": (),
    "has_all_gather_into_tensor": (), "has_reduce_scatter_tensor": (),
    "has_all_reduce_coalesced": (), "has_coalescing_manager": (),
    "initialize_mesh_device": ("mesh_shape", "mesh_dim_names"),
}


@pytest.mark.parametrize("name", sorted(DS_SIGNATURES))
def test_deepspeed_names_and_parameters(name):
    params = tuple(p for p in inspect.signature(getattr(comm, name)).parameters
                   if p != "kwargs")  # new_group passes torch's keywords through
    assert params == DS_SIGNATURES[name]


def test_every_exported_name_resolves():
    for name in comm.__all__:
        assert getattr(comm, name) is not None, name
    assert comm.ReduceOp is dist.ReduceOp
    with pytest.raises(AttributeError):
        comm.no_such_thing  # noqa: B018


def test_rank_queries_before_init_are_one_line_errors():
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    assert not comm.is_initialized() and comm.is_available()
    for query in (comm.get_rank, comm.get_world_size, comm.get_world_group):
        with pytest.raises(UsageError, match=r"before the process group was initialised.*"
                                             r"HINT: call deepshard.comm.init_distributed"):
            query()


def test_local_rank_from_the_launcher_env(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK", raising=False)
    assert comm.get_local_rank() == 0
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert comm.get_local_rank() == 2
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert comm.get_local_rank() == 3


def test_deepspeed_timeout_variable():
    assert timeout_from_env({}) is None
    assert timeout_from_env({"DEEPSPEED_TIMEOUT": "45"}) == datetime.timedelta(minutes=45)
    with pytest.raises(UsageError, match=r"DEEPSPEED_TIMEOUT='soon'.*HINT"):
        timeout_from_env({"DEEPSPEED_TIMEOUT": "soon"})


def test_p2p_op_takes_deepshards_or_torchs_isend_irecv():
    import torch

    assert comm.P2POp(comm.isend, torch.zeros(1), 1).op == "isend"
    assert comm.P2POp(dist.irecv, torch.zeros(1), 1).op == "irecv"
    with pytest.raises(ValueError, match="isend or irecv"):
        comm.P2POp(comm.send, torch.zeros(1), 1)
