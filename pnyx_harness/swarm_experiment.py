"""Tools for swarm experiments: specialist start checkpoints, held-out reward on a task family, and a
swarm of nodes run round-robin in one process.

SAPO's claim is that sharing spreads what one node knows to nodes that do not know it. Testing that needs
nodes that start knowing different things. `specialize` makes such a start checkpoint from any base model:
a short supervised fine-tune on an environment's reference completions (train split only, so held-out
evaluation on the test split stays held out), saved as an ordinary model folder whose tokenizer files are
the base's, byte for byte (peers then share tokens on the exact path). `heldout_reward` measures a node on
any family. `RoundRobin` runs real `SwarmNode`s in turn in one process (one torch runtime; the order is
fixed, so a run is reproducible), meeting through a real store, with optional late joiners.

Used by `benchmarks/bench_swarm.py`, `benchmarks/bench_swarm_mechanism.py` and the mechanism test. Knows
nothing about the node loop's stages. Deterministic for given inputs and thread count. Imports torch
inside functions.
"""

from __future__ import annotations

import random
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnyx.config_sections import AcceptedEnv
from pnyx.envs.base import stable_hash
from pnyx.errors import ConfigError
from pnyx.store import Store

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Family:
    """One task family: an environment name and its constructor kwargs (what a node trains on)."""

    label: str
    """Short name for tables and plots, e.g. "pm1"."""
    env: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        from pnyx.envs import get_env

        return get_env(self.env, **self.kwargs)


# --- specialist start checkpoints -----------------------------------------------------------------------


def _examples(
    tokenizer: PreTrainedTokenizerBase,
    env: Any,
    seed: int,
    n: int,
    eos_id: int | None,
    label: Callable[[Any], str] | None,
) -> list[tuple[list[int], list[int]]]:
    from pnyx.models import render_prompt

    out = []
    for task in env.sample("train", seed, n):
        ref = label(task) if label is not None else env.reference_completion(task)
        if not isinstance(ref, str):
            raise ConfigError(
                f"environment {env.name!r} has a multi-turn reference; specialize needs single-turn"
            )
        comp = list(tokenizer(ref, add_special_tokens=False)["input_ids"])
        if eos_id is not None:
            comp.append(eos_id)
        out.append((list(render_prompt(tokenizer, task.prompt)), comp))
    return out


def specialize(
    base: str | Path,
    out: str | Path,
    family: Family,
    *,
    steps: int = 100,
    batch: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    label: Callable[[Any], str] | None = None,
) -> Path:
    """Fine-tune `base` for `steps` AdamW steps on reference completions of `family` and save it to `out`.

    The loss is the mean negative log-likelihood of the completion tokens (EOS included) at temperature 1.
    `label(task)`, when given, replaces the reference completion: a deliberately damaged checkpoint (e.g.
    answers off by one) keeps the answer format and learns a wrong rule. Returns `out`. An existing `out`
    holding a model is returned as is (name it by its inputs).
    """
    import torch

    from pnyx.models import load_model, load_tokenizer
    from pnyx.models.logprobs import completion_logprobs
    from pnyx.models.tokenizer import TOKENIZER_FILES

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    if steps < 1 or batch < 1 or not lr > 0:
        raise ConfigError(f"specialize needs steps >= 1, batch >= 1 and lr > 0 (got {steps}, {batch}, {lr})")
    tokenizer = load_tokenizer(base)
    model = load_model(base, dtype="float32")
    env = family.build()
    task_seed = stable_hash("specialize", family.label, seed) % (2**31)
    data = _examples(tokenizer, env, task_seed, steps * batch, tokenizer.eos_token_id, label)
    random.Random(seed).shuffle(data)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)
    model.train()
    for s in range(steps):
        chunk = data[s * batch : (s + 1) * batch]
        logp, mask, _ = completion_logprobs(
            model, [p for p, _ in chunk], [c for _, c in chunk], temperature=1.0
        )
        loss = -logp[mask].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:  # byte for byte: same tokenizer digest, so peers take the exact path
        if (Path(base) / name).is_file():
            shutil.copyfile(Path(base) / name, tmp / name)
    tmp.rename(out)  # the folder appears whole or not at all
    return out


