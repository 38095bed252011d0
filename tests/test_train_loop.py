"""The trainer loop end to end on a tiny model: bootstrap, fencing, steps, metrics, resume, kill -9.

Rollouts come from a scripted worker (fixed right/wrong answers, behaviour logprobs from the model), so
the trainer is the only thing under test. The kill tests run the trainer in real processes and SIGKILL
them at a named point of a step (`python -m pnyx_harness.trainer --crash-at`), then resume and compare
with an uninterrupted run: same batches per version, same final weight bits, a chain that verifies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_support import batches, make_trainer, prepared_run, run_toml, write_groups

from pnyx.config import load_config, with_fields
from pnyx.errors import ConfigError, FencedError
from pnyx.store import open_store
from pnyx.train import checkpoint
from pnyx.train.loop import Trainer
from pnyx.weights import read_manifest, verify_chain

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pnyx_harness.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-loop"))


# --- in-process ---------------------------------------------------------------------------------------


def test_start_writes_run_json_and_publishes_v0_anchor(tmp_path, model_dir):
    t = make_trainer(str(tmp_path / "run"), model_dir)
    t.start()
    from pnyx.protocol.runfile import read_run

    run = read_run(t.store)
    assert run.model["vocab_size"] == t.parts.model.config.vocab_size and run.model["tokenizer_digest"]
    assert run.config["env"]["name"] == "arith"
    assert read_manifest(t.store, 0).kind == "anchor"


def test_second_trainer_on_an_owned_run_is_fenced_at_its_first_publish(tmp_path, model_dir):
    url = str(tmp_path / "run")
    make_trainer(url, model_dir).start()
    with pytest.raises(FencedError, match="another trainer owns it"):
        make_trainer(url, model_dir).start()


def test_joining_a_run_with_different_run_defining_config_is_refused(tmp_path, model_dir):
    url = str(tmp_path / "run")
    make_trainer(url, model_dir).start()
    with pytest.raises(ConfigError, match="worker.temperature"):
        make_trainer(url, model_dir, resume=True, worker__temperature=0.5).start()


def test_steps_publish_versions_metrics_and_disjoint_batches_on_every_backend(store_url, model_dir):
    t = make_trainer(store_url, model_dir)
    t.start()
    keys = write_groups(t.store, model_dir, 0, 6)
    before = {k: v.clone() for k, v in t.parts.model.state_dict().items()}
    assert t.run() == 3
    used = [k for b in batches(t.store, 3) for k in b]
    assert sorted(used) == sorted(keys)  # each group once, none lost
    assert [m["version"] for m in checkpoint.read_metrics(t.store)] == [1, 2, 3]
    assert [m["version"] for m in checkpoint.read_metrics(t.store, since_version=2)] == [3]
    assert checkpoint.checkpoint_versions(t.store)[-1] == 3
    assert verify_chain(t.store).ok
    assert any(not torch.equal(before[k], v) for k, v in t.parts.model.state_dict().items())


def test_resume_restores_version_and_cursor_from_the_checkpoint(tmp_path, model_dir):
    url = str(tmp_path / "run")
    t = make_trainer(url, model_dir, run__steps=2)
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    t.run()
    again = make_trainer(url, model_dir, resume=True, run__steps=3)
    again.start()
    assert again.version == 2 and again.parts.ingestor.cursor.uses == t.parts.ingestor.cursor.uses
    for k, v in t.parts.model.state_dict().items():
        assert torch.equal(again.parts.model.state_dict()[k], v)
    assert again.run() == 3
    assert len({k for b in batches(again.store, 3) for k in b}) == 6


def test_resume_rolls_forward_through_published_versions_without_a_checkpoint(tmp_path, model_dir):
    url = str(tmp_path / "run")
    t = make_trainer(url, model_dir)
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    t.step()
    t.step()  # v1 and v2 published, no checkpoint written (as if killed before it)
    assert checkpoint.checkpoint_versions(t.store) == []
    again = make_trainer(url, model_dir, resume=True)
    again.start()
    assert again.version == 2 and again.parts.ingestor.cursor.uses == t.parts.ingestor.cursor.uses
    for k, v in t.parts.model.state_dict().items():
        assert torch.equal(again.parts.model.state_dict()[k], v), k
    assert again.run() == 3
    used = [k for b in batches(again.store, 3) for k in b]
    assert len(used) == len(set(used)) == 6


def test_replay_that_does_not_reproduce_the_published_bits_adopts_them(tmp_path, model_dir):
    from pnyx.weights import Syncer

    url = str(tmp_path / "run")
    t = make_trainer(url, model_dir)
    t.start()
    write_groups(t.store, model_dir, 0, 2)
    t.step()
    again = make_trainer(url, model_dir, resume=True, trainer__lr=0.05)  # a replay that cannot match
    again.start()
    _, published = Syncer(again.store).sync(to_version=1)
    for k, v in again.parts.publishing.tensors().items():
        assert torch.equal(v, published[k]), k


def test_adoption_moves_only_the_values_whose_cast_differs(tmp_path, model_dir):
    """A replay off by a rounding in a few values takes the published bits there and keeps its fp32 masters
    everywhere else (rounding every master would perturb the next step of every weight)."""
    from pnyx.train import resume
    from pnyx.weights import Syncer

    t = make_trainer(str(tmp_path / "run"), model_dir)
    t.start()
    write_groups(t.store, model_dir, 0, 2)
    t.step()
    masters = {k: p.detach().clone() for k, p in t.parts.model.named_parameters()}
    name = next(k for k, p in masters.items() if p.dim() == 2)
    with torch.no_grad():
        dict(t.parts.model.named_parameters())[name][0, 0] += (
            0.5  # its cast now differs from the published v1
        )
    resume.verify_or_adopt(t, 1)
    _, published = Syncer(t.store).sync(to_version=1)
    after = dict(t.parts.model.named_parameters())
    assert after[name][0, 0].item() == published[name][0, 0].float().item()
    off_bf16 = 0
    for k, m in masters.items():
        got = after[k].detach()
        if k == name:
            got, m = got.flatten()[1:], m.flatten()[1:]
        assert torch.equal(got, m), k  # every other master kept, to the bit
        off_bf16 += int((m != m.to(torch.bfloat16).float()).sum())
    assert off_bf16 > 0  # the masters kept are finer than the published cast: nothing was rounded
    for k, v in t.parts.publishing.tensors().items():
        assert torch.equal(v, published[k]), k


def test_metrics_report_every_quantity_the_step_line_needs(tmp_path, model_dir):
    t = make_trainer(str(tmp_path / "run"), model_dir, run__steps=1)
    t.start()
    write_groups(t.store, model_dir, 0, 2)
    t.run()
    (m,) = checkpoint.read_metrics(t.store)
    for field in (
        "loss",
        "reward",
        "staleness",
        "masked_frac",
        "clip_frac",
        "iw_mean",
        "ess",
        "entropy",
        "grad_norm",
        "tok_s",
        "drops",
        "disagreements",
    ):
        assert field in m, field
    assert m["staleness"] == {"0": 2} and m["reward"] == 0.5


def test_stop_request_finishes_the_step_publishes_and_checkpoints(tmp_path, model_dir):
    t = make_trainer(str(tmp_path / "run"), model_dir)
    t.start()
    write_groups(t.store, model_dir, 0, 6)

    class StopAfterFirstStep:  # stands in for Ctrl-C arriving during step 1
        def write(self, m):
            t.request_stop()

        def close(self):
            pass

    assert t.run([StopAfterFirstStep()]) == 1
    assert checkpoint.checkpoint_versions(t.store)[-1] == 1
    assert checkpoint.read_batch_record(t.store, 2) is None


def test_plain_resume_takes_the_runs_own_config(tmp_path, model_dir):
    url = str(tmp_path / "run")
    make_trainer(url, model_dir, run__steps=5, trainer__lr=3e-3).start()
    cfg = load_config(None, {})  # `pnyx trainer --store URL --resume` with no config at all
    cfg = with_fields(cfg, {"store.url": url})
    again = Trainer(cfg, open_store(url), resume=True)
    again.start()
    assert again.steps == 5 and again.cfg.trainer.lr == 3e-3
    assert again.cfg.model.path == str(model_dir)


def test_trainer_stops_cleanly_when_no_rollouts_arrive(tmp_path, model_dir):
    t = make_trainer(str(tmp_path / "run"), model_dir, trainer__max_wait_s=0.5)
    t.start()
    assert t.run() == 0


def test_default_config_checkpoints_every_20_steps_and_at_the_end_only(tmp_path, model_dir):
    t = make_trainer(str(tmp_path / "run"), model_dir)
    assert t.cfg.trainer.checkpoint_every == 20
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    assert t.run() == 3
    assert checkpoint.checkpoint_versions(t.store) == [3]
    assert not t.store.list("trainer/ckpt-00000001") and not t.store.list("trainer/ckpt-00000002")


def test_steps_follow_the_schedule_and_record_their_rate(tmp_path, model_dir):
    from pnyx.train.schedule import Schedule

    t = make_trainer(
        str(tmp_path / "run"),
        model_dir,
        trainer__lr_schedule="cosine",
        trainer__warmup_steps=1,
        trainer__min_lr_ratio=0.1,
    )
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    t.run()
    want = [Schedule(1e-3, "cosine", 1, 3, 0.1).at(v) for v in (1, 2, 3)]
    assert [m["lr"] for m in checkpoint.read_metrics(t.store)] == want
    assert [checkpoint.read_batch_record(t.store, v).lr for v in (1, 2, 3)] == want
    assert want[0] < want[1] and want[2] == pytest.approx(1e-4)


def test_replay_uses_the_recorded_rate_even_when_the_step_budget_changes(tmp_path, model_dir):
    url = str(tmp_path / "run")
    t = make_trainer(url, model_dir, trainer__lr_schedule="linear", trainer__min_lr_ratio=0.0)
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    t.step()
    t.step()  # v1, v2 published under a 3-step decay; no checkpoint
    again = make_trainer(url, model_dir, resume=True, run__steps=50)  # a 50-step decay from now on
    again.start()
    for (
        k,
        v,
    ) in t.parts.model.state_dict().items():  # replayed with the recorded rates: exact, nothing adopted
        assert torch.equal(again.parts.model.state_dict()[k], v), k


def test_an_old_single_object_checkpoint_is_ignored_and_the_run_resumes_from_its_batch_records(
    tmp_path, model_dir
):
    """Runs from before sharded checkpoints may hold `trainer/ckpt-V.pt`: it is no longer read; the batch
    records replay the run from v0 to the same bits."""
    from pnyx.protocol import layout

    url = str(tmp_path / "run")
    t = make_trainer(url, model_dir)
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    t.step()
    t.step()
    t.store.put(layout.trainer_key("ckpt-00000001.pt"), b"an old torch.save object", mode="overwrite")
    again = make_trainer(url, model_dir, resume=True)
    again.start()
    assert again.version == 2 and again.last_checkpoint is None
    assert again.parts.ingestor is not None and t.parts.ingestor is not None
    assert again.parts.ingestor.cursor.uses == t.parts.ingestor.cursor.uses
    for k, v in t.parts.model.state_dict().items():
        assert torch.equal(again.parts.model.state_dict()[k], v), k


def test_kl_to_the_reference_is_reported_and_its_logprobs_are_prefetched(tmp_path, model_dir):
    t = make_trainer(str(tmp_path / "run"), model_dir, algorithm__kl_coef=0.5, run__steps=2)
    t.start()
    keys = write_groups(t.store, model_dir, 0, 4)
    assert t.run() == 2
    first, second = checkpoint.read_metrics(t.store)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # v0 is the reference
    assert second["kl"] > 0
    assert set(keys) <= set(t.parts.reference._cache)


# --- real processes, SIGKILL ---------------------------------------------------------------------------


def _subprocess(url: str, cfg_path: Path, crash: str | None, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    hook = ["--crash-at", crash] if crash else []
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pnyx_harness.trainer",
            *hook,
            "--store",
            url,
            "--config",
            str(cfg_path),
            "--resume",
            *extra,
        ],  # fmt: skip
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    """The uninterrupted run (in this process, one thread like the subprocesses): batches per version and
    the final state digest."""
    root = tmp_path_factory.mktemp("ref") / "run"
    url, _ = prepared_run(root, model_dir)
    t = make_trainer(url, model_dir, resume=True)
    t.start()
    assert t.run() == 3
    return batches(t.store, 3), read_manifest(t.store, 3).weights.state_digest


@pytest.mark.slow
@pytest.mark.parametrize(
    ("crash", "every", "published"),
    [
        ("after_step:2", 20, {1}),  # default checkpointing: nothing checkpointed before the kill
        ("after_publish:2", 20, {2}),
        ("before_manifest:2", 20, {1}),  # v2's payload uploaded, its manifest never written
        # v1 committed; v2's shards uploaded, never committed (training went on meanwhile: v3 may be out)
        ("during_checkpoint:2", 1, {2, 3}),
    ],
)
def test_sigkilled_trainer_resumes_without_losing_or_duplicating_a_group(
    tmp_path, model_dir, reference, crash, every, published
):
    ref_batches, ref_digest = reference
    url, keys = prepared_run(tmp_path / "run", model_dir)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(run_toml(model_dir))

    killed = _subprocess(url, cfg, crash, f"--trainer.checkpoint_every={every}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    store = open_store(url)
    from pnyx.weights import latest_version

    assert latest_version(store) in published
    assert checkpoint.checkpoint_versions(store) == ([1] if every == 1 else [])

    resumed = _subprocess(url, cfg, None)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = batches(store, 3)
    assert got == ref_batches
    assert sorted(k for b in got for k in b) == sorted(keys)
    assert read_manifest(store, 3).weights.state_digest == ref_digest
    assert verify_chain(store).ok


def test_cli_exits_with_code_3_when_another_trainer_owns_the_run(tmp_path, model_dir):
    import typer

    from pnyx.cli.trainer import trainer

    url = str(tmp_path / "run")
    make_trainer(url, model_dir).start()
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(run_toml(model_dir))
    with pytest.raises(typer.Exit) as e:
        trainer(url, cfg, resume=False, steps=1)
    assert e.value.exit_code == 3


def test_each_version_the_trainer_publishes_reaches_its_exact_checks_without_a_fetch(tmp_path, model_dir):
    """`Publishing.publish` hands each version to the exact checks' model as published: `at(v)` then holds
    the bits a worker syncs from the store, and no syncer was ever built to fetch them."""
    from pnyx.weights import Syncer

    t = make_trainer(str(tmp_path / "run"), model_dir)
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    assert t.run() == 3
    (pm,) = t.parts.published
    assert list(pm._states) == [0, 1, 2, 3]
    for v in (2, 0, 3):
        worker = Syncer(t.store, trust=t.trust)
        worker.sync(to_version=v)
        model = pm.at(v)
        assert pm.digest == worker.digest
        held = model.state_dict()
        for name, published in worker.tensors.items():
            assert torch.equal(held[name], published.float()), name
    assert pm._syncer is None
    pm.keep = 2  # past `keep`, the oldest versions go, whatever was used last (v2 above)
    pm.remember(4, "d4", pm._states[3][1])
    assert sorted(pm._states) == [3, 4]
