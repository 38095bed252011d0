"""The worker's sealer: contiguous seqs in the rollout keys, signed bytes, and re-keying under the next seq."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from ingest_support import make_group

from pnyx.protocol import decode_group, layout
from pnyx.protocol.codec import frame_signer
from pnyx.rollout.sealer import Sealer
from pnyx.security.signing import Signer


def test_sealed_groups_take_contiguous_seqs_from_the_resume_point_and_are_signed():
    signer = Signer(Ed25519PrivateKey.generate())
    sealer = Sealer("w1", signer)
    sealer.resume(7)
    sealed = [sealer.seal(make_group(3, "w1", seq=0, task_index=i)) for i in range(3)]
    assert [layout.parse_rollout_key(key) for key, _ in sealed] == [(3, "w1", s) for s in (7, 8, 9)]
    assert [decode_group(data).seq for _, data in sealed] == [7, 8, 9]
    assert all(frame_signer(data) == signer.public_raw for _, data in sealed)
    assert sealer.next_seq == 10


def test_rekey_moves_a_collided_group_to_the_next_seq():
    sealer = Sealer("w1", Signer(Ed25519PrivateKey.generate()))
    key, data = sealer.seal(make_group(2, "w1", seq=0))
    sealer.seal(make_group(2, "w1", seq=0, task_index=1))
    new_key, new_data = sealer.rekey(key, data)
    assert layout.parse_rollout_key(new_key) == (2, "w1", 2) and decode_group(new_data).seq == 2
    assert decode_group(new_data).task_id == decode_group(data).task_id
