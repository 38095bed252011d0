"""Where a model comes from: a local folder, a Hugging Face hub id or a GGUF file, resolved to a local folder.

`resolve_source(spec, revision)` is the one place pnyx turns what a user names a model (`model.path`) into
files on this machine:
- an existing folder in Hugging Face layout (config.json, weights, tokenizer files) is used as it is;
- a `.gguf` file is dequantized once into a safetensors folder in the pnyx cache (`dequantize.py`);
- anything else that is a hub id (`Qwen/Qwen2.5-0.5B-Instruct`, or `org/name/file.gguf` for one GGUF file
  of a repo) goes through `huggingface_hub` exactly as `transformers` does: the same cache (HF_HOME,
  HF_HUB_CACHE, read at each call), offline mode (HF_HUB_OFFLINE) and revisions. It downloads only when
  online; offline, a populated cache is enough and a missing model is a ModelNotFoundError saying how to
  fetch it.

The result, `ModelSource`, names the folder to load and the model's identity: kind, hub id, resolved commit
and a content digest over the files that define the model (`fingerprint.py`). The trainer records that
identity in run.json; `resolve_run_model` resolves the same model on another machine and refuses, with a
ConfigError that names what differs, a copy whose files are not the run's: a worker never drifts silently.

Only this module (and the GGUF conversion it calls) touches the network or the hub cache; loaders read the
resolved folder with `local_files_only`. Knows nothing about the store or RL; imports nothing heavy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pnyx.config import PnyxConfig, shipped_model_path
from pnyx.errors import ConfigError, ModelNotFoundError
from pnyx.models import fingerprint
from pnyx.models.tokenizer import TOKENIZER_FILES, tokenizer_digest

Kind = Literal["folder", "hub", "gguf"]

HUB_PATTERNS = [*fingerprint.CONFIG_FILES, "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]
"""What a hub download fetches: the files that define the model (never READMEs, ONNX or .bin copies)."""


@dataclass(frozen=True)
class ModelSource:
    """A model resolved on this machine: `folder` is what loaders read; the rest is its identity."""

    kind: Kind
    folder: Path
    """A local Hugging Face folder (for a GGUF file: its dequantized copy in the pnyx cache)."""
    spec: str | None
    """What the user named (model.path); None for the shipped tiny model."""
    repo_id: str | None = None
    revision: str | None = None
    """The revision asked for (branch, tag or commit); None = the hub's default branch."""
    commit: str | None = None
    """The commit the revision resolved to (hub sources)."""
    gguf_file: Path | None = None
    """The GGUF file on this machine (gguf sources)."""
    gguf_name: str | None = None
    """The GGUF file's name inside its hub repo, or its base name for a local file."""

    @cached_property
    def fingerprint(self) -> tuple[str, dict[str, str]]:
        """(content digest, {file: digest}): the GGUF file for gguf sources, else the model files of `folder`."""
        if self.gguf_file is not None:
            digest = fingerprint.file_digest(self.gguf_file)
            return digest, {str(self.gguf_name): digest}
        return fingerprint.folder_fingerprint(self.folder)

    @property
    def digest(self) -> str:
        return self.fingerprint[0]

    @property
    def files(self) -> dict[str, str]:
        return self.fingerprint[1]

    @property
    def name(self) -> str:
        """A short display name: the hub id, the GGUF file name or the folder name."""
        if self.kind == "gguf":
            return str(self.gguf_name)
        return self.repo_id or self.folder.name

    def identity(self) -> dict[str, Any]:
        """What run.json records so another machine can resolve and check the same model."""
        return {
            "kind": self.kind,
            "spec": self.spec,
            "path": str(self.gguf_file or self.folder),
            "id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "file": self.gguf_name,
            "digest": self.digest,
            "files": dict(self.files),
        }


def resolve_source(spec: str | Path | None, revision: str | None = None) -> ModelSource:
    """Resolve a model folder, .gguf file or hub id (None: the shipped tiny model) to a `ModelSource`.

    Raises ModelNotFoundError (with how to get the model) when it cannot be found or fetched, and
    ConfigError for a revision given with a local model or a GGUF file without `pnyx[gguf]`.
    """
    text = "" if spec is None else str(spec)
    if not text:
        _no_revision(revision, "model.path is unset (the shipped tiny model)")
        return _folder_source(shipped_model_path().resolve(), None)
    path = Path(text).expanduser()
    if path.exists():
        _no_revision(revision, f"{text} is a local path")
        if path.is_dir():
            return _folder_source(path.resolve(), text)
        if path.suffix.lower() == ".gguf":
            return _gguf_source(path.resolve(), text, path.name)
        raise ModelNotFoundError(
            f"{text} is a file but not a .gguf file: give a model folder, a .gguf file or a hub id"
        )
    repo_id, filename = parse_hub_id(text)
    if repo_id is None:
        raise ModelNotFoundError(
            f"model {text!r} is neither an existing folder or .gguf file nor a Hugging Face hub id "
            "('org/name', or 'org/name/file.gguf'); check the path"
        )
    if filename is not None:
        return _hub_gguf_source(repo_id, filename, revision, text)
    return _hub_source(repo_id, revision, text)


