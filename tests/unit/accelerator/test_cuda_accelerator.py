"""The CUDA accelerator: chosen without CUDA (DS_ACCELERATOR=cuda) it describes the device
family and refuses, in one line, whatever needs a device; on a GPU, the real thing."""

from __future__ import annotations

import pytest
import torch

from deepshard.accelerator import CUDAAccelerator
from deepshard.errors import UsageError

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA gate")
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GATED = [
    ("set_device", (0,)), ("current_device", ()), ("current_device_name", ()),
    ("synchronize", ()), ("get_rng_state", ()), ("set_rng_state", (torch.zeros(1),)),
    ("initial_seed", ()), ("stream", (None,)), ("current_stream", ()), ("default_stream", ()),
    ("create_graph", ()), ("empty_cache", ()), ("memory_allocated", ()),
    ("max_memory_allocated", ()), ("memory_reserved", ()), ("memory_stats", ()),
    ("reset_peak_memory_stats", ()), ("total_memory", ()), ("available_memory", ()),
    ("pin_memory", (torch.zeros(1),)), ("range_push", ("x",)), ("range_pop", ()),
    ("communication_backend_version", ()),
]


@no_cuda
def test_without_cuda_it_describes_the_family():
    cuda = CUDAAccelerator()
    assert not cuda.is_available() and cuda.device_count() == 0
    assert cuda.device_name() == "cuda" and cuda.device_name(1) == "cuda:1"
    assert cuda.device(1) == torch.device("cuda", 1)
    assert cuda.communication_backend_name() == "nccl" and cuda.export_envs() == ["NCCL"]
    assert not cuda.is_synchronized_device() and not cuda.is_current_stream_capturing()
    assert cuda.is_bf16_supported() and cuda.is_fp16_supported()  # DeepSpeed's answers
    assert cuda.supported_dtypes() == [torch.float32, torch.float16, torch.bfloat16]
    assert not cuda.on_accelerator(torch.zeros(1)) and not cuda.is_triton_supported()
    assert cuda.create_op_builder("FusedAdamBuilder") is None


@no_cuda
@pytest.mark.parametrize(("member", "args"), GATED)
def test_without_cuda_device_members_raise_one_line(member, args):
    with pytest.raises(UsageError) as err:
        getattr(CUDAAccelerator(), member)(*args)
    text = str(err.value)
    assert text.startswith(f"CUDA accelerator: get_accelerator().{member}() needs a CUDA "
                           "device, and torch.cuda.is_available() is False")
    assert "HINT:" in text and "DS_ACCELERATOR=cpu" in text and "\n" not in text


@no_cuda
@pytest.mark.parametrize("member", ["Stream", "Event", "FloatTensor", "HalfTensor"])
def test_without_cuda_class_properties_raise_too(member):
    with pytest.raises(UsageError, match=rf"get_accelerator\(\).{member} needs a CUDA device"):
        getattr(CUDAAccelerator(), member)


@gpu
@needs_gpu
def test_on_a_gpu():
    cuda = CUDAAccelerator()
    assert cuda.is_available() and cuda.device_count() >= 1
    cuda.set_device(0)
    assert cuda.current_device() == 0 and cuda.current_device_name() == "cuda:0"
    x = cuda.FloatTensor([1.0, 2.0])
    assert cuda.on_accelerator(x) and x.device.type == "cuda"
    assert cuda.memory_allocated() > 0 and cuda.max_memory_allocated() >= cuda.memory_allocated()
    assert cuda.total_memory() >= cuda.available_memory() > 0
    stream = cuda.Stream()
    with cuda.stream(stream):
        y = x * 2
    event = cuda.Event(enable_timing=True)
    event.record()
    cuda.synchronize()
    assert y.tolist() == [2.0, 4.0]
    state = cuda.get_rng_state()
    first = torch.rand(2, device="cuda")
    cuda.set_rng_state(state)
    assert torch.equal(torch.rand(2, device="cuda"), first)
    pinned = cuda.pin_memory(torch.ones(4))
    assert cuda.is_pinned(pinned) and cuda.pin_empty(3, dtype=torch.float32).is_pinned()
    cuda.range_push("deepshard")
    cuda.range_pop()
    assert torch.bfloat16 in cuda.supported_dtypes()
    assert cuda.communication_backend_version() is not None
