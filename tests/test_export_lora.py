"""`pnyx export` of a LoRA run: the verified adapter as a PEFT adapter folder, or merged into the base.

The module's run is made by the real trainer (`Trainer.start`: run.json and v0, whose adapter is B = 0) with
`trainer.lora` on the tiny model; then the trainer's adapter is set to random values (B != 0, so the adapted
model differs from the base) and published as v1 through the trainer's own publisher, as a step would. The
exported adapter, loaded with peft onto the base, and the merged folder, loaded with transformers alone, must
decode greedily exactly what pnyx's torch engine serving v1 decodes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pnyx.cli import app
from pnyx.cli.export import export_run
from pnyx.config import LoraConfig, load_config, with_fields
from pnyx.errors import ConfigError, IntegrityError
from pnyx.models import load_tokenizer, render_prompt
from pnyx.models.lora import lora_from_run
from pnyx.protocol import layout
from pnyx.protocol.runfile import read_run
from pnyx.store import open_store
from pnyx.train.loop import Trainer
from pnyx.weights import Syncer, TrustedWeights, read_manifest

torch.set_num_threads(1)
LORA = {"enabled": True, "rank": 4, "alpha": 12.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
PROMPTS = ["12 + 7", "What is 3 * 4?", "Compute 25 - 9.", [{"role": "user", "content": "1 + 1"}]]
NEW_TOKENS = 16


def make_run(url: str, model: Path, lora: dict | None = None) -> Trainer:
    overrides: dict = {"model": {"path": str(model)}, "env": {"name": "arith"}}
    if lora is not None:
        overrides["trainer"] = {"lora": lora}
    cfg = with_fields(load_config(None, overrides), {"store.url": url})
    trainer = Trainer(cfg, open_store(url))
    trainer.start()  # run.json + version 0, published in bf16
    return trainer


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir) -> str:
    url = str(tmp_path_factory.mktemp("export-lora") / "run")
    trainer = make_run(url, tiny_model_dir, LORA)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.parts.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    trainer.publish(1)
    return url


@pytest.fixture(scope="module")
def lc(lora_run) -> LoraConfig:
    run = read_run(open_store(lora_run))
    assert run is not None
    found = lora_from_run(run.config)
    assert found is not None and found.rank == LORA["rank"]
    return found


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    tok = load_tokenizer(tiny_model_dir)
    return [render_prompt(tok, p) for p in PROMPTS]


def published(url: str, version: int) -> dict[str, torch.Tensor]:
    return Syncer(open_store(url)).sync(to_version=version)[1]


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy decoding (generate, do_sample=False): the new tokens of each prompt, up to and
    with the first EOS (as pnyx's engines return them)."""
    eos = set(model.generation_config.eos_token_id or [])
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False, max_new_tokens=NEW_TOKENS,
            )[0, len(p):].tolist()  # fmt: skip
        stop = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        out.append(ids[:stop])
    return out


@pytest.fixture(scope="module")
def engine_tokens(lora_run, tiny_model_dir, lc, prompts) -> list[list[int]]:
    """What pnyx's torch engine, serving v1 of the run (the adapter merged into its base), decodes greedily."""
    from pnyx.rollout.engines import make_engine
    from pnyx.rollout.sampling import SamplingParams

    engine = make_engine("torch", tiny_model_dir, load_tokenizer(tiny_model_dir), lora=lc)
    syncer = TrustedWeights.open(open_store(lora_run)).syncer()
    assert syncer.sync(to_version=1)[0] == 1
    engine.update(1, syncer.state, syncer.manifest)
    done = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS))
    return [c.tokens for c in done]


def test_the_exported_version_holds_a_trained_adapter(lora_run):
    v1, v0 = published(lora_run, 1), published(lora_run, 0)
    bs = [k for k in v1 if k.endswith(".lora_B.weight")]
    assert bs and all(v0[k].count_nonzero() == 0 for k in bs) and all(v1[k].count_nonzero() > 0 for k in bs)


