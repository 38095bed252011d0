"""Reading a run's `run.json` (`records.RunManifest`) from its store: what every role joins by.

Written once, create-only, by the trainer (`pnyx.train.bootstrap.init_run`). Knows nothing about training.
"""

from __future__ import annotations

from pnyx.errors import NotFoundError
from pnyx.protocol import layout
from pnyx.protocol.codec import decode_json
from pnyx.protocol.records import RunManifest
from pnyx.store import Store


def read_run(store: Store) -> RunManifest | None:
    """The run's manifest, or None if the run has none yet."""
    try:
        return decode_json(store.get(layout.RUN_MANIFEST), RunManifest)
    except NotFoundError:
        return None
