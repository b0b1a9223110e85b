"""What the launcher and the runtime agree on, and nothing else.

This is the only module both sides import. It names the environment variables a worker
receives and defines the line protocol an agent speaks to the coordinator on its channel
(the stdout of a local pipe, an SSH session or an srun step). It must stay torch-free.

Agent → coordinator, one line each, UTF-8:

* ``o <rank> <text>``: a line the worker ``rank`` printed (stdout and stderr merged);
* ``e <json>``: an event, a JSON object with at least ``"kind"`` (one of the ``EV_*``
  names); :func:`format_event` writes and :func:`decode_line` reads the typed events
  (:class:`Started`, :class:`Exited`, :class:`AgentError`, :class:`Done`, :class:`Alive`,
  :class:`Hung`).

Coordinator → agent: the first line on the agent's stdin is its node plan as JSON
(so that no value ever passes through a shell or shows in ``ps``); each later newline
renews the agent's lease; closing stdin (EOF) tells the agent to stop its workers and exit.
Through pdsh, which forwards no stdin, the plans come on the command line instead:
``--plans-b64 <token> --host <name>`` (:func:`encode_node_plans`).
"""

from __future__ import annotations

import base64
import json
import os

DEEPSHARD_VERSION = "0.1.0"
"""deepshard's own version (``deepshard.__version__`` outside the DeepSpeed compat path, where
``deepspeed.__version__``, the same attribute, reads ``0.19.8+deepshard.<this>``)."""

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release deepshard matches: the version the ``deepspeed`` distribution it
presents carries, and the ``ds_version`` of the DeepSpeed-layout files it writes."""

COMPAT_SUMMARY = "deepshard presenting itself as DeepSpeed (--deepspeed_compat)"
"""The ``Summary`` of the ``deepspeed`` distribution deepshard presents: how ``ds_report`` and
``ds-compat`` tell it from a real DeepSpeed without importing either."""

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
ELASTIC = "DEEPSHARD_ELASTIC"
"""``1`` when ``ds-run --elastic_training`` runs the job: its world size may change between
relaunches, so the runtime keeps ``train_batch_size`` and the micro batch and derives
``gradient_accumulation_steps`` from the world size."""
HEARTBEAT_FILE = "DEEPSHARD_HEARTBEAT_FILE"
"""Where :func:`deepshard.heartbeat` marks this worker alive (set by the agent)."""

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compat", "shim")
"""The directory ``ds-run --deepspeed_compat`` puts first on the workers' ``PYTHONPATH``: it
holds the ``deepspeed`` package of :mod:`deepshard.compat` (found by path, never imported by
the launcher, which may only read this leaf)."""


def deepspeed_distributions(path: list[str] | None = None) -> list[tuple[str, str, bool]]:
    """The ``deepspeed`` distributions ``importlib.metadata`` finds on ``path``
    (``sys.path``), as ``(version, location, ours)``: deepshard's own (the compat shim's, or
    a ``ds-compat install``, told apart by :data:`COMPAT_SUMMARY`) or a real DeepSpeed.
    What ``ds_report`` shows and what ``ds-compat install`` refuses over."""
    import importlib.metadata
    import sys
    from pathlib import Path

    found = []
    for dist in importlib.metadata.distributions(name="deepspeed", path=path or sys.path):
        ours = COMPAT_SUMMARY in (dist.metadata.get_all("Summary") or [])
        location = str(Path(str(dist.locate_file(""))).resolve())
        found.append((dist.version, location, ours))
    return found


def prepend_to_path(shim_dir: str, pythonpath: str | None) -> str:
    """``PYTHONPATH`` with ``shim_dir`` first (once), the existing entries kept after it."""
    rest = [p for p in (pythonpath or "").split(os.pathsep) if p and p != shim_dir]
    return os.pathsep.join([shim_dir, *rest])


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
maps rank -> {``rss`` bytes, ``cpu`` percent, ``step``, ``beat_age`` seconds or null,
``times``: the steps it finished since the last ``alive``, as [step, seconds, own-work
seconds or null]};
``gpus`` lists {``index``, ``mem_used``, ``mem_total`` bytes, ``util`` percent} (NVML)."""
EV_HUNG = "hung"
"""Workers stopped heartbeating: ``rank`` (silent longest) for ``silent`` seconds, and all
hung ``ranks`` of the node, whose stacks were dumped."""

