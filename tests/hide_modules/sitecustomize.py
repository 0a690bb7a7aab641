"""Pretend some packages are not installed (as on the lent GPU machine: no mlflow, no vLLM, ...).

    PYTHONPATH=tests/hide_modules MEGATRON_ASYNC_HIDE_MODULES=mlflow,vllm python -m pytest -m gpu ...

Python imports `sitecustomize` at start-up from sys.path. This one makes the path-based finder
(importlib.machinery.PathFinder, which every site-packages import goes through, pytest's
assertion-rewriting hook included) find nothing for the named top-level packages and their
submodules: importing one raises ModuleNotFoundError and importlib.util.find_spec answers None,
exactly as when the package is missing. (Their dist-info stays: disable pytest plugins they
register with `-p no:NAME`.) Used by `launch/gpu_check.sh --dry-run` (tests/test_gpu_check.py),
so CI collects and runs the GPU check the way the GPU machine will.
"""
import importlib.machinery
import os

_HIDDEN = {m.strip() for m in os.environ.get("MEGATRON_ASYNC_HIDE_MODULES", "").split(",") if m.strip()}

if _HIDDEN:
    _find_spec = importlib.machinery.PathFinder.find_spec

    def _hiding_find_spec(cls, fullname, path=None, target=None):
        if fullname.split(".")[0] in _HIDDEN:
            return None
        return _find_spec(fullname, path, target)

    importlib.machinery.PathFinder.find_spec = classmethod(  # type: ignore[method-assign,assignment]  # this module's point
        _hiding_find_spec)
