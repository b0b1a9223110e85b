"""PyTorch-style backward: ``loss.backward()`` on a loss computed from ``engine(...)``
outputs does what ``engine.backward(loss)`` does, for every engine the loss reaches.

``engine.backward(loss)`` scales the loss and brackets autograd with the strategy's
``begin_backward``/``end_backward``. A plain ``loss.backward()`` gives the engine no such
call, so the engine marks the edges of its forward instead (:class:`Edges`):

- each output tensor is handed out as an alias whose gradient hook, the first time a
  backward reaches it, begins the engine's backward (a *direct session*: the strategy's
  ``begin_backward`` now, its ``end_backward`` queued for the end of that autograd pass)
  and multiplies the incoming gradient by the factor ``engine.backward`` would have
  scaled the loss by (``1 / (accumulation × world)``, times the fp16 loss scale). Outputs
  computed from one another inside the module (HF models return ``loss`` and the
  ``logits`` it came from) are separate aliases, so the factor is applied once;
- each input tensor that requires grad gets an alias whose hook divides that factor out
  again, so a loss that runs through two engines (``D(G(z))``) scales each engine's
  gradients by its own factor only.

During an ``engine.backward`` every edge hook passes gradients through unchanged (its
loss is scaled already), like DeepSpeed's. Parameters a backward reaches without passing
an edge (another engine's backward running through this engine's raw module: the GAN
pattern) get a *passive session*, a backward that does not synchronise: the gradients
accumulate, as in DeepSpeed, and are reduced by the next synchronising backward or step.

:data:`SESSIONS` counts the backwards in progress. It is the one piece of process-wide
state here, because autograd is process-wide: which engine's backward a gradient belongs
to is only known to whoever started it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UsageError


@dataclass
class Sessions:
    """Backwards in progress in this process: ``explicit`` ones (``engine.backward``) and
    ``direct`` ones (begun by an engine's output hook)."""

    explicit: int = 0
    direct: int = 0

    def any(self) -> bool:
        """Some engine's backward is running."""
        return self.explicit > 0 or self.direct > 0


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


class Edges:
    """Aliases of a forward's inputs and outputs with the gradient hooks described in the
    module docstring.

    Args:
        on_output: ``on_output()`` returns the factor to multiply an output's gradient by
            (beginning a direct session when needed), or ``None`` to pass it through.
        active_factor: the factor of this engine's direct session in the running pass, or
            ``None`` when there is none (an input's gradient is then passed through).
    """

    def __init__(self, on_output: Callable[[], float | None],
                 active_factor: Callable[[], float | None]):
        self._on_output, self._active_factor = on_output, active_factor

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args``/``kwargs`` with every tensor that requires grad replaced by an alias."""
        if not torch.is_grad_enabled():
            return args, kwargs
        return (tuple(_map(a, self._alias_input) for a in args),
                {k: _map(v, self._alias_input) for k, v in kwargs.items()})

    def outputs(self, out: Any) -> Any:
        """``out`` with every tensor that requires grad replaced by a hooked alias (tuples,
        lists and dicts, HF ``ModelOutput`` included, are rebuilt or updated in place)."""
        if not torch.is_grad_enabled():
            return out
        return _map(out, self._alias_output)

    def _alias_output(self, t: torch.Tensor) -> torch.Tensor:
        alias = t.view_as(t)
        alias.register_hook(self._output_grad)
        return alias

    def _alias_input(self, t: torch.Tensor) -> torch.Tensor:
        alias = t.view_as(t)
        alias.register_hook(self._input_grad)
        return alias

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        factor = self._on_output()
        return grad if factor is None or factor == 1.0 else grad * factor

    def _input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        factor = self._active_factor()
        return grad if factor is None or factor == 1.0 else grad / factor


@dataclass(frozen=True)
class _Session:
    graph: int  # the autograd pass it belongs to
    sync: bool  # it reduces the gradients (an accumulation boundary)
    factor: float  # what its outputs' gradients are multiplied by
    passive: bool = False  # begun by a parameter's gradient, not by an output's


class BackwardDriver:
    """One engine's backwards, whoever starts them: ``engine.backward`` (:meth:`explicit`),
    a gradient reaching one of its outputs (:meth:`on_output`), or one reaching its
    parameters through neither (:meth:`on_outside`, a passive session).

    Args:
        strategy: the engine's data-parallel strategy (``begin_backward``/``end_backward``).
        boundary: whether a backward starting now synchronises (accumulation boundary).
        factor: what a backward starting now scales the loss by.
        after: called once a backward of this engine has ended (the heartbeat).
    """

    def __init__(self, strategy, boundary: Callable[[], bool], factor: Callable[[], float],
                 after: Callable[[], None]):
        self._strategy = strategy
        self._boundary, self._factor, self._after = boundary, factor, after
        self._session: _Session | None = None
        self.edges = Edges(self.on_output, self.active_factor)

    def explicit(self, autograd: Callable[[], None], sync: bool) -> None:
        """Run ``autograd`` (its loss scaled already) between ``begin_backward`` and
        ``end_backward``; ``abort_backward`` when it raises."""
        self.reap()
        SESSIONS.explicit += 1
        self._strategy.begin_backward(sync)
        try:
            autograd()
        except BaseException:
            self._strategy.abort_backward()
            raise
        finally:
            SESSIONS.explicit -= 1
        self._strategy.end_backward(sync)

    def on_output(self) -> float | None:
        """An output's gradient arrived: the factor to scale it by (``None``: inside an
        ``engine.backward``, whose loss is scaled already)."""
        if SESSIONS.explicit:
            return None
        graph = current_graph()
        s = self._session
        if s is not None and s.graph == graph:
            if s.passive:
                raise UsageError(
                    "one backward reached this engine both through its raw module's "
                    "parameters and through engine(...) outputs", where="loss.backward()",
                    hint="compute the loss from engine(...) outputs only, or use "
                         "engine.backward(loss)")
            return s.factor
        self.reap()
        return self._begin(graph, self._boundary(), self._factor()).factor

    def active_factor(self) -> float | None:
        """The factor of this engine's session in the running pass, if it has one."""
        s = self._session
        return s.factor if s is not None and s.graph == current_graph() else None

    def on_outside(self) -> None:
        """A parameter got a gradient while no backward of this engine is active."""
        if not SESSIONS.any():
            raise UsageError(
                "a parameter got a gradient outside any engine's backward",
                where="loss.backward()",
                hint="call engine.backward(loss), or loss.backward() on a loss computed "
                     "from engine(...) outputs (not engine.module(...))")
        self.reap()
        self._begin(current_graph(), False, 1.0, passive=True)

    def reap(self) -> None:
        """Abort a session whose autograd pass raised (its end never came)."""
        if self._session is not None and self._session.graph != current_graph():
            self._session = None
            SESSIONS.direct -= 1
            self._strategy.abort_backward()

    def _begin(self, graph: int, sync: bool, factor: float,
               passive: bool = False) -> _Session:
        if passive:
            self._strategy.begin_passive()
        else:
            self._strategy.begin_backward(sync)
        self._session = _Session(graph, sync, factor, passive)
        SESSIONS.direct += 1
        at_end_of_backward(self._end)
        return self._session

    def _end(self) -> None:
        s, self._session = self._session, None
        if s is None:
            return
        SESSIONS.direct -= 1
        self._strategy.end_backward(s.sync)
        self._after()


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to each tensor in it that requires grad."""
    if torch.is_tensor(value):
        return fn(value) if value.requires_grad else value
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: _map(v, fn) for k, v in value.items()}
        for k in list(value.keys()):  # a dict subclass (HF ModelOutput): keep its type
            value[k] = _map(value[k], fn)
        return value
    if isinstance(value, tuple):
        items = [_map(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    return value
