"""GSM8k-style problems: the `Problem` record, loaders, the prompt template and tokenization.

Sources (`load_problems`): "synthetic" (see synthetic.py), a .jsonl file (one JSON object per
line), a .json file (a JSON array of objects), a .parquet file, or a HuggingFace `datasets` name,
optionally with a config after a colon ("openai/gsm8k:main"; needs the hub or a local cache).
Every record needs a question field and, unless `answer_key` is None, an answer field (GSM8k:
"question", "answer"; No Robots: "prompt" and no answer, for a reward-model run). The answer is the
full worked solution ending in "#### <number>" or just the number. The final number is extracted
once, at load time, so a reference the reward cannot read fails here, naming the file and line,
instead of mid-training.

Chat (`data.chat_template: true`, instruct models): the filled template is the user turn, after an
optional system turn (`data.system_prompt`), rendered by the tokenizer's own chat template with the
generation prompt. That text already holds the template's special tokens (BOS included where the
template writes it), so it is tokenized with add_special_tokens=False: the ids are exactly what
`apply_chat_template(..., tokenize=True)` gives, with no second BOS. The messages travel with the
prompt so that a reward model can render the conversation with its own template.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence, get_args

from megatron_async.config import Config, OnLongPrompt
from megatron_async.data.problem import Problem
from megatron_async.data.synthetic import synthetic_problems
from megatron_async.rewards.gsm8k import extract_answer

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"


class DataError(ValueError):
    """Bad input data; the message names the file (or dataset) and the line, row or field."""


@dataclass(frozen=True)
class TokenizedPrompt:
    problem: Problem
    text: str  # the templated prompt (chat: the rendered conversation up to the generation prompt)
    ids: list[int]
    messages: tuple[dict, ...] | None = None  # chat only: [system?, user] turns the text was rendered from


def _to_problem(row: Any, where: str, default_id: str, question_key: str, answer_key: str | None,
                id_key: str | None) -> Problem:
    """One raw record -> Problem; `where` ("train.jsonl line 7") goes into every error."""
    keys = (question_key,) if answer_key is None else (question_key, answer_key)
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with {' and '.join(map(repr, keys))}, got {type(row).__name__}")
    for key in keys:
        if key not in row:
            raise DataError(f"{where}: missing field {key!r} (has: {sorted(row)}; see data.question_key, data.answer_key)")
    question = row[question_key]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: field {question_key!r} must be a non-empty string, got {question!r:.80}")
    pid = str(row[id_key]) if id_key is not None and id_key in row else default_id
    if answer_key is None:
        return Problem(id=pid, question=question, solution=None, answer=None)
    solution = row[answer_key]
    if isinstance(solution, (int, float)) and not isinstance(solution, bool):
        solution = str(solution)
    if not isinstance(solution, str):
        raise DataError(f"{where}: field {answer_key!r} must be a string or number, got {type(solution).__name__}")
    answer = extract_answer(solution)
    if answer is None:
        raise DataError(f"{where}: field {answer_key!r} has no final number: {solution[-80:]!r}")
    return Problem(id=pid, question=question, solution=solution, answer=answer)


def _utf8(data: bytes, path: Path, first_line: int = 1, file_offset: int = 0) -> str:
    """`data`, bytes of `path` starting at line `first_line` and byte `file_offset`, decoded as
    UTF-8; bytes that are not (a Latin-1 or Windows-1252 export) are a DataError naming the file,
    the line and the byte offset in the file, not a UnicodeDecodeError without either."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - data.rfind(b"\n", 0, e.start)  # 1-based, in bytes
        raise DataError(f"{path} line {line}: not UTF-8 ({e.reason}: byte 0x{data[e.start]:02x} at byte offset "
                        f"{file_offset + e.start}, byte {column} of the line); data files must be UTF-8 text "
                        "(convert it, e.g. iconv -f latin1 -t utf-8)") from None


