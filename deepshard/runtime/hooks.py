"""Gradient hooks that do not keep the object they call back into alive.

A hook registered on a parameter (``register_post_accumulate_grad_hook``) is held by the
parameter's C++ autograd metadata, which Python's garbage collector cannot see through. A
hook closing over its owner (``lambda p: self._on_grad(p)``) with the owner holding the
parameters is therefore a cycle the collector never frees: a dropped engine would keep its
model, buffers and optimizer state alive to the end of the process. These hooks hold their
owner weakly instead; once the owner is gone they do nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_hook(method: Callable[..., Any], *bound: Any) -> Callable[..., Any]:
    """``hook(*args)`` calls the bound ``method(*args, *bound)`` while its object lives."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        target = ref()
        return None if target is None else target(*args, *bound)

    return hook
