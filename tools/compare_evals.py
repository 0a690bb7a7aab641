"""Paired comparison of two greedy evaluations of the same problems (eval_before.json vs
eval_after.json of a run dir, or two `megatron-async eval --output` files).

    .venv/bin/python tools/compare_evals.py runs/cpu_smollm2_gsm8k            # a run dir
    .venv/bin/python tools/compare_evals.py before.json after.json

Prints each pass@1 with its binomial standard error, the per-problem 2x2 table (wrong -> right,
right -> wrong), the paired difference with its standard error, and the exact two-sided McNemar
p-value (binomial test on the discordant problems). Problems either side could not score are left
out of the pairing.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def compare(before: dict, after: dict) -> dict:
    b = {r["id"]: r["reward"] for r in before["results"]}
    a = {r["id"]: r["reward"] for r in after["results"]}
    ids = [i for i in b if i in a and b[i] is not None and a[i] is not None]
    up = sum(1 for i in ids if b[i] < 1 <= a[i])
    down = sum(1 for i in ids if a[i] < 1 <= b[i])
    both = sum(1 for i in ids if b[i] >= 1 and a[i] >= 1)
    n, d = len(ids), up + down
    p_value = min(1.0, 2 * sum(math.comb(d, k) for k in range(min(up, down) + 1)) / 2 ** d) if d else 1.0
    diff = (up - down) / n if n else float("nan")
    se_diff = math.sqrt(max(0.0, d - (up - down) ** 2 / n)) / n if n else float("nan")
    return {"paired": n, "both_right": both, "wrong_to_right": up, "right_to_wrong": down,
            "difference": diff, "difference_se": se_diff, "mcnemar_p": p_value}


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
    before, after = map(load, paths)
    c = compare(before, after)
    print(line("before", before))
    print(line("after ", after))
    print(f"paired on {c['paired']} problems: both right {c['both_right']}, wrong -> right {c['wrong_to_right']}, "
          f"right -> wrong {c['right_to_wrong']}; difference {c['difference']:+.4f} +- {c['difference_se']:.4f}; "
          f"exact McNemar p = {c['mcnemar_p']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
