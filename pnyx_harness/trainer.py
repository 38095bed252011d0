"""`python -m pnyx_harness.trainer [--crash-at POINT:N[@RANK]] [--ingest-delay-s X] ARGS`: `pnyx trainer ARGS`
(`--store URL [--config FILE] [--resume] [--steps N] [--section.field=value ...]`) under test hooks.

- `--crash-at POINT:N[@RANK]` SIGKILLs the process (only rank RANK under torchrun, when given) at the named
  point POINT of the step that produces version N (`pnyx.train.hooks`: `after_step`, `before_manifest`,
  `after_publish`, `during_checkpoint`): the kill tests' trainer;
- `--ingest-delay-s X` makes every group fetch sleep X seconds first (the liveness tests hold the trainer
  in ingestion with it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from pnyx.protocol.records import RolloutGroup
from pnyx.train import hooks

log = logging.getLogger("pnyx.train")


def crash_at(want: str) -> hooks.Point:
    """A point hook that SIGKILLs this process at `want` (`POINT:N[@RANK]`)."""
    at, _, rank = want.partition("@")

    def hook(name: str, version: int) -> None:
        if at == f"{name}:{version}" and (not rank or rank == os.environ.get("RANK", "0")):
            log.warning("test hook --crash-at %s: SIGKILL", want)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def slow(delay_s: float):
    """A decoder wrapper: sleep `delay_s`, then decode as usual."""

    def wrap(decode: hooks.Decode) -> hooks.Decode:
        def slowed(data: bytes, vocab_size: int | None) -> RolloutGroup:
            time.sleep(delay_s)
            return decode(data, vocab_size)

        return slowed

    return wrap


def main(argv: list[str]) -> None:
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--crash-at":
            hooks.on_point(crash_at(next(it)))
        elif arg == "--ingest-delay-s":
            hooks.wrap_decode(slow(float(next(it))))
        else:
            rest.append(arg)
    from pnyx.cli import app

    app(args=["trainer", *rest], prog_name="pnyx")


if __name__ == "__main__":
    main(sys.argv[1:])
