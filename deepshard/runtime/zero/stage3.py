"""ZeRO stage 3: parameters sharded too, gathered per module around its use.

Units. The model is cut into *units*: every module held in a ``ModuleList``/``Sequential``
(the repeated layers of a transformer; the outermost such modules) is one, and the root
module is one more, owning every parameter no other unit owns (embeddings, final norm,
head; and any parameter shared by two units, such as tied weights). When a model has no
such container, the root's direct children that hold parameters are the units.

Lifecycle of a unit's partitioned parameters:

- forward pre-hook: gather (all-gather of the shards into a full buffer; the parameters'
  ``.data`` become views of it), then prefetch the next units in the recorded order, up to
  ``stage3_prefetch_bucket_size`` elements ahead, within ``stage3_max_live_parameters``;
- forward post-hook: release (drop the full buffer), and hook the outputs' autograd nodes
  so that the unit is gathered again when backward reaches it (prefetching earlier units);
  from the second step on, a unit whose backward comes within
  ``stage3_max_reuse_distance`` elements stays gathered instead (DeepSpeed's default,
  1e9, keeps a model of up to ~500M parameters gathered from its forward to its backward,
  within ``stage3_max_live_parameters``);
- when backward has produced all the gradients of one of a unit's groups (stage 2's
  callback): release that group.

Frozen parameters (LoRA's base) are partitioned too, in groups of their own that have no
gradients, no optimizer state and no reduction. No gradient says when backward is done
with them, so the forward post-hook also hooks the unit's inputs that require grad: once
the gradients of all of them have arrived (for every forward whose backward began at the
unit) and the unit's trainable groups have theirs, its frozen groups are released. A unit
whose inputs need no gradient (the first layer under a frozen embedding) keeps them
gathered to the end of backward.

Parameters smaller than ``stage3_param_persistence_threshold`` elements are not
partitioned (as in DeepSpeed): they live in replicated groups on every rank, while their
gradients and optimizer state are still sharded.

Leaf modules (``set_z3_leaf_modules``) are never split: one that would hold units is a
unit itself. A parameter registered as external to a module of another unit
(``register_external_parameter``) belongs to the root.

``engine.compile()`` compiles each unit's ``forward`` on its own
(:mod:`deepshard.runtime.compiled`): the hooks run in ``Module.__call__``, outside the
compiled code. They are ``torch.compiler.disable``'d too, so that a model compiled whole
by its user breaks the graph around each gather and release instead of tracing them.

Memory at the peak (the start of backward, everything kept gathered): each gathered group
holds its shard inside the full buffer (:meth:`FlatGroup.wait`), the root's parameters
reduce in groups placed where they are registered (a head after the layers reduces and is
let go first) and at most two reductions are staged at once.

Limits: the root unit (embeddings, head, anything outside the containers) is gathered for
the whole forward and until its groups' gradients arrive; every rank must run the same
modules in the same order (as in DeepSpeed: gathers are collectives).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from deepshard.runtime.nested import tensors_in
from deepshard.runtime.zero.flat import FlatGroup
from deepshard.runtime.zero.marks import external_parameters, z3_leaf_module
from deepshard.runtime.zero.status import ZeroParamStatus

CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


@dataclass(frozen=True)
class UnitPlan:
    """The units of a model: for each, its module's qualified name and the names of the
    parameters it owns (pure result of :func:`plan_units`)."""

    modules: tuple[str, ...]
    params: tuple[tuple[str, ...], ...]


def plan_units(model: torch.nn.Module, trainable: Sequence[str]) -> UnitPlan:
    """Cut ``model`` into units (see the module docstring); ``trainable`` are the names of
    the parameters to shard, as ``named_parameters()`` gives them."""
    unit_names = container_blocks(model)
    if not unit_names:
        unit_names = [name for name, child in model.named_children()
                      if any(True for _ in child.parameters())]
    unit_names = _whole_leaves(model, unit_names)
    owners: dict[int, set[str]] = {}
    for unit in unit_names:
        for _, p in model.get_submodule(unit).named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), set()).add(unit)
    # a parameter also held by a module outside every unit is used outside its unit's
    # forward: it must belong to the root, which stays gathered around all of them
    for p in _outside_units(model, set(unit_names)):
        owners.setdefault(id(p), set()).add("")
    # so is one a module registered as external to it (used by another unit's forward)
    for name, module in model.named_modules():
        user = next((u for u in unit_names if name == u or name.startswith(u + ".")), "")
        for p in external_parameters(module):
            owners.setdefault(id(p), set()).add(user)
    by_unit: dict[str, list[str]] = {n: [] for n in ["", *unit_names]}
    named = dict(model.named_parameters())
    for name in trainable:
        units = owners.get(id(named[name]), set())
        by_unit[next(iter(units)) if len(units) == 1 else ""].append(name)
    order = ["", *unit_names]
    return UnitPlan(tuple(order), tuple(tuple(by_unit[n]) for n in order))


def container_blocks(model: torch.nn.Module) -> list[str]:
    """The qualified names of the outermost modules held in a ``ModuleList`` or
    ``Sequential`` (the repeated blocks of a transformer), in model order."""
    names = [name for name, m in model.named_modules()
             if name and _in_container(model, name) and not isinstance(m, CONTAINERS)]
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def _whole_leaves(model: torch.nn.Module, unit_names: list[str]) -> list[str]:
    """The units, with every leaf module (:mod:`.marks`) not already inside a unit made one
    whole: the units inside it give way to it."""
    units = list(unit_names)
    for name, module in model.named_modules():
        if not name or not z3_leaf_module(module):
            continue
        if any(name == u or name.startswith(u + ".") for u in units):
            continue  # gathered whole with the unit it lies in
        inside = [u for u in units if u.startswith(name + ".")]
        if inside:
            units = [u for u in units if u not in inside]
            units.append(name)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(units, key=order.__getitem__)


def _outside_units(model: torch.nn.Module, units: set[str]) -> list[torch.nn.Parameter]:
    """Parameters of the modules reached from the root without entering a unit."""
    found, todo = [], [("", model)]
    while todo:
        name, module = todo.pop()
        found.extend(module.parameters(recurse=False))
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if full not in units:
                todo.append((full, child))
    return found


def _in_container(model: torch.nn.Module, name: str) -> bool:
    parent = name.rpartition(".")[0]
    return isinstance(model.get_submodule(parent), CONTAINERS)


class Unit:
    """One unit: its module, the partitioned flat groups of trainable parameters it owns
    (``groups``) and those of frozen ones (``frozen``: no gradient tells when backward is
    done with them, see :class:`ParamCoordinator`)."""

    def __init__(self, index: int, module: torch.nn.Module, groups: Sequence[FlatGroup],
                 frozen: Sequence[FlatGroup] = ()):
        self.index, self.module = index, module
        self.groups, self.frozen = list(groups), list(frozen)
        self.numel = sum(g.spec.padded for g in (*self.groups, *self.frozen))
        self.pending_grads = len(self.groups)
        # forwards whose backward has begun here: inputs whose gradient is still to come
        self.active: dict[int, int] = {}
        self.done: set[int] = set()
        self.inputs_done = False

    @property
    def gathered(self) -> bool:
        return all(g.full is not None for g in (*self.groups, *self.frozen))

    def gather(self, async_op: bool = False) -> None:
        for g in (*self.groups, *self.frozen):
            g.gather(async_op=True, quantized=True)  # for forward or backward (qwZ)
        if not async_op:
            for g in (*self.groups, *self.frozen):
                g.wait()

    def release(self) -> None:
        for g in (*self.groups, *self.frozen):
            g.release()

    def release_frozen_if_done(self) -> None:
        """Release the frozen groups once backward is through this unit: every forward
        whose backward began here has its inputs' gradients, and every trainable group its
        gradients (an op whose only differentiable input is a trainable parameter may
        still read a frozen weight until then)."""
        if self.inputs_done and not self.active and self.pending_grads <= 0:
            for g in self.frozen:
                g.release()

    def reset(self) -> None:
        """After a backward: nothing gathered, nothing pending."""
        self.release()
        self.pending_grads = len(self.groups)
        self.active.clear()
        self.done.clear()
        self.inputs_done = False


class ParamCoordinator:
    """Gathers and releases stage 3 units around forward and backward (see the module
    docstring). ``group_unit[k]`` is the unit of flat group ``k`` (``None``: replicated)."""

    def __init__(self, units: Sequence[Unit], group_unit: Sequence[int | None],
                 prefetch_elements: int, max_live_elements: int, max_reuse_distance: int = 0):
        self.units = list(units)
        self.group_unit = list(group_unit)
        # each group's place in its unit's ``groups`` (they are listed in group order)
        seen: dict[int | None, int] = {}
        self._position = []
        for u in self.group_unit:
            self._position.append(seen.get(u, 0))
            seen[u] = self._position[-1] + 1
        self.prefetch_elements, self.max_live = prefetch_elements, max_live_elements
        self.max_reuse = max_reuse_distance
        self._after: list[int] = []  # per trace position: elements of the units after it
        self.trace: list[int] = []
        self._recording = True
        self._cursor = 0
        self._hooks: list[RemovableHandle] = []
        self._entered: torch.nn.Module | None = None
        if self.units:  # units[0] is the root: entering it starts the recorded order again
            inner = {id(u.module) for u in self.units[1:]}
            for module in _entry_chain(self.units[0].module, inner):
                self._hooks.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs: self._enter_root(m, (args, kwargs)),
                    with_kwargs=True))
                self._hooks.append(module.register_forward_hook(
                    lambda m, args, kwargs, out: self._leave_root(m, (args, kwargs), out),
                    with_kwargs=True))
        for unit in self.units[1:]:
            if unit.groups or unit.frozen:
                self._hooks.append(unit.module.register_forward_pre_hook(
                    lambda m, args, kwargs, u=unit: self._pre_forward(u, (args, kwargs)),
                    with_kwargs=True))
                self._hooks.append(unit.module.register_forward_hook(
                    lambda m, args, kwargs, out, u=unit: self._post_forward(
                        u, (args, kwargs), out), with_kwargs=True))
        self._forwards = 0  # numbers each forward of a unit, for its backward's bookkeeping
        # groups gathered because a forward read their parameters outside their unit, held
        # (``FlatGroup.holds``) until backward has their gradients
        self._borrowed: dict[int, FlatGroup] = {}
        self._watched: list[torch.nn.Module] = []
        gathered_groups = {id(g) for u in self.units for g in (*u.groups, *u.frozen)}
        root = self.units[0].module if self.units else None
        for module in root.modules() if root is not None else ():
            if any(id(getattr(p, "ds_group", None)) in gathered_groups
                   for p in module._parameters.values() if p is not None):
                module._parameters = _WatchedParameters(module._parameters, self)
                self._watched.append(module)

    # forward ---------------------------------------------------------------------------
    @torch.compiler.disable
    def _enter_root(self, module: torch.nn.Module, inputs) -> None:
        """A forward entered the root unit, through the root or a wrapper chain below it
        (PEFT's ``generate`` calls the wrapped model's forward, not the PeftModel's); the
        outermost entry acts (a raised forward left ``_entered`` set: the same module
        entering again starts afresh)."""
        if self._entered is not None and self._entered is not module:
            return
        self._entered = module
        if not _in_backward():
            self.begin_forward()
        root = self.units[0]
        if root.groups or root.frozen:
            self._pre_forward(root, inputs)

    @torch.compiler.disable
    def _leave_root(self, module: torch.nn.Module, inputs, out) -> None:
        if self._entered is not module:
            return
        self._entered = None
        root = self.units[0]
        if root.groups or root.frozen:
            self._post_forward(root, inputs, out)
        if not torch.is_grad_enabled():  # no backward will let them go
            self._give_back()

    @torch.compiler.disable
    def _pre_forward(self, unit: Unit, inputs) -> None:
        del inputs
        if _in_backward():
            unit.gather()  # activation checkpointing recomputes inside backward
            return
        unit.gather()
        if self._recording:
            self.trace.append(unit.index)
        else:
            self._prefetch(self._advance(unit.index), +1)

    @torch.compiler.disable
    def _post_forward(self, unit: Unit, inputs, out) -> None:
        if _in_backward():
            return
        if torch.is_grad_enabled():
            outputs = [t for t in tensors_in(out) if t.requires_grad]
            if outputs:
                self._forwards += 1
                call = self._forwards
                needs = [t for t in tensors_in(inputs) if t.requires_grad] if unit.frozen else []
                count = len(needs)
                nodes: set[int] = set()
                for t in outputs:
                    hook = functools.partial(self._on_output_grad, unit, call, count)
                    # on the node, not the tensor: the node's pre-hooks run after the
                    # tensor's, so the next unit's input hook (on this same tensor) releases
                    # its frozen groups before this unit gathers
                    if t.grad_fn is None:
                        t.register_hook(hook)
                    elif id(t.grad_fn) not in nodes:
                        nodes.add(id(t.grad_fn))
                        t.grad_fn.register_prehook(hook)
                for t in needs:
                    t.register_hook(lambda grad, u=unit, c=call: self._input_grad(u, c))
                unit.pending_grads = len(unit.groups)
                if self._reused_soon(unit):
                    return
        unit.release()

    def _reused_soon(self, unit: Unit) -> bool:
        """Whether a unit whose forward (with grad) just ended stays gathered for its
        backward, as DeepSpeed's ``stage3_max_reuse_distance`` keeps it: the elements used
        in between (the later units' forward and backward) are at most that distance, and
        what is gathered stays within ``stage3_max_live_parameters``. Needs the recorded
        order (from the second step on); the root's backward comes right after its
        forward."""
        if self._recording or not self.max_reuse:
            return False
        if unit.index == 0:
            between = 0
        else:
            pos = self._cursor - 1
            if not (0 <= pos < len(self.trace)) or self.trace[pos] != unit.index:
                return False
            between = 2 * self._after[pos]
        live = sum(u.numel for u in self.units if u.gathered)
        return between <= self.max_reuse and live <= self.max_live

    def borrow(self, param: torch.nn.Parameter) -> None:
        """A forward read ``param`` while its unit was not gathered (a parameter used
        outside its own module, as DeepSpeed detects through its ``ZeROOrderedDict``):
        gather its group now and keep it until backward has its gradients (or, without
        grad, until the forward ends). Collective, like every gather."""
        group = getattr(param, "ds_group", None)
        if group is None or (self._entered is None and not _in_backward()):
            return
        group.gather(quantized=True)
        if id(group) not in self._borrowed:  # held: its unit's release leaves it
            group.holds += 1
            self._borrowed[id(group)] = group

    def _give_back(self, group: FlatGroup | None = None) -> None:
        """Stop holding ``group`` (every borrowed group when ``None``) and release it."""
        for g in [group] if group is not None else list(self._borrowed.values()):
            if self._borrowed.pop(id(g), None) is not None:
                g.holds -= 1
            g.release()

    # backward --------------------------------------------------------------------------
    @torch.compiler.disable
    def _on_output_grad(self, unit: Unit, call: int, inputs: int, grad) -> None:
        del grad
        self._pre_backward(unit, call, inputs)

    @torch.compiler.disable
    def _pre_backward(self, unit: Unit, call: int, inputs: int) -> None:
        unit.gather()
        if unit.frozen and inputs and call not in unit.active and call not in unit.done:
            unit.active[call] = inputs
        if not self._recording:
            self._prefetch(self._retreat(unit.index), -1)

    @torch.compiler.disable
    def _input_grad(self, unit: Unit, call: int) -> None:
        """A gradient reached one input of forward ``call`` of ``unit``: backward through
        that forward is done once all of them have."""
        left = unit.active.get(call)
        if left is None:
            return
        if left > 1:
            unit.active[call] = left - 1
            return
        del unit.active[call]
        unit.done.add(call)
        unit.inputs_done = True
        unit.release_frozen_if_done()

    def on_grads_staged(self, group_index: int) -> None:
        """Stage 2's callback: every gradient of flat group ``group_index`` is staged."""
        u = self.group_unit[group_index]
        if u is None:
            return
        unit = self.units[u]
        # a group whose gradients have all accumulated is not read again by this backward
        # (the root's head is let go at the start of backward, its embedding at the end)
        self._give_back(unit.groups[self._position[group_index]])
        unit.pending_grads -= 1
        if unit.pending_grads <= 0:
            unit.release_frozen_if_done()

    def end_backward(self) -> None:
        """After a backward: nothing stays gathered; the first pass fixes the order."""
        self._give_back()
        for unit in self.units:
            unit.reset()
        if self.trace and self._recording:
            self._recording = False
            after, total = [], 0
            for index in reversed(self.trace):
                after.append(total)
                total += self.units[index].numel
            self._after = after[::-1]
        self._cursor = len(self.trace)

    def release_all(self) -> None:
        """Release every unit, borrowed groups included (``empty_partition_cache``)."""
        self._give_back()
        for unit in self.units:
            unit.release()

    def begin_forward(self) -> None:
        """Before a forward: prefetching follows the recorded order from its start."""
        self._cursor = 0

    # prefetch --------------------------------------------------------------------------
    def _advance(self, index: int) -> int | None:
        for pos in range(self._cursor, len(self.trace)):
            if self.trace[pos] == index:
                self._cursor = pos + 1
                return pos
        return None

    def _retreat(self, index: int) -> int | None:
        for pos in range(min(self._cursor, len(self.trace)) - 1, -1, -1):
            if self.trace[pos] == index:
                self._cursor = pos
                return pos
        return None

    def _prefetch(self, pos: int | None, direction: int) -> None:
        if pos is None or not self.prefetch_elements:
            return
        live = sum(u.numel for u in self.units if u.gathered)
        budget = self.prefetch_elements
        nxt = pos + direction
        while 0 <= nxt < len(self.trace) and budget > 0:
            unit = self.units[self.trace[nxt]]
            if not unit.gathered:
                if live + unit.numel > self.max_live or unit.numel > budget:
                    break
                unit.gather(async_op=True)
                live += unit.numel
                budget -= unit.numel
            nxt += direction

    def remove(self) -> None:
        """Unregister the hooks (and the parameter dicts' watch)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module in self._watched:
            module._parameters = dict(module._parameters)
        self._watched.clear()


_NOT_GATHERED = (ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT)


class _WatchedParameters(dict):
    """A module's ``_parameters`` that tells the coordinator when a forward reads a
    partitioned parameter that is not gathered (``module.weight`` goes through
    ``__getitem__``; iteration, ``state_dict`` and ``named_parameters`` do not)."""

    def __init__(self, params: dict, coordinator: ParamCoordinator):
        super().__init__(params)
        self._coordinator = weakref.ref(coordinator)

    def __reduce__(self):
        # a copy of the module (deepcopy, pickle) gets a plain dict: the watch is this
        # engine's, and a weak reference does not pickle
        return (dict, (dict(self),))

    def __getitem__(self, key: str):
        p = super().__getitem__(key)
        if p is not None and getattr(p, "ds_status", None) in _NOT_GATHERED:
            coordinator = self._coordinator()
            if coordinator is not None:
                coordinator.borrow(p)
        return p


def _entry_chain(root: torch.nn.Module, inner: set[int]) -> list[torch.nn.Module]:
    """The root and the wrappers below it through which a forward may enter the root
    unit: each module down to the first with parameters of its own or several children
    (``inner``: the ids of the other units' modules, never entered this way)."""
    chain = [root]
    while True:
        children = list(chain[-1].children())
        if len(children) != 1 or id(children[0]) in inner or \
                any(True for _ in chain[-1].parameters(recurse=False)):
            return chain
        chain.append(children[0])


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
