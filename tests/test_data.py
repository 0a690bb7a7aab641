"""Loaders (good and bad input), the real GSM8k files, synthetic problems, the prompt iterator,
and prompt tokenization."""
import json
import operator
import re
from pathlib import Path

import pytest

from megatron_async.data import (
    DataError,
    Problem,
    PromptIterator,
    format_prompt,
    load_file,
    load_hf_dataset,
    load_problems,
    synthetic_problems,
    tokenize_prompts,
)
from megatron_async.data.synthetic import DIRECT_FRACTION, split_of
from megatron_async.rewards import gsm8k_reward

GSM8K = Path("/work/shared/data/gsm8k")


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_loader(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "1+1=2\n#### 2"}, "", {"question": "Big?", "answer": 1000}])
    problems = load_file(p)
    assert problems == [
        Problem(id="d:1", question="1+1?", solution="1+1=2\n#### 2", answer="2"),
        Problem(id="d:3", question="Big?", solution="1000", answer="1000"),  # line numbers, blank skipped
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "q", "answer": "#### 1"', r"line 2: malformed JSON"),
        ('{"answer": "#### 1"}', r"line 2: missing field 'question'"),
        ('{"question": "q"}', r"line 2: missing field 'answer'"),
        ('{"question": "", "answer": "#### 1"}', r"line 2: field 'question' must be a non-empty string"),
        ('{"question": "q", "answer": "no number"}', r"line 2: field 'answer' has no final number"),
        ('{"question": "q", "answer": [1]}', r"line 2: field 'answer' must be a string or number"),
        ('[1, 2]', r"line 2: expected an object"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    p = write_jsonl(tmp_path / "bad.jsonl", ['{"question": "q", "answer": "#### 1"}', line])
    with pytest.raises(DataError, match=message) as e:
        load_file(p)
    assert str(p) in str(e.value)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no records"):
        load_file(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="file not found"):
        load_file(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown file type"):
        load_file(tmp_path / "x.csv")


def test_json_array_loader(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"question": "q", "answer": "#### 3"}, {"question": "q2"}]))
    with pytest.raises(DataError, match=r"d\.json item 1: missing field 'answer'"):
        load_file(p)


def test_parquet_loader_and_row_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["#### 4", "#### 5"], "uid": ["x", "y"]}), p)
    problems = load_file(p, id_key="uid")
    assert [(q.id, q.answer) for q in problems] == [("x", "4"), ("y", "5")]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["#### 4", "none"]}), bad)
    with pytest.raises(DataError, match=r"bad\.parquet row 1: field 'answer' has no final number"):
        load_file(bad)


def test_datasets_source_names_the_dataset_when_unavailable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match=r"dataset no-such-org/no-such-data:main\[train\]: cannot load"):
        load_hf_dataset("no-such-org/no-such-data:main", "train")


def test_datasets_path_with_a_local_directory(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "local").mkdir()
    write_jsonl(tmp_path / "local" / "train.jsonl", [{"question": "q", "answer": "#### 7"}, {"question": "r", "answer": "#### 8"}])
    problems = load_problems(str(tmp_path / "local"), split="train")
    assert [(p.id, p.answer) for p in problems] == [("local-train:0", "7"), ("local-train:1", "8")]


def test_prompt_only_records_for_a_reward_model(tmp_path):
    rows = [{"prompt": "Write a haiku.", "prompt_id": "a", "messages": [], "category": "Generation"}]
    p = write_jsonl(tmp_path / "nr.jsonl", rows)
    assert load_problems(str(p), question_key="prompt", answer_key=None) == [
        Problem(id="nr:1", question="Write a haiku.", solution=None, answer=None)]
    with pytest.raises(DataError, match=r"nr\.jsonl line 1: missing field 'answer' .*data\.answer_key"):
        load_problems(str(p), question_key="prompt")  # exact match: the reference is required


