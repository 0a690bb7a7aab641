"""The reward-model worker process against in-process scores of the same tiny checkpoint."""
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


def test_worker_scores_match_in_process_scores_and_survives_a_timeout(rm_dir):
    path, tok, model = rm_dir
    prompts = ["Question: Ann has 3 apples.\nAnswer:", "Q: 2+2?\nA:", "Question: Ben has 12 pens.\nAnswer:"]
    completions = [" 3 #### 3", " 4 because 2 + 2 = 4. #### 4", " ten"]
    expected = []
    for p, c in zip(prompts, completions):  # one at a time: no padding, the ground truth
        ids = tok(p + c, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected.append(model(input_ids=ids).logits[0, 0].item())
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


def test_worker_start_failure_is_reported(tmp_path):
    rm = RewardModelWorker(str(tmp_path / "missing"), start_timeout_s=60)
    with pytest.raises(RuntimeError, match="failed to start"):
        rm.start()
    assert rm._proc is None
