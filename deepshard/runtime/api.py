"""``deepshard.initialize``: DeepSpeed's entry point, building the engine from a config.

It joins the process group when needed, loads and validates the config against the
data-parallel world size, casts and places the module, broadcasts rank 0's weights, plans
the gradient buckets, creates fp32 masters for fp16/bf16, the optimizer, scheduler and loss
scaler, and resumes from a checkpoint when the config asks for it (``checkpoint.resume_dir``).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ..contract import RESTART_COUNT
from ..errors import UsageError, exit_on_usage_error
from . import teardown
from .allocator import fix_mmap_threshold
from .buckets import DEFAULT_BUCKET_BYTES, GradBuckets, plan_buckets
from .config import load_config
from .distributed import DEFAULT_PORT, init_distributed
from .engine import DeepShardEngine, EngineParts
from .loss_scaler import build_loss_scaler
from .lr_schedules import build_scheduler
from .optim import build_optimizer
from .precision import MasterWeights

logger = logging.getLogger("deepshard")

COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` options to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (accepted for compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    return parser


@exit_on_usage_error
def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None,
               model_parameters: Iterable | None = None, training_data=None, lr_scheduler=None,
               distributed_port: int = DEFAULT_PORT, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, config_params=None):
    """Build the training engine, as ``deepspeed.initialize`` does.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``; the dataloader is
    ``None`` without ``training_data``. ``config`` is a dict or a JSON/YAML path; it may
    instead come from ``args.deepspeed_config``.
    """
    if model is None:
        raise UsageError("deepshard.initialize() needs a model", where="initialize(model=...)",
                         hint="pass the torch.nn.Module to train as model=")
    source = _config_source(args, config if config is not None else config_params)
    _logging_setup()
    fix_mmap_threshold()
    _exit_cleanly_on_sigterm()
    if not dist.is_initialized():
        init_distributed(distributed_port=distributed_port, verbose=False)
    else:
        teardown.register()  # the script's own init_process_group: same care at exit
    layout = _layout(source, model, mpu)
    if layout is not None:
        mpu = layout.groups
    group, dp_world, dp_rank = _data_parallel(mpu)
    rank = dist.get_rank()
    auto = {"pipeline.stages": layout.topology.pipe if layout else 1}
    loaded = load_config(source, world_size=dp_world, model=model, auto_values=auto)
    cfg = loaded.config
    ignored = [*loaded.unimplemented, *_no_effect(cfg)]
    if rank == 0 and ignored:
        logger.warning("config keys DeepSpeed knows but deepshard does not implement "
                       "(ignored): %s", ", ".join(ignored))
    stage = cfg.zero_optimization.stage
    if layout is not None and layout.topology.pipe > 1 and stage > 1:
        raise UsageError(f"ZeRO stage {stage} cannot run with pipeline parallelism: it "
                         "reduces gradients during each backward, before the tied weights' "
                         "sums", where=f"{loaded.origin}: zero_optimization.stage",
                         hint="use ZeRO stage 0 or 1 with pipeline.stages > 1 (as DeepSpeed)")
    if stage and cfg.optimizer is not None and cfg.optimizer.type == "LAMB":
        raise UsageError("LAMB cannot run on ZeRO shards: its trust ratio is per parameter, "
                         "and a shard holds pieces of many", where=f"{loaded.origin}: "
                         "optimizer.type", hint="use Adam/AdamW with ZeRO, or stage 0 for LAMB")
    device = _device()
    module = _place(model, cfg, device)
    if stage < 3 or (layout is not None and layout.topology.tensor > 1):
        from .zero.init import materialize

        # built under zero.Init: whole again below stage 3, and for AutoTP to cut it
        materialize(module)
    excluded: frozenset[int] = frozenset()
    if layout is not None:
        excluded = layout.prepare(module, _broadcast_from_rank0, rank)
    _broadcast_from_rank0(module, group, dp_world)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names, params = tuple(n for n, _ in named), tuple(p for _, p in named)
    comm = COMM_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    buckets = masters = zero = None
    if stage:
        zero, opt, names, params = _zero(cfg, module, optimizer, model_parameters, names,
                                         params, group, dp_world, dp_rank, comm)
    else:
        cap = _bucket_elements(params)
        layouts = plan_buckets([p.shape for p in params], [p.dtype for p in params], cap)
        buckets = GradBuckets(params, layouts, group, dp_world, comm, names)
        half = cfg.fp16.enabled or cfg.bf16.enabled
        masters = MasterWeights(params, layouts) if half and params else None
        opt = _optimizer(cfg, optimizer, model_parameters, params, masters)
    sched = _scheduler(cfg, lr_scheduler, opt)
    scaler = build_loss_scaler(cfg.fp16) if cfg.fp16.enabled else None
    profiler = None
    if cfg.flops_profiler.enabled and rank == 0:
        from .flops_profiler import FlopsProfiler

        fp = cfg.flops_profiler
        profiler = partial(FlopsProfiler, module, module_depth=fp.module_depth,
                           top_modules=fp.top_modules, detailed=fp.detailed,
                           recompute_fwd_factor=fp.recompute_fwd_factor)
    if "activation_checkpointing" in cfg.model_fields_set:
        from . import activation_checkpointing

        notes = activation_checkpointing.configure(mpu, deepspeed_config=cfg)
        if rank == 0 and notes:
            logger.warning("activation_checkpointing: %s", "; ".join(notes))
    parts = EngineParts(
        module=module, config=cfg, params=params, names=names, buckets=buckets,
        masters=masters, zero=zero, optimizer=opt, lr_scheduler=sched, loss_scaler=scaler,
        group=group, rank=rank, dp_rank=dp_rank, dp_world=dp_world, device=device,
        profiler_factory=profiler, norm_excluded=excluded,
        mp_group=_model_group(mpu), mpu=mpu)
    engine = layout.engine(parts) if layout is not None else DeepShardEngine(parts)
    loader = None
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=dp_world, rank=dp_rank)
        loader = DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                            sampler=sampler, collate_fn=collate_fn)
    _maybe_resume(engine, cfg)
    return engine, opt, loader, sched


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
    "zero_optimization": ("stage3_max_reuse_distance", "sub_group_size",
                          "allgather_bucket_size", "round_robin_gradients"),
    "": ("prescale_gradients", "gradient_predivide_factor"),
}


def _no_effect(cfg) -> list[str]:
    found = []
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
    raise SystemExit(128 + signum)


def _logging_setup() -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[deepshard] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _layout(source, model, mpu):
    """The (pipe, data, tensor) layout the config and model ask for, or ``None``."""
    from .config.dialect import read_config_source
    from .parallel.layout import Layout

    data, origin = read_config_source(source)
    return Layout.create(data, origin, model, mpu)


def _model_group(mpu):
    if mpu is None or not hasattr(mpu, "get_model_parallel_world_size"):
        return None
    if mpu.get_model_parallel_world_size() <= 1:
        return None
    return mpu.get_model_parallel_group()


def _data_parallel(mpu):
    if mpu is not None:
        group = mpu.get_data_parallel_group()
        return group, dist.get_world_size(group), dist.get_rank(group)
    return None, dist.get_world_size(), dist.get_rank()


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _place(model: torch.nn.Module, cfg, device: torch.device) -> torch.nn.Module:
    model = model.to(device)
    if cfg.fp16.enabled:
        model = model.half()
    elif cfg.bf16.enabled:
        model = model.bfloat16()
    return model


@torch.no_grad()
def _broadcast_from_rank0(module: torch.nn.Module, group, world: int) -> None:
    """Every rank starts from rank 0's weights and buffers (as DeepSpeed's engine does)."""
    if world == 1:
        return
    tensors = [t for t in (*module.parameters(), *module.buffers())]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in group_tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _bucket_elements(params) -> int:
    """Stage 0 buckets are DDP-sized; ``reduce_bucket_size`` (DeepSpeed's default 5e8, one
    bucket for most models: no overlap) is for the ZeRO stages, as in DeepSpeed."""
    size = params[0].element_size() if params else 4
    return DEFAULT_BUCKET_BYTES // size


def _optimizer(cfg, client, model_parameters, params, masters):
    """The config's optimizer or the client's, stepping the fp32 masters when there are."""
    _one_optimizer(cfg, client)
    mapping = masters.master_of() if masters is not None else None
    groups = _param_groups(model_parameters if model_parameters is not None else params,
                           mapping)
    if (cfg.optimizer is not None or client is not None) and not _any_tensor(groups):
        raise UsageError("the optimizer would have no trainable parameters",
                         where="initialize(model_parameters=...)",
                         hint="pass parameters of the model that require grad (or none, "
                              "for all of them)")
    if cfg.optimizer is not None:
        return build_optimizer(cfg.optimizer.type, cfg.optimizer.params.model_dump(), groups)
    if client is None:
        return None
    if not isinstance(client, torch.optim.Optimizer):
        return _callable_client(client)(groups)
    if mapping is not None:
        _fresh(client)
        for group in client.param_groups:
            group["params"] = [mapping[id(p)] for p in group["params"] if id(p) in mapping]
    return client


def _zero(cfg, module, client, model_parameters, names, params, group, world, rank, comm):
    """Shard the optimizer's parameters (stages 1-3) and build the optimizer over the
    shards. Returns ``(zero, optimizer, names, params)`` for the sharded parameters."""
    from .zero.runtime import build_zero

    _one_optimizer(cfg, client)
    if isinstance(client, torch.optim.Optimizer):
        _fresh(client)
        source = client.param_groups
    else:
        items = list(model_parameters if model_parameters is not None else params)
        source = items if items and isinstance(items[0], dict) else [{"params": items}]
    index = {id(p): i for i, p in enumerate(params)}
    members, owner = [], {}
    for k, g in enumerate(source):
        chosen = []
        for p in g["params"]:
            i = index.get(id(p))
            if i is None:
                continue
            if i in owner:
                raise UsageError(f"{names[i]} is in two optimizer param groups",
                                 where="initialize(model_parameters=...)",
                                 hint="put every parameter in one group only")
            owner[i] = k
            chosen.append(i)
        members.append(chosen)
    if (cfg.optimizer is not None or client is not None) and not owner:
        raise UsageError("the optimizer would have no trainable parameters",
                         where="initialize(model_parameters=...)",
                         hint="pass parameters of the model that require grad (or none, "
                              "for all of them)")
    kept = sorted(owner)
    renumber = {i: j for j, i in enumerate(kept)}
    names, params = tuple(names[i] for i in kept), tuple(params[i] for i in kept)
    members = [[renumber[i] for i in m] for m in members]
    zero = build_zero(cfg, module, names, params, members, group, world, rank, comm)
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": zero.step_tensors(o)} for o, g in enumerate(source)]
    if cfg.optimizer is not None:
        opt = build_optimizer(cfg.optimizer.type, cfg.optimizer.params.model_dump(), groups)
    elif client is None:
        opt = None
    elif isinstance(client, torch.optim.Optimizer):
        for g, new in zip(client.param_groups, groups, strict=True):
            g["params"] = new["params"]
        opt = client
    else:
        opt = _callable_client(client)(groups)
    return zero, opt, names, params


def _one_optimizer(cfg, client) -> None:
    if cfg.optimizer is not None and client is not None:
        raise UsageError("an optimizer is given both in the config and as optimizer=",
                         where="optimizer", hint="remove one of them")


def _fresh(client: torch.optim.Optimizer) -> None:
    """A client optimizer whose parameters deepshard swaps must not have state yet."""
    if client.state:
        raise UsageError("the client optimizer already has state",
                         where="initialize(optimizer=...)",
                         hint="create the optimizer before any step, or let deepshard "
                              "build it from the config's optimizer section")


def _callable_client(client):
    if not callable(client):
        raise UsageError(f"optimizer= is a {type(client).__name__}",
                         where="initialize(optimizer=...)",
                         hint="pass a torch.optim.Optimizer, or a callable that builds one "
                              "from the parameters")
    return client


def _any_tensor(groups) -> bool:
    return any(g["params"] if isinstance(g, dict) else True for g in groups)


def _param_groups(model_parameters, mapping):
    items = list(model_parameters)
    if mapping is None:
        return items
    if items and isinstance(items[0], dict):
        return [{**g, "params": [mapping[id(p)] for p in g["params"] if id(p) in mapping]}
                for g in items]
    return [mapping[id(p)] for p in items if id(p) in mapping]


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
