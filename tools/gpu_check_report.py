"""pytest plugin of tools/gpu_check.py's gpu_tests phase (`-p gpu_check_report`, tools/ on PYTHONPATH):
appends one JSON line per test outcome and per collection result to $GPU_CHECK_REPORT as soon as it
is known, so that a pytest run killed by the phase's budget still reports what passed (pytest's
junit report is written only when the whole session ends)."""
from __future__ import annotations

import json
import os


def _write(entry: dict) -> None:
    with open(os.environ["GPU_CHECK_REPORT"], "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()


def pytest_collection_finish(session) -> None:
    _write({"selected": [item.nodeid for item in session.items]})  # what should run (after -m gpu)


def pytest_collectreport(report) -> None:
    if report.failed or report.skipped:  # a module that cannot be collected, or skipped as a whole
        detail = str(report.longrepr)[-500:] if report.longrepr else ""
        _write({"test": report.nodeid, "collection": True, "outcome": "error" if report.failed else "skipped",
                "detail": detail})


def pytest_runtest_logreport(report) -> None:
    # setup / call / teardown: the call's outcome, or an error or skip of setup / teardown
    if report.when == "call" or report.failed or report.skipped:
        outcome = report.outcome if report.when == "call" else ("error" if report.failed else "skipped")
        detail = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            detail = str(report.longrepr[2])
        elif report.failed:
            detail = str(report.longrepr)[-500:]
        _write({"test": report.nodeid, "when": report.when, "outcome": outcome, "seconds": report.duration,
                "detail": detail})
