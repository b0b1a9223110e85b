"""What the launcher and the runtime agree on, and nothing else.

This is the only module both sides import. It names the environment variables a worker
receives and defines the line protocol an agent speaks to the coordinator on its channel
(the stdout of a local pipe, an SSH session or an srun step). It must stay torch-free.

Agent → coordinator, one line each, UTF-8:

* ``o <rank> <text>``: a line the worker ``rank`` printed (stdout and stderr merged);
* ``e <json>``: an :class:`Event`, a JSON object with at least ``"kind"``.

Coordinator → agent: the first line on the agent's stdin is its node plan as JSON
(so that no value ever passes through a shell or shows in ``ps``); each later newline
renews the agent's lease; closing stdin (EOF) tells the agent to stop its workers and exit.
Through pdsh, which forwards no stdin, the plans come on the command line instead:
``--plans-b64 <token> --host <name>`` (:func:`encode_node_plans`).
"""

from __future__ import annotations

import base64
import json

# --- the environment contract every worker receives ---------------------------------------
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
NODE_RANK = "NODE_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
OMP_NUM_THREADS = "OMP_NUM_THREADS"

RUN_ID = "DEEPSHARD_RUN_ID"
"""Identifies one ``ds-run`` invocation; the same across restarts of the job."""
RESTART_COUNT = "DEEPSHARD_RESTART_COUNT"
"""How many times the job was relaunched (0 on the first attempt)."""
HEARTBEAT_FILE = "DEEPSHARD_HEARTBEAT_FILE"
"""Where :func:`deepshard.heartbeat` marks this worker alive (set by the agent)."""

# --- agent events ---------------------------------------------------------------------------
EV_STARTED = "started"
"""All workers of a node are running: ``pids`` maps rank -> pid."""
EV_EXITED = "exited"
"""A worker ended: ``rank``, ``returncode`` (negative = killed by that signal)."""
EV_ERROR = "error"
"""The agent could not do its job (a worker failed to start): ``message``."""
EV_DONE = "done"
"""The agent has stopped every worker and is about to exit: ``state`` (``succeeded``,
``failed``, ``stopped``) and, when stopped, ``reason``."""
EV_ALIVE = "alive"
"""Sent every :data:`ALIVE_INTERVAL` seconds: the agent and its channel work. ``workers``
maps rank -> {``rss`` bytes, ``cpu`` percent, ``step``, ``beat_age`` seconds or null};
``gpus`` lists {``index``, ``mem_used``, ``mem_total`` bytes, ``util`` percent} (NVML)."""
EV_HUNG = "hung"
"""Workers stopped heartbeating: ``rank`` (silent longest) for ``silent`` seconds, and all
hung ``ranks`` of the node, whose stacks were dumped."""

ALIVE_INTERVAL = 1.0
"""Seconds between ``alive`` events, and between the coordinator's pings (a newline on the
agent's stdin, which renews the agent's lease)."""


class Event:
    """One event from an agent: its ``kind`` (one of the ``EV_*`` names) and its fields."""

    __slots__ = ("fields", "kind")

    def __init__(self, kind: str, fields: dict[str, object] | None = None):
        self.kind = kind
        self.fields = fields or {}

    def get(self, key: str, default: object = None) -> object:
        return self.fields.get(key, default)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Event) and (self.kind, self.fields) == (other.kind,
                                                                        other.fields)

    def __repr__(self) -> str:
        return f"Event({self.kind!r}, {self.fields!r})"


class Output:
    """One line of a worker's output, without its newline."""

    __slots__ = ("rank", "text")

    def __init__(self, rank: int, text: str):
        self.rank = rank
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Output) and (self.rank, self.text) == (other.rank, other.text)

    def __repr__(self) -> str:
        return f"Output({self.rank!r}, {self.text!r})"


def encode_event(kind: str, **fields: object) -> str:
    """The protocol line (with newline) for an event."""
    return "e " + json.dumps({"kind": kind, **fields}, separators=(",", ":")) + "\n"


def encode_output(rank: int, text: str) -> str:
    """The protocol line (with newline) for one line of worker output."""
    return f"o {rank} {text}\n"


def decode_line(line: str) -> Event | Output | None:
    """Parse one protocol line; ``None`` for a line that is neither (e.g. a stray print)."""
    line = line.rstrip("\n")
    if line.startswith("o "):
        rank, _, text = line[2:].partition(" ")
        if rank.isascii() and rank.isdigit():
            return Output(int(rank), text)
    elif line.startswith("e "):
        try:
            data = json.loads(line[2:])
        except (ValueError, RecursionError):
            return None
        if isinstance(data, dict) and isinstance(data.get("kind"), str):
            kind = data.pop("kind")
            return Event(kind, data)
    return None


PLANS_FLAG = "--plans-b64"
HOST_FLAG = "--host"


def encode_node_plans(plans: dict[str, str]) -> str:
    """Node plans (host -> plan JSON) as one shell-safe token for a command line."""
    data = {host: json.loads(text) for host, text in plans.items()}
    raw = json.dumps(data, separators=(",", ":")).encode("utf-8", "surrogateescape")
    return base64.b64encode(raw).decode("ascii")


def decode_node_plan(token: str, host: str) -> str:
    """The plan JSON of ``host`` from an :func:`encode_node_plans` token."""
    data = json.loads(base64.b64decode(token).decode("utf-8", "surrogateescape"))
    return json.dumps(data[host])
