"""What ingestion is told and what it keeps: `IngestSettings` (its filters, caps and the run's sampling
settings) and the `Cursor` (the ingestion state persisted with every checkpoint).

Plain data for `pnyx.train.ingest` (the `Ingestor`) and its collaborators (`listing.py`, `key_ledger.py`,
`planner.py`), which share one settings object and one cursor; `pnyx.train.settings` builds the settings from
the config, `pnyx.train.resume` reloads the cursor. Knows nothing about the store, torch or how groups are
chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

from pnyx.security.calibration import Calibration
from pnyx.security.checks import CheckSettings, KeyEvidence, QuarantineSettings
from pnyx.train.advantages import AdvantageMode
from pnyx.train.seq_books import SeqBook


@dataclass(frozen=True)
class IngestSettings:
    """The filters of ingestion (`pnyx.train.settings.ingest_settings`: the config's `algorithm` and `security`
    sections, and the run's sampling settings from `worker`)."""

    max_staleness: int = 3
    max_reuse: int = 1
    last_chance_share: float = 0.5
    """Share of a batch offered first to fresh groups in their last step of the window (`ranking.ranked`)."""
    max_groups_per_prompt: int = 2
    advantage: AdvantageMode = "grpo"
    adv_eps: float = 1e-6
    temperature: float | None = None
    """The run's sampling settings and per-turn generation budget (run.json's `worker` section): a group
    that claims other settings is `sampling_mismatch`, one with a model turn longer than the budget is
    `over_budget`. None: not checked (tests and tools)."""
    top_p: float | None = None
    top_k: int | None = None
    group_size: int | None = None
    """A group with seeded draws holds exactly this many samples (None: not checked)."""
    max_new_tokens: int | None = None
    checks: CheckSettings = field(default_factory=CheckSettings)
    """The step's sampling checks, as floors: the allowances a step judges with are derived from the run
    (`allowances`, `pnyx.security.calibration`); per-key evidence is folded into the cursor at `commit`."""
    trusted_keys: frozenset[str] = frozenset()
    """Fingerprints of the user's own workers (`security.trusted_keys`, `pnyx run`'s local workers): never
    quarantined (their faulty groups are still dropped), and their groups calibrate the checks."""
    quarantine: QuarantineSettings | None = field(default_factory=QuarantineSettings)
    """When a signing key is quarantined (None: never)."""
    max_key_share: float | Literal["fair"] | None = None
    """At most ceil(share · n) places of a batch of n go to one key while other keys' groups can fill the
    rest; places the others cannot fill now go to it (one worker alone still fills a batch). "fair": the
    share is 1 / (keys with groups waiting in the window), so k keys each get ceil(n / k)."""
    flood_limit: int | None = None
    """A key with more than this many groups listed at one policy version is flooding: it is quarantined
    from the listing (its groups are counted, never downloaded). None: no limit."""
    max_groups_per_key_step: int | None = None
    """Hard cap: groups of one key in one batch (None: none)."""
    max_groups_per_key_version: int | None = None
    """Hard cap: groups of one key generated at one policy version that are ever trained on (None: none)."""
    reject_reward_lies: bool = False
    """Drop a group whose claimed rewards disagree with the re-score (`reward_lie`), instead of training on
    it with the trainer's own rewards."""


class Cursor(msgspec.Struct):
    """Ingestion state persisted with every checkpoint (JSON)."""

    uses: dict[str, int] = {}
    """Group key -> times consumed, for keys of versions not yet swept."""
    rejected: dict[str, str] = {}
    """Group key -> drop reason, for keys of versions not yet swept (never fetched again)."""
    drops: dict[str, int] = {}
    """Cumulative drop counts by reason."""
    disagreements: dict[str, int] = {}
    """Cumulative per-worker count of samples whose claimed reward differed from the re-score."""
    scored: dict[str, int] = {}
    """Cumulative per-worker count of re-scored samples (of groups consumed or rejected after scoring)."""
    keys: dict[str, str] = {}
    """Worker name -> fingerprint of the key it is bound to (the first key whose valid group used it)."""
    by_key: dict[str, dict[str, int]] = {}
    """Key fingerprint -> counters: `groups` consumed, `scored` samples, `disagreements`, and each drop
    reason of its groups (reputation and quotas attach to keys, not to claimed names)."""
    evidence: dict[str, KeyEvidence] = {}
    """Key fingerprint -> its running plausibility statistic over the groups the step checked."""
    calibration: Calibration = msgspec.field(default_factory=Calibration)
    """What the run measured for the sampling checks' allowances (`pnyx.security.calibration`)."""
    quarantined: dict[str, str] = {}
    """Key fingerprint -> why it was quarantined: its later groups are counted from the listing (by the
    worker names bound to it) and never downloaded; a group it signs under a new name is refused after
    one GET, and that name is bound to it."""
    seqs: dict[str, SeqBook] = {}
    """Worker name -> the seqs of it listed and not yet settled (`pnyx.train.seq_books`)."""
    skips: dict[str, int] = {}
    """Skip records (`layout.is_skip_key`) by outcome: `audited` (re-scored, zero variance), `draws_checked`
    (their tokens checked exactly too), `unverifiable` (their version's weights could not be verified),
    `unaudited` (swept before their audit), `false` (a `false_skip`, also counted in `drops`)."""
    seqs_from_zero: bool = False
    """A worker name's seqs start at 0 (a cursor made since the books exist); False: at the lowest listed
    (a cursor of an older build, resumed: its names' earlier seqs were never booked)."""
    gaps: int = 0
    """Seqs the workers left that the store never held, counted when their version was swept (each also
    counted against the key its name is bound to, `by_key[fp]["gaps"]`)."""
    swept_below: int = 0
    """Versions below this have left the window and been swept for stale drops."""
    consumed: int = 0
    """Cumulative number of group uses committed by steps."""

    @property
    def seq_start(self) -> int | None:
        """Where a new worker name's seqs begin (`seq_books.note`)."""
        return 0 if self.seqs_from_zero else None

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> Cursor:
        return msgspec.json.decode(data, type=cls)
