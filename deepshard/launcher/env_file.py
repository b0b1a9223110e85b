"""``.deepspeed_env``: extra environment variables for every worker on every node.

As in DeepSpeed, the file name is ``$DS_ENV_FILE`` or ``.deepspeed_env``, looked up in the
home directory and then in the working directory; both are read and the later wins (an
absolute ``DS_ENV_FILE`` names one file). Lines are ``KEY=VALUE`` or ``export KEY=VALUE``;
blank lines and lines starting with ``#`` are ignored. The value is everything after the
first ``=`` up to the end of the line, byte for byte: no quotes are removed and nothing is
expanded, so a value is always data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deepshard.errors import UsageError

DEFAULT_NAME = ".deepspeed_env"
ENV_FILE_VAR = "DS_ENV_FILE"
DEEPSPEED_ENVIRONMENT_NAME = os.getenv(ENV_FILE_VAR, DEFAULT_NAME)
"""The file name as DeepSpeed's ``deepspeed.launcher.runner`` gives it (read once at
import): ``accelerate launch`` appends its variables there for a multi-node job."""
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class EnvFile:
    """The variables read, and the files they came from (in the order applied)."""

    variables: tuple[tuple[str, str], ...]
    sources: tuple[str, ...]

    def as_dict(self) -> dict[str, str]:
        return dict(self.variables)


def parse_env_text(text: str, path: str) -> dict[str, str]:
    """Parse the contents of one env file; ``path`` names lines in errors."""
    result: dict[str, str] = {}
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export ") or stripped.startswith("export\t"):
            stripped = stripped[len("export"):].lstrip()
        key, sep, value = stripped.partition("=")
        if not sep or not _KEY.match(key):
            shown = key if sep else stripped
            raise UsageError(
                f"expected KEY=VALUE, got {shown[:40]!r}" + ("" if sep else " without '='"),
                where=f"{path}:{lineno}",
                hint="write NAME=value with a name of letters, digits and _ "
                     "and no spaces around '='",
            )
        if "\0" in value:
            raise UsageError(f"the value of {key} contains a NUL byte", where=f"{path}:{lineno}",
                             hint="environment values cannot hold NUL; remove it")
        result[key] = value
    return result


def home_dir() -> Path | None:
    """The home directory, or None where there is none (no HOME, no passwd entry: e.g.
    ``docker run --user 1000``)."""
    home = os.path.expanduser("~")
    return None if home.startswith("~") else Path(home)


def env_file_paths(environ: Mapping[str, str], home: Path | None, cwd: Path) -> list[Path]:
    """The candidate files, in the order they are applied (later wins)."""
    name = environ.get(ENV_FILE_VAR) or DEFAULT_NAME
    paths: list[Path] = []
    for base in (b for b in (home, cwd) if b is not None):
        path = base / os.path.expanduser(name)
        if path.resolve() not in {p.resolve() for p in paths}:
            paths.append(path)
    return paths


def read_env_files(environ: Mapping[str, str], home: Path | None, cwd: Path) -> EnvFile:
    """Read every env file that exists; a named ``DS_ENV_FILE`` that exists nowhere is an error."""
    merged: dict[str, str] = {}
    sources: list[str] = []
    for path in env_file_paths(environ, home, cwd):
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UsageError(f"cannot read env file ({exc.strerror})", where=str(path),
                             hint="make it a readable file of KEY=VALUE lines, or remove it"
                             ) from None
        # surrogateescape: undecodable bytes survive to the worker's environment unchanged
        merged.update(parse_env_text(raw.decode("utf-8", "surrogateescape"), str(path)))
        sources.append(str(path))
    if environ.get(ENV_FILE_VAR) and not sources:
        raise UsageError(
            f"{ENV_FILE_VAR}={environ[ENV_FILE_VAR]!r} exists neither in {home} nor in {cwd}",
            where="environment",
            hint=f"point {ENV_FILE_VAR} at an existing file or unset it",
        )
    return EnvFile(tuple(merged.items()), tuple(sources))
