"""The `Problem` record every data source produces (files, `datasets`, synthetic)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    id: str  # stable across runs: "<file stem>:<line>", the record's own id, or a synthetic id
    question: str
    solution: str | None  # the reference answer as given (worked solution or bare number); None = no answer_key
    answer: str | None  # its final number, normalised ("1234"): what gsm8k_reward compares against
