"""Payload objects in the store: writing anchor shards and delta chunks, reading them back verified.

Writes overlap encoding with uploading (a bounded queue of in-flight puts); reads overlap downloading with
decoding (a bounded look-ahead). Every object is put create-only under a name carrying the publisher's
nonce (or, when a squatter took that name first, the name and a random suffix), so a fenced loser can
never overwrite the winner's bytes; every object read is checked against its
size and xxh3-128 before a byte of it is decoded. Knows nothing about versions policy, HEAD or torch.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pnyx.errors import AlreadyExistsError, IntegrityError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.weights.apply import DeltaApplier
from pnyx.weights.bits import BitState, TensorBits, h, read_safetensors, write_safetensors
from pnyx.weights.codec import DeltaStats, Segment, encode_windows
from pnyx.weights.manifest import PayloadObject, PlaneManifest

LOOKAHEAD = 2  # objects in flight while the current one is encoded or decoded


SQUAT_RETRIES = 4
"""Fresh names tried for a payload object whose name is already taken (see `_put_payload`)."""


def _put_payload(store: Store, version: int, name: str, data: bytes) -> str:
    """Put one payload object create-only; returns the name it was stored under.

    Payload names carry the publisher's nonce, which every manifest makes public, so anyone who can write
    under `weights/` (R2) can squat the next version's names before the trainer writes them. The manifest
    names every object, so any name will do: a taken name is retried under a random suffix instead of
    failing the publish (the attack suite's fork squatter; docs/security.md). Create-only stays: nobody's
    bytes are ever overwritten."""
    try:
        store.put(layout.weights_payload(version, name), data, "create")
        return name
    except AlreadyExistsError:
        pass
    for _ in range(SQUAT_RETRIES):
        fresh = f"{name}.{secrets.token_hex(6)}"
        try:
            store.put(layout.weights_payload(version, fresh), data, "create")
            return fresh
        except AlreadyExistsError:
            continue
    raise AlreadyExistsError(
        f"weights v{version}: payload {name} and {SQUAT_RETRIES} fresh names are all taken"
    )


def _upload_all(store: Store, version: int, named: Iterable[tuple[str, bytes]]) -> list[PayloadObject]:
    out: list[PayloadObject] = []
    pending: deque[tuple[int, Future[str]]] = deque()

    def settle(entry: tuple[int, Future[str]]) -> None:
        i, fut = entry
        stored = fut.result()  # re-raises the upload's error here
        if stored != out[i].name:
            out[i] = PayloadObject(stored, out[i].size, out[i].digest)

    with ThreadPoolExecutor(max_workers=LOOKAHEAD) as pool:
        for name, data in named:
            out.append(PayloadObject(name, len(data), h(data)))
            pending.append((len(out) - 1, pool.submit(_put_payload, store, version, name, data)))
            while len(pending) >= LOOKAHEAD:
                settle(pending.popleft())
        for entry in pending:
            settle(entry)
    return out


def write_shards(
    store: Store,
    version: int,
    prefix: str,
    state: Mapping[str, TensorBits],
    shards: list[tuple[int, list[str]]],
) -> list[tuple[int, PayloadObject]]:
    """Upload anchor shards (index, tensor names; see `parallel.plan_shards`) as safetensors objects named
    `{prefix}-{index:05d}.safetensors`. Returns (index, object) in the order given."""
    named = (
        (f"{prefix}-{i:05d}.safetensors", write_safetensors({n: state[n] for n in names}, {"format": "pt"}))
        for i, names in shards
    )
    return list(zip((i for i, _ in shards), _upload_all(store, version, named), strict=True))


def write_windows(
    store: Store,
    version: int,
    prefix: str,
    old: Mapping[str, TensorBits],
    new: Mapping[str, TensorBits],
    windows: list[tuple[int, list[Segment]]],
    level: int = 1,
    stats: DeltaStats | None = None,
) -> list[tuple[int, PayloadObject]]:
    """Encode and upload the delta old -> new over the given windows (index, segments; see
    `codec.plan_windows`), streaming, as chunks named `{prefix}-{index:05d}`. Windows that did not change
    make no object. Returns (index, object) in window order."""
    indices: list[int] = []

    def named() -> Iterator[tuple[str, bytes]]:
        for i, chunk in encode_windows(old, new, windows, level=level, stats=stats):
            indices.append(i)
            yield f"{prefix}-{i:05d}", chunk

    objects = _upload_all(store, version, named())
    return list(zip(indices, objects, strict=True))


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
    in_place: Mapping[str, np.ndarray] | None = None,
) -> BitState:
    """Apply the plane's delta chunks onto `base` (never written into) and return the new state.

    reuse: arrays nothing else reads any more (a superseded state's), overwritten instead of allocating.
    in_place: arrays nothing else reads that hold exactly `base`'s values of their tensors: patched in place
    (`DeltaApplier`)."""
    if not plane.has_delta:
        raise IntegrityError(f"v{version} carries no delta from its parent")
    ap = DeltaApplier(base, plane.expected(), reuse=reuse, in_place=in_place)
    for data in fetch_verified(store, version, plane.delta):
        ap.apply(data)
    return ap.result()
