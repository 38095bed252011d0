"""Wire records: the msgspec Structs that workers, trainers and swarm nodes exchange through the store.

Each top-level record carries a `schema` integer (its class's `SCHEMA`); a reader refuses any other
value instead of guessing, so an old trainer never misreads a newer worker's record. Structs are
keyword-only. Knows nothing about torch, the store or how records are framed on the wire
(`codec.py` does that); `WeightManifest` belongs to `pnyx.weights`, not here.

Invariants a valid `RolloutGroup` keeps (checked by `codec.validate_group`, never by constructors):
per sample, `tokens`, `logprobs` and `loss_mask` have equal length; the mask is 0/1; a logprob is
finite and <= 0 where the mask is 1, and exactly 0.0 where it is 0; rewards are in [0, 1].
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

GROUP_SCHEMA = 1
RUN_SCHEMA = 1
HEARTBEAT_SCHEMA = 1
DEMAND_SCHEMA = 1
PROTOCOL_VERSION = 1
"""The run-layout/commit protocol version recorded in run.json (docs/architecture.md, "Store layout")."""


class TokenView(msgspec.Struct, kw_only=True):
    """One completion at the token-id level: what every group record's sample carries (rollout and swarm)."""

    tokens: list[int]
    """Completion token ids: model tokens and tool/env tokens interleaved, never re-tokenized."""
    logprobs: list[float]
    """Behaviour logprob of each token under the exact sampling distribution; 0.0 where loss_mask is 0."""
    loss_mask: list[int]
    """1 = the model generated this token (trained on); 0 = a tool/env token (never trained on)."""
    reward: float
    """The producer's reward in [0, 1]; every receiver re-scores and never trusts it."""
    finish_reason: str = "stop"
    """"stop" | "length" | "tool_error" | "turn_limit" | ..."""
    num_tool_calls: int = 0
    """How many tool calls the episode made (multi-turn environments)."""


class Sample(TokenView, kw_only=True):
    """One completion of a rollout group."""

    reward_parts: dict[str, float] = msgspec.field(default_factory=dict)
    """Named reward components (e.g. {"correct": 1.0, "format": 0.5})."""


class GroupHeader(msgspec.Struct, kw_only=True):
    """The fields every group record carries (rollout groups and swarm groups): which task, which policy
    version, under which sampling settings."""

    seq: int
    """The producer's sequence number for this group (unique per producer; part of the key)."""
    policy_version: int
    """The weights version that generated every sample (a group never spans two versions)."""
    env: str
    task_id: str
    """Rebuilds the task (prompt and hidden answer) via `Environment.task(task_id)`."""
    temperature: float
    top_p: float
    top_k: int
    created_at: float
    """Unix time the group was finished (informational; ordering uses versions, not clocks)."""
    draws: str = ""
    """`pnyx.protocol.draws.SCHEME` when every model token was drawn from the group's seeded uniforms (the
    trainer checks each one); "": the engine's own randomness (unseeded: vLLM, older workers, swarm nodes)."""
    tick: int = -1
    """Committed draws (`security.committed_draws`, `pnyx.protocol.commits`): the trainer's tick that
    included this group's commitment; -1: not committed."""
    beacon: str = ""
    """That tick's random bytes (hex), part of every sample's seed; the trainer checks them against its own."""
    commit: str = ""
    """The store key of the commitment that named this group's seq and task before the tick."""


class RolloutGroup(GroupHeader, kw_only=True):
    """G completions of one prompt, produced by one worker under one policy version.

    Stored create-only at `layout.rollout_key(policy_version, worker_id, seq)`.
    """

    SCHEMA: ClassVar[int] = GROUP_SCHEMA

    schema: int = GROUP_SCHEMA
    run_id: str
    worker_id: str
    weights_digest: str
    """The chain digest of those weights, so the trainer can tell forked histories apart."""
    prompt_tokens: list[int]
    samples: list[Sample]
    gen_seconds: float
    score_seconds: float
    engine: str = "torch"
    """The worker engine that generated the samples ("torch", "mlx", "vllm"), so the trainer can report
    its logprob gap per engine. Records written before engines existed come from the torch engine."""


class TrainerKey(msgspec.Struct, kw_only=True):
    """The public half of the key that signs the run's weights (docs/security.md)."""

    algorithm: str = "ed25519"
    public: str
    """The raw 32-byte public key, hex."""
    fingerprint: str
    """First 128 bits of SHA-256 of the raw public key, hex (what `pnyx worker --trust` takes)."""


