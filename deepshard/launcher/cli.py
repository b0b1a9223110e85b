"""``ds-run``: DeepSpeed's launcher command line, on the deepshard launch path.

argv → LaunchOptions → Resources → Placement → LaunchPlan → backend → coordinator.
Everything before the backend is checked first, so bad input exits with code 2 and a
one-line message before any process starts.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from deepshard.contract import DEEPSHARD_VERSION as __version__
from deepshard.errors import EXIT_USAGE, UsageError
from deepshard.launcher import procs
from deepshard.launcher.backends import (
    BACKENDS,
    Backend,
    LocalBackend,
    Router,
    default_backend,
    get_backend,
    launcher_help,
)
from deepshard.launcher.coordinator import Coordinator
from deepshard.launcher.env_file import home_dir, read_env_files
from deepshard.launcher.hostfile import read_hostfile
from deepshard.launcher.options import LaunchOptions
from deepshard.launcher.placement import place, select
from deepshard.launcher.plan import LaunchPlan, build_plan
from deepshard.launcher.resources import (
    Resources,
    gpu_ids,
    interface_addresses,
    is_local,
    local_names,
    probe_local,
)
from deepshard.launcher.selectors import visible_devices_pool
from deepshard.launcher.slurm_env import allocation_resources, expand_nodelist, in_allocation
from deepshard.launcher.spawn import DEFAULT_HOSTFILE
from deepshard.launcher.straggler import StragglerPolicy
from deepshard.launcher.summary import JobRecord, check_summary_path, write_summary
from deepshard.launcher.supervisor import Outcome, supervise
from deepshard.launcher.tree import plan_tree, relay_count, tree_note

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable

    from deepshard.contract import AgentEvent
    from deepshard.launcher.live import LiveView

    Spawned = list[subprocess.Popen[bytes]]


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"],
                      "max_content_width": 100},
    help="Launch USER_SCRIPT on every selected slot (GPU, or CPU worker) of every host.",
)
@click.option("-H", "--hostfile", default=None, metavar="PATH",
              help=f"Hostfile of 'hostname slots=N' lines [default: {DEFAULT_HOSTFILE} if it "
                   "exists, else this machine].")
@click.option("-i", "--include", default=None, metavar="SEL",
              help="Only these hosts/slots, e.g. 'worker-0:0,2@worker-1'.")
@click.option("-e", "--exclude", default=None, metavar="SEL",
              help="All hosts/slots except these, same grammar as --include.")
@click.option("--num_nodes", type=click.IntRange(min=1), default=None,
              help="Use the first N hosts.")
@click.option("--num_gpus", "--num_accelerators", "num_gpus", type=click.IntRange(min=1),
              default=None,
              help="Slots per host; without GPUs, the number of CPU workers [default: 1].")
@click.option("--master_addr", default=None, help="Rendezvous address [default: 127.0.0.1 "
              "when every host is this machine].")
@click.option("--master_port", type=click.IntRange(1, 65535), default=None,
              help="Rendezvous port [default: a free port].")
@click.option("--launcher", type=click.Choice(list(BACKENDS)), default=None,
              help=launcher_help())
@click.option("--launcher_args", default="", metavar="ARGS",
              help="Extra arguments for pdsh, srun or mpirun (--launcher pdsh, slurm or an "
                   "MPI one).")
@click.option("--ssh_port", type=click.IntRange(1, 65535), default=None,
              help="SSH port for every host [default: ~/.ssh/config's Port, else 22].")
@click.option("--remote_python", default=None, metavar="PATH",
              help="Python on remote hosts [default: this one's path].")
@click.option("--ssh_connect_timeout", type=click.FloatRange(min=0.1), default=10.0,
              show_default=True, help="Seconds to reach each host before giving up.")
@click.option("--fanout", type=click.IntRange(min=0), default=None, metavar="K",
              help="ssh: contact K relay hosts, each of which starts and supervises its share "
                   "of the others (a two-level tree); 0: contact every host from here "
                   "[default: every host up to 64, then ceil(sqrt(hosts)) relays].")
@click.option("--max_restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Relaunch the whole job (fresh port, DEEPSHARD_RESTART_COUNT+1) up to N "
                   "times after a failure.")
@click.option("--hang_timeout", type=click.FloatRange(min=0.1), default=None,
              help="A worker whose deepshard.heartbeat() stops for this many seconds gets "
                   "its stacks dumped and fails the job [default: never].")
@click.option("--live/--no_live", "live", default=None,
              help="A live per-rank table [default: when stdout is a terminal].")
@click.option("--monitor_timeout", type=click.FloatRange(min=1.0), default=30.0,
              show_default=True,
              help="Seconds of silence after which a node is lost and the job stopped.")
@click.option("--straggler_factor", type=click.FloatRange(min=1.0, min_open=True), default=1.5,
              show_default=True,
              help="Name a rank whose own work per step, before it synchronises, stays this "
                   "many times the other ranks' median (deepshard.liveness.arrive marks it).")
@click.option("--summary_json", default=None, metavar="PATH",
              help="Write the job's outcome and per-rank step times (with straggler "
                   "verdicts) to PATH as JSON when ds-run ends, also on failure.")
@click.option("--module", is_flag=True, help="Run USER_SCRIPT as a module (python -m).")
@click.option("--no_python", is_flag=True, help="Run USER_SCRIPT directly, not with python.")
@click.option("--no_local_rank", is_flag=True,
              help="Do not pass --local_rank=N to the script.")
@click.option("--log_dir", "--enable_each_rank_log", "log_dir", default=None, metavar="DIR",
              help="Also write each rank's output to DIR/rank_<N>.log on its node.")
@click.option("--bind_cores_to_rank", is_flag=True,
              help="Pin each worker to its own block of the host's cores.")
@click.option("--deepspeed_compat", is_flag=True,
              help="The workers' `import deepspeed` gets deepshard (deepspeed.x.y is "
                   "deepshard.x.y), so a DeepSpeed script runs unedited; no DeepSpeed is "
                   "installed or needed.")
@click.option("--elastic_training", is_flag=True,
              help="Elastic: a lost node (or one whose workers fail twice in a row) is left "
                   "out and the job relaunched on the others, resuming from its checkpoint; "
                   "a lost node that comes back rejoins.")
@click.option("--min_elastic_nodes", type=click.IntRange(min=1), default=None,
              help="Elastic: fewer usable nodes end the job [default: 1].")
@click.option("--max_elastic_nodes", type=click.IntRange(min=1), default=None,
              help="Elastic: at most this many nodes at once [default: every host].")
@click.option("--elastic_probe_interval", type=click.FloatRange(min=0.1), default=60.0,
              show_default=True, help="Elastic: seconds between probes of lost nodes.")
@click.option("--dry_run", is_flag=True, help="Print the launch plan and exit.")
@click.version_option(__version__, "--version", prog_name="ds-run")
@click.argument("user_script")
@click.argument("user_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def ds_run(spawned: Spawned, **params: Any) -> int:
    # click's values, as its declarations above make them: LaunchOptions has their types
    if params["launcher"] is None:
        params["launcher"] = default_backend(params["hostfile"], os.environ)
    options = LaunchOptions(**{**params, "user_args": tuple(params["user_args"])})
    return launch(options, spawned)


def launch(options: LaunchOptions, spawned: Spawned | None = None) -> int:
    """Plan the job (raising :class:`UsageError` on bad input), then run it, restarting
    it after failures while ``--max_restarts`` allows."""
    # a requeued SLURM job is the same run: its id and restart count carry over
    slurm_job = os.environ.get("SLURM_JOB_ID") if in_allocation(os.environ) else None
    run_id = os.environ.get("DEEPSHARD_RUN_ID") or (
        f"slurm-{slurm_job}" if slurm_job else os.urandom(6).hex())
    requeues = os.environ.get("SLURM_RESTART_COUNT", "") if slurm_job else ""
    restarts_before = int(requeues) if requeues.isdigit() else 0
    first = make_plan(options, run_id=run_id, restart_count=restarts_before)
    if options.dry_run:
        from deepshard.launcher.plan_render import (
            render_plan,  # rich costs ~70 ms: only for --dry_run
        )

        render_plan(first, sys.stdout, shown_commands(options, first))
        return 0
    job = JobRecord(run_id, StragglerPolicy(factor=options.straggler_factor))
    code: int | None = None  # None: ds-run itself failed (a bug, KeyboardInterrupt)
    try:
        code = run_job(options, spawned, first, job, restarts_before)
        return code
    except UsageError as exc:  # e.g. a host that cannot be reached: nothing ran
        job.usage_error, code = str(exc), EXIT_USAGE
        raise
    finally:
        if options.summary_json is not None:
            try:
                write_summary(options.summary_json, job.to_json(code))
            except OSError as exc:
                sys.stderr.write(f"ds-run: cannot write --summary_json "
                                 f"{options.summary_json}: {exc.strerror or exc}\n")


def run_job(options: LaunchOptions, spawned: Spawned | None, first: LaunchPlan,
            job: JobRecord, restarts_before: int) -> int:
    """Run the planned job (``first``), restarting it while ``--max_restarts`` allows (or
    elastically); ``job`` records each attempt for the summary."""
    run_id = first.run_id
    backend = Router(LocalBackend(spawned=spawned), remote_backend(options, first))
    live = sys.stdout.isatty() if options.live is None else options.live

    def attempt(restart: int) -> Outcome:
        plan = first
        if restart:  # a fresh port, the restart count in the contract, the same run id
            try:
                plan = make_plan(options, run_id=run_id,
                                 restart_count=restarts_before + restart)
                backend.prepare(plan.nodes)
            except UsageError as exc:
                sys.stderr.write(f"ds-run: cannot restart: {exc}\n")
                return Outcome(1, restartable=True)
        return run_attempt(plan, backend, options, live, restart, job=job)

    # orphans of a local agent that died (SIGKILL, OOM killer) come to us: swept below
    procs.become_subreaper()
    # between attempts (the restart backoff) SIGTERM/SIGHUP must still end in cleanup; during
    # an attempt the coordinator's own handlers take over
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if options.elastic_training:
            return launch_elastic(options, first, backend, live, run_id, restarts_before, job)
        backend.prepare(first.nodes)  # a host that cannot be reached: exit 2, nothing ran
        return supervise(attempt, options.max_restarts, err=sys.stderr)
    except _Stopped as stop:
        sys.stderr.write(f"ds-run: {signal.Signals(stop.signum).name} received between "
                         "attempts: not restarting\n")
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        backend.close()
        procs.stop_tree(set(), options.stop_grace)


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def launch_elastic(options: LaunchOptions, full: LaunchPlan, backend: Backend, live: bool,
                   run_id: str, restarts_before: int, job: JobRecord | None = None) -> int:
    """``--elastic_training``: :func:`.elastic.supervise_elastic` over this CLI's planning,
    attempts and the preflight probe."""
    from deepshard.launcher.elastic import Attempt, Session, make_policy, supervise_elastic

    def plan_for(hosts: tuple[str, ...], restart: int) -> LaunchPlan:
        return make_plan(options, run_id=run_id, restart_count=restarts_before + restart,
                         hosts=hosts)

    def attempt(plan: LaunchPlan, restart: int, session: Session) -> Attempt:
        started: list[Coordinator] = []

        def watch(coordinator: Coordinator) -> None:
            started.append(coordinator)
            session.attach(coordinator)

        try:
            outcome = run_attempt(plan, backend, options, live, restart,
                                  observer=session.observe, watch=watch, job=job)
        finally:
            session.attach(None)
        return Attempt(outcome.code, started[0])

    slots = {n.host: len(n.workers) for n in full.nodes}
    return supervise_elastic(options, make_policy(options, full), backend=backend,
                             plan_for=plan_for, attempt=attempt, err=sys.stderr,
                             probe=lambda host: probe_host(options, host, slots[host]))


def probe_host(options: LaunchOptions, host: str, slots: int) -> str | None:
    """Why ``host`` cannot rejoin the job (``None``: it can): reachable, and ``ds_report
    --hostfile``'s preflight passes there (under SLURM: a step starts on it)."""
    if options.launcher == "slurm":
        import subprocess

        from deepshard.launcher.backends.slurm import slurmd_addresses, slurmd_answers

        # a dead node's srun takes MessageTimeout (10 s) to fail: ask its slurmd first
        slurmd = slurmd_addresses([host]).get(host)
        if slurmd is not None and not slurmd_answers(slurmd):
            return f"its slurmd ({slurmd[0]}:{slurmd[1]}) does not answer"
        probe = subprocess.run(["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
                                "--overlap", "--quiet", "true"], capture_output=True,
                               text=True, timeout=max(30.0, options.ssh_connect_timeout),
                               check=False)
        return None if probe.returncode == 0 else (probe.stderr.strip() or "srun failed")
    from deepshard.launcher.report.preflight import preflight
    from deepshard.launcher.resources import Host, Resources

    check = preflight(Resources((Host(host, tuple(range(slots))),), "elastic probe"),
                      cwd=os.getcwd(), master_port=0, ssh_port=options.ssh_port,
                      remote_python=options.remote_python,
                      timeout=options.ssh_connect_timeout)[0]
    return None if check.ok else "; ".join(check.problems)


