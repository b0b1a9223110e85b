"""PyTorch-style backward: ``loss.backward()`` does what ``engine.backward(loss)`` does, for
every engine whose parameters the loss reaches.

``engine.backward(loss)`` scales the loss and brackets autograd with the strategy's
``begin_backward``/``end_backward``. A plain ``loss.backward()`` gives the engine no such
call, so the engine watches two places instead (:class:`BackwardDriver`):

- the tensors ``engine(...)`` returns carry a gradient hook: the first one a backward
  reaches begins the engine's backward there (a *direct session*: the strategy's
  ``begin_backward`` now, its ``end_backward`` queued for the end of that autograd pass,
  the outer one even when reentrant checkpoints run inner passes for the recompute);
- every parameter the engine trains carries a gradient pre-hook (it runs before the
  gradient is accumulated). In a direct session it multiplies the gradient by the factor
  ``engine.backward`` would have scaled the loss by (``1 / (accumulation × world)``),
  whichever way the gradient came: the engine's outputs, its raw module, a penalty on its
  weights, a gradient penalty from ``torch.autograd.grad``. So each engine's parameters
  get their own engine's factor, also for a loss through two engines (``D(G(z))``). A
  gradient that arrives before any session (only the raw module was used) begins one.
  Inside this engine's own ``engine.backward`` the hook passes gradients through (the
  loss is scaled already); inside another engine's ``engine.backward`` (the GAN
  generator's loss through the discriminator's raw module) it begins a *passive session*,
  a backward that does not synchronise: the gradients accumulate, as in DeepSpeed, and are
  reduced by this engine's next synchronising backward or step (at stages 2-3 they wait in
  ``.grad``, so the module's own ``zero_grad()`` drops them, as in plain torch).

fp16 needs the loss itself scaled (the activations' gradients would underflow otherwise):
``engine.scale(loss).backward()``, as in DeepSpeed.

:data:`SESSIONS` counts the ``engine.backward`` calls in progress. It is the one piece of
process-wide state here, because autograd is process-wide: which engine's backward a
gradient belongs to is only known to whoever started it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.errors import UsageError
from deepshard.liveness import arrive
from deepshard.runtime.nested import tensors_in


@dataclass
class Sessions:
    """``engine.backward`` calls in progress in this process."""

    explicit: int = 0


SESSIONS = Sessions()


def outside_error(name: str) -> UsageError:
    """A parameter got a gradient while no engine listens for one (a strategy used
    without an engine)."""
    return UsageError(f"{name} got a gradient outside engine.backward()",
                      where="loss.backward()",
                      hint="call engine.backward(loss), or loss.backward() on a loss "
                           "computed from engine(...) outputs")


def current_graph() -> int:
    """The running autograd pass (``-1`` outside backward)."""
    return torch._C._current_graph_task_id()


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running autograd pass has finished (DDP's and FSDP's
    post-backward mechanism). It does not run when the pass raises."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@dataclass(frozen=True)
class _Session:
    graph: int  # the autograd pass it belongs to
    sync: bool  # it reduces the gradients (an accumulation boundary)
    factor: float  # what each gradient of the pass is multiplied by


class BackwardDriver:
    """One engine's backwards, whoever starts them: ``engine.backward`` (:meth:`explicit`),
    a gradient reaching one of its outputs (:meth:`on_output`) or parameters
    (:meth:`param_grad`).

    Args:
        strategy: the engine's data-parallel strategy (``begin_backward``/``end_backward``).
        boundary: whether a backward starting now synchronises (accumulation boundary).
        factor: what a ``loss.backward()`` starting now scales the gradients by (it raises
            when a plain backward cannot be right, e.g. fp16 without ``engine.scale``).
        after: called once a backward of this engine has ended (the heartbeat).
    """

    def __init__(self, strategy, boundary: Callable[[], bool], factor: Callable[[], float],
                 after: Callable[[], None]):
        self._strategy = strategy
        self._boundary, self._factor, self._after = boundary, factor, after
        self._session: _Session | None = None
        self._explicit = 0

    def explicit(self, autograd: Callable[[], None], sync: bool) -> None:
        """Run ``autograd`` (its loss scaled already) between ``begin_backward`` and
        ``end_backward``; ``abort_backward`` when it raises."""
        self.reap()
        SESSIONS.explicit += 1
        self._explicit += 1
        self._strategy.begin_backward(sync)
        try:
            autograd()
        except BaseException:
            self._strategy.abort_backward()
            raise
        finally:
            SESSIONS.explicit -= 1
            self._explicit -= 1
        if sync:
            arrive()  # own work done; the gradient reduction waits from here (ds-run stragglers)
        self._strategy.end_backward(sync)

    def hook_outputs(self, out: Any) -> None:
        """Hook the tensors of ``out`` that require grad (tuples, lists, dicts and HF
        ``ModelOutput``); the hooks change no gradient."""
        if torch.is_grad_enabled():
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(self.on_output)

    def on_output(self, grad: torch.Tensor) -> None:
        """An output's gradient arrived: begin a direct session unless one runs."""
        del grad
        if self._session is None and not self._explicit and not SESSIONS.explicit:
            self._begin(passive=False)

    def param_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient pre-hook of every parameter the engine trains (module docstring)."""
        if self._explicit:
            return grad
        s = self._session
        if s is None:
            s = self._begin(passive=SESSIONS.explicit > 0)
        return grad if s.factor == 1.0 else grad * s.factor

    def reap(self) -> None:
        """Outside backward: abort a session whose autograd pass raised (its end never
        came)."""
        if self._session is not None and current_graph() == -1:
            self._session = None
            self._strategy.abort_backward()

    def _begin(self, passive: bool) -> _Session:
        if passive:  # another engine's engine.backward reached these parameters
            session = _Session(current_graph(), False, 1.0)
            self._strategy.begin_passive()
        else:
            session = _Session(current_graph(), self._boundary(), self._factor())
            self._strategy.begin_backward(session.sync)
        self._session = session
        at_end_of_backward(self._end)
        return session

    def _end(self) -> None:
        s, self._session = self._session, None
        if s is None:
            return
        if s.sync:
            arrive()
        self._strategy.end_backward(s.sync)
        self._after()
