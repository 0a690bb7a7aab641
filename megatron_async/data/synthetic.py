"""Procedural GSM8k-style arithmetic word problems: small numbers, one or two operations.

Each problem comes with a GSM8k-format solution ending in "#### <answer>", so it goes through
exactly the same loaders, template and exact-match reward as real GSM8k. Used by the CPU runs and
the tests: a tiny model can learn it within minutes.

Two styles of solution, as in human-written data of mixed quality: WORKED solutions compute by
place value, "57 + 38 = 50 + 30 + 7 + 8 = 80 + 15 = 95.", so every step is a small fact that many
problems share; DIRECT ones (`DIRECT_FRACTION` of them, the majority) state only the answer, "The
answer is 95.". Only the worked style carries over to held-out calculations. The two styles open
differently, so a model imitating this data makes one clear choice at its first token, and with a
70/30 majority that choice is not balanced on an edge that floating-point details could tip: after
SFT, greedy decoding answers direct (seed 1234: on 501 of 512 held-out problems, right on 25%).
That gives RL with an exact-match reward something robust to learn: choose to show the working,
and get the steps right (docs/main-job.md).

Determinism and splits: the generator is `random.Random` seeded from (seed, split), so the same
arguments give the same list on any machine. A problem's split is a hash of its arithmetic
(template + numbers, not the names or objects), so "train" and "test" can never share a
calculation, whatever the seeds; within a split every calculation appears at most once.
"""
from __future__ import annotations

import hashlib
import random

from megatron_async.data.problem import Problem

SPLITS = ("train", "test")
TEST_FRACTION = 5  # 1 in 5 calculations belongs to "test"
DIRECT_FRACTION = 0.7  # share of solutions that state only the answer
NAMES = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jon"]
THINGS = ["apples", "books", "coins", "pens", "cards", "eggs", "shells", "stamps", "marbles", "stickers"]


def _add(a: int, b: int) -> list[str]:
    """a + b by place value: tens with tens, ones with ones, then the two sums (57 + 38 = 50 + 30 + 7 + 8
    = 80 + 15 = 95), so every step is a small fact shared by many problems."""
    if a < 10 and b < 10:
        return [f"{a} + {b} = {a + b}."]
    ta, oa, tb, ob = a - a % 10, a % 10, b - b % 10, b % 10
    return [f"{a} + {b} = {ta} + {tb} + {oa} + {ob} = {ta + tb} + {oa + ob} = {a + b}."]


def _sub(a: int, b: int) -> list[str]:
    """a - b by place value (83 - 27 = 80 - 20 + 3 - 7 = 60 - 4 = 56)."""
    if a < 10:
        return [f"{a} - {b} = {a - b}."]
    ta, oa, tb, ob = a - a % 10, a % 10, b - b % 10, b % 10
    ones = oa - ob
    return [f"{a} - {b} = {ta} - {tb} + {oa} - {ob} = {ta - tb} {'+' if ones >= 0 else '-'} {abs(ones)} = {a - b}."]


def _mul(a: int, b: int) -> list[str]:
    """a * b from the times table, smaller factor first."""
    return [f"{min(a, b)} * {max(a, b)} = {a * b}."]


def _problem(rng: random.Random) -> tuple[str, tuple[int, ...], str, list[str], int]:
    """(template name, numbers, question, worked solution steps, answer) for one random problem."""
    nm, th = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(["add", "sub", "mul", "div", "add_sub", "mul_add"])
    if kind == "add":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        q = f"{nm} has {a} {th} and gets {b} more. How many {th} does {nm} have now?"
        return kind, (a, b), q, _add(a, b), a + b
    if kind == "sub":
        a = rng.randint(3, 99)
        b = rng.randint(1, a - 1)
        q = f"{nm} has {a} {th} and gives {b} away. How many {th} does {nm} have left?"
        return kind, (a, b), q, _sub(a, b), a - b
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{nm} has {a} bags with {b} {th} in each bag. How many {th} does {nm} have?"
        return kind, (a, b), q, _mul(a, b), a * b
    if kind == "div":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{nm} shares {a * b} {th} equally among {b} friends. How many {th} does each friend get?"
        return kind, (a * b, b), q, [f"{a * b} / {b} = {a} because {min(a, b)} * {max(a, b)} = {a * b}."], a
    if kind == "add_sub":
        a, b = rng.randint(2, 50), rng.randint(2, 49)
        c = rng.randint(1, a + b - 1)
        q = f"{nm} has {a} {th}, buys {b} more, then gives {c} away. How many {th} does {nm} have now?"
        return kind, (a, b, c), q, _add(a, b) + _sub(a + b, c), a + b - c
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 30)  # mul_add
    q = f"{nm} buys {a} boxes of {b} {th} and finds {c} more. How many {th} does {nm} have?"
    return kind, (a, b, c), q, _mul(a, b) + _add(a * b, c), a * b + c


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
        worked = rng.random() >= DIRECT_FRACTION
        solution = (" ".join(steps) if worked else f"The answer is {answer}.") + f"\n#### {answer}"
        problems.append(Problem(id=f"synthetic-{split}-{seed}-{len(problems)}", question=question, solution=solution, answer=str(answer)))
        if len(problems) == n:
            return problems
    raise ValueError(f"could only make {len(problems)} distinct synthetic {split} problems, {n} requested")
