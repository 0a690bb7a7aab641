"""MLflow tracking against a real `mlflow server` on 127.0.0.1, including a server outage."""
import logging

import pytest
from mlflow.tracking import MlflowClient

from megatron_async.observability.tracking import PENDING_FILE, MlflowTracker
from tests.mlflow_server import MlflowServer


def steps_of(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_embedded_sqlite_store(tmp_path):
    t = MlflowTracker(tmp_path / "run", run_name="embedded")
    t.log_params({"trainer.lr": 1e-5, "rollout.k": 4})
    for step in range(3):
        t.log_metrics({"reward/mean": 0.1 * step}, step)
    art = tmp_path / "eval.json"
    art.write_text('{"pass@1": 0.5}')
    t.log_artifact(art)
    t.close()
    client = MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run = client.get_run(t.run_id)
    assert run.data.params["trainer.lr"] == "1e-05" and run.info.status == "FINISHED"
    assert steps_of(client, t.run_id, "reward/mean") == [0, 1, 2]
    assert [a.path for a in client.list_artifacts(t.run_id)] == ["eval.json"]


@pytest.mark.integration  # a real `mlflow server` process
def test_server_outage_loses_nothing(tmp_path, caplog):
    server = MlflowServer(tmp_path / "server").start()
    run_dir = tmp_path / "run"
    try:
        t = MlflowTracker(run_dir, uri=server.uri, run_name="outage", request_timeout_s=1, retry_interval_s=0.5)
        t.log_params({"trainer.lr": 1e-5})
        for step in range(5):
            t.log_metrics({"loss": float(step)}, step)
        assert t.flush(30)

        server.stop()  # the server dies mid-run; training goes on
        with caplog.at_level(logging.WARNING, logger="megatron_async.observability.tracking"):
            for step in range(5, 10):
                t.log_metrics({"loss": float(step)}, step)
            assert not t.flush(3)  # nothing can be delivered while it is down
            assert "MLflow unreachable" in caplog.text

            server.start()  # back on the same port and store: the buffer is delivered
            assert t.flush(60)
            assert "reachable again" in caplog.text
        client = MlflowClient(server.uri)
        assert steps_of(client, t.run_id, "loss") == list(range(10))

        server.stop()  # down again at the end of the run: kept on disk, sent on resume
        t.log_metrics({"loss": 10.0}, 10)
        t.close(timeout=3)
        assert (run_dir / PENDING_FILE).exists()

        server.start()
        resumed = MlflowTracker(run_dir, uri=server.uri, run_name="outage")
        assert resumed.run_id == t.run_id
        resumed.log_metrics({"loss": 11.0}, 11)
        resumed.close()
        assert not (run_dir / PENDING_FILE).exists()
        assert steps_of(MlflowClient(server.uri), t.run_id, "loss") == list(range(12))
    finally:
        server.stop()