def test_load_problems_dispatch(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### 7"}])
    assert load_problems(str(p))[0].answer == "7"
    assert load_problems("synthetic", split="test", synthetic_size=5, seed=3) == synthetic_problems(5, seed=3, split="test")


@pytest.mark.skipif(not (GSM8K / "train.jsonl").is_file(), reason=f"real GSM8k not present in {GSM8K}")
@pytest.mark.parametrize("split, size", [("train", 7473), ("test", 1319)])
def test_real_gsm8k_files_load_and_score_their_own_answers(split, size):
    problems = load_file(GSM8K / f"{split}.jsonl")
    assert len(problems) == size
    assert len({p.id for p in problems}) == size
    # every reference scores 1.0 against itself and 0.0 against a different answer
    for p in problems[:: max(1, size // 200)]:
        assert p.solution is not None  # every GSM8k record has its answer
        assert gsm8k_reward("", p.solution, p.solution) == 1.0
        assert gsm8k_reward("", f"#### {p.answer}1", p.solution) == 0.0
    if split == "train":
        assert problems[0].answer == "72" and problems[0].id == "train:1"


def test_synthetic_is_deterministic_and_splits_are_disjoint():
    a, b = synthetic_problems(300, seed=1), synthetic_problems(300, seed=1)
    assert a == b
    assert a != synthetic_problems(300, seed=2)
    train = synthetic_problems(2000, seed=1, split="train")
    test = synthetic_problems(400, seed=9, split="test")
    assert not {p.question for p in train} & {p.question for p in test}
    assert len({p.question for p in train}) == 2000  # distinct within a split
    assert all(split_of(*key) == "test" for key in _keys(test))
    assert all(split_of(*key) == "train" for key in _keys(train))


def _keys(problems):
    """Recover (kind, numbers) from the question's wording and numbers for the split check."""
    kinds = [("buys", "then gives", "add_sub"), ("boxes of", "", "mul_add"), ("bags with", "", "mul"),
             ("shares", "", "div"), ("gets", "more", "add"), ("gives", "away", "sub")]
    for p in problems:
        kind = next(k for a, b, k in kinds if a in p.question and b in p.question)
        yield kind, tuple(int(n) for n in re.findall(r"\d+", p.question))


def _left_to_right(expr: str) -> int:
    """Value of a chain like "80 - 20 + 3 - 7" or "6 * 3", left to right (all the steps need)."""
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
    parts = re.findall(r"\d+|[-+*/]", expr)
    value = int(parts[0])
    for op, n in zip(parts[1::2], parts[2::2]):
        value = ops[op](value, int(n))
    return value


def test_synthetic_solutions_are_gsm8k_format_and_correct():
    for p in synthetic_problems(200, seed=5) + synthetic_problems(50, seed=5, split="test"):
        assert p.solution is not None and p.answer is not None
        assert p.solution.endswith(f"#### {p.answer}")
        assert int(p.answer) >= 0
        assert gsm8k_reward("", p.solution, p.solution) == 1.0
        for claim in re.split(r"\.\s+| because ", p.solution.split("####")[0].strip().rstrip(".")):  # each step holds
            assert len({_left_to_right(side) for side in claim.split(" = ")}) == 1, p.solution
    with pytest.raises(ValueError, match="split"):
        synthetic_problems(3, split="eval")


def test_iterator_epochs_are_permutations_and_resume_exactly():
    items = list(range(10))
    it = PromptIterator(items, seed=7)
    first = it.take(10)
    second = it.take(10)
    assert sorted(first) == sorted(second) == items and first != second  # reshuffled per epoch
    it.take(3)
    state = it.state_dict()
    expected = it.take(12)

    resumed = PromptIterator(items, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert resumed.take(12) == expected
    uninterrupted = PromptIterator(items, seed=7).take(35)
    assert uninterrupted[:20] == first + second and uninterrupted[23:] == expected

    at_boundary = PromptIterator(items, seed=7)
    at_boundary.take(20)
    again = PromptIterator(items, seed=7)
    again.load_state_dict(at_boundary.state_dict())  # saved at position == len: next epoch follows
    assert again.take(10) == uninterrupted[20:30]


def test_iterator_unshuffled_and_state_validation():
    it = PromptIterator(["a", "b", "c"], seed=0, shuffle=False)
    assert it.take(5) == ["a", "b", "c", "a", "b"]
    state = it.state_dict()
    with pytest.raises(ValueError, match="num_items=3 was saved, but this run has num_items=4"):
        PromptIterator(["a", "b", "c", "d"], seed=0, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0 was saved"):
        PromptIterator(["a", "b", "c"], seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="missing key 'seed'"):
        PromptIterator(["a", "b", "c"], seed=0).load_state_dict({"epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="at least one item"):
        PromptIterator([], seed=0)


class CharTokenizer:
    """One id per character, with a BOS: enough to test the length policy without a vocab."""

    def __call__(self, text):
        return {"input_ids": [1] + [ord(c) for c in text]}


def test_tokenize_prompts_length_policy():
    problems = [Problem("a", "short?", "#### 1", "1"), Problem("b", "x" * 50, "#### 2", "2")]
    tok = CharTokenizer()
    prompts, dropped = tokenize_prompts(problems, tok, max_prompt_tokens=30, on_long_prompt="drop")
    assert dropped == 1 and [p.problem.id for p in prompts] == ["a"]
    assert prompts[0].text == "Question: short?\nAnswer:" and len(prompts[0].ids) == 1 + len(prompts[0].text)
    with pytest.raises(DataError, match=r"problem b: prompt is 69 tokens, over data.max_prompt_tokens=30"):
        tokenize_prompts(problems, tok, max_prompt_tokens=30)
    with pytest.raises(DataError, match="all 2 prompts"):
        tokenize_prompts(problems, tok, max_prompt_tokens=3, on_long_prompt="drop")


def test_template_errors_name_the_placeholder():
    assert format_prompt(Problem("a", "2+2?", "4", "4"), "Q: {question} A:") == "Q: 2+2? A:"
    with pytest.raises(DataError, match="unknown placeholder 'answer'"):
        format_prompt(Problem("a", "2+2?", "4", "4"), "{question} {answer}")


LLAMA3_LIKE_TEMPLATE = (  # writes BOS itself, as LLaMA-3's does: a tokenizer adding BOS again would double it
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory):
    """A byte-level BPE that adds BOS by default (like LLaMA's) and has a chat template writing BOS."""
    from tokenizers import processors

    from megatron_async.models.tiny import build_tokenizer, default_corpus

    tok = build_tokenizer(default_corpus(200), tmp_path_factory.mktemp("chat_tok"), vocab_size=300)
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert tok("hi")["input_ids"][0] == tok.bos_token_id  # default encoding adds BOS
    tok.chat_template = LLAMA3_LIKE_TEMPLATE
    return tok


def test_chat_prompts_use_the_template_and_one_bos(bos_tokenizer):
    tok = bos_tokenizer
    problems = [Problem("a", "Ann has 3 apples. How many?", "#### 3", "3")]
    (plain,), _ = tokenize_prompts(problems, tok, max_prompt_tokens=200)
    assert plain.messages is None and plain.text == "Question: Ann has 3 apples. How many?\nAnswer:"
    (chat,), _ = tokenize_prompts(problems, tok, 200, template="{question}", chat=True)
    assert chat.messages == ({"role": "user", "content": "Ann has 3 apples. How many?"},)
    assert chat.text == "<s><|user|>\nAnn has 3 apples. How many?</s>\n<|assistant|>\n"
    # the ids vLLM is given are exactly the template's own tokenization: a single BOS
    expected = tok.apply_chat_template(list(chat.messages), add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert chat.ids == list(expected)
    assert chat.ids.count(tok.bos_token_id) == 1 and chat.ids[0] == tok.bos_token_id
    assert tok(chat.text)["input_ids"].count(tok.bos_token_id) == 2  # what plain tokenization would have done

    (sys_chat,), _ = tokenize_prompts(problems, tok, 200, template="Q: {question}", chat=True,
                                      system_prompt="Answer with a number.")
    assert sys_chat.messages == ({"role": "system", "content": "Answer with a number."},
                                 {"role": "user", "content": "Q: Ann has 3 apples. How many?"})
    assert sys_chat.text.startswith("<s><|system|>\nAnswer with a number.</s>\n<|user|>\nQ: Ann")


def test_chat_prompts_need_a_template_and_follow_the_length_policy(bos_tokenizer):
    problems = [Problem("a", "short?", "#### 1", "1"), Problem("b", "x" * 200, "#### 2", "2")]
    prompts, dropped = tokenize_prompts(problems, bos_tokenizer, 60, chat=True, on_long_prompt="drop")
    assert dropped == 1 and [p.problem.id for p in prompts] == ["a"]
    with pytest.raises(DataError, match="has no chat template"):
        tokenize_prompts(problems, CharTokenizer(), 60, chat=True)


def test_load_prompts_reads_the_chat_keys(bos_tokenizer, tmp_path):
    from megatron_async.config import load_config
    from megatron_async.data import load_prompts

    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2?", "answer": "#### 4"}])
    cfg = load_config(None, [f"data.train={path}", "data.chat_template=true", "data.prompt_template=\"{question}\"",
                             "data.system_prompt=Be brief."])
    (p,), _ = load_prompts(cfg, bos_tokenizer, str(path), "train", 0)
    assert p.messages is not None and p.messages[0] == {"role": "system", "content": "Be brief."}
    assert p.text.endswith("<|assistant|>\n")


def test_synthetic_solutions_are_mostly_direct_and_open_by_their_style():
    """The main job's SFT data: DIRECT_FRACTION of the solutions state only the answer and say so in
    their first words, the rest are worked steps that open with the first calculation."""
    problems = synthetic_problems(2000, seed=3)
    solutions = [p.solution or "" for p in problems]  # every synthetic problem has one (the test above)
    direct = [p for p, s in zip(problems, solutions) if s.startswith("The answer is ")]
    worked = [s for s in solutions if not s.startswith("The answer is ")]
    assert all(p.solution == f"The answer is {p.answer}.\n#### {p.answer}" for p in direct)
    assert all(re.match(r"\d+ [-+*/] \d+ = ", s) for s in worked)
    assert abs(len(direct) / len(problems) - DIRECT_FRACTION) < 0.03


def test_the_synthetic_held_out_set_is_the_same_for_every_run_seed(bos_tokenizer):
    """A seed varies the training problems, not the exam: runs with different run.seed are scored on
    one held-out set (data/prompts.py SYNTHETIC_TEST_SEED)."""
    from megatron_async.config import load_config
    from megatron_async.data import load_prompts

    def questions(seed: int, split: str) -> list[str]:
        prompts, _ = load_prompts(load_config(None, [f"run.seed={seed}"]), bos_tokenizer, "synthetic", split, 50)
        return [p.problem.question for p in prompts]

    assert questions(1, "test") == questions(2, "test") == questions(1234, "test")
    assert questions(1, "train") != questions(2, "train")
