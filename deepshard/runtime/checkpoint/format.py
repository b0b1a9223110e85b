"""Checkpoint files: one directory per tag, written atomically, with a JSON manifest.

Layout of ``<save_dir>``::

    latest                      the newest complete tag (text), replaced atomically, last
    <tag>/manifest.json         world size, ZeRO stage, dtypes, step, deepshard version, files
    <tag>/model_states.pt       what every rank shares (stage 0: module, fp32 masters,
                                optimizer, scheduler, loss scaler, counters, client_state)
    <tag>/rank_00000.pt ...     what each rank alone holds (RNG states; ZeRO: its shards,
                                see ``zero_shards.py``)

Saving writes everything into ``.<tag>.partial``, then the manifest, fsyncs, and renames the
directory to ``<tag>``; only then is ``latest`` replaced. A process killed at any point
leaves the previous checkpoint and ``latest`` intact; a directory without a manifest is
never loaded. The save directory must be shared by all ranks (as with DeepSpeed).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepshard.errors import UsageError

FORMAT = 1
MANIFEST = "manifest.json"
LATEST = "latest"
SHARED_FILE = "model_states.pt"


def rank_file(rank: int) -> str:
    """Name of one rank's file inside a tag directory."""
    return f"rank_{rank:05d}.pt"


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds; written last, so its presence means complete."""

    tag: str
    world_size: int
    zero_stage: int
    param_dtype: str
    master_dtype: str | None
    global_steps: int
    deepshard_version: str
    files: tuple[str, ...]
    format: int = FORMAT
    created_unix: float = 0.0
    # model parallelism: {"pipe": P, "data": D, "tensor": T}; world_size is then P*D*T
    layout: dict | None = None
    # saved with exclude_frozen_parameters: parameters not requiring grad are left out
    frozen_excluded: bool = False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: object, path: Path, pickle_module: Any = None) -> None:
    try:
        with open(path, "wb") as f:
            if pickle_module is None:
                torch.save(obj, f)
            else:
                torch.save(obj, f, pickle_module=pickle_module)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as exc:  # torch's writer reports the OSError it met as this
        cause = _os_error(exc)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from exc


def check_tag(tag: object) -> str:
    """A tag as a directory name, or a UsageError."""
    text = str(tag)
    if not text or text in (LATEST, ".", "..") or "/" in text or text.startswith("."):
        raise UsageError(f"checkpoint tag {text!r} cannot be a directory name here",
                         where="tag", hint="use a plain name such as 'global_step100', not "
                                           "'latest', empty, or with '/' or a leading '.'")
    return text


Agree = Callable[[str | None], str | None]
"""Collective: every rank passes its failure (or ``None``) and gets the first rank's
failure back, or ``None`` when every rank succeeded; it doubles as a barrier."""


def save(save_dir: str | os.PathLike, manifest: Manifest, *, rank: int,
         shared: Mapping[str, object] | None, own: Mapping[str, object],
         agree: Agree, save_latest: bool = True) -> Path:
    """Write one checkpoint collectively; every rank calls this, rank 0 commits it.

    ``shared`` is written by rank 0 only; ``own`` by every rank. ``latest`` is pointed at
    the new tag unless ``save_latest`` is false. Returns the tag directory.

    Raises:
        UsageError: on every rank, when any rank could not write (a full disk, no
            permission, a read-only file system): one line naming the path and the cause.
            The partial directory is removed; the previous checkpoint stays loadable.
    """
    files: dict[str, object] = {rank_file(rank): dict(own)}
    if rank == 0 and shared is not None:
        files[SHARED_FILE] = dict(shared)
    return write_tag(save_dir, manifest.tag, rank=rank, files=files, agree=agree,
                     save_latest=save_latest, manifest=manifest)


def write_tag(save_dir: str | os.PathLike, tag: str, *, rank: int,
              files: Mapping[str, object], agree: Agree, save_latest: bool = True,
              manifest: Manifest | None = None, pickle_module: Any = None) -> Path:
    """Write one tag directory collectively and atomically: every rank writes its
    ``files`` (name → object, ``torch.save``-d with ``pickle_module`` if given) into a
    partial directory; rank 0 then writes ``manifest`` (if any), swaps the directory in
    and points ``latest`` at it (unless ``save_latest`` is false). Errors as :func:`save`."""
    root = Path(save_dir)
    final, partial = root / tag, root / f".{tag}.partial"

    def start() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()

    def write() -> None:
        for name, obj in files.items():
            _save_file(obj, partial / name, pickle_module)

    _step(agree, start if rank == 0 else None, root, partial, rank)
    _step(agree, write, partial, partial, rank)
    _step(agree, (lambda: _commit(root, final, partial, tag, manifest, save_latest))
          if rank == 0 else None, final, partial, rank)
    return final


def _step(agree: Agree, action: Callable[[], None] | None, where: Path, partial: Path,
          rank: int) -> None:
    """Run ``action`` (when this rank has one), then agree with every rank on whether all
    succeeded; on a failure anywhere, clean up and raise the same one-line error."""
    failure = None
    if action is not None:
        try:
            action()
        except OSError as exc:
            failure = f"{exc.filename or where}: cannot write the checkpoint: " \
                f"{exc.strerror or exc}"
    failure = agree(failure)
    if failure is None:
        return
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        with contextlib.suppress(OSError):
            (partial.parent / f".{LATEST}.tmp").unlink(missing_ok=True)
    raise UsageError(failure, hint="free space on that file system or pass a writable "
                                   "save_dir; the previous checkpoint is intact")


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError ``exc`` was raised from or while handling, if any."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


def _commit(root: Path, final: Path, partial: Path, tag: str, manifest: Manifest | None,
            save_latest: bool) -> None:
    if manifest is not None:
        with open(partial / MANIFEST, "w") as f:
            f.write(json.dumps(asdict(manifest), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(partial)
    if final.exists():
        # one atomic swap: at every instant either the old or the new tag is complete
        _exchange(partial, final)
        _fsync_dir(root)
        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.rename(final)
        _fsync_dir(root)
    if not save_latest:
        return
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories atomically (Linux renameat2 RENAME_EXCHANGE)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def full_precision(shared: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The module's state from a loaded ``model_states.pt`` with fp32 masters substituted
    for the half-precision values they shadow."""
    masters = shared.get("fp32_masters") or {}
    return {name: masters.get(name, value) for name, value in shared["module"].items()}


