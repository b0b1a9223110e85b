"""Int8 weights for inference: per-output-channel quantization and the matmuls over it.

``init_inference(dtype=torch.int8)`` (DeepSpeed's ZeroQuant-style weight quantization) keeps
each linear weight as int8 with one fp32 scale per output channel (:class:`Int8Weights`, the
source of truth a layer stores as buffers) and multiplies through an :class:`Int8Kernel` built
from it once. A kernel's packed form is derived data: it is never in a ``state_dict``, and
pickling or deep-copying a kernel rebuilds it from the weights.

Kernels (``KernelName``), measured at GPT-2-small shapes on a 2-core AVX-512 CPU, torch 2.13:
``fbgemm`` is 3-10x faster than fp32 ``F.linear`` at 1-8 rows but quantizes activations too;
``int8pack`` (``torch._weight_int8pack_mm``, weight-only) is 2-20x *slower* than fp32 there with
fp32 input, yet about as fast as fbgemm with bf16 input (``in % 16 == 0``); ``auto`` picks it on
CUDA only. ``dequant`` is the reference and runs anywhere.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import torch
import torch.nn.functional as F

from deepshard.errors import UsageError, UsageValueError

KernelName = Literal["fbgemm", "int8pack", "dequant"]
KERNELS: tuple[str, ...] = get_args(KernelName)
_QMAX = 127
_FBGEMM_ENGINES = ("x86", "fbgemm")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelNotAvailableError(UsageError, RuntimeError):
    """An int8 kernel was requested on a device (or a torch build) that lacks it."""


@dataclass(frozen=True, eq=False)
class Int8Weights:
    """A linear weight, int8 symmetric per output channel: ``w ≈ qweight * scale[:, None]``."""

    qweight: torch.Tensor
    """int8 ``[out, in]``, values in [-127, 127] (-128 is never produced)."""
    scale: torch.Tensor
    """fp32 ``[out]`` on qweight's device: the row's max |w| / 127, or 1.0 for an all-zero row."""

    def __post_init__(self) -> None:
        q, s = self.qweight, self.scale
        if q.dtype != torch.int8 or q.dim() != 2:
            raise UsageValueError(f"qweight must be a 2-D int8 tensor, got {q.dtype} "
                                  f"{tuple(q.shape)}", hint="build it with quantize_per_channel(w)")
        if s.dtype != torch.float32 or tuple(s.shape) != (q.shape[0],) or s.device != q.device:
            raise UsageValueError(f"scale must be fp32 [{q.shape[0]}] on {q.device}, got {s.dtype} "
                                  f"{tuple(s.shape)} on {s.device}",
                                  hint="build it with quantize_per_channel(w)")

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 weight and the scales."""
        return int(self.qweight.numel() + self.scale.numel() * self.scale.element_size())

    def to(self, device: torch.device | str) -> Int8Weights:
        """The same weights on ``device``."""
        return Int8Weights(self.qweight.to(device), self.scale.to(device))


def quantize_per_channel(weight: torch.Tensor) -> Int8Weights:
    """Symmetric int8 per output channel (row) of a float ``[out, in]`` weight, on its device.

    ``|w - dequantize(q)| <= scale / 2`` elementwise; an all-zero row gets scale 1.0 and zeros.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise UsageValueError(f"can only quantize a 2-D float weight, got {weight.dtype} "
                              f"{tuple(weight.shape)}", hint="pass a Linear's weight [out, in]")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if not bool(torch.isfinite(amax).all()):
        raise UsageValueError("the weight holds inf or nan, which int8 cannot represent",
                              hint="check the checkpoint; quantize only finite weights")
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return Int8Weights(q.contiguous(), scale.contiguous())


def dequantize(q: Int8Weights, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float ``[out, in]`` weight ``q`` stands for, computed in fp32 and cast to ``dtype``."""
    return (q.qweight.float() * q.scale[:, None]).to(dtype)


