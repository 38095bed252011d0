"""Hostile producers of the attack suite that attack names and the store rather than content: a replayer of
another run's groups, a flooder (one key behind many names), a junk writer (no key at all, under an honest
worker's name) and an id thief (an honest worker's name under its own key). See `attacks.py` (which
re-exports them) for the suite and `arena.py` for how uploads are judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pnyx.security.signing import Signer
from pnyx_harness.arena import Arena, Upload
from pnyx_harness.producer import HonestWorker, Producer, new_signer


@dataclass
class Replayer(Producer):
    """Uploads groups of another run: `verbatim` (the foreign bytes under the foreign key) or re-labelled
    with this run's id and re-signed by its own key."""

    foreign: list[Upload] = field(default_factory=list)
    verbatim: bool = True

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        from pnyx.protocol.codec import decode_group

        out = []
        for u in self.foreign[:n]:
            if self.verbatim:
                out.append(Upload(u.key, u.data, self.source, u.signer, u.index, u.tokens))
                continue
            g = decode_group(u.data)
            out.append(self.pack(msgspec.structs.replace(g, run_id=arena.run_id)))
        del self.foreign[:n]
        return out


def foreign_groups(arena: Arena, n: int) -> list[Upload]:
    """`n` honest groups of another run of the same model: another trainer key, run id and weights history
    (its v1 moved away from v0), stamped with that run's id and a digest of its history at the version this
    arena serves now (so the trainer lists them), and signed by an honest worker of that run.
    What a replayer finds in another run's bucket. (Sampled by this arena's engine: what the trainer checks
    is the labels, the samples only need to be valid.)"""
    import torch

    from pnyx.store import open_store
    from pnyx.weights.publisher import Publisher

    other_run = f"{arena.run_id}-other"
    pub = Publisher(open_store("memory://"), signer=Signer(new_signer().key, other_run))
    tensors = dict(arena.syncer.tensors)
    pub.publish(0, tensors, force_anchor=True)
    g = torch.Generator().manual_seed(1)
    moved = {
        k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in tensors.items()
    }
    m = pub.publish(1, moved)
    honest = HonestWorker("other-worker", source="foreign")
    out = []
    for grp in honest.sampled(arena, n):
        grp = msgspec.structs.replace(grp, run_id=other_run, weights_digest=m.weights.chain_digest)
        out.append(honest.pack(grp))
    return out


@dataclass
class Flooder(Producer):
    """One key behind `names` worker names; `produce(arena, n)` uploads n groups spread over them. At most
    `fresh` of them are new samples, each drawn under the name it is sent under (valid, signed, honest
    groups), the rest copies of those under new seqs (a flooder spends nothing on content; a copy's tokens
    are not its new seq's draws)."""

    names: int = 8
    fresh: int = 8

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        home, made, out = self.worker_id, [], []
        try:
            for i in range(n):
                self.worker_id = f"{home}-{i % self.names}"  # names in turn
                if len(made) < self.fresh:
                    groups = self.sampled(arena, 1)
                    made += groups
                    out += [self.pack(g) for g in groups]
                elif made:
                    out.append(self.pack(made[i % len(made)], seq=self.reserve()))
        finally:
            self.worker_id = home
        return out


@dataclass
class JunkWriter(Producer):
    """Writes under an honest worker's name (`victim`) at the run's version without its key: one-byte
    objects and copies of the victim's own signed records (its honest uploads) put under other seqs (`produce(arena, n)`: n
    objects, half of each, seqs from `seq` up). What a store that lets every worker write under
    `rollouts/` allows anyone: it aims at the victim's key (a flood quarantine once counted these) and
    at its seqs (a copy listed first squats the seq)."""

    victim: str = ""
    seq: int = 500_000

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        from pnyx.protocol import layout

        own = [
            u
            for u in arena.uploads
            if u.source == "honest" and (layout.parse_rollout_key(u.key) or (0, "", 0))[1] == self.victim
        ]
        if not own:
            raise ValueError(f"no upload of {self.victim!r} to copy yet")
        out = []
        for i in range(n):
            data = b"x" if i % 2 == 0 else own[i % len(own)].data
            key = layout.rollout_key(arena.version, self.victim, self.reserve())
            out.append(Upload(key=key, data=data, source=self.source, index=i + 1))
        return out


@dataclass
class IdThief(Producer):
    """Claims `victim`'s name with its own key (honest-looking content; seqs far above the victim's)."""

    victim: str = ""
    seq: int = 1_000_000_000

    def produce(self, arena: Arena, n: int) -> list[Upload]:
        return [self.pack(g, worker_id=self.victim) for g in self.sampled(arena, n)]
