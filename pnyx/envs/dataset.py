"""Question/answer datasets: reading rows (JSONL, parquet, Arrow, a hub id), splitting by question hash,
seeded streams.

Shared by the file-backed environments (`qa`, `gsm8k`, `searchqa` with a user corpus). Knows nothing about
scoring. JSONL needs nothing beyond the standard library; parquet and Arrow files are read with pyarrow
and hub ids with Hugging Face `datasets` (the optional extra `pnyx[datasets]` installs both), imported
only when such a source is asked for. Invariants: an item's split is a function of its question text
alone (so train and test never share a question, whatever the file order or format); its key (a hash of
the question) is the task id's last field, so a task id keeps naming the same question if the file is
reordered, extended or converted to another format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnyx.envs.base import Split, check_split, seeded_rng, split_of, stable_hash
from pnyx.errors import ConfigError


@dataclass(frozen=True)
class QAItem:
    key: str
    question: str
    answer: Any
    row: dict[str, Any]
    split: Split


def question_key(question: str) -> str:
    return f"{stable_hash('question', question.strip()):016x}"


def iter_jsonl(path: str | Path, what: str, hint: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file of objects; `ConfigError` naming the
    file and line for a missing file, a line that is not UTF-8 JSON, or one that is not an object. `hint` is
    appended to the missing-file message (what the file should be)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file {p} does not exist" + (f": {hint}" if hint else ""))
    with p.open("rb") as f:  # decoded line by line, so that a binary file's error names its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # a binary file (a parquet file under another suffix, say)
                raise ConfigError(f"{p}:{lineno}: not UTF-8 text, so not JSONL ({e})") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise ConfigError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def read_jsonl(path: str | Path, what: str) -> list[dict[str, Any]]:
    """Every object of a JSONL file (see `iter_jsonl`)."""
    return [row for _, row in iter_jsonl(path, what)]


def seeded_order(size: int, *parts: object) -> list[int]:
    """0 .. size-1 shuffled by `seeded_rng(*parts)`: one epoch of a seeded stream over `size` items."""
    order = list(range(size))
    seeded_rng(*parts).shuffle(order)
    return order


INSTALL_HINT = "pip install 'pnyx[datasets]'"
FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
}
"""What a data file's suffix says it holds. An existing file with another suffix (`.json`, `.txt`) is read
as JSONL; a `data` string that is no file and has none of these suffixes is read as a hub dataset id."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_DATA_HINT = "pass data= a .jsonl, .parquet or .arrow file, or a Hugging Face hub dataset id org/name"


def read_rows(
    data: str | Path,
    what: str,
    columns: tuple[str, str] = ("question", "answer"),
    split: str | None = None,
    subset: str | None = None,
) -> list[dict[str, Any]]:
    """The rows of a question/answer source: a JSONL, parquet or Arrow (IPC file or stream) file by its
    suffix (`FORMATS`; an existing file with any other suffix, `.json` or `.txt`, is read as JSONL), else a
    hub dataset id `org/name` read with `datasets.load_dataset(data, subset, split=split or "train")`
    (under `HF_DATASETS_OFFLINE=1`, from the local datasets cache alone).

    Rows of a table hold only `columns`, which the table must have (checked before reading it); JSONL rows
    are returned whole (`QADataset` checks each). `ConfigError`, with what to do, for a missing file, a
    file that is not what its suffix says (a line that is not JSON named by file:line), `split`/`subset`
    given for a file, a missing column, a hub dataset that is neither cached nor reachable, or a missing
    optional dependency (`pnyx[datasets]`)."""
    text = str(data)
    path = Path(text).expanduser()
    fmt = FORMATS.get(path.suffix.lower())
    if path.exists() or fmt is not None or not _HUB_ID.fullmatch(text):
        if split is not None or subset is not None:
            raise ConfigError(
                f"{what}: split= and subset= choose the rows of a hub dataset; {text} is a file"
            )
        return _file_rows(path, fmt, what, columns)
    return _hub_rows(text, what, columns, split, subset)


def _file_rows(path: Path, fmt: str | None, what: str, columns: tuple[str, str]) -> list[dict[str, Any]]:
    if not path.is_file():
        problem = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"{what} data file {path} {problem}: {_DATA_HINT}")
    if fmt is None or fmt == "jsonl":  # any other suffix (`gsm8k_train.json`, `.txt`) is JSONL too
        return read_jsonl(path, what)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"reading the {fmt} file {path} needs pyarrow: {INSTALL_HINT}") from e
    wanted = list(dict.fromkeys(columns))
    try:
        if fmt == "parquet":
            # the schema first: only the two columns are read, and a missing one is named before any reading
            check_columns(pq.read_schema(str(path)).names, columns, str(path))
            return pq.read_table(str(path), columns=wanted).to_pylist()
        with pa.OSFile(str(path)) as f:
            try:  # the IPC file format (Feather v2, `.arrow` from pyarrow)
                table = pa.ipc.open_file(f).read_all()
            except pa.ArrowInvalid:  # the IPC stream format (`.arrow` files from `datasets`)
                f.seek(0)
                table = pa.ipc.open_stream(f).read_all()
    except pa.ArrowException as e:
        raise ConfigError(f"{path}: not a readable {fmt} file ({e})") from e
    check_columns(table.column_names, columns, str(path))
    return table.select(wanted).to_pylist()


