"""Sharded checkpoints: torch.distributed.checkpoint (DCP) to local disk, then uploaded to the run's store.

A checkpoint of version V is the folder `trainer/ckpt-{V:08d}/` in the store:

    r{rank:05d}-{j:03d}.p{i:05d}   the DCP files each rank wrote, in parts of at most PART_BYTES
    rank-{rank:05d}.json           written by each rank once its own parts are uploaded
    COMMIT.json                    written last, by rank 0, once every rank's record is there

Saving: every rank stages its shards of the model and of the AdamW state (`get_state_dict`, FQN keys, so
any number of ranks can load them: DCP reshards) and `dcp.async_save` writes them to a local folder from a
background thread while training continues; the same thread then uploads this rank's files and its record,
and rank 0 commits. Only `COMMIT.json` makes a checkpoint exist, so a process killed anywhere in between
leaves a folder that is ignored and later deleted; the previous checkpoint and the batch records (replay)
cover the gap. The loop is blocked only for staging, and for a previous checkpoint still uploading.

Retention keeps the newest `keep` committed checkpoints, and deletes
uncommitted folders older than the newest committed one (abandoned by a crash). Knows nothing about the
training loop's policy; imports torch only inside the functions that need it.
"""

from __future__ import annotations

import base64
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash

from pnyx.errors import IntegrityError, NotFoundError, PeerFailedError
from pnyx.protocol import layout
from pnyx.store import Store
from pnyx.store.retry import Backoff, wait_for

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from pnyx.train.distributed import Dist

log = logging.getLogger("pnyx.train")

FORMAT = 2
PART_BYTES = 256 << 20
COMMIT = "COMMIT.json"
COMMIT_WAIT_S = 900.0
"""How long rank 0 waits for the other ranks' records before giving up on a checkpoint (not committed)."""


def folder(version: int) -> str:
    return f"ckpt-{version:08d}"


def _key(version: int, name: str) -> str:
    return layout.trainer_folder_key(folder(version), name)


class Part(msgspec.Struct):
    name: str
    size: int
    digest: str


class FileEntry(msgspec.Struct):
    """One local DCP file, stored as one or more parts."""

    path: str  # the file's name inside the DCP folder (`__0_0.distcp`, `.metadata`)
    parts: list[Part]


class RankRecord(msgspec.Struct):
    rank: int
    files: list[FileEntry]


class Commit(msgspec.Struct):
    """The checkpoint's table of contents and the small state that is not in DCP."""

    format: int
    version: int
    world: int
    run_id: str
    files: list[FileEntry]
    cursor: str  # the ingestion cursor (JSON)
    rng: dict[str, str]
    saved_at: float


@dataclass(frozen=True)
class Stored:
    """A checkpoint version found in the store."""

    version: int
    committed: bool


def list_checkpoints(store: Store) -> list[Stored]:
    """Every checkpoint (DCP folder) in the store, ascending."""
    found: dict[int, bool] = {}
    for meta in store.list(layout.TRAINER_PREFIX + "ckpt-"):
        rest = meta.key[len(layout.TRAINER_PREFIX) + len("ckpt-") :]
        digits, sep, tail = rest[:8], rest[8:9], rest[9:]
        if len(digits) != 8 or not digits.isdigit():
            continue
        v = int(digits)
        if sep == "/":
            found[v] = found.get(v, False) or tail == COMMIT
    return [Stored(v, c) for v, c in sorted(found.items())]


def committed(store: Store) -> list[Stored]:
    return [s for s in list_checkpoints(store) if s.committed]


def read_commit(store: Store, version: int) -> Commit:
    try:
        return msgspec.json.decode(store.get(_key(version, COMMIT)), type=Commit)
    except msgspec.DecodeError as e:
        raise IntegrityError(f"{_key(version, COMMIT)} does not decode: {e}") from e


def capture_rng() -> dict[str, str]:
    import torch

    rng = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": repr(random.getstate()),
    }
    if torch.cuda.is_available():
        rng["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return rng


def restore_rng(rng: dict[str, str]) -> None:
    import ast

    import torch

    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
    random.setstate(ast.literal_eval(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(rng["cuda"])), dtype=torch.uint8)
        )


