"""The attack suite's producer of signed groups (`Producer`), and the honest worker every attack runs beside.

A `Producer` holds one worker name and key (an Ed25519 `Signer`) and numbers its own seqs, as a worker does:
it reserves a seq before drawing a seeded group (`draw`, with the follower's real engine), keeps its
zero-variance draws as skip records (`skip_uploads`) and packs a group as the signed upload a courier would
store (`pack`). `uploads(arena, n)` is what a protocol-following producer uploads: `produce(arena, n)` (each
attack's own, in `attacks.py`) and its skip records. `HonestWorker` is `pnyx worker`'s behaviour.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pnyx.protocol import layout
from pnyx.protocol.codec import encode_group
from pnyx.security.signing import Signer
from pnyx_harness.arena import Arena, Upload


def new_signer() -> Signer:
    """A fresh worker key (what a new contributor, or a Sybil's next identity, has)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Signer(Ed25519PrivateKey.generate())


def model_tokens(group: Any) -> int:
    return sum(sum(s.loss_mask) for s in group.samples)


def is_zero_variance(group: Any) -> bool:
    return len({s.reward for s in group.samples}) <= 1


@dataclass
class Producer:
    """A producer of signed groups under one worker name and key (`signer`), numbering its own seqs."""

    worker_id: str
    source: str = "honest"
    signer: Signer = field(default_factory=new_signer)
    seq: int = 0
    seed: int = 0
    skipped: list[tuple[Any, Signer]] = field(default_factory=list)
    """Seeded zero-variance groups drawn and not offered for training, each with the key it was drawn
    under (`skip_uploads` announces them under that key and the group's own name)."""
    _spare: dict[tuple[str, str], list[Any]] = field(default_factory=dict)  # mixed groups drawn beyond
    # what `sampled` returned, per (key, name) they were drawn under
    _made: Counter[str] = field(default_factory=Counter)
    moves_past_refusals: bool = False
    """Under committed draws, a refused commitment moves the numbering to the next free seq the tick names
    and commits again (what `pnyx worker` does); False: it draws anyway (an attacker)."""

    def _next_seed(self) -> int:
        from pnyx.envs import stable_hash

        self.seed += 1
        return stable_hash(self.source, self.worker_id, self.seed) % (2**31)

    def tasks(self, arena: Arena, n: int) -> list[Any]:
        return arena.env.sample("train", seed=self._next_seed(), n=n)

    def pack(
        self,
        group: Any,
        *,
        signer: Signer | None = None,
        worker_id: str | None = None,
        seq: int | None = None,
        payload: bool = False,
        skip: bool = False,
    ) -> Upload:
        """`group` under this producer's (or the given) name, seq and key, signed, as an upload (`skip`: as
        its skip record). A group with seeded draws keeps the seq it was drawn under unless another is
        given."""
        signer = signer or self.signer
        worker_id = worker_id or self.worker_id
        if seq is None and group.draws:
            seq = group.seq
        elif seq is None:
            seq = self.reserve()
        group = msgspec.structs.replace(group, worker_id=worker_id, seq=seq)
        key = layout.rollout_key(group.policy_version, worker_id, seq, skip=skip)
        self._made[signer.fingerprint] += 1
        return Upload(
            key=key, data=encode_group(group, signer=signer), source=self.source, signer=signer.fingerprint,
            index=self._made[signer.fingerprint], tokens=model_tokens(group), payload=payload,
        )  # fmt: skip

    def reserve(self) -> int:
        """The next seq of this producer (a worker reserves it before generating a seeded group)."""
        seq, self.seq = self.seq, self.seq + 1
        return seq

    def draw(self, arena: Arena, tasks: list[Any], temperature: float | None = None) -> list[Any]:
        """One group per task from the follower's engine, with the seeded draws of this producer's key and
        name (what a worker with them samples; `temperature` overrides the run's). Under committed draws a
        refused commitment is drawn anyway, unless the producer `moves_past_refusals`."""
        return arena.sample(
            tasks, self._next_seed(), temperature,
            key=self.signer.fingerprint, worker_id=self.worker_id, next_seq=self.reserve, signer=self.signer,
            skip_to=self._skip_to if self.moves_past_refusals else None,
        )  # fmt: skip

    def _skip_to(self, seq: int) -> None:
        self.seq = max(self.seq, seq)

    def sampled(self, arena: Arena, n: int, temperature: float | None = None) -> list[Any]:
        """`n` groups sampled by the follower's engine whose samples do not all share one reward (what a
        worker offers for training); the zero-variance ones drawn meanwhile go to `skipped` (a worker
        uploads their skip records: `skip_uploads`), mixed ones beyond `n` are kept for the next call."""
        ident = (self.signer.fingerprint, self.worker_id)
        spare = self._spare.setdefault(ident, [])
        out, spare[:] = spare[:n], spare[n:]
        for _ in range(50 * n + 10):
            if len(out) >= n:
                break
            tasks = self.tasks(arena, max(2, n - len(out)))
            for g in self.draw(arena, tasks, temperature):
                if is_zero_variance(g):
                    self.skipped.append((g, self.signer))
                else:
                    out.append(g)
        spare += out[n:]
        return out[:n]

    def discard_spares(self) -> None:
        """Forget the mixed groups drawn beyond what `sampled` returned, so the next groups are drawn now, at
        the arena's current version (spares drawn long ago are of versions the trainer may have swept)."""
        self._spare.clear()

    def skip_uploads(self) -> list[Upload]:
        """The skip records of the seeded zero-variance groups drawn so far, each under the key and name it
        was drawn with (every seq accounted for)."""
        out = [self.pack(g, signer=k, worker_id=g.worker_id, skip=True) for g, k in self.skipped if g.draws]
        self.skipped = []
        return out

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        raise NotImplementedError

    def uploads(self, arena: Arena, n: int) -> list[Upload]:
        """`produce(arena, n)` plus the skip records of the zero-variance groups drawn meanwhile: what a worker
        that follows the protocol uploads (every seq it reserved accounted for)."""
        return self.produce(arena, n) + self.skip_uploads()


@dataclass
class HonestWorker(Producer):
    """A worker that does what `pnyx worker` does (see the module docstring)."""

    moves_past_refusals: bool = True

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        return [self.pack(g) for g in self.sampled(arena, n)] + self.skip_uploads()
