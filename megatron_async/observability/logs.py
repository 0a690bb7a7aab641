"""Logging set-up shared by every entry point: levels, a rank prefix, quiet third-party loggers."""
from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None, rank: int | None = None) -> None:
    """Configure the root logger once. Non-zero ranks log warnings and above only.

    Level: `level`, else $MEGATRON_ASYNC_LOG_LEVEL, else INFO.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = (level or os.environ.get("MEGATRON_ASYNC_LOG_LEVEL", "INFO")).upper()
    if rank != 0 and level in ("DEBUG", "INFO"):
        level = "WARNING"
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname).1s [rank{rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for noisy in ("urllib3", "alembic", "mlflow", "filelock", "httpx", "matplotlib", "datasets"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
