"""``ds-run --elastic_training``: run attempts of the job on the hosts the membership policy
(:mod:`.membership`) picks, and change them while the job runs.

The driver turns what happens into the policy's events: an attempt that ends with a lost
host (its channel closed, silence past ``--monitor_timeout``, no agent start) or a failed
worker, a host that cannot be reached when the job is relaunched, an excluded host that
passes its probe (every ``--elastic_probe_interval`` seconds: reachable, and the
preflight of ``ds_report --hostfile`` passes), and a complete checkpoint. The workers
report checkpoints through the heartbeat they already beat
(:func:`deepshard.liveness.checkpoint_saved`), which the agents forward in their
``alive`` events: that needs no shared file system between the launcher and the hosts, and
a checkpoint counts only once every rank has committed it.

The world sizes a job allows come from its config, when the script's arguments name one
(``--deepspeed_config PATH``): the ``elasticity`` section's valid set, else the sizes at
which ``train_batch_size`` splits into whole accumulation steps of the micro batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from deepshard import contract
from deepshard.errors import UsageError
from deepshard.launcher.backends.base import HostsUnreachable
from deepshard.launcher.membership import (
    CheckpointComplete,
    Decision,
    Event,
    Failed,
    Lost,
    Membership,
    Policy,
    ProbeOk,
    Relaunch,
    Stop,
    begin,
    on_event,
)
from deepshard.launcher.supervisor import backoff

if TYPE_CHECKING:
    from deepshard.launcher.backends.base import Backend
    from deepshard.launcher.coordinator import Coordinator
    from deepshard.launcher.options import LaunchOptions
    from deepshard.launcher.plan import LaunchPlan

CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")


def config_path(user_args: tuple[str, ...]) -> str | None:
    """The config the script is given (``--deepspeed_config PATH`` or ``=PATH``)."""
    for i, arg in enumerate(user_args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(user_args):
                return user_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def config_facts(user_args: tuple[str, ...], most: int) -> tuple[frozenset[int] | None, bool]:
    """(the world sizes up to ``most`` the script's config allows or ``None``, whether it
    configures checkpoints to resume from)."""
    path = config_path(user_args)
    if path is None:
        return None, False
    # pydantic-free reading of the user's dialect (comments, YAML); torch-free
    from deepshard.config.dialect import read_config_source

    data, origin = read_config_source(path)
    checkpoints = bool((data.get("checkpoint") or {}).get("resume_dir"))
    section = data.get("elasticity")
    if isinstance(section, dict) and section.get("enabled"):
        from deepshard.elasticity import allows, spec_from_mapping

        spec = spec_from_mapping(section, where=f"{origin}: elasticity")
        return frozenset(w for w in range(1, most + 1) if allows(spec, w)), checkpoints
    tbs, micro = data.get("train_batch_size"), data.get("train_micro_batch_size_per_gpu")
    if isinstance(tbs, int) and isinstance(micro, int) and tbs > 0 and micro > 0:
        from deepshard.elasticity import fits_batch

        return frozenset(w for w in range(1, most + 1) if fits_batch(tbs, micro, w)), \
            checkpoints
    return None, checkpoints


def make_policy(options: LaunchOptions, full: LaunchPlan) -> Policy:
    """The policy over every host of the full plan, with the flags' bounds."""
    hosts = tuple(n.host for n in full.nodes)
    most = options.max_elastic_nodes or len(hosts)
    least = options.min_elastic_nodes or 1
    if least > most or least > len(hosts):
        raise UsageError(f"--min_elastic_nodes {least} is more than the "
                         f"{min(most, len(hosts))} node(s) the job may use",
                         where="--min_elastic_nodes", hint="lower it, or add hosts")
    sizes, checkpoints = config_facts(options.user_args, full.world_size)
    return Policy(hosts=hosts, slots=tuple(len(n.workers) for n in full.nodes),
                  min_nodes=least, max_nodes=most, world_sizes=sizes,
                  checkpoints=checkpoints)


