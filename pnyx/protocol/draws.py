"""Seeded draws: the randomness of every sampled token, fixed before the worker sees any outcome.

Sample i of a group draws its model tokens by inverse CDF (the engines' `draw`: the first vocabulary index
whose cumulative mass under the sampling distribution exceeds u · total) from a stream of uniforms that
only the group's identity decides:

    seed_i = blake2b-64(SCHEME, run id, key fingerprint, worker id, task id, policy version, seq, i
                        [, the tick's beacon: committed draws, `pnyx.protocol.commits`])
    u_t    = (Philox(key=seed_i).random_raw()[t] >> 40) · 2^-24      (t: the sample's t-th model token)

A worker cannot choose u; it can only use it or not. The trainer recomputes the sampling distribution
at every model token under the exact published weights of the group's version and checks that u falls in
the drawn token's CDF interval (`pnyx.train.drawcheck`), so a token not drawn from the claimed
distribution with this u fails, and a group that passes is the honest draw, token for token (up to a
tolerance for engines' rounding at an interval's edge). u has 24 bits, exact in float32, the dtype the
engines compare it in. Philox's raw output is fixed by its definition (unlike a numpy `Generator`'s float
methods), so every platform draws the same uniforms. Tool tokens (loss mask 0) take no uniform.

A group that samples this way says so in its header (`RolloutGroup.draws == SCHEME`). Knows nothing
about torch, engines or the store.
"""

from __future__ import annotations

import hashlib

import numpy as np

SCHEME = "philox24-v1"
"""The scheme a seeded group names in `draws` (any change to the derivation takes a new name)."""
CHUNK = 64
"""Uniforms a stream derives at a time (a completion rarely needs more)."""


def sample_seed(
    run_id: str,
    key: str,
    worker_id: str,
    task_id: str,
    version: int,
    seq: int,
    index: int,
    beacon: str = "",
) -> int:
    """The 64-bit seed of sample `index` of the group `seq` of `worker_id` (signed by `key`); with a
    `beacon` (a committed group's tick, `pnyx.protocol.commits`) the tick's random bytes join the parts,
    so the stream is unknown until the trainer revealed them."""
    parts: tuple[str, ...] = (
        SCHEME, run_id, key, worker_id, task_id, str(int(version)), str(int(seq)), str(int(index)),
    )  # fmt: skip
    if beacon:
        parts += (beacon,)
    data = "\x1f".join(parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def uniforms(seed: int, n: int) -> np.ndarray:
    """The first `n` uniforms of `seed`'s stream: float32 multiples of 2^-24 in [0, 1)."""
    raw = np.random.Philox(key=seed).random_raw(n)
    return ((raw >> np.uint64(40)).astype(np.float64) * 2.0**-24).astype(np.float32)


def group_seeds(
    run_id: str, key: str, worker_id: str, task_id: str, version: int, seq: int, size: int, beacon: str = ""
) -> list[int]:
    """The seeds of the `size` samples of one group, in sample order."""
    return [sample_seed(run_id, key, worker_id, task_id, version, seq, i, beacon) for i in range(size)]


class UniformStream:
    """One sample's uniforms, consumed one model token at a time by an engine (`peek`, then `advance` once
    the token is kept). Across tool turns the same stream continues."""

    __slots__ = ("_values", "pos", "seed")

    def __init__(self, seed: int):
        self.seed = seed
        self.pos = 0
        """Model tokens drawn so far."""
        self._values = np.empty(0, dtype=np.float32)

    def peek(self) -> float:
        """The uniform of the next model token."""
        if self.pos >= len(self._values):
            self._values = uniforms(self.seed, (self.pos // CHUNK + 1) * CHUNK)
        return float(self._values[self.pos])

    def advance(self) -> None:
        self.pos += 1


def streams(seeds: list[int]) -> list[UniformStream]:
    return [UniformStream(s) for s in seeds]