def run_attempt(plan: LaunchPlan, backend: Backend, options: LaunchOptions, live: bool,
                restart: int, *,
                observer: Callable[[str, AgentEvent], None] | None = None,
                watch: Callable[[Coordinator], None] | None = None,
                job: JobRecord | None = None) -> Outcome:
    """One attempt of the job, with the live view when asked; ``observer`` sees every
    agent event, ``watch`` the coordinator before it runs, ``job`` records the attempt."""
    def coordinate(view: LiveView | None) -> Outcome:
        coordinator = Coordinator(plan, backend, monitor_timeout=options.monitor_timeout,
                                  view=view, observer=observer,
                                  steps=job.attempt_started(restart) if job else None)
        if job is not None:
            job.last = coordinator
        if watch is not None:
            watch(coordinator)
        code = coordinator.run()
        return Outcome(code, restartable=coordinator.failure is not None
                       and coordinator.stop_signal is None)

    if not live:
        return coordinate(None)
    from deepshard.launcher.live import LiveView

    title = f"run {plan.run_id}" + (f", restart {restart}" if restart else "")
    with LiveView(plan, sys.stdout, title) as view:
        return coordinate(view)


def remote_backend(options: LaunchOptions, plan: LaunchPlan) -> Backend | None:
    """The backend for the plan's remote nodes (``None`` when every node is local)."""
    spec = BACKENDS[options.launcher]
    if options.launcher_args and not spec.takes_launcher_args:
        users = " and ".join(name for name, s in BACKENDS.items() if s.takes_launcher_args)
        raise UsageError(f"--launcher_args is only used by --launcher {users}",
                         hint="drop --launcher_args, or add --launcher pdsh")
    if options.fanout is not None and options.launcher != "ssh":
        raise UsageError(f"--fanout is for --launcher ssh, not {options.launcher}",
                         where="--fanout", hint=f"drop --fanout: {options.launcher} has its "
                         "own fan-out" + (" (-f in --launcher_args)"
                                          if options.launcher == "pdsh" else ""))
    remote = [n.host for n in plan.nodes if not n.local]
    if not remote:
        return None
    if not spec.remote:
        raise UsageError(
            f"host {remote[0]!r} is not this machine, and --launcher {options.launcher} "
            "starts workers on this machine only", where=options.hostfile or DEFAULT_HOSTFILE,
            hint=f"drop --launcher {options.launcher} to reach it over ssh, or --include "
                 "localhost")
    # imported only now: the ssh backend brings paramiko (~200 ms)
    return get_backend(options.launcher).from_options(options)


