"""The arena of the attack suite: one real run in a local folder, its real trainer in this process, and a
real signed-weights follower that honest and hostile producers generate from.

    arena = Arena(root)                        # creates the run: the trainer publishes v0 (signed)
    arena.upload(HonestWorker("h1").produce(arena, 4) + CopierWorker("x").produce(arena, 2))
    arena.step()                               # the trainer's own step: select (ingestion checks), train, publish
    arena.verdict(key)                         # "trained", a drop reason ("id_theft", ...), or "waiting"

Nothing here judges a group: every verdict is read from the trainer itself: the drop reasons and use
counts of its ingestion cursor (`pnyx.train.ingest_state.Cursor`), and the groups its step removed from the
update before the optimizer step (`StepStats.rejected`: they are consumed, never trained on). So whatever
checks the trainer runs, at ingestion or in the step, are what the suite measures. A verdict is frozen the first time the trainer reaches one, so
keys later swept from the cursor (their version left the window) keep theirs; a group never judged stays
"waiting" (or "stale" once the trainer counted it stale).

The follower is what a worker runs: a `Syncer` pinned to the run's trainer key and a torch engine updated
from the verified bits (the bf16 cast the trainer publishes), so producers sample exactly what a real
worker would. Knows nothing about particular attacks (`attacks.py`). CPU only, one thread of torch by
default; imports torch and the trainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pnyx.protocol import layout
from pnyx.security.signing import Signer

log = logging.getLogger("pnyx_harness.arena")

BENIGN = frozenset({"zero_variance", "stale", "skipped"})
"""Drop reasons that say nothing about honesty: a group every sample of which got the same reward, one
whose version left the window before a step took it, and a skip record that passed its audit. An honest
group dropped for any other reason is a false positive."""
TRAINED = "trained"
WAITING = "waiting"


@dataclass
class Upload:
    """One object a producer put in the run, and what the suite needs to know about it."""

    key: str
    data: bytes
    source: str
    """"honest", or the name of the attack that made it."""
    signer: str = ""
    """Fingerprint of the key that signed it ("" for unsigned)."""
    index: int = 1
    """1-based: this is the index-th group this key uploaded (detection against groups seen)."""
    tokens: int = 0
    """Model tokens (loss mask 1) over the group's samples (detection against completion length)."""
    payload: bool = False
    """The group carries the poisoner's payload."""


def default_overrides(model_path: str | None = None) -> dict[str, Any]:
    """The arena's run: the default task (arith) and model (the shipped tiny one) on CPU; no periodic
    checkpoints (the arena never restarts); a short wait for a full batch (a step that cannot fill its
    batch says so within seconds instead of the trainer's 10 minutes)."""
    from pnyx.config import shipped_model_path

    return {
        "model": {"path": str(model_path or shipped_model_path())},
        "env": {"name": "arith"},
        "run": {"steps": 100_000},
        "trainer": {"device": "cpu", "checkpoint_every": 100_000, "max_wait_s": 20.0},
    }


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


