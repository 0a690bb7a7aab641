"""Checks before anything starts (run/preflight.py): each bad setting is one ConfigError naming the
key (and file and line for data), raised in-process here; the CLI tests below confirm that
`megatron-async train` turns it into ONE line and exit 2 before torchrun, the learner or a replica."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_async.config import ConfigError, load_config
from megatron_async.learner.mapping import expected_hf_shapes
from megatron_async.learner.model import read_arch
from megatron_async.run.preflight import preflight

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("in_an_empty_folder")  # runs/ of the default run.out_dir: tests/conftest.py
CPU_TINY = str(REPO / "configs" / "cpu_tiny.yaml")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"question": "Ann has 3 apples. How many?", "answer": "3 apples #### 3"})
MALFORMED = '{"question": "b?", "answer": "#### 2"'  # no closing brace
NO_NUMBER = json.dumps({"question": "c?", "answer": "it is two"})


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny HF checkpoint (vocab 320, 4 heads / 2 KV heads) whose tokenizer has no chat template."""
    from megatron_async.models.tiny import TinyLlamaSpec, build_tiny_llama, build_tokenizer, default_corpus

    out = tmp_path_factory.mktemp("hf_model")
    tok = build_tokenizer(default_corpus(200), out, vocab_size=300)
    return build_tiny_llama(out, tok, TinyLlamaSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2))


@pytest.fixture(scope="module")
def chat_model(hf_model, tmp_path_factory):
    """The same checkpoint with a ChatML chat template on its tokenizer."""
    from transformers import AutoTokenizer

    out = shutil.copytree(hf_model, tmp_path_factory.mktemp("chat") / "m")
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    return out


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    bad = jsonl(tmp_path / "train.jsonl", [GOOD, MALFORMED])
    with pytest.raises(ConfigError) as e:
        preflight(load_config(CPU_TINY, [f"data.train={bad}"]))
    assert str(e.value).startswith(f"key 'data.train' = '{bad}': {bad} line 2: malformed JSON")
    assert "column 38" in str(e.value)  # on that line, not the start of a next one


def test_answer_without_a_number_names_file_and_line(tmp_path):
    bad = jsonl(tmp_path / "test.jsonl", [GOOD, GOOD, NO_NUMBER])
    with pytest.raises(ConfigError, match=rf"key 'data.eval' = '{bad}': {bad} line 3: field 'answer' has no final number"):
        preflight(load_config(CPU_TINY, [f"data.eval={bad}"]))


def test_resume_without_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match=r"key 'run.resume' = True: no checkpoint in .*checkpoints"):
        preflight(load_config(CPU_TINY, [f"run.out_dir={tmp_path}", "run.resume=true"]))
    (tmp_path / "cpu_tiny" / "checkpoints").mkdir(parents=True)  # a run that started but saved nothing
    with pytest.raises(ConfigError, match=r"'run.resume'"):
        preflight(load_config(CPU_TINY, [f"run.out_dir={tmp_path}", "run.resume=true"]))


def test_chat_template_needs_a_tokenizer_that_has_one(hf_model, chat_model):
    with pytest.raises(ConfigError, match=r"key 'data.chat_template' = True: model.hf_path=tiny"):
        preflight(load_config(None, ["data.chat_template=true"]))
    with pytest.raises(ConfigError, match=rf"key 'data.chat_template' = True: the tokenizer of {hf_model} has no chat"):
        preflight(load_config(None, [f"model.hf_path={hf_model}", "data.chat_template=true"]))
    preflight(load_config(None, [f"model.hf_path={chat_model}", "data.chat_template=true"]))
    preflight(load_config(None, [f"model.hf_path={hf_model}"]))  # no template needed without chat


def test_prompt_template_placeholders():
    with pytest.raises(ConfigError, match=r"key 'data.prompt_template' = .*unknown placeholder 'answer'"):
        preflight(load_config(None, ['data.prompt_template="{question} {answer}"']))


def test_long_prompts_found_before_the_learner_starts(chat_model, tmp_path):
    long_q = json.dumps({"question": "Ann has apples. " * 40 + "How many?", "answer": "#### 3"})
    data = jsonl(tmp_path / "train.jsonl", [GOOD, long_q])
    base = [f"model.hf_path={chat_model}", f"data.train={data}", "data.max_prompt_tokens=60"]
    with pytest.raises(ConfigError, match=r"key 'data.max_prompt_tokens' = 60: data.train: problem train:2: prompt is "
                                          r"\d+ tokens"):
        preflight(load_config(None, base))
    with pytest.raises(ConfigError, match="problem train:1: prompt is 75 tokens"):  # the chat template's tokens count
        preflight(load_config(None, [*base, "data.chat_template=true"]))
    preflight(load_config(None, [*base, "data.on_long_prompt=drop"]))  # one prompt is left
    short = jsonl(tmp_path / "short.jsonl", [GOOD])
    with pytest.raises(ConfigError, match="all 1 prompts are over"):
        preflight(load_config(None, [f"model.hf_path={chat_model}", f"data.train={short}", "data.max_prompt_tokens=3",
                                     "data.on_long_prompt=drop"]))


