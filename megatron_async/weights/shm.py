"""Shared-memory carrier for weight sync to replicas on the learner's host.

The sender packs each bucket straight into a file in /dev/shm (`ShmSegment`, mode 0600, sized
for a bucket and reused for the sender's life; HostMemorySender alternates two) and sends the replica
only its path, size and CRC32 in the `/update_weights` request; the replica's weight-transfer
engine (weights/cpu_engine.py) maps the file read-only (`open_segment`) and copies the bucket's
tensors out. The bytes never cross a socket.

Safety:
- No bucket is overwritten while it is read: the sender rewrites a segment only after every
  replica answered the bucket in it, and the engine copies every tensor out of the segment.
- Cleanup: `ShmSegment.close()` (and a `weakref.finalize` at garbage collection or interpreter
  exit) unlinks the file; a replica's mapping then lives until it drops it at the end of the update.
  A run stopped at once (`run/stop.py`: os._exit runs no finalizers) calls `unlink_live_segments`
  first. Only a SIGKILLed sender leaves a `mas-wsync-<pid>-*` file behind, and the next run on the
  host removes it (`sweep_dead_segments`: ours by name and owner, whose pid no longer runs).
- Space: tmpfs pages are reserved up front (`posix_fallocate`), so a full /dev/shm is an error
  here, not a SIGBUS on a later write.
- Only files named `mas-wsync-*` directly under /dev/shm are opened on the replica side.
"""
from __future__ import annotations

import mmap
import os
import secrets
import weakref

SHM_DIR = "/dev/shm"
PREFIX = "mas-wsync-"
HEADER_SLACK = 1 << 20  # room for a bucket's safetensors header beyond its tensor bytes


_LIVE: set[str] = set()  # this process's segments, for `unlink_live_segments`


def _unlink(path: str) -> None:
    _LIVE.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmSegment:
    """Sender side: a reused, owner-only file in /dev/shm; `buffer(n)` returns its first n bytes."""

    def __init__(self, initial_bytes: int):
        self.initial_bytes = initial_bytes + HEADER_SLACK
        self.path: str | None = None
        self.size = 0
        self._mm: mmap.mmap | None = None
        self._finalizer: weakref.finalize | None = None

    def buffer(self, nbytes: int) -> memoryview:
        """A writable view of `nbytes`; replaces the file by a larger one if it does not fit."""
        if self._mm is None or nbytes > self.size:
            self._create(max(nbytes, self.initial_bytes))
        assert self._mm is not None  # made by _create
        return memoryview(self._mm)[:nbytes]

    def _create(self, size: int) -> None:
        self.close()
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _LIVE.add(path)
        finalizer = weakref.finalize(self, _unlink, path)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(
                    e.errno, f"cannot reserve {size / 2**20:.0f} MiB in {SHM_DIR} ({free_bytes() / 2**20:.0f} MiB free): "
                    f"lower rollout.sync_bucket_mb or set rollout.weight_transport=http"
                ) from e
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            finalizer()
            raise
        finally:
            os.close(fd)
        self.path, self.size, self._finalizer = path, size, finalizer

    def close(self) -> None:
        """Unlink the file; the mapping goes when the last view of it does."""
        if self._finalizer is not None:
            self._finalizer()
        # NOTE: no mmap.close(): a bucket's memoryview may still be alive (BufferError); dropping
        # the reference unmaps it once the views are gone.
        self._mm, self.path, self.size, self._finalizer = None, None, 0, None


def unlink_live_segments() -> int:
    """Unlink every segment this process still holds (a stop at once); returns how many."""
    paths = list(_LIVE)
    for path in paths:
        _unlink(path)
    return len(paths)


def sweep_dead_segments(shm_dir: str = SHM_DIR) -> tuple[int, int]:
    """Remove the segments of senders that are gone: `mas-wsync-<pid>-*` files directly in `shm_dir`,
    owned by this user, whose pid no longer runs. Returns (files, bytes) removed."""
    files = freed = 0
    uid = os.getuid()
    for entry in os.scandir(shm_dir):
        pid_text = entry.name.removeprefix(PREFIX).split("-", 1)[0]
        if not entry.name.startswith(PREFIX) or not pid_text.isdigit() or not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        if st.st_uid != uid or _pid_runs(int(pid_text)):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:  # another run's sweep was first
            continue
        files, freed = files + 1, freed + st.st_size
    return files, freed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def free_bytes() -> int:
    """Space left in /dev/shm (a container's is often only 64 MiB)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def open_segment(path: str) -> mmap.mmap:
    """Replica side: map a sender's segment read-only; clear errors for a bad or missing path."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"refusing shared-memory path {path!r}: not a {SHM_DIR}/{PREFIX}* segment")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {path} not found: the sender closed it, or the replica is not on "
            f"the sender's host (use rollout.weight_transport=http)"
        ) from None
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
