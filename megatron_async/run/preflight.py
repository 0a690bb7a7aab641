"""Checks that touch the world, run once before anything starts: files, model architectures and
weights, tokenizers, data, the reward model, the run directory, the tracking server, the replicas'
ports, the checkpoint to resume from (whole, and of the model this config builds), CPU lists and
the GPU placement.

`config.validate` checks the config on its own (types, ranges, cross-field rules) when it is
loaded; `preflight` checks it against this machine and the files it names. Both raise `ConfigError`
naming the key, the value and the numbers, so a bad run ends in one clean line before torchrun,
the learner or any replica has started.

    cfg = load_config(path, overrides)    # schema
    preflight(cfg, world_size)            # the world (megatron-async train / config)
    preflight_eval(cfg)                   # what megatron-async eval needs of it
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from megatron_async.algorithms import ALGORITHMS
from megatron_async.cluster import placement
from megatron_async.cluster.cpu_affinity import (CPUS_AUTO, NATIVE_BF16_FLAGS, available_cpus, cpu_flags,
                                                  format_cpu_list, parse_cpu_list)
from megatron_async.config import Config, ConfigError
from megatron_async.data import DataError, Problem, format_prompt, load_file, load_hf_dataset, tokenize_prompts
from megatron_async.learner.checkpoint import read_manifest
from megatron_async.learner.mapping import validate_hf_checkpoint
from megatron_async.learner.model import LlamaArch, read_arch
from megatron_async.models.base_model import load_tokenizer, tiny_spec
from megatron_async.rollout.build import replica_urls
from megatron_async.run.checkpoint import (checkpoint_problem, checkpoint_root, checkpoint_step,
                                           newest_intact_checkpoint, resume_checkpoint, run_checkpoints)
from megatron_async.run.run_lock import check_not_in_use
from megatron_async.run_plan import cuda_here, model_dtype

log = logging.getLogger(__name__)


def preflight(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError if `cfg` cannot run here with `world_size` learner ranks (None: not known yet)."""
    try:
        _preflight(cfg, world_size)
    finally:
        _TOKENIZERS.clear()


def preflight_eval(cfg: Config) -> None:
    """Raise ConfigError if `megatron-async eval` cannot evaluate model.hf_path on data.eval: the
    checkpoint, its tokenizer and template, the prompts and the CPU lists; not data.train, the
    learner's TP x PP split or a checkpoint to resume, which an evaluation does not use."""
    try:
        _check_model_and_data(cfg, ("data.eval",))
        _check_cpu_lists(cfg)
        _warn_on_emulated_bf16(cfg)
    finally:
        _TOKENIZERS.clear()


def _preflight(cfg: Config, world_size: int | None) -> None:
    arch = _check_model_and_data(cfg, ("data.train", "data.eval"))
    par = cfg.parallel
    split_problems = arch.split_problems(par.tp, par.pp) if arch is not None else []
    if split_problems:
        axis, why = split_problems[0]
        raise ConfigError(f"key 'parallel.{axis}' = {getattr(par, axis)}: {why} in {cfg.model.hf_path}/config.json")
    _check_run_dir(cfg)
    _check_tracking_server(cfg)
    _check_replica_ports(cfg)
    _check_cpu_lists(cfg)
    _warn_on_emulated_bf16(cfg)
    world = world_size if world_size is not None else par.world_size
    if world:
        _require(world % (par.tp * par.pp) == 0, "parallel.world_size", world,
                 f"must be a multiple of tp x pp = {par.tp} x {par.pp} = {par.tp * par.pp}")
    if cfg.placement.gpus_per_node:  # known before launch: the whole GPU layout must fit
        placement.check_fit(cfg, cfg.placement.gpus_per_node, world or None)
    _check_resume(cfg, arch)


