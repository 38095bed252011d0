"""The configuration tree itself: `PnyxConfig` and its sections, every field with its bounds and its doc.

Each field is documented once (the docstring under it) and carries its bounds in its type; a section
forbids unknown fields and is immutable (`pnyx.config.with_fields` makes a changed copy). Nothing here
rewrites a sibling field. Layering (defaults → TOML file → dotted CLI flags), errors and derived values are in `pnyx.config`, which
re-exports every section: import them from there. Knows nothing about torch, models or stores.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PosFloat = Annotated[float, Field(gt=0)]
Prob = Annotated[float, Field(ge=0, le=1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class StoreConfig(_Section):
    url: str | None = None
    """Object-store URL of the run root: a folder path, file://, memory://, s3://bucket/prefix?endpoint=..,
    gs://bucket/prefix. Unset: `pnyx run` uses ./runs/<run.name>; trainer/worker require --store."""
    retry_deadline_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Transient store errors retry with jittered backoff for at most this many seconds per operation."""


class RunConfig(_Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")] | None = None
    """Run name (folder under ./runs for `pnyx run`). Unset: a timestamped name."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    """Root seed: task streams, sampling and initialisation derive from it."""
    steps: Annotated[int, Field(ge=1, le=10_000_000)] = 200
    """Trainer step budget: the run stops after this many optimizer steps (published versions)."""
    time_budget_s: Annotated[float, Field(gt=0)] = 900.0
    """`pnyx run` stops the fleet after this many seconds even if the step budget is not spent."""
    eval_every: Annotated[int, Field(ge=0, le=100_000)] = 10
    """`pnyx run` evaluates held-out pass@1 every this many versions (0 = only before and after)."""
    eval_tasks: Annotated[int, Field(ge=1, le=100_000)] = 200
    """Held-out tasks per evaluation (one sample each at the run's temperature for pass@1)."""


class ModelConfig(_Section):
    path: str | None = None
    """A local Hugging Face folder, a .gguf file, or a hub id (`org/name`, `org/name/file.gguf`), downloaded
    and cached like transformers does (HF_HOME, HF_HUB_OFFLINE). Unset: the tiny model in pnyx/assets/."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when model.path is a hub id. Unset: the default branch."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype for generation and training (master weights are always fp32 on the trainer)."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:1, mps, or auto (cuda if present, else mps, else cpu)."""


class EnvConfig(_Section):
    name: str = "arith"
    """Environment name from the registry (`pnyx envs list`)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment (difficulty, corpus paths, `answer="lenient"`,
    `format_reward`, ...; `pnyx envs show NAME` and docs/environments.md list them)."""
    system_prompt: str | None = None
    """System message of every prompt (None: the environment's own, which states its answer format;
    "": none)."""


class WorkerConfig(_Section):
    group_size: Annotated[int, Field(ge=2, le=64)] = 8
    """Completions sampled per prompt (G); the group is the unit of upload and of advantage estimation."""
    prompts_per_cohort: Annotated[int, Field(ge=1, le=1024)] = 4
    """Prompts generated together with one latched weight version (a cohort); swaps happen between cohorts."""
    temperature: Annotated[float, Field(gt=0, le=4)] = 1.0
    """Sampling temperature (behaviour logprobs are recorded under exactly this distribution)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus truncation (1.0 = off)."""
    top_k: Annotated[int, Field(ge=0, le=100_000)] = 0
    """Top-k truncation (0 = off)."""
    max_new_tokens: Annotated[int, Field(ge=1, le=32_768)] | None = None
    """Maximum tokens the model generates per turn (None: the environment's budget; the trainer records
    the resolved value in run.json)."""
    curriculum: bool | None = None
    """Online task selection: prefer tasks likely to make a group with mixed rewards, judged by each
    problem's last outcome and each class's (level, last outcome) recent share of mixed groups
    (pnyx/rollout/curriculum.py); a worker-side choice, task ids are unchanged. None: on when
    skip_zero_variance is (it avoids the groups a worker would not upload; a run that uploads every group
    samples the plain stream)."""
    screen: Annotated[int, Field(ge=1, le=64)] = 4
    """Pre-rollout screening: draw this many candidate tasks per task generated, score each by the policy's
    probability of the env's reference completion (one forward), and generate the ones most likely to make
    a group with mixed rewards (pnyx/rollout/screen.py); 1 = off. Applies to environments whose correct
    completion is essentially their reference (`arith` with tag answers) and engines that can score (torch);
    elsewhere it does nothing. With `screen_start_above` it cut `pnyx run`'s zero-variance groups from 16%
    to 5-6% of generated without slowing pass@1 (BENCHMARKS.md)."""
    screen_start_above: Annotated[float, Field(ge=0, lt=1)] = 0.15
    """Screening starts once this share of the worker's recent groups had zero variance, then stays on (0:
    from the first cohort). Early in a run the policy's p predicts little (correlation 0.32 with the pass
    rate at the shipped model) and screening from the start slowed learning; zero-variance groups pile up
    later, as tasks are mastered (27% by v175 in `pnyx run`), when p predicts well (0.89)."""
    poll_interval_s: Annotated[float, Field(gt=0, le=600)] = 1.0
    """How often a worker polls the weights HEAD for a newer version (with backoff on errors)."""
    heartbeat_interval_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    """How often a worker rewrites its heartbeat object."""
    supply_control: bool = True
    """Make only what the trainer can consume: each worker paces itself by the trainer's demand
    (`weights/DEMAND`: groups per step, groups waiting, workers live) instead of generating flat out."""
    supply_lead: Annotated[float, Field(ge=1, le=100)] = 1.0
    """Supply control's target, in trainer steps: groups waiting when the trainer publishes, as a multiple of
    trainer.groups_per_step (1 = exactly the next batch; more = fewer trainer waits, more stale drops). In
    `pnyx run`, 1.25 left 53-65 groups stale (3-4% of generated, left behind by freshest-first selection);
    1 left 0-2% unconsumed and the trainer no slower (BENCHMARKS.md)."""
    skip_zero_variance: bool = True
    """Do not upload groups whose samples all have the same reward (the trainer, re-scoring with the same
    verifier, would drop them); they are counted in the worker's heartbeat instead."""
    max_groups_per_version: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Hard cap: make at most this many groups per policy version, then wait for the next (None = no cap).
    Superseded by supply_control; kept for fleets that want a fixed cap. Measured slower on 2 cores (the
    trainer waits while the worker notices each new version)."""
    spool_max_groups: Annotated[int, Field(ge=0, le=1_000_000)] = 256
    """Generated groups kept in the local spool while the store is unreachable (oldest dropped beyond)."""
    int8: bool = False
    """Run the worker's model from the int8 actor plane (dequantized on load) instead of bf16."""
    engine: Literal["torch", "mlx", "vllm"] = "torch"
    """Default generation engine of the run's workers (each worker may choose its own with --engine)."""


class LoraConfig(_Section):
    """Train a LoRA adapter instead of the full weights (`[trainer.lora]`; docs/models.md, "LoRA"). The
    trainer holds the frozen base plus the adapter, built on `peft`; only the adapter (and its AdamW state)
    is trained, checkpointed and published, and workers merge it into their own copy of the run's base."""

    enabled: bool = False
    """Train an adapter (True) or the full weights (False, the default)."""
    rank: Annotated[int, Field(ge=1, le=4096)] = 16
    """The adapter's rank r: each target matrix W (out x in) learns B (out x r) @ A (r x in)."""
    alpha: PosFloat = 32.0
    """LoRA's alpha: the update is scaled by alpha / rank."""
    dropout: Prob = 0.0
    """Dropout on the adapter's input while training. Above 0 the trainer's forward is random, so the
    importance ratio and the sampling checks see noise: keep 0 for RL."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names that get an adapter (peft's `target_modules`, e.g. ["q_proj", "v_proj"]); "all-linear":
    every linear layer but the output head."""


class TrainerConfig(_Section):
    lr: Annotated[float, Field(gt=0, le=1)] = 2e-4
    """AdamW learning rate (the peak of the schedule)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after the warm-up: constant, linear or cosine decay to lr·min_lr_ratio at run.steps."""
    warmup_steps: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    """Linear warm-up: step v ≤ warmup_steps uses lr·v/(warmup_steps+1) (0 = none)."""
    min_lr_ratio: Prob = 0.0
    """Where linear and cosine decay end, as a fraction of lr."""
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[Prob, Prob] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: Annotated[float, Field(gt=0)] = 1.0
    """Global gradient-norm clip."""
    groups_per_step: Annotated[int, Field(ge=1, le=4096)] = 8
    """Rollout groups per optimizer step: the gradient is accumulated over micro-batches (and summed over
    ranks) until the whole batch is in it, whatever the memory per micro-batch or the number of ranks."""
    micro_batch_tokens: Annotated[int, Field(ge=64, le=10_000_000)] = 8192
    """Token budget of one forward/backward micro-batch (bounds memory)."""
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Forward/backward precision; master weights and optimizer state stay fp32. auto: bfloat16 on CUDA
    (autocast on one process, FSDP2 parameter dtype when sharded), float32 on CPU."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory)."""
    anchor_every: Annotated[int, Field(ge=1, le=100_000)] = 20
    """Publish a full anchor every this many versions; deltas in between."""
    keep_anchors: Annotated[int, Field(ge=1, le=100_000)] = 3
    """Retention: keep the newest this many anchors and every delta reachable from them."""
    publish_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the published weights that workers run."""
    publish_chunk_bytes: Annotated[int, Field(ge=4096, le=1 << 31)] = 64 << 20
    """Raw state bytes per published payload object; also the unit of work split between ranks."""
    checkpoint_every: Annotated[int, Field(ge=1, le=100_000)] = 20
    """Write a sharded checkpoint every this many steps (and at the end); steps in between are replayed
    from their batch records on resume."""
    keep_checkpoints: Annotated[int, Field(ge=1, le=1000)] = 2
    """Committed checkpoints kept in the store (older ones are deleted)."""
    async_checkpoint: bool = True
    """Write checkpoints from a background thread while training continues (else the loop waits)."""
    checkpoint_dir: str | None = None
    """Local folder where checkpoint shards are written before upload (None: a folder in the system temp
    directory, one per run)."""
    reference_device: str | None = None
    """Device of the KL reference model (kl_coef > 0), held by rank 0 only (None: the trainer's device)."""
    max_wait_s: Annotated[float, Field(gt=0)] = 600.0
    """Give up (clean stop) if no usable rollouts arrive for this long."""
    device: str = "cpu"
    """Torch device for training: cpu, cuda, mps or auto."""
    lora: LoraConfig = LoraConfig()
    """Adapter training (off by default): see `LoraConfig`."""
    tensorboard: bool = False
    """Also write metrics to TensorBoard, under `./tensorboard/<run_id>` (needs `pnyx[tensorboard]`)."""
    wandb_project: str | None = None
    """Also log metrics to this Weights & Biases project (needs `pnyx[wandb]`)."""
    trackio_project: str | None = None
    """Also log metrics to this trackio project, local by default (needs `pnyx[trackio]`)."""


class SecurityConfig(_Section):
    """What the trainer accepts from untrusted workers (docs/security.md): the per-group sampling checks,
    quarantine of signing keys, and the share of a batch one key may take. Read by the trainer; workers read
    only `flood_limit`, to stay at half of it (`pnyx.protocol.rules.worker_version_cap`)."""

    lp_gap_base: Annotated[float, Field(gt=0)] | None = 0.03
    """Logprob-gap check (docs/security.md): a group whose mean |claimed − trainer| behaviour logprob over
    its model tokens exceeds its bound is dropped (`logprob_gap`), from the step's own forward. The bound
    is derived from the run (`pnyx.security.calibration`: the trainer's own drift per version, trusted
    workers' noise per engine); lp_gap_base + lp_gap_per_version · staleness is its floor. None: off."""
    lp_gap_per_version: Annotated[float, Field(ge=0)] = 0.25
    """The floor's allowance per version of staleness (the derived bound only ever widens it)."""
    plausibility_z: Annotated[float, Field(gt=0)] | None = 4.5
    """Token-plausibility check: |z_adj| beyond this drops a group (`implausible`); z_adj is the group's z
    corrected for the policy's measured drift since it was sampled, ~N(0,1) for honest sampling at the
    claimed settings (docs/security.md). None: off."""
    seeded_draws: bool = True
    """Check every model token against its seeded draw (docs/security.md, "Seeded draws"): a worker draws
    token t of sample i by inverse CDF from a uniform derived from the run, its key, its id, the task, the
    version, the group's seq and i (`pnyx.protocol.draws`). The step's own forward gives each token's
    distance from its draw; a row over `draw_tolerance` there (drift: a stale group was sampled from older
    weights) is measured again under exactly the published weights of its version (`pnyx.train.drawcheck`),
    and a group with a token its uniform did not draw is dropped (`draw_mismatch`, a fault of its key).
    Groups without seeded draws are dropped at ingestion (`unseeded`) unless `accept_unseeded` or from a
    trusted key. False: only the statistical checks below."""
    draw_tolerance: Annotated[float, Field(ge=0, lt=0.5)] = 1e-3
    """The largest distance of a token's uniform from its CDF interval that still passes: room for engines'
    rounding at an interval's edge (honest tokens measured at exactly 0 on torch and MLX workers)."""
    stale_draw_audit: Annotated[float, Field(ge=0, le=1)] = 0.1
    """Share of stale rows (samples of groups drawn at an older version) that pass the check under the
    step's own forward and are measured again under exactly their version's published weights, chosen at
    random where no worker can predict it. The step's forward is the current version's: a row stamped with
    an older version but drawn (with that version's uniforms) under the current weights passes there, and
    drawing both ways is a choice between two samples; only the exact weights tell. Each audited row is a
    forward of its completion (the exact re-check's), so every row is checked exactly only at 1.0 (over the
    5% budget on the SmolLM2 recipe). 0: stale rows are measured exactly only when the step's forward flags
    them (drift)."""
    skip_draw_audit: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Share of skip records (zero-variance groups a worker uploads without offering them for training:
    docs/security.md, "Seeded draws") whose every sample the trainer checks against its seeded draws, chosen
    at random where no worker can predict it; a false one quarantines its key at once. Every skip record is
    re-scored, and has `skip_draw_samples` of its samples checked, whatever this is; a key's first
    `skip_audit_first` are checked whole. 0 by default: per sample checked, a random whole record finds a
    forger that changed k of G samples with chance k/G, as a random sample does, at G times the cost. Each
    whole check is a forward of the group under its version's weights: 14.6% of step time on the SmolLM2
    recipe at 1.0 (1.8% on the tiny model)."""
    skip_draw_samples: Annotated[int, Field(ge=0)] = 1
    """Samples of every other skip record whose tokens are checked against their seeded draws, chosen at
    random where no worker can predict it. A skip record forged to zero variance holds at least one sample
    its uniforms did not draw (the one whose reward it changed), k of its G in all, so each forged record is
    caught with chance at least k/G per sample checked: 1/8 for the most careful forger at G = 8, 7/8 for
    one that copies a sample across the group. A forward of that many completions (the group's prompt
    shared). 0: only whole records are checked."""
    skip_audit_first: Annotated[int, Field(ge=0)] = 8
    """Every sample of an untrusted key's first this many skip records is checked against its seeded draws
    (counted per key as `skips_whole` when queued; a key evicted without standing starts again), so a fresh
    key, a Sybil's included, cannot hide a group behind a forged skip record before it has delivered this
    many true ones. A forward of each of them, once per key."""
    skip_audit_trusted: Annotated[float, Field(ge=0, le=1)] = 0.1
    """Share of a trusted key's skip records (`trusted_keys`: your own workers, `pnyx run`'s local ones)
    whose draws are checked as above, chosen at random. A trusted key is never quarantined, so the check of
    its records measures, and does not guard: checked all, they cost 3.8% of the SmolLM2 recipe's step time
    once its policy answered most sums right (most groups zero-variance, BENCHMARKS.md, "Seeded draws").
    Untrusted keys' records are always checked."""
    background_checks: bool = True
    """While the step trains, a background thread of the trainer checks skip records' draws as soon as they
    are re-scored, and measures ahead the stale rows (2+ versions behind) of the prefetcher's forecast of the
    next batch, instead of in the trainer's wait or on the step's path (`pnyx/train/wait_work.py`).
    The exact forwards run on the CPU in fp32 whatever device trains: on a GPU trainer they take cores the
    step leaves idle; on a CPU trainer, cores it shares with whatever else runs there (a worker paced by
    supply control idles while the trainer is the bottleneck). Records the thread has not reached when a
    batch is full are still checked before it trains. False: all in the trainer's own thread."""
    committed_draws: bool = True
    """Commit, then reveal (docs/security.md, "Committed draws"; `pnyx.protocol.commits`): before each
    cohort a worker writes a signed commitment (its seqs, their tasks, the version it will draw at) and
    the trainer's next tick adds random bytes to every sample's seed, so the randomness of a draw does not
    exist until its task is fixed, and each seq of a (name, key) is committed once. Binds a picker that
    draws a seq again with another task, or leaves its seqs empty, which no other check sees. A seeded
    group without a matching commitment is dropped (`uncommitted`, a fault). Costs a worker the wait for
    a tick, hidden by `commit_ahead`. Needs `seeded_draws`: on wherever they are unless set (off with
    `seeded_draws = false`; a swarm node, which has no trainer to tick, ignores the default)."""
    commit_ahead: bool = True
    """Under committed draws: a worker commits its next cohort (tasks, seqs, the version it will draw at:
    the newest it has staged) as it starts drawing the current one, so the tick is there when it needs it
    and it does not wait for one per cohort. It commits ahead only what supply control, the version cap and
    its quota leave room for beyond the current cohort; a stop draws the cohort committed ahead before the
    worker leaves (its seqs would otherwise be gaps). Costs: new weights reach generation one cohort later,
    and the tasks of a cohort are chosen before the outcomes of the one before are known."""
    standing_groups: Annotated[int, Field(ge=0)] = 8
    """Under committed draws: the first this many seqs a worker name commits under an untrusted key are
    read and checked but never trained on (they expire), so a key must deliver that many groups it did not
    choose, in order, before one of its groups counts (docs/security.md, "Committed draws", standing).
    Binds a Sybil that abandons a key after a group it does not want: with a share p of its draws wanted,
    only runs of more than k wanted groups train, p^k of them (0.4% at p = 0.5, k = 8). The price: that
    many groups of every new worker name under an untrusted key (and of every name again after a trainer
    restart: the count starts at the first seq the window's ticks show); trusted keys (`trusted_keys`,
    `pnyx run`'s local workers) are exempt. Left unset, follows `committed_draws` (0 without them). 0: off."""
    tick_interval_s: Annotated[float, Field(gt=0, le=60)] = 0.1
    """Seconds between two of the trainer's ticks while commitments wait (none is written when none do)."""
    accept_unseeded: bool = False
    """Take groups without seeded draws from untrusted keys (the vLLM engine, whose sampler draws its own
    uniforms; workers older than seeded draws), judged by the statistical checks only: a temperature liar
    with a fresh key per group then passes them (docs/security.md). False: such groups are dropped
    (`unseeded`, a fault). A trusted key's unseeded groups are always taken (your own vLLM workers)."""
    rejudge: bool = True
    """A group the step's checks would drop is judged again under the exact published weights of the
    version it claims (a second fp32 copy of the model, built at the first need; `pnyx.train.rejudge`),
    and kept if it passes there: the drift allowances cannot tell a stale group of a prompt the trainer
    just trained on from a dishonest one, an exact forward can. False: the step's verdict is final."""
    trusted_keys: list[str] = []
    """Fingerprints of your own workers' keys (`pnyx worker` prints its key's at start): never quarantined
    (their faulty groups are still dropped), and their groups calibrate the checks' allowances per engine.
    `pnyx run` adds its local workers' keys itself."""
    quarantine_rate: Prob | None = 0.2
    """A worker key is quarantined once this share of its judged groups failed a check (reward, logprob
    gap, plausibility, malformed records; signature failures are never blamed on a key), with at least
    `quarantine_min` failed groups. Its later groups are counted from the listing, never downloaded.
    None: no quarantine on failure rates."""
    quarantine_min: Annotated[int, Field(ge=1, le=1_000_000)] = 5
    """Failed groups a key needs before `quarantine_rate` can quarantine it."""
    quarantine_key_z: Annotated[float, Field(gt=0)] | None = 5.0
    """A key whose running plausibility statistic Σ z / sqrt(n) over at least 8 checked groups exceeds this
    in absolute value (and whose mean z is off by at least 0.5) is quarantined: a statistical liar whose
    single groups pass. None: off."""
    reject_reward_lies: bool = True
    """Drop a group whose claimed rewards disagree with the trainer's re-score of the same completions
    (`reward_lie`; a fault of its key). Workers score with the same deterministic verifier, so an honest
    group never disagrees; False: train on such a group with the trainer's own rewards."""
    max_key_share: Annotated[float, Field(gt=0, le=1)] | Literal["fair"] | None = "fair"
    """One worker key takes at most ceil(share · groups_per_step) places of a batch while other keys'
    groups can fill the rest; places the others cannot fill at that moment go to it, so one worker alone
    still fills every batch and a batch never waits for a slow or dead key. "fair": share = 1 / (keys with
    groups waiting), so k keys get ceil(groups_per_step / k) places each. None: no share cap."""
    flood_limit: Annotated[int, Field(ge=1, le=1_000_000)] | Literal["auto"] | None = "auto"
    """A worker key with more than this many groups at one policy version (skip records do not count) is
    flooding: once the listing counts more, the trainer reads them until more than this many prove to be
    records the key signed, then quarantines it from the listing (the rest are never downloaded; objects
    others wrote under its names are rejected one by one and never count: `pnyx.train.flood_audit`).
    "auto": 2 · (max_staleness + 1) · groups_per_step, twice what could ever be trained from one version.
    Workers stop at half of it per version (`worker.max_groups_per_version` can lower that), so an honest
    worker never reaches it. None: no limit."""
    max_groups_per_key_step: Annotated[int, Field(ge=1, le=4096)] | None = None
    """Hard cap on one key's groups in one batch (binds even when it is alone: a solo worker then cannot
    fill a batch larger than this). None: none."""
    max_groups_per_key_version: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Hard cap on one key's groups generated at one policy version that are ever trained on. None: none."""

    @model_validator(mode="after")
    def _commit_where_seeded(self) -> SecurityConfig:
        """`committed_draws` left unset follows `seeded_draws` (a commitment binds a seed), and
        `standing_groups` left unset follows `committed_draws`; set, they are taken as given
        (`check_worker_dtype` refuses either without what it needs)."""
        if "committed_draws" not in self.model_fields_set and not self.seeded_draws:
            object.__setattr__(self, "committed_draws", False)  # frozen; still not counted as given
        if "standing_groups" not in self.model_fields_set and not self.committed_draws:
            object.__setattr__(self, "standing_groups", 0)  # standing counts the seqs ticks show
        return self


class AlgorithmConfig(_Section):
    advantage: Literal["grpo", "drgrpo"] = "grpo"
    """GRPO (R-mean)/(std+eps) or Dr.GRPO R-mean."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "drgrpo"] = "token_mean"
    """Loss aggregation over tokens: token mean, per-sequence mean then mean, or sum/(G·max_len)."""
    clip_low: Annotated[float, Field(ge=0, le=1)] = 0.2
    """PPO clip ε_lo: ratio floor 1-ε_lo."""
    clip_high: Annotated[float, Field(ge=0, le=10)] = 0.28
    """PPO clip ε_hi: ratio ceiling 1+ε_hi."""
    dual_clip: Annotated[float, Field(gt=1)] | None = 3.0
    """Dual-clip constant c bounding the loss for negative advantages (None = off)."""
    dppo_delta: Annotated[float, Field(gt=0, le=1)] | None = 0.2
    """DPPO gate δ in probability space (None = gate off)."""
    tis_cap: Annotated[float, Field(gt=1)] | None = None
    """Truncated importance weight cap C on π/μ (None = off); use with int8 actors."""
    kl_coef: Annotated[float, Field(ge=0)] = 0.0
    """KL penalty to the initial policy (0 = off, no reference model kept)."""
    max_staleness: Annotated[int, Field(ge=0, le=1000)] = 3
    """Keep a group iff trainer version - rollout version <= this."""
    max_reuse: Annotated[int, Field(ge=1, le=100)] = 1
    """Each group is used at most this many times (replay)."""
    last_chance_share: Prob = 0.5
    """Share of a batch offered first to fresh groups in their last step of the staleness window (the rest
    newest first); 0 = newest first only, under which a group left behind once goes stale unused. Half:
    at a quarter, a version that got two cohorts' groups left more behind than the rescue took (the default
    run dropped 60-79 groups stale under committed draws; 9-41 in six runs at half: BENCHMARKS.md)."""
    max_groups_per_prompt: Annotated[int, Field(ge=1, le=1000)] = 2
    """Each prompt (task id) contributes at most this many groups per step."""


class AcceptedEnv(_Section):
    """An environment with the kwargs a swarm node accepts foreign groups of (`swarm.accept_envs`)."""

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Exactly these constructor kwargs: a peer's group of `name` with other kwargs is dropped."""


