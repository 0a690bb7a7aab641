"""Size-capped buckets of HF-named tensors for weight sync, in the safetensors layout.

A weight sync streams a model as a sequence of buckets. `iter_buckets` turns a lazy iterator of
(hf_name, tensor) into `Bucket`s without ever materialising the model:

- Laziness: the input iterator is advanced one tensor at a time and a bucket is yielded as soon
  as the next tensor would overflow it, so the caller holds at most one bucket's tensors, one
  look-ahead tensor and the serialised bytes of that bucket (about two caps plus one tensor).
- Cap: a bucket's tensor bytes never exceed `cap_bytes`, except a single tensor larger than the
  cap, which travels alone in its own bucket.
- Order: buckets follow the input order (`Bucket.names` too); inside one payload tensors are laid
  out by falling element size (every tensor stays aligned), which loading does not depend on.
- Layout: a payload is a valid safetensors file (8-byte header length, JSON header padded to 8
  bytes, raw data), written straight into a buffer the carrier provides (`alloc`: a bytearray
  for http, the shared-memory segment for shm), and read back zero-copy by `unpack_bucket`
  (torch.frombuffer views into the payload).
- Integrity: each bucket carries a CRC32 of its payload; `unpack_bucket` refuses a payload
  whose CRC32 differs (`BucketChecksumError`). Authenticity comes from the replica's key, not
  from the checksum. Two scopes (`checksum`):
  - full: every byte (~3 GB/s here: a third of a SmolLM2 sync on each side);
  - sampled (`sample_offset` given): the length, the whole safetensors header, and 4 KiB of
    every 256 KiB of tensor data from the offset on, plus the last 4 KiB (1/64 of the bytes).
    It catches what a carrier gets wrong (a truncated or wrong segment, a segment rewritten by
    the next bucket, a header of other shapes or offsets), not a flipped bit in an unsampled
    page; the sender varies the offset per bucket and falls back to full scope on the first sync
    and after any failure (weights/host_memory.py).
"""
from __future__ import annotations

import json
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

# safetensors dtype codes
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {code: dtype for dtype, code in ST_DTYPES.items()}


SAMPLE_STRIDE = 256 << 10  # a sampled checksum reads SAMPLE_BYTES of every SAMPLE_STRIDE bytes
SAMPLE_BYTES = 4 << 10


class BucketChecksumError(ValueError):
    """A bucket's payload does not match the checksum it was sent with."""


@dataclass(frozen=True)
class Bucket:
    index: int  # position in this sync's stream, from 0
    payload: bytes | bytearray | memoryview  # the bucket's tensors in the safetensors layout
    checksum: int  # CRC32 of payload, full or sampled (`checksum`)
    sample_offset: int | None  # None: a full checksum
    names: tuple[str, ...]  # HF names, in order
    tensor_bytes: int  # sum of the tensors' nbytes (payload adds a small header)


def checksum(payload: bytes | bytearray | memoryview, sample_offset: int | None = None) -> int:
    """CRC32 of a payload as an unsigned int: of every byte, or (`sample_offset`) of the sample
    the module docstring describes."""
    if sample_offset is None:
        return zlib.crc32(payload) & 0xFFFFFFFF
    view = memoryview(payload).cast("B")
    size = len(view)
    (head_len,) = struct.unpack_from("<Q", view) if size >= 8 else (0,)
    start = min(size, 8 + head_len)
    crc = zlib.crc32(struct.pack("<QQ", size, sample_offset), zlib.crc32(view[:start]))
    for lo in range(start + sample_offset % SAMPLE_STRIDE, size, SAMPLE_STRIDE):
        crc = zlib.crc32(view[lo:lo + SAMPLE_BYTES], crc)
    return zlib.crc32(view[max(start, size - SAMPLE_BYTES):], crc) & 0xFFFFFFFF


