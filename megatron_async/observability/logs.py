"""Logging set-up shared by every entry point: a quiet console, everything in the run's log file.

    setup_logging(level)                 # at start-up (cli.py): console handler, file records buffered
    attach_log_file(run_dir / "train.log")   # once the run may start (run/launch.py, after preflight)

The console (stderr) shows this project's records (`megatron_async.*`) at `level` (INFO by
default) and other libraries' at WARNING and above; megatron-core's INFO output (its config dumps,
the DDP bucket listing) and every Python `warnings` warning (captured: "Transformer Engine and
Apex are not installed", deprecations, ...) go to the log file only. The file gets every record at
INFO and above (DEBUG with level=DEBUG) from every logger; records logged before it is attached are
buffered and written first, so it also holds the start-up. Progress bars (tqdm) are not logging:
they stay on the terminal; so are results and a run's last line (`say`: printed as they are, and
copied to the log file). Non-zero ranks log warnings and above only on the console and write
`train.rank<N>.log`.
"""
from __future__ import annotations

import collections
import logging
import os
import sys
from pathlib import Path
from typing import TextIO

OWN = "megatron_async"
FORMAT = "%(asctime)s %(levelname).1s [rank{rank}] %(name)s: %(message)s"
_state: dict = {"rank": 0, "buffer": None, "file": None}


class _Buffer(logging.Handler):
    """Records held until the log file is attached (the newest `capacity` of them)."""

    def __init__(self, capacity: int = 20_000):
        super().__init__()
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _ConsoleFilter(logging.Filter):
    """Our records at the chosen level; libraries' at WARNING+; captured `warnings` never."""

    def __init__(self, own_level: int):
        super().__init__()
        self.own_level = own_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":
            return False
        if record.name == OWN or record.name.startswith(OWN + "."):
            return record.levelno >= self.own_level
        return record.levelno >= logging.WARNING


def setup_logging(level: str | None = None, rank: int | None = None) -> None:
    """Configure the root logger (again on each call). Level: `level`, else
    $MEGATRON_ASYNC_LOG_LEVEL, else INFO; non-zero ranks show warnings and above only."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    requested = logging.getLevelName((level or os.environ.get("MEGATRON_ASYNC_LOG_LEVEL", "INFO")).upper())
    requested = requested if isinstance(requested, int) else logging.INFO
    own_level = requested if rank == 0 else max(requested, logging.WARNING)
    file_level = min(requested, logging.INFO)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        if h is not _state["file"]:
            h.close()
    fmt = logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S")
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    console.addFilter(_ConsoleFilter(own_level))
    root.addHandler(console)
    if _state["file"] is not None:
        _state["file"].setFormatter(fmt)
        root.addHandler(_state["file"])
    else:  # hold file records until `attach_log_file` (the run directory may not exist yet)
        buffer = _state["buffer"] or _Buffer()
        buffer.setLevel(file_level)
        buffer.setFormatter(fmt)
        root.addHandler(buffer)
        _state["buffer"] = buffer
    _state["rank"] = rank
    root.setLevel(file_level)
    logging.captureWarnings(True)
    for noisy in ("urllib3", "alembic", "filelock", "httpx", "matplotlib", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # MLflow installs its own stderr handler ("INFO mlflow.store.db.utils: Creating initial MLflow
    # database tables"); route it through ours (console: warnings; file: everything).
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    if "mlflow" in sys.modules:
        route_through_root("mlflow")


def route_through_root(name: str) -> None:
    """A library logger that installed its own console handler (MLflow does, on import) logs
    through ours instead: call after importing the library."""
    lib = logging.getLogger(name)
    for h in list(lib.handlers):
        lib.removeHandler(h)
    lib.propagate = True


def attach_log_file(path: str | os.PathLike) -> Path:
    """Write every record (see module docstring) to `path` from now on, after those buffered so far.
    Non-zero ranks write `<stem>.rank<N><suffix>` next to it. Returns the file's path."""
    path = Path(path)
    rank = _state["rank"]
    if rank != 0:
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    buffer = _state["buffer"]
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(buffer.level if buffer is not None else logging.INFO)
    handler.setFormatter(buffer.formatter if buffer is not None else logging.Formatter(FORMAT.format(rank=rank)))
    if _state["file"] is not None:
        root.removeHandler(_state["file"])
        _state["file"].close()
    if buffer is not None:
        root.removeHandler(buffer)
        for record in buffer.records:
            handler.handle(record)
        _state["buffer"] = None
    root.addHandler(handler)
    _state["file"] = handler
    return path


def say(text: str, stream: TextIO | None = None) -> None:
    """Print `text` (default: to stdout) as it is, not as a log record, and copy it to the log file.

    A terminal pipe whose reader is gone costs the printed copy only: `megatron-async train ...
    2>&1 | tee out.log` interrupted by Ctrl-C loses its tee first, and the run must still end with
    its own exit status, not a BrokenPipeError. That stream then goes to /dev/null, as Python's
    documentation advises (the interpreter's flush at exit would fail the same way)."""
    stream = stream or sys.stdout
    if _state["file"] is not None:
        _state["file"].handle(logging.makeLogRecord({"name": OWN, "levelno": logging.INFO, "levelname": "INFO",
                                                    "msg": text}))
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def log_file() -> Path | None:
    """The attached log file, if any."""
    return Path(_state["file"].baseFilename) if _state["file"] is not None else None