def test_adapter_export_loads_with_peft_and_decodes_like_the_engine_serving_the_version(
    lora_run, tiny_model_dir, prompts, engine_tokens, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = export_run(open_store(lora_run), tmp_path / "adapter")
    assert (result.kind, result.version, result.dtype) == ("adapter", 1, "bfloat16")
    assert not list(tmp_path.glob(".adapter-*"))

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()

    model = PeftModel.from_pretrained(base(), tmp_path / "adapter").eval()
    assert hf_greedy(model, prompts) == engine_tokens
    from peft import AutoPeftModelForCausalLM  # the base named in adapter_config.json, found by peft

    model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", local_files_only=True).eval()
    assert hf_greedy(model, prompts) == engine_tokens
    assert hf_greedy(base(), prompts) != engine_tokens  # the adapter changes what the model says

    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    want = published(lora_run, 1)
    assert saved.keys() == {"base_model.model." + k for k in want}
    assert all(torch.equal(saved["base_model.model." + k], v) for k, v in want.items())  # bf16, as published


def test_adapter_export_records_the_base_the_adapter_and_the_version(lora_run, tiny_model_dir, tmp_path):
    from pnyx.models.tokenizer import TOKENIZER_FILES

    export_run(open_store(lora_run), tmp_path / "adapter", dtype="float32")
    folder = tmp_path / "adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4, 12.0, sorted(LORA["target_modules"])
    )  # fmt: skip
    assert Path(config["base_model_name_or_path"]) == tiny_model_dir
    record = json.loads((folder / "pnyx_export.json").read_text())
    assert record["version"] == 1 and record["dtype"] == "float32"
    assert record["chain_digest"] == read_manifest(open_store(lora_run), 1).weights.chain_digest
    assert record["lora"]["rank"] == 4 and record["lora"]["merged"] is False
    assert record["model"]["digest"] and record["model"]["path"] == str(tiny_model_dir)
    names = [n for n in TOKENIZER_FILES if (tiny_model_dir / n).is_file()]
    assert names and all((folder / n).read_bytes() == (tiny_model_dir / n).read_bytes() for n in names)
    assert not (folder / "model.safetensors").exists()


def test_merged_export_loads_with_transformers_alone_and_decodes_like_the_engine(
    lora_run, prompts, engine_tokens, tmp_path
):
    from transformers import AutoModelForCausalLM

    result = export_run(open_store(lora_run), tmp_path / "merged", merged=True)
    assert (result.kind, result.version, result.dtype) == ("merged", 1, "float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    assert hf_greedy(model, prompts) == engine_tokens
    assert not any("lora" in k for k in model.state_dict())
    record = json.loads((tmp_path / "merged" / "pnyx_export.json").read_text())
    assert record["lora"]["merged"] is True and record["version"] == 1


def test_a_corrupt_adapter_in_the_store_is_refused_and_nothing_is_written(lora_run, tmp_path):
    url = str(shutil.copytree(lora_run, tmp_path / "run"))
    store = open_store(url)
    weights = read_manifest(store, 1).weights
    assert weights.delta or weights.anchor
    for obj in [*weights.delta, *weights.anchor]:  # whichever route the Syncer takes to v1
        key = layout.weights_payload(1, obj.name)
        data = bytearray(store.get(key))
        data[len(data) // 2] ^= 0x01
        store.put(key, bytes(data))
    for merged in (False, True):
        with pytest.raises(IntegrityError):
            export_run(store, tmp_path / "out", merged=merged)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out-*"))


def test_merged_on_a_full_weights_run_is_a_clear_config_error(tmp_path, tiny_model_dir):
    url = str(tmp_path / "run")
    make_run(url, tiny_model_dir)
    with pytest.raises(ConfigError, match="trains full weights; its export is already a plain folder"):
        export_run(open_store(url), tmp_path / "out", merged=True)
    assert not (tmp_path / "out").exists()


def test_the_export_command_says_how_to_load_the_adapter_and_the_merged_folder(lora_run, tmp_path):
    runner = CliRunner(env={"COLUMNS": "400"})  # rich: no line breaks inside the long call
    done = runner.invoke(app, ["export", "--store", lora_run, "--out", str(tmp_path / "a")])
    assert done.exit_code == 0, done.output
    assert "PeftModel.from_pretrained" in done.output and (tmp_path / "a" / "adapter_config.json").is_file()
    done = runner.invoke(app, ["export", "--store", lora_run, "--out", str(tmp_path / "m"), "--merged"])
    assert done.exit_code == 0, done.output
    assert "AutoModelForCausalLM.from_pretrained" in done.output and "PeftModel" not in done.output
    assert (tmp_path / "m" / "config.json").is_file()


def test_a_lora_export_needs_exactly_the_runs_base_not_only_its_tokenizer(lora_run, tmp_path):
    from pnyx_harness.models import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "other", seed=1)  # the same tokenizer, other weights
    for merged in (False, True):
        with pytest.raises(ConfigError, match="this model is not the run's"):
            export_run(open_store(lora_run), tmp_path / "out", model=str(other), merged=merged)
        assert not (tmp_path / "out").exists()


def test_the_adapter_folder_names_a_hub_base_at_its_commit_and_refuses_another_rank(
    lora_run, lc, tiny_model_dir, tmp_path
):
    from peft import PeftConfig

    from pnyx.models.export import write_adapter_folder

    adapter = published(lora_run, 1)
    write_adapter_folder(
        adapter, lc, "org/base", tiny_model_dir, tmp_path / "a", "bfloat16", base_revision="0" * 40
    )
    config = PeftConfig.from_pretrained(str(tmp_path / "a"))
    assert (config.base_model_name_or_path, config.revision, config.task_type) == (
        "org/base",
        "0" * 40,
        "CAUSAL_LM",
    )
    other = lc.model_copy(update={"rank": lc.rank * 2})
    with pytest.raises(IntegrityError, match="rank"):
        write_adapter_folder(adapter, other, "org/base", tiny_model_dir, tmp_path / "b", "bfloat16")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b-*"))
