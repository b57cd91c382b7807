"""``RayGrid``'s scheduling when an actor is restarting, with a scripted stand-in for Ray's calls
(no cluster: the restart timing that a busy machine produces is made exact here).

A dead actor is restarted by Ray (``max_restarts``); calls made before the restart is done fail
with ``ActorUnavailableError``. Those calls never ran: they must neither spend the unit's retries
nor count as new deaths (a loaded CI machine once failed the killed-worker test that way).
"""

from __future__ import annotations

import pytest

exceptions = pytest.importorskip("ray.exceptions")

from confkv.errors import ConfKVError  # noqa: E402
from confkv.eval.ray import grid as ray_grid  # noqa: E402
from confkv.eval.ray.grid import RayGrid, RayOptions, WorkUnit  # noqa: E402


class _Ref:
    def __init__(self, payload, slot):
        self.payload, self.slot = payload, slot


class _Actor:
    def __init__(self, slot, calls):
        outer = self

        class _Method:
            @staticmethod
            def remote(payload):
                calls.append((outer.slot, payload))
                return _Ref(payload, outer.slot)

        self.slot = slot
        self.run = _Method()


class _ScriptedRay:
    """``wait`` returns the oldest call; ``get`` follows a script of outcomes per payload, then succeeds."""

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}

    def wait(self, refs, num_returns=1):
        return refs[:1], refs[1:]

    def get(self, ref):
        outcomes = self.script.get(ref.payload, [])
        if outcomes:
            outcome = outcomes.pop(0)
            if outcome == "dies":
                raise exceptions.RayActorError(error_msg="the worker process exited")
            if outcome == "restarting":
                raise exceptions.ActorUnavailableError("The actor is restarting", None)
            raise AssertionError(outcome)
        return [f"row of {ref.payload}"]


def _grid(script, workers=1, **options):
    grid = RayGrid(RayOptions(workers=workers, **options), loader=None, run_unit=None)
    calls = []
    grid.ray = _ScriptedRay(script)
    grid.actors = [_Actor(i, calls) for i in range(workers)]
    grid.deaths = [0] * workers
    return grid, calls


def test_calls_to_a_restarting_actor_cost_the_unit_no_retry(monkeypatch):
    monkeypatch.setattr(ray_grid, "RESTART_POLL_SECONDS", 0.0)
    # unit "b" kills its worker, then finds it restarting five times (a slow model load), then runs
    grid, calls = _grid({"b": ["dies"] + ["restarting"] * 5}, retries=1)
    units = [WorkUnit(key, key) for key in ("a", "b", "c")]
    landed = []
    grid.run(units, lambda unit, rows: landed.append((unit.key, rows)), progress=False)
    assert sorted(landed) == [("a", ["row of a"]), ("b", ["row of b"]), ("c", ["row of c"])]  # each once
    assert [p for _, p in calls].count("b") == 1 + 1 + 5  # the death, the restart waits, the run
    assert grid.deaths == [1]  # the waits were not deaths


def test_a_real_second_failure_still_counts(monkeypatch):
    monkeypatch.setattr(ray_grid, "RESTART_POLL_SECONDS", 0.0)
    grid, _ = _grid({"b": ["dies", "restarting", "dies"]}, workers=2, retries=1)
    with pytest.raises(ConfKVError, match=r"1 unit\(s\) failed after 1 retries.*unit 'b': its worker died"):
        grid.run([WorkUnit("a", "a"), WorkUnit("b", "b")], lambda unit, rows: None, progress=False)


def test_an_actor_that_never_comes_back_is_given_up(monkeypatch):
    monkeypatch.setattr(ray_grid, "RESTART_POLL_SECONDS", 0.0)
    grid, _ = _grid({"a": ["dies"] + ["restarting"] * 1000}, retries=2, restart_timeout=0.0)
    with pytest.raises(ConfKVError, match="every worker died for good"):
        grid.run([WorkUnit("a", "a")], lambda unit, rows: None, progress=False)
