"""Weight attacks of the attack suite (issue #15 item 5, docs/security.md): what the suite measures is
whether a real follower serves them. The group producers are in `attacks.py`.

- `WeightForger`: publishes the next version with its own key, chained exactly onto the trainer's current
  weights (it knows everything public), and a forged HEAD naming it.
- `ForkSquatter`: before the trainer publishes them, fills the next versions' folders with an unsigned
  `manifest.json`, a manifest under a made-up signature name, junk at the trainer's payload names, and a
  HEAD naming version 99999999.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pnyx.protocol import layout
from pnyx.security.signing import Signer
from pnyx_harness.arena import Arena
from pnyx_harness.producer import new_signer


@dataclass
class WeightForger:
    """Publishes version V+1 (V: the trainer's newest) with its own key, chained exactly onto the trainer's
    history, and a forged HEAD naming it. `act` returns the manifest key it wrote."""

    source: str = "weight_forger"
    signer: Signer = field(default_factory=new_signer)
    noise: float = 0.05

    def act(self, arena: Arena) -> str:
        import torch

        from pnyx.weights.publisher import Publisher

        trainer_pub = arena.trainer.parts.publishing.publisher
        forger = Publisher(arena.store, signer=self.signer.for_run(arena.run_id))
        # everything a forger needs is public (the trainer's manifests and payloads name it): continue the
        # trainer's chain from its newest version
        forger._state, forger.version = trainer_pub._state, trainer_pub.version
        forger.anchor_version, forger._digest = trainer_pub.anchor_version, trainer_pub._digest
        forger._check_fence = lambda version: trainer_pub.version  # its own fence sees none of its versions
        tensors = {
            k: (v.float() + self.noise * torch.randn_like(v.float())).to(v.dtype)
            for k, v in arena.trainer.parts.publishing.tensors().items()
        }
        m = forger.publish(arena.trainer.version + 1, tensors)
        tag = self.signer.for_run(arena.run_id).manifest_tag(m.version)
        return layout.signed_weights_manifest(m.version, tag)


@dataclass
class ForkSquatter:
    """Squats the next `ahead` versions before the trainer publishes them (see the module docstring)."""

    source: str = "fork_squatter"
    ahead: int = 3

    def act(self, arena: Arena) -> list[str]:
        from pnyx.protocol.codec import encode_json
        from pnyx.weights.manifest import Head

        v = arena.trainer.version
        nonce = arena.trainer.parts.publishing.publisher.nonce
        junk = b'{"schema": 1, "version": 0}'
        keys = []
        for ahead in range(1, self.ahead + 1):
            for key in (
                layout.weights_manifest(v + ahead),  # the unsigned name
                layout.signed_weights_manifest(v + ahead, secrets.token_hex(64)),  # a made-up signature
                layout.weights_payload(v + ahead, f"delta-{nonce}-00000"),  # the trainer's payload names
                layout.weights_payload(v + ahead, f"anchor-{nonce}-00000.safetensors"),
            ):
                arena.store.put(key, junk, mode="create")
                keys.append(key)
        head = Head(version=99_999_999, digest="0" * 32, signature="00" * 64)
        arena.store.put(layout.WEIGHTS_HEAD, encode_json(head), mode="overwrite")
        keys.append(layout.WEIGHTS_HEAD)
        return keys
