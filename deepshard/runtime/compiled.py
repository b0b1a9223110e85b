"""``engine.compile()``: ``torch.compile`` for training, at every ZeRO stage.

Two steps, as elsewhere in the runtime:

- :func:`plan_compile` (pure) decides what is compiled: each of the model's repeated
  blocks on its own (*regional* compilation: the items of its ``ModuleList``, such as a
  transformer's layers), at every stage, or the whole model when it has no repeated blocks.
  The blocks are the same code with the same shapes, so they share one compiled graph:
  compiled once, reused by every block, which takes about half the compile time of the
  whole model unrolled (measured: ``benchmarks/zero.py --compile``); the root's own code
  (embeddings, final norm, head, loss) runs eagerly between them. At stage 3 the regions
  are ZeRO-3's *units* (:mod:`.zero.stage3`, the same blocks): their parameters are
  gathered by forward hooks around each unit's call, and only its ``forward`` is compiled,
  so the gathers run in ``Module.__call__``, outside the compiled code, and the region sees
  whole parameters. Compiling the whole model would put those collectives inside the traced
  code: dynamo cannot trace them, breaks the graph around each one, and a graph break in
  the model's loop over its blocks makes it give up on the whole forward (eager then). At
  stages 0-2 the per-block backward graphs also let each block's gradients reach the
  reduction hooks as soon as that block's backward ends, as in eager backward; one backward
  graph for the whole model would hand them all over at its end.
- :class:`CompiledModel` applies the plan and reports: compile time, graphs and graph
  breaks at the first step (one log line; every graph break's reason with ``debug``), and a
  one-line warning, once, when a later step compiles again (a changed batch or sequence
  length: torch then marks the changed dimension dynamic and compiles once more, and later
  shapes reuse that graph; the fix is to pad to a few fixed shapes or to compile with
  ``dynamic=True``).

Counters are dynamo's own (``torch._dynamo.utils.counters``, process-wide): the report
gives the difference since :meth:`CompiledModel.apply`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepshard.runtime.zero.stage3 import container_blocks

logger = logging.getLogger("deepshard")

WHOLE = ""
"""The qualified name of the root module: the whole model is one compiled region."""


@dataclass(frozen=True)
class CompileRequest:
    """What ``engine.compile()`` (or the ``compile`` config section) asked for."""

    backend: str = "inductor"
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """More ``torch.compile`` arguments (``mode``, ``dynamic``, ``fullgraph``, ``options``)."""
    debug: bool = False
    """Log every graph break's reason and every recompilation (``compile.debug_log``)."""
    compiled_autograd: bool = False
    """Also compile ``engine.backward``'s autograd graph (torch's compiled autograd), as
    DeepSpeed's ``compiled_autograd_enabled``. The engine's gradient hooks (reduction,
    ZeRO-3's gathers) run in Python, so it breaks into a graph per hook: correct, rarely
    faster."""


@dataclass(frozen=True)
class CompilePlan:
    """The modules whose ``forward`` is compiled (qualified names; ``("",)``: the whole
    model) and why."""

    regions: tuple[str, ...]
    reason: str

    @property
    def whole(self) -> bool:
        return self.regions == (WHOLE,)


def plan_compile(model: torch.nn.Module, gathered: Sequence[str] | None) -> CompilePlan:
    """What to compile in ``model``: with ZeRO-3's units (``gathered``: their qualified
    names, the root's ``""`` among them) each unit but the root on its own; without, the
    model's repeated blocks (the outermost modules of its ``ModuleList``/``Sequential``,
    when at least two share a class), else the whole model."""
    if gathered is not None:
        regions = tuple(name for name in gathered if name)
        if not regions:
            return CompilePlan((WHOLE,), "ZeRO-3 gathers the whole model at its entry")
        return CompilePlan(regions, "ZeRO-3 gathers each unit around its call, outside "
                                    "the compiled code")
    blocks = container_blocks(model)
    kinds = Counter(type(model.get_submodule(name)) for name in blocks)
    if not kinds or max(kinds.values()) < 2:
        return CompilePlan((WHOLE,), "no repeated blocks")
    return CompilePlan(tuple(blocks), "its repeated blocks, one graph for them all")


