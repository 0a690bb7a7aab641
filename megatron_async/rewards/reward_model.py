"""A learned reward model (HF sequence-classification checkpoint) scored in its own process.

Why a process: the reward model's forward pass must not hold the GIL of the process that drives
generation and training (the paper's own overhead came from sharing one interpreter), and a stuck
or crashed scorer must be killable. The worker loads the checkpoint once, on `device` ("cpu" or
"cuda:N", `reward.device`), and answers batched requests over two multiprocessing queues.

    with RewardModelWorker("runs/rm", batch_size=16, device="cuda:7") as rm:   # device default "cpu"
        report = rm.score(prompts, completions)      # ScoreReport, see scoring.py

The trainer gets one for the run from `scorer.make_scorer` (reward.kind=reward_model) and calls it
from the producer thread and from evaluation; calls are serialised (one request in flight).

The text scored: for a plain prompt (a string, or a prompt without chat messages) `prompt +
completion`, tokenized with the RM tokenizer's default special tokens. For a chat prompt (an object
with `.messages`, e.g. `data.TokenizedPrompt` under data.chat_template) the conversation is
[its system?/user turns, {"role": "assistant", "content": completion}] rendered by the RM
tokenizer's OWN chat template (the form a chat RM was trained on; a policy's template may differ)
and tokenized with add_special_tokens=False (the template wrote them); an RM tokenizer without a
chat template scores the policy's rendered text (`.text`) + completion instead, as a plain RM
reads it. Sequences longer than `max_length` tokens are cut on the LEFT, keeping the end of the
completion the reward is about. The score is logit 0 at the last non-pad token (the model must
have num_labels == 1 and a pad token distinct from the tokens it scores).

Failures follow scoring.py: a micro-batch whose forward pass raises marks its samples as errors,
a request that outlives `timeout_s` per micro-batch of `batch_size` texts marks its samples as
timed out and the worker is killed (it is restarted on the next call), a dead worker marks them as errors. Nothing is ever
scored 0 in their place. Weights are loaded with safetensors only (`use_safetensors=True`).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import queue
import threading
import time
import traceback
from typing import TYPE_CHECKING, Sequence, cast

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from megatron_async.rewards.scoring import SampleScore, ScoreReport

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess


def rm_text(tok, prompt_text: str, messages: list[dict] | None, completion: str) -> tuple[str, bool]:
    """What the reward model reads for one sample -> (text, whether the tokenizer adds its special tokens).

    A chat prompt (`messages`) with an RM tokenizer that has a chat template: the conversation with
    the completion as the assistant's turn, rendered by the RM's template (which writes the special
    tokens itself: none are added). Otherwise the prompt text + completion, special tokens added as
    the RM tokenizer does by default."""
    if messages is not None and getattr(tok, "chat_template", None):
        conv = [*messages, {"role": "assistant", "content": completion}]
        return tok.apply_chat_template(conv, tokenize=False), False
    return prompt_text + completion, True


def _worker_main(path: str, dtype: str, num_threads: int | None, batch_size: int, max_length: int, device: str,
                 requests, results):
    """Worker process: load once, then answer [texts] -> [(reward | None, error | None)] per text."""
    try:
        if num_threads:
            torch.set_num_threads(num_threads)
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side, tok.truncation_side = "right", "left"
        model = AutoModelForSequenceClassification.from_pretrained(path, use_safetensors=True, dtype=getattr(torch, dtype))
        model.to(device)
        if model.config.num_labels != 1:
            raise ValueError(f"{path}: reward model must have num_labels == 1, has {model.config.num_labels}")
        if tok.pad_token_id is None or model.config.pad_token_id is None:
            raise ValueError(f"{path}: reward model needs a pad token (tokenizer and config.pad_token_id)")
        model.eval()
    except Exception:
        results.put(("error", traceback.format_exc()))
        return
    results.put(("ready", None))

    while (items := requests.get()) is not None:
        out: list[tuple[float | None, str | None]] = []
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            try:
                rows = []
                for item in chunk:
                    text, add_special = rm_text(tok, *item)
                    rows.append(tok(text, add_special_tokens=add_special, truncation=True, max_length=max_length))
                enc = tok.pad(rows, padding=True, return_tensors="pt").to(device)
                with torch.no_grad():
                    logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                for value in logits[:, 0].float().tolist():
                    out.append((value, None) if math.isfinite(value) else (None, f"non-finite score {value}"))
            except Exception as e:
                out.extend((None, f"{type(e).__name__}: {e}") for _ in chunk)
        results.put(("ok", out))


class RewardModelWorker:
    """Owns one reward-model process; `score` is blocking and batched (see module docstring)."""

    def __init__(
        self,
        path: str,
        batch_size: int = 16,
        max_length: int = 1024,
        dtype: str = "float32",
        num_threads: int | None = None,
        timeout_s: float = 120.0,
        start_timeout_s: float = 300.0,
        device: str = "cpu",
    ):
        self.args = (str(path), dtype, num_threads, batch_size, max_length, device)
        self.batch_size, self.timeout_s, self.start_timeout_s = batch_size, timeout_s, start_timeout_s
        self._ctx = mp.get_context("spawn")  # never fork a process that may hold threads or CUDA
        self._proc: BaseProcess | None = None
        self._lock = threading.Lock()  # NOTE: one request in flight: the queues carry no request id

    def start(self) -> None:
        if self._proc is not None:
            return
        self._requests, self._results = self._ctx.Queue(), self._ctx.Queue()
        proc = self._proc = self._ctx.Process(target=_worker_main, args=(*self.args, self._requests, self._results),
                                              daemon=True)
        proc.start()
        status, payload = self._wait(self.start_timeout_s, "start")
        if status != "ready":
            self.close()
            raise RuntimeError(f"reward model worker for {self.args[0]} failed to start: {payload}")

    def score(self, prompts: Sequence, completions: Sequence[str], references: Sequence[str | None] = (),
              on_error: str = "drop") -> ScoreReport:
        """Score each completion after its prompt: a string, or a prompt with `.text` and `.messages`
        (chat: rendered with the RM's own template, module docstring). `references` is not used (a
        reward model judges the text alone); it is there so that this is a `scorer.Scorer`."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        items = [(p, None, c) if isinstance(p, str) else
                 (p.text, None if p.messages is None else [dict(m) for m in p.messages], c)
                 for p, c in zip(prompts, completions)]
        with self._lock:
            self.start()
            self._requests.put(items)
            status, payload = self._wait(self.timeout_s * max(1, -(-len(prompts) // self.batch_size)), "score")
            if status == "ok":
                answers = cast("list[tuple[float | None, str | None]]", payload)  # the worker's (reward, error) per item
                scores = [SampleScore(i, reward=r, error=e) for i, (r, e) in enumerate(answers)]
            else:  # timeout or death: kill, so the next call starts clean (no stale answer in a queue)
                self.close(graceful=False)
                scores = [SampleScore(i, error=str(payload), timed_out=status == "timeout") for i in range(len(prompts))]
        return ScoreReport(scores).enforce(on_error, what=list(completions))

    def _wait(self, timeout_s: float, what: str) -> tuple[str, object]:
        """Next message from the worker, or ("timeout" | "dead", reason). Polls so death is seen early."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                return self._results.get(timeout=min(1.0, left))
            except queue.Empty:
                if self._proc is None or not self._proc.is_alive():
                    code = None if self._proc is None else self._proc.exitcode
                    return "dead", f"reward model worker died during {what} (exit code {code})"
        return "timeout", f"reward model worker gave no answer to {what} within {timeout_s:g} s"

    def close(self, graceful: bool = True) -> None:
        """Stop the worker: ask it to exit (graceful) and kill it if it has not after 5 s."""
        if self._proc is None:
            return
        if graceful and self._proc.is_alive():
            self._requests.put(None)
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._proc = None

    def __enter__(self) -> "RewardModelWorker":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
