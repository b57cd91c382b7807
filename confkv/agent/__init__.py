"""An agent workload: a deterministic text web (shop, wiki, mail, forms), 56 tasks, two protocols.

- :mod:`~confkv.agent.world`, :mod:`~confkv.agent.sites`, :mod:`~confkv.agent.env`: the seeded
  sites and the browser (pages as numbered accessibility trees, WebArena-style actions);
- :mod:`~confkv.agent.actions`: actions and the tolerant parser;
- :mod:`~confkv.agent.tasks`, :mod:`~confkv.agent.expert`: tasks, checkers, scripted experts;
- :mod:`~confkv.agent.prompt`, :mod:`~confkv.agent.harness`: prompt format and one episode on
  a streaming confkv cache (teacher-forced / closed loop);
- :mod:`~confkv.agent.grid`: policies x memory ratios over the tasks, resumable JSONL.

Nothing here imports transformers at module level (the harness loads confkv.hf when it runs).
"""

from confkv.agent.actions import Action, format_action, parse_action
from confkv.agent.env import StepResult, WebEnv
from confkv.agent.tasks import Task, build_tasks
from confkv.agent.world import World, make_world

__all__ = ["Action", "StepResult", "Task", "WebEnv", "World", "build_tasks", "format_action", "make_world",
           "parse_action"]
