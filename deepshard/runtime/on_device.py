"""DeepSpeed's ``OnDevice``: build a module's tensors directly on a device, in a dtype.

``with OnDevice(dtype=torch.bfloat16, device="meta"): model = MyModel()`` makes every
tensor the constructors create without an explicit ``device`` land on ``device`` (``"meta"``:
shapes only, no memory, to be materialised later), and every floating tensor created
without an explicit ``dtype`` come out in ``dtype``. This is torch's own device context
(``with torch.device(...)``) and default dtype, set for the block and restored after it,
where DeepSpeed replaces ``torch.empty``, ``torch.zeros`` and the like for the block; an
explicit ``device=``/``dtype=`` argument wins in both.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from deepshard.errors import UsageValueError

__all__ = ["OnDevice"]


class OnDevice:
    """The context manager of the module docstring.

    Args:
        dtype: the floating dtype new floating tensors get (``None``: leave it).
        device: where new tensors are created (default ``"meta"``).
        enabled: ``False`` makes the block change nothing.

    Raises:
        UsageValueError: ``dtype`` is not a floating dtype, or ``device`` is not a device.
    """

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise UsageValueError(f"dtype {dtype!r} is not a floating dtype",
                                  where="OnDevice(dtype)",
                                  hint="pass e.g. torch.float16, torch.bfloat16 or "
                                       "torch.float32 (integer tensors keep their dtype)")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise UsageValueError(f"{device!r} is not a device ({exc})",
                                  where="OnDevice(device)",
                                  hint="pass 'meta', 'cpu' or 'cuda:<local rank>'") from None
        self.dtype, self.enabled = dtype, enabled
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> OnDevice:
        stack = contextlib.ExitStack()
        if self.enabled:
            stack.enter_context(self.device)
            if self.dtype is not None:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
                stack.callback(torch.set_default_dtype, previous)
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
