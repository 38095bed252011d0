"""pnyx's object-store plane: one small API over obstore (local folder, memory, S3/R2/MinIO, GCS).

    from pnyx.store import open_store, IfMatch
    store = open_store("runs/demo")          # or memory://, s3://bucket/prefix?endpoint=..., gs://...
    store.put("run.json", data, mode="create")

Knows nothing about models, RL or the run layout (keys come from `pnyx.protocol.layout`).
Importing this package does not import obstore until a store is opened.
"""

from pnyx.store.base import IfMatch, ObjectMeta, PutMode, PutResult, Store
from pnyx.store.retry import RetryPolicy
from pnyx.store.url import SUPPORTED_SCHEMES, open_store, redact_url

__all__ = [
    "IfMatch",
    "ObjectMeta",
    "PutMode",
    "PutResult",
    "RetryPolicy",
    "SUPPORTED_SCHEMES",
    "Store",
    "open_store",
    "redact_url",
]
