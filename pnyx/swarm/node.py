"""The SAPO node loop: generate → share → refresh the pool → sample the mix → re-tokenize/re-score → step.

A swarm node is worker and trainer of its own policy (SAPO, arXiv 2509.08721). Each round it generates
I = `swarm.local_groups` groups of G completions on its own tasks, uploads them as text, pulls the recent
uploads of live peers (validated, re-scored by its own verifier), draws J = `swarm.external_groups` of
them, and takes one optimizer step on the I + J groups with the trainer's own step function and loss
(`pnyx.train.step.train_step`; decoupled PPO, DPPO gate). Groups whose rewards all agree carry no GRPO
signal and are dropped (counted); a round whose mix has no signal left takes no step, so `version`
counts optimizer steps and `rounds` counts rounds.

Invariants: no round waits for a peer (missing peers only shorten the external part of the mix; only
`swarm.wait_peers` makes the node wait, once, before its first round, under a deadline); a foreign group
trains this node at most once and only with rewards from this node's verifier; every dropped object or
group is counted by reason in `drops`, and nothing a peer writes stops the node (only a record in its own
name at its next key, i.e. a second process running as it, does: ConfigError). Every
`swarm.checkpoint_every` rounds and at a clean stop the node writes its whole state to the store
(`pnyx.swarm.checkpoint`) and, restarted under the same name, resumes from it. Each method is one stage, testable alone; what a round records and which groups its step trains
on are `pnyx.swarm.rounds`. Imports torch at module level: only heavy code imports this module.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from pnyx.config import PnyxConfig, resolve_env_kwargs, resolve_max_new_tokens
from pnyx.envs.base import Environment, stable_hash
from pnyx.errors import AlreadyExistsError, ConfigError, NotFoundError, RecordRejected, StoreError
from pnyx.protocol import layout
from pnyx.protocol.codec import frame_signer
from pnyx.protocol.records import RolloutGroup
from pnyx.protocol.rules import is_zero_variance
from pnyx.security.signing import Signer
from pnyx.store import Store
from pnyx.store.retry import Backoff, wait_for
from pnyx.swarm import foreign
from pnyx.swarm.checkpoint import capture, load_node_checkpoint, node_key, restore, save_node_checkpoint
from pnyx.swarm.foreign import Admission, Candidate, EnvCache, ForeignRows
from pnyx.swarm.records import NodeHeartbeat, SwarmGroup, decode_swarm_group
from pnyx.swarm.rounds import NonFiniteStep, RoundStats, ensure_trainable, refuse_nonfinite, trainable
from pnyx.swarm.sample import Pool, sample_external
from pnyx.swarm.share import (
    MAX_PEERS,
    PeerFeed,
    check_node_name,
    read_heartbeat,
    to_swarm_group,
    upload,
    write_heartbeat,
)
from pnyx.train.advantages import group_advantages
from pnyx.train.ingest import ScoredGroup
from pnyx.train.settings import loss_settings
from pnyx.train.step import make_optimizer, train_step
from pnyx.train.stepstats import StepStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from pnyx.config_sections import AcceptedEnv

log = logging.getLogger("pnyx.swarm")

MAX_TAKEN_SEQS = 64
"""Seqs of its own another writer took first that a node skips for one group before giving up its upload."""


def _model_id(model_dir: Path, model: object) -> str:
    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", "model")
    return f"{model_dir.name}:{arch}"[:256]


class SwarmNode:
    """One SAPO node: its own model, tokenizer and environment, meeting its peers only in `store`."""

    def __init__(
        self,
        store: Store,
        name: str,
        cfg: PnyxConfig,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_dir: str | Path,
        env: Environment,
        accept_envs: Iterable[str | AcceptedEnv] | None = None,
    ):
        from pnyx.models.tokenizer import eos_token_ids, tokenizer_digest
        from pnyx.rollout.engines import make_engine

        self.store, self.name, self.cfg = store, check_node_name(name), cfg
        self.model, self.tokenizer, self.env = model, tokenizer, env
        self.model_dir = Path(model_dir)
        self.model_id = _model_id(self.model_dir, model)
        self.tokenizer_digest = tokenizer_digest(self.model_dir)
        self.eos_ids = set(eos_token_ids(tokenizer, model))
        self.eos_id = tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, int) else None
        # torch over the very model this node trains: each round samples with the weights its last step left
        # (SWARM_UNSUPPORTED refuses another worker.engine)
        self.engine = make_engine("torch", None, tokenizer, model=model)
        self.max_new_tokens = resolve_max_new_tokens(cfg.worker.max_new_tokens, env)
        sw, w = cfg.swarm, cfg.worker
        if accept_envs is None:
            accept_envs = sw.accept_envs or ()
        self.envs = EnvCache(env, resolve_env_kwargs(cfg), accept_envs)
        self.admission = Admission(w.temperature, w.top_p, w.top_k, w.group_size)
        self.max_foreign_tokens = 4 * self.max_new_tokens + 8
        """A foreign completion's cap in our tokens (either path): room for tool text and another tokenizer."""
        recent = sw.recent_per_peer
        self.pool = Pool(sw.window_s, recent)
        self.feed = PeerFeed(
            store, self.name, self._accept, sw.window_s, sw.peer_timeout_s, recent,
            max_peers=max(MAX_PEERS, sw.wait_peers),
        )  # fmt: skip
        self.drops = self.feed.drops  # one counter for every reason, fetch-time and mix-time
        self.settings = loss_settings(cfg)
        t = cfg.trainer
        self.optimizer = make_optimizer(model, t.lr, t.betas, t.weight_decay)
        self.optimizer.register_step_pre_hook(refuse_nonfinite)
        self.rng = random.Random(stable_hash("swarm-sample", cfg.run.seed, self.name))
        self.task_seed = stable_hash("swarm-tasks", cfg.run.seed, self.name) % (2**31)
        self.version = 0
        self.rounds = 0
        self.uploaded = 0
        self.local_trained = 0
        self.external_trained = 0
        self._await_shared = False  # set by run() under swarm.wait_peers; cleared by the first round
        self.peers_seen: set[str] = set()
        self.last_reward = 0.0
        self.resumed_from = -1
        self.checkpoint_round = -1
        self.task_pos = 0
        self.signer = Signer(node_key(self.name))
        """This node's key (on its machine): signs its records and checkpoints; peers bind its name to it."""
        self.seq = self._resume_seq()
        if sw.resume:
            self._restore()

    # --- stage 1: generate ------------------------------------------------------------------------

    def generate(self) -> list[RolloutGroup]:
        """I groups of G completions on this node's next tasks, scored by its verifier, numbered by seq."""
        from pnyx.rollout.cohort import CohortSpec, generate_cohort

        n = self.cfg.swarm.local_groups
        if n == 0:
            return []
        w = self.cfg.worker
        tasks = self.env.sample("train", self.task_seed, n, start=self.task_pos)
        self.task_pos += n
        spec = CohortSpec(
            run_id="swarm",
            worker_id=self.name,
            version=self.version,
            digest=f"{self.name}-v{self.version}",
            group_size=w.group_size,
            temperature=w.temperature,
            top_p=w.top_p,
            top_k=w.top_k,
            max_new_tokens=self.max_new_tokens,
            seed=stable_hash("swarm-gen", self.cfg.run.seed, self.name, self.rounds) % (2**31),
        )
        self.model.eval()
        return generate_cohort(self.engine, self.tokenizer, self.env, tasks, spec, self._next_seq).groups

    # --- stage 2: share ---------------------------------------------------------------------------

    def share(self, groups: list[RolloutGroup]) -> list[str]:
        """Upload each group as text (create-only) and rewrite the heartbeat; store errors are counted."""
        keys = []
        for g in groups:
            key = self._upload(g)
            if key is not None:
                keys.append(key)
                self.uploaded += 1
        self.heartbeat()
        return keys

    def _upload(self, g: RolloutGroup) -> str | None:
        """Upload one group at its seq, or None (counted) if the store refused it.

        Anyone can create keys under our prefix, so a seq taken by an object that is not a record of ours is
        skipped (`seq_taken`) and the group moves to our next seq; a record of ours there (signed by this
        node's key) means another process runs under this name with our key, which only the operator can
        resolve (ConfigError)."""
        sg = to_swarm_group(
            g,
            self.tokenizer,
            self.eos_ids,
            node=self.name,
            model_id=self.model_id,
            tokenizer_digest=self.tokenizer_digest,
            env_kwargs=resolve_env_kwargs(self.cfg),
        )
        taken = 0
        while True:
            try:
                return upload(self.store, sg, self.signer)
            except AlreadyExistsError:
                if self._ours_at(sg.seq):
                    raise ConfigError(
                        f"{layout.swarm_key(self.name, sg.seq)} already exists: another process is running as "
                        f"node {self.name!r}; give every node its own --node name"
                    ) from None
            except StoreError as exc:
                self.drops["upload_failed"] += 1
                log.warning("upload of seq %d failed (%s); the group is trained locally only", g.seq, exc)
                return None
            self.drops["seq_taken"] += 1
            taken += 1
            if taken == MAX_TAKEN_SEQS:
                self.drops["upload_failed"] += 1
                log.warning("%d seqs in a row were taken; seq %d is trained locally only", taken, g.seq)
                return None
            log.warning("%s was taken by another writer; moving on", layout.swarm_key(self.name, sg.seq))
            g.seq = sg.seq = self._next_seq()

    def _ours_at(self, seq: int) -> bool:
        """Whether the object at our `seq` is a valid record of this node signed by its key (another process
        running as us)."""
        try:
            data = self.store.get(layout.swarm_key(self.name, seq))
            return frame_signer(data) == self.signer.public_raw and decode_swarm_group(data).node == self.name
        except (RecordRejected, NotFoundError, StoreError):
            return False

    def heartbeat(self, status: str = "running", detail: str = "") -> None:
        hb = NodeHeartbeat(
            node=self.name,
            model_id=self.model_id,
            tokenizer_digest=self.tokenizer_digest,
            env=self.env.name,
            version=self.version,
            rounds=self.rounds,
            next_seq=self.seq,
            groups=self.uploaded,
            local_trained=self.local_trained,
            external_trained=self.external_trained,
            peers=sorted(self.feed.peers)[:64],
            peers_seen=len(self.peers_seen),
            reward=self.last_reward,
            resumed_from=self.resumed_from,
            checkpoint_round=self.checkpoint_round,
            updated_at=time.time(),
            status=status,
            detail=detail[:512],
        )
        try:
            write_heartbeat(self.store, hb)
        except StoreError as exc:
            self.drops["heartbeat_failed"] += 1
            log.warning("heartbeat failed: %s", exc)

    # --- stage 3: refresh the pool ------------------------------------------------------------------

    def _accept(self, key: str, peer: str, group: SwarmGroup, uploaded: float) -> Candidate:
        return foreign.make_candidate(key, peer, group, self.envs, self.admission, uploaded)

    def refresh(self) -> int:
        """Pull live peers' recent uploads into the pool; returns how many new candidates arrived."""
        try:
            new = self.feed.refresh()
        except StoreError as exc:
            self.drops["store_error"] += 1
            log.warning("refresh failed (%s); training on what the pool holds", exc)
            new = []
        copies = self.pool.add(new)
        if copies:
            self.drops["duplicate_content"] += copies
        self.pool.prune(self.feed.now)
        self.peers_seen.update(self.feed.peers)
        return len(new)

    # --- stage 4: sample the mix --------------------------------------------------------------------

    def sample_mix(self) -> list[Candidate]:
        """Draw J external candidates from the pool (fewer if the pool is short) and mark them used."""
        sw = self.cfg.swarm
        picked = sample_external(
            self.pool.candidates(), sw.external_groups, sw.prefer, sw.max_per_peer, self.rng
        )
        self.pool.take(picked)
        if len(picked) < sw.external_groups:
            self.drops["short_external"] += sw.external_groups - len(picked)
        return picked

    # --- stage 5: re-tokenize, re-score, behaviour --------------------------------------------------

    def local_scored(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        """Local groups as training groups (their rewards come from this node's verifier already)."""
        out = []
        for g in groups:
            rewards = [float(s.reward) for s in g.samples]
            adv = group_advantages(rewards, self.cfg.algorithm.advantage)
            key = layout.swarm_key(self.name, g.seq)
            out.append(ScoredGroup(key, self.version, self.name, g.task_id, g, rewards, adv, rewards))
        return out

    def prepare_external(self, cands: list[Candidate]) -> tuple[list[ScoredGroup], Counter]:
        """Foreign candidates in this node's token space with behaviour logprobs per `swarm.foreign`."""
        mode = self.cfg.swarm.foreign
        rows: list[ForeignRows] = []
        for c in cands:
            try:
                rows.append(
                    foreign.to_rows(
                        c,
                        self.envs,
                        self.tokenizer,
                        self.tokenizer_digest,
                        self.eos_id,
                        self.max_foreign_tokens,
                        self.eos_ids,
                    )
                )
            except RecordRejected as exc:
                self.drops[exc.reason] += 1
                log.info("dropped foreign %s: %s", c.key, exc)
        need = [r for r in rows if r.path == "aligned" or mode == "onpolicy"]
        own = dict(
            zip(
                (id(r) for r in need),
                foreign.own_logprobs(self.model, need, self.cfg.trainer.micro_batch_tokens),
                strict=True,
            )
        )
        out, paths = [], Counter()
        for r in rows:
            mus, masks = foreign.behaviour(r, own.get(id(r)), mode)
            out.append(foreign.scored_group(r, mus, masks, self.cfg.algorithm.advantage))
            paths[r.path] += 1
        return out, paths

    # --- stage 6: step ------------------------------------------------------------------------------

    def step(self, groups: list[ScoredGroup]) -> StepStats | None:
        """One optimizer step on the groups that carry a signal; None (and no step) if none does, or if the
        gradient is not finite (`nonfinite_step`: the weights and optimizer state stay as they were)."""
        live = trainable(groups)
        if not live:
            return None
        longest = max(len(s.tokens) for g in live for s in g.group.samples)
        ensure_trainable(self.model)
        try:
            stats = train_step(
                self.model,
                self.optimizer,
                live,
                self.settings,
                micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
                grad_clip=self.cfg.trainer.grad_clip,
                max_len=max(self.max_new_tokens, longest),
            )
        except NonFiniteStep:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.eval()
            self.drops["nonfinite_step"] += 1
            log.warning("node=%s: a gradient was not finite; the step was skipped", self.name)
            return None
        self.model.eval()
        self.version += 1
        return stats

    # --- the loop -----------------------------------------------------------------------------------

    def round(self) -> RoundStats:
        """One full round; never waits for peers."""
        t0 = time.perf_counter()
        stats = RoundStats(round=self.rounds, version=self.version)
        local = self.generate()
        self.share(local)
        self.refresh()
        if self._await_shared:  # the first round of this process with swarm.wait_peers: see the config
            self._await_shared = False
            self.wait_for_shared(self.cfg.swarm.wait_peers, self.cfg.swarm.peer_timeout_s)
        picked = self.sample_mix()
        external, stats.paths = self.prepare_external(picked)
        mix = self.local_scored(local) + external
        stats.zero_variance = sum(is_zero_variance(g.rewards) for g in mix)
        self.drops["zero_variance"] += stats.zero_variance
        stats.local_groups, stats.external_groups = len(local), len(external)
        live = trainable(mix)  # exactly what `step` trains on: the counts say what the update consumed
        stats.trained_local = sum(g.worker_id == self.name for g in live)
        stats.trained_external = len(live) - stats.trained_local
        stats.trained_groups = len(live)
        stats.local_reward = _mean([float(s.reward) for g in local for s in g.samples])
        stats.external_reward = _mean([r for g in external for r in g.rewards])
        stats.forged = sum(c.forged for c in picked)
        stats.step = self.step(mix)
        if stats.step is not None:
            self.local_trained += stats.trained_local
            self.external_trained += stats.trained_external
        self.rounds += 1
        self.last_reward = stats.local_reward
        every = self.cfg.swarm.checkpoint_every
        if every and self.rounds % every == 0:
            self.checkpoint()
        stats.version = self.version
        stats.seconds = time.perf_counter() - t0
        self.heartbeat()
        log.info(stats.line(self.name))
        return stats

    def wait_for_shared(self, n: int, deadline_s: float) -> int:
        """Refresh (backoff 0.2 s to 2 s) until the pool holds candidates from `n` peers or `deadline_s`
        passes; returns how many peers it holds candidates from. Called after this node shared its own
        groups, so nodes waiting on each other never deadlock."""
        have, looks = 0, 0

        def attempt() -> int | None:
            nonlocal have, looks
            if looks:
                self.refresh()
            looks += 1
            have = len({c.peer for c in self.pool.candidates()})
            if have >= n:
                return have
            self.heartbeat("waiting")
            return None

        if wait_for(attempt, deadline_s, Backoff.polling(cap_s=2.0)) is None:
            log.warning("%s: %d of %d peers shared groups (waited %.0fs)", self.name, have, n, deadline_s)
        return have

    def run(self, total_rounds: int, time_budget_s: float | None = None) -> list[RoundStats]:
        """Run rounds until the node has completed `total_rounds` (rounds restored from a checkpoint count)
        or the time budget is spent; checkpoint at a clean stop; the heartbeat says "stopped" at the end."""
        self.heartbeat("starting")
        sw = self.cfg.swarm
        if sw.wait_peers:
            self.feed.wait(sw.wait_peers, sw.peer_timeout_s, lambda: self.heartbeat("waiting"))
            self._await_shared = True
        out = []
        t0 = time.monotonic()
        status, detail = "stopped", ""
        try:
            while self.rounds < total_rounds:
                out.append(self.round())
                if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
                    detail = "time budget spent"
                    break
            if self.checkpoint_round != self.rounds:
                self.checkpoint()
        except BaseException as exc:  # noqa: BLE001 - recorded in the heartbeat, then re-raised
            status, detail = "error", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.heartbeat(status, detail)
        return out

    # --- checkpoint / resume ------------------------------------------------------------------------

    def checkpoint(self) -> str | None:
        """Write the node's whole state to `swarm/ckpt/{node}.pt`; a store error is counted, not raised."""
        try:
            key = save_node_checkpoint(self.store, capture(self), self.model, self.optimizer)
        except StoreError as exc:
            self.drops["checkpoint_failed"] += 1
            log.warning("node=%s checkpoint at round %d failed: %s", self.name, self.rounds, exc)
            return None
        self.checkpoint_round = self.rounds
        return key

    def _restore(self) -> None:
        blob = load_node_checkpoint(self.store, self.name)
        if blob is None:
            return
        restore(self, blob)
        self.resumed_from = self.checkpoint_round = self.rounds
        log.info(
            "node=%s resumed from its checkpoint at round %d (v=%d)", self.name, self.rounds, self.version
        )

    # --- helpers ------------------------------------------------------------------------------------

    def _next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def _resume_seq(self) -> int:
        """The first free seq: after the heartbeat's `next_seq` and any upload listed past it."""
        hb = read_heartbeat(self.store, self.name)
        floor = hb.next_seq if hb is not None else 0
        start_after = layout.swarm_key(self.name, floor - 1) if floor > 0 else None
        nxt = floor
        for m in self.store.list(layout.swarm_dir(self.name), start_after=start_after):
            parsed = layout.parse_swarm_key(m.key)
            if parsed is not None and parsed[0] == self.name:
                nxt = max(nxt, parsed[1] + 1)
        return nxt


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