@dataclass
class _Snapshot:
    graphs: int
    breaks: int
    seconds: float

    @classmethod
    def now(cls) -> _Snapshot:
        from torch._dynamo.utils import counters

        return cls(counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
                   time.perf_counter())


class CompiledModel:
    """Applies a :class:`CompilePlan` to a model and reports on it (see the module
    docstring). ``report_step`` is called after each optimizer step."""

    def __init__(self, model: torch.nn.Module, plan: CompilePlan, request: CompileRequest,
                 rank: int = 0):
        self.model, self.plan, self.request, self.rank = model, plan, request, rank
        self._start: _Snapshot | None = None
        self._graphs_after_first: int | None = None
        self._warned = False

    def apply(self) -> None:
        """Compile, in place: ``engine(...)`` and the model's own callers then run the
        compiled code."""
        kwargs = {**self.request.kwargs, "backend": self.request.backend}
        self._start = _Snapshot.now()
        if self.plan.whole:
            self.model.compile(**kwargs)
            return
        by_class: dict[type, Any] = {}
        for name in self.plan.regions:
            module = self.model.get_submodule(name)
            # an instance attribute: Module.__call__ (and its hooks) stay eager around it
            own = module.__dict__.get("forward")  # a wrapper already set (Accelerate's)
            if own is not None:
                module.forward = torch.compile(own, **kwargs)
                continue
            cls = type(module)
            if cls not in by_class:
                by_class[cls] = torch.compile(cls.forward, **kwargs)
            # bound, not a closure over the module: a deepcopy of the model calls its copy
            module.forward = types.MethodType(by_class[cls], module)

    def backward_context(self) -> contextlib.AbstractContextManager:
        """Where ``engine.backward`` runs autograd: compiled autograd when asked for."""
        if not self.request.compiled_autograd:
            return contextlib.nullcontext()
        from torch._dynamo import compiled_autograd

        return compiled_autograd._enable(torch.compile(backend=self.request.backend,
                                                       **self.request.kwargs))

    @property
    def graphs(self) -> int:
        """Graphs compiled since :meth:`apply` (in this process)."""
        assert self._start is not None, "apply() first"
        return _Snapshot.now().graphs - self._start.graphs

    @property
    def graph_breaks(self) -> int:
        assert self._start is not None, "apply() first"
        return _Snapshot.now().breaks - self._start.breaks

    def report_step(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): the first one logs the compile report;
        a later one that compiled new graphs warns (once; each time with ``debug``)."""
        if self._start is None:
            return
        if self._graphs_after_first is None:
            self._graphs_after_first = self.graphs
            if self.rank == 0:
                self._log_first()
            return
        new = self.graphs - self._graphs_after_first
        if new <= 0 or (self._warned and not self.request.debug):
            return
        self._graphs_after_first += new
        self._warned = True
        if self.rank == 0:
            logger.warning(
                "engine.compile: step %d compiled %d more graph(s): the input shapes "
                "changed (a new batch size or sequence length); HINT: pad batches to a few "
                "fixed shapes, or engine.compile(compile_kwargs={'dynamic': True}) to "
                "compile for any shape once", step, new)

    def _log_first(self) -> None:
        from torch._dynamo.utils import counters

        assert self._start is not None
        seconds = time.perf_counter() - self._start.seconds
        where = ("the whole model" if self.plan.whole
                 else f"{len(self.plan.regions)} regions ({self.plan.reason})")
        logger.info("engine.compile: %s with backend %s; the first step took %.1f s with "
                    "compilation: %d graph(s), %d graph break(s)", where,
                    self.request.backend, seconds, self.graphs, self.graph_breaks)
        if self.request.debug:
            for reason, count in counters["graph_break"].items():
                logger.info("engine.compile: graph break x%d: %s", count,
                            reason.splitlines()[0])