ALIVE_INTERVAL = 1.0
"""Seconds between ``alive`` events, and between the coordinator's pings (a newline on the
agent's stdin, which renews the agent's lease)."""


class Output:
    """One line of a worker's output, without its newline."""

    __slots__ = ("rank", "text")

    def __init__(self, rank: int, text: str):
        self.rank = rank
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Output) and (self.rank, self.text) == (other.rank, other.text)

    def __hash__(self) -> int:
        return hash((self.rank, self.text))

    def __repr__(self) -> str:
        return f"Output({self.rank!r}, {self.text!r})"


# --- typed events -----------------------------------------------------------------------------
# For the type checker these are frozen, keyword-only dataclasses. At run time _record builds
# the same __init__, __eq__, __hash__, __repr__ and immutability without the dataclasses
# module: the agent imports this module, and `dataclasses` (with `inspect`) adds ~6 ms to
# every agent's start (measured here: 28.6 -> 35.1 ms), on every host of a job.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from dataclasses import dataclass
    from typing import Any, TypeVar

    _C = TypeVar("_C", bound=type)
else:
    def dataclass(*, frozen, kw_only):
        assert frozen and kw_only, "only frozen keyword-only records are implemented"
        return _record


def _record(cls: _C) -> _C:
    """``@dataclass(frozen=True, kw_only=True)`` for a class of annotated fields with
    immutable defaults, as the type checker sees it (see above)."""
    names = tuple(cls.__annotations__)  # the class's own, in order
    defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}

    def __init__(self: Any, **values: Any) -> None:
        for name in names:
            if name in values:
                value = values.pop(name)
            elif name in defaults:
                value = defaults[name]
            else:
                raise TypeError(f"{cls.__name__}() missing keyword argument {name!r}")
            object.__setattr__(self, name, value)
        if values:
            raise TypeError(f"{cls.__name__}() got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, values))}")

    def values_of(self: Any) -> tuple[Any, ...]:
        return tuple(getattr(self, n) for n in names)

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return values_of(self) == values_of(other)

    def __hash__(self: Any) -> int:
        return hash(values_of(self))

    def __repr__(self: Any) -> str:
        return f"{cls.__qualname__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen {cls.__name__}")

    def __delattr__(self: Any, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of a frozen {cls.__name__}")

    methods: tuple[Callable[..., Any], ...] = (__init__, __eq__, __hash__, __repr__,
                                               __setattr__, __delattr__)
    for method in methods:
        method.__qualname__ = f"{cls.__qualname__}.{method.__name__}"
        setattr(cls, method.__name__, method)
    setattr(cls, "__match_args__", ())  # as for keyword-only dataclasses  # noqa: B010
    return cls


class ProtocolError(ValueError):
    """An ``e`` line whose kind is unknown or whose fields do not fit its kind."""


_MISSING: object = object()


def _take(fields: Mapping[str, object], key: str, default: object = _MISSING) -> object:
    if key in fields:
        return fields[key]
    if default is _MISSING:
        raise ProtocolError(f"no {key!r}")
    return default


def _as_int(value: object, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ProtocolError(f"{key!r} is not an integer: {value!r}")


def _as_float(value: object, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ProtocolError(f"{key!r} is not a number: {value!r}")


def _as_opt_int(value: object, key: str) -> int | None:
    return None if value is None else _as_int(value, key)


def _as_opt_float(value: object, key: str) -> float | None:
    return None if value is None else _as_float(value, key)


def _as_str(value: object, key: str) -> str:
    if isinstance(value, str):
        return value
    raise ProtocolError(f"{key!r} is not a string: {value!r}")


def _as_bool(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ProtocolError(f"{key!r} is not a boolean: {value!r}")


def _as_dict(value: object, key: str) -> dict[str, object]:
    if isinstance(value, dict):
        return value
    raise ProtocolError(f"{key!r} is not an object: {value!r}")


def _as_list(value: object, key: str) -> list[object]:
    if isinstance(value, list):
        return value
    raise ProtocolError(f"{key!r} is not a list: {value!r}")


def _as_rank(text: str) -> int:
    if text.isascii() and text.isdigit():
        return int(text)
    raise ProtocolError(f"{text!r} is not a rank")


def _host(fields: Mapping[str, object]) -> str:
    return _as_str(_take(fields, "host", ""), "host")


@dataclass(frozen=True, kw_only=True)
class WorkerStats:
    """One worker in an :class:`Alive` event."""

    step: int = -1
    """The step of its last :func:`deepshard.heartbeat`; -1 before one gave a step."""
    beat_age: float | None = None
    """Seconds since its last heartbeat; ``None`` before the first."""
    rss: int | None = None
    """Resident memory of its process tree in bytes (psutil); ``None`` when unread."""
    cpu: float | None = None
    """CPU use of its process in percent (psutil); ``None`` when unread."""
    loss: float | None = None
    """The last loss it reported (the engine's step, :func:`deepshard.report`); ``None``
    before one."""
    ckpt: int = -1
    """The step of the last complete checkpoint it wrote
    (:func:`deepshard.liveness.checkpoint_saved`); -1 before one."""
    times: tuple[StepTime, ...] = ()
    """The steps it finished since the previous ``alive`` event (a sample of them when
    they came faster than :data:`deepshard.liveness.RING` a second)."""

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {"step": self.step, "beat_age": self.beat_age}
        for key in ("rss", "cpu", "loss"):
            if getattr(self, key) is not None:
                wire[key] = getattr(self, key)
        if self.ckpt >= 0:
            wire["ckpt"] = self.ckpt
        if self.times:
            wire["times"] = [[t.step, t.seconds, t.busy] for t in self.times]
        return wire

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> WorkerStats:
        return cls(step=_as_int(_take(fields, "step", -1), "step"),
                   beat_age=_as_opt_float(_take(fields, "beat_age", None), "beat_age"),
                   rss=_as_opt_int(_take(fields, "rss", None), "rss"),
                   cpu=_as_opt_float(_take(fields, "cpu", None), "cpu"),
                   loss=_as_opt_float(_take(fields, "loss", None), "loss"),
                   ckpt=_as_int(_take(fields, "ckpt", -1), "ckpt"),
                   times=tuple(StepTime.from_wire(_as_list(t, "times"))
                               for t in _as_list(_take(fields, "times", []), "times")))


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One step a worker finished, as it measured it (:mod:`deepshard.liveness`)."""

    step: int
    seconds: float
    """Wall time from the end of the previous step to the end of this one: the same on
    every rank of a synchronous job."""
    busy: float | None = None
    """Of those, the seconds before it arrived at the step's synchronisation
    (:func:`deepshard.liveness.arrive`): its own work, which tells a straggler apart;
    ``None`` when the worker does not mark its arrival."""

    @classmethod
    def from_wire(cls, values: list[object]) -> StepTime:
        if len(values) != 3:
            raise ProtocolError(f"'times' entry is not [step, seconds, busy]: {values!r}")
        return cls(step=_as_int(values[0], "times"), seconds=_as_float(values[1], "times"),
                   busy=_as_opt_float(values[2], "times"))


@dataclass(frozen=True, kw_only=True)
class GpuStats:
    """One GPU of a node in an :class:`Alive` event (NVML)."""

    index: int
    mem_used: int
    """Bytes."""
    mem_total: int
    """Bytes."""
    util: float
    """Percent."""

    def to_wire(self) -> dict[str, object]:
        return {"index": self.index, "mem_used": self.mem_used, "mem_total": self.mem_total,
                "util": self.util}

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> GpuStats:
        return cls(index=_as_int(_take(fields, "index"), "index"),
                   mem_used=_as_int(_take(fields, "mem_used"), "mem_used"),
                   mem_total=_as_int(_take(fields, "mem_total"), "mem_total"),
                   util=_as_float(_take(fields, "util"), "util"))


@dataclass(frozen=True, kw_only=True)
class Started:
    """All workers of a node are running."""

    kind = EV_STARTED
    host: str = ""
    """The node (every event names it)."""
    pids: dict[int, int]
    """rank -> pid."""

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host, "pids": {str(r): p for r, p in self.pids.items()}}

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> Started:
        pids = _as_dict(_take(fields, "pids", {}), "pids")
        return cls(host=_host(fields),
                   pids={_as_rank(r): _as_int(p, "pid") for r, p in pids.items()})


@dataclass(frozen=True, kw_only=True)
class Exited:
    """A worker ended."""

    kind = EV_EXITED
    host: str = ""
    rank: int
    returncode: int
    """Its exit code; negative: killed by that signal."""

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host, "rank": self.rank, "returncode": self.returncode}

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> Exited:
        return cls(host=_host(fields), rank=_as_int(_take(fields, "rank"), "rank"),
                   returncode=_as_int(_take(fields, "returncode"), "returncode"))


@dataclass(frozen=True, kw_only=True)
class AgentError:
    """The agent could not do its job (a worker failed to start)."""

    kind = EV_ERROR
    host: str = ""
    message: str

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host, "message": self.message}

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> AgentError:
        return cls(host=_host(fields), message=_as_str(_take(fields, "message"), "message"))


@dataclass(frozen=True, kw_only=True)
class Done:
    """The agent has stopped every worker and is about to exit."""

    kind = EV_DONE
    host: str = ""
    state: str
    """``succeeded``, ``failed`` or ``stopped``."""
    reason: str = ""
    """When stopped: why (a signal's name, ``channel closed``, ...)."""

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host, "state": self.state, "reason": self.reason}

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> Done:
        return cls(host=_host(fields), state=_as_str(_take(fields, "state"), "state"),
                   reason=_as_str(_take(fields, "reason", ""), "reason"))


@dataclass(frozen=True, kw_only=True)
class Alive:
    """Sent every :data:`ALIVE_INTERVAL` seconds: the agent and its channel work."""

    kind = EV_ALIVE
    host: str = ""
    workers: dict[int, WorkerStats]
    """rank -> stats, for the workers still running."""
    gpus: tuple[GpuStats, ...] = ()

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host,
                "workers": {str(r): w.to_wire() for r, w in self.workers.items()},
                "gpus": [g.to_wire() for g in self.gpus]}

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> Alive:
        workers = _as_dict(_take(fields, "workers", {}), "workers")
        gpus = _as_list(_take(fields, "gpus", []), "gpus")
        return cls(host=_host(fields),
                   workers={_as_rank(r): WorkerStats.from_wire(_as_dict(w, "worker"))
                            for r, w in workers.items()},
                   gpus=tuple(GpuStats.from_wire(_as_dict(g, "gpu")) for g in gpus))


@dataclass(frozen=True, kw_only=True)
class Hung:
    """Workers stopped heartbeating for longer than the hang timeout."""

    kind = EV_HUNG
    host: str = ""
    rank: int
    """The rank silent longest."""
    silent: float
    """For how many seconds it has been silent."""
    ranks: tuple[int, ...] = ()
    """Every hung rank of the node, whose stacks were dumped."""
    dumped: bool = False
    """Whether a stack dump was signalled (false: the silent process is gone)."""

    def to_wire(self) -> dict[str, object]:
        return {"host": self.host, "rank": self.rank, "silent": self.silent,
                "ranks": list(self.ranks), "dumped": self.dumped}

    @classmethod
    def from_wire(cls, fields: Mapping[str, object]) -> Hung:
        ranks = _as_list(_take(fields, "ranks", []), "ranks")
        return cls(host=_host(fields), rank=_as_int(_take(fields, "rank"), "rank"),
                   silent=_as_float(_take(fields, "silent"), "silent"),
                   ranks=tuple(_as_int(r, "ranks") for r in ranks),
                   dumped=_as_bool(_take(fields, "dumped", False), "dumped"))


AgentEvent = Started | Exited | AgentError | Done | Alive | Hung
"""Everything an agent reports besides its workers' output."""
_PARSERS: dict[str, Callable[[Mapping[str, object]], AgentEvent]] = {
    EV_STARTED: Started.from_wire, EV_EXITED: Exited.from_wire,
    EV_ERROR: AgentError.from_wire, EV_DONE: Done.from_wire, EV_ALIVE: Alive.from_wire,
    EV_HUNG: Hung.from_wire,
}


def parse_event(fields: Mapping[str, object]) -> AgentEvent:
    """The typed event of an ``e`` line's JSON object; :class:`ProtocolError` when its
    ``kind`` is unknown or a field does not fit that kind."""
    kind = fields.get("kind")
    parse = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parse is None:
        raise ProtocolError(f"unknown event kind {kind!r}")
    return parse(fields)


def format_event(event: AgentEvent) -> str:
    """The protocol line (with newline) of an event."""
    return encode_event(event.kind, **event.to_wire())


def encode_event(kind: str, **fields: object) -> str:
    """The protocol line (with newline) of an event given as its kind and JSON fields
    (what :func:`format_event` writes)."""
    return "e " + json.dumps({"kind": kind, **fields}, separators=(",", ":")) + "\n"


def encode_output(rank: int, text: str) -> str:
    """The protocol line (with newline) for one line of worker output."""
    return f"o {rank} {text}\n"


def decode_line(line: str) -> Output | AgentEvent | None:
    """Parse one protocol line; ``None`` for a line that is neither output nor a known,
    well-formed event (e.g. a stray print, which the coordinator shows as it is)."""
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
        if isinstance(data, dict):
            try:
                return parse_event(data)
            except ProtocolError:
                return None
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


# -- a relay's channel (the tree fan-out) ------------------------------------------------------
# A relay's stdout carries its own agent's lines as they are, and those of the hosts it
# started behind a mark no agent or worker line starts with: ``\x1d<kind> <host> <text>``.
RELAY_MARK = "\x1d"
RELAY_LINE = "c"
"""A line of a child agent's stdout (its text with the newline)."""
RELAY_STDERR = "s"
"""A line of a child agent's stderr (why it could not start, a crash)."""
RELAY_END = "x"
"""A child's session ended: JSON ``{"code": exit status or null}``."""
RELAY_REACH = "r"
"""After the relay connected to its children, before any of them starts: JSON
``{"unreachable": {host: [reason, hint]}}`` (host is the relay's own)."""
RELAY_KEY = "relay"
"""The key of a relay's payload (its first stdin line), in place of a node plan."""


def encode_relayed(kind: str, host: str, text: str) -> str:
    """One line of a relay's channel about ``host`` (``text`` keeps its newline)."""
    return f"{RELAY_MARK}{kind} {host} {text}" if text.endswith("\n") else \
        f"{RELAY_MARK}{kind} {host} {text}\n"


def decode_relayed(line: str) -> tuple[str, str, str] | None:
    """``(kind, host, text)`` of a relayed line; ``None`` for the relay's own lines."""
    if not line.startswith(RELAY_MARK) or len(line) < 3:
        return None
    host, _, text = line[3:].partition(" ")
    return line[1], host, text
