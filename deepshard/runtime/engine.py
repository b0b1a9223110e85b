"""The training engine a DeepSpeed script drives: ``engine(batch)``, ``backward``, ``step``.

:func:`deepshard.initialize` builds the parts (module in its training dtype, the
data-parallel strategy, optimizer, scheduler, loss scaler) and hands them to
:class:`DeepShardEngine`, which only sequences them; how gradients are reduced and where
masters and optimizer state live is the strategy's
(:class:`~deepshard.runtime.strategy.DataParallelStrategy`), the same calls at every stage:

- ``backward(loss)`` scales the loss by ``loss_scale / (gradient_accumulation_steps ×
  world)`` and runs autograd between the strategy's ``begin_backward`` and
  ``end_backward``; at an accumulation boundary the gradients are reduced during it and
  final when it returns;
- ``step()`` counts micro-steps; at a boundary it takes the unscaled gradients from the
  strategy, checks for overflow (fp16: a skipped step on every rank, since the norm is the
  same on every rank), clips, has the strategy step the optimizer, steps the scheduler,
  zeroes the gradients and beats the launcher's heartbeat with the step's loss;
  :mod:`.engine_monitor` times the three and writes the enabled monitors' events.

Checkpoints are :mod:`deepshard.runtime.checkpoint.engine_io`'s, over this engine's public
state (the methods: :mod:`.engine_persistence`). Errors are
:class:`~deepshard.errors.UsageError` exceptions a caller can catch; uncaught, the worker's
exception hook prints them as one line and exits with code 2.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepshard.config.given import GivenConfig
from deepshard.errors import UsageAssertionError, UsageError
from deepshard.liveness import heartbeat
from deepshard.runtime.backward import BackwardDriver
from deepshard.runtime.compiled import CompiledModel, CompileRequest, plan_compile
from deepshard.runtime.engine_getters import EngineGetters
from deepshard.runtime.engine_monitor import EngineMonitor
from deepshard.runtime.engine_persistence import EngineData, EnginePersistence
from deepshard.runtime.extensions import Extensions
from deepshard.runtime.hooks import weak_hook
from deepshard.runtime.loss_scaler import backward_factor, inverse_scale
from deepshard.runtime.precision import clip_
from deepshard.runtime.strategy import DataParallelStrategy
from deepshard.runtime.strategy.fragments import ParamFragments
from deepshard.runtime.zero.spec import ZeroSpec
from deepshard.runtime.zero.states import StateMover

if TYPE_CHECKING:
    from deepshard.config.schema import DeepShardConfig

logger = logging.getLogger("deepshard")


@dataclass
class Counters:
    """Progress, saved in checkpoints (DeepSpeed's names)."""

    global_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    global_samples: int = 0


@dataclass(frozen=True)
class EngineParts:
    """Everything :class:`DeepShardEngine` sequences, built by ``deepshard.initialize``."""

    module: torch.nn.Module
    config: DeepShardConfig
    strategy: DataParallelStrategy
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any  # a torch LR scheduler, or None
    loss_scaler: object | None
    rank: int
    dp_rank: int
    device: torch.device
    profiler_factory: Callable[[], object] | None = None
    # model parallelism (pipeline and/or tensor): the group the gradient norm is summed
    # over, and the parameters left out of it there (replicas counted on another rank)
    mp_group: dist.ProcessGroup | None = None
    norm_excluded: frozenset[int] = frozenset()
    mpu: object | None = None  # the layout's ProcessGroups (or a user's mpu)
    zero: ZeroSpec = field(default_factory=lambda: ZeroSpec(stage=0))
    """What is sharded (the one place the stage is read from the config)."""
    extensions: Extensions = field(default_factory=Extensions)
    """The registered features: the monitor sink, ``save_pretrained``."""
    given: Mapping[str, Any] = field(default_factory=dict)
    """The config as the user gave it (a file's contents for a path): ``engine.config``'s
    dict."""


class DeepShardEngine(EnginePersistence, EngineData, EngineGetters, torch.nn.Module):
    """DeepSpeed's engine API over one data-parallel strategy (see the module docstring)."""

    def __init__(self, parts: EngineParts):
        super().__init__()
        self.module = parts.module
        self.strategy = parts.strategy
        self._config, self._zero, self._extensions = parts.config, parts.zero, parts.extensions
        self._given = GivenConfig(parts.given, parts.config)
        self._compiled: CompiledModel | None = None
        self._states: StateMover | None = None  # offload_states(), made on first use
        self.optimizer = parts.optimizer
        self.lr_scheduler = parts.lr_scheduler
        self.loss_scaler = parts.loss_scaler
        self.counters = Counters()
        self.global_rank, self.device = parts.rank, parts.device
        self.dp_rank, self.dp_world_size = parts.dp_rank, parts.strategy.world
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.mp_group, self.mpu = parts.mp_group, parts.mpu
        self._norm_excluded = parts.norm_excluded
        self._profiler_factory = parts.profiler_factory
        self._grad_norm: float | None = None
        self._step_applied = False
        self._profiler: Any = None  # a FlopsProfiler once the profile step starts
        self._profile_printed = False
        self._boundary_override: bool | None = None
        self._no_sync = False
        self._prescaled = False
        self.training_dataloader = None
        self._monitor = EngineMonitor(
            parts.config, parts.rank, parts.strategy.group, parts.strategy.world, parts.device,
            parts.extensions.event_sink(parts.config.monitor_config, parts.rank))
        self._driver = BackwardDriver(self.strategy, self._sync_now, self._direct_factor,
                                      lambda: heartbeat(self.counters.global_steps))
        self._grad_hooks = [p.register_hook(weak_hook(self._driver.param_grad))
                            for p in self.strategy.params]
        fragments = ParamFragments(self.strategy, self.optimizer)
        for p in self.strategy.params:
            p._deepshard_strategy = fragments  # runtime.tensor_fragment's safe_get_full_*
        self.features = parts.extensions.attach(self)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last one before an optimizer step (as
        set by :meth:`set_gradient_accumulation_boundary`, when it was called)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.counters.micro_steps + 1) % self._config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's manual accumulation control: the next backwards synchronise and the
        next ``step()`` applies exactly when ``is_boundary`` (``None``: count again)."""
        self._boundary_override = is_boundary

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds: ``params``, ``grads``, ``optimizer``,
        ``nvme``.

        ``optimizer`` counts the optimizer's state tensors plus the fp32 master weights
        (and their gradients) kept for fp16/bf16 training. With ZeRO these are this rank's
        shards (plus replicated parameters and padding), ``nvme`` the bytes offloaded to
        files; all are what the rank holds between steps.
        """
        return self.strategy.state_bytes(self.module, self.optimizer)

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks of this rank's Ulysses sequence-parallel group (1: none)."""
        getter = getattr(self.mpu, "get_sequence_parallel_world_size", None)
        return 1 if getter is None else getter()

    def get_sequence_parallel_group(self):
        """DeepSpeed's: this rank's sequence-parallel group (``None`` without one)."""
        getter = getattr(self.mpu, "get_sequence_parallel_group", None)
        return None if getter is None else getter()

    @property
    def topology(self):
        """The model-parallel (pipe, data, tensor) topology, or ``None`` for plain data
        parallelism (or a user's ``mpu`` without one)."""
        if self.mp_group is None:
            return None
        return getattr(self.mpu, "topology", None)

    # -- training ------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """The module's forward (profiled at ``flops_profiler.profile_step`` on rank 0)."""
        if self._config.fp16.enabled and self._config.fp16.auto_cast:
            inputs = tuple(_to_half(x) for x in inputs)
            kwargs = {k: _to_half(v) for k, v in kwargs.items()}
        self._driver.reap()
        for feature in self.features:
            feature.before_forward(self)
        self._monitor.begin("fwd")
        factory = self._profiler_factory
        if (factory is not None and self.module.training and self._profiler is None
                and self.counters.global_steps == self._config.flops_profiler.profile_step):
            self._profiler = factory()
            out = self._profiler.profile_forward(lambda: self.module(*inputs, **kwargs))
        else:
            out = self.module(*inputs, **kwargs)
        self._monitor.end("fwd")
        self._driver.hook_outputs(out)  # loss.backward() on them: :mod:`..backward`
        return out

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's delegation: a name the engine lacks is the module's
        (``engine.generate``, ``engine.config_class``, a custom method of the model)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                                     f"{name!r}") from None

    @property
    def _averaged_over(self) -> int:
        """The ranks a gradient is averaged over: the data-parallel world, or 1 when the
        config's ``gradient_allreduce_op`` is ``sum`` (the reduced sum is then kept)."""
        return 1 if self._config.gradient_allreduce_op == "sum" else self.dp_world_size

    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` the model in place, at every
        ZeRO stage (:mod:`deepshard.runtime.compiled`: each repeated block on its own,
        sharing one graph; at stage 3 its gathers outside the compiled code); ``engine(...)``
        then runs the compiled forward. ``backend`` defaults to the ``compile`` config
        section's (``inductor``); ``compile_kwargs`` are more ``torch.compile`` arguments
        (a ``backend`` among them is overridden, as in DeepSpeed);
        ``compiled_autograd_enabled`` compiles ``engine.backward``'s autograd graph too.
        DeepSpeed's DeepCompile ``schedule`` is refused. A second call is a no-op."""
        if schedule is not None:
            raise UsageError("engine.compile(schedule=...) is a DeepCompile schedule, which "
                             "deepshard does not have",
                             where="engine.compile",
                             hint="call engine.compile() without it: deepshard compiles "
                                  "each ZeRO-3 block with its gathers outside the graph")
        if self._compiled is not None:
            return
        section = self._config.compile
        kwargs = dict(section.compile_kwargs if compile_kwargs is None else compile_kwargs)
        given = kwargs.pop("backend", None)
        if backend and given and given != backend and self.global_rank == 0:
            logger.warning("engine.compile: backend=%r overrides compile_kwargs' %r",
                           backend, given)
        request = CompileRequest(backend or given or section.backend_name, kwargs,
                                 section.debug, compiled_autograd_enabled)
        units, unit_names = self.strategy.gathered_units(), None
        if units is not None:
            names = {id(m): name for name, m in self.module.named_modules()}
            unit_names = [names[id(m)] for m in units]
        plan = plan_compile(self.module, unit_names)
        self._compiled = CompiledModel(self.module, plan, request, self.global_rank)
        self._compiled.apply()

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's: move this ZeRO engine's states (``include``: kinds of
        :class:`~deepshard.runtime.zero.states.OffloadStateTypeEnum`, all by default) to
        host memory, freeing the accelerator between training phases, until
        :meth:`reload_states`; see :mod:`deepshard.runtime.zero.states`."""
        if self._states is None:
            self._states = StateMover.for_engine(self.strategy, self.optimizer, self._zero)
        self.empty_partition_cache()
        self._states.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's: every state :meth:`offload_states` moved, back where it was."""
        if self._states is None:
            self._states = StateMover.for_engine(self.strategy, self.optimizer, self._zero)
        self._states.reload(non_blocking)

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """DeepSpeed's: reduce the gradients over the data-parallel ranks now
        (collective). deepshard reduces them during every synchronising backward, so this
        reduces only what backwards that did not synchronise left in ``.grad`` (under
        ``no_sync()``, or through another engine) and is a no-op otherwise: calling it after
        ``engine.backward`` never reduces twice (``step()`` reduces what is left in any
        case). ``bucket_size`` is DeepSpeed's tuning knob, not needed here."""
        del bucket_size
        reducer = getattr(self.strategy, "grads", None) or getattr(self.strategy, "buckets",
                                                                     None)
        if reducer is not None and getattr(reducer, "unreduced", False):
            self.strategy.reduce_now()

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` ran."""
        return self._compiled is not None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss``, scaled as in DeepSpeed by 1/accumulation (unless
        ``scale_wrt_gas`` is false) and the fp16 loss scale. At an accumulation boundary the
        gradients are reduced while this runs and are final when it returns. Returns the
        loss as scaled for accumulation, like DeepSpeed.

        A plain ``loss.backward()`` does the same (:mod:`..backward`); several backwards
        before one ``step()`` accumulate."""
        if not loss.requires_grad:
            raise UsageError("engine.backward() got a loss that does not require grad",
                             where="engine.backward",
                             hint="compute the loss from engine(...) outputs in train mode, "
                                  "outside torch.no_grad()")
        boundary = self._sync_now()
        gas = self._config.gradient_accumulation_steps if scale_wrt_gas else 1
        factor = backward_factor(gas, self._averaged_over, self.loss_scaler)
        self._monitor.record_loss(loss)
        self._monitor.begin("bwd")
        self.run_backward(self._monitor.timed("bwd_inner", lambda: (
            loss.float() * factor if factor != 1.0 else loss).backward(
            retain_graph=retain_graph)), boundary)
        self._monitor.end("bwd")
        heartbeat(self.counters.global_steps)
        return loss / gas if gas != 1 else loss

    def run_backward(self, autograd: Callable[[], None], boundary: bool) -> None:
        """Run ``autograd`` (its loss scaled already) between the strategy's
        ``begin_backward`` and ``end_backward`` (``abort_backward`` when it raises)."""
        with (self._compiled.backward_context() if self._compiled is not None
              else contextlib.nullcontext()):
            self._driver.explicit(autograd, boundary)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's manual backward: ``engine.scale(loss).backward()`` applies the fp16
        loss scale (the loss unchanged without fp16), which a plain ``loss.backward()``
        with fp16 needs."""
        if self.loss_scaler is None:
            return loss
        self._prescaled = True
        return loss * self.loss_scaler.loss_scale

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside the block accumulate without reducing (DDP's and DeepSpeed's
        ``no_sync``); not at ZeRO stages 2-3, which reduce during every backward."""
        if self._zero.shards_gradients:
            raise UsageAssertionError(f"engine.no_sync() at ZeRO stage {self._zero.stage}",
                             where="engine.no_sync",
                             hint="stages 2-3 reduce gradients into shards during every "
                                  "backward: use gradient_accumulation_steps instead")
        if self._no_sync:
            raise UsageAssertionError("engine.no_sync() entered twice", where="engine.no_sync",
                             hint="nest no_sync() blocks once")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def _sync_now(self) -> bool:
        return not self._no_sync and self.is_gradient_accumulation_boundary()

    def _direct_factor(self) -> float:
        """What a ``loss.backward()`` reaching this engine's parameters scales their
        gradients by (fp16: the loss must carry the loss scale, from ``scale()``)."""
        if self.loss_scaler is not None and not self._prescaled:
            raise UsageError("loss.backward() with fp16 on a loss engine.scale() did not "
                             "scale", where="loss.backward()",
                             hint="call engine.scale(loss).backward() (the activations' "
                                  "gradients need the loss scale), or engine.backward(loss)")
        self._prescaled = False  # the loss carries the scale: the factor leaves it out
        return backward_factor(self._config.gradient_accumulation_steps, self._averaged_over,
                               None)

    def step(self) -> None:
        """Count a micro-batch; at an accumulation boundary apply the optimizer step."""
        if self._no_sync:
            raise UsageAssertionError("engine.step() inside engine.no_sync()",
                                      where="engine.step",
                             hint="leave the no_sync() block, run a backward outside it, "
                                  "then step")
        self._driver.reap()
        if not self.is_gradient_accumulation_boundary():
            self.counters.micro_steps += 1
            return
        if self._states is not None and self._states.away:
            raise UsageError("engine.step() while the states are offloaded",
                             where="engine.step", hint="call engine.reload_states() first")
        if self.optimizer is None:
            raise UsageError("engine.step() without an optimizer", where="optimizer",
                             hint='add an "optimizer" section to the config, or pass '
                                  "optimizer= to deepshard.initialize()")
        started = time.perf_counter()
        self._monitor.begin("step")
        self._step_applied = self._apply()
        self.strategy.zero_grad()
        c = self.counters
        c.micro_steps += 1
        c.global_steps += 1
        c.global_samples += self._config.train_batch_size
        heartbeat(c.global_steps, loss=self._monitor.step_loss())
        self._monitor.end("step")
        self._monitor.after_step(self)
        if self._compiled is not None:
            self._compiled.report_step(c.global_steps)
        self._report(time.perf_counter() - started)

    def _apply(self) -> bool:
        cfg, strategy = self._config, self.strategy
        grads = strategy.unscaled_grads(inverse_scale(self.loss_scaler))
        # the norm at every step, clipping or not: get_global_grad_norm() is what HF's
        # Trainer logs as grad_norm, and DeepSpeed reports it without clipping too
        norm = strategy.gradient_norm(grads, self._norm_excluded, self.mp_group)
        self._grad_norm = float(norm)
        if self.loss_scaler is not None and self._skip_on_overflow():
            return False
        if cfg.gradient_clipping > 0:
            clip_(grads, norm, cfg.gradient_clipping)
        strategy.apply_step(self.optimizer)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    def _skip_on_overflow(self) -> bool:
        """fp16: update the loss scale; True when the gradients overflowed (the step is
        skipped on every rank: the norm is the same everywhere)."""
        assert self._grad_norm is not None  # set by _apply() just before
        overflow = not math.isfinite(self._grad_norm)
        before = self.loss_scaler.loss_scale
        self.loss_scaler.update_scale(overflow)
        if overflow:
            self.counters.skipped_steps += 1
            if self.global_rank == 0:
                logger.info("step %d: fp16 gradient overflow, step skipped on every rank; "
                            "loss scale %g -> %g", self.global_steps + 1, before,
                            self.loss_scaler.loss_scale)
        return overflow

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (always in place: they live in the communication buffers)."""
        del set_to_none
        self.strategy.zero_grad()

    def _report(self, step_seconds: float) -> None:
        if self.global_rank != 0:
            return
        c, every = self.counters, self._config.steps_per_print
        if every and c.global_steps % every == 0:
            logger.info("step=%d, skipped=%d, lr=%s, mom=%s", c.global_steps, c.skipped_steps,
                        self.get_lr(), self.get_mom())
        if self._profiler is not None and not self._profile_printed:
            self._profiler.record_step(step_seconds)
            self._print_profile()

    def _print_profile(self) -> None:
        from deepshard.runtime.flops_profiler import render

        fp = self._config.flops_profiler
        text = render(self._profiler.result(), module_depth=fp.module_depth,
                      top_modules=fp.top_modules, detailed=fp.detailed)
        self._profile_printed = True
        if fp.output_file:
            Path(fp.output_file).write_text(text + "\n")
        else:
            print(text, flush=True)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: free ZeRO-3 parameters left gathered: units kept from a forward
        for its backward (``stage3_max_reuse_distance``) when no backward came; every
        unit is released at the end of backward anyway."""
        coordinator = getattr(self.strategy, "coordinator", None)
        if coordinator is not None:
            coordinator.release_all()

    def destroy(self) -> None:
        """DeepSpeed's teardown: unregister the engine's gradient and parameter hooks and
        close its offload files (the module keeps its current weights)."""
        self._driver.reap()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        self.strategy.close()
        self._monitor.close()

    def barrier(self) -> None:
        """Every rank of the job (checkpoints are collective over all of them)."""
        if self.world_size > 1:
            dist.barrier()

    def agree(self, failure: str | None) -> str | None:
        """Collective over every rank of the job: the first rank's failure message, or
        ``None`` when no rank failed (a barrier too)."""
        if self.world_size == 1:
            return failure
        everyone: list[str | None] = [None] * self.world_size
        dist.all_gather_object(everyone, failure)
        return next((f for f in everyone if f is not None), None)


def _to_half(x):
    return x.half() if torch.is_tensor(x) and torch.is_floating_point(x) else x


DeepSpeedEngine = DeepShardEngine
"""DeepSpeed's name (``deepspeed.runtime.engine.DeepSpeedEngine``) for the same class."""