def pack_bucket(
    index: int, tensors: list[tuple[str, torch.Tensor]], alloc: Callable[[int], memoryview | bytearray] = bytearray,
    sample_offset: int | None = None,
) -> Bucket:
    """Write (hf_name, tensor) pairs into `alloc(size)` in the safetensors layout; one copy per tensor.

    `alloc` returns a writable buffer of exactly `size` bytes. Tensors may live on any device:
    each is copied from where it lives straight into the buffer. `sample_offset`: the checksum's
    scope (None: full).
    """
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"bucket {index} has duplicate tensor names: {sorted(n for n in set(names) if names.count(n) > 1)}")
    unknown = {str(t.dtype) for _, t in tensors if t.dtype not in ST_DTYPES}
    if unknown:
        raise ValueError(f"bucket {index}: dtypes {sorted(unknown)} have no safetensors code")
    # NOTE: largest elements first, and the header padded to 8 bytes: every tensor's data then
    # starts at a multiple of its element size, which the zero-copy views in unpack_bucket need.
    ordered = sorted(tensors, key=lambda nt: -nt[1].element_size())
    header: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, t in ordered:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    buf = alloc(start + offset)
    view = memoryview(buf)
    view[:8] = struct.pack("<Q", len(head))
    view[8:start] = head
    if offset:
        data = torch.frombuffer(buf, dtype=torch.uint8, count=offset, offset=start)
        for name, t in ordered:
            lo, hi = header[name]["data_offsets"]
            if hi > lo:
                data[lo:hi].copy_(t.detach().reshape(-1).view(torch.uint8))
    return Bucket(index, buf, checksum(buf, sample_offset), sample_offset, tuple(names), offset)


def unpack_bucket(payload: bytes | bytearray | memoryview, expected_checksum: int,
                  sample_offset: int | None = None) -> dict[str, torch.Tensor]:
    """Verify a payload's checksum (full, or sampled from `sample_offset`), then view it as
    {hf_name: tensor} without copying.

    The tensors alias `payload`: a caller keeping one past the payload's lifetime (or past the next
    write into a reused buffer) must clone it.
    """
    got = checksum(payload, sample_offset)
    if got != expected_checksum:
        scope = "full" if sample_offset is None else f"sampled from {sample_offset}"
        raise BucketChecksumError(
            f"bucket checksum mismatch: payload of {len(payload)} bytes has CRC32 ({scope}) {got:#010x}, "
            f"sender said {expected_checksum:#010x}"
        )
    (head_len,) = struct.unpack_from("<Q", payload)
    start = 8 + head_len
    header = json.loads(bytes(memoryview(payload)[8:start]))
    header.pop("__metadata__", None)
    out = {}
    with warnings.catch_warnings():
        # NOTE: an http payload is read-only `bytes`; the views are only read (the engine
        # copies them out), so torch's "buffer is not writable" warning does not apply.
        warnings.simplefilter("ignore", UserWarning)
        for name, info in header.items():
            dtype, shape = TORCH_DTYPES[info["dtype"]], info["shape"]
            lo, hi = info["data_offsets"]
            count = (hi - lo) // torch.empty((), dtype=dtype).element_size()
            out[name] = (
                torch.frombuffer(payload, dtype=dtype, count=count, offset=start + lo).view(shape)
                if count else torch.empty(shape, dtype=dtype)
            )
    return out


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


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], cap_bytes: int,
    alloc: Callable[[int], memoryview | bytearray] = bytearray, sample_offset: int | None = None,
) -> Iterator[Bucket]:
    """Lazily pack a stream of (hf_name, tensor) into checksummed, size-capped buckets.

    With a reused `alloc` buffer (shared memory) a bucket is valid only until the next is packed.
    `sample_offset`: sampled checksums, bucket k's from sample_offset + k * SAMPLE_BYTES (None: full).
    """
    for index, group in enumerate(group_by_cap(named_tensors, cap_bytes)):
        yield pack_bucket(index, group, alloc, None if sample_offset is None else sample_offset + index * SAMPLE_BYTES)
