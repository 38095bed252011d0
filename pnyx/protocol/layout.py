"""The run layout: every object key pnyx reads or writes is built here, and nowhere else.

A store URL points at one run's root; keys are relative to it (docs/architecture.md, "Store layout"):

    run.json                                create-only run manifest
    weights/HEAD                            hint pointer {version, digest}
    weights/DEMAND                          the trainer's demand for rollouts (hint, rewritten per publish)
    weights/v{V:08d}/manifest.json          create-only weight manifest of an unsigned publisher (tests, old runs)
    weights/v{V:08d}/manifest-{tag}.json    create-only signed weight manifest; tag = the trainer's Ed25519
                                            signature of V (128 hex), so only the trainer can name it
    weights/v{V:08d}/{name}                 payload objects (anchor shards, delta chunks)
    rollouts/v{V:08d}/{ms:013d}~{worker}-{seq:010d}
                                            create-only rollout groups, by producing policy version, then
                                            by upload stamp (the uploader's clock, in ms)
    rollouts/v{V:08d}/{ms:013d}~{worker}-{seq:010d}.skip
                                            create-only skip record: a seeded group the worker does not
                                            offer for training (zero variance), so its seq is accounted for
    workers/{worker}.json                   worker heartbeat (overwritten)
    trainer/{name}                          trainer batch records and metrics
    trainer/ckpt-{V:08d}/{name}             sharded (DCP) checkpoint objects, COMMIT.json last
    swarm/{node}/{seq:010d}                 swarm-mode shared groups (decoded text)
    swarm/nodes/{node}.json                 swarm-mode node heartbeat
    swarm/ckpt/{node}.pt                    swarm-mode node checkpoint (overwritten)
    evals/v{V:08d}.json                     held-out evaluation of version V (written by `pnyx run`/`eval`)
    commits/t{n:012d}/{worker}-{seq:010d}-{h}
                                            committed draws: a worker's signed commitment to the seqs from
                                            seq and their tasks, for tick n; h = hash of its bytes
    ticks/{n:012d}                          committed draws: the trainer's signed tick n (its beacon)
    ticks/LATEST                            hint: the newest tick's n

Zero-padded numbers make lexicographic order equal numeric order, so `list(start_after=...)` walks
versions and sequence numbers in order. Inside a version's rollout prefix keys sort by their stamp, so a
reader lists only what arrived since its last listing (`rollouts_start_after`); the stamp is an ordering
hint and nothing else (a group's identity is version, worker and seq; a wrong clock delays its listing,
it never hides or duplicates a group). Keys of the first layout, `rollouts/v{V:08d}/{worker}-{seq:010d}`
without a stamp, still parse (a resumed run keeps its window): they sort by worker id among the stamped
keys, so a reader finds them with its periodic full listing of the prefix rather than its incremental one.
Knows nothing about torch or any backend.
"""

from __future__ import annotations

import re
import time

from pnyx.errors import ConfigError

RUN_MANIFEST = "run.json"
WEIGHTS_PREFIX = "weights/"
WEIGHTS_HEAD = "weights/HEAD"
WEIGHTS_DEMAND = "weights/DEMAND"
"""Next to HEAD because every worker may already read `weights/*` (docs/fleet.md's bucket policy)."""
ROLLOUTS_PREFIX = "rollouts/"
WORKERS_PREFIX = "workers/"
TRAINER_PREFIX = "trainer/"
SWARM_PREFIX = "swarm/"
SWARM_NODES_PREFIX = "swarm/nodes/"
SWARM_CKPT_PREFIX = "swarm/ckpt/"
EVALS_PREFIX = "evals/"
COMMITS_PREFIX = "commits/"
TICKS_PREFIX = "ticks/"
TICKS_LATEST = "ticks/LATEST"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_VERSION_DIR = re.compile(r"^v(\d{8})/$")
MANIFEST_TAG_PREFIX = "manifest-"
_TAG = re.compile(r"^[0-9a-f]{128}$")
_ANY_MANIFEST = re.compile(r"^weights/v(\d{8})/manifest(?:-([0-9a-f]{128}))?\.json$")
_ROLLOUT = re.compile(
    r"^rollouts/v(\d{8})/(?:(\d{13})~)?([A-Za-z0-9][A-Za-z0-9_.-]{0,63})-(\d{10})(\.skip)?$"
)
SKIP_SUFFIX = ".skip"
"""Ends the key of a skip record (`is_skip_key`); a worker id cannot end a key, its 10-digit seq does."""
STAMP_SEP = "~"
"""Ends the stamp of a rollout key; never part of a worker id, so both key forms parse unambiguously."""
_MAX_STAMP = 10**13 - 1
_COMMIT_KEY = re.compile(r"^commits/t(\d{12})/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})-(\d{10})-([0-9a-f]{32})$")
_TICK_KEY = re.compile(r"^ticks/(\d{12})$")
_SWARM = re.compile(r"^swarm/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/(\d{10})$")


