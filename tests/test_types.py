"""The type check's contract (mypy.ini; CI runs `mypy megatron_async tests` before them, .ci/run):
mypy refuses what the typed seams forbid, and accepts their intended use. In-process (`mypy.api`),
on snippets that import only the two typed modules (everything else is skipped), so it takes a second."""
from __future__ import annotations

from pathlib import Path

from mypy import api

REPO = Path(__file__).resolve().parents[1]


def check(tmp_path: Path, snippet: str) -> tuple[int, str]:
    """mypy with the project's settings over `snippet`; only the Microbatch and Tracker modules are followed."""
    config = (REPO / "mypy.ini").read_text().replace("follow_imports = silent", "follow_imports = skip")
    config += "\n[mypy-megatron_async.algorithms.base,megatron_async.observability.tracking]\nfollow_imports = silent\n"
    (tmp_path / "mypy.ini").write_text(config)
    out, err, status = api.run(["--config-file", str(tmp_path / "mypy.ini"), "--cache-dir", str(tmp_path / "cache"),
                                "-c", snippet])
    return status, out + err


HEADER = """
import torch
from megatron_async.algorithms.base import Microbatch, attach
from megatron_async.observability.tracking import MlflowTracker, NullTracker, Tracker
"""


def test_mypy_refuses_a_write_into_a_built_microbatch_an_unknown_key_and_a_non_tracker(tmp_path):
    status, out = check(tmp_path, HEADER + """
def write(mb: Microbatch) -> None:
    mb["advantages"] = torch.zeros(1)  # only `attach` adds fields

def typo(mb: Microbatch) -> int:
    return mb["real_row"]

def unknown(mbs: list[Microbatch]) -> None:
    attach(mbs, "advantage", [torch.zeros(1)])

class NotATracker:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

t: Tracker = NotATracker()

def test_unannotated():  # a pytest test: its body is checked too (check_untyped_defs)
    tracker: Tracker = NotATracker()
""")
    assert status == 1, out
    assert 'ReadOnly TypedDict key "advantages" TypedDict is mutated' in out
    assert 'TypedDict "Microbatch" has no key "real_row"' in out
    assert 'Argument 2 to "attach" has incompatible type' in out
    not_a_tracker = 'Incompatible types in assignment (expression has type "NotATracker", variable has type "Tracker")'
    assert out.count(not_a_tracker) == 2, out
    assert "Found 5 errors" in out, out


def test_mypy_accepts_the_seams_used_as_intended(tmp_path):
    status, out = check(tmp_path, HEADER + """
def advantages(mbs: list[Microbatch]) -> torch.Tensor:
    attach(mbs, "advantages", [mb["rewards"] - mb["rewards"].mean() for mb in mbs])
    return mbs[0]["advantages"] * mbs[0]["real_rows"]

def trackers(mlflow: MlflowTracker) -> list[Tracker]:
    return [mlflow, NullTracker()]
""")
    assert status == 0, out


def test_ci_type_checks_the_package_and_the_tests_before_the_tests():
    ci = (REPO / ".ci" / "run").read_text()
    assert "-m mypy megatron_async tests" in ci and ci.index("-m mypy megatron_async tests") < ci.index("launch/test.sh")
