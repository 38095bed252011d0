"""Who may publish weights and who produced a rollout group: Ed25519 keys, signatures, pinned trust.

- `keys.py`: load or create a key file (trainer or worker), fingerprints, where key files live.
- `signing.py`: `Signer` (a private key, bound to a run for weights) and `Verifier` (a public key): the
  signed messages are domain-separated, so a signature made for one purpose never verifies for another.
- `trust.py`: how a worker pins the trainer's public key (trust on first use from run.json, or
  `--trust <fingerprint>`), and what the trainer records about worker keys.

The threat model and what is (and is not yet) defended: docs/security.md. Knows nothing about torch,
models or the store.
"""

from pnyx.security.keys import fingerprint, load_or_create_key, normalize_fingerprint
from pnyx.security.signing import Signer, Verifier

__all__ = ["Signer", "Verifier", "fingerprint", "load_or_create_key", "normalize_fingerprint"]
