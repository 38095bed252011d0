"""Sharing through the store: publish this node's groups and heartbeat, discover peers, fetch their uploads.

Nodes never exchange addresses: a node is discovered by its heartbeat `swarm/nodes/{node}.json`, and its
groups are the create-only objects `swarm/{node}/{seq:010d}` (keys from `pnyx.protocol.layout`).
Liveness and recency use the *store's* clock (`ObjectMeta.last_modified`), compared with this node's
own freshly written heartbeat, so a peer with a wrong wall clock can neither hide nor pin its records.

`PeerFeed` keeps one cursor per peer and fetches only the newest few uploads of each live peer; every
object it cannot use is dropped once, counted by reason, and never fetched again, so a peer that leaves,
joins late or uploads garbage costs the others a bounded amount of work and never blocks them. Anyone can
write under any prefix, so nothing a peer's objects hold may stop this node: a key that does not parse is
skipped, the cursor moves only over records that validate and that the peer has announced (below its
heartbeat's `next_seq`), and any error raised while handling one peer's objects is a counted drop for that
peer. Knows nothing about torch or the optimizer.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pnyx.errors import ConfigError, NotFoundError, RecordRejected, StoreError
from pnyx.protocol import layout
from pnyx.protocol.codec import decode_json, encode_json, frame_signer
from pnyx.protocol.records import RolloutGroup
from pnyx.security.keys import fingerprint
from pnyx.store import Store
from pnyx.store.retry import Backoff, wait_for
from pnyx.swarm.align import char_ends
from pnyx.swarm.records import NodeHeartbeat, SwarmGroup, SwarmSample, decode_swarm_group, encode_swarm_group

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pnyx.security.signing import Signer

log = logging.getLogger("pnyx.swarm")

MAX_PEERS = 64
"""Peers whose heartbeats a node reads per look (`PeerFeed.max_peers`, at least `swarm.wait_peers`). Names are
free, so a store holding more fresh heartbeats than this is read as: the peers that have delivered a valid
record, up to three quarters of it (a random draw of them if more), then a random draw of the other names.
A flood of invented names costs a bounded number of reads per round, cannot push out the peers a node
learns from, and cannot keep a new peer out for long (the last quarter is drawn anew every look)."""

_DRAW = random.SystemRandom()  # which unknown names are read: no writer can predict it

RESERVED_NODE_NAMES = frozenset({"nodes", "ckpt"})
"""`swarm/nodes/` holds heartbeats and `swarm/ckpt/` checkpoints: a node with either name would collide."""


def check_node_name(name: str) -> str:
    """A valid node name (layout rules, and not a reserved folder name). Raises ConfigError."""
    try:
        layout.check_name(name, "node name")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if name in RESERVED_NODE_NAMES:
        raise ConfigError(
            f"node name {name!r} is reserved (swarm/{name}/ holds node state); pick another name"
        )
    return name


def to_swarm_group(
    group: RolloutGroup,
    tokenizer: PreTrainedTokenizerBase,
    eos_ids: set[int],
    *,
    node: str,
    model_id: str,
    tokenizer_digest: str,
    env_kwargs: dict[str, Any],
) -> SwarmGroup:
    """The shareable text form of one local `RolloutGroup` (decoded text plus our token view of it)."""
    samples = []
    for s in group.samples:
        toks = [int(t) for t in s.tokens]
        samples.append(
            SwarmSample(
                text=cast(str, tokenizer.decode(toks, skip_special_tokens=True)),
                tokens=toks,
                logprobs=[float(x) for x in s.logprobs],
                loss_mask=[int(m) for m in s.loss_mask],
                token_ends=char_ends(tokenizer, toks),
                eos=bool(toks) and toks[-1] in eos_ids,
                reward=float(s.reward),
                finish_reason=str(s.finish_reason),
                num_tool_calls=int(s.num_tool_calls),
            )
        )
    return SwarmGroup(
        node=node,
        seq=int(group.seq),
        policy_version=int(group.policy_version),
        model_id=model_id,
        tokenizer_digest=tokenizer_digest,
        env=group.env,
        env_kwargs=dict(env_kwargs),
        task_id=group.task_id,
        samples=samples,
        temperature=float(group.temperature),
        top_p=float(group.top_p),
        top_k=int(group.top_k),
        created_at=float(group.created_at),
    )


def upload(store: Store, group: SwarmGroup, signer: Signer | None = None) -> str:
    """Write `group` create-only at its key, signed by `signer` (the node's key), and return the key
    (AlreadyExistsError if the seq is taken)."""
    key = layout.swarm_key(group.node, group.seq)
    store.put(key, encode_swarm_group(group, signer), mode="create")
    return key


def write_heartbeat(store: Store, hb: NodeHeartbeat) -> None:
    store.put(layout.swarm_heartbeat(hb.node), encode_json(hb), mode="overwrite")


def read_heartbeat(store: Store, node: str) -> NodeHeartbeat | None:
    """A node's heartbeat, or None if it has none, an unreadable one (out-of-range `next_seq` included) or an
    invalid name."""
    try:
        return decode_json(store.get(layout.swarm_heartbeat(node)), NodeHeartbeat)
    except (NotFoundError, RecordRejected, ConfigError):
        return None


@dataclass
class Peer:
    """What we know about one other node."""

    name: str
    heartbeat: NodeHeartbeat
    seen_at: float
    """Store timestamp of its heartbeat."""


@dataclass
class PeerFeed:
    """Discovers live peers and fetches their recent uploads, validated and converted by `accept`.

    `accept(key, peer, group, uploaded)` turns a decoded group into whatever the caller keeps (it may
    raise RecordRejected, which is counted like any other drop). Per refresh and peer, at most
    `recent_per_peer` of the newest not-yet-seen uploads inside `window_s` are fetched, from at most
    `max_peers` peers (`MAX_PEERS`).
    """

    store: Store
    me: str
    accept: Callable[[str, str, SwarmGroup, float], Any]
    window_s: float = 300.0
    peer_timeout_s: float = 60.0
    recent_per_peer: int = 8
    drops: Counter = field(default_factory=Counter)
    max_peers: int = MAX_PEERS
    peers: dict[str, Peer] = field(default_factory=dict)
    now: float = field(default_factory=time.time)
    """The store's clock at the last refresh (our heartbeat's timestamp)."""
    _seen: dict[str, int] = field(default_factory=dict)
    """Per peer: highest seq of a valid record already fetched (or skipped as too old)."""
    keys: dict[str, str] = field(default_factory=dict)
    """Per peer: the fingerprint of the key that signed the first record of it this node took; a record
    under its name signed by another key is `id_theft` (names are first come, first bound, as in a fleet)."""
    _delivered: set[str] = field(default_factory=set)
    """Peers that have delivered a record `accept` took (read first when there are more than `max_peers`)."""
    _dropped: dict[str, set[int]] = field(default_factory=dict)
    """Per peer: seqs above the cursor whose objects did not validate (never fetched again; they do not move
    the cursor, so junk at a high seq cannot silence the peer)."""

    def live_peers(self, metas: list[Any] | None = None) -> dict[str, Peer]:
        """Read every heartbeat; keep the peers whose heartbeat is within `peer_timeout_s` of ours."""
        metas = self.store.list(layout.SWARM_NODES_PREFIX) if metas is None else metas
        by_name = {}
        for m in metas:
            name = m.key[len(layout.SWARM_NODES_PREFIX) :].removesuffix(".json")
            if not m.key.endswith(".json") or not name:
                continue
            try:
                layout.check_name(name, "node name")
            except ConfigError:  # anyone can write there: a key that names no node is skipped, not fatal
                self.drops["bad_heartbeat_key"] += 1
                continue
            by_name[name] = m
        mine = by_name.get(self.me)
        now = mine.last_modified.timestamp() if mine is not None else time.time()
        self._delivered &= set(by_name)  # a name whose heartbeat is gone is forgotten
        fresh = [
            name
            for name, meta in by_name.items()
            if name != self.me and now - meta.last_modified.timestamp() <= self.peer_timeout_s
        ]
        if len(fresh) > self.max_peers:  # peers that delivered first, then a random draw (see `MAX_PEERS`)
            proven = [n for n in fresh if n in self._delivered]
            proven = _DRAW.sample(proven, min(len(proven), self.max_peers - max(1, self.max_peers // 4)))
            others = [n for n in fresh if n not in proven]
            drawn = proven + _DRAW.sample(others, min(len(others), self.max_peers - len(proven)))
            self.drops["peers_not_read"] += len(fresh) - len(drawn)
            fresh = drawn
        live: dict[str, Peer] = {}
        for name in fresh:
            meta = by_name[name]
            hb = read_heartbeat(self.store, name)
            if hb is None or hb.node != name:
                self.drops["bad_heartbeat"] += 1
                continue
            live[name] = Peer(name, hb, meta.last_modified.timestamp())
        gone = set(self.peers) - set(live)
        joined = set(live) - set(self.peers)
        if gone or joined:
            log.info("peers: joined=%s left=%s live=%s", sorted(joined), sorted(gone), sorted(live))
        self.peers = live
        return live

    def wait(self, n: int, deadline_s: float, beat: Callable[[], None]) -> int:
        """Wait until `n` peers are live or `deadline_s` passes (backoff 0.2 s to 2 s); returns how many are.

        `beat()` rewrites our own heartbeat before each look: peers see us, and liveness uses the store's clock.
        """
        live = 0

        def attempt() -> int | None:
            nonlocal live
            beat()
            try:
                live = len(self.live_peers())
            except StoreError as exc:
                log.warning("listing peers failed (%s); retrying", exc)
            return live if live >= n else None

        if wait_for(attempt, deadline_s, Backoff.polling(cap_s=2.0)) is None:
            log.warning("%s starts with %d of %d peers live (waited %.0fs)", self.me, live, n, deadline_s)
        return live

    def refresh(self) -> list[Any]:
        """Fetch, validate and `accept` the new recent uploads of every live peer; return what was accepted."""
        out: list[Any] = []
        metas = self.store.list(layout.SWARM_NODES_PREFIX)
        mine = [m.last_modified.timestamp() for m in metas if m.key == layout.swarm_heartbeat(self.me)]
        now = self.now = mine[0] if mine else time.time()
        for peer in self.live_peers(metas).values():
            try:
                out.extend(self._refresh_peer(peer, now))
            except StoreError as exc:  # one unreachable prefix must not stop the round
                self.drops["store_error"] += 1
                log.warning("peer %s: listing failed (%s); skipping it this round", peer.name, exc)
            except Exception as exc:  # noqa: BLE001 - one peer's objects must never stop this node
                self.drops["peer_error"] += 1
                log.warning("peer %s: %s: %s; skipping it this round", peer.name, type(exc).__name__, exc)
        return out

    def _refresh_peer(self, peer: Peer, now: float) -> list[Any]:
        seen = self._seen.get(peer.name, -1)
        announced = peer.heartbeat.next_seq
        # Start just below the peer's advertised next seq: listing cost is bounded by the recent window,
        # not by the length of the peer's history.
        floor = max(seen, announced - self.recent_per_peer - 1)
        dropped = self._dropped[peer.name] = {q for q in self._dropped.get(peer.name, ()) if q > floor}
        start_after = layout.swarm_key(peer.name, floor) if floor >= 0 else None
        # The limit bounds the cost of a peer whose heartbeat understates its uploads.
        metas = self.store.list(
            layout.swarm_dir(peer.name), start_after=start_after, limit=4 * self.recent_per_peer + 64
        )
        fresh = []
        for m in metas:
            parsed = layout.parse_swarm_key(m.key)
            if parsed is None or parsed[0] != peer.name:
                self.drops["bad_key"] += 1
                continue
            if parsed[1] <= seen or parsed[1] in dropped:
                continue
            if parsed[1] >= announced:
                # Not announced yet: a peer rewrites its heartbeat right after uploading, so its own uploads
                # are fetched next round; an object far above it (anyone's) never moves the cursor.
                self.drops["ahead_of_heartbeat"] += 1
                continue
            if now - m.last_modified.timestamp() > self.window_s:
                self._seen[peer.name] = max(self._seen.get(peer.name, -1), parsed[1])
                self.drops["outside_window"] += 1
                continue
            fresh.append((parsed[1], m))
        fresh.sort(key=lambda x: x[0])
        if len(fresh) > self.recent_per_peer:
            self.drops["older_than_recent"] += len(fresh) - self.recent_per_peer
            fresh = fresh[-self.recent_per_peer :]
        out = []
        for seq, m in fresh:
            out.extend(self._fetch(peer.name, seq, m.key, m.last_modified.timestamp()))
        return out

    def _fetch(self, peer: str, seq: int, key: str, uploaded: float) -> list[Any]:
        """Fetch, validate and `accept` one upload ([] and a counted drop if it is unusable).

        Only a record that validates moves the cursor; an invalid object is remembered by seq instead, so it
        is fetched once. `accept` runs code this node does not control on the peer's record (its verifier),
        so any error it raises is a counted drop of that record."""
        try:
            data = self.store.get(key)
            signer = fingerprint(frame_signer(data))  # before anything is inflated or decoded
            bound = self.keys.get(peer)
            if bound is not None and bound != signer:
                raise RecordRejected("id_theft", f"{key} is signed by {signer}, {peer!r} is bound to {bound}")
            group = decode_swarm_group(data)
            if group.node != peer or group.seq != seq:
                raise RecordRejected("node_mismatch", f"{key} claims node {group.node!r} seq {group.seq}")
        except RecordRejected as exc:
            self._dropped.setdefault(peer, set()).add(seq)
            self.drops[exc.reason] += 1
            log.info("dropped %s: %s", key, exc)
            return []
        except NotFoundError:
            self.drops["vanished"] += 1
            return []
        self._seen[peer] = max(self._seen.get(peer, -1), seq)
        try:
            accepted = self.accept(key, peer, group, uploaded)
            self.keys.setdefault(peer, signer)  # a record we took binds the name to its key
            self._delivered.add(peer)
            return [accepted]
        except RecordRejected as exc:
            self.drops[exc.reason] += 1
            log.info("dropped %s: %s", key, exc)
        except Exception as exc:  # noqa: BLE001 - a peer's record must never stop this node
            self.drops["accept_error"] += 1
            log.warning("dropped %s: accepting it raised %s: %s", key, type(exc).__name__, exc)
        return []

    # --- checkpoint support -----------------------------------------------------------------------

    def cursor(self) -> dict[str, int]:
        """Per peer: the highest seq of a valid record already fetched (what a checkpoint saves)."""
        return dict(self._seen)

    def restore(self, cursor: dict[str, int], keys: list[str]) -> list[Any]:
        """Set the cursor from a checkpoint and fetch again the groups it had fetched but not yet used."""
        self._seen = dict(cursor)
        out: list[Any] = []
        for key in keys:
            parsed = layout.parse_swarm_key(key)
            if parsed is None:
                self.drops["bad_key"] += 1
                continue
            try:
                uploaded = self.store.head(key).last_modified.timestamp()
            except NotFoundError:
                self.drops["vanished"] += 1
                continue
            out.extend(self._fetch(parsed[0], parsed[1], key, uploaded))
        return out
