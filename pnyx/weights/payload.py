"""Payload objects in the store: writing anchor shards and delta chunks, reading them back verified.

Writes overlap encoding with uploading (a bounded queue of in-flight puts); reads overlap downloading with
decoding (a bounded look-ahead). Every object is put create-only under a name carrying the publisher's
nonce, so a fenced loser can never overwrite the winner's bytes; every object read is checked against its
size and xxh3-128 before a byte of it is decoded. Knows nothing about versions policy, HEAD or torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pnyx.errors import IntegrityError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.weights.bits import BitState, TensorBits, h, read_safetensors, write_safetensors
from pnyx.weights.codec import CHUNK_BYTES, DeltaApplier, DeltaStats, encode_delta
from pnyx.weights.manifest import PayloadObject, PlaneManifest

LOOKAHEAD = 2  # objects in flight while the current one is encoded or decoded


def _upload_all(store: Store, version: int, named: Iterable[tuple[str, bytes]]) -> list[PayloadObject]:
    out: list[PayloadObject] = []
    pending: deque[Future[None]] = deque()
    with ThreadPoolExecutor(max_workers=LOOKAHEAD) as pool:
        for name, data in named:
            out.append(PayloadObject(name, len(data), h(data)))
            pending.append(pool.submit(store.put, layout.weights_payload(version, name), data, "create"))
            while len(pending) >= LOOKAHEAD:
                pending.popleft().result()  # re-raises the upload's error here
        for f in pending:
            f.result()
    return out


def shard_state(state: Mapping[str, TensorBits], shard_bytes: int) -> Iterator[BitState]:
    """Group tensors (sorted by name) into shards of about `shard_bytes` (a tensor is never split)."""
    shard: BitState = {}
    size = 0
    for name in sorted(state):
        tb = state[name]
        if shard and size + tb.nbytes > shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tb
        size += tb.nbytes
    if shard or not state:
        yield shard


def write_anchor(
    store: Store, version: int, prefix: str, state: Mapping[str, TensorBits], shard_bytes: int = CHUNK_BYTES
) -> list[PayloadObject]:
    """Upload the full state as safetensors shards named `{prefix}-{i:05d}.safetensors`."""
    named = (
        (f"{prefix}-{i:05d}.safetensors", write_safetensors(shard, {"format": "pt"}))
        for i, shard in enumerate(shard_state(state, shard_bytes))
    )
    return _upload_all(store, version, named)


def write_delta(
    store: Store,
    version: int,
    prefix: str,
    old: Mapping[str, TensorBits],
    new: Mapping[str, TensorBits],
    chunk_bytes: int = CHUNK_BYTES,
    level: int = 1,
    stats: DeltaStats | None = None,
) -> list[PayloadObject]:
    """Encode and upload the delta old -> new as chunks named `{prefix}-{i:05d}` (streaming)."""
    chunks = encode_delta(old, new, level=level, chunk_bytes=chunk_bytes, stats=stats)
    return _upload_all(store, version, ((f"{prefix}-{i:05d}", c) for i, c in enumerate(chunks)))


def fetch_verified(store: Store, version: int, objects: list[PayloadObject]) -> Iterator[bytes]:
    """Yield each object's bytes in order, downloading ahead; IntegrityError on a size or digest mismatch.

    A missing object raises NotFoundError (the caller retries or re-anchors)."""

    def get(o: PayloadObject) -> bytes:
        data = store.get(layout.weights_payload(version, o.name))
        if len(data) != o.size or h(data) != o.digest:
            raise IntegrityError(
                f"v{version} payload {o.name}: {len(data)} bytes with digest {h(data)[:12]}.., manifest says "
                f"{o.size} bytes / {o.digest[:12]}.. (corrupt or overwritten object)"
            )
        return data

    with ThreadPoolExecutor(max_workers=LOOKAHEAD) as pool:
        pending: deque[Future[bytes]] = deque()
        it = iter(objects)
        for o in it:
            pending.append(pool.submit(get, o))
            if len(pending) >= LOOKAHEAD:
                break
        while pending:
            data = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(get, nxt))
            yield data


def read_anchor(store: Store, version: int, plane: PlaneManifest) -> BitState:
    """The full state of an anchor plane (tensor digests are checked by the caller via verify_plane)."""
    state: BitState = {}
    for data in fetch_verified(store, version, plane.anchor):
        shard = read_safetensors(data)
        dup = set(shard) & set(state)
        if dup:
            raise IntegrityError(f"v{version} anchor: tensor {sorted(dup)[0]!r} appears in two shards")
        state.update(shard)
    return state


def read_delta(
    store: Store,
    version: int,
    plane: PlaneManifest,
    base: Mapping[str, TensorBits],
    reuse: Mapping[str, np.ndarray] | None = None,
) -> BitState:
    """Apply the plane's delta chunks onto `base` (never written into) and return the new state.

    reuse: arrays nothing else reads any more (a superseded state's), overwritten instead of allocating."""
    if not plane.has_delta:
        raise IntegrityError(f"v{version} carries no delta from its parent")
    ap = DeltaApplier(base, plane.expected(), reuse=reuse)
    for data in fetch_verified(store, version, plane.delta):
        ap.apply(data)
    return ap.result()
