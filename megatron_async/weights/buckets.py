"""Size-capped buckets of HF-named tensors for weight sync, serialised as safetensors bytes.

A weight sync streams a model as a sequence of buckets. `iter_buckets` turns a lazy iterator of
(hf_name, tensor) into `Bucket`s without ever materialising the model:

- Laziness: the input iterator is advanced one tensor at a time and a bucket is yielded as soon
  as the next tensor would overflow it, so the caller holds at most one bucket's tensors, one
  look-ahead tensor and the serialised bytes of that bucket (about two caps plus one tensor).
- Cap: a bucket's tensor bytes never exceed `cap_bytes`, except a single tensor larger than the
  cap, which travels alone in its own bucket.
- Order: buckets follow the input order (`Bucket.names` too); inside one payload safetensors
  may store tensors in another order, which loading does not depend on.
- Integrity: each bucket carries the CRC32 of its payload; `unpack_bucket` refuses a payload
  whose CRC32 differs (`BucketChecksumError`). CRC32 guards against corruption and truncation
  (~4 GB/s here); authenticity comes from the connection's authkey, not from the checksum.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


class BucketChecksumError(ValueError):
    """A bucket's payload does not match the checksum it was sent with."""


@dataclass(frozen=True)
class Bucket:
    index: int  # position in this sync's stream, from 0
    payload: bytes  # safetensors serialisation of the bucket's tensors
    checksum: int  # CRC32 of payload
    names: tuple[str, ...]  # HF names, in order
    tensor_bytes: int  # sum of the tensors' nbytes (payload adds a small header)


def checksum(payload: bytes) -> int:
    """CRC32 of a payload, as an unsigned int."""
    return zlib.crc32(payload) & 0xFFFFFFFF


def pack_bucket(index: int, tensors: list[tuple[str, torch.Tensor]]) -> Bucket:
    """Serialise (hf_name, tensor) pairs into one bucket (tensors are moved to CPU, made contiguous)."""
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"bucket {index} has duplicate tensor names: {sorted(n for n in set(names) if names.count(n) > 1)}")
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors}
    payload = st_save(cpu)
    return Bucket(index, payload, checksum(payload), tuple(names), sum(t.nbytes for t in cpu.values()))


def unpack_bucket(payload: bytes, expected_checksum: int) -> dict[str, torch.Tensor]:
    """Verify a payload's checksum, then deserialise it into {hf_name: tensor}."""
    got = checksum(payload)
    if got != expected_checksum:
        raise BucketChecksumError(
            f"bucket checksum mismatch: payload of {len(payload)} bytes has CRC32 {got:#010x}, "
            f"sender said {expected_checksum:#010x}"
        )
    return st_load(payload)


def group_by_cap(
    named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a lazy stream of (name, tensor) into lists of at most `cap_bytes` tensor bytes.

    A tensor larger than the cap forms a group of its own. Empty groups are never yielded.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > cap_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int) -> Iterator[Bucket]:
    """Lazily pack a stream of (hf_name, tensor) into serialised, checksummed, size-capped buckets."""
    for index, group in enumerate(group_by_cap(named_tensors, cap_bytes)):
        yield pack_bucket(index, group)