def quantization_error(weight: torch.Tensor) -> float:
    """Max over output channels of ``max|w - deq| / max|w|`` (0 for zero rows); <= 1/254."""
    w = weight.detach().float()
    err = (w - dequantize(quantize_per_channel(w))).abs().amax(dim=1)
    amax = w.abs().amax(dim=1)
    rel = torch.where(amax > 0, err / amax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return float(rel.max()) if rel.numel() else 0.0


def _unavailable(name: str, device_type: str) -> tuple[str, str] | None:
    """Why kernel ``name`` cannot run on ``device_type``, and the fix; None when it can."""
    other = "request kernel 'auto' or 'dequant' (runs anywhere)"
    if name == "fbgemm":
        if device_type != "cpu":
            return "fbgemm runs on CPU only", other
        engine = torch.backends.quantized.engine
        if engine not in _FBGEMM_ENGINES:
            ok = [e for e in _FBGEMM_ENGINES if e in torch.backends.quantized.supported_engines]
            fix = f"set torch.backends.quantized.engine = {ok[0]!r}" if ok else other
            return f"torch's quantized engine is {engine!r}, not one of {_FBGEMM_ENGINES}", fix
    if name == "int8pack":
        try:
            has = torch._C._dispatch_has_kernel_for_dispatch_key(
                "aten::_weight_int8pack_mm", device_type.upper())
        except RuntimeError:  # not a dispatch key name
            has = False
        if not has:
            return f"this torch build has no {device_type} kernel for _weight_int8pack_mm", other
    return None


def choose_kernel(device_type: str, requested: str = "auto") -> KernelName:
    """The int8 kernel to run on ``device_type`` (``"cpu"``, ``"cuda"``...).

    ``auto``: fbgemm on CPU when torch's quantized engine is x86/fbgemm, int8pack on CUDA when
    the build has its kernel, dequant otherwise. A named kernel the device lacks raises
    :class:`KernelNotAvailableError`; an unknown name raises ``UsageValueError``.
    """
    if requested == "auto":
        preferred = {"cpu": "fbgemm", "cuda": "int8pack"}.get(device_type, "dequant")
        return cast(KernelName, "dequant" if _unavailable(preferred, device_type) else preferred)
    if requested not in KERNELS:
        raise UsageValueError(f"unknown int8 kernel {requested!r}",
                              hint=f"use one of 'auto', {', '.join(map(repr, KERNELS))}")
    why = _unavailable(requested, device_type)
    if why:
        raise KernelNotAvailableError(f"int8 kernel {requested!r} is not available on "
                                      f"{device_type}: {why[0]}", hint=why[1])
    return cast(KernelName, requested)


def _fbgemm_pack(q: Int8Weights, bias: torch.Tensor | None) -> Any:
    zero_points = torch.zeros(q.out_features, dtype=torch.long)
    with warnings.catch_warnings():
        # torch 2.13 deprecates creating quantized tensors; fbgemm's prepack still takes one
        warnings.filterwarnings("ignore", ".*quantized tensor creation", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(q.qweight, q.scale.double(), zero_points, 0)
    return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())


class Int8Kernel:
    """``y ≈ F.linear(x, dequantize(weights), bias)`` over int8 weights; build with :meth:`build`.

    ``x`` is ``[..., in]`` in fp32, bf16 or fp16 on the weights' device; ``y`` has x's dtype.
    Inference only: no gradients flow through fbgemm or int8pack.

    - ``fbgemm`` (CPU): fbgemm's dynamic quantized linear. It is W8A8-dynamic, not weight-only:
      each call quantizes the activations per tensor to uint8 on the fly (7-bit range, as
      torch.ao's dynamic Linear uses with fbgemm): ~1-2% relative error on Gaussian data, but
      ~10-15% when one feature is an outlier 20-100x the rest (as in LLM activations). It
      computes in fp32 (bf16/fp16 cast in and out) and keeps a packed copy of the weight
      (~1x the int8 bytes) besides ``weights``.
    - ``int8pack``: ``torch._weight_int8pack_mm``, weight-only (activations stay float). On
      CPU, bf16 input with ``in % 16 != 0`` runs in fp32: torch 2.13's bf16 kernel segfaults.
    - ``dequant``: the reference: dequantize the weight per call, then ``F.linear``.
    """

    def __init__(self, name: KernelName, weights: Int8Weights, bias: torch.Tensor | None,
                 packed: Any) -> None:
        self.name: KernelName = name
        """The kernel that runs: one of ``KERNELS``."""
        self.weights = weights
        self.bias = bias
        self._packed = packed

    @classmethod
    def build(cls, weights: Int8Weights, bias: torch.Tensor | None = None,
              kernel: str = "auto") -> Int8Kernel:
        """A kernel over ``weights`` and a ``[out]`` bias, ``kernel`` per :func:`choose_kernel`."""
        device = weights.qweight.device
        name = choose_kernel(device.type, kernel)
        if bias is not None:
            if tuple(bias.shape) != (weights.out_features,) or bias.device != device:
                raise UsageValueError(f"bias must be [{weights.out_features}] on {device}, got "
                                      f"{tuple(bias.shape)} on {bias.device}",
                                      hint="pass the Linear's own bias")
            bias = bias.detach()
        return cls(name, weights, bias, _fbgemm_pack(weights, bias) if name == "fbgemm" else None)

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 weight, the scales and the bias (not fbgemm's packed copy)."""
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weights.nbytes + extra

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _INPUT_DTYPES or x.shape[-1:] != (self.weights.in_features,):
            raise UsageValueError(f"int8 linear takes [..., {self.weights.in_features}] fp32/bf16/"
                                  f"fp16 input, got {x.dtype} {tuple(x.shape)}",
                                  hint="cast the input to float32")
        if x.device != self.weights.qweight.device:
            raise UsageValueError(f"input is on {x.device}, the int8 weights on "
                                  f"{self.weights.qweight.device}", hint="move the input there")
        x2 = x.reshape(-1, self.weights.in_features)
        if self.name == "fbgemm":
            y = torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self._packed, True)
        elif self.name == "int8pack":
            y = self._int8pack(x2)
        else:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = F.linear(x2, dequantize(self.weights, x.dtype), bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.weights.out_features)

    def _int8pack(self, x2: torch.Tensor) -> torch.Tensor:
        dtype = x2.dtype
        if x2.device.type == "cpu" and dtype == torch.bfloat16 and self.weights.in_features % 16:
            dtype = torch.float32  # torch 2.13's CPU bf16 kernel segfaults when in % 16 != 0
        y = torch._weight_int8pack_mm(x2.to(dtype).contiguous(), self.weights.qweight,
                                      self.weights.scale.to(dtype))
        return y if self.bias is None else y + self.bias.to(dtype)

    def __reduce__(self) -> tuple[Any, ...]:
        # the packed weight is derived: pickle/deepcopy rebuild it from the source of truth
        return (Int8Kernel.build, (self.weights, self.bias, self.name))

    def __repr__(self) -> str:
        w = self.weights
        return (f"Int8Kernel({self.name}, out={w.out_features}, in={w.in_features}, "
                f"bias={self.bias is not None})")
