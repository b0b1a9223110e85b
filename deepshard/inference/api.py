"""``deepshard.init_inference``: DeepSpeed's entry point to inference.

``init_inference(model, config=None, **kwargs)`` parses the settings
(:mod:`deepshard.config.schema_inference`: DeepSpeed's keys and aliases, kwargs over
config), forms the tensor-parallel group (consecutive ranks; the world when it equals
``tp_size``; replicas of the model when the world is larger), shards the model with the
AutoTP planner while reading each rank's slices from ``checkpoint`` (or from the model's own
weights when they are real), casts or quantizes it, routes the fused path when
``replace_with_kernel_inject`` is set, and returns an :class:`~.engine.InferenceEngine`.

A model too big for one rank is built on the meta device (``with torch.device("meta")`` or
``deepshard.OnDevice(device="meta")``) and loaded from ``checkpoint``: an HF directory
(safetensors, single or sharded), DeepSpeed's checkpoint-description JSON, or a deepshard /
DeepSpeed training checkpoint directory (a ZeRO-3 run's, consolidated on the fly). No rank
then holds more than its shards plus the replicated tensors.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepshard.config.schema_inference import InferenceSpec, parse_inference_config
from deepshard.errors import UsageError
from deepshard.inference.collectives import TPComm
from deepshard.inference.engine import InferenceEngine
from deepshard.inference.fused import inject_kernels
from deepshard.inference.layers import ShardedLinear
from deepshard.inference.sharding import shard_for_inference
from deepshard.inference.sources import (
    SafetensorsSource,
    StateDictSource,
    TensorSource,
    open_source,
)

log = logging.getLogger("deepshard")

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Prepare ``model`` for (tensor-parallel) inference; see the module docstring.

    Raises:
        UsageError: a bad or unsupported setting (one line naming the key), a meta-device
            model without a checkpoint, a checkpoint that does not fit the model, or a model
            whose layers AutoTP cannot split at ``tp_size`` > 1 (naming the module, with the
            ``injection_policy`` to pass).
    """
    spec = parse_inference_config(config, kwargs)
    if not isinstance(model, nn.Module):
        raise UsageError(f"init_inference needs an nn.Module, not {type(model).__name__}",
                         where="init_inference(model)", hint="pass the model object")
    group, rank, world = _group(spec)
    device = _device(spec)
    notes = list(spec.notes)
    dtype = _DTYPES.get(spec.float_dtype or "")
    if not spec.dtype_given and device.type != "cuda":
        dtype = None
        notes.append("init_inference: dtype: not given, so the model keeps its own on this "
                     "CPU (DeepSpeed's default fp16 applies on CUDA; DeepSpeed refuses fp16 on "
                     "a CPU). HINT: pass dtype=torch.float32 to say so")
    for note in notes:
        if rank == 0:
            log.warning("%s", note)
    source, where = _source(model, spec)
    policy = _policy(model, spec.injection_policy)
    comm = TPComm.create(group, world, rank)
    report = shard_for_inference(model, source, comm, rank, world, dtype=dtype, where=where,
                                 policy=policy)
    done = inject_kernels(model, device) if spec.kernel_inject else ()
    model.to(device)
    if spec.int8:
        for module in model.modules():
            if isinstance(module, ShardedLinear):
                module.quantize_int8()
    model.eval()
    model.requires_grad_(False)
    if _rank0():
        log.info("init_inference: tensor-parallel size %d%s, %s, %.1f MiB on rank 0%s", world,
                 " (shared-memory collectives)" if comm.shared_memory else "",
                 "int8 weights" if spec.int8 else str(next(model.parameters()).dtype),
                 report.local_bytes / 2**20, "".join(f"; {d}" for d in done))
        log.debug("%s", report.plan.describe())
    return InferenceEngine(model, spec, group, report)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _group(spec: InferenceSpec) -> tuple[Any, int, int]:
    """(group, rank in it, its size)."""
    if spec.tp_group is not None:
        return spec.tp_group, dist.get_rank(spec.tp_group), dist.get_world_size(spec.tp_group)
    if spec.tp_size == 1:
        return None, 0, 1
    if not dist.is_initialized():
        from deepshard.comm.distributed import init_distributed

        init_distributed()
    world = dist.get_world_size()
    if world % spec.tp_size:
        raise UsageError(f"tp_size {spec.tp_size} does not divide the {world} ranks of the job",
                         where="init_inference: tensor_parallel.tp_size",
                         hint=f"start a multiple of {spec.tp_size} ranks, or choose a tp_size "
                              f"that divides {world}")
    if world == spec.tp_size:
        return dist.group.WORLD, dist.get_rank(), world
    mine = None
    for first in range(0, world, spec.tp_size):
        ranks = list(range(first, first + spec.tp_size))
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    return mine, dist.get_rank() % spec.tp_size, spec.tp_size