def shown_commands(options: LaunchOptions, plan: LaunchPlan) -> dict[str, list[str]]:
    """For ``--dry_run``: the command line that starts each remote node's agent, where the
    backend has one worth showing (srun's)."""
    remote = [n for n in plan.nodes if not n.local]
    if not remote or not BACKENDS[options.launcher].remote:
        return {}
    backend = get_backend(options.launcher).from_options(options)
    return {n.host: command for n in remote
            if (command := backend.shown_command(n)) is not None}


def make_plan(options: LaunchOptions, *, run_id: str, restart_count: int = 0,
              hosts: tuple[str, ...] | None = None) -> LaunchPlan:
    """Every check and decision before anything starts; pure but for reading named files
    (and choosing a free port). ``hosts``: only these of the selected hosts (elastic
    training's current membership)."""
    check_script(options)
    check_log_dir(options.log_dir)
    check_summary_path(options.summary_json)
    hostfile = options.hostfile
    if hostfile is None and os.path.isfile(DEFAULT_HOSTFILE):
        hostfile = DEFAULT_HOSTFILE
    hidden: frozenset[str] = frozenset()
    notes: list[str] = []  # decisions --dry_run shows
    if options.launcher == "slurm" and not in_allocation(os.environ):
        raise UsageError("--launcher slurm outside a SLURM allocation",
                         hint="run ds-run inside sbatch or salloc (see hostfiles/slurm/)")
    if hostfile is not None:
        resources = read_hostfile(hostfile)
        names = local_names(interface_addresses())
    elif options.launcher == "slurm":
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ["SLURM_NODELIST"]
        resources = allocation_resources(os.environ, expand_nodelist(nodelist),
                                         options.num_gpus)
        names = frozenset()
    else:
        resources = probe_local(options.num_gpus, os.environ)
        names = local_names()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible == "":  # the user hid the GPUs: keep them
            hidden = frozenset({"localhost"})
        elif visible is not None:  # DeepSpeed's implicit --include localhost:<ids>
            resources, note = visible_devices_pool(
                resources, visible, gpu_ids({}), include_text=options.include,
                exclude_text=options.exclude, num_gpus=options.num_gpus)
            notes.append(note)
    selected = select(resources, include_text=options.include, exclude_text=options.exclude,
                      num_nodes=options.num_nodes,
                      num_gpus=options.num_gpus)
    if hosts is not None:
        selected = Resources(tuple(h for h in selected.hosts if h.name in hosts),
                             selected.origin)
    placement = place(selected)
    # under SLURM every node's agent is an srun step, this node's too
    locality = {n.host: options.launcher != "slurm" and is_local(n.host, names)
                for n in placement.nodes}
    env_file = read_env_files(os.environ, home_dir(), Path.cwd())
    master_addr = options.master_addr or rendezvous_address(placement.nodes[0].host,
                                                            locality, options)
    master_port = options.master_port or free_port(master_addr)
    if options.launcher == "ssh":
        remote = tuple(n.host for n in placement.nodes if not locality[n.host])
        if relays := relay_count(len(remote), options.fanout):
            notes.append(tree_note(plan_tree(remote, relays)))
    return build_plan(
        options, placement, env_file.as_dict(), python=sys.executable, cwd=os.getcwd(),
        master_addr=master_addr, master_port=master_port,
        run_id=run_id, is_local=locality, environ=os.environ, hidden_devices=hidden,
        restart_count=restart_count, notes=tuple(notes),
    )


