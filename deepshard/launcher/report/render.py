"""The report for a person (rich tables) and for machines (JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, TextIO

from deepshard.launcher.report.collect import Report
from deepshard.launcher.report.preflight import HostCheck

if TYPE_CHECKING:
    from rich.console import Console


def to_json(report: Report | None, checks: list[HostCheck] | None = None) -> str:
    """The stable JSON form: the report's fields, plus ``preflight`` when hosts were checked."""
    data: dict[str, object] = asdict(report) if report is not None else {}
    if checks is not None:
        data["preflight"] = [{**asdict(c), "ok": c.ok} for c in checks]
    return json.dumps(data, indent=2, sort_keys=True)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024**2:,.0f} MiB"


def _console(stream: TextIO) -> Console:
    """A rich console; wide when not a terminal, so pasted reports keep one row a line."""
    from rich.console import Console

    tty = getattr(stream, "isatty", lambda: False)()
    return Console(file=stream, highlight=False, width=None if tty else 160)


def _compat_line(found: list) -> str:
    """Whether ``import deepspeed`` is deepshard in this environment, in one line."""
    ours = [f for f in found if f.ours]
    real = [f for f in found if not f.ours]
    if real:
        where = ", ".join(f"{f.version} at {f.location}" for f in real)
        return f"no: DeepSpeed {where} is installed (ds-run --deepspeed_compat still " \
               "presents deepshard to its workers)"
    if ours:
        return f"yes: deepspeed {ours[0].version} at {ours[0].location} (ds-compat install; " \
               "`ds-compat uninstall` removes it)"
    return "only under ds-run --deepspeed_compat (`ds-compat install` makes it this " \
           "environment's)"


def render_report(report: Report, stream: TextIO) -> None:
    from rich.table import Table

    console = _console(stream)

    def section(title: str, rows: list[tuple[str, str]]) -> None:
        table = Table(title=title, title_justify="left", show_header=False, box=None,
                      padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        for key, value in rows:
            table.add_row(key, value, style=None)
        console.print(table, markup=False)

    d, p, t = report.deepshard, report.python, report.torch
    section("deepshard", [("version", d.version), ("path", d.path),
                          ("git revision", d.git_revision or "-"),
                          ("as deepspeed", _compat_line(d.deepspeed))])
    section("python", [("version", p.version), ("executable", p.executable),
                       ("platform", p.platform), ("cpus", str(p.cpus))])
    if t is not None:
        section("torch", [("version", t.version or "not installed"), ("cuda", t.cuda or "-"),
                          ("hip", t.hip or "-"), ("cudnn", t.cudnn or "-"),
                          ("nccl", t.nccl or "-"),
                          ("distributed", ", ".join(t.backends) or "-"),
                          ("cuda available", str(t.cuda_available))]
                + ([("error", t.error)] if t.error else []))
    section("devices", [(f"gpu {dv.index}", f"{dv.name}, {_mib(dv.memory_bytes)}, "
                         f"sm {dv.capability or '?'}") for dv in report.devices]
            or [("gpus", "none: CPU workers use gloo")])
    section("cuda toolchain", [
        ("cupy", f"{report.cupy.version} ({report.cupy.path})" if report.cupy.path
         else "not installed (pip install deepshard[cuda12] or [cuda13])"),
        ("nvcc", f"{report.nvcc.version or '?'} ({report.nvcc.path})" if report.nvcc.path
         else "not found")])
    section("kernels", [(k.name, k.status + (f" ({k.reason})" if k.reason else ""))
                        for k in report.kernels] or [("registry", "no kernels registered")])
    lau = report.launchers
    section("launchers", [(tool.name, tool.path or "not found") for tool in lau.tools]
            + [("ssh keys", ", ".join(lau.ssh_keys) or "none in ~/.ssh"),
               ("ssh agent", "running" if lau.ssh_agent else "not running")])
    section("/dev/shm", [("size", _mib(report.shm_bytes))])
    section(".deepspeed_env", [(k, v) for k, v in report.env_file.items()]
            or [("files", ", ".join(report.env_file_sources) or "none")])
    for warning in report.warnings:
        console.print(f"WARNING: {warning}", markup=False, style="yellow")


def render_checks(checks: list[HostCheck], stream: TextIO) -> None:
    from rich.table import Table

    table = Table(title="preflight", title_justify="left")
    for column in ("host", "verdict", "python", "deepshard", "torch", "GPUs", "clock",
                   "problem", "fix"):
        table.add_column(column)
    for c in checks:
        f = c.facts
        skew = f.get("skew")
        table.add_row(c.host, "ok" if c.ok else "FAIL", str(f.get("python", "-")),
                      str(f.get("deepshard", "-")), str(f.get("torch", "-")),
                      str(f.get("gpus", "-")),
                      "-" if skew is None else f"{skew:+.2f} s",
                      "; ".join(c.problems) or "-", "; ".join(c.fixes) or "-",
                      style=None if c.ok else "red")
    _console(stream).print(table, markup=False)
