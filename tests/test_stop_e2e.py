"""End to end: real runs stopped by a signal (run/stop.py) save their place, clean up and resume exactly.

The learner sends the signal at a fixed point (run/faults.py MEGATRON_ASYNC_SIGNAL_DURING): to
itself, the launcher (a single-rank run has no other process of ours), as learner step 1 starts
training; to its whole process group, as `timeout` and `kill -TERM -PGID` do, inside step 1's
weight push (after its first tensor), once a checkpoint was saved (the processes of that save's
writer existed then; a group-wide signal killed megatron's results-queue server and the next save
failed with BrokenPipeError); and twice to the group, the second more than run/stop.py's
DUPLICATE_WINDOW_S after the first. Each run exits 75; the first two with one line naming the signal,
the step, the checkpoint at that boundary and how to continue, the third stopped at once with the
previous checkpoint. None leaves a /dev/shm segment, and each resumed run's steps match an
uninterrupted run's (RLOO on coin-flip answers, as tests/test_adaptive_e2e.py: the same seeds give
the same samples). Ctrl-C exits 130 with one line and no traceback.
"""
import glob
import re
from pathlib import Path

import pytest

from megatron_async.run.stop import EXIT_INTERRUPTED, EXIT_REQUEUE
from megatron_async.weights.host_memory import SHM_DIR, SHM_PREFIX
from tests.e2e_utils import RLOO, assert_trained, coin_flip_data, metrics, train

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # each runs `megatron-async train`

STEPS = 3
RUN = [*RLOO, f"trainer.steps={STEPS}", "trainer.checkpoint_every=0"]  # checkpoints: the final one, and the stop's
COMPARED = ("reward/mean", "train/loss", "kl/ref", "train/grad_norm", "train/tokens", "rollout/policy_version")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    train(out, *coin_flip_data(out), *RUN)
    assert_trained(out / "cpu_tiny", STEPS)
    return metrics(out / "cpu_tiny")


def leaked_segments() -> list[str]:
    """Weight-sync segments in /dev/shm whose sender no longer runs (the stopped run's would be
    among them; each run sweeps such leftovers of earlier ones at its start)."""
    paths = glob.glob(f"{SHM_DIR}/{SHM_PREFIX}*")
    return [p for p in paths if not Path(f"/proc/{p.removeprefix(f'{SHM_DIR}/{SHM_PREFIX}').split('-')[0]}").exists()]


def assert_resumed_as_uninterrupted(tmp_path, uninterrupted, overrides) -> None:
    """`--resume` the stopped run in `tmp_path`: every step's metrics match the uninterrupted run's."""
    train(tmp_path, *coin_flip_data(tmp_path), *RUN, *overrides, resume=True)
    run_dir = tmp_path / "cpu_tiny"
    assert_trained(run_dir, STEPS)  # history.json covers every step, the stopped run's and the resumed one's
    resumed = metrics(run_dir)
    for key in COMPARED:
        for step in range(STEPS):
            assert resumed[key][step] == pytest.approx(uninterrupted[key][step], rel=1e-5, abs=1e-6), (key, step)
    assert resumed["eval/pass_at_1_after"] == uninterrupted["eval/pass_at_1_after"]


TO_GROUP = {"MEGATRON_ASYNC_SIGNAL_TO": "group"}
SAVED_AFTER_STEP_0 = ["trainer.checkpoint_every=1"]  # checkpoints at every boundary: the group signal comes after one


@pytest.mark.parametrize("during, to, overrides, boundary", [("train:1", {}, [], 2), ("sync:1", TO_GROUP, SAVED_AFTER_STEP_0, 2)],
                         ids=["mid-step-to-the-launcher", "mid-sync-to-the-whole-group"])
def test_sigterm_saves_at_the_step_boundary_and_the_resumed_run_goes_on_as_if_uninterrupted(tmp_path, uninterrupted, during, to,
                                                                                             overrides, boundary):
    stopped = train(tmp_path, *coin_flip_data(tmp_path), *RUN, *overrides, env={"MEGATRON_ASYNC_SIGNAL_DURING": during, **to},
                    check=False)
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == EXIT_REQUEUE, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    line = re.search(r"megatron-async: stopped by SIGTERM at step (\d+) of 3; checkpoint (\S+); continue with: .* --resume", stopped.stderr)
    assert line and int(line[1]) == boundary, stopped.stderr[-3000:]
    run_dir = tmp_path / "cpu_tiny"
    assert line[2].endswith(f"step_{boundary:06d}")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{boundary:06d}"
    assert not leaked_segments(), leaked_segments()
    assert_resumed_as_uninterrupted(tmp_path, uninterrupted, overrides)


def test_a_second_sigterm_to_the_whole_group_stops_at_once_and_the_resumed_run_goes_on_as_if_uninterrupted(tmp_path, uninterrupted):
    # saves written in the foreground here, so that step 0's checkpoint is complete before the signals;
    # a background save that a stop at once cuts short leaves the one before it (test_checkpoint_async)
    stopped = train(tmp_path, *coin_flip_data(tmp_path), *RUN, *SAVED_AFTER_STEP_0, "trainer.async_save=false",
                    env={"MEGATRON_ASYNC_SIGNAL_DURING": "train:1,sync:1", **TO_GROUP}, check=False)
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == EXIT_REQUEUE, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert re.search(r"stopping at once: a second signal \(SIGTERM\); \d+ shared-memory segment\(s\) removed; "
                     r"the previous checkpoint is intact", stopped.stderr), stopped.stderr[-3000:]
    assert "megatron-async: stopped by" not in stopped.stderr
    run_dir = tmp_path / "cpu_tiny"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"  # step 0's, before the signals
    assert not leaked_segments(), leaked_segments()
    assert_resumed_as_uninterrupted(tmp_path, uninterrupted, SAVED_AFTER_STEP_0)


def test_ctrl_c_stops_with_one_line_and_no_traceback(tmp_path):
    stopped = train(tmp_path, *coin_flip_data(tmp_path), *RUN, env={"MEGATRON_ASYNC_SIGNAL_DURING": "train:1:SIGINT"},
                    check=False)
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == EXIT_INTERRUPTED, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert re.search(r"megatron-async: interrupted \(Ctrl-C\); no checkpoint was saved yet; continue with: .* --resume",
                     stopped.stderr), stopped.stderr[-3000:]
    assert not leaked_segments(), leaked_segments()
