"""The episode check (`pnyx.train.episode_check`): tool tokens must be the environment's own replies, and a
model turn must end where the engine would have stopped it. On the shipped tiny model's tokenizer, with the
real `arith` and `searchqa` environments; the forgeries are the ones a red-team review found passing every
other check (docs/security.md, "Tool tokens and sample endings")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pnyx.envs import get_env
from pnyx.errors import RecordRejected
from pnyx.models import load_tokenizer
from pnyx.models.tokenizer import StopMatcher, eos_token_ids
from pnyx.protocol.draws import SCHEME
from pnyx.protocol.records import Sample
from pnyx.train.episode_check import EpisodeRules

BUDGET = 64


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("pnyx/assets/tiny-base")


def rules(env, tokenizer) -> EpisodeRules:
    return EpisodeRules(
        env=env,
        eos_ids=frozenset(eos_token_ids(tokenizer)),
        stops=StopMatcher(tokenizer, [*env.stop_strings, *env.tool_stops]),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        tokenize=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        max_new_tokens=BUDGET,
    )


def sample(parts: list[tuple[list[int], int]]) -> Sample:
    tokens = [t for ids, _ in parts for t in ids]
    mask = [m for ids, m in parts for _ in ids]
    return Sample(tokens=tokens, logprobs=[0.0] * len(tokens), loss_mask=mask, reward=0.0)


def group(*samples: Sample, seeded: bool = True):
    return SimpleNamespace(samples=list(samples), draws=SCHEME if seeded else "")


def enc(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def reason(check, task, g) -> str:
    with pytest.raises(RecordRejected) as e:
        check(task, g)
    assert e.value.reason == "forged_episode", e.value
    return str(e.value)


@pytest.fixture(scope="module")
def searchqa():
    env = get_env("searchqa")
    return env, env.sample("train", 0, 1)[0]


def honest_search(tokenizer, env, task) -> list[tuple[list[int], int]]:
    """The env's ideal episode as the tool loop assembles it: model turn, the env's reply, model turn."""
    roles = {"model": 1, "tool": 0}
    return [(enc(tokenizer, text), roles[role]) for role, text in env.reference_completion(task)]


def test_honest_episodes_pass(tokenizer, searchqa):
    env, task = searchqa
    rules(env, tokenizer).check(task, group(sample(honest_search(tokenizer, env, task))))
    arith = get_env("arith")
    t = arith.sample("train", 0, 1)[0]
    check = rules(arith, tokenizer).check
    check(t, group(sample([(enc(tokenizer, "<answer>12</answer>"), 1)])))  # ends at the stop
    check(t, group(sample([(enc(tokenizer, "x" * 200)[:BUDGET], 1)])))  # ends at the budget
    check(t, group(sample([(enc(tokenizer, "7") + [tokenizer.eos_token_id], 1)])))  # ends at EOS


def test_tool_tokens_in_an_environment_without_tools_are_rejected(tokenizer):
    """What set any arith sample's reward: an answer appended as tool tokens, which take no uniform."""
    arith = get_env("arith")
    t = arith.sample("train", 0, 1)[0]
    forged = sample([(enc(tokenizer, "<answer>1"), 1), (enc(tokenizer, "</answer>"), 0)])
    assert "without tools" in reason(rules(arith, tokenizer).check, t, group(forged))


def test_a_tool_reply_that_is_not_the_environments_is_rejected(tokenizer, searchqa):
    env, task = searchqa
    parts = honest_search(tokenizer, env, task)
    check = rules(env, tokenizer).check
    # the reply with its answer changed (a worker writing the document it wants)
    doc = env.reference_completion(task)[1][1].replace(task.answer[0], "Nowhere")
    assert "not the environment's reply" in reason(
        check, task, group(sample([parts[0], (enc(tokenizer, doc), 0), parts[2]]))
    )
    # a reply where the model made no call (text inserted into its own turn)
    assert "no reply" in reason(
        check, task, group(sample([(enc(tokenizer, "<answer>"), 1), parts[1], parts[2]]))
    )
    # a reply re-tokenized another way (the same text, other ids: another context for the next draws)
    reply = env.reference_completion(task)[1][1]
    other = [t for c in reply for t in enc(tokenizer, c)]  # one character at a time
    assert other != parts[1][0] and tokenizer.decode(other) == reply
    assert "not the environment's reply" in reason(
        check, task, group(sample([parts[0], (other, 0), parts[2]]))
    )


def test_more_model_turns_than_the_environment_allows_are_rejected(tokenizer, searchqa):
    env, task = searchqa
    parts = honest_search(tokenizer, env, task)
    over = [parts[0], parts[1], parts[0], parts[1], parts[2]]  # 3 model turns, max_turns 2
    assert "model turns" in reason(rules(env, tokenizer).check, task, group(sample(over)))


def test_a_sample_cut_short_or_run_on_is_rejected(tokenizer):
    """A prefix of an honest draw, or a draw continued past its stop or EOS, is a run of honest draws the
    engine would never have sent: it would let a worker zero a correct sample or change where one ends."""
    arith = get_env("arith")
    t = arith.sample("train", 0, 1)[0]
    check = rules(arith, tokenizer).check
    full = enc(tokenizer, "<answer>12</answer>")
    assert "ends before" in reason(check, t, group(sample([(full[:-2], 1)])))
    assert "past the stop" in reason(check, t, group(sample([(full + enc(tokenizer, " more"), 1)])))
    eos = tokenizer.eos_token_id
    assert "past EOS" in reason(check, t, group(sample([(enc(tokenizer, "7") + [eos] + full, 1)])))
    assert "no tokens" in reason(check, t, group(sample([])))
    # an unseeded group's endings are not judged (its engine's stop logic is its own), its tool tokens are
    check(t, group(sample([(full[:-2], 1)]), seeded=False))
    with pytest.raises(RecordRejected):
        check(t, group(sample([(full[:-2], 1), (full[-2:], 0)]), seeded=False))


def test_a_turn_before_a_tool_reply_must_end_with_the_tool_call(tokenizer, searchqa):
    env, task = searchqa
    parts = honest_search(tokenizer, env, task)
    call = parts[0][0]
    # the call's closing tag made into tool tokens: the env answers the text, but the turn did not end there
    cut = [(call[:-3], 1), (call[-3:], 0)]
    with pytest.raises(RecordRejected):
        rules(env, tokenizer).check(task, group(sample([*cut, parts[1], parts[2]])))


def test_a_tool_call_with_an_empty_reply_splits_the_run_into_two_turns(tokenizer, searchqa):
    """The tool loop appends an empty reply as no tokens and goes on with the next turn: the model's run of
    tokens then holds two turns, the first ending at the call. It passes; the same text where the env gives
    a non-empty reply (so the loop would have inserted it) does not."""
    env, task = searchqa

    class Silent(type(env)):  # a tool that answers every call with nothing
        def respond(self, task, text_so_far):
            return "" if text_so_far.rstrip().endswith("</search>") else None

    silent = Silent()
    parts = honest_search(tokenizer, env, task)
    run = [(parts[0][0] + parts[2][0], 1)]  # call, (empty reply), answer
    rules(silent, tokenizer).check(task, group(sample(run)))
    assert "past the stop" in reason(rules(env, tokenizer).check, task, group(sample(run)))