def _hub_rows(
    repo_id: str, what: str, columns: tuple[str, str], split: str | None, subset: str | None
) -> list[dict[str, Any]]:
    try:
        import datasets
        from datasets import config as datasets_config
        from datasets.exceptions import DatasetsError
    except ImportError as e:
        raise ConfigError(
            f"{what}: {repo_id!r} is no file, so it is read as a hub dataset id, which needs Hugging Face "
            f"datasets: {INSTALL_HINT} (or {_DATA_HINT})"
        ) from e
    split = split or "train"
    source = f"hub dataset {repo_id}" + (f" subset {subset}" if subset else "") + f" split {split}"
    try:
        ds = datasets.load_dataset(repo_id, subset, split=split)
    except ConnectionError as e:
        cache = datasets_config.HF_DATASETS_CACHE
        raise ConfigError(
            f"{what}: {source} is not in the local datasets cache ({cache}) and the Hub was not reached "
            f'({e}). On a machine with network, run python -c "import datasets; datasets.load_dataset('
            f"'{repo_id}', {subset!r}, split='{split}')\", copy its datasets cache folder (HF_DATASETS_CACHE, "
            f"by default under HF_HOME) to {cache} here and set HF_DATASETS_OFFLINE=1; or save the rows there "
            "with .to_parquet('qa.parquet') and pass that file as data="
        ) from e
    except (FileNotFoundError, ValueError, DatasetsError) as e:
        raise ConfigError(f"{what}: cannot read {source}: {e}") from e
    if not isinstance(ds, datasets.Dataset):
        raise ConfigError(f"{what}: {source} is a {type(ds).__name__}, not one table; name one split")
    check_columns(ds.column_names, columns, source)
    return ds.select_columns(list(dict.fromkeys(columns))).to_list()


def check_columns(names: list[str], columns: tuple[str, str], source: str) -> None:
    """`ConfigError` naming the first of `columns` missing from a table's column `names`, and those names."""
    for column in columns:
        if column not in names:
            raise ConfigError(
                f"{source} has no column {column!r}; its columns: {', '.join(names)}. The environment's "
                "question_column= and answer_column= options name the question and answer columns"
            )


class QADataset:
    """Items split into train/test by question hash, each split streamed in a seeded order per epoch.

    `question` and `answer` name the fields of a row that hold the question text and its answer."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        test_fraction: float,
        salt: str,
        source: str = "dataset",
        question: str = "question",
        answer: str = "answer",
    ):
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.by_key: dict[str, QAItem] = {}
        self.splits: dict[str, list[QAItem]] = {"train": [], "test": []}
        for i, row in enumerate(rows):
            q, a = row.get(question), row.get(answer)
            if not isinstance(q, str) or not q.strip() or a is None:
                fields = ", ".join(repr(k) for k in list(row)[:12])
                raise ConfigError(
                    f"{source} row {i}: expected a non-empty {question!r} string and a non-null {answer!r}; "
                    f"the row has {fields or 'no fields'} (question_column=/answer_column= name other fields)"
                )
            key = question_key(q)
            if key in self.by_key:
                continue  # a duplicated question is one item (it must not land in both splits)
            text = q.strip()
            item = QAItem(key, text, a, row, split_of(text, test_fraction, salt=salt))
            self.by_key[key] = item
            self.splits[item.split].append(item)
        for split, items in self.splits.items():
            if not items:
                raise ConfigError(
                    f"{source}: the {split} split is empty ({len(self.by_key)} questions, "
                    f"test_fraction={test_fraction}); add questions or change test_fraction"
                )
        self.salt = salt
        self._orders: dict[tuple[str, int, int], list[int]] = {}

    def at(self, split: Split, seed: int, index: int) -> QAItem:
        """Item `index` of the stream for (split, seed): a fresh seeded permutation every epoch."""
        items = self.splits[check_split(split)]
        epoch, pos = divmod(index, len(items))
        return items[self._order(split, seed, epoch)[pos]]

    def _order(self, split: str, seed: int, epoch: int) -> list[int]:
        cache_key = (split, seed, epoch)
        if cache_key not in self._orders:
            if len(self._orders) > 64:
                self._orders.clear()
            self._orders[cache_key] = seeded_order(len(self.splits[split]), self.salt, split, seed, epoch)
        return self._orders[cache_key]

    def get(self, key: str, split: Split | None = None) -> QAItem:
        """The item with this key; `ConfigError` if there is none, or if `split` is given and is not its
        split (a task id naming a train question as a test task)."""
        if key not in self.by_key:
            raise ConfigError(
                f"no question with key {key!r} in this dataset: was the task made from another file?"
            )
        item = self.by_key[key]
        if split is not None and item.split != split:
            raise ConfigError(f"question {key!r} is in the {item.split} split, not {split}")
        return item
