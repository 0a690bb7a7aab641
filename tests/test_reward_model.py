"""The reward-model worker process against in-process scores of the same tiny checkpoint, and a
short end-to-end `megatron-async train` run (real vLLM replica and megatron learner) that rewards
with it: prompt-only No Robots-style records, Online DPO, max_lag=1."""
import json

import pytest
import torch

from megatron_async.models.tiny import build_tokenizer, default_corpus, llama_config, TinyLlamaSpec
from megatron_async.rewards import RewardModelWorker, ScoringError


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from transformers import LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    tok = build_tokenizer(default_corpus(200), out, vocab_size=300)
    spec = TinyLlamaSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    cfg = llama_config(spec, -(-len(tok) // 64) * 64, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    cfg.num_labels = 1
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(cfg).float().eval()
    model.save_pretrained(str(out), safe_serialization=True)
    assert (out / "model.safetensors").exists() and not list(out.glob("*.bin"))
    return out, tok, model


@pytest.mark.integration  # the reward-model worker process
def test_worker_scores_match_in_process_scores_and_survives_a_timeout(rm_dir):
    path, tok, model = rm_dir
    prompts = ["Question: Ann has 3 apples.\nAnswer:", "Q: 2+2?\nA:", "Question: Ben has 12 pens.\nAnswer:"]
    completions = [" 3 #### 3", " 4 because 2 + 2 = 4. #### 4", " ten"]
    expected = rm_scores(tok, model, [p + c for p, c in zip(prompts, completions)])
    assert len(set(expected)) == 3  # a constant model would make this test vacuous

    # batch_size=2 makes the worker pad (right) and split into two micro-batches
    with RewardModelWorker(str(path), batch_size=2, num_threads=1, timeout_s=60) as rm:
        report = rm.score(prompts, completions)
        assert [s.reward for s in report.scores] == pytest.approx(expected, abs=1e-4)
        assert report.n_errors == report.n_timeouts == 0
        with pytest.raises(ValueError, match="2 prompts but 1 completions"):
            rm.score(prompts[:2], completions[:1])

        rm.timeout_s = 0.0  # no time to answer: every sample must come back as a timeout, not 0
        report = rm.score(prompts[:2], completions[:2])
        assert [s.reward for s in report.scores] == [None, None]
        assert report.n_timeouts == 2 and rm._proc is None  # the stuck worker was killed
        with pytest.raises(ScoringError, match=r"sample 0 ' 3 #### 3': timed out"):
            report.enforce("stop", what=completions)

        rm.timeout_s = 60.0  # the next call starts a fresh worker
        assert [s.reward for s in rm.score(prompts, completions).scores] == pytest.approx(expected, abs=1e-4)


@pytest.mark.integration  # tries to start the worker process
def test_worker_start_failure_is_reported(tmp_path):
    rm = RewardModelWorker(str(tmp_path / "missing"), start_timeout_s=60)
    with pytest.raises(RuntimeError, match="failed to start"):
        rm.start()
    assert rm._proc is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_cuda_reward_device_without_cuda_fails_at_start_naming_the_key(rm_dir):
    from megatron_async.config import ConfigError, load_config
    from megatron_async.rewards import make_scorer

    cfg = load_config(None, ["reward.kind=reward_model", f"reward.model_path={rm_dir[0]}", "reward.device=cuda:0"])
    with pytest.raises(ConfigError, match=r"'reward.device' = 'cuda:0': no CUDA device here"):
        make_scorer(cfg.reward)


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_on_cuda_scores_like_the_cpu_model(rm_dir):
    path, tok, model = rm_dir
    prompts, completions = ["Q: 2+2?\nA:", "Question: Ben has 12 pens.\nAnswer:"], [" 4 #### 4", " ten"]
    expected = rm_scores(tok, model, [p + c for p, c in zip(prompts, completions)])
    with RewardModelWorker(str(path), batch_size=2, timeout_s=60, device="cuda:0") as rm:
        report = rm.score(prompts, completions)
    assert report.n_errors == 0
    assert [s.reward for s in report.scores] == pytest.approx(expected, abs=1e-3)  # fp32, GPU kernels


def rm_scores(tok, model, texts: list[str]) -> list[float]:
    """In-process scores, one text at a time (no padding): the ground truth for the worker."""
    out = []
    for text in texts:
        with torch.no_grad():
            out.append(model(input_ids=tok(text, return_tensors="pt")["input_ids"]).logits[0, 0].item())
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_train_with_a_reward_model_on_prompt_only_data(rm_dir, tmp_path):
    from tests.e2e_utils import assert_trained, metrics, train

    path, tok, model = rm_dir
    topics = ["apples", "a red kite", "the sea", "Ben's pens", "a long walk", "rain", "Ann's cat", "tea"]
    records = [{"prompt": f"Write one line about {t}.", "prompt_id": f"p{i}", "category": "Generation",
                "messages": [{"role": "user", "content": f"Write one line about {t}."}]}  # No Robots fields
               for i, t in enumerate(topics)]
    data = tmp_path / "norobots.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = 3
    proc = train(tmp_path, "sft.steps=0", f"trainer.steps={steps}", "trainer.warmup_steps=0", "rollout.k=2",
                 "rollout.prompts_per_step=4", "rollout.max_new_tokens=16", "data.eval_size=4",
                 f"data.train={data}", f"data.eval={data}", "data.question_key=prompt", "data.answer_key=null",
                 'data.prompt_template="{question}"', "reward.kind=reward_model", f"reward.model_path={path}",
                 "reward.on_error=stop")
    run_dir = tmp_path / "cpu_tiny"
    assert_trained(run_dir, steps)
    m = metrics(run_dir)
    rewards = [m["reward/mean"][s] for s in range(steps)]
    assert all(r not in (0.0, 1.0) for r in rewards), rewards  # RM scores, not exact-match 0/1
    assert all(m["reward/std"][s] > 0 for s in range(steps))
    assert all(m["reward/errors"][s] == m["reward/timeouts"][s] == 0 for s in range(steps))
    assert all(m["dpo/pairs"][s] == 4 for s in range(steps))  # real-valued scores never tie
    assert [m["rollout/policy_version"][s] for s in range(steps)] == [0, 0, 1]  # one step off-policy
    assert "eval/pass_at_1" not in m  # no reference answers: the RM score is the eval metric
    for tag in ("before", "after"):
        result = json.loads((run_dir / f"eval_{tag}.json").read_text())
        assert result["metric"] == "rm_score" and result["scored"] == result["n"] == 4
        got = [r["reward"] for r in result["results"]]
        # the worker's scores of the greedy completions equal the RM's own on prompt + completion
        prompts = {f"norobots:{i + 1}": r["prompt"] for i, r in enumerate(records)}
        want = rm_scores(tok, model, [prompts[r["id"]] + r["completion"] for r in result["results"]])
        assert got == pytest.approx(want, abs=1e-4)
        assert list(m[f"eval/rm_score_{tag}"].values()) == [pytest.approx(sum(got) / len(got))]
    assert "rm_score on 4 held-out problems: before" in proc.stdout + proc.stderr


CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_rm_text_renders_a_chat_with_the_reward_models_own_template(rm_dir):
    from megatron_async.rewards.reward_model import rm_text

    _, tok, _ = rm_dir
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    policy_text = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"  # the policy's own rendering
    assert rm_text(tok, "Q: 2+2?\nA:", None, " 4") == ("Q: 2+2?\nA: 4", True)  # plain prompt: as before
    assert rm_text(tok, policy_text, messages, "4") == (policy_text + "4", True)  # RM without a template
    chat_tok = type(tok).from_pretrained(str(rm_dir[0]))
    chat_tok.chat_template = CHATML
    text, add_special = rm_text(chat_tok, policy_text, messages, "4")
    assert text == "<s>system\nBe brief.</s>\n<s>user\n2+2?</s>\n<s>assistant\n4</s>\n" and add_special is False


@pytest.mark.integration  # the reward-model worker process
def test_worker_scores_chat_prompts_in_the_reward_models_template(rm_dir, tmp_path):
    import shutil

    from megatron_async.data import TokenizedPrompt
    from megatron_async.data.problem import Problem

    path, tok, model = rm_dir
    chat_dir = shutil.copytree(path, tmp_path / "chat_rm")
    chat_tok = type(tok).from_pretrained(str(chat_dir))
    chat_tok.chat_template = CHATML
    chat_tok.save_pretrained(str(chat_dir))
    questions = ("Ann has 3 apples.", "2+2?")
    prompts = [TokenizedPrompt(Problem(id=q, question=q, solution=None, answer=None), "policy text\n", [1],
                               ({"role": "user", "content": q},)) for q in questions]
    completions = ["3 #### 3", "4 because 2 + 2 = 4."]
    rendered = [f"<s>user\n{q}</s>\n<s>assistant\n{c}</s>\n" for q, c in zip(questions, completions)]
    expected = []
    for text in rendered:
        ids = chat_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(model(input_ids=ids).logits[0, 0].item())
    with RewardModelWorker(str(chat_dir), batch_size=2, num_threads=1, timeout_s=60) as rm:
        chat = [s.reward for s in rm.score(prompts, completions).scores]
        plain = [s.reward for s in rm.score([p.text for p in prompts], completions).scores]
    assert chat == pytest.approx(expected, abs=1e-4)
    assert plain == pytest.approx(rm_scores(tok, model, [p.text + c for p, c in zip(prompts, completions)]), abs=1e-4)