class SwarmConfig(_Section):
    local_groups: Annotated[int, Field(ge=0, le=4096)] = 4
    """I: groups per step from this node's own rollouts."""
    external_groups: Annotated[int, Field(ge=0, le=4096)] = 4
    """J: groups per step drawn from other nodes' recent uploads."""
    foreign: Literal["onpolicy", "gated"] = "gated"
    """Treatment of foreign text: ratio ≡ 1 as in SAPO's reference code, or own-logprob DPPO gating."""
    prefer: Literal["uniform", "variance"] = "variance"
    """How external groups are drawn: uniformly, or preferring groups with non-zero reward variance."""
    window_s: Annotated[float, Field(gt=0)] = 300.0
    """Only external groups uploaded within this many seconds are eligible."""
    max_per_peer: Annotated[int, Field(ge=1, le=4096)] = 4
    """At most this many external groups per peer per step (a noisy peer cannot dominate)."""
    peer_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """A peer whose heartbeat is older than this is considered gone."""
    accept_envs: list[str | AcceptedEnv] | None = None
    """The environments this node scores foreign groups with, besides its own (which it always accepts, with
    its own kwargs): a name accepts that environment with its default kwargs, `{name, kwargs}` with exactly
    those kwargs (another task family: `[{"name": "arith", "kwargs": {"digits": 2}}]`). A peer's group must
    carry one of these (name, kwargs) pairs, else it is dropped (`env_kwargs_mismatch`, `unknown_env`):
    kwargs choose the system prompt, the answer mode, format rewards and data paths, so they are this
    node's operator's to choose, never a peer's. None: only its own."""
    recent_per_peer: Annotated[int, Field(ge=1, le=4096)] = 8
    """At most this many of each live peer's newest uploads are fetched per round (older ones are skipped)."""
    wait_peers: Annotated[int, Field(ge=0, le=4096)] = 0
    """Before its first round, wait until this many peers are live, and in that round, after sharing its own
    groups, until this many have shared groups it can train on (each wait at most peer_timeout_s), so a fast
    node does not take its first steps alone; 0 = start at once."""
    checkpoint_every: Annotated[int, Field(ge=0, le=1_000_000)] = 10
    """Checkpoint the node (weights, optimizer, counters, RNG, peer cursor) every this many rounds; 0 = only at
    the end of the run."""
    resume: bool = True
    """Start from this node's checkpoint in the store when it has one (False: from the model, same sequence)."""


class PnyxConfig(_Section):
    """The whole configuration of a pnyx run."""

    store: StoreConfig = Field(default_factory=StoreConfig)
    """Where the run lives."""
    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity and budgets."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment (task + verifier)."""
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    """Rollout generation (sampling settings are part of the run; workers read them from run.json)."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimisation and publishing."""
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    """The trainer's checks of untrusted workers' groups and keys."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The RL objective and off-policy controls."""
    swarm: SwarmConfig = Field(default_factory=SwarmConfig)
    """Swarm mode (SAPO): local/external mix per step."""
