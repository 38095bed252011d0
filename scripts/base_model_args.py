"""The command line of `scripts/make_base_model.py`: every knob of the tiny base model's build, with defaults.

Knows nothing about models or training; `make_base_model.py` reads the parsed arguments.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSET = REPO / "pnyx" / "assets" / "tiny-base"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Build pnyx's shipped tiny base model from scratch (see scripts/make_base_model.py)."
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ASSET)
    p.add_argument("--envs", nargs="+", default=["arith", "searchqa"])
    p.add_argument(
        "--mix",
        type=json.loads,
        default={"arith": 0.8, "searchqa": 0.2},
        help='JSON weights per environment, e.g. \'{"arith": 0.75, "searchqa": 0.25}\'',
    )
    p.add_argument("--p-correct", type=float, default=0.4, help="arith: probability a transcript is correct")
    p.add_argument("--p-format-error", type=float, default=0.05, help="arith: probability of a format error")
    p.add_argument("--p-search", type=float, default=0.25, help="searchqa: probability a transcript searches")
    p.add_argument("--pool", type=int, default=20000, help="training tasks drawn per environment")
    p.add_argument("--vocab", type=int, default=384)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument(
        "--arith-first", type=int, default=700, help="phase 1 starts with this many arith-only steps"
    )
    p.add_argument("--clean-steps", type=int, default=1300, help="phase 1: steps on clean labels")
    p.add_argument("--steps", type=int, default=400, help="phase 2: steps on noisy labels")
    p.add_argument(
        "--phase3",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="phase 3: searchqa copying (--no-phase3 stops after phase 2)",
    )
    p.add_argument(
        "--p3-steps", type=int, nargs="+", default=[800, 400, 400, 400], help="phase 3: steps per cycle"
    )
    p.add_argument("--p3-done-cycles", type=int, default=0, help="phase-3 cycles the --phase2-from model ran")
    p.add_argument("--p3-lr", type=float, default=2e-3, help="phase 3: peak lr (fresh AdamW)")
    p.add_argument("--p3-warmup", type=int, default=30)
    p.add_argument(
        "--p3-arith", type=float, default=0.25, help="phase 3: share of noisy arith replay batches"
    )
    p.add_argument(
        "--p3-copy", type=float, default=0.85, help="phase 3: share of searchqa episodes that search"
    )
    p.add_argument(
        "--p3-search-rate", type=float, default=0.3, help="phase 3: target rate of the <search> tag"
    )
    p.add_argument("--p3-worlds", type=int, default=8, help="phase 3: synthetic worlds (none the default)")
    p.add_argument("--p3-eval-every", type=int, default=200)
    p.add_argument(
        "--phase2-from",
        type=Path,
        default=None,
        help="skip phases 1-2: load the phase-2 model and tokenizer from this folder (the same seed's build)",
    )
    p.add_argument(
        "--adapt-steps", type=int, default=400, help="adaptation to the system prompts: steps (0 skips it)"
    )
    p.add_argument("--adapt-lr", type=float, default=1e-3, help="adaptation: peak lr (fresh AdamW)")
    p.add_argument("--adapt-arith", type=float, default=0.5, help="adaptation: share of noisy arith batches")
    p.add_argument(
        "--adapt-from",
        type=Path,
        default=None,
        help="skip phases 1-3: adapt the model and tokenizer saved in this folder (a previous build)",
    )
    p.add_argument(
        "--source-minutes",
        type=float,
        default=None,
        help="with --adapt-from: minutes phases 1-3 took, when the folder's evaluation.json does not say",
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--probe-tasks", type=int, default=128)
    p.add_argument("--eval-tasks", type=int, default=512)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: bit-reproducible, and fastest on a shared CPU)",
    )
    return p.parse_args(argv)
