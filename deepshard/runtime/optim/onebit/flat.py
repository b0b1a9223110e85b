"""What the flat-buffer 1-bit optimizers share: the flat layout of the parameters, DeepSpeed's
momentum masks, the per-rank error buffers and the common argument checks (0/1 Adam and
1-bit LAMB), and DeepSpeed's rule for masks on load (1-bit Adam too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: DeepSpeed's engine runs one zero-gradient ``step()`` (its "initialization step", which
#: only allocates buffers) before training, and that step advances every 1-bit optimizer's
#: step counter. Its schedules are written against that counter, so here the k-th update is
#: scheduled as DeepSpeed's counter value ``k + DEEPSPEED_INIT_STEPS``; ``state["step"]``
#: itself counts real updates.
DEEPSPEED_INIT_STEPS = 1


class FlatParams:
    """The trainable (``requires_grad``, non-empty) parameters of some param groups laid end
    to end, group after group, in fp32 buffers of ``padded`` elements (``numel`` used, the
    rest padding); the others are left alone."""

    def __init__(self, param_groups: list[dict[str, Any]], padded_numel: Callable[[int], int]):
        self.entries: list[tuple[int, torch.Tensor, int]] = []  # (group index, param, offset)
        self.group_ranges: list[tuple[int, int]] = []
        offset = 0
        for index, group in enumerate(param_groups):
            start = offset
            for p in group["params"]:
                if p.requires_grad and p.numel() > 0:  # DeepSpeed's LAMB drops empty ones too
                    self.entries.append((index, p, offset))
                    offset += p.numel()
            self.group_ranges.append((start, offset))
        if not self.entries:
            raise ValueError("a 1-bit optimizer needs at least one parameter that requires "
                             "grad; HINT: pass the model's trainable parameters")
        self.numel = offset
        self.padded = padded_numel(offset)
        self.device = self.entries[0][1].device

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.padded, dtype=torch.float32, device=self.device)

    def view(self, flat: torch.Tensor, entry: int) -> torch.Tensor:
        """``flat``'s slice for entry ``entry``, shaped like its parameter."""
        _, p, offset = self.entries[entry]
        return flat[offset:offset + p.numel()].view(p.shape)

    def group_slice(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        start, end = self.group_ranges[index]
        return flat[start:end]

    def in_group(self, index: int) -> list[int]:
        return [i for i, (g, _, _) in enumerate(self.entries) if g == index]

    def gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        """Copy every parameter's gradient into ``out`` (a missing gradient counts as zeros,
        so that all ranks send the same layout); the padding is zeroed."""
        out.zero_()
        for i, (_, p, _) in enumerate(self.entries):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError("1-bit optimizers do not support sparse gradients")
                self.view(out, i).copy_(p.grad)
        return out

    def attach(self, states: list[dict[str, Any]], key: str, flat: torch.Tensor) -> None:
        """Make ``states[i][key]`` a view of ``flat``, copying in what it held before."""
        for i, state in enumerate(states):
            view = self.view(flat, i)
            if key in state:
                view.copy_(state[key])
            state[key] = view


def apply_masks(flat: FlatParams, buffer: torch.Tensor, param_groups: list[dict]) -> None:
    """Multiply each parameter's slice of ``buffer`` by its group's ``exp_avg_mask`` (a tensor
    broadcastable to every parameter of the group), as DeepSpeed does to the momentum."""
    for index, group in enumerate(param_groups):
        if "exp_avg_mask" not in group:
            continue
        if group["exp_avg_mask"].device != buffer.device:
            group["exp_avg_mask"] = group["exp_avg_mask"].to(device=buffer.device)
        for i in flat.in_group(index):
            flat.view(buffer, i).mul_(group["exp_avg_mask"])


def keep_current_masks(param_groups: list[dict], state_dict: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's rule on load: the masks the script gave win over the checkpoint's (a
    shallow copy of ``state_dict``; a group count that differs is left for torch to refuse)."""
    saved_groups = [dict(saved) for saved in state_dict["param_groups"]]
    for group, saved in zip(param_groups, saved_groups, strict=False):
        if "exp_avg_mask" in group:
            saved["exp_avg_mask"] = group["exp_avg_mask"]
        else:
            saved.pop("exp_avg_mask", None)
    return {**state_dict, "param_groups": saved_groups}


def ring_allreduce_bytes(numel: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` fp32 elements."""
    return 0 if world <= 1 else 2 * (world - 1) * numel * 4 // world


def check_common(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 amsgrad: bool, name: str) -> None:
    if amsgrad:
        raise ValueError(f"{name} does not support the AMSGrad variant. HINT: set amsgrad "
                         "to false (or leave it out)")
    if lr < 0:
        raise ValueError(f"{name}: lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {betas}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"{name}: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")


def restore_errors(local: dict[str, torch.Tensor], errors: dict[str, torch.Tensor] | None
                   ) -> None:
    """Copy ``errors`` (an ``error_state()`` of the same layout) into the per-rank buffers
    ``local``; None, or a missing or mismatched entry, zeroes them all."""
    ok = errors is not None and set(errors) == set(local) and all(
        errors[k].shape == v.shape for k, v in local.items())
    for key, buffer in local.items():
        if ok and errors is not None:
            buffer.copy_(errors[key])
        else:
            buffer.zero_()