@pytest.fixture
def edited_model(hf_model, tmp_path):
    """edit(**fields) -> a copy of hf_model whose config.json has `fields` changed (None deletes one)
    and whose weights (zeros) have the shapes it implies, so the preflight gets to the check a test
    is about (a config.json that the learner cannot read keeps the original weights)."""
    model = shutil.copytree(hf_model, tmp_path / "edited")
    original = json.loads((model / "config.json").read_text())

    def edit(**fields):
        hf = {**original, **fields}
        (model / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
        try:
            shapes = expected_hf_shapes(read_arch(model))
        except (KeyError, ValueError, TypeError):
            return f"model.hf_path={model}"
        save_file({name: torch.zeros(shape) for name, shape in shapes.items()}, str(model / "model.safetensors"))
        return f"model.hf_path={model}"
    return edit


def test_tp_and_pp_against_the_checkpoint(edited_model):
    """4 heads / 2 KV heads, MLP 64, 2 layers. A vocab_size TP does not divide is padded by the learner
    (model.make_vocab_size_divisible_by), so it runs; heads, KV heads, MLP and layers are split as they are."""
    preflight(load_config(None, [edited_model(), "parallel.tp=2", "parallel.pp=2"]))
    preflight(load_config(None, [edited_model(vocab_size=1003), "parallel.tp=2"]))  # padded to 1024
    preflight(load_config(None, [edited_model(vocab_size=1003), "parallel.tp=2", "model.make_vocab_size_divisible_by=1"]))
    with pytest.raises(ConfigError, match=r"key 'parallel.tp' = 4: must divide num_key_value_heads \(2\) in .*config.json"):
        preflight(load_config(None, [edited_model(), "parallel.tp=4"]))
    with pytest.raises(ConfigError, match=r"key 'parallel.tp' = 2: must divide intermediate_size \(63\)"):
        preflight(load_config(None, [edited_model(intermediate_size=63), "parallel.tp=2"]))
    with pytest.raises(ConfigError, match=r"key 'parallel.pp' = 4: must divide num_hidden_layers \(2\)"):
        preflight(load_config(None, [edited_model(), "parallel.pp=4"]))
    with pytest.raises(ConfigError, match=r"key 'model.hf_path' = .*vocab_size=0, expected a positive integer .* "
                                          r"model.make_vocab_size_divisible_by x parallel.tp = 128 x 2"):
        preflight(load_config(None, [edited_model(vocab_size=0), "parallel.tp=2"]))


def test_prompt_and_completion_must_fit_the_models_positions(edited_model):
    """The issue's case: a 256-position model, 256 prompt + 32 new tokens; found at config time, not
    as a traceback in the replica's log after the learner is built."""
    model = edited_model(max_position_embeddings=256)
    with pytest.raises(ConfigError, match=r"key 'data.max_prompt_tokens' = 256: \+ rollout.max_new_tokens \(32\) = "
                                          r"288 tokens, over the model's max_position_embeddings \(256\)"):
        preflight(load_config(None, [model, "data.max_prompt_tokens=256", "rollout.max_new_tokens=32"]))
    preflight(load_config(None, [model, "data.max_prompt_tokens=224", "rollout.max_new_tokens=32"]))


def test_a_checkpoint_the_learner_cannot_build_is_refused(edited_model):
    """Whatever learner.model.read_arch refuses, the preflight refuses first, naming config.json."""
    cases: dict[str, dict[str, object]] = {"model_type 'gpt2' is not supported": {"model_type": "gpt2"},
             "hidden_act 'gelu' is not supported": {"hidden_act": "gelu"},
             "rope_type 'yarn' is not supported": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                                                   "rope_parameters": None},
             "missing key 'hidden_size'": {"hidden_size": None}}
    for why, fields in cases.items():
        with pytest.raises(ConfigError, match=f"config.json.*{why}|{why}.*config.json"):
            preflight(load_config(None, [edited_model(**fields)]))
    with pytest.raises(ConfigError, match="directory not found"):
        preflight(load_config(None, ["model.hf_path=/nonexistent/model"]))
    model = edited_model()
    for weights in Path(model.split("=", 1)[1]).glob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(ConfigError, match=r"has no \*.safetensors weights .* pytorch_model.bin is a pickle"):
        preflight(load_config(None, [model]))


