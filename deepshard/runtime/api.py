"""``deepshard.initialize``: DeepSpeed's entry point, building the engine from a config.

It joins the process group when needed, validates the config, derives the model-parallel
layout from it and resolves the batch triad against the data-parallel size, prepares the
model (:mod:`.assembly.model`, with the registered features' model hooks:
:mod:`.extensions`), builds the data-parallel strategy and its optimizer from one
:class:`~.zero.spec.ZeroSpec` (:mod:`.assembly.strategy`), the scheduler and loss scaler,
and resumes from a checkpoint when the config asks for it (``checkpoint.resume_dir``).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable
from functools import partial

import torch
import torch.distributed as dist

from deepshard.comm import teardown
from deepshard.comm.distributed import DEFAULT_PORT, init_distributed
from deepshard.config import parse_config, with_batch_triad
from deepshard.config.schema_optim import ONEBIT_OPTIMIZERS
from deepshard.contract import RESTART_COUNT
from deepshard.errors import UsageAssertionError, UsageError, install_exit_hooks
from deepshard.runtime.allocator import fix_mmap_threshold
from deepshard.runtime.assembly.model import prepare_model, training_device
from deepshard.runtime.assembly.strategy import build_strategy
from deepshard.runtime.engine import DeepShardEngine, EngineParts
from deepshard.runtime.extensions import load_extensions
from deepshard.runtime.loss_scaler import build_loss_scaler
from deepshard.runtime.lr_schedules import build_scheduler
from deepshard.runtime.parallel import groups
from deepshard.runtime.zero.spec import ZeroSpec

logger = logging.getLogger("deepshard")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` options to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (accepted for compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    return parser


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None,
               model_parameters: Iterable | None = None, training_data=None, lr_scheduler=None,
               distributed_port: int = DEFAULT_PORT, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, config_params=None):
    """Build the training engine, as ``deepspeed.initialize`` does.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the dataloader is
    ``None`` without ``training_data``. ``config`` is a dict or a JSON/YAML path; it may
    instead come from ``args.deepspeed_config``.

    Raises:
        UsageError: a bad config, argument or combination, naming where and the fix
            (uncaught in a worker: one line and exit code 2).
    """
    if model is None:
        raise UsageAssertionError("deepshard.initialize() needs a model",
                                  where="initialize(model=...)",
                         hint="pass the torch.nn.Module to train as model=")
    source = _config_source(args, config if config is not None else config_params)
    if dist_init_required is False and not dist.is_initialized():
        raise UsageAssertionError("initialize(dist_init_required=False) but no process group "
                                  "exists", where="deepshard.initialize",
                                  hint="call deepshard.init_distributed() (or torch's "
                                       "init_process_group) first, or leave "
                                       "dist_init_required unset")
    _join(distributed_port)
    loaded, layout = _config_and_layout(source, model, mpu, without_optimizer=optimizer is None)
    cfg, extensions, zero = loaded.config, load_extensions(), ZeroSpec.from_config(loaded.config)
    extensions.require(cfg)
    if layout is not None:
        mpu = layout.groups
    groups.set_mpu(mpu)  # DeepSpeed's deepspeed.utils.groups answers from it
    group, dp_world, dp_rank = _data_parallel(mpu)
    rank, device = dist.get_rank(), training_device()
    prepared = prepare_model(model, cfg, zero, extensions, layout, group, dp_world, rank,
                             device)
    module, excluded = prepared.module, prepared.excluded
    strategy, opt = build_strategy(cfg, zero, module, optimizer, model_parameters, group,
                                   dp_world, dp_rank, prepared.replaced)
    sched = _scheduler(cfg, lr_scheduler, opt)
    _configure_activation_checkpointing(cfg, mpu, rank)
    parts = EngineParts(
        module=module, config=cfg, strategy=strategy, optimizer=opt, lr_scheduler=sched,
        loss_scaler=build_loss_scaler(cfg.fp16) if cfg.fp16.enabled else None, rank=rank,
        dp_rank=dp_rank, device=device, profiler_factory=_profiler(cfg, module, rank),
        norm_excluded=excluded, mp_group=_model_group(mpu), mpu=mpu, zero=zero,
        extensions=extensions, given=loaded.given)
    engine = layout.engine(parts) if layout is not None else DeepShardEngine(parts)
    if cfg.compile.at_initialize:  # the compile section (either of DeepSpeed's schemas)
        engine.compile()
    loader = None if training_data is None else engine.training_loader(training_data,
                                                                       collate_fn)
    _maybe_resume(engine, cfg)
    return engine, opt, loader, sched


def _join(distributed_port: int) -> None:
    """Logging, the allocator, SIGTERM and the exit hooks; the process group if the
    script has not made one."""
    install_exit_hooks()
    _logging_setup()
    fix_mmap_threshold()
    _exit_cleanly_on_sigterm()
    if not dist.is_initialized():
        init_distributed(distributed_port=distributed_port, verbose=False)
    else:
        teardown.register()  # the script's own init_process_group: same care at exit


def _config_and_layout(source, model, mpu, without_optimizer: bool = False):
    """The validated config (batch triad resolved against the data-parallel size) and
    the model-parallel layout it asks for (``None``: plain data parallelism)."""
    from deepshard.runtime.parallel.layout import Layout, pipeline_stages

    parsed = parse_config(source, model=model,
                          auto_values={"pipeline.stages": pipeline_stages(model)},
                          without_optimizer=without_optimizer)
    if dist.get_rank() == 0 and parsed.skipped:
        logger.info("%s: no optimizer, so no LR scheduler is built (as DeepSpeed): the "
                    "scheduler section is not used", parsed.origin)
    layout = Layout.create(parsed.config, parsed.origin, model, mpu)
    replicas = _replicas(layout.groups if layout is not None else mpu)
    try:
        loaded = with_batch_triad(parsed, replicas)
    except UsageError as exc:
        raise _accelerate_counted_one(parsed.config, replicas, parsed.origin) or exc from None
    cfg = loaded.config
    ignored = [*loaded.unimplemented, *_no_effect(cfg)]
    if dist.get_rank() == 0 and ignored:
        logger.warning("config keys DeepSpeed knows but deepshard does not implement "
                       "(ignored): %s", ", ".join(ignored))
    if dist.get_rank() == 0 and loaded.unknown:
        logger.warning("%s: unknown config keys, ignored as DeepSpeed does: %s",
                       loaded.origin, ", ".join(loaded.unknown))
    _check_combination(cfg, layout, loaded.origin)
    from deepshard import comm

    comm.configure(deepspeed_config=cfg)  # the comms_logger section, when written
    return loaded, layout


def _accelerate_counted_one(cfg, replicas: int, origin: str) -> UsageError | None:
    """The batch-size mismatch Accelerate causes on a machine without GPUs: it counts one
    process (its backend unnamed) and writes a train_batch_size for world size 1. DeepSpeed
    0.19.8 fails the same way; the fix is one argument of the script's ``Accelerator``."""
    tbs, micro, gas = (getattr(cfg, key) for key in ("train_batch_size",
                                                     "train_micro_batch_size_per_gpu",
                                                     "gradient_accumulation_steps"))
    if (os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true" or replicas == 1
            or None in (tbs, micro, gas) or tbs != micro * gas):
        return None
    return UsageError(f"Accelerate counted 1 process of {replicas}: train_batch_size {tbs} = "
                      f"{micro} * {gas} * 1", where=f"{origin}: train_batch_size",
                      hint="on a machine without GPUs name Accelerate's process-group backend: "
                           "Accelerator(..., kwargs_handlers=[InitProcessGroupKwargs("
                           "backend='gloo')]) (accelerate.utils); DeepSpeed needs the same")


