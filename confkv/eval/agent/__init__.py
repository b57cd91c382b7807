"""An agent workload: a deterministic text web (shop, wiki, mail, forms), 56 tasks, two protocols.

- :mod:`~confkv.eval.agent.world`, :mod:`~confkv.eval.agent.sites`, :mod:`~confkv.eval.agent.env`: the seeded
  sites and the browser (pages as numbered accessibility trees, WebArena-style actions);
- :mod:`~confkv.eval.agent.actions`: actions and the tolerant parser;
- :mod:`~confkv.eval.agent.tasks`, :mod:`~confkv.eval.agent.expert`: tasks, checkers, scripted experts;
- :mod:`~confkv.eval.agent.prompt`, :mod:`~confkv.eval.agent.harness`: prompt format and one episode on
  a streaming confkv cache (teacher-forced / closed loop);
- :mod:`~confkv.eval.agent.grid`: policies x memory ratios over the tasks, resumable JSONL.

Nothing here imports transformers at module level (the harness loads confkv.hf when it runs).
"""

from confkv.eval.agent.actions import Action, format_action, parse_action
from confkv.eval.agent.env import StepResult, WebEnv
from confkv.eval.agent.tasks import Task, build_tasks
from confkv.eval.agent.world import World, make_world

__all__ = ["Action", "StepResult", "Task", "WebEnv", "World", "build_tasks", "format_action", "make_world",
           "parse_action"]