class RunManifest(msgspec.Struct, kw_only=True):
    """`run.json`: written create-only once per run; every role checks it before joining."""

    SCHEMA: ClassVar[int] = RUN_SCHEMA

    schema: int = RUN_SCHEMA
    run_id: str
    created_at: float
    config: dict
    """The resolved pnyx config as JSON."""
    model: dict
    """Model identity: name, tokenizer hash, vocab_size, ..."""
    protocol: int = PROTOCOL_VERSION
    trainer_key: TrainerKey | None = None
    """The trainer's public key; workers pin it and refuse weights it did not sign. None: a run created
    before signed weights, which workers refuse to join."""


class Heartbeat(msgspec.Struct, kw_only=True):
    """`workers/{id}.json` (or a swarm node's): liveness and throughput, overwritten periodically."""

    SCHEMA: ClassVar[int] = HEARTBEAT_SCHEMA

    schema: int = HEARTBEAT_SCHEMA
    worker_id: str
    role: str = "worker"
    """"worker" | "trainer" | "node"."""
    version: int = -1
    """The policy version currently loaded (-1 before the first sync)."""
    digest: str = ""
    """Chain digest of the loaded (verified) weights, so an operator can see every worker is on the trainer's bits."""
    staged: int = -1
    """The newest version fetched and verified but not loaded yet (-1: none newer than `version`). Under
    committed draws a worker loads it at its next cohort, which waits for the trainer's tick: while no
    trainer ticks (stopped, restarting) this is how far the worker has followed the published weights."""
    staged_digest: str = ""
    """Chain digest of the `staged` weights."""
    updated_at: float
    rollouts: int = 0
    """Completions uploaded so far."""
    groups: int = 0
    """Groups uploaded so far (by this process)."""
    groups_skipped_zero_variance: int = 0
    """Groups generated but not uploaded because every sample had the same reward (the trainer, which
    re-scores with the same verifier, would drop them as zero-variance)."""
    groups_pending: int = 0
    """Groups generated and spooled (on disk), not uploaded yet."""
    groups_expired: int = 0
    """Spooled groups never uploaded because the trainer had moved past their version's staleness window."""
    started_at: float = 0.0
    """Unix time this worker process started (tells one life of a worker id from the next)."""
    tokens_per_s: float = 0.0
    rollouts_per_s: float = 0.0
    status: str = "running"
    """"starting" | "syncing" | "generating" | "uploading" | "waiting" | "running" | "stopped" | "error"."""
    detail: str = ""
    key: str = ""
    """Fingerprint of the key this worker signs its groups with ("" before it joined, or an old worker)."""
    generate_seconds: float = 0.0
    """Seconds this process spent generating cohorts."""
    screen_seconds: float = 0.0
    """Seconds this process spent screening candidate tasks before generating (`pnyx.rollout.screen`)."""
    tasks_screened: int = 0
    """Candidate tasks scored by the screen."""
    commit_wait_seconds: float = 0.0
    """Seconds this process waited for the trainer's ticks (committed draws: `pnyx.rollout.committer`)."""
    engine: str = ""
    """The engine this worker generates with ("torch", "mlx", "vllm"; "" from an older worker)."""


class Demand(msgspec.Struct, kw_only=True):
    """`weights/DEMAND`: what the trainer can consume, rewritten after every publish (a hint, like HEAD).

    Workers read it to make only what the trainer will use (`pnyx.rollout.throttle`). Nothing depends on
    it for correctness: a missing, old or unreadable demand only makes workers fall back to a slow,
    bounded production.
    """

    SCHEMA: ClassVar[int] = DEMAND_SCHEMA

    schema: int = DEMAND_SCHEMA
    version: int
    """The newest version the trainer has published."""
    groups_per_step: int
    """Groups one trainer step consumes (trainer.groups_per_step)."""
    max_staleness: int
    """The trainer uses a group of version v only while its own version is at most v + max_staleness."""
    waiting: int
    """Usable groups waiting for the next step when `version` was published (the step takes
    `groups_per_step` of them; fewer means the trainer is about to wait)."""
    step_s: float = 0.0
    """Seconds per trainer step (moving average; 0 until measured), so workers pace and poll to it."""
    workers: int = 1
    """Workers whose heartbeat is recent (at least 1): each worker's share of the demand is 1/workers."""
    steps_left: int | None = None
    """Steps the trainer will still take before its step budget ends (None: no step budget, or a trainer
    that does not say): what its last steps can consume caps what workers make for them."""
    updated_at: float
    """Unix time of this record (informational: workers pace by their own clock)."""