def parse_hub_id(text: str) -> tuple[str | None, str | None]:
    """(repo id, GGUF file name or None) for a hub spec, or (None, None) if `text` cannot be one."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    parts = text.split("/")
    repo, filename = text, None
    if text.lower().endswith(".gguf") and len(parts) >= 3:
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None, None
    return repo, filename


def hub_cache_dir() -> Path:
    """The hub cache folder as huggingface_hub computes it, from the environment at call time."""
    env = os.environ.get
    home = env("HF_HOME") or os.path.join(
        env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    cache = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) now, or as huggingface_hub read it at import."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


# --- the three kinds ---------------------------------------------------------------------------------


def _no_revision(revision: str | None, why: str) -> None:
    if revision:
        raise ConfigError(
            f"model.revision={revision!r} applies to hub ids only, but {why}: unset model.revision"
        )


def _folder_source(folder: Path, spec: str | None) -> ModelSource:
    if not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf")) if folder.is_dir() else []
        hint = f" It holds {ggufs[0]}: pass that file instead." if ggufs else ""
        raise ModelNotFoundError(
            f"{folder} has no config.json: expected a Hugging Face model folder (config.json, *.safetensors, "
            f"tokenizer files).{hint}"
        )
    return ModelSource("folder", folder, spec)


def _gguf_source(
    file: Path, spec: str, name: str, repo_id: str | None = None, revision: str | None = None,
    commit: str | None = None,
) -> ModelSource:  # fmt: skip
    from pnyx.models.dequantize import _require_gguf, dequantized_folder

    _require_gguf()
    digest = fingerprint.file_digest(file)
    folder = dequantized_folder(file, digest)
    return ModelSource("gguf", folder, spec, repo_id, revision, commit, gguf_file=file, gguf_name=name)


def _hub_source(repo_id: str, revision: str | None, spec: str) -> ModelSource:
    from huggingface_hub import snapshot_download

    with _hub_errors(repo_id, revision, None):
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(),
                local_files_only=hub_offline(),
                allow_patterns=HUB_PATTERNS,
            )  # fmt: skip
        )
    source = _folder_source(folder, spec)
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{repo_id} ({folder}) has no *.safetensors weights: pnyx loads safetensors checkpoints from the hub; "
            "convert the model (transformers save_pretrained) into a folder and pass that folder"
        )
    return ModelSource("hub", source.folder, spec, repo_id, revision, commit=folder.name)


def _hub_gguf_source(repo_id: str, filename: str, revision: str | None, spec: str) -> ModelSource:
    from huggingface_hub import hf_hub_download

    with _hub_errors(repo_id, revision, filename):
        file = Path(
            hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                cache_dir=hub_cache_dir(),
                local_files_only=hub_offline(),
            )
        )
    snapshot = file.parents[len(Path(filename).parts) - 1]  # .../snapshots/<commit>/<filename>
    return _gguf_source(file, spec, filename, repo_id, revision, commit=snapshot.name)


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, filename: str | None) -> Iterator[None]:
    """Turn huggingface_hub's errors into a ModelNotFoundError saying what to do."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = repo_id + (f"/{filename}" if filename else "")
    at = f" at revision {revision!r}" if revision else ""
    fetch = (
        f"hf download {repo_id}"
        + (f" {filename}" if filename else "")
        + (f" --revision {revision}" if revision else "")
    )
    try:
        yield
    except LocalEntryNotFoundError as e:  # offline, or the hub unreachable, and not (completely) in the cache
        if hub_offline():
            raise ModelNotFoundError(
                f"{what}{at} is not a local path, not in the Hugging Face cache ({hub_cache_dir()}), and "
                "HF_HUB_OFFLINE is set, so "
                f"pnyx may not download it. Fetch it first on a machine with network access (`{fetch}`, with the "
                "same HF_HOME, then copy that cache here), or unset HF_HUB_OFFLINE to let pnyx download it."
            ) from e
        raise ModelNotFoundError(
            f"could not download {what}{at} and it is not in the Hugging Face cache ({hub_cache_dir()}): {e}. "
            f"Check the network (HF_ENDPOINT, proxies), or fetch it elsewhere with `{fetch}` and copy the cache."
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"{repo_id} has no revision {revision!r}: check model.revision") from e
    except RemoteEntryNotFoundError as e:
        raise ModelNotFoundError(f"{repo_id}{at} has no file {filename!r}: check the file name") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path, and the hub has no model of that name visible to you: check the "
            "path or id, or log in (`hf auth login` or HF_TOKEN) if it is private or gated"
        ) from e
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"the hub refused {what}{at}: {e}") from e


