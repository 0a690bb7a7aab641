"""Vocabulary padding (megatron's make_vocab_size_divisible_by): the pad/strip/mask arithmetic in
process, and a tiny model whose vocab_size (301) TP=2 does not divide, through the real learner."""
from __future__ import annotations

import pytest
import torch

from megatron_async.learner.logprobs import mask_vocab_padding
from megatron_async.learner.mapping import TOP_RULES, _TIED_OUTPUT, pad_vocab, to_hf, to_megatron_shard
from megatron_async.learner.model import padded_vocab_size, read_arch, vocab_shard_real_rows
from tests.dist import run_worker

VOCAB = 301  # prime-ish: no TP > 1 divides it


@pytest.mark.parametrize("vocab, tp, divisible_by, padded", [
    (301, 1, 128, 384), (301, 2, 128, 512), (1003, 2, 128, 1024), (1003, 8, 128, 1024),
    (32001, 1, 128, 32128), (32001, 2, 128, 32256), (32001, 8, 128, 32768),
    (49152, 2, 128, 49152), (320, 1, 128, 384),  # already a multiple: unchanged / megatron pads anyway
    (1003, 2, 1, 1004), (301, 4, 1, 304), (301, 1, 1, 301),  # 1: only a multiple of TP
])
def test_padded_vocab_size_is_megatrons(vocab, tp, divisible_by, padded):
    assert padded_vocab_size(vocab, tp, divisible_by) == padded
    assert padded % (divisible_by * tp) == 0 and 0 <= padded - vocab < divisible_by * tp


def test_padded_vocab_size_refuses_nonpositive_sizes():
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by=0"):
        padded_vocab_size(301, 2, 0)
    with pytest.raises(ValueError, match="vocab_size=0"):
        padded_vocab_size(0, 2)


def test_real_rows_per_tp_rank():
    assert [vocab_shard_real_rows(301, 512, 2, r) for r in range(2)] == [256, 45]
    assert [vocab_shard_real_rows(100, 256, 2, r) for r in range(2)] == [100, 0]  # rank 1: padding only
    assert [vocab_shard_real_rows(1003, 1024, 8, r) for r in range(8)] == [128] * 7 + [107]
    assert vocab_shard_real_rows(320, 320, 1, 0) == 320


def _arch(tied=False):
    return read_arch({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 16,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                      "tie_word_embeddings": tied})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("rule", [TOP_RULES["embedding.word_embeddings.weight"], TOP_RULES["output_layer.weight"],
                                  _TIED_OUTPUT], ids=["embedding", "lm_head", "tied_output"])
