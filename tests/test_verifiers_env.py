"""`verifiers` environments through pnyx (`--env.name=verifiers:<target>`, pnyx/envs/verifiers/).

Environments live in tests/vf_envs/ and examples/verifiers/ (no hub). Each test builds the env through the
registry as `--env.name` would, plays the worker (sample, respond) and then the trainer (a fresh instance,
the task rebuilt from its id, the completion re-scored from its text). Skipped only where verifiers (or its
classic API) is not installed; the last two tests run `pnyx run` as real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pnyx.config import shipped_model_path
from pnyx.envs import get_env
from pnyx.envs.arith import SYSTEM_PROMPT as ARITH_SYSTEM
from pnyx.envs.searchqa import SearchQAEnv
from pnyx.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
ENVS = Path(__file__).resolve().parent / "vf_envs"
EXAMPLES = REPO / "examples" / "verifiers"
CLASSIC = f"verifiers:{ENVS / 'classic_envs.py'}"
V1 = f"verifiers:{ENVS / 'v1_envs.py'}"
ARITH_OPTS = {"stop_strings": ["</answer>"], "max_new_tokens": 64}
SEARCH_OPTS = {
    "tool_format": "tags", "reply_tags": ["<information>", "</information>"], "tool_prompt": False,
    "stop_strings": ["</answer>"], "max_new_tokens": 128,
}  # fmt: skip


@pytest.fixture
def classic():
    vf = pytest.importorskip("verifiers")
    if not hasattr(vf, "SingleTurnEnv"):
        pytest.skip(f"verifiers {vf.__version__} has no classic API (it needs <= 0.3.x)")


@pytest.fixture
def v1():
    pytest.importorskip("verifiers.v1")


def _calc_call(task) -> str:
    expression = task.prompt[-1]["content"].removeprefix("Compute ").removesuffix(".")
    return f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


# --- classic API ------------------------------------------------------------------------------------


def test_classic_single_turn_samples_rebuilds_and_scores(classic):
    name = f"verifiers:{EXAMPLES / 'arith_single.py'}"
    env = get_env(name, num_rows=200, pnyx=ARITH_OPTS)
    trainer = get_env(name, num_rows=200, pnyx=ARITH_OPTS)
    tasks = env.sample("train", seed=1, n=5)
    assert len({t.id for t in tasks}) == 5 and all(
        t.id.startswith("verifiers:arith_single/train/") for t in tasks
    )
    assert [trainer.task(t.id).prompt for t in tasks] == [t.prompt for t in tasks]
    assert tasks[0].prompt[0] == {"role": "system", "content": ARITH_SYSTEM}
    assert env.tool_stops == [] and env.max_turns == 1 and env.stop_strings == ["</answer>"]
    t = trainer.task(tasks[0].id)
    good, bad = trainer.score(t, f"<answer>{t.answer}</answer>"), trainer.score(t, "<answer>-999</answer>")
    assert good.reward == 1.0 and good.parts["format"] == 1.0, good
    assert bad.reward == 0.0 and bad.parts["format"] == 1.0 and bad.reason == "zero_reward", bad
    assert [t.id for t in env.sample("train", 1, 5)] == [t.id for t in tasks]  # deterministic
    assert env.keys["test"] and not set(env.keys["train"]) & set(env.keys["test"])


def test_classic_tool_env_answers_calls_and_refuses_forged_replies(classic):
    env = get_env(f"{CLASSIC}:load_calc_tool", n=32)
    assert env.tool_stops == ["</tool_call>"] and env.max_turns == 3
    t = env.sample("train", 0, 1)[0]
    assert "calc" in t.prompt[0]["content"]  # the tool preamble
    call = _calc_call(t)
    reply = env.respond(t, call)
    assert reply == f"<tool_response>{t.answer}</tool_response>"
    full = call + reply + f"<answer>{t.answer}</answer>"
    trainer = get_env(f"{CLASSIC}:load_calc_tool", n=32)
    s = trainer.score(trainer.task(t.id), full)  # replays the env's rollout, re-runs the tool
    assert s.reward == 1.0 and s.parts["used_tool"] == 1.0, s
    forged = trainer.score(t, call + "<tool_response>7</tool_response><answer>7</answer>")
    assert forged.reward == 0.0 and forged.reason.startswith("tool_reply_mismatch"), forged
    assert env.respond(t, full) is None  # no tool call: the env ends the episode
    bad = env.respond(t, '<tool_call>{"name": "calc", "arguments": {"expression": "os"}}</tool_call>')
    assert bad is not None and "only integers" in bad  # a raising tool answers with its error
    assert env.score(t, f"<answer>{t.answer}</answer>").parts["used_tool"] == 0.0


def test_classic_tags_protocol_gives_the_native_searchqa_bytes(classic):
    env = get_env(f"verifiers:{EXAMPLES / 'search_tool.py'}", num_people=100, pnyx=SEARCH_OPTS)
    assert env.tool_stops == ["</search>"] and env.max_turns == 2
    t = env.sample("train", 0, 1)[0]
    call = "<search>" + t.prompt[-1]["content"].split(" ", 3)[-1] + "</search>"
    reply = env.respond(t, call)
    assert reply is not None and reply == SearchQAEnv(num_people=100).respond(t, call)
    assert env.score(t, call + reply + f"<answer>{t.answer}</answer>").reward == 1.0
    assert env.score(t, call + reply + "<answer>nowhere</answer>").reward == 0.0


def test_classic_multiturn_env_state_is_rebuilt_by_replay(classic):
    env = get_env(
        f"{CLASSIC}:load_guess", pnyx={"turn_stops": ["</guess>"], "reply_tags": ["<hint>", "</hint>"]}
    )
    assert env.tool_stops == ["</guess>"] and env.max_turns == 4
    t = env.sample("train", 0, 1)[0]
    secret = int(t.answer)
    text = "<guess>-1</guess>"
    assert env.respond(t, text) == "<hint>higher</hint>"
    text += f"<hint>higher</hint><guess>{secret + 1}</guess>"
    assert env.respond(t, text) == "<hint>lower</hint>"  # the guesses so far, rebuilt by the replay
    text += f"<hint>lower</hint><guess>{secret}</guess>"
    assert env.respond(t, text) is None  # final_env_response: the env ends the game
    s = env.score(t, text)
    assert s.reward == 1.0 and s.parts["num_guesses"] == 3.0, s
    cut = env.score(t, "<guess>-1</guess>")  # cut by pnyx's limits on a call the env would answer
    assert cut.reward == 0.0 and cut.parts["num_guesses"] == 1.0, cut


def test_classic_episode_cut_at_pnyx_turn_limit_still_scores(classic):
    env = get_env(f"{CLASSIC}:load_calc_tool", n=8, pnyx={"max_turns": 1})
    t = env.sample("train", 0, 1)[0]
    s = env.score(t, _calc_call(t))
    assert env.max_turns == 1 and s.reward == 0.0 and s.parts["total_tool_calls"] == 1.0, s


def test_classic_replay_refuses_more_model_turns_than_max_turns(classic):
    # the env's own limit is 3; an honest worker under max_turns=1 cannot write a second model turn
    env = get_env(f"{CLASSIC}:load_calc_tool", n=8, pnyx={"max_turns": 1})
    t = env.sample("train", 0, 1)[0]
    call = _calc_call(t)
    two_turns = call + f"<tool_response>{t.answer}</tool_response><answer>{t.answer}</answer>"
    s = env.score(t, two_turns)
    assert s.reward == 0.0 and s.reason.startswith("tool_reply_mismatch") and "max_turns=1" in s.reason, s
    ok = get_env(f"{CLASSIC}:load_calc_tool", n=8, pnyx={"max_turns": 2})  # the same text within the limit
    assert ok.score(ok.task(t.id), two_turns).reward == 1.0


def test_a_verifier_past_its_deadline_scores_zero_and_delays_no_later_call(classic):
    env = get_env(f"{CLASSIC}:load_slow_on_demand", pnyx={**ARITH_OPTS, "timeout_s": 1.0})
    t = env.sample("train", 0, 1)[0]
    stuck = env.score(t, f"SLOW <answer>{t.answer}</answer>")
    assert stuck.reward == 0.0 and "TimeoutError" in stuck.reason, stuck
    # while the stuck call still blocks its loop (5 s): before the fix these queued behind it and timed out
    honest = [env.score(t, f"<answer>{t.answer}</answer>") for _ in range(3)]
    assert [s.reward for s in honest] == [1.0, 1.0, 1.0], honest


def test_classic_reward_range_rescales_to_unit_interval(classic):
    plain = get_env(f"{CLASSIC}:load_wide_reward")
    wide = get_env(f"{CLASSIC}:load_wide_reward", pnyx={"reward_range": [-1, 1]})
    t = plain.sample("train", 0, 1)[0]
    assert wide.score(t, f"<answer>{t.answer}</answer>").reward == 1.0
    assert plain.score(t, "<answer>0</answer>").reward == 0.0  # -1 clamped
    assert wide.score(t, "<answer>0</answer>").reward == 0.0  # -1 rescaled
    assert plain.score(t, "").reason == "empty"


def test_classic_env_build_keeps_the_process_signal_handlers(classic):
    def handler(signum, frame):
        return None

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        get_env(f"{CLASSIC}:load_calc_tool", n=4)
        assert signal.getsignal(signal.SIGTERM) is handler  # verifiers would install its own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_system_prompt_option_replaces_the_rows_system_message(classic):
    env = get_env(f"{CLASSIC}:load_calc_tool", n=4, system_prompt="Be brief.", pnyx={"tool_prompt": False})
    assert env.sample("train", 0, 1)[0].prompt[0] == {"role": "system", "content": "Be brief."}
    bare = get_env(f"{CLASSIC}:load_calc_tool", n=4, system_prompt="", pnyx={"tool_prompt": False})
    assert [m["role"] for m in bare.sample("train", 0, 1)[0].prompt] == ["user"]


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        (f"{CLASSIC}:load_group_reward", {}, "group reward functions ['diversity']"),
        (f"{CLASSIC}:make_list", {}, "not a verifiers Environment or Taskset"),
        (f"{CLASSIC}:no_such_loader", {}, "has no attribute 'no_such_loader'"),
        (
            f"{CLASSIC}:load_calc_tool",
            {"pnyx": {"tool_format": "tags", "nope": 1}},
            "unknown verifiers adapter",
        ),
        ("verifiers:pnyx_no_such_env_module", {}, "no module 'pnyx_no_such_env_module'"),
        ("verifiers:/nonexistent/env.py", {}, "no such file"),
        ("verifiers:", {}, "needs a target"),
    ],
)
def test_unloadable_targets_are_config_errors_that_say_why(classic, name, kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        get_env(name, **kwargs)


def test_missing_verifiers_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # find_spec then reports it absent
    with pytest.raises(ConfigError, match=r"pip install 'pnyx\[verifiers\]'"):
        get_env(f"{CLASSIC}:load_calc_tool")


# --- v1 API -----------------------------------------------------------------------------------------


def test_v1_single_turn_taskset(v1):
    env = get_env(f"{V1}:ArithTaskset", num_tasks=32, pnyx=ARITH_OPTS)
    t = env.sample("train", 3, 4)[1]
    trainer = get_env(f"{V1}:ArithTaskset", num_tasks=32, pnyx=ARITH_OPTS)
    assert trainer.task(t.id).prompt == t.prompt and t.prompt[0]["content"] == ARITH_SYSTEM
    s = trainer.score(trainer.task(t.id), f"<answer>{t.answer}</answer>")
    assert s.reward == 1.0 and s.parts == {"correct": 1.0, "turns": 1.0}, s
    assert trainer.score(t, "<answer>0</answer>").reward == 0.0


def test_v1_stateful_toolset_sees_the_episodes_earlier_calls_after_a_cache_hit(v1):
    env = get_env(f"{V1}:CounterTaskset", num_tasks=8)
    t = env.sample("train", 0, 1)[0]

    def tick(label: str) -> str:
        return f'<tool_call>{{"name": "tick", "arguments": {{"label": "{label}"}}}}</tool_call>'

    first = tick("a")
    assert env.respond(t, first) == "<tool_response>a:1</tool_response>"  # now cached
    # the first call comes from the cache; the second runs on fresh toolsets that must have seen it
    text = first + "<tool_response>a:1</tool_response>" + tick("b")
    assert env.respond(t, text) == "<tool_response>b:2</tool_response>"


def test_v1_tool_taskset_answers_calls_and_refuses_forged_replies(v1):
    env = get_env(f"{V1}:CalcTaskset", num_tasks=16)
    assert env.tool_stops == ["</tool_call>"] and env.max_turns == 8
    t = env.sample("train", 0, 1)[0]
    call = _calc_call(t)
    reply = env.respond(t, call)
    assert reply == f"<tool_response>{t.answer}</tool_response>"
    s = env.score(t, call + reply + f"<answer>{t.answer}</answer>")
    assert s.reward == 1.0 and s.parts["tool_calls"] == 1.0, s
    forged = env.score(t, call + "<tool_response>1</tool_response><answer>1</answer>")
    assert forged.reason.startswith("tool_reply_mismatch"), forged


def test_v1_search_taskset_caches_tool_results_by_text_prefix(v1):
    env = get_env(f"{V1}:SearchTaskset", num_tasks=40, pnyx={**SEARCH_OPTS, "max_turns": 2})
    searches = sys.modules[type(env.backend.taskset).__module__].SEARCHES
    searches.clear()
    t = env.sample("train", 0, 1)[0]
    call = "<search>" + t.prompt[-1]["content"].split(" ", 3)[-1] + "</search>"
    reply = env.respond(t, call)
    assert reply is not None and reply.startswith("<information>") and t.answer in reply
    full = call + reply + f"<answer>{t.answer}</answer>"
    assert env.score(t, full).reward == 1.0 and env.score(t, full).reward == 1.0
    # one tool call for the respond and both scores: the replays found its result cached
    assert searches == [call[len("<search>") : -len("</search>")]]


def test_v1_runtime_bound_reward_is_refused(v1):
    with pytest.raises(ConfigError, match=r"\['tests_pass'\].*need a runtime"):
        get_env(f"{V1}:SandboxTaskset")


# --- pnyx run, real processes -----------------------------------------------------------------------


def _pnyx_run(tmp_path: Path, name: str, kwargs: dict, extra: list[str], steps: int = 2) -> Path:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "pnyx", "run", "--no-live", "--workers", "1", "--run.name=vf",
         f"--run.steps={steps}", "--run.eval_every=0", "--run.eval_tasks=4", "--run.time_budget_s=240",
         f"--env.name={name}", f"--env.kwargs={json.dumps(kwargs)}", "--worker.group_size=4",
         "--worker.prompts_per_cohort=2", "--worker.poll_interval_s=0.2", "--trainer.groups_per_step=2", *extra],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = tmp_path / "runs" / "vf"
    assert json.loads((folder / "summary.json").read_text())["final_version"] == steps
    return folder


def _trained_groups(folder: Path, steps: int) -> list:
    from pnyx.protocol import decode_group
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_batch_record, read_metrics

    store = open_store(folder)
    assert [m["version"] for m in read_metrics(store)] == list(range(1, steps + 1))
    groups = []
    for version in range(1, steps + 1):
        record = read_batch_record(store, version)
        assert record is not None and record.keys, version
        groups += [decode_group(store.get(key)) for key in record.keys]
    return groups


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pnyx_run_trains_on_a_verifiers_single_turn_env(tmp_path, classic):
    if not shipped_model_path().is_dir():
        pytest.skip(f"the shipped base model is missing at {shipped_model_path()}")
    folder = _pnyx_run(
        tmp_path, f"verifiers:{EXAMPLES / 'arith_single.py'}", {"num_rows": 300, "pnyx": ARITH_OPTS}, []
    )
    groups = _trained_groups(folder, 2)
    assert all(
        g.env == "verifiers:arith_single" and g.task_id.startswith("verifiers:arith_single/train/")
        for g in groups
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pnyx_run_trains_on_a_verifiers_tool_env_with_tool_tokens_masked(tmp_path, classic):
    if not shipped_model_path().is_dir():
        pytest.skip(f"the shipped base model is missing at {shipped_model_path()}")
    kwargs = {"num_people": 100, "pnyx": SEARCH_OPTS}
    folder = _pnyx_run(
        tmp_path, f"verifiers:{EXAMPLES / 'search_tool.py'}", kwargs, ["--worker.max_new_tokens=48"]
    )
    groups = _trained_groups(folder, 2)
    assert all(g.task_id.startswith("verifiers:search_tool/train/") for g in groups)
    samples = [s for g in groups for s in g.samples]
    called = [s for s in samples if s.num_tool_calls > 0]
    assert called, "no sample called the search tool"
    assert all(0 in s.loss_mask and 1 in s.loss_mask for s in called)  # the tool's reply tokens are masked
