"""NVMe offload: tensors kept in files, read and written asynchronously by worker threads.

Each key is one file under the swapper's own directory (``<nvme_path>/deepshard-swap/
<job>-rank<N>-<what>-<pid>-<random>``), written and read with ``pwrite``/``pread`` from a
thread pool so that the optimizer can step one group while the next is read and the
previous written. The directory is removed when the swapper is closed or the process exits
(``initialize`` turns SIGTERM into a normal exit); a process killed outright leaves it,
and the next swapper of the same job and rank (a restart) removes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from deepshard.contract import RUN_ID
from deepshard.errors import UsageError

CHUNK = 64 << 20


class TensorSwapper:
    """Async file-backed storage for CPU tensors, keyed by name."""

    def __init__(self, nvme_path: str | os.PathLike, rank: int, name: str, threads: int = 2):
        base = Path(nvme_path)
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot use the NVMe offload directory ({exc.strerror})",
                             where=f"zero_optimization.*.nvme_path = {str(base)!r}",
                             hint="point nvme_path at a writable directory on the NVMe "
                                  "drive") from None
        job = os.environ.get(RUN_ID) or "nojob"
        root = base / "deepshard-swap"
        root.mkdir(exist_ok=True)
        prefix = f"{job}-rank{rank}-{name}-"
        _remove_stale(root, prefix)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvme-swap")
        self._sizes: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _cleanup, self._pool, self.directory)

    def path(self, key: str) -> Path:
        """The file holding ``key``."""
        return self.directory / f"{key}.swp"

    def write(self, key: str, tensor: torch.Tensor) -> Future:
        """Write ``tensor`` (CPU, contiguous) to ``key``'s file. The tensor must not change
        until the returned future is done, and its storage can no longer be resized (numpy
        holds its bytes)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only contiguous CPU tensors can be swapped")
        self._sizes[key] = tensor.numel() * tensor.element_size()
        return self._pool.submit(_pwrite, self.path(key), _bytes(tensor))

    def read(self, key: str, out: torch.Tensor) -> Future:
        """Read ``key`` into ``out`` (CPU, contiguous, of the size written)."""
        size = out.numel() * out.element_size()
        if self._sizes.get(key) != size:
            raise ValueError(f"swap key {key!r} holds {self._sizes.get(key)} bytes, not {size}")
        return self._pool.submit(_pread, self.path(key), _bytes(out))

    def nbytes(self) -> int:
        """Bytes held in files."""
        return sum(self._sizes.values())

    def close(self) -> None:
        """Wait for pending I/O and remove the swap directory."""
        self._finalizer()


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def _pwrite(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:done + CHUNK], done)
    finally:
        os.close(fd)


def _pread(path: Path, out: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:done + CHUNK]], done)
            if n == 0:
                raise OSError(f"{path}: file shorter than expected")
            done += n
    finally:
        os.close(fd)


def _remove_stale(root: Path, prefix: str) -> None:
    """Swap directories of this job and rank left by processes that are gone."""
    for entry in root.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cleanup(pool: ThreadPoolExecutor, directory: Path) -> None:
    pool.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)