@pytest.fixture
def model_copy(hf_model, tmp_path) -> Path:
    """A copy of hf_model to break."""
    return shutil.copytree(hf_model, tmp_path / "model")


def test_truncated_weights_are_refused_naming_the_file_and_tensor(model_copy):
    """An interrupted copy: found from the safetensors header and the file size, before torchrun,
    not as a SafetensorError on learner rank 0; weights whose shapes config.json does not imply too."""
    weights = model_copy / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(ConfigError, match=rf"key 'model.hf_path' = '{model_copy}': {weights}: truncated: tensor "
                                          rf"model\.\S+ \(F32 \[\d+(, \d+)?\]\) ends at byte \d+, the file has "
                                          rf"{size - 1000} bytes"):
        preflight(load_config(None, [f"model.hf_path={model_copy}"]))
    with open(weights, "r+b") as f:
        f.truncate(4)  # not even the header's length
    with pytest.raises(ConfigError, match=rf"{weights}: truncated: 4 bytes, too short"):
        preflight(load_config(None, [f"model.hf_path={model_copy}"]))
    hf = json.loads((model_copy / "config.json").read_text())
    save_file({name: torch.zeros(shape) for name, shape in expected_hf_shapes(read_arch(hf)).items()}, str(weights))
    (model_copy / "config.json").write_text(json.dumps({**hf, "intermediate_size": 48}))
    with pytest.raises(ConfigError, match=rf"key 'model.hf_path' = '{model_copy}': HF checkpoint {model_copy} does "
                                          r"not match its config.json: tensor model.layers.0.mlp.down_proj.weight in "
                                          r"model.safetensors has shape \[32, 64\], the config implies \[32, 48\]; "):
        preflight(load_config(None, [f"model.hf_path={model_copy}"]))


def test_nan_or_inf_in_the_weights_is_refused_naming_the_tensor(model_copy):
    weights = model_copy / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    tensors["model.layers.1.mlp.up_proj.weight"][4, 0] = float("-inf")
    save_file(tensors, str(weights))
    with pytest.raises(ConfigError, match=rf"key 'model.hf_path' = '{model_copy}': {weights}: tensor "
                                          r"model.layers.1.mlp.up_proj.weight: 2 of its 2048 values are NaN or inf"):
        preflight(load_config(None, [f"model.hf_path={model_copy}"]))


def test_a_model_folder_without_tokenizer_files_is_refused_naming_them(model_copy):
    """Not transformers' "You need to have sentencepiece or tiktoken installed" (misleading: it
    has both); the files that are missing and the folder."""
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=rf"key 'model.hf_path' = '{model_copy}': no tokenizer in {model_copy}: "
                                          r"tokenizer.json missing \(nor a slow tokenizer's tokenizer.model, "
                                          r"vocab.json, vocab.txt\)"):
        preflight(load_config(None, [f"model.hf_path={model_copy}"]))
    (model_copy / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="tokenizer.json and tokenizer_config.json missing"):
        preflight(load_config(None, [f"model.hf_path={model_copy}"]))


