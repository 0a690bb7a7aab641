"""GSM8k answer extraction (cases + hypothesis fuzz) and failure-aware scoring."""
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_async.rewards import (
    ScoringError,
    answers_match,
    extract_answer,
    gsm8k_reward,
    parse_number,
    score_samples,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
        ("She earned $1,234.", "1234"),
        ("So the answer is 72.0", "72.0"),
        ("#### 18\nThen I counted 99 more", "18"),  # first number after the marker
        ("#### 1\nlater #### 2 and 3", "2"),  # the LAST marker counts
        ("x = -7", "-7"),
        ("3-2", "2"),  # a minus glued to a digit is subtraction, not a sign
        ("1,2,3", "3"),  # not a thousands-separated number
        ("12,345,678 people", "12345678"),
        ("pi is about 3.14.", "3.14"),
        ("I think 5, so ####", None),  # a marker with nothing after it is no answer
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer_cases(text, expected):
    assert extract_answer(text) == expected


def test_numeric_comparison():
    assert answers_match("The answer is 72.0", "#### 72")
    assert answers_match("#### $1,000.", "1000")
    assert answers_match("#### -0", "0")
    assert not answers_match("#### 73", "#### 72")
    assert not answers_match("I don't know", "#### 72")
    assert gsm8k_reward("q", "so #### 72", "long solution\n#### 72") == 1.0
    assert gsm8k_reward("q", "so #### 7", "long solution\n#### 72") == 0.0


def test_reference_without_a_number_is_bad_data_not_a_wrong_answer():
    with pytest.raises(ValueError, match="reference answer has no final number"):
        gsm8k_reward("q", "#### 1", "the answer is unknown")


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_never_raises_on_arbitrary_completion(text):
    answer = extract_answer(text)
    assert answer is None or parse_number(answer) is not None
    assert gsm8k_reward("q", text, "#### 42") in (0.0, 1.0)


@settings(deadline=None)
@given(st.text(alphabet="0123456789,.-$# \n"))
def test_never_raises_on_number_like_junk(text):
    answer = extract_answer(text)
    assert answer is None or parse_number(answer) is not None


FORMATS = [
    lambda n: f"{n}",
    lambda n: f"{n:,}",
    lambda n: f"${n:,}",
    lambda n: f"{n}.",
    lambda n: f"{n}.0",
    lambda n: f"{n:,}.00",
]


@settings(deadline=None)
@given(st.integers(-10**15, 10**15), st.sampled_from(FORMATS), st.text(alphabet="abc xyz=+*\n", max_size=30))
def test_formatted_integers_round_trip(n, fmt, prefix):
    answer = extract_answer(f"{prefix} 17 apples, so the total is {fmt(n)}")
    assert answer is not None and parse_number(answer) == n


@settings(deadline=None)
@given(st.decimals(allow_nan=False, allow_infinity=False, places=3, min_value=-10**6, max_value=10**6))
def test_formatted_decimals_round_trip(d):
    answer = extract_answer(f"#### {d:f}")
    assert answer is not None and parse_number(answer) == d


@settings(deadline=None)
@given(st.integers(0, 10**9), st.sampled_from(FORMATS), st.sampled_from(FORMATS))
def test_reward_ties_to_the_reference(n, fmt_ref, fmt_out):
    reference = f"some working <<1+1=2>>2\n#### {fmt_ref(n)}"
    assert gsm8k_reward("q", f"I get {fmt_out(n)}", reference) == 1.0
    assert gsm8k_reward("q", f"#### {fmt_out(n + 1)}", reference) == 0.0


# ----------------------------------------------------------------------------- scoring


def test_scoring_ok_path():
    samples = [("q", "#### 4", "#### 4"), ("q", "#### 5", "#### 4"), ("q", "4", "4")]
    report = score_samples(samples, gsm8k_reward, timeout_s=5.0)
    assert [s.reward for s in report.scores] == [1.0, 0.0, 1.0]
    assert report.metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0}


def test_scoring_records_errors_and_never_scores_them_zero():
    def score(prompt, completion, reference):
        if completion == "boom":
            raise RuntimeError("scorer exploded")
        if completion == "nan":
            return float("nan")
        if completion == "none":
            return None
        return 1.0

    samples = [("q", c, "r") for c in ["fine", "boom", "nan", "none", "fine"]]
    report = score_samples(samples, score, timeout_s=5.0, max_workers=2)
    assert [s.reward for s in report.scores] == [1.0, None, None, None, 1.0]
    errors = [str(s.error) for s in report.scores]
    assert "RuntimeError: scorer exploded" in errors[1] and "non-finite" in errors[2] and "NoneType" in errors[3]
    assert report.n_errors == 3 and report.n_timeouts == 0
    assert [s.index for s in report.kept()] == [0, 4]


def test_scoring_times_out_one_sample_and_ignores_its_late_result():
    release = threading.Event()
    hung = []

    def score(prompt, completion, reference):
        if completion == "hang":
            hung.append(threading.current_thread())
            release.wait(10.0)
        return 1.0

    samples = [("q", "a", "r"), ("q", "hang", "r"), ("q", "b", "r")]
    t0 = time.monotonic()
    report = score_samples(samples, score, timeout_s=0.3)
    assert time.monotonic() - t0 < 3.0
    release.set()
    hung[0].join(5.0)  # the hung scorer has returned and its worker has written its late 1.0 ...
    assert not hung[0].is_alive()
    assert [s.reward for s in report.scores] == [1.0, None, 1.0]  # ... but not into the report
    assert report.scores[1].timed_out and report.n_timeouts == 1 and report.n_errors == 0
    assert report.metrics()["reward/timeouts"] == 1.0


def test_stop_policy_names_the_failed_sample():
    def score(prompt, completion, reference):
        raise ValueError("bad reference")

    with pytest.raises(ScoringError, match=r"sample 0 'my completion'.*bad reference"):
        score_samples([("q", "my completion", "r")], score, on_error="stop")


def test_unknown_policy_is_rejected_before_scoring():
    called = []

    def score(*args) -> float:
        called.append(args)
        return 1.0

    with pytest.raises(ValueError, match="on_error"):
        score_samples([("q", "c", "r")], score, on_error="zero")
    assert called == []


def test_reference_errors_surface_as_errors():
    report = score_samples([("q", "#### 1", "no number")], gsm8k_reward)
    assert report.scores[0].reward is None and "no final number" in str(report.scores[0].error)


def test_only_ascii_digits_are_numbers():
    assert extract_answer("#### \u0667\u0662") is None  # Arabic-Indic "72" is not read as 72


def test_make_scorer_exact_match_scores_against_the_references():
    from megatron_async.config import RewardConfig
    from megatron_async.rewards import ExactMatchScorer, make_scorer

    scorer = make_scorer(RewardConfig())
    assert isinstance(scorer, ExactMatchScorer)
    report = scorer.score(["q1", "q2"], ["so #### 4", "#### 5"], ["#### 4", "4"])
    assert [s.reward for s in report.scores] == [1.0, 0.0]
    with pytest.raises(ValueError):  # a missing reference is a bug, not a silently short batch
        scorer.score(["q1", "q2"], ["#### 4", "#### 5"], ["#### 4"])
    scorer.close()
