"""``--dry_run``: the LaunchPlan as a table, with secret-looking values masked."""

from __future__ import annotations

import re
import shlex
from typing import TextIO

from deepshard.contract import SHIM_DIR
from deepshard.launcher.plan import LaunchPlan

_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
MASK = "****"


def is_secret(name: str) -> bool:
    """Whether a variable's value must not be printed (``*TOKEN*``, ``*KEY*``, ...)."""
    return bool(_SECRET.search(name))


def shown_env(env: tuple[tuple[str, str], ...]) -> list[str]:
    """``KEY=value`` strings for display, secrets masked, values quoted like a shell would."""
    return [f"{k}={MASK if is_secret(k) else shlex.quote(v)}" for k, v in env]


def render_plan(plan: LaunchPlan, stream: TextIO,
                commands: dict[str, list[str]] | None = None) -> None:
    """Print the plan: one row per worker, then each node's environment and, when given,
    the command that starts its agent (e.g. the srun line)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=stream, soft_wrap=False, width=max(100, Console().width))
    # markup=False everywhere: addresses, paths and values are data, not rich markup
    console.print(f"run {plan.run_id}: {plan.world_size} worker(s) on {len(plan.nodes)} "
                  f"node(s), rendezvous {plan.master_addr}:{plan.master_port}",
                  markup=False, highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    table = Table(show_lines=False)
    for column in ("host", "node", "rank", "local", "devices", "command", "env"):
        table.add_column(column, overflow="fold")
    for node in plan.nodes:
        devices = dict(node.env).get("CUDA_VISIBLE_DEVICES", "")
        for w in node.workers:
            cells = (node.host, str(node.node_rank), str(w.rank), str(w.local_rank), devices,
                     shlex.join(w.argv), " ".join(shown_env(w.env)))
            table.add_row(*(Text(c) for c in cells))
    console.print(table)
    for node in plan.nodes:
        where = "this machine" if node.local else "remote"
        if commands and node.host in commands:
            console.print(f"agent on {node.host}: {shlex.join(commands[node.host])}",
                          highlight=False, markup=False, soft_wrap=True)
        console.print(f"env on {node.host} ({where}, cwd {node.cwd}):", highlight=False,
                      markup=False)
        for item in shown_env(node.env):
            console.print(f"  {item}", highlight=False, markup=False)
        if node.deepspeed_compat:
            shim = SHIM_DIR if node.local else "<deepshard/compat/shim on that host>"
            console.print(f"  PYTHONPATH={shim}:<its PYTHONPATH> (--deepspeed_compat: "
                          "`import deepspeed` is deepshard; set by its agent)",
                          highlight=False, markup=False, soft_wrap=True)
        if "OMP_NUM_THREADS" not in dict(node.env):
            console.print(f"  OMP_NUM_THREADS=<the host's cores / {len(node.workers)}, "
                          "set by its agent unless its environment has one>",
                          highlight=False, markup=False)
