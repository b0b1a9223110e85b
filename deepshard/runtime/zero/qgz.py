"""ZeRO++ qgZ: gradients reduced into their shards through two quantized all-to-alls, inside
the node first, then across nodes, in place of a reduce-scatter (or gloo's all-reduce).

The data-parallel group of ``W = L x N`` ranks is ``N`` nodes of ``L`` consecutive ranks.
Rank ``n L + i`` owns chunk ``n L + i`` (``s`` elements) of every flat buffer. Step 1: each
rank sends local peer ``i`` the ``N`` chunks owned by ranks with local index ``i``, as int8
blocks, and sums what its ``L`` peers sent: the node's partial sums of the chunks of its
own local index. Step 2: among the ranks with that local index (one per node), each sends
node ``n`` its partial sum of chunk ``n L + i``, again int8, and sums the ``N`` received:
its own chunk, summed over every rank. Across nodes a rank sends ``(N - 1) s`` bytes (and
4 bytes per 256 elements of scales) where gloo's all-reduce sends ``~8 (W - 1) s`` and a
reduce-scatter ``4 (W - 1) s``. Each quantization errs by at most half a step of its block
(:mod:`.quantize`), so a reduced element errs by at most ``L`` half-steps of the first
level's blocks plus ``N`` of the second's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.runtime.zero.quantize import dequantize, pack, packed_bytes, quantize, unpack
from deepshard.runtime.zero.subgroups import SubGroup

QGZ_BLOCK = 256


@dataclass(frozen=True)
class QuantizedReduce:
    """The two levels of one rank: its node (``local``) and its peers with the same local
    index on the other nodes (``cross``); either may be ``None`` (one node, or one rank
    per node)."""

    local: SubGroup | None
    cross: SubGroup | None
    block: int = QGZ_BLOCK

    @property
    def nodes(self) -> int:
        return self.cross.size if self.cross is not None else 1

    @property
    def per_node(self) -> int:
        return self.local.size if self.local is not None else 1


def _exchange(parts: torch.Tensor, group: SubGroup, block: int) -> torch.Tensor:
    """``parts`` (``group.size x m``): part ``j`` to group rank ``j`` as int8 blocks; the
    sum, in fp32, of the ``m`` elements every rank sent this one."""
    m = parts.shape[1]
    each = packed_bytes(m, block)
    send = torch.empty(group.size * each, dtype=torch.uint8, device=parts.device)
    for j in range(group.size):
        values, scales = quantize(parts[j], block)
        send[j * each:(j + 1) * each].copy_(pack(values, scales))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.pg)
    total = torch.zeros(m, dtype=torch.float32, device=parts.device)
    for j in range(group.size):
        values, scales = unpack(recv[j * each:(j + 1) * each], m, block)
        total += dequantize(values, scales, m)
    return total


def quantized_reduce_into_shard(buf: torch.Tensor, lo: int, hi: int,
                                plan: QuantizedReduce) -> None:
    """Sum ``buf`` (every rank's, ``W`` chunks) into ``buf[lo:hi]``, this rank's chunk;
    the rest of ``buf`` is left undefined. Collective over both levels, synchronous."""
    s = hi - lo
    n_nodes, per_node = plan.nodes, plan.per_node
    chunks = buf.view(n_nodes, per_node, s).float()
    if plan.local is not None:
        # part i: the chunks owned by local index i on every node
        partial = _exchange(chunks.transpose(0, 1).reshape(per_node, n_nodes * s),
                            plan.local, plan.block).view(n_nodes, s)
    else:
        partial = chunks[:, 0, :]
    mine = _exchange(partial, plan.cross, plan.block) if plan.cross is not None \
        else partial[0]
    buf[lo:hi].copy_(mine)
