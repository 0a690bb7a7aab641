"""Atomic file and directory writes: a reader sees the old content or the new, never half of it."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def replace_dir(tmp: Path, dst: Path) -> Path:
    """Put the complete folder `tmp` at `dst`, replacing what is there, with renames only.

    Between the two renames `dst` is briefly absent, never half-written: a reader either finds
    the old folder, the new one, or none (and `<dst>.old` for the old one).
    """
    tmp, dst = Path(tmp), Path(dst)
    old = dst.with_name(f"{dst.name}.old")
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)
    return dst


@contextmanager
def atomic_directory(path: str | os.PathLike):
    """Yield a temporary sibling folder to fill; on success it replaces `path` in one rename.

    On an exception the temporary folder is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
