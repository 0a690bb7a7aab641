"""GSM8k exact-match reward: compare the final number of a completion with the reference's.

Extraction (the same for completions and references):
1. if the text contains "####", the first number after the LAST "####" (GSM8k's answer marker);
   if nothing numeric follows the marker, there is no answer (a model that writes "#### " and
   stops did not answer, even if numbers appear earlier);
2. otherwise the last number anywhere in the text.
A number is an optional minus sign (not when glued to a preceding digit, so "3-2" reads 3 and 2),
ASCII digits with optional thousands separators ("1,234" but not "1,2,3", which is three numbers)
and an optional decimal part. "$" and a trailing "." are not part of the match, so "$1,234." -> "1234".
Comparison is numeric with `decimal.Decimal` ("72.0" == "72", "-0" == "0"), exact for any length.

Nothing here evaluates model text: only a regular expression and Decimal parsing of the match.
Fractions ("3/4") and scientific notation are not understood; GSM8k answers are integers.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

ANSWER_MARKER = "####"
_NUMBER = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?", re.ASCII)


def extract_answer(text: str) -> str | None:
    """The normalised final number in `text` (e.g. "1234", "-3.5"), or None if there is none."""
    if ANSWER_MARKER in text:
        match = _NUMBER.search(text.rsplit(ANSWER_MARKER, 1)[1])
    else:
        match = None
        for match in _NUMBER.finditer(text):
            pass
    return None if match is None else match.group(0).replace(",", "")


def parse_number(answer: str) -> Decimal | None:
    """A normalised answer string -> Decimal, or None when it is not a plain decimal number."""
    try:
        value = Decimal(answer)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def answers_match(completion: str, reference: str) -> bool:
    """True when the completion's final number equals the reference's, numerically.

    Raises ValueError when the REFERENCE has no number: that is bad data, not a wrong answer.
    """
    want = extract_answer(reference)
    if want is None or parse_number(want) is None:
        raise ValueError(f"reference answer has no final number: {reference[-200:]!r}")
    got = extract_answer(completion)
    return got is not None and parse_number(got) == parse_number(want)


def gsm8k_reward(prompt: str, completion: str, reference: str | None) -> float:
    """1.0 for an exact (numeric) match of the final answer, else 0.0. `prompt` is unused; the
    signature is the one `scoring.score_samples` calls. No reference (a problem without an answer)
    is a ValueError, a failed score, like a reference without a number."""
    del prompt
    if reference is None:
        raise ValueError("no reference answer to match (data.answer_key)")
    return 1.0 if answers_match(completion, reference) else 0.0
