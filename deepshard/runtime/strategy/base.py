"""The data-parallel strategy interface: what the engine calls, whatever the ZeRO stage.

The engine sequences a training step (scale the loss, run autograd, unscale, check for
overflow, clip, step, zero) and a checkpoint (collect, write, commit); *how* gradients are
reduced, where the fp32 masters and optimizer state live and what a rank writes of them is
the strategy's. Stage 0 (bucketed all-reduce, :mod:`.stage0`) and ZeRO stages 1-3
(:class:`deepshard.runtime.zero.runtime.ZeroStrategy`) implement it; a new way of
data-parallel training (expert groups, compressed gradients) is a new subclass, not a new
branch in the engine.

Every method is called on every rank of the data-parallel group, in the same order:
collectives inside them match across ranks.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from deepshard.runtime.precision import global_norm

if TYPE_CHECKING:
    from deepshard.runtime.checkpoint.by_name import Needed


class DataParallelStrategy(ABC):
    """One rank's share of data-parallel training.

    Attributes:
        stage: the ``zero_optimization.stage`` it implements (0-3).
        params: the trainable parameters it manages, in registration order.
        names: their names in the module.
        group: the data-parallel process group (``None``: the default group).
        world: its size.
        optimizer_groups: the names of the parameters of each of the user's optimizer
            param groups, in the user's order, frozen ones included (what a stage 0
            DeepSpeed checkpoint's optimizer positions refer to); ``None`` where not
            known.
    """

    stage: int
    params: tuple[torch.nn.Parameter, ...]
    names: tuple[str, ...]
    group: dist.ProcessGroup | None
    world: int
    optimizer_groups: tuple[tuple[str, ...], ...] | None = None

    @property
    def partitions_params(self) -> bool:
        """Parameters are sharded between steps (stage 3): whole only when gathered."""
        return False

    def gathered_units(self) -> list[torch.nn.Module] | None:
        """The modules whose parameters are gathered around their own call (stage 3's
        units, the root first), or None when no parameter is gathered in the forward:
        what ``engine.compile()`` compiles one by one (:mod:`deepshard.runtime.compiled`)."""
        return None

    # -- backward ---------------------------------------------------------------------
    @abstractmethod
    def begin_backward(self, boundary: bool) -> None:
        """Before autograd runs; ``boundary``: this backward's gradients are reduced."""

    def begin_passive(self) -> None:
        """Before gradients from another engine's ``engine.backward`` (which reached these
        parameters through this engine's raw module): they accumulate, and are reduced by
        the next synchronising backward or by the step."""
        self.begin_backward(False)

    @abstractmethod
    def end_backward(self, boundary: bool) -> None:
        """After autograd returned: at a boundary the reduced gradients are final now."""

    @abstractmethod
    def abort_backward(self) -> None:
        """Autograd raised: drop what is half done and launch nothing more."""

    @abstractmethod
    def reduce_now(self) -> None:
        """Reduce the gradients of backwards that did not synchronise, and wait (the
        pipeline engine, once its last micro-batch's backward and tied sums are done)."""

    # -- the step ---------------------------------------------------------------------
    @abstractmethod
    def unscaled_grads(self, inv_scale: float) -> list[torch.Tensor]:
        """The gradients the optimizer will step with, the loss scale undone
        (``× inv_scale``); clipping scales them in place. Gradients still unreduced (a
        backward since the last reduction that did not synchronise) are reduced first."""

    @abstractmethod
    def apply_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` over :meth:`unscaled_grads` and bring the model up to date."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Zero every gradient (in place: they live in communication buffers)."""

    @abstractmethod
    def excluded_grads(self, grads: Sequence[torch.Tensor],
                       excluded: frozenset[int]) -> list[torch.Tensor]:
        """The parts of ``grads`` belonging to parameters whose ``id`` is in ``excluded``
        (replicas another model-parallel rank counts in the norm)."""

    def sum_over_data_parallel_(self, square_norm: torch.Tensor) -> None:
        """Make this rank's squared gradient norm the group's, in place (a strategy whose
        ranks hold different gradient shards sums them; stage 0's are all the same)."""
        del square_norm

    def gradient_norm(self, grads: Sequence[torch.Tensor], excluded: frozenset[int],
                      mp_group: dist.ProcessGroup | None) -> torch.Tensor:
        """The global L2 norm of ``grads``, the same on every rank of the job: summed over
        the data-parallel group's shards and the model-parallel group's parts, with the
        replicas in ``excluded`` counted once."""
        sq = global_norm(grads).square()
        parts = self.excluded_grads(grads, excluded) if excluded else []
        if parts:
            sq = sq - global_norm(parts).square()
        self.sum_over_data_parallel_(sq)
        if mp_group is not None:
            dist.all_reduce(sq, group=mp_group)
        return sq.clamp_min(0).sqrt()

    # -- accounting and lifetime -------------------------------------------------------
    @abstractmethod
    def state_bytes(self, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes of model states this rank holds between steps: ``params``, ``grads``,
        ``optimizer`` (state plus fp32 masters and their gradients), ``nvme``."""

    @abstractmethod
    def close(self) -> None:
        """Release hooks and files (the engine is being torn down)."""

    # -- checkpoints ------------------------------------------------------------------
    @property
    @abstractmethod
    def master_dtype(self) -> str | None:
        """``"torch.float32"`` when the optimizer steps fp32 masters of the parameters."""

    @contextlib.contextmanager
    def materialized(self, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
        """Optimizer state in memory for the block (NVMe offload swaps it in and out)."""
        del optimizer
        yield

    @abstractmethod
    def owned_names(self, module: torch.nn.Module) -> set[str]:
        """State-dict names (aliases included) whose values :meth:`rank_payload` writes,
        so the module file leaves them out."""

    def entry_names(self) -> set[str]:
        """Names this strategy's checkpoint entries may hold beyond the module's
        state-dict names (MoE experts under their global ids): a load does not count them
        as unexpected."""
        return set()

    @abstractmethod
    def masters_by_name(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """fp32 masters kept in the shared file, by every name of their parameter."""

    @abstractmethod
    def optimizer_state(self, optimizer: torch.optim.Optimizer | None) -> dict | None:
        """What the shared file keeps of the optimizer (hyperparameters at least)."""

    @abstractmethod
    def optimizer_names(self, optimizer: torch.optim.Optimizer | None) -> list[str] | None:
        """The parameter name of every position in :meth:`optimizer_state`'s ``state``."""

    @abstractmethod
    def rank_payload(self, optimizer: torch.optim.Optimizer | None,
                     exclude_frozen: bool = False) -> list[dict] | None:
        """What this rank alone writes (its shards), or ``None``; ``exclude_frozen``:
        without frozen parameters."""

    def own_state(self, optimizer: torch.optim.Optimizer | None) -> object | None:
        """What only this rank has besides its shards (the 1-bit optimizers' compression
        errors), for its own checkpoint file; ``None``: nothing."""
        del optimizer
        return None

    def restore_own(self, optimizer: torch.optim.Optimizer | None, payload: object | None,
                    saved_world: int) -> None:
        """Take back what :meth:`own_state` wrote for this rank (``None``: no such file,
        or it held nothing) in a checkpoint saved by ``saved_world`` data-parallel ranks
        (called after :meth:`restore`)."""
        del optimizer, payload, saved_world

    def needed(self) -> Needed | None:
        """Which names this rank takes from a checkpoint
        (:class:`deepshard.runtime.checkpoint.by_name.Needed`); ``None``: all."""
        return None

    @abstractmethod
    def restore(self, optimizer: torch.optim.Optimizer | None, by_name,
                load_optimizer: bool, saved_groups: list[dict]) -> set[str]:
        """Load this strategy's values (masters, shards) and, if asked, optimizer state
        and hyperparameters from a checkpoint's by-name form; returns the names of
        :meth:`owned_names` it lacked."""

    def same_layout(self, entries: list[dict]) -> bool:
        """Whether this rank's entries of a checkpoint are its own shards as they are now
        (then :meth:`restore_same_layout` can copy them); ``False`` by default."""
        del entries
        return False

    def restore_same_layout(self, optimizer: torch.optim.Optimizer | None,
                            entries: list[dict], load_optimizer: bool,
                            saved_groups: list[dict],
                            peer_entries: Callable[[int], list[dict]] | None = None,
                            release: Callable[[], None] | None = None) -> None:
        """Copy this rank's entries into its shards (when :meth:`same_layout` held on
        every rank); ``peer_entries(rank)``: another rank's entries (memory-mapped), from
        which replicated parameters may be filled instead of gathered; ``release``: hands
        back the pages of the entries' memory-mapped file (:mod:`~deepshard.runtime.
        checkpoint.mapped`). Collective."""
        raise NotImplementedError(type(self).__name__)

    def gather_groups(self) -> list[list[torch.nn.Parameter]]:
        """Parameter lists to gather one at a time for a whole-model save (stage 3)."""
        return []