def check_name(name: str, what: str = "name") -> str:
    """Validate a worker, node or object name used inside a key (letters, digits, `_.-`, ≤64 chars)."""
    if not isinstance(name, str) or not _NAME.match(name) or name in {".", ".."}:
        raise ConfigError(
            f"invalid {what} {name!r}: use 1-64 letters, digits, '_', '.', '-' (starting with a letter or digit)"
        )
    return name


def _v(version: int) -> str:
    if not isinstance(version, int) or version < 0 or version > 99_999_999:
        raise ConfigError(f"version must be an int in [0, 99999999], got {version!r}")
    return f"v{version:08d}"


# --- weights ----------------------------------------------------------------------------------


def weights_dir(version: int) -> str:
    return f"{WEIGHTS_PREFIX}{_v(version)}/"


def weights_manifest(version: int) -> str:
    return f"{weights_dir(version)}manifest.json"


def weights_payload(version: int, name: str) -> str:
    return f"{weights_dir(version)}{check_name(name, 'payload name')}"


def signed_weights_manifest(version: int, tag: str) -> str:
    """`weights/v{V:08d}/manifest-{tag}.json`: a signed manifest, named by the trainer's signature of V."""
    if not _TAG.match(tag):
        raise ValueError(f"manifest tag must be 128 lowercase hex digits, got {tag[:20]!r}...")
    return f"{weights_dir(version)}{MANIFEST_TAG_PREFIX}{tag}.json"


def weights_manifest_candidates(version: int) -> str:
    """The listing prefix under which every manifest of `version` (signed or not, genuine or not) lies."""
    return f"{weights_dir(version)}manifest"


def parse_any_weights_manifest(key: str) -> tuple[int, str | None] | None:
    """(version, tag) of a signed manifest key, (version, None) of an unsigned one, None for any other key.

    Says nothing about whether the tag is genuine: that takes the trainer's public key."""
    m = _ANY_MANIFEST.match(key)
    if not m:
        return None
    return int(m.group(1)), m.group(2)


# --- rollouts ---------------------------------------------------------------------------------


def rollouts_dir(version: int) -> str:
    return f"{ROLLOUTS_PREFIX}{_v(version)}/"


def now_ms() -> int:
    """The stamp a rollout key gets by default: this machine's wall clock in milliseconds."""
    return time.time_ns() // 1_000_000


def _stamp(stamp_ms: int) -> str:
    if not isinstance(stamp_ms, int) or stamp_ms < 0 or stamp_ms > _MAX_STAMP:
        raise ValueError(f"rollout stamp must be an int in [0, {_MAX_STAMP}] (ms), got {stamp_ms!r}")
    return f"{stamp_ms:013d}"


def rollout_key(
    version: int, worker: str, seq: int, stamp_ms: int | None = None, *, skip: bool = False
) -> str:
    """`rollouts/v{V:08d}/{stamp:013d}~{worker}-{seq:010d}`; the stamp defaults to now (`now_ms`). With
    `skip`, the same key plus `SKIP_SUFFIX`: the group's skip record (`is_skip_key`).

    Build the key once per group and keep it (the worker's spool does): the same group under two
    stamps would be two objects.
    """
    if not isinstance(seq, int) or seq < 0 or seq > 9_999_999_999:
        raise ValueError(f"seq must be an int in [0, 9999999999], got {seq!r}")
    stamp = _stamp(now_ms() if stamp_ms is None else stamp_ms)
    key = f"{rollouts_dir(version)}{stamp}{STAMP_SEP}{check_name(worker, 'worker id')}-{seq:010d}"
    return key + SKIP_SUFFIX if skip else key


