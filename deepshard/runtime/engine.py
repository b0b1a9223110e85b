"""The training engine a DeepSpeed script drives: ``engine(batch)``, ``backward``, ``step``.

:func:`deepshard.initialize` builds the parts (module in its training dtype, gradient
buckets, fp32 masters, optimizer, scheduler, loss scaler) and hands them to
:class:`DeepShardEngine`, which only sequences them:

- ``backward(loss)`` scales the loss by ``loss_scale / (gradient_accumulation_steps ×
  world)`` and runs autograd; at an accumulation boundary the buckets all-reduce during it
  and it waits for the last of them;
- ``step()`` counts micro-steps; at a boundary it unscales into
  the masters, checks for overflow (fp16: a skipped step on every rank, since every rank
  has the same reduced gradients), clips, steps the optimizer and the scheduler, zeroes the
  gradients and beats the launcher's heartbeat.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import __version__
from ..errors import UsageError, exit_on_usage_error
from ..liveness import heartbeat
from . import checkpoint as ckpt
from .buckets import GradBuckets
from .precision import MasterWeights, clip_, global_norm
from .zero import checkpoint as zsave
from .zero.runtime import ZeroRuntime

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
    config: object
    params: tuple[torch.nn.Parameter, ...]
    names: tuple[str, ...]
    buckets: GradBuckets | None
    masters: MasterWeights | None
    zero: ZeroRuntime | None
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: object | None
    loss_scaler: object | None
    group: dist.ProcessGroup | None
    rank: int
    dp_rank: int
    dp_world: int
    device: torch.device
    profiler_factory: Callable[[], object] | None = None
    # model parallelism (pipeline and/or tensor): the group the gradient norm is summed
    # over, and the parameters left out of it there (replicas counted on another rank)
    mp_group: dist.ProcessGroup | None = None
    norm_excluded: frozenset[int] = frozenset()
    mpu: object | None = None  # the layout's ProcessGroups (or a user's mpu)


class DeepShardEngine(torch.nn.Module):
    """DeepSpeed's engine API over stage 0 data parallelism (see the module docstring)."""

    def __init__(self, parts: EngineParts):
        super().__init__()
        self.module = parts.module
        self._parts = parts
        self._config = parts.config
        self.optimizer = parts.optimizer
        self.lr_scheduler = parts.lr_scheduler
        self.loss_scaler = parts.loss_scaler
        self.counters = Counters()
        self.global_rank, self.dp_world_size, self.device = parts.rank, parts.dp_world, parts.device
        self.dp_rank = parts.dp_rank
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._grad_norm: float | None = None
        self._step_applied = False
        self._profiler = None
        self._profile_printed = False

    # -- DeepSpeed's getters -------------------------------------------------------------
    @property
    def config(self):
        """The validated config (``deepshard.runtime.config.DeepShardConfig``)."""
        return self._config

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (including fp16-skipped ones, as in DeepSpeed)."""
        return self.counters.global_steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches seen."""
        return self.counters.micro_steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of fp16 overflow."""
        return self.counters.skipped_steps

    @property
    def global_samples(self) -> int:
        """Samples consumed by all ranks."""
        return self.counters.global_samples

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def memory_breakdown(self) -> bool:
        """DeepSpeed's config flag getter (``memory_breakdown``); deepshard does not log it."""
        return False

    def get_lr(self) -> list[float]:
        """Learning rate of every param group."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        """Momentum (``betas`` for Adam-style groups, ``momentum`` for SGD) per param group."""
        if not self.optimizer:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Norm of the last step's gradients, when it was computed (clipping or fp16)."""
        return self._grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary's optimizer step was skipped (fp16 overflow)."""
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.loss_scaler.loss_scale if self.loss_scaler else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last one before an optimizer step."""
        return (self.counters.micro_steps + 1) % self._config.gradient_accumulation_steps == 0

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds: ``params``, ``grads``, ``optimizer``.

        ``optimizer`` counts the optimizer's state tensors plus the fp32 master weights
        (and their gradients) kept for fp16/bf16 training. With ZeRO these are this rank's
        shards (plus replicated parameters and padding), ``nvme`` the bytes offloaded to
        files; all are what the rank holds between steps.
        """
        if self._parts.zero is not None:
            return self._parts.zero.state_bytes(self.optimizer)
        params = sum(t.numel() * t.element_size() for t in self.module.parameters())
        grads = self._parts.buckets.nbytes()
        optimizer = 0
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                optimizer += sum(v.numel() * v.element_size() for v in state.values()
                                 if torch.is_tensor(v))
        if self._parts.masters is not None:
            master_params, master_grads = self._parts.masters.nbytes()
            optimizer += master_params + master_grads
        return {"params": params, "grads": grads, "optimizer": optimizer, "nvme": 0}

    # -- training ------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """The module's forward (profiled at ``flops_profiler.profile_step`` on rank 0)."""
        if self._config.fp16.enabled and self._config.fp16.auto_cast:
            inputs = tuple(_to_half(x) for x in inputs)
            kwargs = {k: _to_half(v) for k, v in kwargs.items()}
        factory = self._parts.profiler_factory
        if (factory is not None and self.module.training and self._profiler is None
                and self.counters.global_steps == self._config.flops_profiler.profile_step):
            self._profiler = factory()
            return self._profiler.profile_forward(lambda: self.module(*inputs, **kwargs))
        return self.module(*inputs, **kwargs)

    @exit_on_usage_error
    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss``, scaled as in DeepSpeed by 1/accumulation (unless
        ``scale_wrt_gas`` is false) and the fp16 loss scale. At an accumulation boundary the
        gradients are all-reduced while this runs and are final when it returns. Returns the
        loss as scaled for accumulation, like DeepSpeed."""
        if not loss.requires_grad:
            raise UsageError("engine.backward() got a loss that does not require grad",
                             where="engine.backward",
                             hint="compute the loss from engine(...) outputs in train mode, "
                                  "outside torch.no_grad()")
        boundary = self.is_gradient_accumulation_boundary()
        buckets = self._parts.buckets if self._parts.zero is None else self._parts.zero
        gas = self._config.gradient_accumulation_steps if scale_wrt_gas else 1
        factor = 1.0 / (gas * self.dp_world_size)
        if self.loss_scaler is not None:
            factor *= self.loss_scaler.loss_scale
        buckets.begin_backward(boundary)
        zero = self._parts.zero
        try:
            (loss.float() * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
        except BaseException:
            if zero is not None:
                zero.abort_backward()
            else:
                buckets.end_backward()
            raise
        if zero is not None:
            zero.end_backward(boundary)
        else:
            buckets.end_backward()
        if boundary and self._parts.zero is None:
            buckets.finish()
        heartbeat(self.counters.global_steps)
        return loss / gas if gas != 1 else loss

    @exit_on_usage_error
    def step(self) -> None:
        """Count a micro-batch; at an accumulation boundary apply the optimizer step."""
        if not self.is_gradient_accumulation_boundary():
            self.counters.micro_steps += 1
            return
        if self.optimizer is None:
            raise UsageError("engine.step() without an optimizer", where="optimizer",
                             hint='add an "optimizer" section to the config, or pass '
                                  "optimizer= to deepshard.initialize()")
        started = time.perf_counter()
        self._step_applied = self._apply()
        self._zero_grads()
        c = self.counters
        c.micro_steps += 1
        c.global_steps += 1
        c.global_samples += self._config.train_batch_size
        heartbeat(c.global_steps)
        self._report(time.perf_counter() - started)

    def _apply(self) -> bool:
        parts, cfg = self._parts, self._config
        zero = parts.zero
        inv = 1.0 / self.loss_scaler.loss_scale if self.loss_scaler else 1.0
        if zero is not None:
            grads = zero.stepper.load_grads(zero.grads.shard_grads(), inv)
        elif parts.masters is not None:
            parts.masters.load_grads(parts.buckets.buffers, inv)
            grads = parts.masters.grad_flats
        else:
            grads = parts.buckets.buffers
        self._grad_norm = None
        if cfg.gradient_clipping > 0 or self.loss_scaler is not None:
            norm = self._gradient_norm(grads)
            self._grad_norm = float(norm)
            if self.loss_scaler is not None:
                overflow = not math.isfinite(self._grad_norm)
                before = self.loss_scaler.loss_scale
                self.loss_scaler.update_scale(overflow)
                if overflow:
                    self.counters.skipped_steps += 1
                    if self.global_rank == 0:
                        logger.info("step %d: fp16 gradient overflow, step skipped on every "
                                    "rank; loss scale %g -> %g", self.global_steps + 1,
                                    before, self.loss_scaler.loss_scale)
                    return False
            if cfg.gradient_clipping > 0:
                clip_(grads, norm, cfg.gradient_clipping)
        if zero is not None:
            zero.stepper.step(self.optimizer)
            zero.stepper.update_model()
        else:
            self.optimizer.step()
        if parts.masters is not None:
            parts.masters.copy_to_model()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    def _gradient_norm(self, grads) -> torch.Tensor:
        """The global gradient norm, the same on every rank: over this rank's gradients
        (ZeRO: its shards, summed over the data-parallel group), minus replicas another
        rank counts, summed over the model-parallel group."""
        parts = self._parts
        if parts.zero is None and parts.mp_group is None:
            return global_norm(grads)
        sq = global_norm(grads).square()
        excluded = self._excluded_views(grads)
        if excluded:
            sq = sq - global_norm(excluded).square()
        if parts.zero is not None and self.dp_world_size > 1:
            dist.all_reduce(sq, group=parts.group)
        if parts.mp_group is not None:
            dist.all_reduce(sq, group=parts.mp_group)
        return sq.clamp_min(0).sqrt()

    def _excluded_views(self, grads) -> list[torch.Tensor]:
        parts = self._parts
        if not parts.norm_excluded:
            return []
        out = []
        if parts.zero is not None:
            from .zero.partition import pieces

            for k, g in enumerate(parts.zero.groups):
                for pc in pieces(g.flat, g.spec, g.rank):
                    if id(parts.params[pc.param]) in parts.norm_excluded:
                        out.append(grads[k][pc.shard_start:pc.shard_start + pc.length])
            return out
        views = parts.masters.grad_views if parts.masters is not None else parts.buckets.views
        return [v for p, v in zip(parts.params, views, strict=True)
                if id(p) in parts.norm_excluded]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (always in place: they live in the communication buckets)."""
        del set_to_none
        self._zero_grads()

    def _zero_grads(self) -> None:
        if self._parts.zero is not None:
            self._parts.zero.zero()
        else:
            self._parts.buckets.zero()

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
        from .flops_profiler import render

        fp = self._config.flops_profiler
        text = render(self._profiler.result(), module_depth=fp.module_depth,
                      top_modules=fp.top_modules, detailed=fp.detailed)
        self._profile_printed = True
        if fp.output_file:
            Path(fp.output_file).write_text(text + "\n")
        else:
            print(text, flush=True)

    # -- checkpoints ---------------------------------------------------------------------
    @exit_on_usage_error
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False) -> bool:
        """Save model, optimizer, scheduler, loss scaler, RNG and ``client_state`` atomically.

        Collective: every rank must call it. ``tag`` defaults to ``global_step<N>``.
        ``exclude_frozen_parameters`` leaves out parameters that do not require grad (a
        LoRA model's base), as DeepSpeed does: load such a checkpoint with
        ``load_module_strict=False`` into a model that has them already.
        """
        exclude = bool(exclude_frozen_parameters)
        tag = ckpt.check_tag(tag if tag is not None else f"global_step{self.global_steps}")
        parts, zero = self._parts, self._parts.zero
        heartbeat(self.counters.global_steps)
        if zero is not None:
            zero.stepper.swap_in_all(self.optimizer)
        topology = self._mp_topology()
        if topology is None and parts.mp_group is not None:
            raise UsageError("checkpoints of a model split by a user's mpu are not supported",
                             where="engine.save_checkpoint",
                             hint="let deepshard split the model (pipeline / tensor_parallel "
                                  "config sections), or save the module yourself")
        shared = None
        if self.global_rank == 0:
            shared = {
                "module": self._module_state(exclude),
                "fp32_masters": self._masters_by_name() if parts.masters else None,
                "optimizer": self._optimizer_state(),
                "optimizer_names": self._optimizer_names() if zero is None else None,
                "aliases": zsave.aliases(self.module),
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                "counters": vars(self.counters).copy(),
                "client_state": dict(client_state or {}),
            }
        own = {"rng": ckpt.rng_states()}
        if zero is not None:
            own["zero"] = zsave.shard_payload(zero, self.optimizer)
        world = self.dp_world_size
        if topology is not None:
            from .parallel import checkpoint as mpckpt

            own["mp"] = mpckpt.own_payload(self, exclude)  # every rank holds another part
            if shared is not None:
                shared.update(module={}, fp32_masters=None, optimizer_names=None,
                              optimizer={"state": {}, "param_groups": self.optimizer.state_dict()
                                         ["param_groups"]} if self.optimizer else None)
            world = self.world_size
        manifest = ckpt.Manifest(
            tag=tag, world_size=world, zero_stage=self.zero_optimization_stage(),
            param_dtype=str(parts.params[0].dtype if parts.params else torch.float32),
            master_dtype="torch.float32" if parts.masters or (
                zero is not None and any(zero.stepper.separate)) else None,
            global_steps=self.global_steps, deepshard_version=__version__,
            files=(ckpt.SHARED_FILE, *(ckpt.rank_file(r) for r in range(world))),
            created_unix=ckpt.now(),
            layout=None if topology is None else mpckpt.layout_of(topology),
            frozen_excluded=exclude)
        ckpt.save(save_dir, manifest, rank=self.global_rank, shared=shared, own=own,
                  barrier=self._barrier, save_latest=save_latest)
        if zero is not None:
            zero.stepper.swap_out_all(self.optimizer)
        heartbeat(self.counters.global_steps)
        return True

    @exit_on_usage_error
    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: rank 0 writes the module's state dict (its training dtype) to
        ``save_dir/save_filename``, atomically. At ZeRO stage 3 the parameters are gathered
        for it when ``stage3_gather_16bit_weights_on_model_save`` is set; otherwise nothing
        is saved and False returned, as in DeepSpeed; they are gathered one flat group at
        a time, so the whole model is never held by any rank but rank 0's CPU copy.
        Collective."""
        from .zero.stage3 import GatheredParameters

        if self._mp_topology() is not None or self._parts.mp_group is not None:
            raise UsageError("save_16bit_model cannot gather a model split over pipeline or "
                             "tensor-parallel ranks", where="engine.save_16bit_model",
                             hint="save a checkpoint and consolidate it with "
                                  "deepshard.get_fp32_state_dict()")
        zero = self._parts.zero
        if zero is not None and zero.stage == 3 and not \
                self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            if self.global_rank == 0:
                logger.warning("save_16bit_model: nothing saved; set zero_optimization."
                               "stage3_gather_16bit_weights_on_model_save to gather the "
                               "stage 3 parameters for it")
            return False
        skip = self._frozen_names() if exclude_frozen_parameters else set()
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        gathered: dict[str, torch.Tensor] = {}
        partitioned = [] if zero is None or zero.stage != 3 else [
            g for g in zero.groups if g.partitioned]
        # one flat group whole at a time: no rank ever holds the whole model
        for g in partitioned:
            with GatheredParameters(g.params):
                if self.global_rank == 0:
                    for p in g.params:
                        value = p.detach().cpu().clone()
                        gathered.update((n, value) for n in names[id(p)])
        state = None
        if self.global_rank == 0:
            state = {k: gathered[k] if k in gathered else v.detach().cpu().clone()
                     for k, v in self.module.state_dict().items() if k not in skip}
        if state is not None:
            path = Path(save_dir) / save_filename
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.partial")
            torch.save(state, tmp)
            os.replace(tmp, path)
        self._barrier()
        return True

    def _module_state(self, exclude_frozen: bool = False) -> dict:
        """The module's state dict; with ZeRO without the sharded parameters (their values
        are in the rank files); without parameters that do not require grad if asked."""
        state = self.module.state_dict()
        if self._parts.zero is not None:
            owned = zsave.owned_names(self._parts.zero, self.module)
            state = {k: v for k, v in state.items() if k not in owned}
        if exclude_frozen:
            frozen = self._frozen_names()
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def _frozen_names(self) -> set[str]:
        """State-dict names (aliases included) of the parameters that do not require grad."""
        return {n for n, p in self.module.named_parameters(remove_duplicate=False)
                if not p.requires_grad}

    def _optimizer_state(self) -> dict | None:
        if self.optimizer is None:
            return None
        state = self.optimizer.state_dict()
        if self._parts.zero is not None:
            state = {"state": {}, "param_groups": state["param_groups"]}
        return state

    def _optimizer_names(self) -> list[str]:
        """The parameter name of every position in the optimizer's state dict."""
        if self.optimizer is None:
            return []
        parts = self._parts
        tensors = parts.masters.masters if parts.masters is not None else parts.params
        by_id = {id(t): n for t, n in zip(tensors, parts.names, strict=True)}
        return [by_id.get(id(p), "") for g in self.optimizer.param_groups for p in g["params"]]

    def _masters_by_name(self) -> dict[str, torch.Tensor]:
        """fp32 masters keyed by every name of their parameter (tied weights: all aliases)."""
        by_id = {id(p): m for p, m in zip(self._parts.params, self._parts.masters.masters,
                                           strict=True)}
        return {name: by_id[id(p)].detach().clone()
                for name, p in self.module.named_parameters(remove_duplicate=False)
                if id(p) in by_id}

    @exit_on_usage_error
    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        """Restore a checkpoint; returns ``(path, client_state)``, or ``(None, None)`` when
        ``load_dir`` holds no complete checkpoint (as DeepSpeed does)."""
        manifest = ckpt.resolve_tag(load_dir, None if tag is None else ckpt.check_tag(tag))
        if manifest is None:
            if self.global_rank == 0:
                logger.warning("no complete checkpoint in %s: starting from scratch", load_dir)
            return None, None
        path = Path(load_dir) / manifest.tag
        shared = ckpt.load_file(path, ckpt.SHARED_FILE)
        topology = self._mp_topology()
        if topology is not None or manifest.layout:
            from .parallel import checkpoint as mpckpt

            mpckpt.check_same_layout(manifest, topology, path)
            coord = topology.coord(self.global_rank)
            by_name, _ = mpckpt.by_name(path, manifest, coord.pipe, coord.tensor)
            self._load_by_name(by_name, shared, load_module_strict,
                               load_optimizer_states and not load_module_only, manifest, path)
            self._load_rest(path, shared, load_lr_scheduler_states, load_module_only)
            return str(path), shared["client_state"]
        if self._parts.zero is not None or manifest.zero_stage != 0:
            need = zsave.needed(self._parts.zero) if self._parts.zero is not None else None
            self._load_by_name(zsave.read_by_name(path, manifest, shared, need=need), shared,
                               load_module_strict, load_optimizer_states and not load_module_only,
                               manifest, path)
            self._load_rest(path, shared, load_lr_scheduler_states, load_module_only)
            return str(path), shared["client_state"]
        # fp32 values wherever the checkpoint has them (its masters), whatever precision
        # either run trains in; load_state_dict casts them to the module's dtypes
        full = ckpt.full_precision(shared)
        want = self.module.state_dict()
        self._check_missing(set(want) - set(full), load_module_strict, manifest, path,
                            unexpected=set(full) - set(want))
        self.module.load_state_dict({k: v for k, v in full.items() if k in want}, strict=False)
        parts = self._parts
        if parts.masters is not None:
            with torch.no_grad():
                for name, p, m in zip(parts.names, parts.params, parts.masters.masters,
                                      strict=True):
                    m.copy_(full[name] if name in full else p.detach())
        if not load_module_only and load_optimizer_states and self.optimizer \
                and shared["optimizer"]:
            self.optimizer.load_state_dict(shared["optimizer"])
        self._load_rest(path, shared, load_lr_scheduler_states, load_module_only)
        return str(path), shared["client_state"]

    def _load_rest(self, path: Path, shared, load_lr_scheduler_states: bool,
                   load_module_only: bool) -> None:
        if not load_module_only:
            if load_lr_scheduler_states and self.lr_scheduler and shared["lr_scheduler"]:
                self.lr_scheduler.load_state_dict(shared["lr_scheduler"])
            if self.loss_scaler and shared["loss_scaler"]:
                self.loss_scaler.load_state_dict(shared["loss_scaler"])
            self.counters = Counters(**shared["counters"])
            own_file = path / ckpt.rank_file(self.global_rank)
            if own_file.exists():
                ckpt.set_rng_states(ckpt.load_file(path, own_file.name)["rng"])
        self._zero_grads()
        self._barrier()

    def _mp_topology(self):
        """The model-parallel topology, or ``None`` for plain data parallelism."""
        mpu = self._parts.mpu
        if self._parts.mp_group is None or not hasattr(mpu, "topology"):
            return None
        return mpu.topology

    def _load_by_name(self, by_name: zsave.ByName, shared, strict: bool,
                      load_optimizer: bool, manifest: ckpt.Manifest, path: Path) -> None:
        """Load a checkpoint of any stage and world size through its by-name form."""
        parts, zero = self._parts, self._parts.zero
        saved_groups = (shared.get("optimizer") or {}).get("param_groups") or []
        if zero is None:
            self.module.load_state_dict(
                {k: by_name.values[k] for k in self.module.state_dict() if k in by_name.values},
                strict=False)
            self._check_missing(set(self.module.state_dict()) - set(by_name.values), strict,
                                manifest, path)
            if parts.masters is not None:
                with torch.no_grad():
                    for name, m in zip(parts.names, parts.masters.masters, strict=True):
                        if name in by_name.values:
                            m.copy_(by_name.values[name].view_as(m))
            if load_optimizer and self.optimizer is not None:
                ours = self.optimizer.state_dict()["param_groups"]
                groups = _merge_groups(ours, saved_groups)
                self.optimizer.load_state_dict(zsave.stage0_optimizer_state(
                    by_name, self._optimizer_names(), groups))
            return
        zero.stepper.swap_in_all(self.optimizer)
        owned = zsave.owned_names(zero, self.module)
        rest = {k: v for k, v in by_name.values.items() if k not in owned}
        self.module.load_state_dict(rest, strict=False)
        want = set(self._module_state())
        missing = (want - by_name.present) | set(
            zsave.load_into_zero(zero, self.optimizer, by_name, load_optimizer))
        self._check_missing(missing, strict, manifest, path)
        if load_optimizer and self.optimizer is not None:
            for g, saved in zip(self.optimizer.param_groups,
                                _merge_groups(self.optimizer.param_groups, saved_groups),
                                strict=True):
                g.update({k: v for k, v in saved.items() if k != "params"})
        zero.stepper.swap_out_all(self.optimizer)

    def _check_missing(self, missing: set[str], strict: bool, manifest: ckpt.Manifest,
                       path: Path, unexpected: frozenset[str] | set[str] = frozenset()) -> None:
        """With ``strict``, a checkpoint lacking entries of the model (or holding entries
        the model lacks) is a usage error."""
        if not strict or not (missing or unexpected):
            return
        if missing and manifest.frozen_excluded and missing <= self._frozen_names():
            raise UsageError(f"the checkpoint lacks this model's {len(missing)} frozen "
                             f"parameters: it was saved with exclude_frozen_parameters=True",
                             where=str(path),
                             hint="pass load_module_strict=False: the frozen parameters "
                                  "then keep the values the model has")
        what = f"lacks {len(missing)} entries of this model: " \
            f"{', '.join(sorted(missing)[:5])}" if missing else \
            f"holds {len(unexpected)} entries this model lacks: " \
            f"{', '.join(sorted(unexpected)[:5])}"
        raise UsageError(f"the checkpoint {what}", where=str(path),
                         hint="load a checkpoint of the same model, or pass "
                              "load_module_strict=False")

    def _barrier(self) -> None:
        """Every rank of the job (checkpoints are collective over all of them)."""
        if self.world_size > 1:
            dist.barrier()


def _merge_groups(ours: list[dict], saved: list[dict]) -> list[dict]:
    """Our param groups with the checkpoint's hyperparameters (when the counts match)."""
    if len(ours) != len(saved):
        return [dict(g) for g in ours]
    return [{**s, "params": g["params"]} for g, s in zip(ours, saved, strict=True)]


def _to_half(x):
    return x.half() if torch.is_tensor(x) and torch.is_floating_point(x) else x
