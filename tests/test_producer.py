"""The producer's admission logic (unit tests with a fake batch maker; the real pool is tested in
test_rollout_pool.py and end to end in test_train_e2e.py)."""
import threading
import time

import pytest

from megatron_async.rollout.producer import RolloutBatch, RolloutProducer


class Recorder:
    """make_batch that records which batches started, and the version the learner had announced
    (`sync`) when each started: an admission check at the moment of the start, not after a sleep."""

    def __init__(self, fail_at=None):
        self.started: list[int] = []
        self.started_under: dict[int, int] = {}
        self.announced = 0
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def __call__(self, index):
        if index == self.fail_at:
            raise ValueError("replica exploded")
        with self.lock:
            self.started.append(index)
            self.started_under[index] = self.announced
        # the replicas hold the announced version: the batch's completions report it
        return RolloutBatch(index=index, policy_version=self.announced, problems=[], samples=[])


def sync(prod, maker, version):
    """The learner's push: announced to the maker BEFORE the producer may admit under it."""
    maker.announced = version
    prod.notify_synced(version)


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("max_lag", [0, 1, 2])
def test_batches_get_version_b_minus_lag_and_wait_for_it(max_lag):
    """The learner as Trainer drives it: it pushes version step + 1 only once `old_weights_done(step)`
    (every batch that may use version step is generated). Then batch b gets exactly
    max(0, b - max_lag), however late the producer thread is scheduled."""
    maker = Recorder()
    prod = RolloutProducer(maker, max_lag=max_lag, last_batch=5).start()
    try:
        for step in range(6):
            assert wait_until(lambda: prod.has(step))
            batch = prod.take(step)
            assert batch.index == step and batch.policy_version == max(0, step - max_lag)
            assert step - batch.policy_version <= max_lag
            assert wait_until(lambda: prod.old_weights_done(step))
            # admission: nothing that would need a version the replicas do not hold has started
            assert max(maker.started) <= step + max_lag
            sync(prod, maker, step + 1)
        assert maker.started == list(range(6))  # and nothing past last_batch
        # each batch started only once the version it needs was announced, and under that version
        assert maker.started_under == {b: max(0, b - max_lag) for b in range(6)}
    finally:
        prod.stop()


class Gate(Recorder):
    """make_batch that blocks until released: a batch stays in flight for as long as a test needs."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def __call__(self, index):
        batch = super().__call__(index)
        assert self.release.wait(5)
        self.release.clear()
        return batch


@pytest.mark.parametrize("during", [False, True])
def test_push_waits_for_the_batch_in_flight_only_between_batches(during):
    """max_lag=1, batch 1 in flight under v0: the learner may push v1 at once only when updates
    during generation are on (the running batch then takes the new weights); between batches it
    waits until batch 1 is generated."""
    maker = Gate()
    prod = RolloutProducer(maker, max_lag=1, last_batch=3, updates_during_generation=during).start()
    try:
        maker.release.set()  # batch 0
        assert wait_until(lambda: prod.has(0) and maker.started == [0, 1])
        assert not prod.has(1)  # batch 1 runs, held by the gate: its make_batch has been called
        assert prod.old_weights_done(0) is during
        maker.release.set()
        assert wait_until(lambda: prod.has(1))
        assert prod.old_weights_done(0)
        assert not prod.old_weights_done(1)  # batch 2 needs v1 and is not admitted before it is pushed
    finally:
        maker.release.set()
        prod.stop()


def test_resume_with_buffered_batches():
    maker = Recorder()
    maker.announced = 4  # the checkpoint's version, which the replicas hold after the resume
    saved = [RolloutBatch(index=4, policy_version=3, problems=[], samples=[])]
    prod = RolloutProducer(maker, max_lag=1, last_batch=7, first_batch=4, synced_version=4, ready=saved).start()
    try:
        assert prod.take(4) is saved[0]
        assert wait_until(lambda: prod.has(5))
        assert prod.take(5).policy_version == 4
        assert wait_until(lambda: prod.old_weights_done(4))
        sync(prod, maker, 5)
        assert wait_until(lambda: prod.has(6))
        assert prod.take(6).policy_version == 5
        assert maker.started_under == {5: 4, 6: 5}  # batch 6 started only once version 5 was announced
    finally:
        prod.stop()


def test_errors_reach_the_learner():
    prod = RolloutProducer(Recorder(fail_at=1), max_lag=1, last_batch=5).start()
    try:
        assert wait_until(lambda: prod._error is not None)
        with pytest.raises(RuntimeError, match="replica exploded"):
            prod.has(0)
    finally:
        prod.stop()


def test_a_batch_with_completions_older_than_admitted_stops_the_run():
    """The batch's version is what its completions report, checked against the version it was
    admitted under (never overwritten): tokens of an older policy than the lag allows are an error."""
    class Stale(Recorder):
        def __call__(self, index):
            batch = super().__call__(index)
            batch.policy_version = self.announced - 1 if index == 2 else batch.policy_version
            return batch

    maker = Stale()
    prod = RolloutProducer(maker, max_lag=1, last_batch=3).start()
    try:
        assert wait_until(lambda: prod.has(0)) and prod.take(0).policy_version == 0
        assert wait_until(lambda: prod.old_weights_done(0))
        sync(prod, maker, 1)  # batch 2 is admitted under v1 and reports v0
        assert wait_until(lambda: prod._error is not None)
        with pytest.raises(RuntimeError, match="batch 2: completions of policy version 0, older than v1"):
            prod.has(2)
    finally:
        prod.stop()


def test_stop_ends_a_waiting_thread():
    prod = RolloutProducer(Recorder(), max_lag=0, last_batch=100).start()
    assert wait_until(lambda: prod.has(0))
    prod.stop(timeout=5)
    assert not prod._thread.is_alive()


def test_a_batch_that_fails_after_a_stop_request_is_the_stop_not_an_error(caplog):
    """RolloutState.close asks the producer to stop, then stops the replicas: the batch under way
    fails then (PoolError), which is the stop's doing, logged as such, not the producer failing."""
    started, replicas_stopped = threading.Event(), threading.Event()

    def make_batch(index):
        started.set()
        assert replicas_stopped.wait(60)
        raise RuntimeError("pool stopped with 4 of 4 prompts unfinished")

    prod = RolloutProducer(make_batch, max_lag=0, last_batch=3).start()
    assert started.wait(60)
    prod.request_stop()
    replicas_stopped.set()
    with caplog.at_level("INFO", logger="megatron_async.rollout.producer"):
        prod.stop(timeout=60)
    assert not prod._thread.is_alive() and prod._error is None
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "the batch under way ended with the stop (pool stopped" in caplog.text
