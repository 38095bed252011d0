"""Ingestion state under a Sybil: what the trainer keeps per fresh key (issue #25: "ingestion memory with
100,000 Sybil keys").

A Sybil signs every group with a fresh key under a fresh worker name. Each such group that the trainer
downloads binds the name to the key, and its drop is booked against the key and the name, in the ingestion
cursor that every checkpoint persists. This replays, for N fresh keys, exactly the bookkeeping calls
`Ingestor._admit` and `Ingestor.load` make for one rejected seeded group (the name's binding, the samples
scored, the drop reason against the key, the rejection of its object key, its name's seq book), through the real `Ingestor`,
`KeyLedger` and `WindowListings` (`--per-version` groups per policy version; a rejected object key is
forgotten once its version leaves the staleness window, as the trainer's sweep does), and measures the Python heap they hold (tracemalloc) and the cursor's
JSON size, at several N in one process (keys without standing are evicted past `KeyLedger.max_new_keys`,
10,000; `--max-new-keys 1000000` shows the books without eviction). The signature check and the draw check's forward are left out: they
cost time per group, not state.

    python benchmarks/bench_sybil_keys.py                              # N = 1,000, 10,000, 100,000
    python benchmarks/bench_sybil_keys.py --max-new-keys 1000000       # the same without eviction
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--keys", default="1000,10000,100000")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--per-version", type=int, default=1000, help="Sybil groups uploaded per policy version")
    p.add_argument("--window", type=int, default=4, help="versions a rejected key stays in the cursor")
    p.add_argument("--max-new-keys", type=int, default=None, help="KeyLedger.max_new_keys (default: pnyx's)")
    args = p.parse_args()

    import hashlib

    from pnyx.envs import get_env
    from pnyx.protocol import layout
    from pnyx.store import open_store
    from pnyx.train import seq_books
    from pnyx.train.ingest import Ingestor

    print(
        f"{'keys':>8} {'heap MB':>8} {'bytes/key':>9} {'cursor JSON MB':>14} {'cursor B/key':>12} {'us/key':>7}"
    )
    for n in (int(x) for x in args.keys.split(",")):
        gc.collect()
        tracemalloc.start()
        ing = Ingestor(open_store("memory://"), get_env("arith"), detokenize=lambda ids: "")
        if args.max_new_keys is not None:
            ing.ledger.max_new_keys = args.max_new_keys
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        window: dict[int, list[str]] = {}
        for i in range(n):
            fp = hashlib.sha256(i.to_bytes(8, "big")).hexdigest()[:32]
            name = f"sybil-{fp[:12]}"
            version = i // args.per_version
            key = layout.rollout_key(version, name, 0)
            window.setdefault(version, []).append(key)
            for old in [v for v in window if v < version - args.window]:  # what the sweep forgets
                for k in window.pop(old):
                    ing.cursor.rejected.pop(k, None)
            with ing.shared.lock:  # what one rejected group of a fresh key books (`_merge`, `_admit`, `load`)
                seq_books.note(ing.cursor.seqs, name, 0, ing.cursor.seq_start)  # listed: its name's seq book
                seq_books.verify(ing.cursor.seqs, name, 0, True, ing.cursor.seq_start)  # read: signed, seeded
                ing.cursor.keys[name] = fp
                ing.ledger.bind(name, fp)
                ing.cursor.scored[name] = ing.cursor.scored.get(name, 0) + args.group_size
                ing.ledger.count_key(fp, "scored", args.group_size)
                ing.listing.reject(key, "draw_mismatch")
                ing.ledger.count_key(fp, "draw_mismatch")
        dt = time.perf_counter() - t0
        heap = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        size = len(ing.cursor_json())
        print(
            f"{n:>8} {heap / 1e6:>8.1f} {heap / n:>9.0f} {size / 1e6:>14.2f} {size / n:>12.0f} {1e6 * dt / n:>7.1f}",
            flush=True,
        )
        ing.close()
        del ing


if __name__ == "__main__":
    main()
