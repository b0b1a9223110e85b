"""The accelerator interface: DeepSpeed's ``DeepSpeedAccelerator`` method names, one ABC.

Scripts written for DeepSpeed ask ``get_accelerator()`` for the device name, streams, memory
statistics, RNG state and pinned buffers instead of calling ``torch.cuda`` directly; this is
the contract the CPU and CUDA accelerators implement with those names and signatures.
Members every device answers the same way (pinning helpers, op builders, compile backend,
visible-devices variables) are implemented here once.

deepshard has no op builders (its kernels live in :mod:`deepshard.kernels`, loaded with
CuPy): ``create_op_builder`` and ``get_op_builder`` return ``None`` for every name, which is
what DeepSpeed's CUDA accelerator returns for a builder it does not have, so code that probes
for an optional builder (``if builder is None: fall back``) takes its fallback.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from deepshard.errors import UsageError


class Accelerator(abc.ABC):
    """What ``get_accelerator()`` returns: one device family, DeepSpeed's method names.

    ``device_index=None`` means the current device throughout. ``_name`` and
    ``_communication_backend_name`` are attributes, as in DeepSpeed (scripts read
    ``get_accelerator()._name``).
    """

    supports_nvtx_domain = False

    def __init__(self, name: str, communication_backend: str):
        self._name = name
        self._communication_backend_name = communication_backend
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name!r}>"

    # ---- how the device behaves ---------------------------------------------------------

    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """True when work finishes before the call that issued it returns (a CPU)."""

    def use_host_timers(self) -> bool:
        """Time with the host clock (True) rather than device events."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """True when no stream synchronisation is needed between producer and consumer."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """True when allocation waits for in-flight work by itself."""
        return self.is_synchronized_device()

    # ---- devices ------------------------------------------------------------------------

    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str:
        """``'cuda'`` / ``'cpu'``, or ``'cuda:<index>'`` with an index."""

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> torch.device:
        """The ``torch.device`` of ``device_index``."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` the current device."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of the current device."""

    @abc.abstractmethod
    def current_device_name(self) -> str:
        """``device_name`` of the current device (``'cuda:0'``, ``'cpu'``)."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices this process can use."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all work queued on the device."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether the device family is usable in this process."""

    @abc.abstractmethod
    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: ``'nccl'`` or ``'gloo'``."""

    # ---- random numbers -----------------------------------------------------------------

    def random(self) -> Any:
        """The ``torch.random`` module."""
        return torch.random

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The device's RNG state (a ByteTensor)."""

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a state from :meth:`get_rng_state`."""

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> Any:
        """Seed the current device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> Any:
        """Seed every device's generator."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed of the current device's generator."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """The default ``torch.Generator`` of ``device_index``."""

    # ---- streams, events and graphs -----------------------------------------------------

    @property
    @abc.abstractmethod
    def Stream(self) -> Any:
        """The stream class, or ``None`` on a device without streams."""

    @property
    @abc.abstractmethod
    def Event(self) -> Any:
        """The event class, or ``None`` on a device without events."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A context manager that makes ``stream`` current."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any:
        """The current stream, or ``None``."""

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any:
        """The default stream, or ``None``."""

    def is_current_stream_capturing(self) -> bool:
        """Whether a graph capture is in progress on the current stream."""
        return False

    @abc.abstractmethod
    def create_graph(self) -> Any:
        """A new device graph, or ``None`` where graphs do not exist."""

    @abc.abstractmethod
    def capture_to_graph(self, graph: Any, pool: Any = None,
                         stream: Any = None) -> contextlib.AbstractContextManager[Any]:
        """A context manager that records the work issued inside it into ``graph``."""

    @abc.abstractmethod
    def replay_graph(self, graph: Any) -> None:
        """Run a captured graph."""

    # ---- memory -------------------------------------------------------------------------

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused memory to the device."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors now."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Start a new peak for :meth:`max_memory_allocated`."""

    @abc.abstractmethod
    def memory_cached(self, device_index: int | None = None) -> int:
        """Bytes held by the caching allocator (DeepSpeed's older name of reserved)."""

    @abc.abstractmethod
    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_cached`."""

    @abc.abstractmethod
    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Start a new peak for :meth:`max_memory_cached`."""

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """The allocator's statistics (``allocated_bytes.all.current``, ``...peak``...)."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Reset every peak statistic."""

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes reserved by the allocator."""

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved`."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory in bytes."""

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory in bytes."""

    # ---- data types ---------------------------------------------------------------------

    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 compute is supported."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 compute is supported."""

    def is_fp64_supported(self) -> bool:
        """Whether float64 compute is supported."""
        return True

    @abc.abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating dtypes training can use on this device."""

    @abc.abstractmethod
    def amp(self) -> Any:
        """The device's legacy ``torch.<device>.amp`` module (older DeepSpeed's ``amp()``)."""

    def autocast(self, **kwargs: Any) -> torch.autocast:
        """``torch.autocast`` for this device (deepshard's shortcut for what DeepSpeed spells
        ``torch.autocast(device_type=get_accelerator().device_name(), ...)``)."""
        return torch.autocast(device_type=self.device_name(), **kwargs)

    # ---- tensor constructors (``get_accelerator().FloatTensor(data)``) --------------------

    @abc.abstractmethod
    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """A constructor of tensors of ``dtype`` on this device."""

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.float64)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.float16)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        return self._tensor_type(torch.int64)

    # ---- pinned host memory -------------------------------------------------------------

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True,
                   match_shape: bool = True) -> torch.Tensor:
        """A page-locked copy of ``tensor`` (``make_copy=False``: an uninitialised pinned
        buffer of its shape, or of its element count when not ``match_shape``)."""
        if make_copy:
            return tensor.pin_memory()
        shape = tensor.shape if match_shape else (tensor.numel(),)
        return tensor.new_empty(shape, pin_memory=True)

    def pin_empty(self, *size: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        """An uninitialised pinned host tensor of ``size``."""
        _require_host(device)
        shape = size[0] if len(size) == 1 and isinstance(size[0], Sequence) else size
        return self._pinned_empty(tuple(int(n) for n in shape), dtype)

    def pin_empty_like(self, tensor: torch.Tensor, device: Any = "cpu",
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised pinned host tensor shaped like ``tensor``."""
        _require_host(device)
        return self._pinned_empty(tuple(tensor.shape), dtype or tensor.dtype)

    def _pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in page-locked host memory."""
        return tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Release a pin taken by a native pinning backend (deepshard has none): no-op."""
        del tensor

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock existing host memory with the device runtime; False: not done."""
        del address, num_bytes
        return False

    def unregister_host_memory(self, address: int) -> None:
        """Undo :meth:`register_host_memory`."""
        del address

    def pin_memory_alignment(self) -> int:
        """Byte alignment required for registered host memory; 1 means none."""
        return 1

    @abc.abstractmethod
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator."""

    # ---- misc ---------------------------------------------------------------------------

    @abc.abstractmethod
    def range_push(self, msg: str, domain: str | None = None,
                   category: Any = None) -> Any:
        """Open a named profiler range (NVTX on CUDA)."""

    @abc.abstractmethod
    def range_pop(self, domain: str | None = None) -> Any:
        """Close the innermost profiler range."""

    @abc.abstractmethod
    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` once the device is initialised (at once where it is)."""

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run here."""
        return False

    def prefer_triton_grouped_mm(self) -> bool:
        """Whether MoE should prefer a Triton grouped GEMM over ``torch._grouped_mm``."""
        return False

    def op_builder_dir(self) -> None:
        """DeepSpeed's op-builder package; deepshard has none (see the module docstring)."""
        return None

    def create_op_builder(self, class_name: str) -> None:
        """``None``: deepshard has no op builders (its kernels are in deepshard.kernels)."""
        del class_name
        return None

    def get_op_builder(self, class_name: str) -> None:
        """``None``: deepshard has no op builders (its kernels are in deepshard.kernels)."""
        del class_name
        return None

    def build_extension(self) -> Any:
        """torch's ``BuildExtension``, for setup.py files that ask the accelerator."""
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    @abc.abstractmethod
    def export_envs(self) -> list[str]:
        """Prefixes of environment variables the launcher forwards for this device."""

    def visible_devices_envs(self) -> list[str]:
        """Variables that restrict which devices a process sees."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: MutableMapping[str, str],
                                 local_accelerator_ids: Sequence[int]) -> None:
        """Set :meth:`visible_devices_envs` in ``current_env`` to ``local_accelerator_ids``."""
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend the engine uses (``inductor`` by default)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend; it must be one torch knows."""
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise UsageError(f"torch.compile backend {backend!r} is not known to torch",
                             where=f"{type(self).__name__}.set_compile_backend",
                             hint=f"use one of: {', '.join(known)}")
        self._compile_backend = backend


DeepSpeedAccelerator = Accelerator
"""DeepSpeed's name of the interface (``set_accelerator`` takes any subclass)."""


def _require_host(device: Any) -> None:
    if torch.device(device).type != "cpu":
        raise UsageError(f"pinned buffers live in host memory, not on {device!r}",
                         where="pin_empty", hint="pass device='cpu' or leave it out")
