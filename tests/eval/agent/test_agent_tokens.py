"""Page and history sizes in real SmolLM2 tokens (integration: loads the bundled model's tokenizer)."""

import pytest

from confkv.eval.agent import WebEnv, build_tasks, make_world
from confkv.eval.agent.expert import run_plan
from confkv.eval.agent.harness import encode, expert_history_tokens
from confkv.eval.agent.prompt import ChatFormat

pytestmark = pytest.mark.integration


def test_pages_150_to_600_tokens_and_histories_3k_to_8k(smollm2):
    model, tokenizer = smollm2
    fmt = ChatFormat.for_tokenizer(tokenizer)
    assert fmt.after_obs == "<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's chat template
    world = make_world(0)
    limit = model.config.max_position_embeddings
    for task in build_tasks(world):
        steps = run_plan(WebEnv(world, task.start_url, task.cart), task.plan)
        assert all(150 <= len(encode(tokenizer, s.observation)) <= 600 for s in steps), task.tid
        history = expert_history_tokens(tokenizer, world, task, fmt)
        assert 3000 <= history <= 8000 and history + 24 <= limit, (task.tid, history)
