"""ZeRO checkpoints: what each rank writes of its shards, and how it reads them back.

Saving, every rank writes its shard of every flat group into its own rank file: the
group's member names, offsets and element counts, the shard bounds, the fp32 values
(master or parameter) and the optimizer state tensors of the shard; at stage 3 also its
shard of every partitioned group of frozen parameters (values only; left out with
``exclude_frozen_parameters``). Rank 0's shared file keeps the rest (buffers and whole
frozen parameters, optimizer hyperparameters, scheduler, ...).

Loading fills the shards from a checkpoint's by-name form (:mod:`.by_name`), so a ZeRO
checkpoint loads at any stage and world size; one saved with the very same flat groups
(same world size, stage and grouping) is copied shard for shard instead
(:func:`same_layout`, :func:`load_own`). A rank assembles only what it keeps
(:func:`needed`): optimizer state for the parameters its shards cut into, values for those
too at stage 3 (at stages 1-2 every rank holds every value).

The functions take the ZeRO strategy (its ``groups`` of flat parameters and its shard
``stepper``) without importing it: the strategy imports this module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from deepshard.runtime.checkpoint.by_name import ByName, Needed, copy_scalars
from deepshard.runtime.zero.partition import pieces


def needed(zero) -> Needed:
    """What this rank's flat groups keep: state for the parameters its shards cut into;
    values for those in partitioned groups, for every member of a replicated group."""
    values: set[str] = set()
    state: set[str] = set()
    for g in zero.groups:
        mine = _mine(g)
        state |= mine
        values |= mine if g.partitioned else set(g.names)
    for g in zero.frozen_groups:
        values |= _mine(g)
    return Needed(frozenset(values), frozenset(state))


def _mine(g) -> set[str]:
    return {g.names[g.flat.params.index(pc.param)] for pc in pieces(g.flat, g.spec, g.rank)}


def shard_payload(zero, optimizer, exclude_frozen: bool = False) -> list[dict]:
    """This rank's part of a checkpoint: one entry per flat group (frozen ones too unless
    ``exclude_frozen``)."""
    out = []
    for k, g in enumerate(zero.groups):
        t = zero.stepper.step_tensors[k]
        state = optimizer.state.get(t, {}) if optimizer is not None else {}
        out.append(_entry(g, t, state))
    if not exclude_frozen:
        out.extend(_entry(g, g.read_shard(), {}) for g in zero.frozen_groups)
    return out


def _entry(g, values: torch.Tensor, state: dict) -> dict:
    return {
        "names": g.names, "offsets": g.flat.offsets, "numels": g.flat.numels,
        "shapes": [tuple(s) for s in g.shapes], "lo": g.lo, "hi": g.hi,
        "values": values.detach().float().clone(),
        "state": {n: v.clone() for n, v in state.items() if torch.is_tensor(v) and v.dim() > 0},
        "scalars": {n: v for n, v in state.items()
                    if not (torch.is_tensor(v) and v.dim() > 0)},
    }


def owned_names(zero, module: torch.nn.Module) -> set[str]:
    """Every state-dict name (aliases included) of a parameter the flat groups own."""
    ids = {id(p) for g in (*zero.groups, *zero.frozen_groups) for p in g.params}
    return {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}


@torch.no_grad()
def load_into_zero(zero, optimizer, by_name: ByName, load_optimizer: bool) -> list[str]:
    """Fill this rank's shards (values, masters and, if asked, optimizer state) from
    ``by_name``. Returns the names it lacked (left as they were)."""
    missing: list[str] = []
    steps = [*zero.stepper.step_tensors, *[None] * len(zero.frozen_groups)]
    for g, t in zip([*zero.groups, *zero.frozen_groups], steps, strict=True):
        fresh = torch.empty(g.spec.shard, dtype=torch.float32)
        state: dict[str, torch.Tensor] = {}
        # the optimizer's own state tensors are filled in place where they fit: a load
        # then needs no second copy of this rank's optimizer state
        held = optimizer.state.get(t, {}) if load_optimizer and t is not None and \
            optimizer is not None else {}
        found = [n in by_name.present for n in g.names]
        missing.extend(n for n, ok in zip(g.names, found, strict=True) if not ok)
        mine = [(g.names[g.flat.params.index(pc.param)], pc)
                for pc in pieces(g.flat, g.spec, g.rank)]
        # what the pieces do not cover: the padding past the group's end, or everything
        # where a name lacks its value (kept as it was) or its state (zeros)
        real = max(0, min(g.hi, g.flat.numel) - g.lo)  # the shard's elements before padding
        if all(n in by_name.values for n, _ in mine):
            fresh[real:] = 0
        else:
            fresh.copy_(g.read_shard())
        clear = slice(real, None) if all(n in by_name.state for n, _ in mine) else slice(None)
        for name, piece in mine:
            src = slice(piece.param_start, piece.param_start + piece.length)
            dst = slice(piece.shard_start, piece.shard_start + piece.length)
            if name in by_name.values:
                fresh[dst] = by_name.values[name].reshape(-1)[src].float()
            for key, full in by_name.state.get(name, {}).items():
                if key not in state:
                    state[key] = _buffer(held.get(key), g.spec.shard, full.dtype, clear)
                state[key][dst] = full.reshape(-1)[src]
            if by_name.release is not None:
                by_name.release()
        g.write_shard(fresh)
        if t is None:  # frozen: no master, no optimizer state
            continue
        if t is not g.shard and t.numel():
            t.copy_(fresh)
        if not g.partitioned:
            for name, p in zip(g.names, g.params, strict=True):
                if name in by_name.values:
                    p.copy_(by_name.values[name].view_as(p))
                    if by_name.release is not None:
                        by_name.release()
        if load_optimizer and optimizer is not None and state:
            scal = next((by_name.scalars[n] for n in g.names if n in by_name.scalars), {})
            # a fresh step counter per group: fused optimizers increment it in place
            optimizer.state[t] = {**copy_scalars(scal), **state}
    return missing


def _buffer(held: object, size: int, dtype: torch.dtype, clear: slice) -> torch.Tensor:
    """A shard-sized state tensor, zero in ``clear`` (what the checkpoint will not
    fill): ``held`` (the optimizer's own) where it fits."""
    if isinstance(held, torch.Tensor) and held.dim() == 1 and held.numel() == size and \
            held.dtype == dtype and held.device.type == "cpu":
        out = held
    else:
        out = torch.empty(size, dtype=dtype)
    out[clear] = 0
    return out


def same_layout(zero, entries: list[dict]) -> bool:
    """Whether this rank's saved ``entries`` are its own flat groups' shards, member for
    member and bound for bound (a checkpoint of the same world size, stage and groups)."""
    groups = [*zero.groups, *zero.frozen_groups]
    if len(entries) != len(groups):
        return False
    sizes = [*(t.numel() for t in zero.stepper.step_tensors),
             *(g.spec.shard for g in zero.frozen_groups)]
    return all(list(e["names"]) == list(g.names) and list(e["offsets"]) == list(g.flat.offsets)
               and (e["lo"], e["hi"]) == (g.lo, g.hi) and e["values"].numel() == size
               for g, e, size in zip(groups, entries, sizes, strict=True))


@torch.no_grad()
def load_own(zero, optimizer, entries: list[dict], load_optimizer: bool,
             peer_entries: Callable[[int], list[dict]] | None = None,
             release: Callable[[], None] | None = None) -> None:
    """Copy this rank's saved shards (:func:`same_layout` holds on every rank) into its
    flat groups, masters and optimizer state (the optimizer's own state tensors, in
    place, where they fit); replicated groups (stages 1-2) then fill their whole
    parameters with every rank's shard: read from the other ranks' entries
    (``peer_entries(global rank)``, memory-mapped: only their values are touched) where
    given, which is faster than gathering them, else gathered. ``release``: hands back
    the pages of ``entries``' memory-mapped file, called after each group. Collective."""
    steps = [*zero.stepper.step_tensors, *[None] * len(zero.frozen_groups)]
    groups = [*zero.groups, *zero.frozen_groups]
    works = []
    for g, t, e in zip(groups, steps, entries, strict=True):
        g.write_shard(e["values"][:g.spec.shard])
        if t is not None and t is not g.shard and t.numel():
            t.copy_(e["values"])
        if peer_entries is None:
            work = g.all_gather_replicated()
            if work is not None:
                works.append(work)
        if t is not None and load_optimizer and optimizer is not None and e["state"]:
            held = optimizer.state.get(t, {})
            optimizer.state[t] = {**copy_scalars(e["scalars"]),
                                  **{k: _filled(held.get(k), v) for k, v in e["state"].items()}}
        if release is not None:
            release()
    if peer_entries is not None:
        _fill_replicated(groups, peer_entries)
    for work in works:
        work.wait()


def _filled(held: object, saved: torch.Tensor) -> torch.Tensor:
    """``saved`` in the optimizer's own state tensor ``held`` where it fits, else a copy
    of it (``saved`` may be a view of a memory-mapped file)."""
    if isinstance(held, torch.Tensor) and held.shape == saved.shape and \
            held.dtype == saved.dtype:
        return held.copy_(saved)
    return saved.clone(memory_format=torch.contiguous_format)


def _fill_replicated(groups: list, peer_entries: Callable[[int], list[dict]]) -> None:
    """Each replicated group's whole buffer from every rank's saved shard, one rank's
    file at a time (its mapping dropped before the next)."""
    replicated = [k for k, g in enumerate(groups) if not g.partitioned and g.spec.world > 1]
    if not replicated:
        return
    first = groups[replicated[0]]
    for r in range(first.spec.world):
        if r == first.rank:  # its shard is a view of its buffer, written already
            continue
        theirs = peer_entries(dist.get_global_rank(first.pg, r) if first.pg is not None else r)
        for k in replicated:
            g = groups[k]
            lo, hi = g.spec.bounds(r)
            g.full[lo:hi].copy_(theirs[k]["values"][:g.spec.shard])
        del theirs