def off_by_one(task: Any) -> str:
    """A deliberately wrong label for integer-answer families (arith): `<answer>{answer + 1}</answer>`.

    A checkpoint fine-tuned on it keeps the answer format and learns a systematically wrong rule.
    """
    return f"<answer>{int(task.answer) + 1}</answer>"


def mechanism_starts(
    base: str | Path, work: str | Path, family: Family, a_steps: int, b_start: str, b_steps: int
) -> tuple[Path, Path]:
    """(A's, B's) start checkpoints for the mechanism experiment, built once under `work`.

    A: `a_steps` fine-tuning steps on `family`. B: `"base"` (the base model itself), `"earlier"` (`b_steps`
    steps of A's fine-tune) or `"off1"` (`b_steps` steps on `off_by_one` labels: a damaged checkpoint).
    """
    work = Path(work)
    a = specialize(base, work / f"spec-{family.label}-s{a_steps}", family, steps=a_steps)
    if b_start == "base":
        return a, Path(base)
    if b_start == "earlier":
        return a, specialize(base, work / f"spec-{family.label}-s{b_steps}", family, steps=b_steps)
    if b_start == "off1":
        return a, specialize(
            base, work / f"off1-{family.label}-s{b_steps}", family, steps=b_steps, label=off_by_one
        )
    raise ConfigError(f"b_start must be base, earlier or off1, got {b_start!r}")


# --- held-out evaluation --------------------------------------------------------------------------------


def heldout_reward(
    engine: Any,
    tokenizer: PreTrainedTokenizerBase,
    env: Any,
    *,
    tasks: int = 64,
    samples: int = 4,
    max_new_tokens: int = 16,
    seed: int = 0,
) -> float:
    """Mean reward of `samples` completions (temperature 1) on each of `tasks` test-split tasks of `env`.

    The tasks depend only on `seed` and the environment, so every model is compared on the same problems.
    """
    from pnyx.models import render_prompt
    from pnyx.rollout.cohort import sample_env
    from pnyx.rollout.sampling import SamplingParams

    picked = env.sample("test", 10_000 + seed, tasks)
    rows = [t for t in picked for _ in range(samples)]
    prompts = [render_prompt(tokenizer, t.prompt) for t in rows]
    params = SamplingParams(
        temperature=1.0, max_new_tokens=max_new_tokens, stop=list(env.stop_strings), seed=seed
    )
    engine.model.eval()
    outs = sample_env(engine, env, prompts, rows, params)
    return statistics.fmean(float(env.score(t, o.text).reward) for t, o in zip(rows, outs, strict=True))


# --- a swarm in one process ---------------------------------------------------------------------------


@dataclass
class NodeSpec:
    """One node of a round-robin swarm."""

    name: str
    model: Path
    """Its start checkpoint."""
    family: Family
    """What it generates and trains on locally."""
    local_groups: int
    external_groups: int
    join_round: int = 0
    """The swarm round at which it starts (a late joiner starts from its own start checkpoint)."""
    lr: float | None = None
    """Its learning rate, if not the shared config's."""


@dataclass
class RoundRobin:
    """Real `SwarmNode`s run in turn in this process, meeting through `store`.

    `overrides` is the config (dotted sections as nested dicts) every node shares; each node gets its
    family, its I/J and its name on top. Nodes accept every family in `accept` (`swarm.accept_envs`; by
    default every node's family: they learn from each other's groups).
    """

    store: Store
    specs: list[NodeSpec]
    overrides: dict[str, Any]
    accept: list[Family] | None = None
    nodes: dict[str, Any] = field(default_factory=dict)
    stats: list[dict[str, Any]] = field(default_factory=list)
    """One entry per round: {node name: RoundStats} for the nodes that ran that round."""

    def open(self, spec: NodeSpec) -> Any:
        from pnyx.config import load_config
        from pnyx.swarm.opening import open_node

        ov = {k: dict(v) for k, v in self.overrides.items()}
        ov["env"] = {"name": spec.family.env, "kwargs": dict(spec.family.kwargs)}
        ov["swarm"] = ov.get("swarm", {}) | {
            "local_groups": spec.local_groups,
            "external_groups": spec.external_groups,
        }
        if spec.lr is not None:
            ov["trainer"] = ov.get("trainer", {}) | {"lr": spec.lr}
        families = self.accept if self.accept is not None else [s.family for s in self.specs]
        accept = [AcceptedEnv(name=f.env, kwargs=dict(f.kwargs)) for f in families]
        node = open_node(self.store, spec.name, load_config(overrides=ov), spec.model, accept_envs=accept)
        self.nodes[spec.name] = node
        return node

    def run(self, rounds: int, after_round: Callable[[int, RoundRobin], None] | None = None) -> None:
        """Run `rounds` swarm rounds: in each, every node that has joined runs one node round, in spec order."""
        for r in range(len(self.stats), rounds):
            done = {}
            for spec in self.specs:
                if r < spec.join_round:
                    continue
                node = self.nodes.get(spec.name) or self.open(spec)
                done[spec.name] = node.round()
            self.stats.append(done)
            if after_round is not None:
                after_round(r, self)


