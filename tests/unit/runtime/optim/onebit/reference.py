"""DeepSpeed ``OnebitAdam``'s update for ``world`` simulated ranks in one process, in plain
torch: one tensor and one formula at a time, the compressed all-reduce by ``simulate``.

Per parameter, with ``g`` the average gradient (warm-up) or rank ``r``'s own (compressed):
``m = b1 m + (1 - b1) g``; warm-up also ``v = b2 v + (1 - b2) g^2`` (frozen afterwards);
compressed: the ranks' momenta, each flattened into one zero-padded buffer, go through the
compressed all-reduce, then ``m *= mask``; ``u = m / (sqrt(v) + eps) (+ wd p)``,
``p -= lr u``. No bias correction, eps outside the square root (DeepSpeed's OnebitAdam).
"""

from __future__ import annotations

import torch

from deepshard.runtime.optim.onebit.compressed import padded_numel, simulate


class ReferenceOneBitAdam:
    """``params[r]`` is rank ``r``'s list of parameters (updated in place)."""

    def __init__(self, params: list[list[torch.Tensor]], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, freeze_step=10, masks=None, feedback=True):
        self.params, self.world = params, len(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.freeze_step, self.masks, self.feedback = freeze_step, masks, feedback
        self.m = [[torch.zeros_like(p, dtype=torch.float32) for p in ps] for ps in params]
        self.v = [torch.zeros_like(p, dtype=torch.float32) for p in params[0]]
        self.t = 0
        n = sum(p.numel() for p in params[0])
        self.padded = padded_numel(n, self.world)
        self.workers = [torch.zeros(self.padded) for _ in range(self.world)]
        self.servers = [torch.zeros(self.padded // self.world) for _ in range(self.world)]

    @torch.no_grad()
    def step(self, grads: list[list[torch.Tensor]]) -> None:
        """``grads[r]``: rank ``r``'s local gradients (averaged here during warm-up)."""
        b1, b2 = self.betas
        if self.t < self.freeze_step:
            for i, v in enumerate(self.v):
                g = sum(grads[r][i] for r in range(self.world)) / self.world
                for r in range(self.world):
                    self.m[r][i].mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
        else:
            for r in range(self.world):
                for m, g in zip(self.m[r], grads[r], strict=True):
                    m.mul_(b1).add_(g, alpha=1 - b1)
            if self.world > 1:
                self._allreduce()
            if self.masks is not None:
                for r in range(self.world):
                    for m, mask in zip(self.m[r], self.masks, strict=True):
                        if mask is not None:
                            m.mul_(mask)
        self.t += 1
        for r in range(self.world):
            for p, m, v in zip(self.params[r], self.m[r], self.v, strict=True):
                u = m / (v.sqrt() + self.eps)
                if self.wd > 0:
                    u += self.wd * p
                p.add_(u.to(p.dtype), alpha=-self.lr)

    def _allreduce(self) -> None:
        flats = []
        for ms in self.m:
            flat = torch.zeros(self.padded)
            torch.cat([m.reshape(-1) for m in ms], out=flat[:sum(m.numel() for m in ms)])
            flats.append(flat)
        if not self.feedback:
            for e in (*self.workers, *self.servers):
                e.zero_()
        simulate(flats, self.workers, self.servers)
        for ms, flat in zip(self.m, flats, strict=True):
            offset = 0
            for m in ms:
                m.copy_(flat[offset:offset + m.numel()].view(m.shape))
                offset += m.numel()
