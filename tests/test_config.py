"""Config loading: YAML + dotted overrides, type checks, cross-field validation, saving."""
import string

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_async.config import Config, ConfigError, load_config
from megatron_async.config_io import DuplicateKeyLoader, flatten, save_config
from megatron_async.run.preflight import preflight
from megatron_async.run_plan import weight_transport


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_yaml_then_overrides(tmp_path):
    p = write(tmp_path, {"trainer": {"lr": 1e-4, "steps": 3}, "rollout": {"k": 8}})
    cfg = load_config(p, ["trainer.lr=1e-6", 'rollout.stop=["\\n\\n"]', "run.name=abc"])
    assert cfg.trainer.lr == 1e-6 and cfg.trainer.steps == 3 and cfg.rollout.k == 8
    assert cfg.rollout.stop == ["\n\n"] and cfg.run.name == "abc"


def test_int_widens_to_float_but_nothing_else_is_guessed(tmp_path):
    assert load_config(None, ["trainer.lr=1"]).trainer.lr == 1.0
    with pytest.raises(ConfigError, match=r"trainer\.steps.*expected int.*'ten'"):
        load_config(None, ["trainer.steps=ten"])
    with pytest.raises(ConfigError, match=r"trainer\.steps.*expected int"):
        load_config(None, ["trainer.steps=2.5"])
    with pytest.raises(ConfigError, match=r"run\.resume.*expected bool"):
        load_config(None, ["run.resume=1"])


@pytest.mark.parametrize("data, key", [
    ({"trainer": {"lrr": 1}}, "trainer.lrr"),
    ({"trainerr": {"lr": 1}}, "trainerr"),
    ({"trainer": {"lr": {"x": 1}}}, "trainer.lr"),
])
def test_unknown_or_misplaced_keys_name_the_file_and_key(tmp_path, data, key):
    p = write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert key in str(e.value) and str(p) in str(e.value)


def test_section_set_as_value_is_refused():
    with pytest.raises(ConfigError, match="'trainer' is a section"):
        load_config(None, ["trainer=3"])


def test_literal_choices():
    with pytest.raises(ConfigError, match=r"trainer\.algorithm.*'reinforce' is not one of"):
        load_config(None, ["trainer.algorithm=reinforce"])


@pytest.mark.parametrize("overrides, key", [
    (["parallel.tp=3"], "parallel.tp"),                                # 4 heads
    (["model.tiny_heads=8", "model.tiny_kv_heads=2", "parallel.tp=4"], "parallel.tp"),  # 2 groups
    (["parallel.world_size=6", "parallel.tp=2", "parallel.pp=2"], "parallel.world_size"),
    (["rollout.max_lag=-1"], "rollout.max_lag"),
    (["rollout.k=1"], "rollout.k"),
    (["trainer.algorithm=rloo", "rollout.k=1"], "rollout.k"),
    (["rollout.host=0.0.0.0"], "rollout.token"),
    (["rollout.weight_transport=shm", "rollout.host=10.0.0.5", "rollout.token=t"], "rollout.weight_transport"),
    (["rollout.weight_transport=udp"], "rollout.weight_transport"),
    (["rollout.weight_transport=nccl", "rollout.rendezvous_port=80"], "rollout.rendezvous_port"),
    (["rollout.weight_transport=gloo", "parallel.pp=2", "rollout.num_replicas=2", "rollout.rendezvous_port=65532"],
     "rollout.rendezvous_port"),  # 2 stages x 2 replicas: 4 ports from 65532 pass 65535
    (["rollout.sync_full_every=1"], "rollout.sync_full_every"),
    (["rollout.sync_full_every=5", "rollout.weight_transport=nccl"], "rollout.sync_full_every"),
    (["trainer.logits_chunk_mb=-1"], "trainer.logits_chunk_mb"),
    (["trainer.minibatches=3"], "trainer.minibatches"),
    (["model.hf_path=/no/such/model"], "model.hf_path"),
    (["data.train=/no/such/file.jsonl"], "data.train"),
    (["reward.kind=reward_model"], "reward.model_path"),
    (["reward.kind=reward_model", "reward.model_path=.", "trainer.algorithm=best_of_k_sft"], "trainer.algorithm"),
    (["reward.kind=reward_model", "reward.model_path=.", "reward.device=gpu0"], "reward.device"),
    (["data.answer_key=null"], "data.answer_key"),  # exact match needs the reference
    (["reward.kind=reward_model", "reward.model_path=.", "data.answer_key=null", "sft.steps=5"], "data.answer_key"),
    (["trainer.algorithm=ppo", "trainer.value_lr=0"], "trainer.value_lr"),
    (["trainer.algorithm=ppo", "trainer.lam=1.5"], "trainer.lam"),
    (["model.make_vocab_size_divisible_by=0"], "model.make_vocab_size_divisible_by"),
    (["trainer.max_bad_steps=0"], "trainer.max_bad_steps"),
    (["tracking.flush_timeout_s=0"], "tracking.flush_timeout_s"),
])
def test_impossible_settings_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:  # the schema's checks or the preflight's: before anything starts
        preflight(load_config(None, overrides))
    assert f"'{key}'" in str(e.value)


