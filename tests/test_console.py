"""The quiet console (observability/logs.py), the end-of-run summary (run/report.py) and the
evaluation's per-problem JSON with its progress bar (run/evaluate.py); all in-process."""
from __future__ import annotations

import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_async import cli
from megatron_async.run import TRAIN_STARTED_ENV
from megatron_async.config import load_config
from megatron_async.observability import logs
from megatron_async.observability.tracking import NullTracker
from megatron_async.run import report
from megatron_async.run.report import run_summary


@pytest.fixture
def fresh_logging():
    saved = dict(logs._state)
    logs._state.update(buffer=None, file=None, rank=0)
    logging.captureWarnings(False)  # an earlier setup_logging's capture is undone by pytest's per-test catch_warnings
    yield
    if logs._state["file"] is not None:
        logs._state["file"].close()
    logs._state.update(saved)
    logs.setup_logging()
    logging.captureWarnings(False)


def test_console_shows_ours_and_library_warnings_file_gets_everything(fresh_logging, tmp_path, capsys):
    logs.setup_logging("INFO", rank=0)
    logging.getLogger("megatron.core.optimizer").info("Setting up optimizer with config OptimizerConfig(lr=...)")
    warnings.warn("Transformer Engine and Apex are not installed.", UserWarning)  # before the file exists
    logging.getLogger("megatron_async.run.trainer").info("step 0 | reward 0.1")
    logging.getLogger("megatron.core.optimizer").warning("a library warning the user should see")
    logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
    console = capsys.readouterr().err
    assert "step 0 | reward 0.1" in console and "a library warning the user should see" in console
    for quiet in ("OptimizerConfig", "Transformer Engine", "MLflow database"):
        assert quiet not in console
    path = logs.attach_log_file(tmp_path / "run" / "train.log")
    logging.getLogger("megatron.core.distributed").info("Params for bucket 1 (135M elements)")
    text = path.read_text()
    for line in ("OptimizerConfig", "Transformer Engine and Apex", "step 0 | reward 0.1", "a library warning",
                 "MLflow database", "Params for bucket 1"):
        assert line in text, line  # buffered start-up records first, then everything after
    assert text.index("OptimizerConfig") < text.index("Params for bucket")
    assert logs.log_file() == path
    assert "Params for bucket" not in capsys.readouterr().err


def test_other_ranks_warn_only_and_write_their_own_file(fresh_logging, tmp_path, capsys):
    logs.setup_logging("INFO", rank=1)
    logging.getLogger("megatron_async.run.trainer").info("rank 1 info")
    logging.getLogger("megatron_async.run.trainer").warning("rank 1 warning")
    err = capsys.readouterr().err
    assert "rank 1 info" not in err and "[rank1]" in err and "rank 1 warning" in err
    path = logs.attach_log_file(tmp_path / "train.log")
    assert path.name == "train.rank1.log" and "rank 1 info" in path.read_text()


def tracker_at(uri: str) -> NullTracker:
    """A tracker whose run lives at `uri` (what the summary reads of a `Tracker`)."""
    tracker = NullTracker()
    tracker.uri, tracker.run_id = uri, "abc123"
    return tracker


def test_a_run_s_last_line_survives_a_terminal_pipe_that_is_gone(fresh_logging, tmp_path):
    """`megatron-async train ... 2>&1 | tee`, interrupted by Ctrl-C: tee is gone before the run
    says how it ended. `say` keeps the line in the log file and raises nothing (the run keeps its
    exit status), and the stream goes to /dev/null from then on."""
    logs.setup_logging("INFO", rank=0)
    logs.attach_log_file(tmp_path / "train.log")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (tee) is gone
    with open(write_end, "w") as stream:
        logs.say("megatron-async: interrupted (Ctrl-C)", stream)
        assert os.path.samestat(os.fstat(stream.fileno()), os.stat(os.devnull))
        logs.say("a second line", stream)  # and later writes raise nothing either
    assert "megatron-async: interrupted (Ctrl-C)" in (tmp_path / "train.log").read_text()


def test_run_summary_names_metric_wall_time_and_where_things_are(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=r", "trainer.algorithm=rloo", "trainer.steps=30"])
    uri = f"sqlite:///{tmp_path}/r/mlflow.db"
    text = run_summary(cfg, 200, 0.015, 0.03, wall_s=3000.0, png=cfg.run_dir / "training.png",
                       checkpoint=cfg.run_dir / "checkpoints" / "step_30", tracker=tracker_at(uri),
                       log_path=cfg.run_dir / "train.log")
    assert "pass@1 on 200 held-out problems: before 0.015 -> after 0.030 (+0.015" in text
    assert "wall time: 50.0 min" in text and f"checkpoint: {cfg.run_dir}/checkpoints/step_30" in text
    assert f"plot: {cfg.run_dir}/training.png" in text and f"final model (HF): {cfg.run_dir}/hf_final" in text
    assert f"MLflow run abc123 in {uri}" in text and f"open it: mlflow ui --backend-store-uri {uri}" in text
    assert f"{cfg.run_dir}/train.log" in text
    paired = {"up": 79, "down": 28, "mcnemar_p": 8.36e-7}
    text = run_summary(cfg, 512, 0.502, 0.602, None, None, None, tracker_at(uri), None, paired=paired)
    assert ("before 0.502 -> after 0.602 (+0.100; 79 problems wrong -> right, 28 right -> wrong, "
            "exact McNemar p = 8.4e-07)") in text
    server = run_summary(cfg, 8, None, 0.5, None, None, None, tracker_at("http://mlflow:5000"), None)
    assert "after training: 0.500" in server and "mlflow ui" not in server and "http://mlflow:5000" in server


def test_run_summary_says_what_its_wall_time_and_held_out_count_are(tmp_path, monkeypatch):
    """The wall time is the train command's (not its process's, which for launch/quickstart.sh began
    with the install); a resumed run's is its own command's and says so; a data.eval with fewer
    problems than data.eval_size is named with both numbers."""
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "data.eval=test.jsonl", "data.eval_size=64"])
    tracker = tracker_at("")
    text = run_summary(cfg, 2, 0.0, 0.5, wall_s=660.0, png=None, checkpoint=None, tracker=tracker, log_path=None)
    assert "pass@1 on 2 held-out problems (all of data.eval; data.eval_size asked for 64): before" in text
    assert "wall time: 11.0 min (since the train command started)" in text
    text = run_summary(cfg, 64, None, 0.5, wall_s=120.0, png=None, checkpoint=None, tracker=tracker, log_path=None,
                       resumed_at=40)
    assert "pass@1 on 64 held-out problems after training" in text
    assert ("wall time: 2.0 min of this command, which resumed the run at step 40 (the commands before it are not "
            "counted)") in text
    monkeypatch.setenv(TRAIN_STARTED_ENV, str(time.time() - 90))  # set by the CLI when `train` starts
    seconds = report._command_seconds()
    assert seconds is not None and 90 <= seconds < 90 + 60


