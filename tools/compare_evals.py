"""Paired comparison of two greedy evaluations of the same problems (eval_before.json vs
eval_after.json of a run dir, or two `megatron-async eval --output` files).

    .venv/bin/python tools/compare_evals.py runs/cpu_smollm2_gsm8k            # a run dir
    .venv/bin/python tools/compare_evals.py before.json after.json

Prints each pass@1 with its binomial standard error, the per-problem 2x2 table (wrong -> right,
right -> wrong), the paired difference with its standard error, and the exact two-sided McNemar
p-value: `megatron_async.run.evaluate.paired_test`, the test a run's own summary prints.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from megatron_async.run.evaluate import paired_test


def line(name: str, result: dict) -> str:
    p, n = result["pass@1"], result["scored"]
    return f"{name}: pass@1 {p:.4f} +- {math.sqrt(p * (1 - p) / n) if n else float('nan'):.4f} ({round(p * n)}/{n})"


def main(argv: list[str]) -> int:
    if len(argv) == 1:
        paths = [Path(argv[0]) / "eval_before.json", Path(argv[0]) / "eval_after.json"]
    elif len(argv) == 2:
        paths = [Path(a) for a in argv]
    else:
        print(__doc__)
        return 2
    before, after = (json.loads(path.read_text()) for path in paths)
    c = paired_test(before, after)
    print(line("before", before))
    print(line("after ", after))
    print(f"paired on {c['paired']} problems: both right {c['both_right']}, wrong -> right {c['up']}, "
          f"right -> wrong {c['down']}; difference {c['difference']:+.4f} +- {c['difference_se']:.4f}; "
          f"exact McNemar p = {c['mcnemar_p']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
