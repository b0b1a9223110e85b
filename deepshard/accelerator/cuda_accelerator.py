"""The CUDA accelerator: DeepSpeed's ``CUDA_Accelerator`` over ``torch.cuda``.

It can be chosen where CUDA is not usable (``DS_ACCELERATOR=cuda`` on a login node, as
DeepSpeed allows): what only describes the device family (its name, ``nccl``, the visible
devices variable, ``is_available() == False``) answers, and every member that needs a device
raises a one-line :class:`~deepshard.errors.UsageError` saying so, instead of torch's
"Torch not compiled with CUDA enabled" from deep inside a call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from deepshard.accelerator.abstract_accelerator import Accelerator
from deepshard.errors import UsageError

F = TypeVar("F", bound=Callable[..., Any])


def cuda_unavailable(member: str) -> UsageError:
    """The error a device-only member raises without CUDA."""
    return UsageError(
        f"get_accelerator().{member} needs a CUDA device, and torch.cuda.is_available() is "
        f"False (torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})",
        where="CUDA accelerator",
        hint="run on a machine with a GPU and a CUDA build of torch, or set DS_ACCELERATOR=cpu "
             "(or unset it) to use the CPU accelerator")


def needs_cuda(method: F) -> F:
    """Raise :func:`cuda_unavailable` instead of calling ``method`` when CUDA is not usable."""
    @functools.wraps(method)
    def gated(self: CUDAAccelerator, *args: Any, **kwargs: Any) -> Any:
        if not torch.cuda.is_available():
            raise cuda_unavailable(f"{method.__name__}()")
        return method(self, *args, **kwargs)
    return gated  # type: ignore[return-value]


class CUDAAccelerator(Accelerator):
    """NVIDIA GPUs through ``torch.cuda``; collectives on nccl."""

    supports_nvtx_domain = False  # torch's NVTX ranges only; no domains without ``nvtx``

    def __init__(self) -> None:
        super().__init__("cuda", "nccl")

    def is_synchronized_device(self) -> bool:
        return False

    # ---- devices ------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index)

    @needs_cuda
    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    @needs_cuda
    def current_device(self) -> int:
        return torch.cuda.current_device()

    @needs_cuda
    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        """0 where CUDA is not usable (torch's answer, no error)."""
        return torch.cuda.device_count()

    @needs_cuda
    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    @needs_cuda
    def communication_backend_version(self) -> Any:
        """NCCL's version, as torch reports it."""
        return torch.cuda.nccl.version()

    # ---- random numbers -----------------------------------------------------------------

    @needs_cuda
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    @needs_cuda
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> Any:
        """Queued until CUDA initialises (torch's behaviour; no device needed)."""
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed)

    @needs_cuda
    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    @needs_cuda
    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # ---- streams, events and graphs -----------------------------------------------------

    @property
    def Stream(self) -> Any:
        if not torch.cuda.is_available():
            raise cuda_unavailable("Stream")
        return torch.cuda.Stream

    @property
    def Event(self) -> Any:
        if not torch.cuda.is_available():
            raise cuda_unavailable("Event")
        return torch.cuda.Event

    @needs_cuda
    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    @needs_cuda
    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    @needs_cuda
    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @needs_cuda
    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    @needs_cuda
    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    # ---- memory -------------------------------------------------------------------------

    @needs_cuda
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    @needs_cuda
    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    @needs_cuda
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    @needs_cuda
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    @needs_cuda
    def memory_cached(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    @needs_cuda
    def max_memory_cached(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    @needs_cuda
    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    @needs_cuda
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    @needs_cuda
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    @needs_cuda
    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    @needs_cuda
    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    @needs_cuda
    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    @needs_cuda
    def available_memory(self, device_index: int | None = None) -> int:
        """Free memory on the device, other processes' use included (``cudaMemGetInfo``)."""
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    # ---- data types ---------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        """True without a device, as in DeepSpeed (the answer is about the family)."""
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Compute capability 7+ (6.x with ``DS_ALLOW_DEPRECATED_FP16=1``); True without a
        device, as in DeepSpeed."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16") == "1")

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def amp(self) -> Any:
        return torch.cuda.amp

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        if not torch.cuda.is_available():
            raise cuda_unavailable(f"{_TYPE_NAMES[dtype]}")
        return functools.partial(torch.tensor, dtype=dtype, device="cuda")

    # ---- pinned host memory -------------------------------------------------------------

    @needs_cuda
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True,
                   match_shape: bool = True) -> torch.Tensor:
        return super().pin_memory(tensor, make_copy=make_copy, match_shape=match_shape)

    @needs_cuda
    def _pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return super()._pinned_empty(shape, dtype)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    @needs_cuda
    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        result = int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0))
        torch.cuda.check_error(result)
        return True

    @needs_cuda
    def unregister_host_memory(self, address: int) -> None:
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(address)))

    # ---- misc ---------------------------------------------------------------------------

    @needs_cuda
    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> Any:
        return torch.cuda.nvtx.range_push(msg)

    @needs_cuda
    def range_pop(self, domain: str | None = None) -> Any:
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` when CUDA initialises (at once if it has)."""
        return torch.cuda._lazy_call(callback)

    def is_triton_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def export_envs(self) -> list[str]:
        return ["NCCL"]


CUDA_Accelerator = CUDAAccelerator
"""DeepSpeed's class name."""

_TYPE_NAMES = {
    torch.bfloat16: "BFloat16Tensor", torch.uint8: "ByteTensor", torch.float64: "DoubleTensor",
    torch.float32: "FloatTensor", torch.float16: "HalfTensor", torch.int32: "IntTensor",
    torch.int64: "LongTensor",
}
