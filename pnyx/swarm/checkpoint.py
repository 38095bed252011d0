"""Swarm node checkpoints: a node's whole training state as one object in the store, so a killed node resumes.

`swarm/ckpt/{node}.pt` (one per node, overwritten; a single put, so no reader ever sees half of one) holds
the fp32 model state, the AdamW state, the node's counters (rounds, version, task position, uploads, groups
trained), its mix-sampling RNG and torch's RNG, and the peer cursor: per peer, the highest seq already
fetched, plus the keys of fetched groups not yet trained on (refetched on resume, so none is lost).

Why this is consistent: a checkpoint is written at the end of a round, so it is the state that produced
everything the node did up to that round. After a kill the node loses the rounds since the checkpoint
(their weight updates and the foreign groups they consumed are rolled back together, and those groups
are fetched again); its uploads of those rounds stay in the store, and its sequence continues after them
(`SwarmNode._resume_seq`), so no key is ever reused.

Signed (anyone who can write to the store can put an object at `swarm/ckpt/{node}.pt`): the object is
`SIGNED_MAGIC`, the node key's 32-byte public key, its 64-byte Ed25519 signature of (node name, the blob),
then the torch blob. The key lives on the node's own machine (`node_key_path`: created at the first
checkpoint), and a node resumes only from a checkpoint its own key signed: one signed by another key, or
unsigned, is refused with the way out (copy the key file from the machine that wrote it, or start with
`--swarm.resume=false`). What it binds: whoever overwrites the object can make the node refuse to resume,
never resume from their weights, counters or cursor.

Knows nothing about peers' weights or the node loop's stages; imports torch inside functions.
"""

from __future__ import annotations

import ast
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pnyx.errors import ConfigError, IntegrityError, NotFoundError
from pnyx.protocol import layout
from pnyx.store import Store

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

NODE_CKPT_FORMAT = 1
SIGNED_MAGIC = b"PNYXNCK1"
"""The first bytes of a signed node checkpoint (then the public key, the signature, the torch blob)."""
_DOMAIN = b"pnyx:swarm-checkpoint\0"


def node_key_path(node: str) -> Path:
    """The file of the key that signs node `node`'s checkpoints on this machine (`default_keys_dir()`)."""
    from pnyx.security.keys import default_keys_dir

    return default_keys_dir() / f"swarm-node-{node}.key"


def node_key(node: str) -> Ed25519PrivateKey:
    """This machine's key for node `node` (created on first use)."""
    from pnyx.security.keys import load_or_create_key

    return load_or_create_key(node_key_path(node))[0]


def _signed_message(node: str, blob: bytes) -> bytes:
    return _DOMAIN + node.encode() + b"\0" + blob


COUNTERS = ("rounds", "version", "task_pos", "seq", "uploaded", "local_trained", "external_trained")
"""`SwarmNode` integer attributes a checkpoint saves and restores by name."""


@dataclass
class NodeState:
    """Everything a node restores besides the model and optimizer tensors."""

    node: str
    tokenizer_digest: str
    counters: dict[str, int]
    """The node's `COUNTERS` by name."""
    drops: dict[str, int] = field(default_factory=dict)
    peers_seen: list[str] = field(default_factory=list)
    feed_seen: dict[str, int] = field(default_factory=dict)
    """Per peer: the highest seq already fetched or dropped."""
    feed_keys: dict[str, str] = field(default_factory=dict)
    """Per peer: the fingerprint its name is bound to (`PeerFeed.keys`)."""
    pending: list[str] = field(default_factory=list)
    """Keys of fetched foreign groups not yet trained on."""
    sample_rng: str = ""
    """repr of the mix-sampling `random.Random` state."""


def capture(node: Any) -> NodeState:  # a SwarmNode (node.py imports this module)
    """The state of a `SwarmNode` (duck-typed: its counters, drops, peers, feed cursor, pool and RNG)."""
    return NodeState(
        node=node.name,
        tokenizer_digest=node.tokenizer_digest,
        counters={k: int(getattr(node, k)) for k in COUNTERS},
        drops=dict(node.drops),
        peers_seen=sorted(node.peers_seen),
        feed_seen=node.feed.cursor(),
        feed_keys=dict(node.feed.keys),
        pending=[c.key for c in node.pool.candidates()],
        sample_rng=repr(node.rng.getstate()),
    )


