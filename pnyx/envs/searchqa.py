"""`searchqa`: question answering that needs retrieval, with a BM25 search tool (Search-R1 protocol).

The system prompt states the protocol: the model calls `<search>query</search>` (the engine stops there),
`respond` answers with the top-k documents in `<information>...</information>`, and the model ends with
`<answer>...</answer>`. An ideal episode on the default synthetic world (`world.py`):

    <search>Zorvan Keel</search><information>Zorvan Keel was born in Tamsk in 1843. Zorvan Keel works
    as a potter.</information><answer>Tamsk</answer>

Reward is cover-EM: some normalized gold answer is contained, as whole words, in the normalized last
answer; parts `correct`, `format`, `searched`, `num_searches`, `answer_len` (words). Two sources:
- default: a seeded synthetic world (`world_seed`, `num_people`), ids `searchqa/<split>/<seed>/<index>`;
- `corpus_path` + `qa_path`: any JSONL corpus `{"id", "title", "text"}` and QA file
  `{"question", "answer": str | [str]}`, split by question hash, ids `searchqa/<split>/<question key>`.

Knows nothing about models. Invariants: the answer is read only from the model's own text (the
`<information>` spans are removed first, so a retrieved document can never answer for the model); an
answer longer than `max_answer_chars` scores 0, so listing every candidate is not rewarded.
"""

from __future__ import annotations

from collections.abc import Hashable

from pnyx.envs.base import (
    Environment,
    Score,
    Split,
    Task,
    check_fraction,
    check_split,
    parse_procedural_id,
    parse_task_id,
    seeded_rng,
    split_of,
    zero,
)
from pnyx.envs.dataset import QADataset, read_jsonl
from pnyx.envs.parsing import count_tag, cover_em, find_tags, last_answer, strip_spans
from pnyx.envs.retrieval import BM25Index, Doc, read_corpus
from pnyx.envs.world import QUESTIONS, make_world
from pnyx.errors import ConfigError

SYSTEM_PROMPT = (
    "Look facts up with <search>query</search>; results come back in <information>...</information>. "
    "Give the final answer in answer tags, e.g. <answer>Paris</answer>."
)
_MAX_ATTEMPTS = 100_000