def _check_model_and_data(cfg: Config, data_keys: tuple[str, ...]) -> LlamaArch | None:
    """The policy checkpoint, its chat template, the reward model, the prompt template and the data
    sources `data_keys` with their prompts' lengths -> the policy's architecture (None: tiny)."""
    arch = _check_model(cfg)
    if cfg.data.chat_template:
        _check_chat_template(cfg)
    if cfg.reward.kind == "reward_model":
        _check_reward_model(cfg)
    _check_prompt_template(cfg)
    _check_prompt_lengths(cfg, {key: _check_data_source(cfg, key) for key in data_keys})
    return arch


def _is_rank0() -> bool:
    """This process is learner rank 0, or the launcher that starts it: under a torchrun that starts
    `megatron-async train` itself (launch/*.sh), every rank runs the preflight, with its RANK set."""
    return os.environ.get("RANK", "0") == "0"


def _verify_share() -> tuple[int, int]:
    """(rank, world): the share of a checkpoint's files this process verifies. Under a torchrun
    that starts `megatron-async train` itself (launch/*.sh) every rank runs the preflight: each
    hashes its share, and all of them together every file once; elsewhere the one process all."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"key '{key}' = {value!r}: {why}")


def _read_config_json(model_dir: str, key: str) -> dict:
    _require(Path(model_dir).is_dir(), key, model_dir, "directory not found")
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the model config: {e}") from None


def _check_model(cfg: Config) -> LlamaArch | None:
    """The policy checkpoint as the learner will read it (`learner.model.read_arch`: a supported
    LLaMA-family architecture) with room for prompt + completion in its positions, whole and finite
    weights of the shapes its config.json implies, and a tokenizer whose every id has an embedding
    (`models.base_model.load_tokenizer`) -> its architecture."""
    if cfg.model.hf_path == "tiny":
        return None  # built from model.tiny_*, checked by config.validate
    par, config_json = cfg.parallel, Path(cfg.model.hf_path) / "config.json"
    hf = _read_config_json(cfg.model.hf_path, "model.hf_path")
    try:
        arch = read_arch(hf)
    except KeyError as e:
        raise ConfigError(f"{config_json}: missing key {e} (key 'model.hf_path' = {cfg.model.hf_path!r})") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"key 'model.hf_path' = {cfg.model.hf_path!r}: {config_json}: {e}") from None
    # The vocabulary needs no check against TP: the learner pads it to a multiple of
    # model.make_vocab_size_divisible_by x tp (learner/model.py); it must be a positive integer.
    vocab = arch.vocab_size
    if not (isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1):
        raise ConfigError(f"key 'model.hf_path' = {cfg.model.hf_path!r}: config.json has vocab_size={vocab!r}, "
                          "expected a positive integer (the learner pads it to a multiple of "
                          f"model.make_vocab_size_divisible_by x parallel.tp = "
                          f"{cfg.model.make_vocab_size_divisible_by} x {par.tp})")
    budget, positions = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens, arch.max_position_embeddings
    _require(budget <= positions, "data.max_prompt_tokens", cfg.data.max_prompt_tokens,
             f"+ rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) = {budget} tokens, over the model's "
             f"max_position_embeddings ({positions}) in {config_json}")
    files = _check_safetensors(cfg.model.hf_path, "model.hf_path", arch)
    _check_finite_weights(cfg.model.hf_path, "model.hf_path", files)
    _tokenizer(cfg)  # loads and checks it against vocab_size
    return arch


# bits per element of each safetensors dtype (the format's list)
_SAFETENSORS_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16,
                           "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64,
                           "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _check_safetensors(model_dir: str, key: str, arch: LlamaArch | None, score_head: bool = False) -> list[Path]:
    """The checkpoint's safetensors files, there (weights are never read from a pickle) and each
    one whole (`_safetensors_problem`) -> the files. Given its `arch` (a checkpoint the learner
    loads) they hold exactly the tensors and shapes its config.json implies
    (`learner.mapping.validate_hf_checkpoint`, the learner's own check; `score_head`: a reward
    model's); without (a reward model that only scores, any architecture), only their headers."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    _require(bool(files), key, model_dir,
             "has no *.safetensors weights (weights are read from safetensors only: a pytorch_model.bin is a "
             "pickle and is never loaded; save the model with save_pretrained(safe_serialization=True))")
    for path in files:
        if problem := _safetensors_problem(path):
            raise ConfigError(f"key '{key}' = {model_dir!r}: {path}: {problem}")
    if arch is not None:
        try:
            validate_hf_checkpoint(model_dir, arch, score_head)
        except (ValueError, OSError) as e:
            what, *problems = str(e).split("\n  ")  # one line: the problems one after the other
            raise ConfigError(f"key '{key}' = {model_dir!r}: {what} {'; '.join(problems)}".rstrip()) from None
    return files


