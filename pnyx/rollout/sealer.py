"""Numbering and signing a worker's groups: the seq in each rollout key, and the worker key's signature.

A group takes its seq only when it is sealed for the spool (skipped groups take none), so a worker's seqs
are contiguous; the join resumes the counter past the highest seq this worker id left in the store or its
spool. `rekey` seals a group that collided create-only with foreign bytes (two live workers sharing an id)
again under the next seq. The generating thread seals and the courier thread re-keys, so the counter is
under a lock.

Knows nothing about the store, the spool or generation.
"""

from __future__ import annotations

import threading

import msgspec

from pnyx.protocol import RolloutGroup, decode_group, encode_group, layout
from pnyx.security.signing import Signer


class Sealer:
    """Gives each group of `worker_id` the next seq and signs it with `signer` (see the module docstring)."""

    def __init__(self, worker_id: str, signer: Signer):
        self.worker_id = worker_id
        self.signer = signer
        """This machine's worker key; the trainer binds the worker's name to it."""
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def next_seq(self) -> int:
        """The seq the next sealed group gets."""
        with self._lock:
            return self._seq

    def resume(self, seq: int) -> None:
        """Continue numbering at `seq` (at join, before any group is sealed)."""
        with self._lock:
            self._seq = seq

    def seal(self, group: RolloutGroup) -> tuple[str, bytes]:
        """(rollout key, signed bytes) of `group` under the next seq."""
        with self._lock:
            seq = self._seq
            self._seq += 1
        group = msgspec.structs.replace(group, seq=seq)
        return layout.rollout_key(group.policy_version, self.worker_id, seq), encode_group(
            group, signer=self.signer
        )

    def rekey(self, key: str, data: bytes) -> tuple[str, bytes]:
        """The spool's re-key callback: the group in `data` sealed again under the next seq (`key` is the
        one that collided)."""
        return self.seal(decode_group(data))
