"""Experiment tracking: MLflow, buffered so that a flaky server never stops or loses a run.

`MlflowTracker` logs the flattened config as params, metrics by step and files as artifacts. The
default store is embedded: SQLite at `<run dir>/mlflow.db` with artifacts in `<run dir>/mlartifacts`;
open it with `mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db`. `tracking.uri` points
at a real MLflow server instead.

NOTE delivery: every call only appends to an in-memory outbox; a background thread sends the
outbox in batches. When the server is unreachable the thread warns once, keeps everything and
retries with backoff; training never waits on the network. At `close()` whatever still cannot be
delivered is written to `<run dir>/mlflow_pending.jsonl` (with a warning), and the next tracker
opened on the same run dir (`--resume`) delivers it first. Only one rank logs (`build_tracker`
returns a `NullTracker` elsewhere). Callers hold a `Tracker`, the protocol both satisfy.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megatron_async.observability.logs import route_through_root

if TYPE_CHECKING:
    from megatron_async.config import Config

log = logging.getLogger(__name__)

PENDING_FILE = "mlflow_pending.jsonl"
RUN_ID_FILE = "mlflow_run_id"


class Tracker(Protocol):
    """What the run logs to: `MlflowTracker` on the logging rank, `NullTracker` elsewhere. Every
    call returns at once (delivery is the tracker's business); `flush` waits for it."""

    @property
    def run_id(self) -> str | None: ...  # None: nothing is recorded
    @property
    def uri(self) -> str | None: ...  # where the runs are stored
    @property
    def resumed(self) -> bool: ...  # logging into a run opened before (its params are logged already)

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...
    def flush(self, timeout: float = 30.0) -> bool: ...
    def close(self) -> None: ...


class NullTracker:
    """Tracker of ranks that do not log, and of runs with tracking.enabled=false."""

    run_id: str | None = None
    uri: str | None = None
    resumed: bool = False

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...
    def flush(self, timeout: float = 30.0) -> bool:
        return True
    def close(self) -> None: ...


class MlflowTracker:
    def __init__(self, run_dir: str | os.PathLike, uri: str = "", experiment: str = "megatron_async",
                 run_name: str = "run", request_timeout_s: float = 5.0, retry_interval_s: float = 2.0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Fail fast inside one request; our own loop does the retrying, without blocking training.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, request_timeout_s))))
        from mlflow.tracking import MlflowClient  # mlflow (seconds to import) only where tracking is on

        route_through_root("mlflow")  # its own stderr handler would bypass the quiet console
        self.uri = uri or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.retry_interval_s = retry_interval_s
        self._outbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._outage_since: float | None = None
        self.run_id = self._open_run(experiment, run_name)
        self._load_pending()
        self._thread = threading.Thread(target=self._deliver_loop, name="mlflow-delivery", daemon=True)
        self._thread.start()

    # -- public API: all non-blocking -------------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        self._put("params", {k: str(v)[:6000] for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        ts = int(time.time() * 1000)
        self._put("metrics", [(k, float(v), ts, int(step)) for k, v in metrics.items() if v is not None])

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._put("artifact", (str(Path(path).resolve()), artifact_path))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the outbox is delivered; False if that did not happen within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._outbox and self._idle.is_set():
                    return True
            self._wake.set()
            time.sleep(0.05)
        return False

    def close(self, timeout: float = 30.0) -> None:
        delivered = self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout)
        if not delivered:
            self._save_pending()
        else:
            try:
                self.client.set_terminated(self.run_id)
            except Exception as e:  # the data is in; only the run status could not be set
                log.warning("MLflow: could not mark run %s finished: %s", self.run_id, e)

    # -- internals ----------------------------------------------------------------------------
    def _open_run(self, experiment: str, run_name: str) -> str:
        id_file = self.run_dir / RUN_ID_FILE
        self.resumed = id_file.exists()
        if self.resumed:  # a resumed run keeps logging into the same MLflow run
            return id_file.read_text().strip()
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            location = None
            if self.uri.startswith("sqlite:"):
                location = (self.run_dir / "mlartifacts").resolve().as_uri()
            exp_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            exp_id = exp.experiment_id
        run = self.client.create_run(exp_id, run_name=run_name)
        id_file.write_text(run.info.run_id)
        return run.info.run_id

    def _put(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._outbox.append((kind, payload))
            self._idle.clear()
        self._wake.set()

    def _deliver_loop(self) -> None:
        while True:
            self._wake.wait(timeout=self.retry_interval_s)
            self._wake.clear()
            self._deliver_once()
            if self._stop.is_set():
                return

    def _deliver_once(self) -> None:
        from mlflow.entities import Metric, Param

        while True:
            with self._lock:
                if not self._outbox:
                    self._idle.set()
                    return
                kind, payload = self._outbox[0]
            try:
                if kind == "metrics":
                    for i in range(0, len(payload), 1000):
                        chunk = [Metric(k, v, ts, s) for k, v, ts, s in payload[i:i + 1000]]
                        self.client.log_batch(self.run_id, metrics=chunk)
                elif kind == "params":
                    items = list(payload.items())
                    for i in range(0, len(items), 100):
                        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i:i + 100]])
                elif kind == "artifact":
                    self.client.log_artifact(self.run_id, payload[0], payload[1])
            except Exception as e:
                if _is_rejected(e):  # the server answered "no": retrying would loop forever
                    log.warning("MLflow rejected a %s item, dropping it: %s", kind, str(e)[:300])
                    with self._lock:
                        self._outbox.popleft()
                    continue
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    log.warning("MLflow unreachable (%s: %s); keeping metrics and retrying every %.0fs",
                                type(e).__name__, str(e)[:200], self.retry_interval_s)
                with self._lock:
                    self._idle.set()  # idle but not empty: flush() keeps waiting
                return
            with self._lock:
                self._outbox.popleft()
            if self._outage_since is not None:
                log.warning("MLflow reachable again after %.0fs; delivering buffered metrics",
                            time.monotonic() - self._outage_since)
                self._outage_since = None

    def _save_pending(self) -> None:
        with self._lock:
            items = list(self._outbox)
        if not items:
            return
        path = self.run_dir / PENDING_FILE
        with open(path, "a") as f:
            for kind, payload in items:
                f.write(json.dumps({"run_id": self.run_id, "kind": kind, "payload": payload}) + "\n")
        log.warning("MLflow still unreachable at close: %d undelivered items saved to %s; "
                    "they are sent when a run is resumed in this folder", len(items), path)

    def _load_pending(self) -> None:
        path = self.run_dir / PENDING_FILE
        if not path.exists():
            return
        with self._lock:
            for line in path.read_text().splitlines():
                item = json.loads(line)
                payload = item["payload"]
                if item["kind"] == "artifact":
                    payload = tuple(payload)
                elif item["kind"] == "metrics":
                    payload = [tuple(m) for m in payload]
                self._outbox.append((item["kind"], payload))
        path.unlink()
        log.info("MLflow: re-queued undelivered items from %s", path)


def _is_rejected(e: Exception) -> bool:
    """A request the store refused (e.g. changing a logged param), as opposed to an outage."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and e.error_code in (
        "INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE")


def build_tracker(cfg: Config, rank: int = 0) -> Tracker:
    """The MLflow tracker on the logging rank (global rank 0), a NullTracker elsewhere."""
    if rank != 0 or not cfg.tracking.enabled:
        return NullTracker()
    return MlflowTracker(cfg.run_dir, uri=cfg.tracking.uri, experiment=cfg.tracking.experiment,
                         run_name=cfg.run.name, request_timeout_s=cfg.tracking.flush_timeout_s)
