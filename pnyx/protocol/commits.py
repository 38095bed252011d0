"""Committed draws: a worker names its groups' seqs and tasks before the randomness of their draws exists.

Seeded draws (`pnyx.protocol.draws`) fix each token's uniform from the group's identity, but the worker
chooses part of that identity: its task, and when it draws. One that dislikes an outcome can draw the same
seq again with another task and upload only the draw it likes (docs/verifiable-sampling.md, "A picker that
reuses its seqs"). With `security.committed_draws` the identity is fixed first and the randomness revealed
after, by the trainer:

1. **Commitment.** Before a cohort, the worker writes `commits/t{n}/{worker}-{first seq}-{h}` (`Commitment`,
   signed by its key; h: the hash of the object's bytes, so a listing pins what was committed), where n is
   the trainer's next tick: the cohort's seqs, their task ids and the policy version it will draw at.
2. **Tick.** The trainer (`pnyx.train.ticker`) ticks every `security.tick_interval_s`: it lists
   `commits/t{n}/`, reads each commitment, includes those that are valid and do not reuse a seq its
   (name, key) already committed, and writes `ticks/{n}` (`Tick`, signed by the trainer's key): 32 random
   bytes (the beacon) and what it included; a refused commitment is listed with its reason (a restarted
   worker learns its next free seq from it). `ticks/LATEST` points at the newest tick (a hint).
3. **Draw.** Sample i of seq s draws from `sample_seed(..., beacon)`, the tick's beacon joining the seed,
   at the committed version; the group names its tick, beacon and commitment (`RolloutGroup.tick`,
   `beacon`, `commit`).
4. **Check.** The trainer admits a committed group only if its tick is one of its own, the beacon is that
   tick's, the tick included the named commitment, and the commitment holds the group's worker, key, seq,
   task and version (`check_group`); else it is `uncommitted`, a fault of its key.

Before the tick the worker cannot know any outcome (the beacon does not exist); after it, nothing is left to
choose: the task, the seq and the version are fixed and each seq is committed once. What a picker can
still do is leave a committed seq empty, a gap (`pnyx.train.seq_books`). Knows nothing about the store's
backends or torch.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import ClassVar

import msgspec

from pnyx.errors import RecordRejected
from pnyx.protocol import layout
from pnyx.security.keys import fingerprint
from pnyx.security.signing import Signer, Verifier

COMMIT_SCHEMA = 1
TICK_SCHEMA = 1
COMMIT_DOMAIN = "commit"
TICK_DOMAIN = "tick"
SEALED_MAGIC = b"PNYS"
MAX_COMMIT_BYTES = 64 * 1024
"""A commitment object larger than this is refused unread (a cohort's seqs and task ids fit in far less)."""
MAX_COMMIT_SEQS = 256
"""Seqs in one commitment at most (a cohort is a few groups)."""
MAX_TICK_BYTES = 64 * 1024 * 1024
BEACON_BYTES = 32


class Commitment(msgspec.Struct, kw_only=True):
    """What a worker commits to before a tick: seqs `first_seq`.. of `worker_id`, one task each, drawn at
    `version` (signed by the worker's key; the signer is the key the seeds name)."""

    SCHEMA: ClassVar[int] = COMMIT_SCHEMA

    schema: int = COMMIT_SCHEMA
    run_id: str
    worker_id: str
    version: int
    first_seq: int
    tasks: list[str]
    """Task id of seq first_seq + i."""
    created_at: float = 0.0


class Included(msgspec.Struct, kw_only=True, array_like=True):
    """A commitment a tick included, as the trainer read it (so a tick alone answers `check_group`)."""

    key: str
    """Fingerprint of the key that signed it."""
    worker_id: str
    version: int
    first_seq: int
    tasks: list[str]


class Lost(msgspec.Struct, kw_only=True, array_like=True):
    """Seqs `first_seq`..`last_seq` of (`worker_id`, `key`) that a tick included and that the name's next
    commitment, refused as their reuse, shows its worker never drew: a restarted worker's last cohort,
    excused by the trainer (counted `lost`, not `gap`) within a budget (`pnyx.train.ticker`)."""

    key: str
    worker_id: str
    first_seq: int
    last_seq: int


class Tick(msgspec.Struct, kw_only=True):
    """`ticks/{n}`: the trainer's beacon n and the commitments it binds (signed by the trainer's key)."""

    SCHEMA: ClassVar[int] = TICK_SCHEMA

    schema: int = TICK_SCHEMA
    run_id: str
    n: int
    beacon: str
    """32 random bytes, hex: part of every seed drawn under this tick."""
    version: int
    """The trainer's newest published version when it ticked (informational)."""
    included: dict[str, Included] = {}
    """Commitment key -> what it commits to."""
    refused: dict[str, str] = {}
    """Commitment key -> why it was not included (a worker whose commitment is refused re-commits)."""
    created_at: float = 0.0
    lost: list[Lost] = []
    """Committed seqs excused at this tick (a restarted worker's undrawn cohort)."""


# --- keys (built in `pnyx.protocol.layout`) ---------------------------------------------------------------


def commit_key(n: int, worker_id: str, first_seq: int, data: bytes) -> str:
    """The key of a commitment for tick `n` whose object bytes are `data`."""
    return layout.commit_key(n, worker_id, first_seq, content_hash(data))


def content_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# --- sealed (signed) objects ----------------------------------------------------------------------------

_enc = msgspec.msgpack.Encoder()
_commit_dec = msgspec.msgpack.Decoder(Commitment)
_tick_dec = msgspec.msgpack.Decoder(Tick)


def _seal(domain: str, signer: Signer, body: bytes) -> bytes:
    return SEALED_MAGIC + signer.public_raw + signer.sign(domain, body) + body


def _open(domain: str, run_id: str, data: bytes, max_bytes: int) -> tuple[str, bytes]:
    """(fingerprint of the signer, body) of a sealed object; RecordRejected when it is not one."""
    if len(data) > max_bytes:
        raise RecordRejected("oversize_bytes", f"{len(data)} bytes > {max_bytes}")
    if len(data) < 4 + 32 + 64 or data[:4] != SEALED_MAGIC:
        raise RecordRejected("bad_magic", f"not a sealed pnyx {domain} object")
    public, signature, body = data[4:36], data[36:100], data[100:]
    try:
        verifier = Verifier.from_hex(public.hex(), run_id)
    except ValueError as exc:
        raise RecordRejected("bad_signature", f"not an Ed25519 public key: {exc}") from None
    if not verifier.check(domain, body, signature):
        raise RecordRejected("bad_signature", f"the {domain} signature does not verify")
    return fingerprint(public), body


def encode_commitment(c: Commitment, signer: Signer) -> bytes:
    """The signed bytes of a commitment (`signer` bound to the run: `Signer.for_run`)."""
    return _seal(COMMIT_DOMAIN, signer, _enc.encode(c))


def decode_commitment(data: bytes, run_id: str) -> tuple[str, Commitment]:
    """(signer's fingerprint, commitment) of a commitment object of run `run_id`. Raises RecordRejected."""
    fp, body = _open(COMMIT_DOMAIN, run_id, data, MAX_COMMIT_BYTES)
    try:
        c = _commit_dec.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RecordRejected("decode_error", f"commitment: {exc}") from None
    if c.schema != COMMIT_SCHEMA:
        raise RecordRejected(
            "wrong_schema", f"commitment schema {c.schema}, this reader knows {COMMIT_SCHEMA}"
        )
    if c.run_id != run_id:
        raise RecordRejected("run_mismatch", f"commitment of run {c.run_id!r}")
    if not 0 < len(c.tasks) <= MAX_COMMIT_SEQS or c.first_seq < 0 or c.version < 0:
        raise RecordRejected("bad_field", f"commitment of {len(c.tasks)} seqs from {c.first_seq}")
    return fp, c


def encode_tick(t: Tick, signer: Signer) -> bytes:
    return _seal(TICK_DOMAIN, signer, _enc.encode(t))


def decode_tick(data: bytes, run_id: str, trainer_fp: str) -> Tick:
    """A tick of run `run_id`, signed by the key whose fingerprint is `trainer_fp`. Raises RecordRejected."""
    fp, body = _open(TICK_DOMAIN, run_id, data, MAX_TICK_BYTES)
    if fp != trainer_fp:
        raise RecordRejected("bad_signature", f"tick signed by {fp}, not the run's trainer key {trainer_fp}")
    try:
        t = _tick_dec.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RecordRejected("decode_error", f"tick: {exc}") from None
    if t.run_id != run_id or len(bytes.fromhex(t.beacon)) != BEACON_BYTES:
        raise RecordRejected("bad_field", f"tick {t.n}: run {t.run_id!r} or a beacon of the wrong size")
    return t


def new_beacon() -> str:
    return secrets.token_hex(BEACON_BYTES)


# --- the trainer's check -----------------------------------------------------------------------------------


def check_group(
    tick: Tick | None, *, signer: str, worker_id: str, seq: int, task_id: str, version: int, beacon: str,
    commit: str,
) -> str | None:  # fmt: skip
    """Why a committed group does not match its tick (None: it does): its tick `tick` (the trainer's own,
    None when the trainer never wrote the tick the group names)."""
    if tick is None:
        return "names a tick the trainer never wrote"
    if beacon != tick.beacon:
        return f"its beacon is not tick {tick.n}'s"
    inc = tick.included.get(commit)
    if inc is None:
        return f"tick {tick.n} did not include commitment {commit!r}"
    if inc.key != signer or inc.worker_id != worker_id:
        return f"commitment {commit!r} is {inc.worker_id!r}'s (key {inc.key}), not this group's"
    i = seq - inc.first_seq
    if not 0 <= i < len(inc.tasks):
        return f"seq {seq} is outside commitment {commit!r} ({inc.first_seq}..{inc.first_seq + len(inc.tasks) - 1})"
    if inc.tasks[i] != task_id:
        return f"seq {seq} was committed to task {inc.tasks[i]!r}, the group holds {task_id!r}"
    if inc.version != version:
        return f"seq {seq} was committed at v{inc.version}, the group was drawn at v{version}"
    return None