def test_an_out_dir_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "runs"
    file.write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"key 'run.out_dir' = '{file}': {file} is a file, not a folder \(the run "
                                          rf"directory would be {file}/run\)"):
        preflight(load_config(None, [f"run.out_dir={file}"]))
    with pytest.raises(ConfigError, match=rf"key 'run.out_dir' = '{file}/deeper': {file} is a file"):
        preflight(load_config(None, [f"run.out_dir={file}/deeper"]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run").write_text("")
    with pytest.raises(ConfigError, match=rf"key 'run.name' = 'run': {tmp_path}/out/run is a file"):
        preflight(load_config(None, [f"run.out_dir={tmp_path}/out"]))
    preflight(load_config(None, [f"run.out_dir={tmp_path}/new/runs"]))  # made when the run starts


def test_a_tracking_server_that_does_not_answer_is_refused():
    with pytest.raises(ConfigError, match=r"key 'tracking.uri' = 'http://127.0.0.1:1': no server answers there "
                                          r"\(ConnectionRefusedError: .* tracking.flush_timeout_s = 5 s\)"):
        preflight(load_config(None, ["tracking.uri=http://127.0.0.1:1"]))
    preflight(load_config(None, ["tracking.uri=http://127.0.0.1:1", "tracking.enabled=false"]))
    with socket.create_server(("127.0.0.1", 0)) as server:  # something listens: accepted
        preflight(load_config(None, [f"tracking.uri=http://127.0.0.1:{server.getsockname()[1]}"]))


def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused(edited_model):
    with pytest.raises(ConfigError, match=r"key 'model.hf_path' = .*the tokenizer has 300 tokens but config.json "
                                          r"has vocab_size=200"):
        preflight(load_config(None, [edited_model(vocab_size=200)]))


def test_bf16_replicas_on_a_cpu_that_emulates_bf16_are_warned_about(monkeypatch, caplog, tmp_path):
    from megatron_async.cluster.cpu_affinity import cpu_flags
    from megatron_async.run import preflight as module

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "sse", "avx2", "avx512f"} and cpu_flags(str(tmp_path / "none")) == set()
    monkeypatch.setattr(module.torch.cuda, "device_count", lambda: 0)
    for flags, dtype, warned in (({"avx2"}, "bfloat16", True), ({"avx2", "avx512_bf16"}, "bfloat16", False),
                                 ({"avx2"}, "float32", False), (set(), "bfloat16", False)):
        monkeypatch.setattr(module, "cpu_flags", lambda: flags)
        caplog.clear()
        with caplog.at_level("WARNING", logger="megatron_async.run.preflight"):
            preflight(load_config(None, [f"model.dtype={dtype}"]))
        assert ("vLLM emulates bf16" in caplog.text) == warned, (flags, dtype, caplog.text)


def test_data_that_is_not_utf8_is_refused_naming_file_line_and_byte(tmp_path):
    """A Latin-1 export (an e-acute as the one byte 0xe9): not a raw UnicodeDecodeError without a file."""
    first = (GOOD + "\n").encode()
    latin1 = tmp_path / "train.jsonl"
    latin1.write_bytes(first + '{"question": "Caf\xe9 sells 3 cakes. How many?", "answer": "#### 3"}\n'.encode("latin-1"))
    offset = len(first) + len('{"question": "Caf')
    with pytest.raises(ConfigError, match=rf"key 'data.train' = '{latin1}': {latin1} line 2: not UTF-8 \(invalid "
                                          rf"continuation byte: byte 0xe9 at byte offset {offset}, byte 18 of the line\); "
                                          r"data files must be UTF-8 text"):
        preflight(load_config(None, [f"data.train={latin1}"]))
    array = tmp_path / "test.json"
    data = b'[\n  {"question": "a?", "answer": "#### 1"},\n  {"question": "\xff?", "answer": "#### 2"}\n]'
    array.write_bytes(data)
    with pytest.raises(ConfigError, match=rf"key 'data.eval' = '{array}': {array} line 3: not UTF-8 \(invalid start "
                                          rf"byte: byte 0xff at byte offset {data.index(0xff)}, byte 17 of the line\)"):
        preflight(load_config(None, [f"data.eval={array}"]))
    latin1.write_text(GOOD + "\n" + json.dumps({"question": "Café sells 3 cakes?", "answer": "#### 3"}, ensure_ascii=False))
    preflight(load_config(None, [f"data.train={latin1}"]))  # the same text in UTF-8


@pytest.fixture(scope="module")
def reward_model(hf_model, tmp_path_factory) -> Path:
    """A tiny LlamaForSequenceClassification (one label, a pad token) with hf_model's tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    hf = json.loads((hf_model / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=hf["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=hf["pad_token_id"])
    cfg.num_labels = 1  # a PretrainedConfig property, not one of LlamaConfig's typed arguments
    LlamaForSequenceClassification(cfg).save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_model / name, out / name)
    return out


def test_a_reward_model_folder_that_is_not_one_is_refused_saying_what_it_needs(reward_model, hf_model, tmp_path):
    """Not transformers' "You need to have sentencepiece or tiktoken installed" after torchrun started,
    nor a causal LM scored through a random head: what is missing, and what the folder must hold."""
    needs = r"a reward model folder holds config.json naming a \*ForSequenceClassification architecture"

    def refused(folder, expect: str):
        with pytest.raises(ConfigError, match=rf"key 'reward.model_path' = '{folder}': {expect}"):
            preflight(load_config(None, ["reward.kind=reward_model", f"reward.model_path={folder}"]))

    preflight(load_config(None, ["reward.kind=reward_model", f"reward.model_path={reward_model}"]))
    refused(tmp_path / "none", f"directory not found; {needs}")
    (tmp_path / "run").mkdir()
    refused(tmp_path / "run", f"no config.json in it: not an HF model folder; {needs}")
    refused(hf_model, rf"config.json names architectures \['LlamaForCausalLM'\], no \*ForSequenceClassification: not a "
                      rf"reward model .*; {needs}")
    broken = {name: shutil.copytree(reward_model, tmp_path / name) for name in ("labels", "weights", "tokenizer")}
    config = json.loads((reward_model / "config.json").read_text())
    (broken["labels"] / "config.json").write_text(json.dumps({**config, "id2label": {"0": "bad", "1": "good"}}))
    refused(broken["labels"], r"config.json has num_labels=2 .*, expected 1")
    (broken["weights"] / "model.safetensors").unlink()
    refused(broken["weights"], r"has no \*.safetensors weights")
    (broken["tokenizer"] / "tokenizer.json").unlink()
    refused(broken["tokenizer"], rf"no tokenizer in {broken['tokenizer']}: tokenizer.json missing")


def listener_after_a_free_port() -> socket.socket:
    """A listening socket on a port P whose port P - 1 is free (other tests' servers come and go)."""
    for _ in range(100):
        taken = socket.create_server(("127.0.0.1", 0))
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", taken.getsockname()[1] - 1))
                return taken
            except OSError:
                taken.close()
    raise RuntimeError("no free port below a listening one in 100 tries")


def test_a_replica_port_another_process_holds_is_refused_naming_the_replica(monkeypatch):
    """rollout.base_port + i for replica i: found by binding it here, not as Errno 98 from rank 0."""
    with listener_after_a_free_port() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"key 'rollout.base_port' = {port - 1}: port {port} on 127.0.0.1, which "
                                              r"replica 1 of rollout.num_replicas=2 would listen on \(base_port \+ 1\), is "
                                              r"not free: another process listens there"):
            preflight(load_config(None, [f"rollout.base_port={port - 1}", "rollout.num_replicas=2"]))
        with pytest.raises(ConfigError, match=rf"port {port} on 127.0.0.1, which replica 0 "):
            preflight(load_config(None, [f"rollout.base_port={port}"]))
        monkeypatch.setenv("RANK", "1")  # another rank's preflight: rank 0's starts the replicas
        preflight(load_config(None, [f"rollout.base_port={port}"]))
    monkeypatch.delenv("RANK")
    preflight(load_config(None, [f"rollout.base_port={port}"]))  # free again


def write_checkpoint(cfg, step: int, arch: dict, value_arch: dict | None = None) -> Path:
    """A run checkpoint's folder as `run.checkpoint.save_run_checkpoint` leaves it, for the preflight
    (which reads its manifest and files, not the tensors): manifest.json with the saved architecture
    and every file's sha256 and size, and `latest` naming it."""
    from megatron_async.learner.checkpoint import FORMAT, MANIFEST, file_digests
    from megatron_async.run.checkpoint import ROLLOUT_STATE, checkpoint_root

    def manifest(folder: Path, arch: dict) -> None:
        (folder / "dist").mkdir(parents=True)
        (folder / "dist" / "__0_0.distcp").write_bytes(os.urandom(4096))
        files = file_digests(folder, [p for p in sorted(folder.rglob("*")) if p.is_file()])
        (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "arch": arch, "has_optimizer": True,
                                                   "extra": {"next_step": step},
                                                   "files": {name: d["sha256"] for name, d in files.items()},
                                                   "sizes": {name: d["bytes"] for name, d in files.items()}}))

    path = checkpoint_root(cfg) / f"step_{step:06d}"
    if value_arch is not None:
        manifest(path / "value", value_arch)
    (path / ROLLOUT_STATE).parent.mkdir(parents=True, exist_ok=True)
    (path / ROLLOUT_STATE).write_text(json.dumps({"next_step": step}))
    manifest(path, arch)
    (checkpoint_root(cfg) / "latest").write_text(path.name)
    return path