def prune(store: Store, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed checkpoints, and uncommitted DCP folders older than the
    newest committed one. COMMIT.json goes first, so a half-deleted checkpoint is never taken for one."""
    stored = list_checkpoints(store)
    done = [s for s in stored if s.committed]
    if not done:
        return []
    newest = done[-1].version
    doomed = done[:-keep] + [s for s in stored if not s.committed and s.version < newest]
    for s in doomed:
        keys = [m.key for m in store.list(layout.TRAINER_PREFIX + folder(s.version) + "/")]
        for k in sorted(keys, key=lambda k: not k.endswith("/" + COMMIT)):
            store.delete(k)
    return sorted({s.version for s in doomed})


def local_folder(configured: str | None, store_url: str) -> Path:
    """The local folder of checkpoint shards: the configured one, else one per run in the temp directory."""
    if configured:
        return Path(configured).expanduser()
    import tempfile

    return Path(tempfile.gettempdir()) / "pnyx-ckpt" / xxhash.xxh3_64_hexdigest(store_url.encode())


def _remove_if_empty(path: Path) -> None:
    """Remove a folder (and the per-run folder above it) once no rank has files left in it."""
    for p in (path, path.parent):
        try:
            p.rmdir()
        except OSError:  # not empty (another rank still uploading, another run) or already gone
            return


class Checkpointer:
    """Writes and reads the DCP checkpoints of one trainer (every rank has one; they act together).

    d: the trainer's `distributed.Dist`; local_root: a local folder for DCP files (node-local disk);
    keep: committed checkpoints retained; asynchronous: `dcp.async_save` (else `dcp.save`, then upload,
    before returning); hook: called as `hook("during_checkpoint", version)` after this rank's shards are
    uploaded, before its record (so before any commit: the kill-test hook).
    """

    def __init__(
        self,
        store: Store,
        d: Dist,
        local_root: Path,
        keep: int = 2,
        asynchronous: bool = True,
        hook: Callable[[str, int], None] | None = None,
        frozen_base: bool = False,
    ):
        self.store, self.d, self.local_root, self.keep = store, d, Path(local_root), keep
        self.asynchronous = asynchronous
        self.hook = hook
        self.frozen_base = frozen_base
        """A LoRA run: the frozen base is not saved (it is the run's model, loaded at every start); only the
        trained parameters and their optimizer state are."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_committed: int | None = None

    # --- saving ----------------------------------------------------------------------------------------

    def save(
        self,
        version: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cursor_json: str,
        run_id: str,
    ) -> float:
        """Checkpoint `version` (every rank calls this together). Returns the seconds the caller was blocked."""
        import torch.distributed.checkpoint.state_dict_saver as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from pnyx.train.distributed import quiet_dcp_warnings

        t0 = time.perf_counter()
        self.wait()
        quiet_dcp_warnings()
        local = self.local_root / folder(version)
        if self.d.local_rank == 0 and self.local_root.is_dir():
            for stale in self.local_root.glob("ckpt-*"):  # leftovers of a killed process (none is in flight)
                shutil.rmtree(stale, ignore_errors=True)
        self.d.barrier()  # ... gone before any rank of this node writes into it
        msd, osd = get_state_dict(model, optimizer, options=self._options())
        msd = self._trained(model, msd)
        commit = Commit(FORMAT, version, self.d.world, run_id, [], cursor_json, capture_rng(), time.time())
        group = self.d.checkpoints
        if self.asynchronous:
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(local), process_group=group)
            self._thread = threading.Thread(
                target=self._finish, args=(local, fut, commit), name="pnyx-checkpoint", daemon=True
            )
            self._thread.start()
        else:
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(local), process_group=group)
            self._finish(local, None, commit)
            self.wait()
        return time.perf_counter() - t0

    def _options(self) -> StateDictOptions | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.frozen_base else None

    def _trained(self, model: torch.nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
        """With a frozen base, only the trained parameters' entries (`ignore_frozen_params` still lists a
        head tied to the frozen embedding)."""
        if not self.frozen_base:
            return msd
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        return {k: v for k, v in msd.items() if k in trained}

    def wait(self) -> None:
        """Block until the checkpoint in flight is committed (or failed: its error is raised here)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _finish(self, local: Path, fut: Future[object] | None, commit: Commit) -> None:
        """Background half of a save: wait for DCP, upload this rank's files, record, commit (rank 0)."""
        try:
            t0 = time.perf_counter()
            if fut is not None:
                fut.result()
            v, rank = commit.version, self.d.rank
            files = self._upload(v, local)
            if self.hook is not None:
                self.hook("during_checkpoint", v)
            self.store.put(_key(v, f"rank-{rank:05d}.json"), msgspec.json.encode(RankRecord(rank, files)))
            for f in files:  # ranks of one node share the folder: each removes only its own files
                (local / f.path).unlink(missing_ok=True)
            if self.d.is_main:
                commit.files = self._collect(v)
                self.store.put(_key(v, COMMIT), msgspec.json.encode(commit))
                self.last_committed = v
                pruned = prune(self.store, self.keep)
                size = sum(p.size for f in commit.files for p in f.parts)
                log.info(
                    "trainer checkpoint v=%d committed: %d ranks, %.1f MB in %.2fs after the step%s",
                    v, commit.world, size / 1e6, time.perf_counter() - t0,
                    f" (pruned {pruned})" if pruned else "",
                )  # fmt: skip
            _remove_if_empty(local)
        except BaseException as e:  # re-raised into the loop by wait()
            self._error = e

    def _upload(self, version: int, local: Path) -> list[FileEntry]:
        mine = sorted(p for p in local.iterdir() if p.name.startswith(f"__{self.d.rank}_"))
        if self.d.is_main:
            mine += [local / ".metadata"]
        out = []
        for j, path in enumerate(mine):
            parts = []
            with open(path, "rb") as f:
                i = 0
                while True:
                    data = f.read(PART_BYTES)
                    if not data and i > 0:
                        break
                    name = f"r{self.d.rank:05d}-{j:03d}.p{i:05d}"
                    self.store.put(_key(version, name), data)
                    parts.append(Part(name, len(data), xxhash.xxh3_128_hexdigest(data)))
                    i += 1
                    if len(data) < PART_BYTES:
                        break
            out.append(FileEntry(path.name, parts))
        return out

    def _collect(self, version: int) -> list[FileEntry]:
        """Rank 0: every rank's file list, waiting (with backoff, under a deadline) for their records."""
        records: dict[int, RankRecord] = {}

        def attempt() -> dict[int, RankRecord] | None:
            for r in range(self.d.world):
                if r not in records:
                    try:
                        records[r] = msgspec.json.decode(
                            self.store.get(_key(version, f"rank-{r:05d}.json")), type=RankRecord
                        )
                    except NotFoundError:
                        continue
            return records if len(records) == self.d.world else None

        if wait_for(attempt, COMMIT_WAIT_S, Backoff.polling(cap_s=2.0, base_s=0.1)) is None:
            missing = sorted(set(range(self.d.world)) - set(records))
            raise PeerFailedError(f"checkpoint v{version}: ranks {missing} never uploaded their shards")
        return [f for r in range(self.d.world) for f in records[r].files]

    # --- loading -----------------------------------------------------------------------------------------

    def load(self, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Commit:
        """Load checkpoint `version` into `model` and `optimizer` (every rank calls this together), with any
        number of ranks: DCP reshards. Returns the commit (cursor, RNG, run id)."""
        import torch.distributed.checkpoint.state_dict_loader as dcp_load
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from pnyx.train.distributed import quiet_dcp_warnings

        quiet_dcp_warnings()
        self.d.barrier()  # a rank's own wait() returns before rank 0 has committed: read COMMIT after all
        commit = read_commit(self.store, version)
        if commit.format != FORMAT or commit.version != version:
            raise IntegrityError(
                f"{_key(version, COMMIT)} has format {commit.format} / version {commit.version}; "
                f"expected format {FORMAT}, version {version}: upgrade pnyx"
            )
        local = self.local_root / f"load-{version:08d}"
        if self.d.local_rank == 0:
            self._download(commit, local)
        self.d.barrier()
        options = self._options()
        msd, osd = get_state_dict(model, optimizer, options=options)
        state = {"model": self._trained(model, msd), "optim": osd}
        dcp_load.load(state, checkpoint_id=str(local), process_group=self.d.checkpoints)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        self.d.barrier()
        if self.d.local_rank == 0:
            shutil.rmtree(local, ignore_errors=True)
        self.last_committed = version
        return commit

    def _download(self, commit: Commit, local: Path) -> None:
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        for entry in commit.files:
            if os.sep in entry.path or entry.path in ("", ".", ".."):
                raise IntegrityError(f"checkpoint v{commit.version} names a bad file {entry.path!r}")
            with open(local / entry.path, "wb") as f:
                for part in entry.parts:
                    data = self.store.get(_key(commit.version, part.name))
                    if len(data) != part.size or xxhash.xxh3_128_hexdigest(data) != part.digest:
                        raise IntegrityError(
                            f"checkpoint v{commit.version}: {part.name} does not match its commit (corrupt)"
                        )
                    f.write(data)
