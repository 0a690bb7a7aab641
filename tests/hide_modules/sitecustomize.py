"""Pretend some packages are not installed (as on the lent GPU machine: no mlflow, no vLLM).

    PYTHONPATH=tests/hide_modules MEGATRON_ASYNC_HIDE_MODULES=mlflow,vllm python -m pytest -m gpu ...

Python imports `sitecustomize` at start-up from sys.path; this one puts a finder first on
sys.meta_path that raises ModuleNotFoundError for the named top-level packages (and their
submodules), exactly what an import of a missing package raises, and makes
importlib.util.find_spec answer None for them. Used by tests/test_gpu_check.py
and `launch/gpu_check.sh --dry-run`, so that CI collects the GPU tests the way the GPU machine will.
"""
import importlib.util
import os
import sys

_HIDDEN = {m.strip() for m in os.environ.get("MEGATRON_ASYNC_HIDE_MODULES", "").split(",") if m.strip()}


class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return None


def _find_spec(name, package=None, _real=importlib.util.find_spec):
    """importlib.util.find_spec answers None for a missing package (it does not raise)."""
    if name.split(".")[0] in _HIDDEN:
        return None
    return _real(name, package)


if _HIDDEN:
    sys.meta_path.insert(0, _Hide())
    importlib.util.find_spec = _find_spec