def _records(path: Path) -> Iterable[tuple[str, str, Any]]:
    """(where, default id, raw record) for each record of a jsonl / json / parquet file."""
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            offset = 0  # of the line in the file, in bytes
            for lineno, raw in enumerate(f, start=1):
                line, offset = _utf8(raw, path, lineno, offset), offset + len(raw)
                if not line.strip():
                    continue  # a blank line (e.g. trailing) is not a record
                where = f"{path} line {lineno}"
                try:
                    row = json.loads(line.rstrip("\r\n"))  # so an error's column is on this line
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
                yield where, f"{path.stem}:{lineno}", row
    elif path.suffix == ".json":
        try:
            rows = json.loads(_utf8(path.read_bytes(), path))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {e.lineno}: malformed JSON: {e.msg}") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON array of records, got {type(rows).__name__}")
        for i, row in enumerate(rows):
            yield f"{path} item {i}", f"{path.stem}:{i}", row
    elif path.suffix == ".parquet":
        import pyarrow as pa  # pyarrow and datasets: optional, for the file kinds that need them
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:  # not parquet, cut short, a corrupt page
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        for i, row in enumerate(rows):
            yield f"{path} row {i}", f"{path.stem}:{i}", row
    else:
        raise DataError(f"{path}: unknown file type {path.suffix!r} (expected .jsonl, .json or .parquet)")


def load_file(path: str | Path, question_key: str = "question", answer_key: str | None = "answer",
              id_key: str | None = None) -> list[Problem]:
    """Problems from a .jsonl / .json / .parquet file; errors name the file and line (or row)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    problems = [_to_problem(row, where, pid, question_key, answer_key, id_key) for where, pid, row in _records(path)]
    if not problems:
        raise DataError(f"{path}: no records (empty dataset)")
    return problems


def load_hf_dataset(name: str, split: str, question_key: str = "question", answer_key: str | None = "answer",
                    id_key: str | None = None) -> list[Problem]:
    """Problems from a `datasets` name ("openai/gsm8k" or "openai/gsm8k:main") and split."""
    import datasets

    path, _, config = name.partition(":")
    where = f"dataset {name}[{split}]"
    try:
        ds = datasets.load_dataset(path, config or None, split=split)
    except Exception as e:  # offline, unknown name, unknown split: say which source failed
        raise DataError(f"{where}: cannot load: {type(e).__name__}: {e}") from e
    problems = [
        _to_problem(row, f"{where} row {i}", f"{path.rsplit('/', 1)[-1]}-{split}:{i}", question_key, answer_key, id_key)
        for i, row in enumerate(ds)
    ]
    if not problems:
        raise DataError(f"{where}: no records (empty dataset)")
    return problems


def load_problems(source: str, split: str = "train", synthetic_size: int = 1000, seed: int = 0,
                  question_key: str = "question", answer_key: str | None = "answer") -> list[Problem]:
    """Dispatch on the source string of `DataConfig.train` / `DataConfig.eval` (module docstring).

    `split` selects the synthetic split and the `datasets` split; files are taken whole. The keys
    name the record fields of files and `datasets` (answer_key None: prompts only).
    """
    if source == "synthetic":
        return synthetic_problems(synthetic_size, seed=seed, split=split)
    if source.endswith((".jsonl", ".json", ".parquet")) or Path(source).is_file():
        return load_file(source, question_key, answer_key)
    return load_hf_dataset(source, split, question_key, answer_key)


def format_prompt(problem: Problem, template: str = DEFAULT_TEMPLATE) -> str:
    """The template with {question} filled in (str.format: other braces must be doubled)."""
    try:
        return template.format(question=problem.question)
    except (KeyError, IndexError) as e:
        raise DataError(f"prompt template {template!r}: unknown placeholder {e}; only {{question}} is filled") from None


def chat_messages(user: str, system_prompt: str = "") -> tuple[dict, ...]:
    """The turns of a chat prompt: an optional system turn, then the user turn."""
    system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
    return (*system, {"role": "user", "content": user})


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """`messages` rendered by the tokenizer's own chat template (text, special tokens included)."""
    if not has_chat_template(tokenizer):
        raise DataError(f"data.chat_template=true but the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) "
                        f"has no chat template")
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)