def rendezvous_address(first_host: str, locality: dict[str, bool],
                       options: LaunchOptions) -> str:
    """MASTER_ADDR: loopback when every node is this machine; under SLURM the first node's
    name; else the first host's address as ssh reaches it (its ``HostName`` in
    ~/.ssh/config, else its name)."""
    if all(locality.values()):
        return "127.0.0.1"
    if options.launcher == "slurm":
        return first_host  # SLURM's node names resolve on its nodes; no ssh config applies
    if locality[first_host]:
        return socket.gethostname()
    from deepshard.launcher.ssh_config import load_config_text, resolve_target

    return resolve_target(first_host, load_config_text(),
                          port_override=options.ssh_port, default_user="-").hostname


def check_script(options: LaunchOptions) -> None:
    """The script must exist here (or be on PATH with --no_python) before anything starts."""
    script = options.user_script
    if options.module and options.no_python:
        raise UsageError("--module and --no_python exclude each other",
                         hint="--module runs `python -m SCRIPT`; --no_python runs SCRIPT as a "
                              "program: pick one")
    if options.module:
        return
    if options.no_python:
        import shutil  # ~15 ms: only for --no_python

        if shutil.which(script) is None:
            raise UsageError("program not found or not executable", where=script,
                             hint="give a path or a program on PATH")
        return
    if not os.path.isfile(script):
        raise UsageError("training script not found", where=script,
                         hint="check the path, or pass --module to run a module")


