"""Named points of a trainer step where a harness may act (`pnyx_harness.trainer` kills the process there).

The loop, the publisher and the checkpointer call `point(name, version)` at: `after_step` (optimizer step
done), `before_manifest` (payload uploaded, manifest not written), `after_publish` (published, before
metrics and checkpoint) and `during_checkpoint` (this rank's checkpoint shards uploaded, not committed).
Nothing is registered in production: `point` is then a no-op. `decoder(decode)` returns the group decoder
the trainer's ingestor uses, wrapped by what a harness registered with `wrap_decode` (e.g. to slow every fetch
down). Knows nothing about training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pnyx.protocol.records import RolloutGroup

Point = Callable[[str, int], None]
Decode = Callable[[bytes, "int | None"], "RolloutGroup"]
"""(record bytes, vocabulary size) -> the decoded group."""

_points: list[Point] = []
_decode_wrap: list[Callable[[Decode], Decode]] = []


def on_point(fn: Point) -> None:
    """Call `fn(name, version)` at every named point of this process's trainer."""
    _points.append(fn)


def point(name: str, version: int) -> None:
    """A named point of the step that produces `version` (see the module docstring)."""
    for fn in _points:
        fn(name, version)


def wrap_decode(fn: Callable[[Decode], Decode]) -> None:
    """Wrap the group decoder of the trainers made in this process: `fn(decode) -> decode`."""
    _decode_wrap.append(fn)


def decoder(decode: Decode) -> Decode:
    """`decode`, wrapped by whatever `wrap_decode` registered (itself when nothing did)."""
    for fn in _decode_wrap:
        decode = fn(decode)
    return decode
