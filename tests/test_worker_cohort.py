"""One cohort with a tool environment: the real multi-turn loop and `searchqa` tool, scripted model turns.

Only the model's sampling is scripted (a random tiny model almost never emits a well-formed tool call):
each row's turns are fixed text, tokenized once, with made-up negative logprobs. Everything else is real:
the engine's episode loop appends the tool replies from `env.respond`, the cohort packs the groups, the
environment scores them.
"""

from __future__ import annotations

import pytest

from pnyx.envs import get_env
from pnyx.protocol import decode_group, encode_group
from pnyx.rollout.cohort import CohortSpec, generate_cohort
from pnyx.rollout.engines.torch import TorchEngine
from pnyx.rollout.sampling import Completion

G = 2


class ScriptedEngine(TorchEngine):
    """The real torch engine (and its real `run_episodes`) with `generate` replaced by fixed per-row turns."""

    def __init__(self, model, tokenizer, scripts: list[list[tuple[str, str | None]]]):
        super().__init__(None, tokenizer, model=model)
        self.scripts = scripts
        self.turn = 0

    def generate(self, prompt_ids, params):
        assert len(prompt_ids) == len(self.scripts), "every row stays active in this script"
        out = []
        for script in self.scripts:
            text, stop = script[self.turn]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Completion(ids, [-0.5] * len(ids), "stop", text, stop))
        self.turn += 1
        return out

    def decoder(self):
        return None  # the tool loop then calls `generate` every turn (the cache path never does)


@pytest.fixture
def searchqa():
    return get_env("searchqa", num_people=50)


def test_cohort_packs_tool_episodes_with_mask_zero_on_tool_tokens(tiny_model_dir, searchqa):
    from pnyx.models import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    tasks = searchqa.sample("train", 0, 2)
    scripts = []
    for task in tasks:  # per task: one right and one wrong final answer after the same search
        search = (f"<search>{task.meta['query']}</search>", "</search>")
        scripts += [[search, (f"<answer>{task.answer[0]}</answer>", "</answer>")]]
        scripts += [[search, ("<answer>nobody knows</answer>", "</answer>")]]
    engine = ScriptedEngine(model, tokenizer, scripts)
    spec = CohortSpec(
        run_id="r", worker_id="w1", version=7, digest="d" * 32, group_size=G, temperature=1.0, top_p=1.0,
        top_k=0, max_new_tokens=32, seed=0,
    )  # fmt: skip
    seqs = iter(range(40, 100))
    result = generate_cohort(engine, tokenizer, searchqa, tasks, spec, lambda: next(seqs))

    assert [g.seq for g in result.groups] == [40, 41]
    for task, group in zip(tasks, result.groups, strict=True):
        group = decode_group(encode_group(group))  # valid on the wire
        assert (group.policy_version, group.weights_digest, group.task_id) == (7, "d" * 32, task.id)
        assert [s.reward for s in group.samples] == [1.0, 0.0]
        for s in group.samples:
            assert s.num_tool_calls == 1 and 0 in s.loss_mask and 1 in s.loss_mask
            assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m == 0)
            assert all(lp == -0.5 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m == 1)
            tool_text = tokenizer.decode([t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m == 0])
            assert tool_text.startswith("<information>") and task.answer[0] in tool_text
            assert (
                s.reward == searchqa.score(task, tokenizer.decode(s.tokens, skip_special_tokens=True)).reward
            )