def parse_rollout_key(key: str) -> tuple[int, str, int] | None:
    """(version, worker, seq) of a rollout key of either form, or of a skip record's key (`is_skip_key`
    tells them apart), or None if the key is not one (junk)."""
    m = _ROLLOUT.match(key)
    return (int(m.group(1)), m.group(3), int(m.group(4))) if m else None


def is_skip_key(key: str) -> bool:
    """The key names a skip record: a seeded group its worker does not offer for training (it was zero
    variance), uploaded so that every seq the worker reserved is accounted for (docs/security.md, "Seeded
    draws"). Its record is a rollout group like any other; the trainer audits it and never trains on it."""
    return key.endswith(SKIP_SUFFIX) and _ROLLOUT.match(key) is not None


def rollout_stamp(key: str) -> int | None:
    """The stamp (ms) of a rollout key, or None for a key of the first layout or not a rollout key."""
    m = _ROLLOUT.match(key)
    return int(m.group(2)) if m and m.group(2) is not None else None


def rollouts_start_after(version: int, stamp_ms: int) -> str:
    """A `start_after` bound that lists the keys of `version` stamped at or after `stamp_ms`."""
    return f"{rollouts_dir(version)}{_stamp(max(0, min(stamp_ms, _MAX_STAMP)))}"


# --- workers, trainer, swarm --------------------------------------------------------------------


def worker_heartbeat(worker: str) -> str:
    return f"{WORKERS_PREFIX}{check_name(worker, 'worker id')}.json"


def trainer_key(name: str) -> str:
    return f"{TRAINER_PREFIX}{check_name(name, 'trainer object name')}"


def trainer_folder_key(folder: str, name: str) -> str:
    """`trainer/{folder}/{name}`: one object of a multi-object trainer record (a sharded checkpoint)."""
    return f"{TRAINER_PREFIX}{check_name(folder, 'trainer folder')}/{check_name(name, 'trainer object name')}"


def swarm_dir(node: str) -> str:
    return f"{SWARM_PREFIX}{check_name(node, 'node name')}/"


def swarm_key(node: str, seq: int) -> str:
    if not isinstance(seq, int) or seq < 0 or seq > 9_999_999_999:
        raise ValueError(f"seq must be an int in [0, 9999999999], got {seq!r}")
    return f"{swarm_dir(node)}{seq:010d}"


def parse_swarm_key(key: str) -> tuple[str, int] | None:
    m = _SWARM.match(key)
    return (m.group(1), int(m.group(2))) if m else None


def swarm_heartbeat(node: str) -> str:
    return f"{SWARM_NODES_PREFIX}{check_name(node, 'node name')}.json"


def swarm_checkpoint(node: str) -> str:
    return f"{SWARM_CKPT_PREFIX}{check_name(node, 'node name')}.pt"


def eval_key(version: int) -> str:
    """Where the held-out evaluation of `version` is published (overwritten if re-evaluated)."""
    return f"{EVALS_PREFIX}{_v(version)}.json"


# --- committed draws (`pnyx.protocol.commits`) -----------------------------------------------------------


def commits_dir(n: int) -> str:
    """The prefix the trainer lists for tick `n`."""
    return f"{COMMITS_PREFIX}t{int(n):012d}/"


def commit_key(n: int, worker: str, first_seq: int, content_hash: str) -> str:
    """The key of a commitment for tick `n` whose object bytes hash to `content_hash` (32 hex digits)."""
    return f"{commits_dir(n)}{check_name(worker, 'worker id')}-{int(first_seq):010d}-{content_hash}"


def parse_commit_key(key: str) -> tuple[int, str, int, str] | None:
    """(tick, worker id, first seq, content hash) of a commitment key, None for any other key."""
    m = _COMMIT_KEY.match(key)
    return (int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)) if m else None


def tick_key(n: int) -> str:
    return f"{TICKS_PREFIX}{int(n):012d}"


def parse_tick_key(key: str) -> int | None:
    m = _TICK_KEY.match(key)
    return int(m.group(1)) if m else None
