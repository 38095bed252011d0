"""Question/answer data from files and the hub: parquet and Arrow files with a column mapping, a hub id read
from the offline datasets cache, the errors that say what to do, the `qa` environment's checkers, and
`pnyx run` training on a parquet file (real processes).

The hub cache is built here, with no network, by `datasets`' own builder: a local dataset repository (a
folder of parquet files, as on the Hub) prepared under the hub id `pnyx-test/arith-qa`, which is the
folder layout (`<cache>/pnyx-test___arith-qa/default/0.0.0/<hash>/`) that an online
`load_dataset("pnyx-test/arith-qa")` leaves behind and that an offline one reads.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_envs_common import HOSTILE

from pnyx.config import shipped_model_path
from pnyx.envs import Score, Task, dataset, get_env
from pnyx.envs.base import split_of
from pnyx.envs.dataset import question_key
from pnyx.envs.qa import exact_equal
from pnyx.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
HUB_ID = "pnyx-test/arith-qa"
MAPPING = {"question_column": "problem", "answer_column": "result"}


def arith_rows(n: int, seed: int = 0) -> list[dict]:
    """`Compute 37+48.` problems (the shipped tiny model's task) under the column names problem/result."""
    rng = random.Random(seed)
    problems = sorted({(rng.randint(10, 99), rng.choice("+-"), rng.randint(10, 99)) for _ in range(n)})
    return [
        {"problem": f"Compute {a}{op}{b}.", "result": a + b if op == "+" else a - b, "source": "test"}
        for a, op, b in problems
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def user_turn(task: Task) -> str:
    return task.prompt[-1]["content"] if isinstance(task.prompt, list) else task.prompt


def all_tasks(env) -> list[Task]:
    return [env.task(f"{env.name}/{split}/{item.key}") for split in ("train", "test") for item in env.dataset.splits[split]]  # fmt: skip


# --- files ------------------------------------------------------------------------------------------------


def test_parquet_file_with_other_column_names_is_read_through_the_mapping(tmp_path):
    rows = arith_rows(60)
    env = get_env("qa", data=str(write_parquet(tmp_path / "a.parquet", rows)), checker="numeric", **MAPPING)
    gold = {r["problem"]: str(r["result"]) for r in rows}
    tasks = all_tasks(env)
    assert len(tasks) == len(rows)
    for task in tasks:
        assert task.answer == gold[user_turn(task)]
        assert env.score(task, f"<answer>{task.answer}</answer>").reward == 1.0
    assert {tuple(item.row) for item in env.dataset.by_key.values()} == {("problem", "result")}  # only those


def test_arrow_files_in_the_ipc_file_and_stream_formats_are_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    rows = arith_rows(40)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink:  # Feather v2 / the IPC file format
        table = pa.Table.from_pylist(rows)
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))  # the IPC stream format
    (stream,) = (tmp_path / "saved").glob("*.arrow")
    want = {r["problem"] for r in rows}
    for path in (tmp_path / "file.arrow", stream):
        env = get_env("qa", data=str(path), checker="numeric", **MAPPING)
        assert {user_turn(t) for t in all_tasks(env)} == want, path


def test_task_ids_name_the_same_question_whatever_the_format_or_order(tmp_path):
    rows = arith_rows(60)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = write_parquet(tmp_path / "b.parquet", list(reversed(rows)))
    a = get_env("qa", data=str(jsonl), checker="numeric", **MAPPING)
    b = get_env("qa", data=str(parquet), checker="numeric", **MAPPING)
    tasks = a.sample("train", seed=0, n=20) + a.sample("test", seed=0, n=5)
    for task in tasks:
        assert b.task(task.id) == task
        assert task.id.rsplit("/", 1)[1] == question_key(user_turn(task))
        assert task.id.split("/")[1] == split_of(user_turn(task), 0.2, salt="qa")


def test_gsm8k_reads_a_parquet_file_through_the_mapping_too(tmp_path):
    rows = [{"q": f"Tom has {i} apples and buys {i} more. How many?", "sol": f"{i}+{i}\n#### {2 * i}"} for i in range(30)]  # fmt: skip
    env = get_env(
        "gsm8k",
        data=str(write_parquet(tmp_path / "g.parquet", rows)),
        question_column="q",
        answer_column="sol",
    )
    task = env.sample("train", seed=0, n=1)[0]
    assert env.score(task, f"so \\boxed{{{task.answer}}}").reward == 1.0
    with pytest.raises(ConfigError, match="older name"):
        get_env("gsm8k", data=str(tmp_path / "g.parquet"), path=str(tmp_path / "g.parquet"))


