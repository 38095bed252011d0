"""BM25 retrieval over a small document corpus (`bm25s`), the search tool of `searchqa`.

Knows nothing about questions, rewards or models. Invariants: the index is built once per corpus and
is read-only afterwards (safe to query from several threads); a query is capped in length before
tokenizing; documents that share no term with the query (score 0) are never returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pnyx.envs.dataset import iter_jsonl
from pnyx.errors import ConfigError

MAX_QUERY_CHARS = 256


@dataclass(frozen=True)
class Doc:
    """One corpus document: a stable id, a title and a short text."""

    id: str
    title: str
    text: str

    def render(self) -> str:
        """How the tool shows this document to the model: the text, prefixed by the title unless the
        text already names it (the synthetic world's documents do)."""
        return self.text if self.title in self.text else f"{self.title}: {self.text}"


def read_corpus(path: str | Path) -> list[Doc]:
    """Documents from a JSONL file of `{"id", "title", "text"}` objects (id defaults to the line number)."""
    docs: list[Doc] = []
    for lineno, row in iter_jsonl(path, "corpus", hint="pass corpus_path= a JSONL of {id, title, text}"):
        if "text" not in row:
            raise ConfigError(
                f"{path}:{lineno}: expected a JSON object with a 'text' field, got keys {sorted(row)}"
            )
        docs.append(
            Doc(id=str(row.get("id", lineno)), title=str(row.get("title", "")), text=str(row["text"]))
        )
    if not docs:
        raise ConfigError(f"corpus file {path} has no documents")
    return docs


class BM25Index:
    """A BM25 index over the title and text of each document."""

    def __init__(self, docs: list[Doc]):
        import bm25s  # imported here: only environments that search need it

        if not docs:
            raise ConfigError("cannot index an empty corpus")
        self.docs = docs
        self._bm25s = bm25s
        tokens = bm25s.tokenize([f"{d.title} {d.text}" for d in docs], stopwords="en", show_progress=False)
        self._retriever = bm25s.BM25()
        self._retriever.index(tokens, show_progress=False)

    def search(self, query: str, k: int) -> list[Doc]:
        """The top-`k` documents for `query`, best first; [] when nothing matches."""
        query = query[:MAX_QUERY_CHARS]
        # Query tokens as strings, not ids: ids from a second tokenize() call would use another vocabulary.
        q = self._bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)
        if not q[0]:
            return []
        k = max(1, min(k, len(self.docs)))
        ids, scores = self._retriever.retrieve(q, k=k, show_progress=False, n_threads=1)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0], strict=True) if s > 0]