def _check_combination(cfg, layout, origin: str) -> None:
    stage = cfg.zero_optimization.stage
    if layout is not None and layout.topology.pipe > 1 and stage > 1:
        raise UsageError(f"ZeRO stage {stage} cannot run with pipeline parallelism: it "
                         "reduces gradients during each backward, before the tied weights' "
                         "sums", where=f"{origin}: zero_optimization.stage",
                         hint="use ZeRO stage 0 or 1 with pipeline.stages > 1 (as DeepSpeed)")
    if stage and cfg.optimizer is not None and cfg.optimizer.type in ("LAMB", "OneBitLamb"):
        name = cfg.optimizer.type
        raise UsageError(f"{name} cannot run on ZeRO shards: its trust ratio is per "
                         "parameter, and a shard holds pieces of many", where=f"{origin}: "
                         "optimizer.type", hint=f"use Adam/AdamW with ZeRO, or stage 0 for "
                                                f"{name}")
    if cfg.gradient_allreduce_op == "sum" and (cfg.prescale_gradients or
                                               cfg.gradient_predivide_factor != 1.0 or (
            cfg.optimizer is not None and cfg.optimizer.type in ONEBIT_OPTIMIZERS)):
        raise UsageError("gradient_allreduce_op 'sum' with prescale_gradients, "
                         "gradient_predivide_factor or a 1-bit optimizer is not supported",
                         where=f"{origin}: gradient_allreduce_op",
                         hint="use 'mean' with those, or leave them out")
    if cfg.optimizer is not None and cfg.optimizer.type in ONEBIT_OPTIMIZERS:
        _check_onebit(cfg.optimizer.type, stage, layout, origin, cfg.sequence_parallel_size)


