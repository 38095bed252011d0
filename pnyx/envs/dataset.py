"""Question/answer datasets from files: reading JSONL, splitting by question hash, seeded streams.

Shared by the file-backed environments (`gsm8k`, `searchqa` with a user corpus). Knows nothing about
scoring. Invariants: an item's split is a function of its question text alone (so train and test never
share a question, whatever the file order); its key (a hash of the question) is the task id's last
field, so a task id keeps naming the same question if the file is reordered or extended.
"""

from __future__ import annotations

import json
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


def question_key(question: str) -> str:
    return f"{stable_hash('question', question.strip()):016x}"


def iter_jsonl(path: str | Path, what: str, hint: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file of objects; `ConfigError` naming the
    file and line for a missing file, a line that is not JSON, or one that is not an object. `hint` is
    appended to the missing-file message (what the file should be)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file {p} does not exist" + (f": {hint}" if hint else ""))
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
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


class QADataset:
    """Items split into train/test by question hash, each split streamed in a seeded order per epoch."""

    def __init__(self, rows: list[dict[str, Any]], test_fraction: float, salt: str, source: str = "dataset"):
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.by_key: dict[str, QAItem] = {}
        self.splits: dict[str, list[QAItem]] = {"train": [], "test": []}
        for i, row in enumerate(rows):
            q, a = row.get("question"), row.get("answer")
            if not isinstance(q, str) or not q.strip() or a is None:
                raise ConfigError(f"{source} row {i}: expected a non-empty 'question' string and an 'answer'")
            key = question_key(q)
            if key in self.by_key:
                continue  # a duplicated question is one item (it must not land in both splits)
            item = QAItem(key=key, question=q.strip(), answer=a, row=row)
            self.by_key[key] = item
            self.splits[split_of(item.question, test_fraction, salt=salt)].append(item)
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
            order = list(range(len(self.splits[split])))
            seeded_rng(self.salt, split, seed, epoch).shuffle(order)
            self._orders[cache_key] = order
        return self._orders[cache_key]

    def get(self, key: str) -> QAItem:
        if key not in self.by_key:
            raise ConfigError(
                f"no question with key {key!r} in this dataset: was the task made from another file?"
            )
        return self.by_key[key]