CPU_TINY = str(Path(__file__).resolve().parents[1] / "configs" / "cpu_tiny.yaml")


def test_the_train_command_records_when_it_started_and_its_ranks_keep_it(fresh_logging, monkeypatch):
    """cli.main sets TRAIN_STARTED_ENV as it starts (replacing a value from the environment), before
    the launch, whose own imports take seconds; a rank it relaunched (LOCAL_RANK set) keeps its launcher's."""
    seen: list[float] = []

    def launch_main(cfg, config_path, overrides, nproc=None):
        seen.append(float(os.environ[TRAIN_STARTED_ENV]))
        return 0

    monkeypatch.setattr(cli, "_load", lambda module, what: SimpleNamespace(main=launch_main))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv(TRAIN_STARTED_ENV, "1.0")
    before = time.time()
    assert cli.main(["train", CPU_TINY]) == 0
    assert before <= seen[-1] <= time.time()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(TRAIN_STARTED_ENV, "123.0")
    cli.main(["train", CPU_TINY])
    assert seen[-1] == 123.0


# --------------------------------------------------------------------------- evaluation JSON


@dataclass
class _Record:
    token_ids: list
    policy_version: int = 0


class _FakePool:
    """Answers every prompt with a fixed completion (its token ids are characters)."""

    def __init__(self, answers: dict[int, str]):
        self.answers = answers
        self.calls: list = []

    def pids(self):
        return [1]

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        return [_Record([ord(c) for c in self.answers[p[0]]]) for p in prompts]


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_greedy_eval_lists_each_completion_and_verdict(capsys):
    from megatron_async.data import Problem, TokenizedPrompt
    from megatron_async.rewards.scorer import ExactMatchScorer
    from megatron_async.run.evaluate import EVAL_CHUNK, greedy_eval

    n = EVAL_CHUNK + 6
    prompts = [TokenizedPrompt(Problem(f"test:{i}", f"q{i}?", f"#### {i}", str(i)), f"q{i}?", [i]) for i in range(n)]
    answers = {i: (f"so it is {i}." if i % 3 else f"maybe {i + 1}") for i in range(n)}
    pool = _FakePool(answers)
    result = greedy_eval(pool, _CharTokenizer(), prompts, ExactMatchScorer(), "gsm8k_exact_match", 16,
                         progress=True, desc="eval test")
    assert pool.calls == [EVAL_CHUNK, 6]  # chunks: the progress bar's ticks
    assert "eval test" in capsys.readouterr().err  # the bar
    first, second = result["results"][:2]
    assert first == {"id": "test:0", "question": "q0?", "reference": "0", "completion": "maybe 1", "extracted": "1",
                     "reward": 0.0, "verdict": "wrong", "error": None, "policy_version": 0}
    assert second["verdict"] == "correct" and second["extracted"] == "1" and second["reward"] == 1.0
    right = sum(1 for i in range(n) if i % 3)
    assert result["pass@1"] == pytest.approx(right / n) and result["n"] == result["scored"] == n
    json.dumps(result)  # what --output and eval_<tag>.json write


def test_paired_test_pairs_the_verdicts():
    from megatron_async.run.evaluate import paired_test

    before = {"results": [{"id": str(i), "reward": float(i < 2)} for i in range(10)]}  # 0, 1 right
    after = {"results": [{"id": str(i), "reward": float(i in (1, 2, 3, 4, 5, 6))} for i in range(10)]}
    after["results"].append({"id": "10", "reward": 1.0})  # not in `before`: left out
    before["results"][9]["reward"] = None  # could not be scored before: left out
    c = paired_test(before, after)
    assert (c["paired"], c["both_right"], c["up"], c["down"]) == (9, 1, 5, 1)
    assert c["difference"] == pytest.approx(4 / 9) and c["mcnemar_p"] == pytest.approx(2 * 7 / 64)  # P(X<=1), n=6


def test_compare_evals_prints_the_paired_test(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_evals", Path(__file__).resolve().parents[1] / "tools"
                                                  / "compare_evals.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for tag, right in (("before", (0,)), ("after", (0, 1, 2))):
        results = [{"id": str(i), "reward": float(i in right)} for i in range(4)]
        (tmp_path / f"eval_{tag}.json").write_text(json.dumps({"pass@1": len(right) / 4, "scored": 4, "results": results}))
    assert mod.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "before: pass@1 0.2500" in out and "after : pass@1 0.7500" in out
    assert "wrong -> right 2, right -> wrong 0" in out and "exact McNemar p = 0.5" in out
