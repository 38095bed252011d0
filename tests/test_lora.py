"""LoRA runs (`[trainer.lora]`, pnyx/models/lora.py): the merge computes what the adapter computes, the trainer
trains and publishes only the adapter (base untouched, checkpoints without the base, resume exact), FSDP2
shards it, and a real fleet (`pnyx run`: trainer and worker processes, every check on) learns with it.

The engines' side (torch, mlx, vllm serving a published adapter with exact logprobs) is the adapter part
of tests/test_engine_contract.py; `pnyx export` of an adapter is tests/test_export_lora.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import dist_support as ds
import pytest
import tomli_w
import torch
from train_support import batches, make_trainer, overrides, write_groups

from pnyx.config import LoraConfig
from pnyx.errors import ConfigError, IntegrityError
from pnyx.models import load_model
from pnyx.models.lora import AdapterMerge, attach, published_names, target_of, targets
from pnyx.store import open_store
from pnyx.train import checkpoint
from pnyx.weights import Syncer, read_manifest, verify_chain

torch.set_num_threads(1)
LORA = {"enabled": True, "rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def _randomised(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every adapter tensor random values (B starts at 0, which would make any merge trivially right)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key in published_names(model):
            p = model.state_dict(keep_vars=True)[key]
            p.copy_(0.05 * torch.randn(p.shape, generator=g))


def test_the_merged_weights_compute_what_the_adapter_computes(model_dir):
    lc = LoraConfig(enabled=True, rank=8, alpha=16.0)
    adapted = load_model(model_dir)
    names = attach(adapted, lc)
    assert names and all(".default." not in p for p in names.values())
    assert all(p.requires_grad == (k in names) for k, p in adapted.named_parameters())  # the base is frozen
    _randomised(adapted)
    adapter = {pub: adapted.state_dict()[key] for key, pub in names.items()}
    plain = load_model(model_dir)
    merge = AdapterMerge(lc, {k: v for k, v in plain.state_dict().items() if k in targets(adapter)})
    merged = merge.merged(adapter, adapter)
    assert set(merged) == set(targets(adapter)) and "lm_head.weight" not in merged  # all-linear: not the head
    with torch.no_grad():
        for k, w in merged.items():
            plain.state_dict(keep_vars=True)[k].copy_(w)
        ids = torch.randint(
            0, int(plain.config.vocab_size), (3, 20), generator=torch.Generator().manual_seed(1)
        )
        want, got = adapted(input_ids=ids).logits, plain(input_ids=ids).logits
    base = load_model(model_dir)(input_ids=ids).logits.detach()
    assert (want - base).abs().max() > 1e-2  # the adapter moves the model ...
    assert torch.allclose(got, want, atol=2e-5, rtol=0)  # ... and the merge moves it the same way
    # A delta that changed only B of one target re-merges that target alone.
    one = next(n for n in adapter if n.endswith("lora_B.weight"))
    assert list(merge.merged(adapter, [one])) == [target_of(one)[0]]


def test_an_adapter_that_does_not_fit_the_base_is_refused(model_dir):
    lc = LoraConfig(enabled=True, rank=4, alpha=8.0)
    plain = load_model(model_dir)
    key = "model.layers.0.self_attn.q_proj.weight"
    merge = AdapterMerge(lc, {key: plain.state_dict()[key]})
    a, b = torch.zeros(4, 64), torch.zeros(64, 4)
    stem = key.removesuffix(".weight")
    with pytest.raises(IntegrityError, match="does not fit"):
        merge.merged(
            {f"{stem}.lora_A.weight": torch.zeros(4, 3), f"{stem}.lora_B.weight": b},
            [f"{stem}.lora_A.weight"],
        )
    with pytest.raises(IntegrityError, match="rank 4"):  # an adapter of another rank: another scale
        merge.merged(
            {f"{stem}.lora_A.weight": torch.zeros(8, 64), f"{stem}.lora_B.weight": torch.zeros(64, 8)},
            [f"{stem}.lora_A.weight"],
        )
    with pytest.raises(IntegrityError, match="does not have"):
        merge.merged({"x.lora_A.weight": a, "x.lora_B.weight": b}, ["x.lora_A.weight"])
    with pytest.raises(IntegrityError, match="only one of"):
        targets([f"{stem}.lora_A.weight"])
    with pytest.raises(ConfigError, match="matched no layer|target_modules"):
        attach(load_model(model_dir), LoraConfig(enabled=True, target_modules=["no_such_proj"]))


def test_a_lora_trainer_trains_and_publishes_only_the_adapter(tmp_path, model_dir):
    url = str(tmp_path / "run")
    t = make_trainer(url, model_dir, trainer__lora=LORA)
    t.start()
    m0 = read_manifest(t.store, 0)
    names = {e.name for e in m0.weights.tensors}
    assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    full = sum(p.numel() for p in load_model(model_dir).parameters())
    assert m0.weights.elements < 0.2 * full  # the adapter, not the model
    base = {k: v.clone() for k, v in t.parts.model.state_dict().items() if ".lora_" not in k}
    keys = write_groups(t.store, model_dir, 0, 6)
    assert t.run() == 3
    assert sorted(k for b in batches(t.store, 3) for k in b) == sorted(keys)
    assert verify_chain(t.store).ok
    state = t.parts.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())  # the base never moves
    _, published = Syncer(t.store).sync(to_version=3)
    assert set(published) == names
    assert any(bool(published[n].float().abs().max() > 0) for n in names if n.endswith("lora_B.weight"))
    # The exact re-check of a failing group (security.rejudge) judges under the same adapter, as published.
    judge = t.parts.rejudge
    assert judge is not None and judge.published.lora is not None
    with judge.published.lock:
        model = judge.published.at(3)
    params = dict(model.named_parameters())
    for key, name in t.parts.publishing.names.items():
        assert torch.equal(params[key].detach(), published[name].float()), name


def _checkpoint_keys(store, version: int, where) -> list[str]:
    """The state-dict keys DCP saved in checkpoint `version` (downloaded as the checkpointer does)."""
    from torch.distributed.checkpoint import FileSystemReader

    from pnyx.train.checkpointer import read_commit

    commit = read_commit(store, version)
    where.mkdir()
    for entry in commit.files:
        with open(where / entry.path, "wb") as f:
            for part in entry.parts:
                f.write(store.get(f"trainer/ckpt-{version:08d}/{part.name}"))
    return list(FileSystemReader(str(where)).read_metadata().state_dict_metadata)


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_it_exactly(tmp_path, model_dir):
    url = str(tmp_path / "run")
    t = make_trainer(url, model_dir, run__steps=2, trainer__lora=LORA, trainer__checkpoint_every=1)
    t.start()
    write_groups(t.store, model_dir, 0, 6)
    t.run()
    saved = _checkpoint_keys(open_store(url), 2, tmp_path / "dl")
    model_keys = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    trained = {n for n, p in t.parts.model.named_parameters() if p.requires_grad}
    assert sorted(model_keys) == sorted(trained)  # the adapter alone: no base, no tied head
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in saved)
    again = make_trainer(url, model_dir, resume=True, run__steps=3, trainer__lora=LORA)
    again.start()
    assert again.version == 2
    for k, v in t.parts.model.state_dict().items():
        assert torch.equal(again.parts.model.state_dict()[k], v), k
    moments = [s for s in again.parts.optimizer.state.values() if s]
    assert moments and all(torch.count_nonzero(s["exp_avg_sq"]) > 0 for s in moments)
    assert again.run() == 3


def test_a_lora_run_refuses_what_it_cannot_do(tmp_path, model_dir):
    url = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="int8"):
        make_trainer(url, model_dir, trainer__lora=LORA, worker__int8=True).start()
    make_trainer(url, model_dir, trainer__lora=LORA).start()
    with pytest.raises(ConfigError, match="trainer.lora"):  # another rank: another run
        make_trainer(url, model_dir, resume=True, trainer__lora={**LORA, "rank": 8}).start()
    with pytest.raises(ConfigError, match="trainer.lora"):  # full weights on a LoRA run
        make_trainer(url, model_dir, resume=True, trainer__lora={"enabled": False}).start()


@pytest.mark.slow
def test_two_fsdp2_ranks_train_the_adapter_as_one_process_does(tmp_path, model_dir):
    """torchrun, 2 gloo ranks: the adapter is sharded with the layers; the published adapter after a step
    matches a one-process replay of the same batch within the sharded tests' tolerance."""
    url = str(tmp_path / "run")
    fleet = {"trainer__lora": LORA, "run__steps": 1}
    make_trainer(url, model_dir, **fleet).start()
    write_groups(open_store(url), model_dir, 0, 2)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(tomli_w.dumps(overrides(model_dir, **fleet)))
    cmd = ds.torchrun_cmd(2, "-m", "pnyx", "trainer", "--store", url, "--config", str(cfg), "--resume")
    run = subprocess.run(cmd, env=ds.child_env(), cwd=ds.REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    store = open_store(url)
    assert [m["ranks"] for m in checkpoint.read_metrics(store)] == [2]
    _, sharded = Syncer(store).sync(to_version=1)
    assert all(".lora_" in n for n in sharded)
    # The 2-rank checkpoint (the adapter and its moments, sharded) resumes on one process: DCP reshards it.
    assert checkpoint.checkpoint_versions(store) == [1]
    resumed = make_trainer(url, model_dir, resume=True, **fleet)
    resumed.start()
    assert resumed.version == 1
    assert all(torch.equal(t, sharded[n]) for n, t in resumed.parts.publishing.tensors().items())
    moments = list(resumed.parts.optimizer.state.values())
    assert moments and all("exp_avg_sq" in m for m in moments)  # (A's are 0 after one step: B was 0)
    assert any(bool(torch.count_nonzero(m["exp_avg_sq"])) for m in moments)
    one = make_trainer(url, model_dir, resume=True, **fleet)
    from pnyx.protocol.runfile import read_run

    one.load(read_run(store))
    rec = checkpoint.read_batch_record(store, 1)
    one.version = 0
    one.train_batch(one.make_batch(rec, one.load_recorded(rec)))
    mine = one.parts.publishing.tensors()
    assert set(mine) == set(sharded)
    for n, x in mine.items():
        y = sharded[n].float()
        ulp = torch.maximum(x.float().abs(), y.abs()) * 2.0**-7 + 1e-6
        assert bool(((x.float() - y).abs() <= ulp).all()), n


@pytest.mark.slow
def test_pnyx_run_learns_with_an_adapter_and_every_check_on(tmp_path):
    """The real fleet: `pnyx run` (trainer + worker processes over a local folder) with LoRA on the tiny
    model: the worker merges each published adapter, the trainer drops none of its groups as dishonest, and
    the run ends with a before/after evaluation."""
    cmd = [
        sys.executable, "-m", "pnyx", "run", "--no-live", "--run.name", "lora", "--run.steps", "12",
        "--run.eval_every", "0", "--run.eval_tasks", "16", "--trainer.lora.enabled=true", "--trainer.lr=2e-3",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=ds.child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "lora" / "summary.json").read_text())
    assert summary["final_version"] == 12, summary
    log = (tmp_path / "runs" / "lora" / "logs" / "worker-1.log").read_text()
    assert "(derived proof)" in log  # the worker served the adapter, proved against the manifest
    drops = summary["supply"]["dropped"]
    assert not {k: v for k, v in drops.items() if k in ("logprob_gap", "implausible", "reward_lie")}, drops
    assert summary["supply"]["consumed"] >= 12 * 8  # every step trained on the worker's groups


