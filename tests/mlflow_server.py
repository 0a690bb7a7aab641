"""A real `mlflow server` on 127.0.0.1 for tests: start, wait for /health, stop (whole group)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from megatron_async.learner.parallel import free_port


class MlflowServer:
    def __init__(self, store: Path, port: int | None = None):
        self.store, self.port = Path(store), port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "MlflowServer":
        mlflow = Path(sys.executable).with_name("mlflow")
        self.store.mkdir(parents=True, exist_ok=True)
        log = open(self.store / "server.log", "ab")
        self.proc = proc = subprocess.Popen(
            [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{self.store / 'mlflow.db'}",
             "--artifacts-destination", str(self.store / "artifacts"),
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.store / 'server.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=1)
                return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"mlflow server on port {self.port} not healthy after {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