class SearchQAEnv(Environment):
    """Question answering over a BM25-searched corpus (<search>, <information>, <answer>); cover-EM reward."""

    name = "searchqa"
    system_prompt = SYSTEM_PROMPT
    max_new_tokens = 128  # per model turn: a search call, or a short answer after some reasoning
    stop_strings = ["</answer>"]
    tool_stops = ["</search>"]
    part_names = ("correct", "format", "searched", "num_searches", "answer_len")

    def __init__(
        self,
        world_seed: int = 0,
        num_people: int = 500,
        corpus_path: str | None = None,
        qa_path: str | None = None,
        top_k: int | None = None,
        max_turns: int = 2,
        test_fraction: float = 0.1,
        max_answer_chars: int = 128,
    ):
        if (corpus_path is None) != (qa_path is None):
            raise ConfigError(
                "searchqa needs both corpus_path and qa_path (or neither, for the synthetic world)"
            )
        if max_turns < 1:
            raise ConfigError(f"searchqa max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.max_answer_chars = max_answer_chars
        self.test_fraction = check_fraction(test_fraction)
        self.dataset: QADataset | None = None
        if corpus_path is None:
            self.world = make_world(world_seed, num_people)
            docs = self.world.documents()
            self.top_k = 1 if top_k is None else top_k
        else:
            self.world = None
            assert qa_path is not None  # both or neither, checked above
            docs = read_corpus(corpus_path)
            rows = read_jsonl(qa_path, "QA")
            self.dataset = QADataset(rows, test_fraction, salt=self.name, source=str(qa_path))
            self.top_k = 3 if top_k is None else top_k
        if self.top_k < 1:
            raise ConfigError(f"searchqa top_k must be >= 1, got {self.top_k}")
        self.index = BM25Index(docs)

    # --- tasks ------------------------------------------------------------------------------

    def _prompt(self, question: str) -> list[dict[str, str]]:
        return self.chat(f"Question: {question}")

    def _world_task(self, split: Split, seed: int, index: int) -> Task:
        assert self.world is not None
        attrs = sorted(QUESTIONS)
        for attempt in range(_MAX_ATTEMPTS):
            rng = seeded_rng(self.name, split, seed, index, attempt)
            person = rng.choice(self.world.people)
            attr = rng.choice(attrs)
            if split_of(f"{person.name}|{attr}", self.test_fraction, salt=self.name) == split:
                question = QUESTIONS[attr].format(name=person.name)
                return Task(
                    id=f"{self.name}/{split}/{seed}/{index}",
                    prompt=self._prompt(question),
                    answer=[person.attribute(attr)],
                    meta={"question": question, "query": person.name, "attribute": attr},
                )
        raise ConfigError(f"searchqa could not draw a {split} question; enlarge the world or test_fraction")

    def _file_task(self, split: Split, key: str) -> Task:
        assert self.dataset is not None
        item = self.dataset.get(key)
        golds = item.answer if isinstance(item.answer, list) else [item.answer]
        return Task(
            id=f"{self.name}/{split}/{item.key}",
            prompt=self._prompt(item.question),
            answer=[str(g) for g in golds],
            meta={"question": item.question, "query": item.question},
        )

    def sample(self, split: Split, seed: int, n: int, start: int = 0) -> list[Task]:
        check_split(split)
        if self.dataset is None:
            return [self._world_task(split, seed, i) for i in range(start, start + n)]
        return [self._file_task(split, self.dataset.at(split, seed, i).key) for i in range(start, start + n)]

    def task(self, task_id: str) -> Task:
        if self.dataset is None:
            return self._world_task(*parse_procedural_id(task_id, self.name))
        split, key = parse_task_id(task_id, self.name, 2)
        task = self._file_task(check_split(split), key)
        if task.id != task_id:
            raise ConfigError(f"task id {task_id!r} names the wrong split for its question")
        return task

    def level_of(self, task: Task) -> Hashable | None:
        """The asked attribute (`city`, `year`, `job`) in the synthetic world: each is its own skill (copying a
        made-up city name, a four-digit year, a common word), learned at its own pace. None for a user corpus."""
        return task.meta.get("attribute")

    def problem_key(self, task: Task) -> Hashable:
        """The question: the synthetic world's stream asks the same question under many task ids."""
        return task.meta["question"]

    # --- the tool ---------------------------------------------------------------------------

    def retrieve(self, query: str, k: int | None = None) -> list[Doc]:
        return self.index.search(query, self.top_k if k is None else k)

    def respond(self, task: Task, text_so_far: str) -> str | None:
        """`<information>doc ...</information>` for the `<search>` call the text ends with, else None."""
        tail = text_so_far[-4096:].rstrip()
        if not tail.endswith("</search>"):
            return None
        start = tail.rfind("<search>")
        if start < 0:
            return None
        query = tail[start + len("<search>") : -len("</search>")]
        docs = self.retrieve(query)
        return "<information>" + " ".join(d.render() for d in docs) + "</information>"

    # --- scoring ----------------------------------------------------------------------------

    def grade(self, task: Task, text: str) -> Score:
        # Only the model's own words count: retrieved documents could contain the answer verbatim.
        own = strip_spans(text, "information")
        num_searches = float(count_tag(own, "search"))
        searched = float(num_searches > 0)
        ans = last_answer(own)
        parts: dict[str, float] = {"searched": searched, "num_searches": num_searches}
        if ans.text is None:
            return zero(ans.missing_reason, correct=0, format=0, answer_len=0, **parts)
        parts["answer_len"] = float(len(ans.text.split()))
        fmt = float(ans.count == 1 and ans.well_formed and find_tags(own, "search").balanced)
        if len(ans.text) > self.max_answer_chars:
            return zero("answer_too_long", correct=0, format=fmt, **parts)
        correct = float(cover_em(ans.text, task.answer))
        return Score(
            reward=correct,
            parts={"correct": correct, "format": fmt, **parts},
            reason=None if correct else "wrong_answer",
        )

    def reference_completion(self, task: Task) -> list[tuple[str, str]]:
        """The ideal episode as turns: ("model", "<search>NAME</search>"), ("tool", "<information>...
        </information>"), ("model", "<answer>GOLD</answer>"). Concatenated, they are the full completion."""
        call = f"<search>{task.meta['query']}</search>"
        reply = self.respond(task, call) or ""
        return [("model", call), ("tool", reply), ("model", f"<answer>{task.answer[0]}</answer>")]

    def describe(self) -> str:
        source = "synthetic world" if self.dataset is None else "user corpus"
        return f"{super().describe()} [{source}, top_k={self.top_k}]"