def _check_onebit(name: str, stage: int, layout, origin: str, sequence: int = 1) -> None:
    """The 1-bit optimizers compress plain data parallelism's momentum exchange: ZeRO
    stage 0, or 1 for OneBitAdam; no pipeline, tensor or sequence parallelism (the
    config's ``sequence_parallel_size`` also when ``mpu=`` brings the groups)."""
    top = 1 if name == "OneBitAdam" else 0
    if stage > top:
        raise UsageError(f"{name} at ZeRO stage {stage}", where=f"{origin}: "
                         "zero_optimization.stage",
                         hint=f"use stage {'0 or 1' if top else '0'}: {name} exchanges "
                              "compressed momentum in its own step, where stages 2-3 "
                              "reduce gradients during backward")
    topo = layout.topology if layout is not None else None
    sizes = (("pipeline.stages", topo.pipe if topo else 1),
             ("tensor_parallel.autotp_size", topo.tensor if topo else 1),
             ("sequence_parallel_size", topo.sequence if topo else sequence))
    if topo is not None or sequence > 1:
        found = ", ".join(f"{key} {size}" for key, size in sizes if size > 1)
        raise UsageError(f"{name} with {found or 'model parallelism'} is not supported: it "
                         "compresses plain data parallelism's momentum exchange",
                         where=f"{origin}: optimizer.type",
                         hint="use it with data parallelism only, or Adam/AdamW")


def _profiler(cfg, module, rank: int):
    """What builds the FLOP profiler at ``flops_profiler.profile_step`` (rank 0 only)."""
    if not cfg.flops_profiler.enabled or rank != 0:
        return None
    from deepshard.runtime.flops_profiler import FlopsProfiler

    fp = cfg.flops_profiler
    return partial(FlopsProfiler, module, module_depth=fp.module_depth,
                   top_modules=fp.top_modules, detailed=fp.detailed,
                   recompute_fwd_factor=fp.recompute_fwd_factor)


def _configure_activation_checkpointing(cfg, mpu, rank: int) -> None:
    if "activation_checkpointing" not in cfg.model_fields_set:
        return
    from deepshard.runtime import activation_checkpointing

    notes = activation_checkpointing.configure(mpu, deepspeed_config=cfg)
    if rank == 0 and notes:
        logger.warning("activation_checkpointing: %s", "; ".join(notes))


def _config_source(args, config):
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config",
                                                                    None)
    if from_args is not None and config is not None:
        raise UsageError("a config was given both as --deepspeed_config and as config=",
                         where="deepshard.initialize", hint="pass only one of them")
    source = config if config is not None else from_args
    if source is None:
        raise UsageError("no DeepSpeed config given", where="deepshard.initialize",
                         hint="pass config=<dict or path>, or --deepspeed_config <file> "
                              "with args=")
    return source


