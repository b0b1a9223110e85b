"""DeepSpeed's pipeline engine: ``engine.train_batch(data_iter)`` over a ``PipelineModule``.

Each stage executes its 1F1B action list (:func:`.schedule.one_f_one_b`) in order with
blocking point-to-point sends and receives to its neighbours (the order itself rules out
deadlock: on every link an activation goes before the gradient). A micro-batch's
activation crosses a link as a small shape header, then the tensor. After the last
backward: tied weights' gradients are summed over the stages sharing them, gradients are
reduced over the data-parallel group (ZeRO 0 or 1), and the optimizer steps.

The loss is computed on the last stage (``loss_fn(outputs, labels)``), scaled by
``1 / (micro-batches × data-parallel size)`` like any accumulated loss, and the batch's
mean loss is broadcast to every stage, as DeepSpeed returns it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...errors import UsageError, exit_on_usage_error
from ...liveness import heartbeat
from ..engine import DeepShardEngine, EngineParts
from . import schedule as S
from .pipe_module import PipelineModule
from .tied import TiedWeightGroups
from .topology import ProcessGroups

HEADER = 8  # ndim, dtype code, up to six dims
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32)


class PipelineEngine(DeepShardEngine):
    """A :class:`DeepShardEngine` whose module is one stage of a ``PipelineModule``."""

    last_batch_timing: dict[str, float]
    """Seconds of the last ``train_batch``: ``total_s`` (all of it), ``pipe_s`` (the 1F1B
    schedule, before gradient reduction and the step), ``forward_s``/``backward_s`` (this
    stage's compute) and ``busy_s`` (their sum); ``1 - busy_s / pipe_s`` is the stage's
    bubble."""

    def __init__(self, parts: EngineParts, groups: ProcessGroups, tied: TiedWeightGroups):
        super().__init__(parts)
        if not isinstance(parts.module, PipelineModule):
            raise TypeError("PipelineEngine needs a PipelineModule")
        self.grid = self.mpu = groups
        self._tied = tied
        self.stage_id = parts.module.stage_id
        self.num_stages = parts.module.num_stages
        self.last_batch_timing: dict[str, float] = {}

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def forward(self, *inputs, **kwargs):
        raise UsageError("a pipeline engine is driven by engine.train_batch(data_iter)",
                         where="engine(...)", hint="call engine.train_batch(iter(loader))")

    @exit_on_usage_error
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Run one optimizer step over ``gradient_accumulation_steps`` micro-batches drawn
        from ``data_iter`` (``(inputs, labels)`` each; the first stage reads inputs, the
        last labels). Returns the mean loss over the whole batch (every data-parallel
        replica), on every stage."""
        module: PipelineModule = self.module
        if (self.is_first_stage() or self.is_last_stage()) and data_iter is None:
            raise UsageError("train_batch() needs data_iter on the first and last stages",
                             where="engine.train_batch", hint="pass iter(your_loader)")
        if self.is_last_stage() and module.loss_fn is None:
            raise UsageError("the PipelineModule has no loss_fn", where="PipelineModule",
                             hint="build it with loss_fn=<function(outputs, labels)>")
        m = self._config.gradient_accumulation_steps
        started = time.perf_counter()
        fwd = bwd = 0.0
        pipe_s = None
        inputs, outputs, labels = {}, {}, {}
        losses = []
        grad_in: dict[int, torch.Tensor] = {}
        grad_out: dict[int, torch.Tensor] = {}
        prev, nxt = self.grid.prev_stage_rank, self.grid.next_stage_rank
        factor = 1.0 / (m * self.dp_world_size)
        if self.loss_scaler is not None:
            factor *= self.loss_scaler.loss_scale
        grads = self._parts.zero.grads if self._parts.zero is not None else self._parts.buckets
        for action in S.one_f_one_b(self.num_stages, self.stage_id, m):
            mb = getattr(action, "mb", None)
            if isinstance(action, S.LoadMicroBatch):
                batch = next(data_iter) if data_iter is not None else None
                if self.is_first_stage():
                    inputs[mb] = _to(batch[0], self.device)
                if self.is_last_stage():
                    labels[mb] = _to(batch[1], self.device)
            elif isinstance(action, S.RecvActivation):
                inputs[mb] = _recv(prev, self.device).requires_grad_()
            elif isinstance(action, S.Forward):
                t0 = time.perf_counter()
                out = module(inputs[mb])
                if self.is_last_stage():
                    loss = module.loss_fn(out, labels.pop(mb))
                    losses.append(loss.detach().float())
                    out = loss.float() * factor
                outputs[mb] = out
                fwd += time.perf_counter() - t0
            elif isinstance(action, S.SendActivation):
                if not torch.is_tensor(outputs[mb]):
                    raise UsageError("a pipeline stage must pass one tensor to the next",
                                     where=f"PipelineModule stage {self.stage_id}",
                                     hint="return a single tensor from the last layer of "
                                          "each stage")
                _send(outputs[mb].detach(), nxt)
            elif isinstance(action, S.RecvGrad):
                grad_out[mb] = _recv(nxt, self.device)
            elif isinstance(action, S.Backward):
                t0 = time.perf_counter()
                grads.begin_backward(False)
                try:
                    out = outputs.pop(mb)
                    torch.autograd.backward(out, None if self.is_last_stage()
                                            else grad_out.pop(mb))
                finally:
                    grads.end_backward()
                x = inputs.pop(mb)
                if x.requires_grad and not self.is_first_stage():
                    grad_in[mb] = x.grad
                bwd += time.perf_counter() - t0
            elif isinstance(action, S.SendGrad):
                _send(grad_in.pop(mb), prev)
            elif isinstance(action, S.ReduceTiedGrads):
                pipe_s = time.perf_counter() - started
                self._tied.all_reduce_grads(module)
            elif isinstance(action, S.ReduceGrads):
                grads.reduce_all()
            elif isinstance(action, S.OptimizerStep):
                self.counters.micro_steps += m - 1
                self.step()
        mean = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        if self.is_last_stage() and self.dp_world_size > 1:  # the batch's mean, as DeepSpeed
            dist.all_reduce(mean, group=self._parts.group)
            mean /= self.dp_world_size
        if self.num_stages > 1:
            src = self.grid.topology.stage_rank(dist.get_rank(), self.num_stages - 1)
            dist.broadcast(mean, src=src, group=self.grid.pipe_group)
        self.last_batch_timing = {
            "total_s": time.perf_counter() - started, "pipe_s": pipe_s or 0.0,
            "busy_s": fwd + bwd, "forward_s": fwd, "backward_s": bwd}
        heartbeat(self.counters.global_steps)
        return mean

    def is_gradient_accumulation_boundary(self) -> bool:
        """In a pipeline every ``train_batch`` ends at a boundary (its last call to step)."""
        return True


def _to(x, device):
    return x.to(device) if torch.is_tensor(x) else x


def _send(t: torch.Tensor, dst: int) -> None:
    t = t.contiguous()
    if t.dim() > HEADER - 2 or t.dtype not in DTYPES:
        raise UsageError(f"cannot pass a {t.dim()}-d {t.dtype} tensor between stages",
                         where="PipelineModule", hint=f"pass at most {HEADER - 2}-d tensors of "
                                                      "a float or int dtype")
    header = torch.zeros(HEADER, dtype=torch.int64, device=t.device)
    header[0], header[1] = t.dim(), DTYPES.index(t.dtype)
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, dst)
    dist.send(t, dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    ndim, code = int(header[0]), int(header[1])
    t = torch.empty(tuple(int(d) for d in header[2:2 + ndim]), dtype=DTYPES[code],
                    device=device)
    dist.recv(t, src)
    return t
