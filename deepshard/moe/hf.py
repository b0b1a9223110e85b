"""Expert parallelism for the sparse MoE blocks of HF transformers models (Mixtral,
Qwen2-MoE, Qwen3-MoE and every other block whose experts transformers 5 stores fused).

In transformers 5 a sparse block (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock``, ...) holds a router (``gate``: logits, top-k weights and
indices) and an experts module (``experts``) whose weights are two 3-D parameters,
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, called as
``experts(hidden [S, H], top_k_index [S, k], top_k_weights [S, k])``.
:func:`shard_hf_moe` replaces each such experts module by an :class:`HFExpertParallel`
holding only this rank's ``E / ep_size`` experts (global experts ``r * L .. r * L + L - 1``
on expert-parallel rank ``r``, as :mod:`.groups` lays them out) and leaves everything else
as transformers built it: the router, its logits (``output_router_logits``) and the
load-balancing loss the model computes from them, shared experts, the block's forward.
The routed (token, expert) pairs travel with the uneven all-to-all of :mod:`.dispatch`,
the local experts run as one batched matmul, and the outputs come back weighted by the
router's weights: the block's output is the unsharded block's.

The local experts are one module each (``...experts.experts.{j}.gate_up_proj``: 2-D),
marked as expert parameters (:mod:`.utils`), so the engine reduces their gradients over
their expert-data-parallel group and its checkpoints name them by global expert id
(``runtime/assembly/moe.py``). :func:`hf_state_dict` gathers them back into transformers'
names and shapes; ``engine.save_pretrained`` (``integrations/hf_save.py``) writes the HF
format with them (``from_pretrained`` loads it into a plain model).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from deepshard.errors import UsageError
from deepshard.moe.dispatch import combine, dispatch, plan
from deepshard.moe.gating import Routes
from deepshard.moe.sharded_moe import MOELayer
from deepshard.runtime.parallel.expert_groups import check_sizes, configure, group_name

if TYPE_CHECKING:
    from deepshard.runtime.parallel.expert_groups import ExpertGroups

FUSED = ("gate_up_proj", "down_proj")
"""The parameters of a transformers 5 fused experts module, in its registration order."""
_WHERE = "deepshard.moe.hf.shard_hf_moe"
PRESETS = {"mixtral": ("mixtral",), "qwen3_moe": ("qwen3_moe", "qwen2_moe")}
"""DeepSpeed AutoEP's ``preset_model`` names this adapter covers -> the HF model types."""
_PER_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate_up_proj|down_proj)")
AUTOEP_KEYS = ("enabled", "autoep_size", "preset_model", "use_grouped_mm")
"""The keys of DeepSpeed's ``expert_parallel`` section read here (``use_grouped_mm``:
accepted, the local experts always run as one batched matmul)."""


class HFExpert(nn.Module):
    """One expert of a fused HF experts module: ``gate_up_proj [2I, H]`` and
    ``down_proj [H, I]``, marked as an expert parameter of the group ``name``."""

    def __init__(self, gate_up: Tensor, down: Tensor, name: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up.detach().clone(),
                                         requires_grad=gate_up.requires_grad)
        self.down_proj = nn.Parameter(down.detach().clone(), requires_grad=down.requires_grad)
        for param in (self.gate_up_proj, self.down_proj):
            param.allreduce = False
            param.group_name = name