def tiny_arch(model_overrides: list[str]) -> dict:
    """The architecture (as a manifest stores it) of the tiny model these model.tiny_* overrides build."""
    from megatron_async.models.base_model import tiny_spec
    from megatron_async.models.tiny import llama_config

    spec = tiny_spec(load_config(None, model_overrides).model)
    return json.loads(json.dumps(read_arch(llama_config(spec, 1024, 1, 2, 0).to_dict()).to_dict()))


def test_resume_with_another_model_size_is_refused_naming_the_keys(tmp_path, hf_model, edited_model):
    """The issue's case (model.tiny_hidden_size 128 -> 256), found from the checkpoint's manifest before
    launch, naming the key, its value and the saved one; a model.hf_path of another shape by field."""
    run = [f"run.out_dir={tmp_path}", "run.resume=true"]
    write_checkpoint(load_config(None, run), 2, tiny_arch([]))
    preflight(load_config(None, run))
    with pytest.raises(ConfigError, match=r"key 'model.tiny_hidden_size' = 256 but the checkpoint's model has "
                                          r"hidden_size 128; key 'model.tiny_layers' = 2 but the checkpoint's model has "
                                          rf"num_layers 4; cannot resume from {tmp_path}/run/checkpoints/step_000002: "
                                          r"resume with the model it was saved with, or start a new run"):
        preflight(load_config(None, [*run, "model.tiny_hidden_size=256", "model.tiny_layers=2"]))
    model = edited_model()
    hf_run = [*run, "run.name=hf", model]
    write_checkpoint(load_config(None, hf_run), 1, json.loads(json.dumps(read_arch(hf_model).to_dict())))
    preflight(load_config(None, hf_run))
    with pytest.raises(ConfigError, match=rf"key 'model.hf_path' = '{tmp_path}/edited': its config.json has "
                                          r"intermediate_size 48 \(the checkpoint's: 64\); cannot resume"):
        preflight(load_config(None, [*run, "run.name=hf", edited_model(intermediate_size=48)]))
    with pytest.raises(ConfigError, match=r"key 'trainer.algorithm' = 'ppo' trains a value model, and the checkpoint "
                                          r"has none \(value/\)"):
        preflight(load_config(None, [*run, "trainer.algorithm=ppo"]))