def test_broadcast_transports_are_accepted_at_every_learner_layout():
    preflight(load_config(None, ["rollout.weight_transport=nccl", "parallel.tp=2"]), world_size=2)
    for transport in ("nccl", "gloo"):  # each pipeline stage's sender has its own groups (weights/broadcast.py)
        preflight(load_config(None, [f"rollout.weight_transport={transport}", "parallel.tp=2", "parallel.pp=2"]),
                  world_size=8)  # TP=2 x PP=2 x DP=2


def test_auto_transport_is_nccl_for_gpu_replicas_and_host_memory_otherwise(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert weight_transport(load_config(None, []))[0] == "auto"  # CPU replicas: shm or http per replica
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert weight_transport(load_config(None, [])) == (
        "nccl", "auto: GPU replicas (a CUDA machine); nccl's GPU communicator has not yet run on a GPU")
    assert weight_transport(load_config(None, ["rollout.weight_transport=http"]))[0] == "http"  # explicit wins
    assert weight_transport(load_config(None, ["rollout.sync_full_every=10"]))[0] == "auto"  # deltas: host memory
    elsewhere = ["rollout.replica_urls=[http://10.0.0.5:8000]", "rollout.token=t"]
    assert weight_transport(load_config(None, elsewhere))[0] == "auto"  # their engine is not this run's choice


def test_ppo_allows_k1_and_world_size_checked_at_launch():
    cfg = load_config(None, ["trainer.algorithm=ppo", "rollout.k=1", "parallel.tp=2"])
    assert cfg.trainer.value_lr is None  # = trainer.lr
    assert load_config(None, ["trainer.algorithm=ppo", "trainer.value_lr=1e-5"]).trainer.value_lr == 1e-5
    preflight(cfg, world_size=4)
    with pytest.raises(ConfigError, match="parallel.world_size"):
        preflight(cfg, world_size=3)


def test_bad_yaml_and_non_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml.*not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="list.yaml.*mapping"):
        load_config(lst)


def test_a_key_given_twice_names_the_file_and_both_lines(tmp_path):
    """PyYAML would keep the last silently; at any depth, block or flow style."""
    p = tmp_path / "twice.yaml"
    for text, key, lines in [("trainer:\n  lr: 1.0e-5\nrollout:\n  k: 4\ntrainer:\n  steps: 5\n", "trainer", (1, 5)),
                             ("run:\n  name: a\ntrainer:\n  lr: 1.0e-5\n  steps: 3\n  lr: 2.0e-5\n", "lr", (4, 6)),
                             ("rollout: {k: 4, stop: [x], k: 8}\n", "k", (1, 1))]:
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(p)
        assert str(e.value) == f"{p}: key '{key}' given twice (lines {lines[0]} and {lines[1]})"
    # a merge key's values may be overridden, as YAML intends
    merged = yaml.load("a: &x {k: 1, j: 2}\nb:\n  <<: *x\n  k: 3\n", Loader=DuplicateKeyLoader)
    assert merged == {"a": {"k": 1, "j": 2}, "b": {"k": 3, "j": 2}}


def test_saved_config_round_trips_and_redacts_secrets(tmp_path):
    cfg = load_config(None, ["rollout.token=s3cret", "trainer.lr=3e-5", "rollout.stop=['x']"])
    out = save_config(cfg, tmp_path / "run" / "config.yaml")
    text = out.read_text()
    assert "s3cret" not in text and "***" in text
    again = load_config(out, ["rollout.token=s3cret"])
    assert flatten(again, redact=False) == flatten(cfg, redact=False)


def test_shipped_configs_are_valid():
    from pathlib import Path

    configs = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))
    assert configs, "configs/ must ship YAML run configs"
    for p in configs:
        data = yaml.safe_load(p.read_text())
        # GPU configs name model folders that exist only on the user's machine: check keys/types.
        cfg = Config()
        from megatron_async.config_io import _apply_mapping

        _apply_mapping(cfg, data, prefix="", source=str(p))


keys = st.text(alphabet=string.ascii_lowercase + "._", min_size=1, max_size=20)
values = st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=10), st.booleans(), st.none(),
                   st.lists(st.integers(), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, st.one_of(values, st.dictionaries(keys, values, max_size=3)), max_size=4))
def test_fuzz_loader_only_ever_raises_config_error(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    try:
        load_config(p)
    except ConfigError as e:
        assert str(e)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_fuzz_override_strings(text):
    try:
        load_config(None, [text])
    except ConfigError as e:
        assert str(e)


def test_cli_takes_overrides_before_or_after_options(capsys):
    from pathlib import Path

    from megatron_async.cli import main, parse_args

    CPU_TINY = str(Path(__file__).resolve().parents[1] / "configs" / "cpu_tiny.yaml")

    args = parse_args(["eval", CPU_TINY, "trainer.lr=2e-5", "--data", "x.jsonl", "rollout.k=6"])
    assert args.overrides == ["trainer.lr=2e-5", "rollout.k=6"] and args.data == "x.jsonl"
    assert main(["config", CPU_TINY, "trainer.lr=2e-5", "rollout.k=6"]) == 0
    out = capsys.readouterr().out
    assert "lr: 2.0e-05" in out and "k: 6" in out
    assert main(["config", CPU_TINY, "trainer.nope=1"]) == 2
