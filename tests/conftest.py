"""Test tiers (markers in pytest.ini) and the fixtures shared across modules.

Tiers:
  fast tier    `-m "not integration"`: in-process tests (losses, batching, algorithms, config, data,
               rewards, mapping, placement, the producer with fakes). They start no process: the
               guard below fails a test that does, naming what it started.
  integration  every test that starts a process: vLLM replicas (ReplicaPool), torchrun / megatron
               workers (tests/dist), an `mlflow server`, the reward-model worker, the CLI as a
               subprocess. `slow` marks the longest of them (whole training runs); conftest adds
               `integration` to every `slow` test.
  recipe       the main job's shipped recipe end to end (~10 min, slow too): left out of every run
               that names no `-m`, CI's included (pytest.ini's addopts); `-m recipe` runs it.

How a test is marked: a module that is wholly integration says `pytestmark = pytest.mark.integration`;
a mixed module marks its tests one by one. Modules edited by others (MARKED_HERE) are marked by
the hook below instead; move their mark into the module when it is next edited.

Helpers for the tests live next to this file: tests/rollout_fixtures.py (tiny checkpoints, the
transformers reference, replica specs), tests/e2e_utils.py (run `megatron-async train`, read its
metrics, check that it trained), tests/mlflow_server.py, tests/dist/ (worker scripts).
"""
from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import subprocess
from pathlib import Path

import pytest

# Modules marked here rather than in the module (it was being edited elsewhere when the tiers came
# in): file name -> the tests in it that start NO process (so stay in the fast tier); every other
# test in the module is marked integration. A test renamed or added there thus lands in the
# integration tier, never in the fast one by mistake. (tests/test_algorithms.py starts no process;
# tests/test_gpu_*.py carry their own `pytestmark`.)
MARKED_HERE: dict[str, set[str]] = {
    # run_worker (tests/dist, torchrun for PP=2); the refusal test only builds configs
    "test_algorithms_learner.py": {"test_ppo_refuses_a_reward_model_it_cannot_start_the_value_model_from"},
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        fast = MARKED_HERE.get(item.path.name)
        if item.get_closest_marker("slow") or (fast is not None and item.originalname not in fast):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_failed = report.failed  # read by the process guard's teardown
    return report


@pytest.fixture(scope="session")
def one_rank_group():
    """A one-rank gloo default process group in this process (a HashStore: no port, no process),
    for in-process tests of code that talks to its learner ranks through torch.distributed."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a default process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_process_outside_integration(request):
    """A test not marked `integration` must start no process (the fast tier's promise): starting one
    raises, and the test fails naming what it started, even if the code under test swallowed the error."""
    if request.node.get_closest_marker("integration"):
        yield
        return
    started: list[str] = []

    def refuse(what):
        def _refuse(*args, **kwargs):
            detail = f"{what}{' ' + repr(args[1])[:200] if what == 'subprocess.Popen' and len(args) > 1 else ''}"
            started.append(detail)
            raise RuntimeError(f"{request.node.nodeid} started a process ({detail}) but is not marked "
                               "`integration` (see tests/conftest.py)")
        return _refuse

    with pytest.MonkeyPatch.context() as mp:  # its own: a test's `monkeypatch.undo()` leaves it in place
        mp.setattr(subprocess.Popen, "_execute_child", refuse("subprocess.Popen"))
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing.Process.start"))
        mp.setattr(multiprocessing.util, "spawnv_passfds", refuse("multiprocessing spawn"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                mp.setattr(os, name, refuse(f"os.{name}"))
        yield
    if started and not getattr(request.node, "call_failed", False):  # a failed test already says why
        pytest.fail(f"started a process outside the integration tier: {'; '.join(started)}; "
                    "mark the test `integration` (tests/conftest.py)", pytrace=False)


@pytest.fixture
def in_an_empty_folder(tmp_path_factory):
    """The test runs in an empty folder of its own, so that a config's default run.out_dir (runs/,
    relative) is not this checkout's, where a run of the main job may be: the preflight refuses a
    run folder in use or holding a previous run's checkpoints."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(before)


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny random HF checkpoints sharing one tokenizer: GQA (untied), tied embeddings, llama3 rope
    scaling, and a Qwen2 (q/k/v bias). Hidden 64, 2 layers, 4 heads / 2 KV groups, vocab 320."""
    from tests.rollout_fixtures import build_variants

    return build_variants(tmp_path_factory.mktemp("tiny_ckpts"), hidden_size=64, intermediate_size=96)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> list[Path]:
    """Three random tiny LLaMAs (seeds 0, 1, 2) sharing one tokenizer, small enough for vLLM on CPU:
    any of them can be pushed into a replica started from another (rollout / weight-sync tests)."""
    from tests.rollout_fixtures import build_models

    return build_models(tmp_path_factory.mktemp("tiny_models"), seeds=(0, 1, 2))


# Packages only some tests need. In a `-m gpu` run, a test module that imports one at the top is
# SKIPPED with the reason when the package is missing, instead of failing collection: `pytest -m gpu`
# imports every module under tests/ before it deselects by marker, and the GPU machine has none of
# these (tests/hide_modules/sitecustomize.py reproduces that on any machine). Other runs still
# fail on a missing package: CI must not skip the CPU tests silently.
OPTIONAL_PACKAGES = ("mlflow", "vllm", "transformer_engine", "hypothesis", "datasets", "matplotlib", "psutil",
                     "rich", "sentencepiece", "accelerate", "gguf")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    import re

    report = yield
    if report.failed and isinstance(collector, pytest.Module) and "gpu" in (collector.config.getoption("markexpr") or ""):
        missing = re.search(r"No module named '(%s)(\.[\w.]*)?'" % "|".join(OPTIONAL_PACKAGES), str(report.longrepr))
        if missing:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: needs {missing.group(1)}, which is not installed")
    return report