def test_a_swarm_node_trains_an_adapter_and_samples_through_it(tmp_path):
    """`pnyx swarm` with [trainer.lora]: the node's policy carries the adapter; a round steps only the
    adapter, and the node's engine samples through it (peft's layers: the fast path steps aside)."""
    from swarm_support import open_test_node, swarm_cfg

    from pnyx.config import with_fields
    from pnyx.rollout.decoder import fast_path_supported
    from pnyx_harness.models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "m", vocab=512, seed=0)
    cfg = with_fields(
        swarm_cfg(local_groups=3, external_groups=0), {"trainer.lora": LORA, "trainer.lr": 1e-2}
    )
    node = open_test_node(open_store("memory://"), "me", cfg, model_dir)
    assert not fast_path_supported(node.model)
    base = {k: v.clone() for k, v in node.model.state_dict().items() if ".lora_" not in k}
    trained = [p for group in node.optimizer.param_groups for p in group["params"]]
    assert trained and all(p.requires_grad for p in trained)
    assert sum(p.numel() for p in trained) < sum(p.numel() for p in node.model.parameters()) / 2
    for _ in range(3):
        stats = node.round()
        if stats.step is not None:
            break
    assert stats.step is not None
    state = node.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())
    assert any(bool(state[k].abs().max() > 0) for k in state if ".lora_B." in k)  # B left 0: it trained
