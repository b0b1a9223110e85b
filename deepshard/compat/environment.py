"""``ds-compat``: the explicit, reversible install of deepshard as ``deepspeed`` in an environment.

``ds-run --deepspeed_compat`` presents DeepSpeed only to the workers it starts. Tools that
start their own processes or check in their own (``accelerate launch``, ``trl sft``, a
``deepspeed --num_gpus 2 train.py`` line in a script, Axolotl, LLaMA-Factory) need it in the
environment itself. ``ds-compat install`` writes, into the running interpreter's
``site-packages`` and scripts directory:

- ``deepspeed/__init__.py``: the import shim (``import deepspeed`` is deepshard);
- ``deepspeed-0.19.8+deepshard.X.dist-info/``: the distribution's metadata
  (:mod:`.distribution`), an ``INSTALLER`` and a ``RECORD`` of every file written, so
  ``ds-compat uninstall`` and ``pip uninstall deepspeed`` both remove exactly those;
- ``deepspeed``: the command, ``ds-run --deepspeed_compat``;
- ``deepshard-compat.pth``: at interpreter start, what the shim's ``sitecustomize`` does
  for ``ds-run --deepspeed_compat`` workers (:mod:`.transformers_hook`).

It refuses, without writing anything, when a real DeepSpeed is installed (a ``deepspeed``
distribution or package that is not deepshard's), and never comes with ``pip install
deepshard``. ``ds-compat status`` and ``ds_report`` say whether it is active.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import click

from deepshard import contract
from deepshard.compat import distribution
from deepshard.errors import EXIT_USAGE, UsageError

INSTALLER = "ds-compat"
PTH = "deepshard-compat.pth"
# run at every start of this environment's interpreter (a finder only; no torch, no
# transformers): transformers' own HfDeepSpeedConfig then reaches deepshard's ZeRO-3 loader
# also when a script builds it before anything imports deepspeed
PTH_LINE = ("import deepshard.compat.transformers_hook as _ds_hook; _ds_hook.adopt()\n")

SCRIPT = """#!{python}
# written by ds-compat install: DeepSpeed's `deepspeed` command is `ds-run --deepspeed_compat`
import sys

from deepshard.launcher.entry import deepspeed_main

if __name__ == "__main__":
    sys.exit(deepspeed_main())
"""


@dataclass(frozen=True)
class Target:
    """Where an install goes: a ``site-packages`` directory and a scripts directory."""

    purelib: Path
    scripts: Path

    @classmethod
    def current(cls) -> Target:
        """The running interpreter's (a virtual environment's, when one is active)."""
        paths = sysconfig.get_paths()
        return cls(Path(paths["purelib"]), Path(paths["scripts"]))


def _real_deepspeed(target: Target) -> str | None:
    """What makes an install refuse: a DeepSpeed that is not deepshard's, as one phrase."""
    for version, location, ours in contract.deepspeed_distributions([str(target.purelib),
                                                                      *sys.path]):
        if not ours:
            return f"DeepSpeed {version} is installed in {location}"
    package = target.purelib / "deepspeed"
    if package.exists() and _ours_dist_info(target) is None:
        return f"a 'deepspeed' package that is not deepshard's is at {package}"
    return None


def _ours_dist_info(target: Target) -> Path | None:
    """deepshard's ``deepspeed-*.dist-info`` in ``target``, if installed there."""
    for info in sorted(target.purelib.glob("deepspeed-*.dist-info")):
        metadata = info / "METADATA"
        if metadata.is_file() and f"Summary: {contract.COMPAT_SUMMARY}\n" in metadata.read_text():
            return info
    return None


def _record_row(root: Path, path: Path) -> str:
    """A ``RECORD`` line for ``path`` (relative to ``root``, sha256 as wheels write it)."""
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{os.path.relpath(path, root)},sha256={digest},{len(data)}"