def _source(model: nn.Module, spec: InferenceSpec) -> tuple[TensorSource, str]:
    ckpt = spec.checkpoint
    if ckpt is None:
        meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if meta:
            raise UsageError(f"the model's weights are on the meta device ({meta[0]}, ...) and "
                             "no checkpoint was given", where="init_inference: checkpoint",
                             hint="pass checkpoint='path/to/hf_model_dir' (or a training "
                                  "checkpoint directory)")
        return StateDictSource(model.state_dict()), "the model"
    if isinstance(ckpt, (str, os.PathLike)):
        return open_source(_based(ckpt, spec.base_dir), "init_inference: checkpoint"), str(ckpt)
    if (ckpt.tp_size or 1) > 1:
        raise UsageError(f"the checkpoint description lists files saved at tp_size "
                         f"{ckpt.tp_size} (per-rank shards); deepshard reads whole-model files "
                         "and shards them itself", where="init_inference: checkpoint.tp_size",
                         hint="point checkpoint at the HF model directory or the training "
                              "checkpoint directory instead")
    files = [_based(f, ckpt.base_dir or spec.base_dir)
             for f in (*ckpt.checkpoints, *ckpt.non_tp)]
    where = f"init_inference: checkpoint ({', '.join(map(str, files[:2]))})"
    missing = [f for f in files if not f.exists()]
    if missing:
        raise UsageError(f"{missing[0]} does not exist", where="init_inference: checkpoint",
                         hint="list the checkpoint files relative to base_dir")
    if len(files) == 1 and files[0].is_dir():
        return open_source(files[0], where), where
    if all(f.suffix == ".safetensors" for f in files):
        return SafetensorsSource(files[0].parent, [f.name for f in files]), where
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        loaded = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        tensors.update(loaded.get("module", loaded) if isinstance(loaded, dict) else loaded)
    return StateDictSource(tensors), where


def _based(path: str | os.PathLike, base: str | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or not base else Path(base) / p


def _policy(model: nn.Module, injection_policy: Any) -> dict[str, str] | None:
    """DeepSpeed's ``{BlockClass: ("name.of.row_linear", ...)}``: in every module of a
    listed class, the named Linears are row-parallel (all-reduced) and the block's other
    Linears column-parallel."""
    if not injection_policy:
        return None
    kinds: dict[str, str] = {}
    for cls, rows in injection_policy.items():
        found = [(n, m) for n, m in model.named_modules()
                 if (isinstance(cls, type) and isinstance(m, cls)) or type(m).__name__ == cls]
        if not found:
            raise UsageError(f"injection_policy names {getattr(cls, '__name__', cls)}, which the "
                             "model does not contain", where="init_inference: injection_policy",
                             hint="key it by the class of the model's transformer block")
        for prefix, block in found:
            for name, sub in block.named_modules():
                if isinstance(sub, nn.Linear):
                    row = any(name == r or name.endswith("." + r) or r.endswith(name)
                              for r in rows)
                    kinds[f"{prefix}.{name}"] = "row" if row else "column"
    return kinds


def _device(spec: InferenceSpec) -> torch.device:
    """The rank's device. ``keep_module_on_host`` needs nothing: weights are always read and
    sharded on the host, and only the rank's shards move to the device."""
    del spec
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