def read_manifest(tag_dir: Path) -> Manifest | None:
    """The manifest of a complete checkpoint, or ``None`` when it is incomplete."""
    try:
        data = json.loads((tag_dir / MANIFEST).read_text())
        data["files"] = tuple(data["files"])
        return Manifest(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def complete_tags(load_dir: Path) -> list[tuple[int, str]]:
    """``(global_steps, tag)`` of every complete checkpoint, newest first."""
    found = []
    if load_dir.is_dir():
        for entry in load_dir.iterdir():
            if entry.is_dir() and not entry.name.startswith("."):
                manifest = read_manifest(entry)
                if manifest is not None:
                    found.append((manifest.global_steps, entry.name))
    return sorted(found, reverse=True)


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> Manifest | None:
    """The manifest to load: ``tag``, else ``latest``, else the newest complete tag.

    Returns ``None`` when ``tag`` is ``None`` and there is no complete checkpoint at all.
    """
    root = Path(load_dir)
    if tag is not None:
        manifest = read_manifest(root / tag)
        if manifest is None:
            have = ", ".join(t for _, t in complete_tags(root)) or "none"
            raise UsageError(f"no complete checkpoint with tag {tag!r}", where=str(root / tag),
                             hint=f"complete tags here: {have}")
        return manifest
    try:
        latest = (root / LATEST).read_text().strip()
    except OSError:
        latest = ""
    manifest = read_manifest(root / latest) if latest else None
    if manifest is None:
        tags = complete_tags(root)
        manifest = read_manifest(root / tags[0][1]) if tags else None
    return manifest


def load_file(tag_dir: Path, name: str, mmap: bool = False) -> dict:
    """One file of a checkpoint (our own files: full unpickling, not ``weights_only``);
    ``mmap``: tensors stay in the file until read."""
    try:
        return torch.load(tag_dir / name, map_location="cpu", weights_only=False, mmap=mmap)
    except (OSError, RuntimeError, EOFError) as exc:
        raise UsageError(f"cannot read checkpoint file ({exc})", where=str(tag_dir / name),
                         hint="the checkpoint is damaged: load an older tag") from None


def rng_states() -> dict:
    """Every RNG a training step can draw from, for an exact resume."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(),
              "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_states` captured."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def now() -> float:
    """Wall-clock time for the manifest."""
    return time.time()
