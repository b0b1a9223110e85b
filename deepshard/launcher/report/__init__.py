"""``ds_report``: diagnostics of an install (and, with ``--hostfile``, of a cluster).

Data first (:mod:`.collect`, :mod:`.preflight`), then rendered (:mod:`.render`) as rich
tables or, with ``--json``, as JSON for bug reports and scripts.
"""

from __future__ import annotations

import os
import sys

import click

from deepshard.errors import EXIT_USAGE, UsageError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("-H", "--hostfile", default=None, metavar="PATH",
              help="Also check every host of this hostfile over ssh (preflight).")
@click.option("--master_port", type=click.IntRange(1, 65535), default=29500,
              show_default=True, help="The port the preflight checks is free on the "
                                      "first host.")
@click.option("--ssh_port", type=click.IntRange(1, 65535), default=None)
@click.option("--remote_python", default=None, metavar="PATH")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds to reach each host.")
def ds_report(as_json: bool, hostfile: str | None, master_port: int, ssh_port: int | None,
              remote_python: str | None, timeout: float) -> int:
    """What this install and machine have (and, with --hostfile, whether every host is
    ready for a job). Exits non-zero when a checked host is not."""
    from deepshard.launcher.report.collect import collect
    from deepshard.launcher.report.render import render_checks, render_report, to_json

    checks = None
    if hostfile is not None:
        from deepshard.launcher.hostfile import read_hostfile
        from deepshard.launcher.report.preflight import preflight

        checks = preflight(read_hostfile(hostfile), cwd=os.getcwd(), master_port=master_port,
                           ssh_port=ssh_port, remote_python=remote_python, timeout=timeout)
    # the preflight is about the hosts: it needs no torch here
    report = collect(with_torch=hostfile is None)
    if as_json:
        sys.stdout.write(to_json(report, checks) + "\n")
    else:
        render_report(report, sys.stdout)
        if checks is not None:
            render_checks(checks, sys.stdout)
    return 0 if checks is None or all(c.ok for c in checks) else 1


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