class HFExpertParallel(MOELayer):
    """Stands in for an HF fused experts module: same call
    (``forward(hidden_states, top_k_index, top_k_weights) -> [S, H]``), this rank's
    experts only.

    Built holding the HF module's full weights (not registered); they are cut to this
    rank's slice when its groups are set
    (:func:`deepshard.runtime.parallel.expert_groups.configure`, which
    :func:`shard_hf_moe` calls), and dropped. ``exp_counts`` holds the last forward's
    tokens per global expert; the load-balancing loss is the HF model's own.
    """

    def __init__(self, experts: nn.Module, ep_size: int) -> None:
        gate_up, down = _fused_weights(experts)
        num_experts = gate_up.shape[0]
        check_sizes(num_experts, ep_size)
        name = group_name(ep_size)
        super().__init__(None, nn.ModuleList(), name, ep_size,
                         num_experts // ep_size)
        self.act_fn = experts.act_fn
        self.hidden_dim = gate_up.shape[2]
        self.intermediate_dim = down.shape[2]
        self._full: tuple[Tensor, Tensor] | None = (gate_up, down)

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group  # the HF router needs no group

    def set_expert_groups(self, groups: ExpertGroups) -> None:
        """Use ``groups`` and keep experts ``ep_rank * L .. ep_rank * L + L - 1``."""
        super().set_expert_groups(groups)
        if self._full is None:
            return
        gate_up, down = self._full
        first = groups.ep_rank * self.num_local_experts
        for g in range(first, first + self.num_local_experts):
            self.experts.append(HFExpert(gate_up[g], down[g], self.ep_group_name))
        self._full = None

    def forward(self, hidden_states: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
        """The HF experts' output for ``[S, H]`` tokens routed by the HF router."""
        if self._full is not None:
            raise UsageError("this HF MoE block has no expert-parallel group yet",
                             where="HFExpertParallel.forward",
                             hint="shard the model with deepshard.moe.hf.shard_hf_moe")
        indices = top_k_index.t().long()
        routes = Routes(indices, torch.zeros_like(indices), top_k_weights.t(), 0,
                        self.num_experts)
        self.exp_counts = torch.bincount(indices.reshape(-1), minlength=self.num_experts)
        p = plan(routes, self.ep_size, self.ep_group)
        if self.expert_groups is not None:
            self.sent_rows = sum(p.send) - p.send[self.expert_groups.ep_rank]
        buffer = dispatch(hidden_states, p, self.ep_size, self.ep_group)
        out = self._grouped(buffer)
        return combine(out, p, hidden_states.shape[0], self.ep_size, self.ep_group)

    def _grouped(self, x: Tensor) -> Tensor:
        """The local experts on a ``[L, width, H]`` buffer, one bmm per projection."""
        gate_up = torch.stack([e.gate_up_proj for e in self.experts])  # [L, 2I, H]
        gate, up = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        down = torch.stack([e.down_proj for e in self.experts])  # [L, H, I]
        return torch.bmm(self.act_fn(gate) * up, down.transpose(1, 2))

    def full_weights(self) -> dict[str, Tensor]:
        """``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` of every expert,
        gathered over the expert-parallel group (a collective over it), detached."""
        out = {}
        for name in FUSED:
            local = torch.stack([getattr(e, name).detach() for e in self.experts])
            if self.ep_size > 1:
                from deepshard.comm import collectives as comm

                parts = [torch.empty_like(local) for _ in range(self.ep_size)]
                comm.all_gather(parts, local.contiguous(), group=self.ep_group)
                local = torch.cat(parts)
            out[name] = local
        return out


def _fused_weights(experts: nn.Module) -> tuple[Tensor, Tensor]:
    """``(gate_up_proj, down_proj)`` of a supported fused experts module, else a one-line
    :class:`UsageError`."""
    params = dict(experts.named_parameters(recurse=False))
    kind = type(experts).__name__
    if set(params) != set(FUSED) or params["gate_up_proj"].dim() != 3 \
            or params["down_proj"].dim() != 3 or not hasattr(experts, "act_fn"):
        raise UsageError(f"{kind} is not a fused gate_up_proj/down_proj experts module "
                         f"(parameters: {', '.join(sorted(params))})", where=_WHERE,
                         hint="only transformers 5 experts with 3-D gate_up_proj and "
                              "down_proj, without biases, are supported")
    layout = {"has_bias": False, "is_transposed": False, "has_gate": True,
              "is_concatenated": True, "has_post_expert_norm": False}
    odd = [k for k, v in layout.items() if getattr(experts, k, v) != v]
    if odd or not _default_gating(experts):
        raise UsageError(f"{kind} uses a layout this adapter does not run "
                         f"({', '.join(odd) or 'its own _apply_gate'})", where=_WHERE,
                         hint="leave this model's experts unsharded (ep_size 1)")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        raise UsageError(f"{kind} has gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)}, not [E, 2I, H] and [E, H, I]", where=_WHERE,
                         hint="leave this model's experts unsharded (ep_size 1)")
    return gate_up, down


def _default_gating(experts: nn.Module) -> bool:
    own = getattr(type(experts), "_apply_gate", None)
    if own is None:
        return True
    from transformers.integrations.moe import _default_apply_gate

    return own is _default_apply_gate


def fused_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` of every HF fused experts module in ``model`` (a module with
    3-D ``gate_up_proj`` and ``down_proj`` parameters), in ``named_modules`` order."""
    for name, module in model.named_modules():
        params = module._parameters
        if name and all(params.get(n) is not None and params[n].dim() == 3 for n in FUSED):
            yield name, module


def expert_parallel_layers(model: nn.Module) -> list[tuple[str, HFExpertParallel]]:
    """``(name, layer)`` of every :class:`HFExpertParallel` in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HFExpertParallel)]


def shard_hf_moe(model: nn.Module, ep_size: int, dp_group: Any = None) -> list[str]:
    """Run every fused experts module of ``model`` with expert parallelism of ``ep_size``
    ranks (see the module docstring); returns the names of the modules replaced.

    A collective (the expert-parallel groups are made, :func:`.groups.configure`): every
    rank calls it on the same model, with the same weights, before
    ``deepshard.initialize``, and builds the optimizer's parameters after it (the fused
    parameters are gone). ``dp_group``: the data-parallel group the engine will use,
    the whole world by default (pass it under pipeline or tensor parallelism).
    ``ep_size`` must divide the number of experts and the data-parallel size.
    """
    if not isinstance(ep_size, int) or ep_size < 1:
        raise UsageError(f"ep_size={ep_size!r} must be a positive integer", where=_WHERE,
                         hint="pass the number of ranks that share one layer's experts")
    found = list(fused_experts(model))
    if not found and not expert_parallel_layers(model):
        raise UsageError(f"{type(model).__name__} has no fused MoE experts module",
                         where=_WHERE, hint="pass a transformers 5 MoE model (Mixtral, "
                                            "Qwen2-MoE, Qwen3-MoE, ...)")
    for name, experts in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, HFExpertParallel(experts, ep_size))
    configure(model, dp_group)
    return [name for name, _ in found]


def hf_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` (detached) with the experts of every
    :class:`HFExpertParallel` gathered back under transformers' names and shapes
    (``{experts}.gate_up_proj [E, 2I, H]``, ``{experts}.down_proj [E, H, I]``), in the
    unsharded model's key order. A collective over every expert-parallel group; every
    rank gets the whole dict (the experts of one layer at a time are communicated)."""
    layers = dict(expert_parallel_layers(model))
    live = model.state_dict()
    out: dict[str, Tensor] = {}
    done: set[str] = set()
    for key, value in live.items():
        owner = next((n for n in layers if key.startswith(n + ".experts.")), None)
        if owner is None:
            out[key] = value.detach()
            continue
        if owner not in done:
            done.add(owner)
            for name, full in layers[owner].full_weights().items():
                out[f"{owner}.{name}"] = full
    for owner in sorted(set(layers) - done):  # a layer none of whose experts is saved
        for name, full in layers[owner].full_weights().items():
            out[f"{owner}.{name}"] = full
    return out


def fused_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A state dict of a sharded model's names (``{experts}.experts.{global id}.gate_up_proj``,
    e.g. ``deepshard.get_fp32_state_dict`` of its checkpoint, which holds every expert) with
    each layer's experts stacked back into transformers' ``{experts}.gate_up_proj`` and
    ``{experts}.down_proj``, in place of the first; ``load_state_dict`` of the plain HF model
    takes it. Pure; a layer missing some expert id is a one-line error."""
    grouped: dict[str, dict[int, Tensor]] = {}
    out: dict[str, Tensor | None] = {}
    for key, value in state.items():
        m = _PER_EXPERT.fullmatch(key)
        if m is None:
            out[key] = value
            continue
        fused = f"{m.group(1)}.{m.group(3)}"
        out.setdefault(fused, None)
        grouped.setdefault(fused, {})[int(m.group(2))] = value
    for fused, experts in grouped.items():
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise UsageError(f"{fused} lacks experts {missing}", where="state dict",
                             hint="consolidate the whole checkpoint "
                                  "(deepshard.get_fp32_state_dict) first")
        out[fused] = torch.stack([experts[g] for g in range(len(experts))])
    return {k: v for k, v in out.items() if v is not None}


def apply_expert_parallel(model: nn.Module, section: Mapping[str, Any], dp_group: Any = None
                          ) -> dict[int, list[nn.Parameter]]:
    """DeepSpeed's ``expert_parallel`` config section (AutoEP: ``{"enabled": true,
    "autoep_size": 2, "preset_model": "mixtral"}``): when enabled,
    :func:`shard_hf_moe` with ``autoep_size``. Returns, by the ``id`` of each fused
    parameter replaced, the per-expert parameters standing for it on this rank (so that
    optimizer param groups built over the unsharded model can be mapped); ``{}`` when
    disabled. A key of DeepSpeed's this adapter does not implement is a one-line error."""
    where = "expert_parallel"
    for key in section:
        if key not in AUTOEP_KEYS:
            raise UsageError(f"{key} is not supported by deepshard's expert parallelism",
                             where=f"{where}.{key}",
                             hint=f"remove it (supported: {', '.join(AUTOEP_KEYS)})")
    if not section.get("enabled", False):
        return {}
    size = section.get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UsageError(f"autoep_size={size!r} must be a positive integer",
                         where=f"{where}.autoep_size", hint="set the expert-parallel size")
    preset = section.get("preset_model")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if preset is not None and model_type not in PRESETS.get(preset, ()):
        raise UsageError(f"preset_model {preset!r} does not match this model "
                         f"(model_type {model_type!r})", where=f"{where}.preset_model",
                         hint=f"leave it out, or use one of {', '.join(sorted(PRESETS))}")
    before = {name: dict(m.named_parameters(recurse=False)) for name, m in fused_experts(model)}
    shard_hf_moe(model, size, dp_group)
    out: dict[int, list[nn.Parameter]] = {}
    for name, params in before.items():
        layer = model.get_submodule(name)
        for attr, old in params.items():
            out[id(old)] = [getattr(e, attr) for e in layer.experts]
    return out
