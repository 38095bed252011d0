"""The ingestion cursor's per-key books stay bounded however many keys a Sybil invents (issue #25): keys
without standing are evicted oldest first past `KeyLedger.max_new_keys`, their counters summed under
`EVICTED`; keys with standing (groups trained on, quarantined, trusted) are never evicted."""

from __future__ import annotations

from pnyx.envs import get_env
from pnyx.protocol import layout
from pnyx.store import open_store
from pnyx.train.ingest import Ingestor
from pnyx.train.ingest_state import IngestSettings
from pnyx.train.key_ledger import EVICTED, STANDING


def _sybil_group(ing: Ingestor, i: int) -> str:
    """Book what one rejected group of a fresh key books (the name's binding, samples, the drop)."""
    fp, name = f"{i:032x}", f"sybil-{i}"
    with ing.shared.lock:
        ing.cursor.keys[name] = fp
        ing.ledger.bind(name, fp)
        ing.cursor.scored[name] = 8
        ing.ledger.count_key(fp, "scored", 8)
        ing.listing.reject(layout.rollout_key(3, name, 0), "draw_mismatch")
        ing.ledger.count_key(fp, "draw_mismatch")
    return fp


def test_keys_without_standing_are_evicted_and_keys_with_standing_kept():
    ing = Ingestor(open_store("memory://"), get_env("arith"), detokenize=lambda ids: "",
                   settings=IngestSettings(trusted_keys=frozenset({"t" * 32})))  # fmt: skip
    ing.ledger.max_new_keys = 50
    with ing.shared.lock:
        ing.cursor.keys["honest"] = "h" * 32
        ing.ledger.count_key("h" * 32, "groups", STANDING)  # trained on: standing
        ing.ledger.count_key("t" * 32, "scored", 8)  # trusted: standing
        ing.ledger.quarantine("q" * 32, "a test")
        ing.ledger.count_key("q" * 32, "draw_mismatch")  # quarantined: standing
    fps = [_sybil_group(ing, i) for i in range(1000)]
    by_key = ing.cursor.by_key
    assert len(by_key) <= 50 + 3 + 1  # the cap, the three keys with standing, the aggregate
    assert by_key["h" * 32]["groups"] == STANDING and "t" * 32 in by_key and "q" * 32 in by_key
    assert ing.cursor.keys["honest"] == "h" * 32
    kept = [fp for fp in fps if fp in by_key]
    assert kept == fps[-len(kept) :]  # the newest are kept, the oldest evicted
    evicted = by_key[EVICTED]
    assert evicted["keys"] == 1000 - len(kept) == ing.ledger.evicted
    assert evicted["draw_mismatch"] == evicted["keys"] and evicted["scored"] == 8 * evicted["keys"]
    assert len(ing.cursor.keys) == len(kept) + 1 and len(ing.cursor.scored) == len(kept)
    # a cursor with evicted keys round-trips through a checkpoint
    from pnyx.train.ingest_state import Cursor

    assert Cursor.from_json(ing.cursor.to_json()).by_key[EVICTED] == evicted
