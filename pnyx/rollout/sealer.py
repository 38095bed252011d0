"""Numbering and signing a worker's groups: the seq in each rollout key, and the worker key's signature.

A group with seeded draws (`pnyx.protocol.draws`) takes its seq before it is generated (`reserve`): the
seq is part of its draws, so it is fixed before any outcome is seen; a group the worker does not offer for
training (zero variance) is sealed under the key of its skip record (`seal(group, skip=True)`), so every
reserved seq is accounted for in the store. An unseeded group (an engine without seeded draws) takes its seq
only when it is sealed for the spool, so such a worker's seqs are contiguous. The join resumes the counter
past the highest seq this worker id left in the store or its spool. `rekey` seals an unseeded group that
collided create-only with foreign bytes (two live workers sharing an id) again under the next seq; a seeded
group cannot move (its draws name its seq), so that collision stops the worker with the reason. The
generating thread reserves and seals and the courier thread re-keys, so the counter is under a lock.

Knows nothing about the store, the spool or generation.
"""

from __future__ import annotations

import threading

import msgspec

from pnyx.errors import AlreadyExistsError
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

    def reserve(self) -> int:
        """A seq for a group about to be generated with seeded draws (sealed later under that seq)."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            return seq

    def seal(self, group: RolloutGroup, *, skip: bool = False) -> tuple[str, bytes]:
        """(rollout key, signed bytes) of `group`: under its reserved seq if it has seeded draws, else under
        the next seq. `skip`: under the key of its skip record (`layout.is_skip_key`; seeded groups only)."""
        if skip and not group.draws:
            raise ValueError(
                "only a group with seeded draws has a reserved seq to account for with a skip record"
            )
        if not group.draws:
            with self._lock:
                seq = self._seq
                self._seq += 1
            group = msgspec.structs.replace(group, seq=seq)
        return layout.rollout_key(group.policy_version, self.worker_id, group.seq, skip=skip), encode_group(
            group, signer=self.signer
        )

    def rekey(self, key: str, data: bytes) -> tuple[str, bytes]:
        """The spool's re-key callback: the group in `data` sealed again under the next seq (`key` is the
        one that collided)."""
        group = decode_group(data)
        if group.draws:
            raise AlreadyExistsError(
                f"{key} already exists with different content: two workers share the worker id "
                f"{self.worker_id!r} (a group with seeded draws cannot move to another seq). Give each "
                "worker a unique --id."
            )
        return self.seal(group)