def check_log_dir(log_dir: str | None) -> None:
    """``--log_dir`` must be a directory this machine can create (checked before any start;
    on other hosts the agent reports its own failure)."""
    if log_dir is None:
        return
    path = Path(log_dir).absolute()
    if path.exists() and not path.is_dir():
        raise UsageError("exists and is not a directory", where=f"--log_dir {log_dir}",
                         hint="name a directory (it is created when missing)")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot create files under {existing}",
                         where=f"--log_dir {log_dir}", hint="name a writable directory")


def free_port(address: str) -> int:
    """A port that is free on ``address`` now (or on any address if it is not ours)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])


def run_cli(args: list[str], spawned: Spawned) -> int:
    """Run ds-run on ``args``: one-line errors with exit code 2, the job's code otherwise.

    ``spawned``: local agent processes started ahead of planning (see :mod:`.spawn`).
    """
    try:
        code = ds_run.main(args=args, prog_name="ds-run", standalone_mode=False, obj=spawned)
    except click.UsageError as exc:
        hint = "see ds-run --help"
        message = " ".join(exc.format_message().split()).rstrip(".")
        sys.stderr.write(f"ds-run: error: {message}. HINT: {hint}\n")
        return EXIT_USAGE
    except UsageError as exc:
        sys.stderr.write(f"ds-run: error: {exc}\n")
        return EXIT_USAGE
    except click.Abort:
        return 130
    return code if isinstance(code, int) else 0
