"""``ds_report``: diagnostics of an install (and, with ``--hostfile`` or ``--slurm``, of a
cluster).

Data first (:mod:`.collect`, :mod:`.preflight`), then rendered (:mod:`.render`) as rich
tables or, with ``--json``, as JSON for bug reports and scripts.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click

from deepshard.errors import EXIT_USAGE, UsageError

if TYPE_CHECKING:
    from deepshard.launcher.report.preflight import HostCheck


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("-H", "--hostfile", default=None, metavar="PATH",
              help="Also check every host of this hostfile over ssh (preflight).")
@click.option("--slurm", is_flag=True,
              help="Also check every node of this SLURM allocation (or of -w) through "
                   "srun (preflight).")
@click.option("-w", "--nodelist", default=None, metavar="NODES",
              help="With --slurm: these nodes (SLURM's syntax, node[1-3],gpu7); outside "
                   "an allocation each is a one-node srun job. Implies --slurm.")
@click.option("--launcher_args", default="", metavar="ARGS",
              help="Extra srun arguments for --slurm (--partition, --account, ...).")
@click.option("--master_port", type=click.IntRange(1, 65535), default=29500,
              show_default=True, help="The port the preflight checks is free on the "
                                      "first host.")
@click.option("--ssh_port", type=click.IntRange(1, 65535), default=None)
@click.option("--remote_python", default=None, metavar="PATH")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds to reach each host (--slurm -w: as long again to be "
                   "allocated).")
def ds_report(as_json: bool, hostfile: str | None, slurm: bool, nodelist: str | None,
              launcher_args: str, master_port: int, ssh_port: int | None,
              remote_python: str | None, timeout: float) -> int:
    """What this install and machine have (and, with --hostfile or --slurm, whether every
    host is ready for a job). Exits non-zero when a checked host is not."""
    from deepshard.launcher.report.collect import collect
    from deepshard.launcher.report.render import render_checks, render_report, to_json

    checks = None
    slurm = slurm or nodelist is not None
    if slurm:
        checks = _slurm_preflight(hostfile, nodelist, launcher_args, master_port, ssh_port,
                                  remote_python, timeout)
    elif launcher_args:
        raise UsageError("only srun takes extra arguments", where="--launcher_args",
                         hint="add --slurm, or leave --launcher_args out")
    elif hostfile is not None:
        from deepshard.launcher.hostfile import read_hostfile
        from deepshard.launcher.report.preflight import preflight

        checks = preflight(read_hostfile(hostfile), cwd=os.getcwd(), master_port=master_port,
                           ssh_port=ssh_port, remote_python=remote_python, timeout=timeout)
    # the preflight is about the hosts: it needs no torch here
    report = collect(with_torch=checks is None)
    if as_json:
        sys.stdout.write(to_json(report, checks) + "\n")
    else:
        render_report(report, sys.stdout)
        if checks is not None:
            render_checks(checks, sys.stdout)
    return 0 if checks is None or all(c.ok for c in checks) else 1


def _slurm_preflight(hostfile: str | None, nodelist: str | None, launcher_args: str,
                     master_port: int, ssh_port: int | None, remote_python: str | None,
                     timeout: float) -> list[HostCheck]:
    """--slurm: plan (one-line errors for what does not go with it), then srun."""
    import secrets
    import shutil

    from deepshard.launcher.report.slurm import plan_slurm_preflight, run_slurm_preflight
    from deepshard.launcher.slurm_env import expand_nodelist

    for flag, value in (("-H", hostfile), ("--ssh_port", ssh_port)):
        if value is not None:
            raise UsageError(f"{flag} is for the ssh preflight, --slurm probes through srun",
                             where="--slurm", hint=f"use either --slurm or {flag}, not both")
    if shutil.which("srun") is None:
        raise UsageError("srun is not on PATH", where="--slurm",
                         hint="run ds_report on a SLURM login or compute node, or use -H "
                              "hostfile")
    plan = plan_slurm_preflight(os.environ, nodelist=nodelist, expand=expand_nodelist,
                                python=remote_python or sys.executable, cwd=os.getcwd(),
                                master_port=master_port, timeout=timeout,
                                launcher_args=launcher_args,
                                job_name=f"ds_report-{secrets.token_hex(3)}")
    return run_slurm_preflight(plan)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one-line errors with exit code 2."""
    try:
        code = ds_report.main(args=argv, prog_name="ds_report", standalone_mode=False)
    except click.UsageError as exc:
        message = " ".join(exc.format_message().split()).rstrip(".")
        sys.stderr.write(f"ds_report: error: {message}. HINT: see ds_report --help\n")
        sys.exit(EXIT_USAGE)
    except UsageError as exc:
        sys.stderr.write(f"ds_report: error: {exc}\n")
        sys.exit(EXIT_USAGE)
    sys.exit(code if isinstance(code, int) else 0)