def test_gsm8k_reads_a_data_file_with_any_other_suffix_as_jsonl(tmp_path, monkeypatch):
    """`gsm8k path=gsm8k_train.json` (JSONL under another name) loads as it did before parquet support."""
    rows = [{"question": f"Tom has {i} apples and buys {i} more. How many?", "answer": f"{i}+{i}\n#### {2 * i}"} for i in range(30)]  # fmt: skip
    for name in ("gsm8k_train.json", "gsm8k_train.txt", "gsm8k_train"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        env = get_env("gsm8k", path=str(tmp_path / name))
        assert len(all_tasks(env)) == 30, name
    hub_ids: list[str] = []
    monkeypatch.setattr(dataset, "_hub_rows", lambda repo_id, *args: hub_ids.append(repo_id) or rows)
    get_env("gsm8k", data="pnyx-test/no-such-file")  # no such file: still a hub dataset id
    assert hub_ids == ["pnyx-test/no-such-file"]


# --- the errors ---------------------------------------------------------------------------------------------


def test_a_missing_column_is_named_with_the_columns_the_file_has(tmp_path):
    path = str(write_parquet(tmp_path / "a.parquet", arith_rows(20)))
    with pytest.raises(ConfigError, match="no column 'question'; its columns: problem, result, source"):
        get_env("qa", data=path)
    with pytest.raises(ConfigError, match="no column 'answer'"):
        get_env("qa", data=path, question_column="problem")
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"problem": "Compute 1+1.", "result": 2}) + "\n")
    with pytest.raises(ConfigError, match="expected a non-empty 'question' string.*'problem', 'result'"):
        get_env("qa", data=str(jsonl))