class Session:
    """The membership as events change it, from the driver, the prober and the
    coordinator's thread (one lock); a change while an attempt runs stops it."""

    def __init__(self, state: Membership, err: TextIO):
        self.state = state
        self.err = err
        self._lock = threading.Lock()
        self._coordinator: Coordinator | None = None
        self._last_checkpoint = -1

    def feed(self, event: Event) -> Decision:
        with self._lock:
            self.state, decision = on_event(self.state, event)
            lines = decision.changes if isinstance(decision, Relaunch) else (
                (decision.reason,) if isinstance(decision, Stop) else ())
            for line in lines:
                self.err.write(f"ds-run: elastic: {line}\n")
            self.err.flush()
            if isinstance(decision, Relaunch) and not decision.after_failure \
                    and self._coordinator is not None:
                self._coordinator.regroup("; ".join(decision.changes))
            return decision

    def attach(self, coordinator: Coordinator | None) -> None:
        with self._lock:
            self._coordinator = coordinator
            self._last_checkpoint = -1

    def observe(self, host: str, event: contract.AgentEvent) -> None:
        """The coordinator's observer: complete checkpoints from the workers' reports."""
        if not isinstance(event, contract.Alive) or not event.workers:
            return
        step = max(w.ckpt for w in event.workers.values())
        if step > self._last_checkpoint:
            self._last_checkpoint = step
            self.feed(CheckpointComplete(step))

    def lost_hosts(self) -> list[str]:
        with self._lock:
            return [h for h, why in self.state.excluded if why.startswith("lost")]


@dataclass(frozen=True)
class Attempt:
    """How one attempt ended, as the driver needs it."""

    code: int
    coordinator: Coordinator


def events_of(coordinator: Coordinator) -> Iterator[Event]:
    """The policy's events for a failed attempt: every lost host, else the failed one."""
    failure = coordinator.failure
    assert failure is not None
    if coordinator.lost_hosts:
        for host in dict.fromkeys(coordinator.lost_hosts):
            reason = failure.reason if host == failure.host else "its channel closed"
            yield Lost(host, reason)
    else:
        yield Failed(failure.host, failure.reason)


def supervise_elastic(options: LaunchOptions, policy: Policy, *, backend: Backend,
                      plan_for: Callable[[tuple[str, ...], int], LaunchPlan],
                      attempt: Callable[[LaunchPlan, int, Session], Attempt],
                      probe: Callable[[str], str | None], err: TextIO,
                      sleep: Callable[[float], None] = time.sleep) -> int:
    """Run the job until it succeeds, is stopped, or too few hosts are left; returns the
    exit code. ``plan_for(hosts, restart)`` plans an attempt, ``attempt`` runs one,
    ``probe(host)`` says why a host is not usable (``None``: it is)."""
    state, first = begin(policy)
    if isinstance(first, Stop):
        err.write(f"ds-run: elastic: {first.reason}\n")
        return 1
    session = Session(state, err)
    stop_probing = threading.Event()
    prober = threading.Thread(target=_probe_loop, daemon=True, name="elastic-probe",
                              args=(session, probe, options.elastic_probe_interval,
                                    stop_probing))
    prober.start()
    try:
        return _drive(options, session, backend, plan_for, attempt, err, sleep)
    finally:
        stop_probing.set()


def _drive(options: LaunchOptions, session: Session, backend: Backend,
           plan_for: Callable[[tuple[str, ...], int], LaunchPlan],
           attempt: Callable[[LaunchPlan, int, Session], Attempt], err: TextIO,
           sleep: Callable[[float], None]) -> int:
    restart = failed_restarts = 0
    while True:
        plan = plan_for(session.state.active, restart)
        try:
            backend.prepare(plan.nodes)
        except HostsUnreachable as exc:
            for host, why in exc.hosts.items():
                if isinstance(session.feed(Lost(host, f"unreachable: {why}")), Stop):
                    return 1
            continue
        ended = attempt(plan, restart, session)
        coordinator = ended.coordinator
        if coordinator.stop_signal is not None or (
                ended.code == 0 and coordinator.failure is None
                and coordinator.regrouped is None):
            return ended.code
        restart += 1
        if coordinator.failure is None:  # stopped to grow (or shrink) by the policy
            continue
        decision: Decision = Stop("no event")
        for event in events_of(coordinator):
            decision = session.feed(event)
            if isinstance(decision, Stop):
                return ended.code
        if isinstance(decision, Relaunch) and decision.after_failure:
            if failed_restarts >= options.max_restarts:
                err.write(f"ds-run: giving up after {failed_restarts} restart(s)\n")
                return ended.code
            wait = backoff(failed_restarts)
            failed_restarts += 1
            err.write(f"ds-run: restarting the job in {wait:g} s (restart {failed_restarts} "
                      f"of {options.max_restarts})\n")
            err.flush()
            sleep(wait)


def _probe_loop(session: Session, probe: Callable[[str], str | None], interval: float,
                stop: threading.Event) -> None:
    while not stop.wait(interval):
        for host in session.lost_hosts():
            if stop.is_set():
                return
            try:
                why = probe(host)
            except Exception as exc:  # a probe that breaks is a probe that failed
                why = f"{type(exc).__name__}: {exc}"
            if why is None:
                session.feed(ProbeOk(host))