def _safetensors_problem(path: Path) -> str | None:
    """What makes a safetensors file unreadable (None: nothing), from its header alone: the 8-byte
    header length and the JSON header are read, no tensor data. Every tensor's bytes must be what
    its dtype and shape need, back to back, and end where the file does, as the safetensors loader
    requires; a file cut short (an interrupted copy) names the first tensor it cuts."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or 8 + length > size:
            return f"truncated: {size} bytes, too short for an 8-byte length and its {length}-byte header"
        header = f.read(length)
    data, end = size - 8 - length, 0  # bytes after the header; where the previous tensor ended
    try:
        tensors = sorted(((name, t["dtype"], t["shape"], t["data_offsets"]) for name, t in json.loads(header).items()
                          if name != "__metadata__"), key=lambda t: t[3])
        for name, dtype, shape, (begin, stop) in tensors:
            if dtype not in _SAFETENSORS_DTYPE_BITS:
                return f"tensor {name} has an unknown dtype {dtype!r}"
            need = -(-math.prod(shape) * _SAFETENSORS_DTYPE_BITS[dtype] // 8)
            if begin != end or stop - begin != need:
                return (f"tensor {name} ({dtype} {shape}, {need} bytes) has data_offsets [{begin}, {stop}], "
                        f"expected [{end}, {end + need}]: a corrupt header")
            if stop > data:
                return (f"truncated: tensor {name} ({dtype} {shape}) ends at byte {8 + length + stop}, the file "
                        f"has {size} bytes")
            end = stop
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # not the format's JSON
        return f"unreadable safetensors header ({type(e).__name__}: {e})"
    if end != data:
        return f"{data - end} bytes after the last tensor's data: a corrupt file"
    return None


def _check_finite_weights(model_dir: str, key: str, files: list[Path]) -> None:
    """No NaN or inf in any tensor of `files`, the checkpoint's: a policy with one generates garbage,
    every reward ties and nothing is trained, and the run would end with exit 0. Each tensor is read
    and checked on its own (`safe_open`, memory-mapped: the peak is one tensor and its isfinite
    mask, not the model). Cost: the weights are read once more than by the learner's and replicas'
    own loads, which then find them in the page cache (seconds for a small model: docs/measurements.md,
    "The preflight's finite-weights check: its cost")."""
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                finite = torch.isfinite(fh.get_tensor(name))
                if not finite.all():
                    raise ConfigError(f"key '{key}' = {model_dir!r}: {path}: tensor {name}: {int((~finite).sum())} "
                                      f"of its {finite.numel()} values are NaN or inf (a policy with them generates "
                                      "garbage and trains on nothing)")


def _check_chat_template(cfg: Config) -> None:
    """data.chat_template needs a tokenizer that has one (an instruct model's)."""
    if cfg.model.hf_path == "tiny":
        raise ConfigError("key 'data.chat_template' = True: model.hf_path=tiny builds a BPE tokenizer without a "
                          "chat template; use an instruct model's checkpoint or set data.chat_template=false")
    _require(bool(getattr(_tokenizer(cfg), "chat_template", None)), "data.chat_template", True,
             f"the tokenizer of {cfg.model.hf_path} has no chat template (no chat_template.jinja, none in "
             f"tokenizer_config.json); use an instruct model or set data.chat_template=false")


# what `reward.model_path` must hold, said with every refusal of it
REWARD_MODEL_FOLDER = ("a reward model folder holds config.json naming a *ForSequenceClassification architecture "
                       "with num_labels=1 and a pad_token_id, its *.safetensors weights and its tokenizer files "
                       "(tokenizer.json), as model.save_pretrained(safe_serialization=True) and "
                       "tokenizer.save_pretrained write them")


def _check_reward_model(cfg: Config) -> None:
    """reward.model_path as the scorer loads it (`rewards.reward_model`: AutoModelForSequenceClassification
    from safetensors, its own tokenizer with a pad token): config.json with a sequence-classification
    architecture and one label, whole safetensors weights and tokenizer files. A folder that is none
    of this (a policy's, a run directory) was found only after launch, by transformers, as "You need
    to have sentencepiece or tiktoken installed", or scored with a random head. For PPO, whose value
    model starts from it, it also splits like the policy and holds the tensors the value model loads
    (that it reads the policy's token ids is checked against the model RL starts from, once built:
    `run.learner_state.check_value_model_source`)."""
    r, par, key = cfg.reward, cfg.parallel, "reward.model_path"
    _require(Path(r.model_path).is_dir(), key, r.model_path, f"directory not found; {REWARD_MODEL_FOLDER}")
    _require((Path(r.model_path) / "config.json").is_file(), key, r.model_path,
             f"no config.json in it: not an HF model folder; {REWARD_MODEL_FOLDER}")
    arch = None
    if ALGORITHMS[cfg.trainer.algorithm].value_model:
        try:
            arch = read_arch(r.model_path)
            arch.check_parallel(par.tp, par.pp)
        except (ValueError, KeyError, OSError) as e:
            raise ConfigError(f"key '{key}' = {r.model_path!r}: trainer.algorithm={cfg.trainer.algorithm} "
                              f"starts its value model from the reward model, which must be a LLaMA-family model "
                              f"that splits at parallel.tp={par.tp} x parallel.pp={par.pp}: {type(e).__name__}: "
                              f"{e}") from None
    try:
        hf = AutoConfig.from_pretrained(r.model_path)  # as the scorer reads it (num_labels from id2label)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"key '{key}' = {r.model_path!r}: config.json: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}; {REWARD_MODEL_FOLDER}") from None
    classifiers = [a for a in hf.architectures or [] if a.endswith("ForSequenceClassification")]
    _require(bool(classifiers), key, r.model_path,
             f"config.json names architectures {hf.architectures}, no *ForSequenceClassification: not a reward "
             f"model (a causal LM's folder would score with a random head); {REWARD_MODEL_FOLDER}")
    _require(hf.num_labels == 1, key, r.model_path,
             f"config.json has num_labels={hf.num_labels} (id2label {hf.id2label}), expected 1: a reward model "
             "gives one score per sequence")
    _require(hf.pad_token_id is not None, key, r.model_path,
             "config.json has no pad_token_id: the reward model reads the score at the last token before padding")
    _check_safetensors(r.model_path, key, arch, score_head=arch is not None)
    _check_tokenizer_files(r.model_path, key)
    try:
        pad = AutoTokenizer.from_pretrained(r.model_path).pad_token_id
    except (OSError, ValueError) as e:
        raise ConfigError(f"key '{key}' = {r.model_path!r}: cannot use its tokenizer: {e}") from None
    _require(pad is not None, key, r.model_path, "its tokenizer has no pad token (set one and save it with "
             "tokenizer.save_pretrained): batches of texts are padded")


def _check_data_source(cfg: Config, key: str) -> list | None:
    """A file source exists and parses (every record has its fields and a readable answer), and a
    `datasets` name such as "openai/gsm8k:main" is in the local cache and parses (`_load_cached`)
    -> its problems; None for "synthetic". A held-out set with fewer problems than data.eval_size
    is taken whole, with a warning (the summary says it too: `run.report.run_summary`)."""
    d = cfg.data
    source = getattr(d, key.split(".")[1])
    if source == "synthetic":
        return None
    try:
        if source.endswith((".jsonl", ".json", ".parquet")) or source.startswith((".", "/", "~")):
            _require(Path(source).is_file(), key, source, "file not found")
            problems = load_file(source, d.question_key, d.answer_key)
        else:
            problems = _load_cached(source, "train" if key == "data.train" else "test", d.question_key, d.answer_key)
    except DataError as e:
        raise ConfigError(f"key '{key}' = {source!r}: {e}") from None
    if key == "data.eval" and d.eval_size > len(problems):
        log.warning("data.eval = %s has %d problems, fewer than data.eval_size = %d: the held-out evaluation uses "
                    "all %d", source, len(problems), d.eval_size, len(problems))
    return problems


def _load_cached(name: str, split: str, question_key: str, answer_key: str | None) -> list:
    """A `datasets` source's problems from the local cache only: the hub is not asked (offline mode
    for this call), so a set that was never downloaded is refused here at once, not after a wait
    for the network on rank 0 after launch. Offline mode is switched by the flags `datasets` and
    `huggingface_hub` read at each call (what HF_HUB_OFFLINE=1 sets at import)."""
    import datasets  # lazy: only a run that names a hub set pays for importing it
    import huggingface_hub.constants

    flags = ((datasets.config, datasets.config.HF_HUB_OFFLINE),
             (huggingface_hub.constants, huggingface_hub.constants.HF_HUB_OFFLINE))
    for module, _ in flags:
        setattr(module, "HF_HUB_OFFLINE", True)
    try:
        try:
            return load_hf_dataset(name, split, question_key, answer_key)
        except DataError as e:
            if e.__cause__ is None:  # loaded, but a record is bad: the loader's own message
                raise
            path, _, config = name.partition(":")
            load = f"datasets.load_dataset({path!r}{f', {config!r}' if config else ''})"
            raise DataError(f"not in the local `datasets` cache ({datasets.config.HF_DATASETS_CACHE}; looked up "
                            f"offline: {type(e.__cause__).__name__}: {e.__cause__}); download it once where there "
                            f"is network, with the same HF_HOME / HF_DATASETS_CACHE: python -c \"import datasets; "
                            f"{load}\", or give a .jsonl, .json or .parquet file") from None
    finally:
        for module, before in flags:
            setattr(module, "HF_HUB_OFFLINE", before)


def _check_prompt_template(cfg: Config) -> None:
    """data.prompt_template fills {question} and nothing else."""
    try:
        format_prompt(Problem("preflight", "?", None, None), cfg.data.prompt_template)
    except DataError as e:
        raise ConfigError(f"key 'data.prompt_template' = {cfg.data.prompt_template!r}: {e}") from None


def _check_prompt_lengths(cfg: Config, sources: dict[str, list | None]) -> None:
    """With a real checkpoint's tokenizer and data.on_long_prompt=error, no prompt of a file source
    is over data.max_prompt_tokens (and under "drop" some prompt is left): formatted and tokenized
    as the run will (chat template included), here rather than after the learner is built."""
    if cfg.model.hf_path == "tiny" or not any(sources.values()):
        return  # the tiny tokenizer is built by the run
    tokenizer = _tokenizer(cfg)
    d = cfg.data
    for key, problems in sources.items():
        if not problems:
            continue
        if key == "data.eval" and d.eval_size:
            problems = problems[:d.eval_size]
        try:
            tokenize_prompts(problems, tokenizer, d.max_prompt_tokens, d.prompt_template, d.on_long_prompt,
                             chat=d.chat_template, system_prompt=d.system_prompt)
        except DataError as e:
            raise ConfigError(f"key 'data.max_prompt_tokens' = {d.max_prompt_tokens}: {key}: {e}") from None


_TOKENIZERS: dict[str, Any] = {}  # hf_path -> tokenizer, for the duration of one preflight


def _tokenizer(cfg: Config):
    """The policy checkpoint's tokenizer, checked against its vocabulary (loaded once per preflight)."""
    path = cfg.model.hf_path
    if path not in _TOKENIZERS:
        _check_tokenizer_files(path, "model.hf_path")
        try:
            _TOKENIZERS[path] = load_tokenizer(Path(path))
        except (OSError, ValueError) as e:
            raise ConfigError(f"key 'model.hf_path' = {path!r}: cannot use its tokenizer: {e}") from None
    return _TOKENIZERS[path]


# a fast tokenizer's file, then slow ones' vocabularies: sentencepiece, BPE, WordPiece
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _check_tokenizer_files(model_dir: str, key: str) -> None:
    """The checkpoint folder holds a tokenizer: tokenizer.json or a slow tokenizer's vocabulary.
    Without one transformers fails with "You need to have sentencepiece or tiktoken installed to
    convert a slow tokenizer", which points at the wrong fix."""
    folder = Path(model_dir)
    if any((folder / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        return
    missing = ["tokenizer.json"] + ["tokenizer_config.json"] * (not (folder / "tokenizer_config.json").is_file())
    raise ConfigError(f"key '{key}' = {model_dir!r}: no tokenizer in {folder}: {' and '.join(missing)} missing (nor "
                      f"a slow tokenizer's {', '.join(TOKENIZER_VOCAB_FILES[1:])}); save the model's tokenizer "
                      "there (tokenizer.save_pretrained)")


def _check_run_dir(cfg: Config) -> None:
    """The run directory can be made and written: it, or else the nearest of its parents that
    exists, is a folder (a file there would be a NotADirectoryError on learner rank 0) in which a
    file can be created (a read-only filesystem or folder was an OSError traceback); and no other
    run holds it (`run.run_lock`; rank 0's preflight only: the other ranks' would see rank 0's own
    lock)."""
    run_dir = cfg.run_dir
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    key, value = ("run.name", cfg.run.name) if existing == run_dir else ("run.out_dir", cfg.run.out_dir)
    if not existing.is_dir():
        raise ConfigError(f"key '{key}' = {value!r}: {existing} is a file, not a folder (the run directory would "
                          f"be {run_dir})")
    try:  # created and removed at once: what the run's first write would meet
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".megatron-async-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"key '{key}' = {value!r}: cannot write in {existing} ({e.strerror}): the run directory "
                          f"{run_dir} needs a writable folder") from None
    if _is_rank0():
        check_not_in_use(cfg)


def _check_tracking_server(cfg: Config) -> None:
    """An http(s) tracking.uri answers: something accepts a TCP connection there within
    tracking.flush_timeout_s. Learner rank 0 creates the MLflow run (experiment, run id) when it
    starts, so a server missing then would be a traceback after launch; one that goes away later
    is buffered and retried (observability/tracking.py). Only the connection is tried: what answers
    (a proxy, a login) is the MLflow client's business."""
    t = cfg.tracking
    url = urlparse(t.uri)
    if not t.enabled or url.scheme not in ("http", "https"):
        return  # the embedded store (""), sqlite:/file: stores, databricks, ...
    _require(bool(url.hostname), "tracking.uri", t.uri, "has no host")
    try:  # url.port: ValueError for a port that is not a number in 0-65535
        socket.create_connection((url.hostname, url.port or {"http": 80, "https": 443}[url.scheme]),
                                 timeout=t.flush_timeout_s).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"key 'tracking.uri' = {t.uri!r}: no server answers there ({type(e).__name__}: {e}; "
                          f"tried for up to tracking.flush_timeout_s = {t.flush_timeout_s:g} s); start it, fix the URI, "
                          "or set tracking.uri='' (a store in the run directory) or tracking.enabled=false") from None


def _check_replica_ports(cfg: Config) -> None:
    """rollout.base_port (fixed ports): replica i's vLLM server binds rollout.host:base_port + i,
    and a port another process holds was an "Address already in use" traceback after the launch.
    Each port is bound here once and let go, as vLLM binds it (SO_REUSEADDR: a port left in
    TIME_WAIT by an earlier run is no problem to it either). Only where the replicas start: in the
    process that is or launches learner rank 0, not for servers started elsewhere
    (rollout.replica_urls, a dedicated replica node), and not from the other ranks' preflight."""
    r = cfg.rollout
    if not r.base_port or replica_urls(cfg) or not _is_rank0():
        return  # 0: the pool picks free ports
    family = socket.AF_INET6 if ":" in r.host else socket.AF_INET
    for replica in range(r.num_replicas):
        port = r.base_port + replica
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((r.host, port))
            except OSError as e:
                why = ("another process listens there" if e.errno == errno.EADDRINUSE else
                       f"it cannot be bound here ({e.strerror})")
                raise ConfigError(f"key 'rollout.base_port' = {r.base_port}: port {port} on {r.host}, which replica "
                                  f"{replica} of rollout.num_replicas={r.num_replicas} would listen on (base_port + "
                                  f"{replica}), is not free: {why}; stop that process, choose another "
                                  "rollout.base_port, or set rollout.base_port=0 (free ports)") from None


def _check_resume(cfg: Config, arch: LlamaArch | None) -> None:
    """run.resume: the checkpoint to continue from (`run.checkpoint.resume_checkpoint`: run.resume_from,
    else the latest) exists, every file of it matches its manifest's size and sha256 (each file read
    once here, hashed in threads, split over the ranks' preflights: `_verify_share`; and again when
    the ranks load it, docs/checkpoints.md), and it holds the model this config builds
    (`_check_resumed_model`). A corrupt one is refused, naming the newest intact checkpoint and the
    override that resumes from it; it is not skipped on the quiet (docs/checkpoints.md)."""
    run, root = cfg.run, checkpoint_root(cfg)
    if not run.resume:
        _require(not run.resume_from, "run.resume_from", run.resume_from,
                 "is read only when resuming: add --resume (run.resume=true)")
        _check_no_previous_run(cfg)
        return
    key, value = ("run.resume_from", run.resume_from) if run.resume_from else ("run.resume", True)
    ckpt = resume_checkpoint(cfg)
    if ckpt is None:
        raise ConfigError(f"key 'run.resume' = True: no checkpoint in {root} (nothing was saved yet)")
    if not ckpt.is_dir():
        saved = ", ".join(p.name for p in run_checkpoints(cfg)) or "none"
        raise ConfigError(f"key '{key}' = {value!r}: {ckpt} not found (this run's checkpoints: {saved})")
    if problem := checkpoint_problem(ckpt, _verify_share()):
        intact = newest_intact_checkpoint(cfg, besides=ckpt)
        if intact is None:
            fix = f"no intact checkpoint is left in {root}: start again without --resume (or under another run.name)"
        else:
            fix = (f"the newest intact checkpoint is {intact} (step {checkpoint_step(intact)}): resume from it with "
                   f"--resume run.resume_from={intact.name} (the steps after it are trained again)")
        raise ConfigError(f"key '{key}' = {value!r}: cannot resume from {ckpt}: {problem}; {fix}")
    _check_resumed_model(cfg, ckpt, arch)


def _check_no_previous_run(cfg: Config) -> None:
    """A fresh run (no --resume) starts only in a folder without a previous run's checkpoints or
    final model: it would replace them (its checkpoints prune the old ones, its outputs overwrite
    history, evaluations and plot). Nothing of that run is removed or moved here: it is continued
    with --resume, or a new run gets another folder (docs/checkpoints.md)."""
    saved = run_checkpoints(cfg)
    final = cfg.run_dir / "hf_final"
    if not saved and not final.is_dir():
        return
    what = f"checkpoints up to {saved[-1].name}" if saved else f"a final model ({final.name})"
    raise ConfigError(f"key 'run.resume' = False: run folder {cfg.run_dir} holds a previous run ({what}); continue it "
                      f"with --resume, or start over under another run.name (or move {cfg.run_dir} away first); "
                      "nothing of it is removed")


def _check_resumed_model(cfg: Config, ckpt: Path, arch: LlamaArch | None) -> None:
    """The checkpoint's model (its manifest's architecture, and for PPO its value model's) is the one
    this config builds. Otherwise another model.hf_path fails after launch, in megatron's load of
    the saved shapes, and changed model.tiny_* would be ignored without a word (the run directory
    keeps the tiny base model it built first). Named by the keys that set them: model.tiny_* for
    the tiny model, the fields of model.hf_path's (or reward.model_path's) config.json otherwise."""
    saved = read_manifest(ckpt, verify=False)["arch"]  # verified by _check_resume
    if arch is None:  # the tiny model: model.tiny_* give its shape
        spec = tiny_spec(cfg.model)
        now = {"hidden_size": ("model.tiny_hidden_size", spec.hidden_size),
               "num_layers": ("model.tiny_layers", spec.num_hidden_layers),
               "num_heads": ("model.tiny_heads", spec.num_attention_heads),
               "num_kv_heads": ("model.tiny_kv_heads", spec.num_key_value_heads)}
        differences = [f"key '{key}' = {value} but the checkpoint's model has {field} {saved.get(field)}"
                       for field, (key, value) in now.items() if saved.get(field) != value]
    else:
        differences = _arch_differences("model.hf_path", cfg.model.hf_path, arch, saved)
    if ALGORITHMS[cfg.trainer.algorithm].value_model:
        if not (ckpt / "value").is_dir():
            differences.append(f"key 'trainer.algorithm' = {cfg.trainer.algorithm!r} trains a value model, and the "
                               "checkpoint has none (value/): it was saved by a run without one")
        elif cfg.reward.kind == "reward_model":  # the value model is the reward model's shape
            value_saved = read_manifest(ckpt / "value", verify=False)["arch"]
            differences += _arch_differences("reward.model_path", cfg.reward.model_path,
                                             read_arch(cfg.reward.model_path), value_saved)
    if differences:
        raise ConfigError(f"{'; '.join(differences)}; cannot resume from {ckpt}: resume with the model it was "
                          "saved with, or start a new run (another run.name, without --resume)")


def _arch_differences(key: str, model_dir: str, arch: LlamaArch, saved: dict) -> list[str]:
    """How `arch` (model_dir's config.json) differs from a checkpoint's saved architecture, one
    phrase per field."""
    now = json.loads(json.dumps(arch.to_dict()))  # tuples -> lists, as the manifest stores them
    fields = [f"{field} {value!r} (the checkpoint's: {saved.get(field)!r})"
              for field, value in now.items() if saved.get(field) != value]
    return [f"key '{key}' = {model_dir!r}: its config.json has {', '.join(fields)}"] if fields else []


def _check_cpu_lists(cfg: Config) -> None:
    have = available_cpus()
    for key, text in (("parallel.learner_cpus", cfg.parallel.learner_cpus), ("rollout.replica_cpus", cfg.rollout.replica_cpus)):
        if text == CPUS_AUTO:  # resolved at launch, over whatever CPUs there are (placement.cpu_plan)
            continue
        try:
            cpus = parse_cpu_list(str(text))  # YAML reads a lone CPU (0) as an int
        except ValueError as e:
            raise ConfigError(f"key '{key}' = {text!r}: {e}") from None
        missing = [c for c in cpus if c not in have]
        _require(not missing, key, text, f"CPU(s) {format_cpu_list(missing)} do not exist here "
                 f"(this machine has CPUs 0-{max(have)}; '' = no pinning)")


def _warn_on_emulated_bf16(cfg: Config) -> None:
    """bf16 replicas on a CPU without native bf16 run, but slowly (several times slower than fp32:
    docs/real-models.md): a warning, not a refusal."""
    if model_dtype(cfg.model)[0] != "bfloat16" or cfg.rollout.replica_urls or cuda_here():
        return
    flags = cpu_flags()
    if flags and not flags & NATIVE_BF16_FLAGS:
        log.warning("model.dtype=bfloat16 on a CPU without %s: vLLM emulates bf16 here and generates several "
                    "times slower than in float32; model.dtype=float32 is the faster choice on this machine",
                    " or ".join(sorted(NATIVE_BF16_FLAGS)))