# --- the run's model on another machine --------------------------------------------------------------


def resolve_run_model(
    info: Mapping[str, Any], model_path: str | None = None, revision: str | None = None,
    override: str | Path | None = None, check: Literal["model", "tokenizer"] = "model",
) -> ModelSource:  # fmt: skip
    """The run's model (run.json's `model` record `info`) on this machine, checked against the run's.

    Resolution: `override` if given (a worker's `--model`); else what run.json names: a hub id pinned to the
    commit the trainer resolved, the GGUF file, the folder's path (the shipped tiny model: this install's);
    runs recorded before sources were `model_path`/`revision` (the run's config). `check="model"` refuses a
    copy whose files differ from the run's; `check="tokenizer"` (export, evaluation from the store) only
    requires the run's tokenizer and vocabulary, since the weights come from the store.
    """
    ident = info.get("source") or {}
    try:
        if override is not None:
            source = resolve_source(override)
        elif ident.get("kind") == "hub" or (ident.get("kind") == "gguf" and ident.get("id")):
            spec = ident["id"] if ident["kind"] == "hub" else f"{ident['id']}/{ident['file']}"
            source = resolve_source(spec, ident.get("commit") or ident.get("revision"))
        elif ident:
            source = resolve_source(None if ident.get("spec") is None else ident["path"])
        else:
            source = resolve_source(model_path, revision)
    except ModelNotFoundError as e:
        raise ConfigError(
            f"this machine does not have the run's model ({describe(ident) if ident else model_path}): {e}\n"
            "Give this process a copy of exactly that model (`pnyx worker --model PATH`, `pnyx export --model PATH`)."
        ) from e
    check_run_model(info, source, check)
    return source


def describe(ident: Mapping[str, Any]) -> str:
    """A human description of a recorded source identity."""
    kind, commit = ident.get("kind"), str(ident.get("commit") or "")[:12]
    if kind == "hub":
        return f"hub model {ident.get('id')} at commit {commit}"
    if kind == "gguf" and ident.get("id"):
        return f"GGUF file {ident.get('file')} of hub model {ident.get('id')} at commit {commit}"
    if kind == "gguf":
        return f"GGUF file {ident.get('path')}"
    return "the shipped tiny model" if ident.get("spec") is None else f"folder {ident.get('path')}"


def check_run_model(
    info: Mapping[str, Any], source: ModelSource, check: Literal["model", "tokenizer"] = "model"
) -> None:
    """Raise ConfigError naming every difference between `source` and the run's model record `info`."""
    ident = info.get("source") or {}
    problems: list[str] = []
    want = ident.get("digest")
    if check == "model" and want and source.digest != want:
        problems.append(f"model files: the run's digest {want[:16]}, here {source.digest[:16]}")
        problems += [f"  {line}" for line in _file_diff(ident.get("files") or {}, source.files)]
    want_tok = info.get("tokenizer_digest")
    have_tok = tokenizer_digest(source.folder)
    if want_tok and have_tok != want_tok:
        problems.append(
            f"tokenizer: the run's digest {want_tok[:16]}, here {have_tok[:16]} (token ids would differ)"
        )
    config = json.loads((source.folder / "config.json").read_text())
    for key in ("vocab_size", "model_type"):
        run_value, here = info.get(key), config.get(key, (config.get("text_config") or {}).get(key))
        if run_value is not None and here is not None and str(run_value) != str(here):
            problems.append(f"{key}: the run's {run_value!r}, here {here!r}")
    if problems:
        run_is = describe(ident) if ident else f"model {info.get('name') or info.get('path')}"
        raise ConfigError(
            f"this model is not the run's: the run uses {run_is}; this process resolved {source.kind} "
            f"{source.gguf_file or source.folder}.\n  "
            + "\n  ".join(problems)
            + "\nUse exactly the run's model: run without --model to resolve the one run.json names, or pass "
            "a byte-identical copy of it with --model PATH."
        )


def _file_diff(want: Mapping[str, str], have: Mapping[str, str]) -> list[str]:
    out = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            out.append(f"{name}: missing here")
        elif name not in want:
            out.append(f"{name}: only here")
        elif want[name] != have[name]:
            out.append(f"{name}: different content")
    return out


def resolve_model_source(cfg: PnyxConfig) -> ModelSource:
    """The configured model (`model.path`, `model.revision`; unset: the shipped tiny model) resolved: a hub
    id is downloaded (online) or found in the cache, a GGUF file converted once. Raises ModelNotFoundError
    or ConfigError with what to do."""
    return resolve_source(cfg.model.path, cfg.model.revision)


def resolve_model_path(cfg: PnyxConfig) -> Path:
    """The local folder of the configured model (see `resolve_model_source`)."""
    return resolve_model_source(cfg).folder