def install(target: Target) -> list[Path]:
    """Write the shim, the distribution and the ``deepspeed`` command into ``target``;
    returns the files written. Replaces an earlier install of its own; raises
    :class:`UsageError` (nothing written) when a real DeepSpeed is there."""
    real = _real_deepspeed(target)
    if real is not None:
        raise UsageError(f"{real}; deepshard never installs over a real DeepSpeed",
                         where="ds-compat install",
                         hint="`pip uninstall deepspeed` first, or keep it and use `ds-run "
                              "--deepspeed_compat`, which presents deepshard to its workers only")
    if _ours_dist_info(target) is not None:
        uninstall(target)
    shim = Path(contract.SHIM_DIR) / "deepspeed" / "__init__.py"
    package = target.purelib / "deepspeed" / "__init__.py"
    info = target.purelib / distribution.dist_info_name()
    script = target.scripts / "deepspeed"
    package.parent.mkdir(parents=True, exist_ok=True)
    info.mkdir(parents=True, exist_ok=True)
    target.scripts.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shim, package)
    (info / "METADATA").write_text(distribution.metadata_text())
    (info / "INSTALLER").write_text(INSTALLER + "\n")
    (info / "top_level.txt").write_text("deepspeed\n")
    (info / "entry_points.txt").write_text(
        "[console_scripts]\ndeepspeed = deepshard.launcher.entry:deepspeed_main\n")
    script.write_text(SCRIPT.format(python=sys.executable))
    script.chmod(0o755)
    hook = target.purelib / PTH
    hook.write_text(PTH_LINE)
    written = [package, info / "METADATA", info / "INSTALLER", info / "top_level.txt",
               info / "entry_points.txt", script, hook]
    record = info / "RECORD"
    rows = [_record_row(target.purelib, path) for path in written]
    record.write_text("\n".join([*rows, f"{os.path.relpath(record, target.purelib)},,"]) + "\n")
    return [*written, record]


def uninstall(target: Target) -> list[Path]:
    """Remove exactly what :func:`install` wrote into ``target`` (its ``RECORD``); returns
    the files removed (none when it was not installed there)."""
    info = _ours_dist_info(target)
    if info is None:
        return []
    removed = []
    record = info / "RECORD"
    rows = record.read_text().splitlines() if record.is_file() else []
    for row in rows:
        relative = row.rsplit(",", 2)[0]
        path = (target.purelib / relative).resolve()
        if path.is_file():
            path.unlink()
            removed.append(path)
    for folder in (info, target.purelib / "deepspeed"):
        if folder.is_dir():
            cache = folder / "__pycache__"
            if cache.is_dir():
                shutil.rmtree(cache)
            if not any(folder.iterdir()):
                folder.rmdir()
    return removed


def describe(target: Target) -> str:
    """One line: whether deepshard is installed as ``deepspeed`` in ``target``, or what
    DeepSpeed is."""
    info = _ours_dist_info(target)
    if info is not None:
        return (f"active: deepspeed {distribution.version()} is deepshard "
                f"({info}; `ds-compat uninstall` removes it)")
    real = _real_deepspeed(target)
    if real is not None:
        return f"not installed: {real}"
    return "not installed (`ds-compat install` presents deepshard as deepspeed here)"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Present deepshard as DeepSpeed in this Python environment, or stop doing so."""


@cli.command("install")
def install_command() -> None:
    """Install the `deepspeed` distribution, import shim and command (deepshard's)."""
    target = Target.current()
    for path in install(target):
        click.echo(f"wrote {path}")
    click.echo(f"deepspeed {distribution.version()} is deepshard in {target.purelib}; "
               "`ds-compat uninstall` removes it")


@cli.command("uninstall")
def uninstall_command() -> None:
    """Remove exactly what `ds-compat install` wrote."""
    removed = uninstall(Target.current())
    for path in removed:
        click.echo(f"removed {path}")
    if not removed:
        click.echo("ds-compat: nothing to remove (not installed in this environment)")


@cli.command("status")
def status_command() -> None:
    """Whether deepshard is installed as deepspeed in this environment."""
    click.echo(describe(Target.current()))


def main(argv: list[str] | None = None) -> None:
    """The ``ds-compat`` console script: one-line errors with exit code 2."""
    try:
        cli.main(args=argv, prog_name="ds-compat", standalone_mode=False)
    except click.UsageError as exc:
        message = " ".join(exc.format_message().split()).rstrip(".")
        sys.stderr.write(f"ds-compat: error: {message}. HINT: see ds-compat --help\n")
        sys.exit(EXIT_USAGE)
    except UsageError as exc:
        sys.stderr.write(f"ds-compat: error: {exc}\n")
        sys.exit(EXIT_USAGE)
