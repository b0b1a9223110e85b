"""Point-to-point ops with DeepSpeed's signatures: send/recv, isend/irecv and batches.

``P2POp(isend | irecv, tensor, peer)`` names this module's ``isend``/``irecv`` as DeepSpeed
does (torch's own functions are accepted too); :func:`batch_isend_irecv` turns them into
torch's ``P2POp`` list and returns torch's requests.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from deepshard.comm.timed import timed_op


@timed_op
def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return dist.send(tensor, dst, group=group, tag=tag)


@timed_op
def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return dist.recv(tensor, src, group=group, tag=tag)


@timed_op
def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return dist.isend(tensor, dst, group=group, tag=tag)


@timed_op
def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return dist.irecv(tensor, src, group=group, tag=tag)


class P2POp:
    """One point-to-point op of a :func:`batch_isend_irecv` batch.

    Args:
        op: :func:`isend` or :func:`irecv` (or torch's).
        tensor: what to send, or where to receive.
        peer: the other rank (a world rank).
    """

    def __init__(self, op: Any, tensor: Any, peer: int, group: Any = None, tag: int = 0):
        if op in (isend, dist.isend):
            self.op = "isend"
        elif op in (irecv, dist.irecv):
            self.op = "irecv"
        else:
            raise ValueError(f"P2POp: op must be deepshard.comm.isend or irecv, got {op!r}")
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag

    def to_torch(self) -> dist.P2POp:
        return dist.P2POp(getattr(dist, self.op), self.tensor, self.peer, self.group, self.tag)


@timed_op
def batch_isend_irecv(p2p_op_list, prof=False, log_name="batch_isend_irecv", debug=None):
    """Start every op of ``p2p_op_list`` (this module's or torch's ``P2POp``); returns
    their requests."""
    ops = [op.to_torch() if isinstance(op, P2POp) else op for op in p2p_op_list]
    return dist.batch_isend_irecv(ops)