def tokenize_prompts(
    problems: Sequence[Problem],
    tokenizer,
    max_prompt_tokens: int,
    template: str = DEFAULT_TEMPLATE,
    on_long_prompt: str = "error",
    chat: bool = False,
    system_prompt: str = "",
) -> tuple[list[TokenizedPrompt], int]:
    """Template + tokenize every problem -> (prompts, number dropped for length).

    Plain prompts get special tokens as the tokenizer adds them by default (BOS for LLaMA
    tokenizers), the same ids vLLM would produce from the text. Chat prompts (`chat`) are rendered
    by the tokenizer's chat template with the generation prompt and tokenized with
    add_special_tokens=False (the template wrote them). A prompt over `max_prompt_tokens` raises
    (naming the problem and its length) under on_long_prompt="error", or is dropped and counted
    under "drop".
    """
    if on_long_prompt not in get_args(OnLongPrompt):
        raise ValueError(f"on_long_prompt must be one of {get_args(OnLongPrompt)}, got {on_long_prompt!r}")
    out, dropped = [], 0
    for problem in problems:
        messages = None
        if chat:
            messages = chat_messages(format_prompt(problem, template), system_prompt)
            text = render_chat(tokenizer, messages)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            text = format_prompt(problem, template)
            ids = list(tokenizer(text)["input_ids"])
        if len(ids) > max_prompt_tokens:
            if on_long_prompt == "error":
                raise DataError(
                    f"problem {problem.id}: prompt is {len(ids)} tokens, over data.max_prompt_tokens={max_prompt_tokens} "
                    f"(raise it, or set data.on_long_prompt=drop)"
                )
            dropped += 1
            continue
        out.append(TokenizedPrompt(problem, text, ids, messages))
    if not out:
        raise DataError(f"all {len(problems)} prompts are over data.max_prompt_tokens={max_prompt_tokens}")
    return out, dropped


# The synthetic held-out ("test") set is drawn with this seed whatever run.seed is, so that runs with
# different seeds are scored on the same problems (a seed varies the training, not the exam). 1234 is
# the main job's run.seed: its held-out set, the one every earlier run of it was scored on.
SYNTHETIC_TEST_SEED = 1234


def load_prompts(cfg: Config, tokenizer, source: str, split: str, size: int) -> tuple[list[TokenizedPrompt], int]:
    """The run's prompts from `source` (data.train / data.eval) under the config's keys and template:
    the first `size` problems (0 = all; the synthetic set is then 1000), tokenized -> (prompts, dropped).
    Synthetic training problems are drawn with run.seed, the held-out ones with SYNTHETIC_TEST_SEED."""
    d = cfg.data
    seed = SYNTHETIC_TEST_SEED if split == "test" else cfg.run.seed
    problems = load_problems(source, split, synthetic_size=size or 1000, seed=seed,
                             question_key=d.question_key, answer_key=d.answer_key)
    if size:
        problems = problems[:size]
    return tokenize_prompts(problems, tokenizer, d.max_prompt_tokens, d.prompt_template, d.on_long_prompt,
                            chat=d.chat_template, system_prompt=d.system_prompt)


SYNTHETIC_TRAIN_SIZE = 20000  # problems drawn for the synthetic train split (it has no natural size)


def load_train_prompts(cfg: Config, tokenizer) -> tuple[list[TokenizedPrompt], int]:
    """The run's training prompts (data.train, all of it) -> (prompts, dropped)."""
    size = SYNTHETIC_TRAIN_SIZE if cfg.data.train == "synthetic" else 0
    return load_prompts(cfg, tokenizer, cfg.data.train, "train", size)
