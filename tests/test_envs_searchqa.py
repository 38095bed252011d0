"""`searchqa`: the synthetic world, the BM25 tool, the transcript format, cover-EM, user corpora."""

from __future__ import annotations

import json

import pytest

from pnyx.envs import get_env
from pnyx.envs.world import make_world
from pnyx.errors import ConfigError


@pytest.fixture(scope="module")
def env():
    return get_env("searchqa", num_people=300)


def test_world_is_seeded_with_unique_names_and_short_documents():
    world = make_world(seed=3, num_people=400)
    assert world == make_world(seed=3, num_people=400)
    assert world != make_world(seed=4, num_people=400)
    assert len({p.name for p in world.people}) == 400
    assert max(len(d.text) for d in world.documents()) <= 120


def test_exact_title_query_returns_that_document(env):
    for doc in env.index.docs:
        assert env.retrieve(doc.title, k=1)[0] == doc


def test_respond_answers_the_trailing_search_with_top_k_documents(env):
    task = env.sample("train", seed=0, n=1)[0]
    name = task.meta["query"]
    reply = env.respond(task, f"<search>{name}</search>")
    assert reply is not None and reply.startswith("<information>") and reply.endswith("</information>")
    assert reply.count(" was born in ") == 1 and name in reply
    assert env.respond(task, "thinking, no tool call") is None
    assert env.respond(task, "<search>zzqx</search>") == "<information></information>"


def test_top_k_returns_k_documents():
    env3 = get_env("searchqa", num_people=50, top_k=3)
    task = env3.sample("train", seed=0, n=1)[0]
    assert env3.respond(task, "<search>born works</search>").count(" was born in ") == 3


def test_prompt_and_reference_transcript_format(env):
    task = next(t for t in env.sample("train", seed=0, n=20) if t.meta["attribute"] == "city")
    name = task.meta["query"]
    assert task.prompt == [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": f"Question: Where was {name} born?"},
    ]
    turns = env.reference_completion(task)
    assert [r for r, _ in turns] == ["model", "tool", "model"]
    assert turns[0][1] == f"<search>{name}</search>"
    assert turns[2][1] == f"<answer>{task.answer[0]}</answer>"
    assert env.tool_stops == ["</search>"] and env.stop_strings == ["</answer>"] and env.max_turns == 2


def test_answer_inside_retrieved_information_does_not_count(env):
    task = env.sample("train", seed=0, n=1)[0]
    text = f"<search>x</search><information><answer>{task.answer[0]}</answer></information>"
    assert env.score(task, text).reward == 0.0


def test_cover_em_accepts_a_sentence_containing_the_gold(env):
    task = env.sample("train", seed=0, n=1)[0]
    score = env.score(task, f"<answer>The answer is {task.answer[0]}.</answer>")
    assert score.reward == 1.0
    assert score.parts["searched"] == 0.0 and score.parts["num_searches"] == 0.0
    assert score.parts["answer_len"] == 4.0


def test_cover_em_needs_whole_words(env):
    task = env.sample("train", seed=0, n=1)[0]
    assert env.score(task, f"<answer>{task.answer[0]}x</answer>").reward == 0.0


def test_search_counts_are_reported(env):
    task = env.sample("train", seed=0, n=1)[0]
    text = "<search>a</search><information></information><search>b</search><information></information>"
    score = env.score(task, text + f"<answer>{task.answer[0]}</answer>")
    assert score.parts["num_searches"] == 2.0 and score.parts["searched"] == 1.0 and score.reward == 1.0


def test_overlong_answer_listing_candidates_scores_zero(env):
    task = env.sample("train", seed=0, n=1)[0]
    cities = " ".join({p.city for p in env.world.people} | {task.answer[0]})
    score = env.score(task, f"<answer>{cities} {task.answer[0]}</answer>")
    assert score.reward == 0.0 and score.reason == "answer_too_long"


def _write_corpus(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    qa = tmp_path / "qa.jsonl"
    docs = [
        {"id": f"d{i}", "title": f"Planet {n}", "text": f"Planet {n} has {i + 2} moons."}
        for i, n in enumerate(["Ardo", "Belun", "Cyrrh", "Dovra", "Esk", "Farro", "Gint", "Hool"])
    ]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    rows = [
        {"question": f"How many moons does {d['title']} have?", "answer": [str(i + 2), f"{i + 2} moons"]}
        for i, d in enumerate(docs)
    ]
    rows += [
        {"question": f"Which planet has {i + 2} moons?", "answer": d["title"]} for i, d in enumerate(docs)
    ]
    qa.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(corpus), str(qa)


def test_user_corpus_and_qa_files(tmp_path):
    corpus, qa = _write_corpus(tmp_path)
    env = get_env("searchqa", corpus_path=corpus, qa_path=qa, test_fraction=0.3)
    assert env.top_k == 3
    train, test = env.sample("train", seed=0, n=30), env.sample("test", seed=0, n=10)
    assert not {t.id for t in train} & {t.id for t in test}
    task = train[0]
    assert task.prompt[-1]["content"].startswith("Question: ") and "<search>" in task.prompt[0]["content"]
    assert get_env("searchqa", corpus_path=corpus, qa_path=qa, test_fraction=0.3).task(task.id) == task
    assert env.score(task, f"<answer>{task.answer[-1]}</answer>").reward == 1.0
    assert env.retrieve("Planet Dovra", k=1)[0].id == "d3"


def test_corpus_without_qa_is_a_config_error(tmp_path):
    corpus, _ = _write_corpus(tmp_path)
    with pytest.raises(ConfigError, match="both"):
        get_env("searchqa", corpus_path=corpus)
