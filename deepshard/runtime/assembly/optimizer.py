"""The optimizer for ``initialize``, the same way at every stage: the param groups as the
user gave them (a client optimizer's, ``model_parameters``, or all trainable parameters),
which trainable parameters each holds, and the optimizer built (from the config) or
re-pointed (a client's) over the tensors the strategy steps: the parameters, their fp32
masters, or this rank's ZeRO shards."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepshard.errors import UsageError
from deepshard.runtime.optim import build_optimizer

WHERE = "initialize(model_parameters=...)"
logger = logging.getLogger("deepshard")


def check_one_optimizer(cfg, client):
    """The config to build the optimizer from: with ``optimizer=`` given, the client's
    wins and the config's ``optimizer`` section is ignored with one warning (DeepSpeed
    ignores it silently; DeepSpeedExamples' GAN and ImageNet scripts have both). A client
    optimizer must be fresh (deepshard re-points its parameters) or a callable that
    builds one."""
    if cfg.optimizer is not None and client is not None:
        if dist.is_initialized() and dist.get_rank() == 0:
            logger.warning("the config's optimizer section (%s) is ignored: optimizer= "
                           "was given to initialize, and it is used (as DeepSpeed does)",
                           cfg.optimizer.type)
        cfg = cfg.model_copy(update={"optimizer": None})
    if isinstance(client, torch.optim.Optimizer):
        if client.state:
            raise UsageError("the client optimizer already has state",
                             where="initialize(optimizer=...)",
                             hint="create the optimizer before any step, or let deepshard "
                                  "build it from the config's optimizer section")
    elif client is not None and not callable(client):
        raise UsageError(f"optimizer= is a {type(client).__name__}",
                         where="initialize(optimizer=...)",
                         hint="pass a torch.optim.Optimizer, or a callable that builds one "
                              "from the parameters")
    return cfg


def source_groups(client, model_parameters, params: Sequence[torch.nn.Parameter]
                  ) -> list[dict]:
    """The param groups as given: a client optimizer's, ``model_parameters`` (tensors are
    one group), or every trainable parameter in one group."""
    if isinstance(client, torch.optim.Optimizer):
        return client.param_groups
    items = list(model_parameters if model_parameters is not None else params)
    return items if items and isinstance(items[0], dict) else [{"params": items}]


def group_members(cfg, client, source: Sequence[dict], params: Sequence[torch.nn.Parameter],
                  names: Sequence[str], replaced: dict | None = None) -> list[list[int]]:
    """For each source group, the indices into ``params`` (trainable) it holds, a
    parameter the module replaced (AutoTP; AutoEP: a list, one per local expert) counted
    as its replacements; other tensors are left out. A parameter in two groups, or an
    optimizer with nothing to train, is a usage error."""
    index = {id(p): [i] for i, p in enumerate(params)}
    for old, new in (replaced or {}).items():
        hits = [index[id(n)][0] for n in (new if isinstance(new, list) else [new])
                if id(n) in index]
        if hits:
            index[old] = hits
    members, owner = [], set()
    for g in source:
        chosen = []
        for p in (g["params"] if not torch.is_tensor(g["params"]) else [g["params"]]):
            for i in index.get(id(p), ()):
                if i in owner:
                    raise UsageError(f"{names[i]} is in two optimizer param groups",
                                     where=WHERE, hint="put every parameter in one group only")
                owner.add(i)
                chosen.append(i)
        members.append(chosen)
    if (cfg.optimizer is not None or client is not None) and not owner:
        raise UsageError("the optimizer would have no trainable parameters", where=WHERE,
                         hint="pass parameters of the model that require grad (or none, "
                              "for all of them)")
    return members


def make_optimizer(cfg, client, source: Sequence[dict],
                   step_tensors: Sequence[list[torch.Tensor]],
                   group=None) -> torch.optim.Optimizer | None:
    """The optimizer over ``step_tensors`` (one list per source group, with that group's
    hyperparameters): built from the config, the client's re-pointed, or what the
    client's callable builds; ``group``: the data-parallel process group (the 1-bit
    optimizers communicate over it)."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(tensors)}
              for g, tensors in zip(source, step_tensors, strict=True)]
    if cfg.optimizer is not None:
        offload = cfg.zero_optimization.offload_optimizer
        return build_optimizer(cfg.optimizer.type, cfg.optimizer.params.model_dump(), groups,
                               group=group, cpu_offload=offload is not None and
                               offload.device in ("cpu", "nvme"))
    if client is None:
        return None
    if isinstance(client, torch.optim.Optimizer):
        for g, new in zip(client.param_groups, groups, strict=True):
            g["params"] = new["params"]
        return client
    return client(groups)
