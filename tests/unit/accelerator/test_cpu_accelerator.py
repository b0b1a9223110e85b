"""The CPU accelerator, for real: DeepSpeed's names and its CPU answers."""

from __future__ import annotations

import contextlib

import pytest
import torch

from deepshard.accelerator import CPUAccelerator, CUDAAccelerator
from deepshard.accelerator.cpu_accelerator import numa_nodes_with_cpus

# public members of DeepSpeed 0.19.8's DeepSpeedAccelerator
DS_MEMBERS = [
    "BFloat16Tensor", "ByteTensor", "DoubleTensor", "Event", "FloatTensor", "HalfTensor",
    "IntTensor", "LongTensor", "Stream", "available_memory", "build_extension", "capture_to_graph",
    "communication_backend_name", "create_graph", "create_op_builder", "current_device",
    "current_device_name", "current_stream", "default_generator", "default_stream", "device",
    "device_count", "device_name", "empty_cache", "export_envs", "get_compile_backend",
    "get_op_builder", "get_rng_state", "handles_memory_backpressure", "initial_seed",
    "is_available", "is_bf16_supported", "is_current_stream_capturing", "is_fp16_supported",
    "is_fp64_supported", "is_pinned", "is_synchronized_device", "is_triton_supported", "lazy_call",
    "manual_seed", "manual_seed_all", "max_memory_allocated", "max_memory_cached",
    "max_memory_reserved", "memory_allocated", "memory_cached", "memory_reserved", "memory_stats",
    "on_accelerator", "op_builder_dir", "pin_empty", "pin_empty_like", "pin_memory",
    "pin_memory_alignment", "prefer_triton_grouped_mm", "random", "range_pop", "range_push",
    "register_host_memory", "replay_graph", "reset_max_memory_allocated",
    "reset_max_memory_cached", "reset_peak_memory_stats", "resolves_data_dependency",
    "set_compile_backend", "set_device", "set_rng_state", "set_visible_devices_envs", "stream",
    "supported_dtypes", "supports_nvtx_domain", "synchronize", "total_memory", "unpin_memory",
    "unregister_host_memory", "use_host_timers", "visible_devices_envs",
]


@pytest.fixture
def cpu():
    return CPUAccelerator()


@pytest.mark.parametrize("cls", [CPUAccelerator, CUDAAccelerator])
def test_every_deepspeed_member_is_there(cls):
    missing = [name for name in DS_MEMBERS if not hasattr(cls, name)]
    assert not missing
    assert cls()._name in ("cpu", "cuda")  # nothing abstract is left


def test_device_queries(cpu, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cpu.device_name() == cpu.device_name(3) == cpu.current_device_name() == "cpu"
    assert cpu.device(0) == torch.device("cpu") and cpu.current_device() == 1
    assert cpu.communication_backend_name() == "gloo"  # what init_distributed picks on CPU
    assert cpu.is_available() and cpu.is_synchronized_device() and cpu.use_host_timers()
    assert cpu.resolves_data_dependency() and cpu.handles_memory_backpressure()
    cpu.set_device(1)
    cpu.synchronize()
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert cpu.device_count() == 4
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() == numa_nodes_with_cpus() >= 1


def test_numa_nodes_count_those_with_cpus(tmp_path):
    for node, cpus in (("node0", "0-3\n"), ("node1", "\n"), ("node2", "4-7\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    assert numa_nodes_with_cpus(tmp_path) == 2
    assert numa_nodes_with_cpus(tmp_path / "absent") == 1


def test_memory_is_the_process_rss_with_a_peak(cpu):
    now = cpu.memory_allocated()
    assert now > 0 and cpu.max_memory_allocated() >= now
    assert cpu.memory_reserved() > 0 and cpu.memory_cached() > 0
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] > 0
    cpu.reset_peak_memory_stats()
    # The current value first: the resident set may grow between the two reads, and the
    # peak read second has seen it.
    after = cpu.memory_allocated()
    assert cpu.max_memory_allocated() >= after > 0
    assert cpu.total_memory() >= cpu.available_memory() > 0
    cpu.empty_cache()


def test_random_state_round_trips(cpu):
    cpu.manual_seed(7)
    assert cpu.initial_seed() == 7
    state = cpu.get_rng_state()
    first = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert cpu.random() is torch.random and cpu.default_generator(0) is torch.default_generator


def test_no_streams_events_or_graphs(cpu):
    assert cpu.Stream is None and cpu.Event is None
    assert cpu.current_stream() is None and cpu.default_stream() is None
    assert isinstance(cpu.stream(None), contextlib.nullcontext)
    assert cpu.create_graph() is None and not cpu.is_current_stream_capturing()
    with cpu.capture_to_graph(None):
        pass


def test_dtypes_tensors_and_pinning(cpu):
    assert torch.float32 in cpu.supported_dtypes() and cpu.is_bf16_supported()
    assert (torch.float16 in cpu.supported_dtypes()) == cpu.is_fp16_supported()
    assert cpu.FloatTensor([1, 2]).dtype == torch.float32
    assert cpu.LongTensor([1]).dtype == torch.int64 and cpu.BFloat16Tensor([1]).is_cpu
    t = torch.ones(3)
    assert cpu.pin_memory(t) is t  # no-op on a CPU, as in DeepSpeed
    assert cpu.pin_empty(2, 3, dtype=torch.float16).shape == (2, 3)
    assert cpu.pin_empty_like(t).shape == (3,) and not cpu.is_pinned(t)
    assert cpu.on_accelerator(t) and cpu.amp() is torch.cpu.amp
    with cpu.autocast(dtype=torch.bfloat16):
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16


def test_misc_members(cpu):
    assert cpu.lazy_call(lambda: 5) == 5
    assert cpu.range_push("x") is None and cpu.range_pop() is None
    assert cpu.create_op_builder("CPUAdamBuilder") is None  # deepshard has no op builders
    assert cpu.get_op_builder("FusedAdamBuilder") is None
    assert cpu.export_envs() == [] and cpu.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"]
    env: dict[str, str] = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert cpu.get_compile_backend() == "inductor" and not cpu.is_triton_supported()
