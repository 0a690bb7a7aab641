"""Thin wrapper: `.venv/bin/python tools/bench_async.py CONFIG [overrides] [options]` is
`megatron-async bench async CONFIG [overrides] [options]` (see megatron_async/bench/commands.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_async.bench.commands import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["async", *sys.argv[1:]]))
