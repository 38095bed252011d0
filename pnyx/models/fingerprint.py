"""Content digests of model files, with a cache so big models are hashed once per machine.

A model's fingerprint is one xxh3-128 digest per file that defines it (config, generation config, weights,
tokenizer) plus a combined digest over the sorted (name, digest) pairs. Two copies with equal combined
digests hold byte-identical model files, wherever they live. Hashing a 16 GB checkpoint takes tens of
seconds, so the digest of each large file is cached under the pnyx cache folder keyed by (real path, size,
mtime_ns): a file rewritten in place gets a new mtime and is hashed again.

Knows nothing about torch, transformers, the store or RL. The cache is only a cache: a missing or corrupt
cache file is rebuilt, and concurrent writers (a trainer and its workers on one machine) at worst lose an
entry and hash that file again.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tempfile
from pathlib import Path

import xxhash

from pnyx.models.tokenizer import TOKENIZER_FILES

CHUNK = 16 << 20
CACHE_MIN_BYTES = 16 << 20
"""Files smaller than this are hashed every time (faster than a cache lookup and keeps the cache small)."""

CONFIG_FILES = ("config.json", "generation_config.json")
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)


def cache_dir() -> Path:
    """pnyx's own cache folder: $PNYX_CACHE_DIR, else $XDG_CACHE_HOME/pnyx, else ~/.cache/pnyx (read per call)."""
    explicit = os.environ.get("PNYX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pnyx"


def model_files(folder: Path) -> list[str]:
    """Names of the files in `folder` that define the model: config, generation config, weights, tokenizer."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    keep = set(CONFIG_FILES) | set(TOKENIZER_FILES)
    return [n for n in names if n in keep or any(fnmatch.fnmatch(n, pat) for pat in WEIGHT_PATTERNS)]


def combine(files: dict[str, str]) -> str:
    """The combined digest of a {name: file digest} map (order-independent)."""
    h = xxhash.xxh3_128()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def folder_fingerprint(folder: Path) -> tuple[str, dict[str, str]]:
    """(combined digest, {file name: digest}) over `model_files(folder)`."""
    files = {name: file_digest(folder / name) for name in model_files(folder)}
    return combine(files), files


def file_digest(path: Path) -> str:
    """xxh3-128 hex digest of a file's bytes; cached by (real path, size, mtime_ns) for large files."""
    real = Path(os.path.realpath(path))  # hub snapshots are symlinks into blobs/: key on the blob
    st = real.stat()
    if st.st_size < CACHE_MIN_BYTES:
        return _hash_file(real)
    key = str(real)
    cache = _read_cache()
    hit = cache.get(key)
    if isinstance(hit, list) and hit[:2] == [st.st_size, st.st_mtime_ns]:
        return str(hit[2])
    digest = _hash_file(real)
    cache = _read_cache()  # re-read: another process may have added entries while we hashed
    cache[key] = [st.st_size, st.st_mtime_ns, digest]
    _write_cache(cache)
    return digest


def _hash_file(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cache_path() -> Path:
    return cache_dir() / "digests.json"


def _read_cache() -> dict[str, list]:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # absent or torn: rebuild, it is only a cache
    return data if isinstance(data, dict) else {}


def _write_cache(cache: dict[str, list]) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digests-", suffix=".json")
    except OSError:
        return  # a read-only home still works, it just hashes again next time
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(cache, fh)
        os.replace(tmp, path)  # atomic: readers see the old or the new file, never half of one
    except OSError:
        Path(tmp).unlink(missing_ok=True)
