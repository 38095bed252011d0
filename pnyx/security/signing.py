"""Signing and verifying: a `Signer` holds a private key, a `Verifier` the matching public key.

Every signed message is `b"pnyx:" + domain + b"\\0" + run_id + b"\\0" + data`: the domain (`manifest`,
`manifest-name`, `head`, `group`) keeps a signature made for one purpose from verifying for another, and the
run id keeps a trainer that uses one key for several runs from having its manifests replayed from one run
into another. Rollout groups are signed with an empty run id (the run id is inside the signed record,
and the trainer checks it).

Ed25519 signatures are deterministic: the same key signs the same message to the same 64 bytes. Weight
manifests use this for their object names (`manifest_tag`): the name of version V's manifest is the
trainer's signature of V, so nobody without the key can compute or squat it, a reader recognises the
trainer's manifest from a listing alone, and two processes holding the same key still collide on the same
create-only name (the fence against two trainers). Knows nothing about the store or the records' layouts.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pnyx.security.keys import fingerprint, public_from_hex, public_raw

SIGNATURE_BYTES = 64
_TAG_CACHE = 4096


def _message(domain: str, run_id: str, data: bytes) -> bytes:
    return b"pnyx:" + domain.encode() + b"\0" + run_id.encode() + b"\0" + data


class _BoundedDict(dict[str, str]):
    """A dict that forgets everything once it holds `cap` items (only ever a log-once memory)."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap

    def __setitem__(self, key: str, value: str) -> None:
        if key not in self and len(self) >= self.cap:
            self.clear()
        super().__setitem__(key, value)


class Verifier:
    """Checks signatures made by one public key (for one run, when `run_id` is given)."""

    def __init__(self, public: Ed25519PublicKey, run_id: str = ""):
        self.public = public
        self.run_id = run_id
        self.raw = public_raw(public)
        self.fingerprint = fingerprint(self.raw)
        self._tags: dict[tuple[int, str], bool] = {}
        self.manifest_names: dict[int, str] = {}
        """Version -> key of the manifest this key named (filled by `pnyx.weights.manifest` listings)."""
        self.ignored: dict[str, str] = _BoundedDict(_TAG_CACHE)
        """Manifest key -> why it was ignored (not named by this key), for every manifest object seen in
        listings; each is logged once (filled by `pnyx.weights.manifest` listings)."""

    @classmethod
    def from_hex(cls, public_hex: str, run_id: str = "") -> Verifier:
        return cls(public_from_hex(public_hex), run_id)

    @property
    def public_hex(self) -> str:
        return self.raw.hex()

    def check(self, domain: str, data: bytes, signature: bytes) -> bool:
        """Whether `signature` is this key's signature of (domain, run, data)."""
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            self.public.verify(signature, _message(domain, self.run_id, data))
        except InvalidSignature:
            return False
        return True

    def check_hex(self, domain: str, data: bytes, signature_hex: str) -> bool:
        try:
            sig = bytes.fromhex(signature_hex)
        except ValueError:
            return False
        return self.check(domain, data, sig)

    def check_tag(self, version: int, tag: str) -> bool:
        """Whether `tag` is the trainer's name tag of `version` (see `Signer.manifest_tag`); cached."""
        known = self._tags.get((version, tag))
        if known is None:
            if len(self._tags) >= _TAG_CACHE:
                self._tags.clear()
            known = self._tags[(version, tag)] = self.check_hex("manifest-name", b"%d" % version, tag)
        return known


class Signer:
    """Signs with one private key (bound to one run when `run_id` is given)."""

    def __init__(self, key: Ed25519PrivateKey, run_id: str = ""):
        self.key = key
        self.run_id = run_id
        self.verifier = Verifier(key.public_key(), run_id)

    @property
    def fingerprint(self) -> str:
        return self.verifier.fingerprint

    @property
    def public_hex(self) -> str:
        return self.verifier.public_hex

    @property
    def public_raw(self) -> bytes:
        return self.verifier.raw

    def for_run(self, run_id: str) -> Signer:
        """The same key, bound to `run_id`."""
        return Signer(self.key, run_id)

    def sign(self, domain: str, data: bytes) -> bytes:
        return self.key.sign(_message(domain, self.run_id, data))

    def sign_hex(self, domain: str, data: bytes) -> str:
        return self.sign(domain, data).hex()

    def manifest_tag(self, version: int) -> str:
        """The name tag of version `version`'s manifest: this key's signature of the version (128 hex)."""
        return self.sign_hex("manifest-name", b"%d" % version)
