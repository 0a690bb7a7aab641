"""Procedural GSM8k-style arithmetic word problems: small numbers, one or two operations.

Each problem comes with a GSM8k-format solution (calculator annotations and a final
"#### <answer>"), so it goes through exactly the same loaders, template and exact-match reward as
real GSM8k. Used by the CPU runs and the tests: a tiny model can learn it within minutes.

Determinism and splits: the generator is `random.Random` seeded from (seed, split), so the same
arguments give the same list on any machine. A problem's split is a hash of its arithmetic
(template + numbers, not the names or objects), so "train" and "test" can never share a
calculation, whatever the seeds; within a split every calculation appears at most once.
"""
from __future__ import annotations

import hashlib
import random

from megatron_async.data.prompts import Problem

SPLITS = ("train", "test")
TEST_FRACTION = 5  # 1 in 5 calculations belongs to "test"
NAMES = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jon"]
THINGS = ["apples", "books", "coins", "pens", "cards", "eggs", "shells", "stamps", "marbles", "stickers"]


def _problem(rng: random.Random) -> tuple[str, tuple[int, ...], str, list[str], int]:
    """(template name, numbers, question, solution steps, answer) for one random problem."""
    nm, th = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(["add", "sub", "mul", "div", "add_sub", "mul_add"])
    if kind == "add":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        q = f"{nm} has {a} {th} and gets {b} more. How many {th} does {nm} have now?"
        return kind, (a, b), q, [f"{nm} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {th}."], a + b
    if kind == "sub":
        a = rng.randint(3, 99)
        b = rng.randint(1, a - 1)
        q = f"{nm} has {a} {th} and gives {b} away. How many {th} does {nm} have left?"
        return kind, (a, b), q, [f"{nm} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {th} left."], a - b
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q = f"{nm} has {a} bags with {b} {th} in each bag. How many {th} does {nm} have?"
        return kind, (a, b), q, [f"{nm} has {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {th}."], a * b
    if kind == "div":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q = f"{nm} shares {a * b} {th} equally among {b} friends. How many {th} does each friend get?"
        return kind, (a * b, b), q, [f"Each friend gets {a * b} / {b} = <<{a * b}/{b}={a}>>{a} {th}."], a
    if kind == "add_sub":
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        c = rng.randint(1, a + b - 1)
        q = f"{nm} has {a} {th}, buys {b} more, then gives {c} away. How many {th} does {nm} have now?"
        steps = [
            f"After buying, {nm} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {th}.",
            f"After giving some away, {nm} has {a + b} - {c} = <<{a + b}-{c}={a + b - c}>>{a + b - c} {th}.",
        ]
        return kind, (a, b, c), q, steps, a + b - c
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 30)  # mul_add
    q = f"{nm} buys {a} boxes of {b} {th} and finds {c} more. How many {th} does {nm} have?"
    steps = [
        f"The boxes hold {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {th}.",
        f"In total {nm} has {a * b} + {c} = <<{a * b}+{c}={a * b + c}>>{a * b + c} {th}.",
    ]
    return kind, (a, b, c), q, steps, a * b + c


def split_of(kind: str, numbers: tuple[int, ...]) -> str:
    """The split a calculation belongs to: a stable hash (not Python's salted hash())."""
    digest = hashlib.sha256(f"{kind}|{numbers}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_FRACTION == 0 else "train"


def synthetic_problems(n: int, seed: int = 0, split: str = "train") -> list[Problem]:
    """n distinct problems of `split` ("train" or "test"), deterministic in (n, seed, split)."""
    if split not in SPLITS:
        raise ValueError(f"synthetic split must be one of {SPLITS}, got {split!r}")
    if n < 1:
        raise ValueError(f"synthetic problem count must be >= 1, got {n}")
    rng = random.Random(f"megatron_async-synthetic-{seed}-{split}")
    seen: set[tuple[str, tuple[int, ...]]] = set()
    problems: list[Problem] = []
    for _ in range(200 * n):  # rejection sampling; the space holds tens of thousands per split
        kind, numbers, question, steps, answer = _problem(rng)
        if split_of(kind, numbers) != split or (kind, numbers) in seen:
            continue
        seen.add((kind, numbers))
        solution = "\n".join(steps) + f"\n#### {answer}"
        problems.append(Problem(id=f"synthetic-{split}-{seed}-{len(problems)}", question=question, solution=solution, answer=str(answer)))
        if len(problems) == n:
            return problems
    raise ValueError(f"could only make {len(problems)} distinct synthetic {split} problems, {n} requested")
