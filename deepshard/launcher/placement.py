"""Placement: which slots of which hosts run which ranks.

Pure functions over :class:`~.resources.Resources`. Ranks are assigned host-major in host
order; a worker's local rank is its position among the host's selected slots, and the host's
selected slot ids become its ``CUDA_VISIBLE_DEVICES`` (as DeepSpeed does).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepshard.errors import UsageError
from deepshard.launcher.resources import Host, Resources
from deepshard.launcher.selectors import exclude, include, parse_selector


@dataclass(frozen=True)
class NodePlacement:
    """One node of the job: its host, node rank, selected slots and first global rank."""

    host: str
    node_rank: int
    slots: tuple[int, ...]
    first_rank: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + len(self.slots))


@dataclass(frozen=True)
class Placement:
    """All nodes of the job, in node-rank order."""

    nodes: tuple[NodePlacement, ...]

    @property
    def world_size(self) -> int:
        return sum(len(n.slots) for n in self.nodes)


def select(
    resources: Resources,
    *,
    include_text: str | None = None,
    exclude_text: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> Resources:
    """Narrow ``resources`` by the user's selectors and counts, as DeepSpeed's runner does.

    ``num_nodes`` keeps the first N hosts, ``num_gpus`` the first N slots of each; neither
    combines with a selector (DeepSpeed refuses that too).
    """
    if include_text is not None and exclude_text is not None:
        raise UsageError("--include and --exclude cannot be used together",
                         hint="use one of them")
    selector = "--include" if include_text is not None else "--exclude"
    if (include_text is not None or exclude_text is not None) and (
        num_nodes is not None or num_gpus is not None
    ):
        raise UsageError(f"{selector} cannot be combined with --num_nodes/--num_gpus",
                         hint=f"list the hosts and slots you want in {selector} alone")
    if include_text is not None:
        return include(resources, parse_selector(include_text, "--include"), "--include")
    if exclude_text is not None:
        return exclude(resources, parse_selector(exclude_text, "--exclude"), "--exclude")
    hosts = resources.hosts
    if num_nodes is not None:
        if num_nodes > len(hosts):
            raise UsageError(f"asked for {num_nodes} nodes but {resources.origin} has "
                             f"{len(hosts)}", where="--num_nodes",
                             hint=f"use --num_nodes {len(hosts)} or fewer")
        hosts = hosts[:num_nodes]
    if num_gpus is not None:
        short = next((h for h in hosts if len(h.slots) < num_gpus), None)
        if short is not None:
            raise UsageError(f"asked for {num_gpus} slots per node but {short.name} has "
                             f"{len(short.slots)} ({short.where})", where="--num_gpus",
                             hint=f"use --num_gpus {len(short.slots)} or fewer, "
                                  "or exclude that host")
        hosts = tuple(Host(h.name, h.slots[:num_gpus], h.where) for h in hosts)
    return Resources(hosts, resources.origin)


def place(resources: Resources) -> Placement:
    """Assign global ranks host-major over the (already selected) resources."""
    nodes = []
    rank = 0
    for node_rank, host in enumerate(resources.hosts):
        nodes.append(NodePlacement(host.name, node_rank, host.slots, rank))
        rank += len(host.slots)
    return Placement(tuple(nodes))