# keys the config accepts (DeepSpeed's) that change nothing here: reported when set
NO_EFFECT = {
    "zero_optimization": ("sub_group_size",
                          "allgather_bucket_size", "round_robin_gradients"),
    "": ("prescale_gradients", "gradient_predivide_factor"),
}


def _no_effect(cfg) -> list[str]:
    found: list[str] = []
    for section, keys in NO_EFFECT.items():
        node = getattr(cfg, section) if section else cfg
        found.extend(f"{section}.{k}" if section else k for k in keys
                     if k in node.model_fields_set)
    return found


def _exit_cleanly_on_sigterm() -> None:
    """ds-run stops workers with SIGTERM; by default that kills Python without running
    finalizers (NVMe swap files would stay). A script's own handler is left alone."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum, frame) -> None:
    import contextlib
    import threading

    code = 128 + signum
    with contextlib.suppress(RuntimeError):  # the interpreter is already shutting down
        threading._register_atexit(_exit_after_handlers, code)  # type: ignore[attr-defined]
    raise SystemExit(code)


def _exit_after_handlers(code: int) -> None:
    """Once SIGTERM's ``SystemExit`` has unwound the stack (``finally`` blocks ran): the
    exit handlers and finalizers (NVMe swap files, process groups), then the exit itself,
    without the interpreter's final garbage collection — seconds for a worker holding a
    model (5-7 s measured), past the launcher's stop grace, so it was SIGKILLed."""
    import atexit

    from deepshard.errors import flush_stdio

    atexit._run_exitfuncs()
    flush_stdio()
    os._exit(code)


def _logging_setup() -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[deepshard] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _model_group(mpu):
    if mpu is None or not hasattr(mpu, "get_model_parallel_world_size"):
        return None
    if mpu.get_model_parallel_world_size() <= 1:
        return None
    return mpu.get_model_parallel_group()


def _data_parallel(mpu):
    """The group the strategy reduces gradients over (and ZeRO shards over), its size and
    this rank's place: with sequence parallelism every rank of ``data x sequence`` (as
    DeepSpeed's ``seq_data_parallel_group``; the gradients are averaged over all of them)."""
    if mpu is not None:
        group = mpu.get_data_parallel_group()
        if _sequence_parallel_size(mpu) > 1:
            group = mpu.get_sequence_data_parallel_group()
        return group, dist.get_world_size(group), dist.get_rank(group)
    return None, dist.get_world_size(), dist.get_rank()


def _sequence_parallel_size(mpu) -> int:
    getter = getattr(mpu, "get_sequence_parallel_world_size", None)
    return 1 if getter is None else getter()


def _replicas(mpu) -> int:
    """The data-parallel size the batch triad counts: model replicas, each sequence-parallel
    group one (DeepSpeed: world / (sp x tp x pp))."""
    if mpu is None:
        return dist.get_world_size()
    return dist.get_world_size(mpu.get_data_parallel_group())


def _scheduler(cfg, client, optimizer):
    """The client's scheduler (or what its callable builds) wins over the config's, as in
    DeepSpeed."""
    if client is not None:
        if callable(client) and not hasattr(client, "step"):
            return client(optimizer)
        return client
    if cfg.scheduler is not None:
        if optimizer is None:
            raise UsageError("a scheduler needs an optimizer", where="scheduler",
                             hint='add an "optimizer" section or pass optimizer=')
        return build_scheduler(cfg.scheduler.type, cfg.scheduler.params.model_dump(), optimizer)
    return None


def _maybe_resume(engine: DeepShardEngine, cfg) -> None:
    section = cfg.checkpoint
    if not section.resume_dir or section.resume == "never":
        return
    restarted = int(os.environ.get(RESTART_COUNT, "0") or 0) > 0
    if section.resume == "always" or restarted:
        path, _ = engine.load_checkpoint(section.resume_dir)
        if path and engine.global_rank == 0:
            logger.info("resumed from %s at step %d", path, engine.global_steps)