def test_hf_to_megatron_pads_with_zeros_and_back_strips(rule, tp):
    arch = _arch(tied=rule is _TIED_OUTPUT)
    padded = padded_vocab_size(VOCAB, tp)
    hf = torch.randn(VOCAB, 8)
    shards = [to_megatron_shard([hf], rule, arch, tp, r, padded) for r in range(tp)]
    assert all(s.shape == (padded // tp, 8) for s in shards)
    full = torch.cat(shards)
    assert torch.equal(full[:VOCAB], hf) and torch.all(full[VOCAB:] == 0)
    back, = to_hf(full, rule, arch, tp)
    assert back.shape == (VOCAB, 8) and torch.equal(back, hf)
    # no padding asked: the shard is the plain TP split (as before padding existed)
    assert torch.equal(to_megatron_shard([hf[:300]], rule, arch, 2, 1, 300), hf[150:300])


def test_pad_vocab_refuses_fewer_rows():
    with pytest.raises(ValueError, match="smaller than"):
        pad_vocab(torch.zeros(10, 2), 8)


@pytest.mark.parametrize("vocab, tp", [(VOCAB, 2), (1003, 8), (100, 2), (VOCAB, 1)])
def test_masked_vocab_parallel_log_softmax_equals_the_unpadded_one(vocab, tp):
    """Per-rank masking then a log-softmax over all ranks' columns (what vocab_parallel_cross_entropy
    computes) gives exactly the log-softmax over the real vocabulary, also when a rank holds
    padding only (vocab 100 at TP=2), and no NaN."""
    padded = padded_vocab_size(vocab, tp)
    logits = torch.randn(3, 5, padded) * 4
    logits[..., vocab:] = 7.0  # what unmasked padding logits could be: would take probability mass
    shards = [mask_vocab_padding(s.clone(), vocab, tp=tp, rank=r) for r, s in enumerate(logits.chunk(tp, -1))]
    masked = torch.cat(shards, -1)
    assert torch.all(masked[..., vocab:] == float("-inf")) and torch.equal(masked[..., :vocab], logits[..., :vocab])
    got = torch.log_softmax(masked, -1)[..., :vocab]
    assert not got.isnan().any()
    torch.testing.assert_close(got, torch.log_softmax(logits[..., :vocab], -1), rtol=0, atol=1e-6)
    unmasked = torch.log_softmax(logits, -1)[..., :vocab]
    assert (unmasked - got).abs().max() > 1e-2  # so the comparison above would see a missing mask


def test_mask_without_padding_or_vocab_is_a_no_op():
    x = torch.randn(2, 64)
    assert torch.equal(mask_vocab_padding(x.clone(), 128, tp=2, rank=1), x)
    assert torch.equal(mask_vocab_padding(x.clone(), None, tp=2, rank=1), x)
    with pytest.raises(ValueError, match="fewer than vocab_size=129"):
        mask_vocab_padding(x.clone(), 129, tp=2, rank=0)


# ---------------------------------------------------------------- the learner at TP=2 (torchrun)

def _tiny(root, tokenizer, tied: bool):
    """An HF LLaMA with vocab_size 301 (the tokenizer's 300 tokens and one more, as a model with an
    added pad token has), hidden 64, 2 layers, 4 heads / 2 KV groups."""
    from transformers import LlamaForCausalLM

    from megatron_async.models.tiny import TinyLlamaSpec, llama_config

    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=tied)
    cfg = llama_config(spec, VOCAB, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(7 + tied)
    out = root / ("tied" if tied else "untied")
    LlamaForCausalLM(cfg).float().save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _hf_logprobs(model_dir, mbs):
    """transformers' fp32 logprobs, aligned and masked like the learner's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for mb in mbs:
            ids = mb["input_ids"]
            lp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            out.append(torch.nn.functional.pad(lp, (1, 0)) * mb["loss_mask"])
    return out


@pytest.mark.integration  # torchrun, 2 ranks
def test_vocab_tp_does_not_divide_works_at_tp2(tmp_path):
    from safetensors.torch import load_file

    from megatron_async.learner.mapping import expected_hf_shapes
    from megatron_async.models.tiny import build_tokenizer, default_corpus

    tok = build_tokenizer(default_corpus(200), tmp_path / "tok", vocab_size=300)
    models = [_tiny(tmp_path, tok, tied=False), _tiny(tmp_path, tok, tied=True)]
    out = tmp_path / "out"
    run_worker("vocab_padding_worker.py", out, *models, nproc=2, timeout=300)

    for src in models:
        r = torch.load(out / f"{src.name}.pt", weights_only=False)
        mbs = r["microbatches"]
        assert any((mb["input_ids"] >= 256).any() for mb in mbs)  # tokens of TP rank 1's slice
        ref = load_file(str(src / "model.safetensors"))
        # padded to 512 (128 x 2): 256 rows per rank, padding zero from the build on
        assert r["padded_vocab_size"] == 512 and r["local_embedding_shape"] == [256, 64]
        assert r["padding_zero_at_build"] and r["padding_zero_after_load"]
        assert r["iter_hf_exact"]  # the tensors synced to vLLM / exported: HF shapes, bit-exact

        # HF -> Megatron (512 rows) -> HF (loaded at 302 rows) is exact
        back = load_file(str(out / f"{src.name}_roundtrip" / "model.safetensors"))
        assert back.keys() == ref.keys()
        for k in ref:
            assert torch.equal(back[k], ref[k]), k

        # logprobs over the real vocabulary = transformers' (fp32); without the mask they are not
        hf = _hf_logprobs(src, mbs)
        for got, want in zip(r["logprobs"], hf):
            assert got.shape == want.shape == (2, 12)
            assert (got - want).abs().max() < 1e-4
        masked = mbs[0]["loss_mask"][:, 1:].bool()
        assert (r["direct_masked"][:, 1:][masked] - hf[0][:, 1:][masked]).abs().max() < 1e-4
        assert (r["unmasked"][:, 1:][masked] - hf[0][:, 1:][masked]).abs().max() > 1e-2

        # one training step: it trains, and the padding rows get no gradient and stay zero
        m = r["metrics"]
        assert m["skipped"] == 0.0 and m["grad_norm"] > 0 and m["loss"] == pytest.approx(
            -sum((lp * mb["loss_mask"]).sum() / mb["loss_mask"].sum() for lp, mb in zip(hf, mbs)).item() / 2, abs=1e-4)
        assert r["padding_grad_max"] == 0.0 and r["padding_weight_max_after_step"] == 0.0
        weights = r["weights_after_step"]
        assert {k: tuple(v.shape) for k, v in weights.items()} == expected_hf_shapes(read_arch(src))
        assert (weights["model.embed_tokens.weight"] - ref["model.embed_tokens.weight"]).abs().max() > 0
        exported = load_file(str(out / f"{src.name}_export" / "model.safetensors"))
        assert exported.keys() == weights.keys()
        for k in weights:
            assert torch.equal(exported[k], weights[k]), k
        assert read_arch(out / f"{src.name}_export") == read_arch(src)