def test_resume_from_a_corrupt_checkpoint_names_the_newest_intact_one(tmp_path, monkeypatch):
    """The latest checkpoint's file does not match its manifest: refused before launch (not a ValueError
    from rank 0), naming the file, the intact checkpoint beside it and the override that resumes from it."""
    from megatron_async.run.checkpoint import resume_checkpoint

    run = [f"run.out_dir={tmp_path}", "run.resume=true"]
    cfg = load_config(None, run)
    first, latest = (write_checkpoint(cfg, step, tiny_arch([])) for step in (10, 20))
    with open(latest / "dist" / "__0_0.distcp", "r+b") as f:
        f.write(b"\0")  # one byte: a bad sector, a copy cut short and padded
    with pytest.raises(ConfigError, match=rf"key 'run.resume' = True: cannot resume from {latest}: checkpoint {latest}: "
                                          r"file dist/__0_0.distcp is corrupt \(sha256 differs from the manifest\); the "
                                          rf"newest intact checkpoint is {first} \(step 10\): resume from it with "
                                          r"--resume run.resume_from=step_000010 \(the steps after it are trained again\)"):
        preflight(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun each rank's preflight hashes its share of the files
    for rank, refused in ((1, False), (0, True)):  # the larger file, the corrupt one, is rank 0's
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        with pytest.raises(ConfigError, match=r"file dist/__0_0.distcp is corrupt") if refused else nullcontext():
            preflight(cfg)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name)
    again = load_config(None, [*run, "run.resume_from=step_000010"])
    preflight(again)
    assert resume_checkpoint(again) == first
    assert resume_checkpoint(load_config(None, [*run, f"run.resume_from={first}"])) == first  # a path
    with pytest.raises(ConfigError, match=r"key 'run.resume_from' = 'step_000010': is read only when resuming: add "
                                          r"--resume"):
        preflight(load_config(None, [f"run.out_dir={tmp_path}", "run.resume_from=step_000010"]))
    with pytest.raises(ConfigError, match=rf"key 'run.resume_from' = 'step_000030': {first.parent}/step_000030 not "
                                          r"found \(this run's checkpoints: step_000010, step_000020\)"):
        preflight(load_config(None, [*run, "run.resume_from=step_000030"]))
    (first / "rollout_state.json").unlink()
    with pytest.raises(ConfigError, match=r"file rollout_state.json listed in the manifest is missing; no intact "
                                          rf"checkpoint is left in {first.parent}: start again without --resume"):
        preflight(load_config(None, [*run, "run.resume_from=step_000010"]))


