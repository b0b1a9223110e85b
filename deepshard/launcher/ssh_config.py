"""Where and how to reach each host over SSH, from the user's ``~/.ssh/config``.

Pure but for reading the config file: :func:`resolve_target` turns a hostfile name into an
:class:`SSHTarget` (address, port, user, keys, known_hosts files, host key policy, jump
hosts), following the OpenSSH keywords paramiko's ``SSHConfig`` understands.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepshard.errors import UsageError

DEFAULT_PORT = 22
POLICIES = {"yes": "yes", "ask": "yes", "accept-new": "accept-new", "no": "no", "off": "no"}


@dataclass(frozen=True)
class SSHTarget:
    """How to connect to one host."""

    alias: str
    """The name in the hostfile."""
    hostname: str
    """The address to connect to (``HostName``, else the alias)."""
    port: int
    user: str
    identity_files: tuple[str, ...]
    known_hosts_files: tuple[str, ...]
    strict_host_key_checking: str
    """``yes`` (also for ``ask`` and by default): refuse unknown hosts; ``accept-new``:
    record unknown hosts, refuse changed keys; ``no``: accept any key, record nothing."""
    proxy_jump: tuple[str, ...] = ()
    """Jump hosts in order (``ProxyJump``), each ``[user@]host[:port]``."""


def default_config_path() -> Path:
    return Path(os.path.expanduser("~/.ssh/config"))


def load_config_text(path: Path | None = None) -> str:
    """The text of the user's ssh config ('' when there is none)."""
    path = path or default_config_path()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read ssh config ({exc})", where=str(path)) from None


def parse_config(config_text: str) -> Any:
    """The parsed config (a ``paramiko.SSHConfig``): parse once, look up every host in it
    (parsing a config of N ``Host`` blocks for each of N hosts costs seconds at 128)."""
    base: Any = import_paramiko().SSHConfig

    class Config(base):
        # paramiko asks getpass.getuser() (a passwd lookup where $USER is unset) for every
        # Host block of every lookup, Match or not: O(hosts^2) lookups, seconds at 128
        # hosts. Without Match criteria the answer is "no match" in any case.
        def _does_match(self, match_list: list[Any], *args: Any) -> Any:
            return [] if not match_list else super()._does_match(match_list, *args)

    try:
        return Config.from_text(config_text)
    except Exception as exc:  # paramiko raises several types on a malformed file
        raise UsageError(f"cannot parse ssh config ({exc})", where=str(default_config_path()),
                         hint="check the file with `ssh -G <host>`") from None


def resolve_target(alias: str, config: str | Any, *, port_override: int | None = None,
                   default_user: str | None = None) -> SSHTarget:
    """Resolve ``alias`` through the config (its text, or :func:`parse_config`'s result);
    ``port_override`` is ``--ssh_port``."""
    parsed = parse_config(config) if isinstance(config, str) else config
    try:
        conf = parsed.lookup(alias)
    except Exception as exc:  # paramiko raises several types on a malformed file
        raise UsageError(f"cannot parse ssh config ({exc})", where=str(default_config_path()),
                         hint="check the file with `ssh -G <host>`") from None
    strict = str(conf.get("stricthostkeychecking", "yes")).lower()
    if strict not in POLICIES:
        raise UsageError(f"StrictHostKeyChecking {strict!r} for {alias} is not supported",
                         where=str(default_config_path()), hint="use yes, accept-new or no")
    known = conf.get("userknownhostsfile", "~/.ssh/known_hosts ~/.ssh/known_hosts2")
    jumps = conf.get("proxyjump", "")
    port_text = str(port_override or conf.get("port", DEFAULT_PORT))
    if not port_text.isdigit():
        raise UsageError(f"Port {port_text!r} for {alias} is not a number",
                         where=str(default_config_path()), hint="use Port 22")
    return SSHTarget(
        alias=alias,
        hostname=conf.get("hostname", alias),
        port=int(port_text),
        user=conf.get("user") or default_user or _local_user(),
        identity_files=tuple(os.path.expanduser(p) for p in conf.get("identityfile", [])),
        known_hosts_files=tuple(os.path.expanduser(p) for p in str(known).split()),
        strict_host_key_checking=POLICIES[strict],
        proxy_jump=tuple(j.strip() for j in jumps.split(",") if j.strip()
                         and jumps.strip().lower() != "none"),
    )


def import_paramiko() -> Any:
    """paramiko, imported without ``invoke``.

    paramiko's config module imports invoke (~120 ms, more than a third of paramiko's
    import) only to run ``Match exec`` lines; without it such a line fails with paramiko's
    own message. Imported on first need only: ds-run starts local jobs without it.
    """
    if "paramiko" not in sys.modules:
        blocked: Any = None  # None in sys.modules blocks an import (typeshed says modules only)
        sys.modules.setdefault("invoke", blocked)
        # paramiko logs every failed handshake with a traceback ("Error reading SSH
        # protocol banner"); ds-run reports each host's failure in one line instead
        import logging

        log = logging.getLogger("paramiko")
        log.addHandler(logging.NullHandler())
        log.propagate = False
    import paramiko

    return paramiko


def parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` → (user, host, port)."""
    user, _, rest = spec.rpartition("@")
    host, sep, port = rest.partition(":")
    return (user or None, host, int(port) if sep and port.isdigit() else None)


def _local_user() -> str:
    import getpass

    return getpass.getuser()