# --- the mechanism: does sharing carry what A knows to B? ---------------------------------------------


@dataclass
class TransferResult:
    """B's held-out reward on the family over one run, and what B's steps did."""

    curve: list[tuple[int, float]]
    """(rounds B has run, B's held-out reward) at B's start and every `eval_every` rounds after."""
    a_end: float
    """A's held-out reward at the end (A's arm is the same whatever B does)."""
    steps: int
    """Optimizer steps B took (a round whose mix has no reward signal takes none)."""
    external_trained: int
    masked_frac: float
    """DPPO-gate-masked fraction of B's counted tokens, averaged over B's steps."""
    clip_frac: float

    @property
    def start(self) -> float:
        return self.curve[0][1]

    @property
    def end(self) -> float:
        return self.curve[-1][1]


def transfer_run(
    store: Store,
    a_model: Path,
    b_model: Path,
    family: Family,
    *,
    rounds: int,
    b_external: int,
    mode: str,
    seed: int,
    overrides: dict[str, Any],
    b_lr: float | None = None,
    b_join: int = 0,
    eval_every: int = 10,
    eval_tasks: int = 64,
    eval_samples: int = 4,
) -> TransferResult:
    """Node A (able) and node B (unable) on the same family; B trains on 8 - J local + J of A's groups.

    A trains on 8 own groups and never on B's (its run is identical in every arm). B joins at swarm
    round `b_join` from its own start checkpoint and then runs `rounds` rounds. J = 0 is the no-sharing
    arm: the same rounds and the same 8 groups per step, all B's own.
    """
    ov = {k: dict(v) for k, v in overrides.items()}
    ov["run"] = ov.get("run", {}) | {"seed": seed}
    ov["swarm"] = ov.get("swarm", {}) | {"foreign": mode}
    batch = 8
    specs = [
        NodeSpec("A", a_model, family, batch, 0),
        NodeSpec("B", b_model, family, batch - b_external, b_external, join_round=b_join, lr=b_lr),
    ]
    rr = RoundRobin(store, specs, ov)
    env = family.build()
    max_new = int(ov.get("worker", {}).get("max_new_tokens", 16))

    def held(node: Any) -> float:
        return heldout_reward(node.engine, node.tokenizer, env, tasks=eval_tasks, samples=eval_samples,
                              max_new_tokens=max_new, seed=seed)  # fmt: skip

    curve: list[tuple[int, float]] = []

    def after(r: int, rr: RoundRobin) -> None:
        b = rr.nodes.get("B")
        if b is not None and b.rounds % eval_every == 0:
            curve.append((b.rounds, held(b)))

    rr.run(b_join)
    b = rr.open(specs[1])
    curve.append((0, held(b)))
    rr.run(b_join + rounds, after)
    if not curve or curve[-1][0] != b.rounds:
        curve.append((b.rounds, held(b)))
    steps = [s["B"].step for s in rr.stats if "B" in s and s["B"].step is not None]
    return TransferResult(
        curve=curve,
        a_end=held(rr.nodes["A"]),
        steps=len(steps),
        external_trained=b.external_trained,
        masked_frac=statistics.fmean(s.masked_frac for s in steps) if steps else 0.0,
        clip_frac=statistics.fmean(s.clip_frac for s in steps) if steps else 0.0,
    )