def test_a_corrupt_parquet_file_is_refused_naming_the_key_and_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(GOOD)] * 3), good)
    preflight(load_config(None, [f"data.train={good}"]))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[:good.stat().st_size // 2])  # a copy cut short
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 not really")
    for bad, key in ((cut, "data.train"), (junk, "data.eval")):
        with pytest.raises(ConfigError, match=rf"key '{key}' = '{bad}': {bad}: not a readable parquet file \(Arrow"):
            preflight(load_config(None, [f"{key}={bad}"]))


def test_an_eval_set_smaller_than_eval_size_is_taken_whole_with_a_warning(tmp_path, caplog):
    """Decision (docs/reliability.md): the held-out evaluation uses what data.eval has; the
    preflight's warning goes to the console and train.log, the summary names both numbers."""
    two = jsonl(tmp_path / "test.jsonl", [GOOD, GOOD])
    with caplog.at_level("WARNING", logger="megatron_async.run.preflight"):
        preflight(load_config(None, [f"data.eval={two}", "data.eval_size=64"]))
    assert f"data.eval = {two} has 2 problems, fewer than data.eval_size = 64: the held-out evaluation uses all 2" \
        in caplog.text
    caplog.clear()
    preflight(load_config(None, [f"data.eval={two}", "data.eval_size=2"]))
    assert "fewer than data.eval_size" not in caplog.text


def cached_hub_set(cache: Path, name: str, rows: list[dict]) -> None:
    """`rows` in `cache` as `datasets` keeps a hub set it downloaded (`<org>___<name>/<config>/<version>/<hash>/`,
    arrow files per split): prepared by its own json builder, then moved to the hub set's place."""
    import datasets

    source = jsonl(cache.parent / "rows.jsonl", [json.dumps(r) for r in rows])
    builder = datasets.load_dataset_builder("json", data_files={"train": str(source), "test": str(source)},
                                            cache_dir=str(cache / "build"))
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    org, set_name = name.split("/")
    target = shutil.copytree(built, cache / f"{org}___{set_name}" / "default" / built.parts[-2] / built.parts[-1])
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(arrow.with_name(arrow.name.replace("json-", f"{set_name}-")))
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default", "dataset_name": set_name}))


def test_a_hub_dataset_not_in_the_local_cache_is_refused_saying_how_to_get_it(tmp_path, monkeypatch):
    """Looked up offline before launch (it was a DataError traceback from rank 0, 37 s after torchrun
    and the replicas started, on a machine without network); found in the cache, it is read and checked."""
    import datasets
    import huggingface_hub.constants

    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    online = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    with pytest.raises(ConfigError, match=rf"key 'data.train' = 'testorg/tiny_set': not in the local `datasets` cache "
                                          rf"\({cache}; looked up offline: .*\); download it once where there is network, "
                                          r"with the same HF_HOME / HF_DATASETS_CACHE: python -c \"import datasets; "
                                          r"datasets.load_dataset\('testorg/tiny_set'\)\", or give a .jsonl"):
        preflight(load_config(None, ["data.train=testorg/tiny_set"]))
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == online  # switched back
    cached_hub_set(cache, "testorg/tiny_set", [json.loads(GOOD)] * 3)
    preflight(load_config(None, ["data.train=testorg/tiny_set", "data.eval=testorg/tiny_set", "data.eval_size=3"]))
    cached_hub_set(tmp_path / "other", "testorg/bad_set", [{"question": "q?", "answer": "no number"}])
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "other")
    with pytest.raises(ConfigError, match=r"key 'data.eval' = 'testorg/bad_set': dataset testorg/bad_set\[test\] row 0: "
                                          r"field 'answer' has no final number"):
        preflight(load_config(None, ["data.eval=testorg/bad_set"]))


def test_an_out_dir_on_a_read_only_filesystem_is_refused(tmp_path):
    """A read-only filesystem (was an OSError traceback from rank 0), for a new run directory (named
    by run.out_dir, its parent) and for one that is there already (named by run.name)."""
    from tests.test_checkpoint_save import tmpfs

    runs = tmp_path / "disk" / "runs"
    with tmpfs(tmp_path / "disk", size_bytes=1 << 20) as make_read_only:
        preflight(load_config(None, [f"run.out_dir={runs}", "run.name=new"]))
        (runs / "old").mkdir(parents=True)
        make_read_only()
        with pytest.raises(ConfigError, match=rf"key 'run.out_dir' = '{runs}': cannot write in {runs} \(Read-only file "
                                              rf"system\): the run directory {runs}/new needs a writable folder"):
            preflight(load_config(None, [f"run.out_dir={runs}", "run.name=new"]))
        with pytest.raises(ConfigError, match=rf"key 'run.name' = 'old': cannot write in {runs}/old \(Read-only"):
            preflight(load_config(None, [f"run.out_dir={runs}", "run.name=old"]))


# --------------------------------------------------------------------------- the command line