def test_a_missing_file_or_one_that_is_not_jsonl_under_another_suffix_is_a_config_error(tmp_path):
    for data in (str(tmp_path / "none.parquet"), str(tmp_path / "none.arrow"), "no-such-file"):
        with pytest.raises(ConfigError, match="does not exist"):
            get_env("qa", data=data)
    (tmp_path / "qa.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match=r"qa\.csv:1: not valid JSON"):
        get_env("qa", data=str(tmp_path / "qa.csv"))
    binary = write_parquet(tmp_path / "qa.parquet", arith_rows(20)).rename(tmp_path / "qa.bin")
    with pytest.raises(ConfigError, match=r"qa\.bin:1: not UTF-8 text, so not JSONL"):
        get_env("qa", data=str(binary))
    with pytest.raises(ConfigError, match="needs data="):
        get_env("qa")


def test_without_the_datasets_extra_jsonl_works_and_the_rest_names_the_extra(tmp_path):
    """In a fresh process where pyarrow and datasets cannot be imported (as when not installed)."""
    rows = arith_rows(30)
    parquet = write_parquet(tmp_path / "a.parquet", rows)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = f"""
import json, sys
sys.modules.update(dict.fromkeys(["pyarrow", "pyarrow.parquet", "datasets"]))  # None: ImportError
from pnyx.envs import get_env
from pnyx.errors import ConfigError
env = get_env("qa", data={str(jsonl)!r}, checker="numeric", **{MAPPING!r})
errors = []
for data in ({str(parquet)!r}, {HUB_ID!r}):
    try:
        get_env("qa", data=data, **{MAPPING!r})
    except ConfigError as e:
        errors.append(str(e))
print(json.dumps({{"tasks": sum(map(len, env.dataset.splits.values())), "errors": errors}}))
"""
    child = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tasks"] == len(rows) and len(out["errors"]) == 2
    assert all("pip install 'pnyx[datasets]'" in e for e in out["errors"]), out["errors"]


# --- the hub, through the offline datasets cache ------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A datasets cache holding HUB_ID (splits train and test), as an online `load_dataset` leaves it."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hub")
    repo = root / "repo" / HUB_ID.split("/")[1]
    (repo / "data").mkdir(parents=True)
    rows = arith_rows(80)
    write_parquet(repo / "data" / "train-00000-of-00001.parquet", rows[:60])
    write_parquet(repo / "data" / "test-00000-of-00001.parquet", rows[60:])
    builder = datasets.load_dataset_builder(str(repo), cache_dir=str(root / "cache"))
    # what the Hub loader sets: the repo id names the cache folder `<namespace>___<name>`
    builder.repo_id = HUB_ID
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()
    assert (root / "cache" / "pnyx-test___arith-qa").is_dir()
    return root / "cache"


def test_hub_id_is_read_from_the_cache_under_hf_datasets_offline_in_a_fresh_process(hub_cache, tmp_path):
    code = (
        "import json, sys; from pnyx.envs import get_env; "
        f"env = get_env('qa', data={HUB_ID!r}, checker='numeric', **{MAPPING!r}); "
        "print(json.dumps({t.id: t.answer for t in env.sample('train', 0, 200) + env.sample('test', 0, 50)}))"
    )
    child = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_HOME")}
    child |= {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(hub_cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the same 60 rows as a parquet file make the same tasks: ids name questions, not sources
    local = get_env("qa", data=str(write_parquet(tmp_path / "t.parquet", arith_rows(80)[:60])), checker="numeric", **MAPPING)  # fmt: skip
    assert got == {t.id: t.answer for t in all_tasks(local)}


def test_hub_split_chooses_the_rows_and_an_unknown_split_is_named(hub_cache, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hub_cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    env = get_env("qa", data=HUB_ID, split="test", test_fraction=0.5, checker="numeric", **MAPPING)
    assert {user_turn(t) for t in all_tasks(env)} == {r["problem"] for r in arith_rows(80)[60:]}
    with pytest.raises(ConfigError, match="validation"):
        get_env("qa", data=HUB_ID, split="validation", **MAPPING)


def test_an_uncached_hub_id_is_a_config_error_saying_how_to_fix_it(hub_cache, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hub_cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as err:
        get_env("qa", data="pnyx-test/never-downloaded")
    message = str(err.value)
    assert "not in the local datasets cache" in message and str(hub_cache) in message
    assert "load_dataset('pnyx-test/never-downloaded'" in message and "HF_DATASETS_OFFLINE=1" in message


# --- the qa environment's checkers -------------------------------------------------------------------------


def qa_env(tmp_path: Path, rows: list[dict], **kwargs):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return get_env("qa", data=str(path), **kwargs)


def _capitals() -> list[dict]:
    return [{"question": f"What is the capital of land {i}?", "answer": [f"The City {i}", f"C{i}"]} for i in range(20)]  # fmt: skip


def test_exact_checker_matches_normalized_text_and_any_listed_answer(tmp_path):
    env = qa_env(tmp_path, _capitals())
    task = env.sample("train", seed=0, n=1)[0]
    i = user_turn(task).split()[-1].rstrip("?")
    assert task.answer == [f"The City {i}", f"C{i}"]
    for text in (f"<answer>city {i}</answer>", f"<answer>C{i}.</answer>", f"<answer>THE CITY {i}</answer>"):
        assert env.score(task, text).reward == 1.0, text
    assert env.score(task, f"<answer>city {i}0</answer>").reason == "wrong_answer"


def test_exact_checker_grades_multiple_choice_letters_that_normalize_to_nothing(tmp_path):
    """SQuAD normalization drops "A" as an article: such a gold is compared by case and spacing alone."""
    rows = [{"question": f"Which option is right in quiz {i}?", "answer": "AB"[i % 2]} for i in range(20)]
    env = qa_env(tmp_path, rows)  # loads: "A" is a gold the checker can grade
    task = next(t for t in all_tasks(env) if t.answer == "A")
    for text, reward in [
        ("<answer>A</answer>", 1.0),
        ("<answer> a </answer>", 1.0),
        ("<answer>B</answer>", 0.0),
    ]:
        assert env.score(task, text).reward == reward, text
    assert env.score(task, "<answer>an</answer>").reason == "wrong_answer"  # also normalizes to nothing
    assert exact_equal("A", "a") == "equal" and exact_equal("A", "the") == "different"
    assert exact_equal(" ", "") == "different"  # a blank gold still matches nothing


def test_numeric_checker_compares_numbers_exactly_and_refuses_non_number_golds(tmp_path):
    env = qa_env(tmp_path, [{"question": f"Half of {2 * i + 1}?", "answer": (2 * i + 1) / 2} for i in range(20)], checker="numeric")  # fmt: skip
    task = next(t for t in all_tasks(env) if t.answer == "7.5")
    for text, reward in [
        ("<answer>7.50</answer>", 1.0),
        ("<answer>15/2</answer>", 1.0),
        ("<answer>7.51</answer>", 0.0),
    ]:
        assert env.score(task, text).reward == reward, text
    assert env.score(task, "<answer>seven and a half</answer>").reason == "answer_not_a_number"
    with pytest.raises(ConfigError, match="cannot be graded by the numeric checker"):
        qa_env(tmp_path, _capitals(), checker="numeric")


def test_math_checker_uses_math_verify_and_counts_a_final_boxed_answer(tmp_path):
    env = qa_env(tmp_path, [{"question": f"Simplify {i}/{2 * i}.", "answer": "\\frac{1}{2}"} for i in range(1, 21)], checker="math")  # fmt: skip
    task = env.sample("train", seed=0, n=1)[0]
    assert "\\boxed{42}" in env.system_prompt and env.max_new_tokens == 384
    for text in ("<answer>0.5</answer>", "so it is \\boxed{1/2}"):
        score = env.score(task, text)
        assert score.reward == 1.0 and score.parts["format"] == 1.0, text
    lenient = qa_env(tmp_path, [{"question": f"{i}+{i}?", "answer": 2 * i} for i in range(20)], checker="math", answer="lenient")  # fmt: skip
    t = lenient.sample("train", seed=0, n=1)[0]
    assert lenient.score(t, f"it is {t.answer}").parts == {"correct": 1.0, "format": 0.0, "lenient": 1.0}
    with pytest.raises(ConfigError, match="lenient"):
        qa_env(tmp_path, _capitals(), answer="lenient")


@pytest.mark.parametrize("checker", ["exact", "numeric", "math"])
def test_qa_hostile_strings_never_raise_and_score_zero(tmp_path, checker):
    rows = [{"question": f"Compute {i}+1.", "answer": i + 1} for i in range(20)]
    env = qa_env(tmp_path, rows, checker=checker)
    task = env.sample("train", seed=6, n=1)[0]
    assert env.score(task, env.reference_completion(task)).reward == 1.0
    for text in HOSTILE:
        score = env.score(task, text)
        assert isinstance(score, Score) and score.reward == 0.0 and score.reason, (text[:80], score)


def test_a_task_id_naming_a_question_under_the_other_split_is_refused(tmp_path):
    env = qa_env(tmp_path, _capitals())
    train = env.sample("train", seed=0, n=1)[0]
    with pytest.raises(ConfigError, match="in the train split, not test"):
        env.task(train.id.replace("/train/", "/test/"))


# --- pnyx run on a parquet file (real processes) ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pnyx_run_trains_on_tasks_from_a_parquet_file_with_a_column_mapping(tmp_path):
    from pnyx.protocol import decode_group
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_batch_record, read_metrics

    if not shipped_model_path().is_dir():
        pytest.skip(f"the shipped base model is missing at {shipped_model_path()}")
    rows = arith_rows(300)
    data = write_parquet(tmp_path / "arith.parquet", rows)
    kwargs = {"data": str(data), "checker": "numeric", **MAPPING}
    steps = 3
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "pnyx", "run", "--no-live", "--workers", "1", "--run.name=qa",
         f"--run.steps={steps}", "--run.eval_every=0", "--run.eval_tasks=8", "--run.time_budget_s=300",
         "--env.name=qa", f"--env.kwargs={json.dumps(kwargs)}", "--worker.group_size=4",
         "--worker.prompts_per_cohort=2", "--worker.poll_interval_s=0.2", "--trainer.groups_per_step=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    folder = tmp_path / "runs" / "qa"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["env"] == "qa" and summary["final_version"] == steps
    store = open_store(folder)
    assert [m["version"] for m in read_metrics(store)] == list(range(1, steps + 1))
    train_keys = {
        question_key(r["problem"]) for r in rows if split_of(r["problem"], 0.2, salt="qa") == "train"
    }
    for version in range(1, steps + 1):  # the groups each step trained on: train questions of the file
        record = read_batch_record(store, version)
        assert record is not None and record.keys, version
        for key in record.keys:
            group = decode_group(store.get(key))
            assert group.env == "qa" and group.task_id.startswith("qa/train/"), group.task_id
            assert group.task_id.rsplit("/", 1)[1] in train_keys, group.task_id