def restore(node: Any, blob: dict[str, Any]) -> NodeState:  # a SwarmNode, as above
    """Put a checkpoint back into a freshly built `SwarmNode`: tensors, RNGs, counters, drops, peer cursor,
    and the pending foreign groups (fetched again). The node's seq only moves forward (uploads made after
    the checkpoint keep their keys)."""
    st = restore_into(blob, node.model, node.optimizer, node.tokenizer_digest)
    seq = node.seq
    for k, v in st.counters.items():
        setattr(node, k, v)
    node.seq = max(seq, st.counters.get("seq", 0))
    node.drops.update(st.drops)
    node.peers_seen = set(st.peers_seen)
    node.rng.setstate(ast.literal_eval(st.sample_rng))
    node.feed.keys = dict(st.feed_keys)
    node.pool.add(node.feed.restore(st.feed_seen, st.pending))
    node.model.eval()
    return st


def save_node_checkpoint(
    store: Store, state: NodeState, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> str:
    """Write the node's state as one object (atomic put). Returns its key."""
    import torch

    blob = {
        "format": NODE_CKPT_FORMAT,
        "state": {k: v for k, v in state.__dict__.items()},
        "model": {k: v.detach().to("cpu") for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    buf = io.BytesIO()
    torch.save(blob, buf)
    data = buf.getvalue()
    from pnyx.security.keys import public_raw

    signer = node_key(state.node)
    signature = signer.sign(_signed_message(state.node, data))
    key = layout.swarm_checkpoint(state.node)
    store.put(key, SIGNED_MAGIC + public_raw(signer) + signature + data, mode="overwrite")
    return key


def load_node_checkpoint(store: Store, node: str) -> dict[str, Any] | None:
    """The node's checkpoint (tensors on CPU), or None if it has none. Raises IntegrityError if unreadable,
    ConfigError if this machine's key for the node did not sign it (see the module docstring)."""
    import torch

    key = layout.swarm_checkpoint(node)
    try:
        signed = store.get(key)
    except NotFoundError:
        return None
    data = _verified(key, node, signed)
    try:
        blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError) as exc:
        raise IntegrityError(
            f"{key} is not a readable node checkpoint ({exc}); delete it to start fresh"
        ) from exc
    if not isinstance(blob, dict) or blob.get("format") != NODE_CKPT_FORMAT:
        raise IntegrityError(
            f"{key} has format {blob.get('format') if isinstance(blob, dict) else '?'}; "
            f"this reader knows {NODE_CKPT_FORMAT}"
        )
    blob["state"] = NodeState(**blob["state"])
    return blob


def _verified(key: str, node: str, signed: bytes) -> bytes:
    """The torch blob of `signed` if this machine's key for `node` signed it; else ConfigError."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from pnyx.security.keys import fingerprint, public_raw

    mine = node_key(node)
    way_out = (
        f"copy this node's key from the machine that wrote it to {node_key_path(node)}, or start from the "
        "model with --swarm.resume=false (its sequence continues)"
    )
    head = len(SIGNED_MAGIC)
    if not signed.startswith(SIGNED_MAGIC) or len(signed) < head + 96:
        raise ConfigError(f"{key} is not a signed node checkpoint: refusing to resume from it; {way_out}")
    public, signature, data = signed[head : head + 32], signed[head + 32 : head + 96], signed[head + 96 :]
    if public != public_raw(mine):
        raise ConfigError(
            f"{key} is signed by key {fingerprint(public)}, not this machine's key for node {node!r} "
            f"({fingerprint(mine)}): refusing to resume from it; {way_out}"
        )
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, _signed_message(node, data))
    except InvalidSignature:
        raise ConfigError(f"{key}: its signature does not verify (tampered); {way_out}") from None
    return data


def restore_into(
    blob: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokenizer_digest: str
) -> NodeState:
    """Load a checkpoint's tensors into `model` and `optimizer` and restore torch's RNG; returns its state.

    Raises ConfigError when the checkpoint belongs to another tokenizer or model shape (a node name reused
    for another model): the caller names the way out.
    """
    import torch

    state: NodeState = blob["state"]
    if state.tokenizer_digest != tokenizer_digest:
        raise ConfigError(
            f"the checkpoint of node {state.node!r} was made with another tokenizer; run this model under "
            "another --node name, or pass --swarm.resume=false to start it from its model"
        )
    try:
        model.load_state_dict(blob["model"], strict=True)
    except RuntimeError as exc:
        raise ConfigError(
            f"the checkpoint of node {state.node!r} does not fit this model ({str(exc).splitlines()[0]}); "
            "use another --node name or --swarm.resume=false"
        ) from None
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    return state