def cli(command: str, *words: str, cwd: Path, config: str | Path = CPU_TINY) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "megatron_async", command, str(config), *words], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_refused_in_one_line(proc: subprocess.CompletedProcess, prefix: str, expect: str) -> None:
    """Exit 2 and ONE line on stderr, starting with `prefix` and holding `expect`; nothing else."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert lines[0].startswith(prefix) and expect in lines[0], lines[0]


@pytest.mark.integration  # runs the CLI as a subprocess (it exits in seconds: preflight fails first)
@pytest.mark.parametrize("case", ["malformed", "no_number", "resume"])
def test_train_cli_says_one_clean_line_and_starts_nothing(case, tmp_path):
    out = tmp_path / "runs"
    if case == "resume":
        words, expect = ["--resume"], f"key 'run.resume' = True: no checkpoint in {out}/cpu_tiny/checkpoints"
    else:
        lines = [GOOD, MALFORMED] if case == "malformed" else [GOOD, NO_NUMBER]
        data = jsonl(tmp_path / "train.jsonl", lines)
        what = "malformed JSON" if case == "malformed" else "field 'answer' has no final number"
        words, expect = [f"data.train={data}"], f"{data} line 2: {what}"
    t0 = time.monotonic()
    proc = cli("train", *words, f"run.out_dir={out}", cwd=tmp_path)
    assert_refused_in_one_line(proc, "megatron-async: config error: ", expect)
    assert not out.exists()  # no run directory: nothing (torchrun, learner, replicas, MLflow) started
    assert time.monotonic() - t0 < 60


@pytest.mark.integration  # as above
@pytest.mark.parametrize("case", ["truncated", "nan", "no_tokenizer", "out_dir_file", "tracking", "key_twice",
                                  "parquet", "hub_not_cached"])
def test_train_cli_refuses_bad_input_in_one_line(case, hf_model, tmp_path, monkeypatch):
    """Bad input that was a traceback after launch (truncated weights, no tokenizer files, an out_dir
    that is a file, a tracking server that does not answer, a corrupt parquet file, a hub set not in
    the cache) or a silent run (NaN weights, a key given twice): one line and exit 2, before torchrun."""
    model, out, config = shutil.copytree(hf_model, tmp_path / "model"), tmp_path / "runs", Path(CPU_TINY)
    weights, words = model / "model.safetensors", [f"model.hf_path={model}"]
    if case == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
        expect = f"key 'model.hf_path' = '{model}': {weights}: truncated: tensor "
    elif case == "nan":
        tensors = load_file(str(weights))
        tensors["model.norm.weight"][0] = float("inf")
        save_file(tensors, str(weights))
        expect = f"{weights}: tensor model.norm.weight: 1 of its 32 values are NaN or inf"
    elif case == "no_tokenizer":
        (model / "tokenizer.json").unlink()
        expect = f"key 'model.hf_path' = '{model}': no tokenizer in {model}: tokenizer.json missing"
    elif case == "out_dir_file":
        out.write_text("")
        expect = f"key 'run.out_dir' = '{out}': {out} is a file, not a folder"
    elif case == "tracking":
        words.append("tracking.uri=http://127.0.0.1:1")
        expect = "key 'tracking.uri' = 'http://127.0.0.1:1': no server answers there (ConnectionRefusedError"
    elif case == "parquet":
        junk = tmp_path / "train.parquet"
        junk.write_bytes(b"PAR1 not really")
        words.append(f"data.train={junk}")
        expect = f"key 'data.train' = '{junk}': {junk}: not a readable parquet file (ArrowInvalid"
    elif case == "hub_not_cached":
        monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))  # empty: nothing downloaded
        words.append("data.train=openai/gsm8k:main")
        expect = (f"key 'data.train' = 'openai/gsm8k:main': not in the local `datasets` cache ({tmp_path}/hf_datasets; "
                  "looked up offline")
    else:
        text = config.read_text()
        config = tmp_path / "twice.yaml"
        config.write_text(text + "trainer:\n  steps: 2\n")
        first, second = text.splitlines().index("trainer:") + 1, len(text.splitlines()) + 1
        expect = f"{config}: key 'trainer' given twice (lines {first} and {second})"
    proc = cli("train", *words, f"run.out_dir={out}", cwd=tmp_path, config=config)
    assert_refused_in_one_line(proc, "megatron-async: config error: ", expect)
    assert not out.is_dir()  # no run directory: nothing started


@pytest.mark.integration  # as above: `megatron-async eval` checks before it starts a replica
@pytest.mark.parametrize("case", ["positions", "malformed", "no_template"])
def test_eval_cli_says_one_clean_line_and_starts_nothing(case, hf_model, tmp_path):
    data = jsonl(tmp_path / "test.jsonl", [GOOD, MALFORMED] if case == "malformed" else [GOOD])
    words = {"positions": (["data.max_prompt_tokens=500", "rollout.max_new_tokens=32"],
                           "key 'data.max_prompt_tokens' = 500: + rollout.max_new_tokens (32) = 532 tokens, over the "
                           "model's max_position_embeddings (512)"),
             "malformed": ([], f"key 'data.eval' = '{data}': {data} line 2: malformed JSON"),
             "no_template": (["data.chat_template=true"], "key 'data.chat_template' = True: the tokenizer of")}
    overrides, expect = words[case]
    proc = cli("eval", "--checkpoint", str(hf_model), "--data", str(data), *overrides, cwd=tmp_path)
    assert_refused_in_one_line(proc, "megatron-async eval: ", expect)