@dataclass
class Arena:
    """A run, its in-process trainer, and a follower of its signed weights (see the module docstring)."""

    root: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config overrides on top of `default_overrides()` (sections of the pnyx config)."""

    def __post_init__(self) -> None:
        import torch

        from pnyx.config import load_config
        from pnyx.models import load_tokenizer
        from pnyx.rollout.engines import make_engine
        from pnyx.store import open_store
        from pnyx.train.loop import Trainer
        from pnyx.weights.syncer import Syncer

        torch.set_num_threads(int(os.environ.get("PNYX_ARENA_THREADS", "1")))
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        cfg = load_config(None, _merge(default_overrides(), self.overrides))
        self.trainer = Trainer(cfg, open_store(str(self.root / "run")))
        self.trainer.start()
        self.cfg = self.trainer.cfg
        self.store = self.trainer.store
        self.run_id: str = self.trainer.run_id
        self.env = self.trainer.parts.env
        self.tokenizer = self.trainer.parts.tokenizer
        self.trust = self.trainer.trust
        self.syncer = Syncer(self.store, trust=self.trust, backoff_s=0)
        path = self.trainer.parts.model_info["path"]
        self.tokenizer = load_tokenizer(path)
        self.engine = make_engine("torch", path, self.tokenizer, dtype=self.cfg.model.dtype, device="cpu")
        self.version = -1
        self.digest = ""
        self.uploads: list[Upload] = []
        self.verdicts: dict[str, str] = {}
        self.served: list[tuple[int, str]] = []
        """(version, chain digest) of every version the follower served, in order."""
        self.refusals: list[tuple[str, int, str, int | None]] = []
        """(worker, first seq, why, the next free seq it named) of every commitment the trainer's tick
        refused (committed draws)."""
        self.follow()

    # --- the worker side ----------------------------------------------------------------------------

    def follow(self) -> int:
        """Sync the follower to the newest version the trainer's key signed and load it into the engine;
        returns that version."""
        version, _ = self.syncer.sync()
        if version != self.version:
            proof = self.engine.update(version, self.syncer.state, self.syncer.manifest)
            self.version, self.digest = version, proof.chain_digest
            self.served.append((version, self.digest))
        return self.version

    def sample(
        self,
        tasks: list[Any],
        seed: int,
        temperature: float | None = None,
        *,
        key: str = "",
        worker_id: str = "arena",
        next_seq: Callable[[], int] | None = None,
        signer: Signer | None = None,
        skip_to: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """One group per task from the follower's engine at the served version, with the run's sampling
        settings (`temperature` overrides the one used to sample; the group records what was used). With
        `key` (a signer's fingerprint), the groups are drawn from the seeded draws of (`key`, `worker_id`,
        the seqs `next_seq` gives), as a worker with that key and name draws them. Under committed draws
        (`security.committed_draws`) the `signer` (key `key`) first commits to the seqs and tasks, the
        trainer ticks, and the groups are drawn with the tick's beacon: `commit_and_tick`; a refused
        commitment is drawn anyway (what an attacker does), unless `skip_to` is given: then, as
        `pnyx worker` does, the numbering moves to the next free seq it names and commits again."""
        from dataclasses import replace

        from pnyx.rollout.cohort import CohortSpec, generate_cohort

        w = self.cfg.worker
        spec = CohortSpec(
            run_id=self.run_id, worker_id=worker_id, version=self.version, digest=self.digest,
            group_size=w.group_size, temperature=w.temperature if temperature is None else temperature,
            top_p=w.top_p, top_k=w.top_k, max_new_tokens=int(w.max_new_tokens or 64), seed=seed, key=key,
        )  # fmt: skip
        numbering = next_seq or (lambda: 0)
        if self.cfg.security.committed_draws and signer is not None and key:
            while True:
                seqs = [numbering() for _ in tasks]
                refused = len(self.refusals)
                drawn = self.commit_and_tick(signer, worker_id, seqs, [t.id for t in tasks])
                nxt = self.refusals[-1][3] if len(self.refusals) > refused else None
                if skip_to is None or nxt is None:
                    break
                skip_to(nxt)
            spec = replace(spec, tick=drawn.n, beacon=drawn.beacon, commit=drawn.key)
            numbering = iter(seqs).__next__
        return generate_cohort(self.engine, self.tokenizer, self.env, tasks, spec, numbering).groups

    def commit_and_tick(self, signer: Signer, worker_id: str, seqs: list[int], task_ids: list[str]) -> Any:
        """Commit `signer`'s `worker_id` to `seqs` and `task_ids` at the served version, then tick the
        trainer's beacon at once (a real trainer ticks on its own thread). Returns the tick's `Drawn`; for a
        refused commitment too (its beacon and key, as an attacker that draws anyway would use them), with
        the refusal in `self.refusals`."""
        from pnyx.rollout.committer import Committer, Drawn

        ticker = self.trainer.parts.ticker
        assert ticker is not None and self.trust is not None  # committed draws: the trainer attached one
        committer = Committer(self.store, signer, self.run_id, worker_id, self.trust.fingerprint)
        ticket = committer.commit(self.version, seqs, task_ids, n=ticker.next_n)
        tick = ticker.tick()
        assert tick is not None and tick.n == ticket.n, (tick, ticket)
        got = committer.outcome(ticket, tick)
        if not isinstance(got, Drawn):
            self.refusals.append((worker_id, seqs[0], str(got), getattr(got, "next_seq", None)))
        return Drawn(n=tick.n, beacon=tick.beacon, key=ticket.key)

    def own_logprobs(self, prompt: list[int], completions: list[list[int]]) -> list[list[float]]:
        """Per-token logprobs of each completion under the follower's model at the run's sampling settings:
        what an honest worker would have claimed for these tokens."""
        import torch

        from pnyx.models.logprobs import completion_logprobs

        w = self.cfg.worker
        model = getattr(self.engine, "model", None)
        if model is None:
            raise TypeError(f"engine {type(self.engine).__name__} exposes no torch model")
        with torch.no_grad():
            lp, _, _ = completion_logprobs(
                model, [prompt] * len(completions), completions, w.temperature, w.top_k, w.top_p
            )
        return [[float(x) for x in lp[i, : len(c)]] for i, c in enumerate(completions)]

    # --- the trainer side ---------------------------------------------------------------------------

    def upload(self, uploads: list[Upload]) -> None:
        """Put each upload create-only (as workers do) and remember it for its verdict."""
        for u in uploads:
            self.store.put(u.key, u.data, mode="create")
            self.uploads.append(u)

    def step(self) -> Any:
        """One real trainer step (its selection runs every ingestion check), then what the trainer loop does
        after a step: list and fetch the whole window (the supply poll). Records verdicts; the follower
        then syncs to the new version. Returns the trainer's StepResult (None: no full batch in time)."""
        result = self.trainer.step()
        if result is not None:  # groups the step's checks removed from its update (consumed, not trained)
            for key, reason in result.stats.rejected.items():
                self.verdicts.setdefault(key, reason)
        self.trainer.parts.ingestor.poll(self.trainer.version)
        self.judge()
        self.follow()
        return result

    def poll(self) -> None:
        """Ingestion only (no step): list and fetch every waiting key, then record verdicts."""
        self.trainer.parts.ingestor.poll(self.trainer.version)
        self.judge()

    def judge(self) -> None:
        """Freeze the verdict of every upload the trainer has reached a decision on."""
        ing = self.trainer.parts.ingestor
        assert ing is not None  # the trainer started
        with ing.shared.lock:
            rejected = dict(ing.cursor.rejected)
            uses = dict(ing.cursor.uses)
        for u in self.uploads:
            if u.key in self.verdicts:
                continue
            if u.key in rejected:
                self.verdicts[u.key] = rejected[u.key]
            elif uses.get(u.key, 0) > 0:
                self.verdicts[u.key] = TRAINED
            elif ing.cursor.swept_below > (layout.parse_rollout_key(u.key) or (1 << 40,))[0]:
                self.verdicts[u.key] = "stale"

    def verdict(self, key: str) -> str:
        return self.verdicts.get(key, WAITING)

    def tally(self, source: str, skips: bool = True) -> dict[str, int]:
        """Verdict counts of the uploads of `source` ("honest" or an attack name); without `skips`, of its
        groups only (not its skip records)."""
        out: dict[str, int] = {}
        for u in self.uploads:
            if u.source == source and (skips or not layout.is_skip_key(u.key)):
                v = self.verdict(u.key)
                out[v] = out.get(v, 0) + 1
        return out

    def evaluate(self, tasks: int = 200, seed: int = 0, examples: int = 0) -> Any:
        """Held-out pass@1 of the trainer's current weights (the env's test split, one sample per task at
        the run's temperature): `pnyx.eval.runner.evaluate_model` with the torch engine over the trainer's
        own model."""
        from pnyx.eval.runner import evaluate_model, heldout_tasks
        from pnyx.rollout.engines import make_engine

        model = self.trainer.parts.model
        model.eval()
        try:
            return evaluate_model(
                make_engine("torch", None, self.tokenizer, model=model), self.env,
                heldout_tasks(self.env, tasks, seed),
                temperature=self.cfg.worker.temperature, top_p=self.cfg.worker.top_p,
                top_k=self.cfg.worker.top_k, max_new_tokens=self.cfg.worker.max_new_tokens,
                seed=seed, examples=examples,
            )  # fmt: skip
        finally:
            model.train()

    def close(self) -> None:
        """Stop the trainer's background threads (no checkpoint: the arena is thrown away)."""
        self.trainer.parts.prefetcher.close()
        self.trainer.parts.ingestor.close()
        self.syncer.stop(timeout_s=1.0)
        self.engine.close()
