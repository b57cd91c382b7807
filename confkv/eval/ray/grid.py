"""Run a grid's work units on a Ray cluster (``--ray``): actors load the model once, the driver writes.

Every grid command (``niah``, ``sweep``, ``ppl``, ``agent``, ``ruler``) splits its work into
picklable units and has one pure function ``run_unit(model, tokenizer, unit) -> rows`` that
both its in-process loop and the Ray actors call, so the records are the same either way
(apart from timing fields: seconds, finished_at).

Here (:class:`RayGrid`):

- ``N`` actors (one CPU each; one torch thread each) each load the model **once** from a
  :class:`ModelSpec` (a name, not the model) and then run many units;
- one unit is in flight per actor; results come back as they complete (``ray.wait``) and
  only the driver hands them to the command's writer (which appends to the resumable JSONL
  with :mod:`confkv.eval.jsonl`): workers never touch the file;
- a unit that raises is retried up to ``retries`` times; an actor that dies (its process is
  killed) is restarted by Ray (``max_restarts``) and its in-flight unit goes back to the
  queue. A unit's rows are written once, when its result arrives, so a unit lands once or
  not at all, never twice;
- a progress bar over units (:mod:`confkv.progress`).

Where it runs: ``RayOptions(address=None)`` starts a local Ray with one worker per core;
``"auto"`` or ``"HOST:PORT"`` (or ``"ray://HOST:PORT"``) joins a running cluster. An address
that does not answer within ``connect_timeout`` seconds is a :class:`ConfKVError` naming
``--ray`` and the fix (Ray's own ``ray.init`` would keep retrying for minutes).

Ray is imported only inside these functions: a run without ``--ray`` never imports it.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Sequence

from confkv.errors import ConfKVError
from confkv.progress import progress as show_progress

#: what ``--ray`` with no value means (a local Ray on this machine)
LOCAL = "local"


@dataclass(frozen=True)
class ModelSpec:
    """How an actor loads its model: a name for :func:`confkv.models.load_model` (or ``tiny-<arch>``,
    the tiny random test models) and a dtype name. Picklable and small: the model is never shipped."""

    name: str
    dtype: str = "float32"

    def __call__(self) -> tuple[Any, Any]:
        import torch

        if self.name.startswith("tiny-"):
            from confkv.models import tiny_model, tiny_tokenizer

            return tiny_model(self.name[len("tiny-"):]), tiny_tokenizer()
        from confkv.models import load_model

        return load_model(self.name, dtype=getattr(torch, self.dtype))


#: seconds between two calls to an actor that is restarting
RESTART_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class RayOptions:
    """``--ray [ADDRESS]``, ``--ray-workers``, ``--ray-retries`` of the grid commands.

    Attributes:
        address: ``None`` or ``"local"``: start a local Ray; ``"auto"``: the cluster this machine
            belongs to (``ray start``); ``"HOST:PORT"`` / ``"ray://HOST:PORT"``: that cluster's head.
        workers: actors to start (default: one per core locally, one per cluster CPU otherwise).
        retries: times a failed unit is tried again (a raised error or a dead worker).
        connect_timeout: seconds to wait for the head node to answer before giving up.
        threads: torch threads per actor.
        restart_timeout: seconds to wait for a dead actor's restart (its model load) before the
            slot is given up; calls meanwhile find it "unavailable", which costs the unit no retry.
    """

    address: str | None = None
    workers: int | None = None
    retries: int = 2
    connect_timeout: float = 5.0
    threads: int = 1
    restart_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConfKVError(f"--ray-workers must be >= 1, got {self.workers}")
        if self.retries < 0:
            raise ConfKVError(f"--ray-retries must be >= 0, got {self.retries}")

    @property
    def local(self) -> bool:
        return self.address in (None, LOCAL)


@dataclass(frozen=True)
class WorkUnit:
    """One unit of a grid: ``key`` is stable across runs (resuming skips keys already on disk),
    ``payload`` is what ``run_unit`` receives (picklable), ``cost`` orders the queue."""

    key: Hashable
    payload: Any
    cost: float = 0.0  # relative run time, if known (e.g. the context length): the longest are sent first


def add_ray_arguments(parser: Any) -> None:
    """``--ray [ADDRESS]``, ``--ray-workers N``, ``--ray-retries N`` on an argparse parser."""
    parser.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                        help="run the units on Ray: alone, a local Ray (one worker per core); 'auto' or HOST:PORT "
                             "joins a running cluster (`ray start --head`). Needs `pip install confkv[ray]`")
    parser.add_argument("--ray-workers", type=int, default=None,
                        help="with --ray: actors to start (default one per core / cluster CPU)")
    parser.add_argument("--ray-retries", type=int, default=2, help="with --ray: retries of a failed unit")


def ray_options(args: Any) -> RayOptions | None:
    """The :class:`RayOptions` of parsed arguments (None without ``--ray``)."""
    if getattr(args, "ray", None) is None:
        return None
    return RayOptions(address=args.ray, workers=args.ray_workers, retries=args.ray_retries)


# --------------------------------------------------------------------------- connecting

def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ConfKVError("--ray needs Ray: `pip install 'confkv[ray]'` (or `pip install ray`), "
                          "or run without --ray") from error
    return ray


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _auto_address(ray: Any) -> str:
    """The head of the cluster this machine joined: ``$RAY_ADDRESS``, else Ray's ``ray_current_cluster`` file."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    try:
        temp = Path(ray._private.utils.get_ray_temp_dir())
    except Exception:  # private API moved: Ray's default
        temp = Path("/tmp/ray")
    current = temp / "ray_current_cluster"
    if current.exists() and current.read_text().strip():
        return current.read_text().strip()
    raise ConfKVError("--ray auto: no running Ray cluster on this machine; start one with `ray start --head` "
                      "(or give its address: --ray HOST:PORT, or --ray alone for a local Ray)")


def check_reachable(address: str, timeout: float) -> None:
    """Raise :class:`ConfKVError` unless ``HOST:PORT`` (optionally ``ray://``) accepts a TCP connection."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfKVError(f"--ray {address!r}: expected HOST:PORT (e.g. 10.0.0.5:6379), 'auto', or nothing "
                          "for a local Ray")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as error:
        raise ConfKVError(f"--ray {address}: no Ray head answers there ({error}; waited {timeout:g} s). Start one "
                          "with `ray start --head --port PORT` on that machine, check the address and firewall, "
                          "or use --ray alone for a local Ray") from error


def connect(options: RayOptions) -> tuple[Any, bool]:
    """Initialise Ray for ``options``; returns ``(ray, started_here)``.

    An already initialised Ray (a notebook, the tests) is used as it is.
    """
    ray = _import_ray()
    address = None
    if not options.local:  # checked first, even when Ray is up: a wrong address is always an error
        address = _auto_address(ray) if options.address == "auto" else options.address
        check_reachable(address, options.connect_timeout)
    if ray.is_initialized():
        return ray, False
    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
    if options.local:
        ray.init(address="local", num_cpus=options.workers or _cores(), **quiet)  # never a running cluster
        return ray, True
    try:
        ray.init(address=address, **{k: v for k, v in quiet.items() if k != "include_dashboard"})
    except ConnectionError as error:
        raise ConfKVError(f"--ray {options.address}: could not join the cluster: {error}. If the cluster uses token "
                          "authentication (Ray enables it for clusters started by ray.init), set RAY_AUTH_MODE=token "
                          "and the cluster's token (RAY_AUTH_TOKEN, or ~/.ray/auth_token; `ray get-auth-token`)"
                          ) from error
    return ray, True


# --------------------------------------------------------------------------- the actors

class _Worker:
    """One actor: loads the model once, then runs units (``run_unit(model, tokenizer, payload)``)."""

    def __init__(self, loader: Callable[[], tuple[Any, Any]], run_unit: Callable[..., Any], threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.model, self.tokenizer = loader()
        self.run_unit = run_unit

    def run(self, payload: Any) -> Any:
        return self.run_unit(self.model, self.tokenizer, payload)


class RayGrid:
    """A pool of actors running one command's units; see the module docstring.

    Use as a context manager (``with RayGrid(options, loader, run_unit) as grid:``); the pool
    outlives one :meth:`run`, so a command whose later units depend on earlier results (the
    sweep's mean matching, the agent's agreement with full KV) runs them as several batches
    without reloading the model. Ray is shut down on exit when it was started here.
    """

    def __init__(self, options: RayOptions, loader: Callable[[], tuple[Any, Any]],
                 run_unit: Callable[[Any, Any, Any], Any]) -> None:
        self.options = options
        self.loader = loader
        self.run_unit = run_unit
        self.ray: Any = None
        self.started_here = False
        self.actors: list[Any] = []
        self.deaths: list[int] = []

    def __enter__(self) -> "RayGrid":
        self.ray, self.started_here = connect(self.options)
        workers = self.options.workers
        if workers is None:
            workers = max(1, int(self.ray.cluster_resources().get("CPU", 1)))
        actor = self.ray.remote(num_cpus=1, max_restarts=self.options.retries, max_task_retries=0)(_Worker)
        self.actors = [actor.remote(self.loader, self.run_unit, self.options.threads) for _ in range(workers)]
        self.deaths = [0] * workers
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.actors:
            try:
                self.ray.kill(handle)
            except Exception:  # already dead
                pass
        self.actors = []
        if self.started_here:
            self.ray.shutdown()

    def run(self, units: Sequence[WorkUnit], land: Callable[[WorkUnit, Any], None], *, progress: bool = True,
            desc: str = "") -> None:
        """Run every unit; ``land(unit, rows)`` is called in the driver, once per finished unit.

        Raises:
            ConfKVError: some units still failed after ``retries`` retries (the others have
                landed), or every actor died for good.
        """
        failures: list[str] = []
        for _ in show_progress(self._completed(units, land, failures), total=len(units), desc=desc,
                               enabled=progress, leave=True):
            pass
        if failures:
            raise ConfKVError(f"--ray: {len(failures)} unit(s) failed after {self.options.retries} retries "
                              f"(--ray-retries); the finished units are saved, rerun the same command to retry the "
                              f"rest. First failure: {failures[0]}")

    def _completed(self, units: Sequence[WorkUnit], land: Callable[[WorkUnit, Any], None],
                   failures: list[str]) -> Iterator[WorkUnit]:
        """Submit, wait, land, retry; yields each unit once, when it is finished (landed or given up)."""
        ray = self.ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        last_error = ""
        unavailable_since: dict[int, float] = {}  # slot -> when its actor was first found restarting
        queue = deque(sorted(units, key=lambda unit: -unit.cost))  # longest first: workers finish together
        attempts: dict[Hashable, int] = {}
        idle = deque(range(len(self.actors)))
        pending: dict[Any, tuple[WorkUnit, int]] = {}
        while queue or pending:
            while queue and idle:
                slot = idle.popleft()
                unit = queue.popleft()
                pending[self.actors[slot].run.remote(unit.payload)] = (unit, slot)
            if not pending:
                raise ConfKVError(f"--ray: every worker died for good (each restarted {self.options.retries} times, "
                                  f"--ray-retries); {len(queue)} unit(s) not run. Rerun the same command to resume. "
                                  f"Last error: {last_error}")
            ready, _ = ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            unit, slot = pending.pop(ref)
            try:
                rows = ray.get(ref)
            except ActorUnavailableError as error:
                # the actor is restarting after a death (max_restarts): the call never ran there, and it is
                # neither a new death nor the unit's fault. Wait for the restart (a model load, slow on a
                # busy machine) instead of spending the unit's retries on it.
                last_error = _first_lines(error)
                first = unavailable_since.setdefault(slot, time.monotonic())
                if time.monotonic() - first <= self.options.restart_timeout:
                    time.sleep(RESTART_POLL_SECONDS)
                    idle.append(slot)
                    queue.appendleft(unit)
                    continue
                self.deaths[slot] = self.options.retries + 1  # never came back: retire the slot
                queue.appendleft(unit)
                continue
            except (RayActorError, RayTaskError) as error:
                last_error = _first_lines(error)
                died = isinstance(error, RayActorError)
                if died:
                    self.deaths[slot] += 1
                if not died or self.deaths[slot] <= self.options.retries:
                    idle.append(slot)  # Ray restarts a dead actor (max_restarts); calls wait for it
                attempts[unit.key] = attempts.get(unit.key, 0) + 1
                if attempts[unit.key] <= self.options.retries:
                    queue.appendleft(unit)
                    continue
                failures.append(f"unit {unit.key!r}: {'its worker died: ' if died else ''}{last_error}")
                yield unit
                continue
            unavailable_since.pop(slot, None)
            idle.append(slot)
            land(unit, rows)  # once: a unit is resubmitted only after its attempt failed (no Ray task retries)
            yield unit


def _first_lines(error: Exception, limit: int = 400) -> str:
    """The last line of a worker's traceback (the exception itself), at most ``limit`` characters."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:limit]


#: pools started ahead by :func:`prestart`, by (options, loader, run_unit)
_PRESTARTED: dict[tuple, RayGrid] = {}


def prestart(options: RayOptions, loader: Callable[[], Any], run_unit: Callable[..., Any]) -> None:
    """Start the pool now (Ray, the actors and their model loads run in the background), so that a
    command can load its own model for planning meanwhile; the next :func:`run_units` with the same
    ``(options, loader, run_unit)`` uses it. :func:`release_prestarted` closes one never used."""
    key = (options, loader, run_unit)
    if key not in _PRESTARTED:
        _PRESTARTED[key] = RayGrid(options, loader, run_unit).__enter__()  # actor creation does not block


def release_prestarted() -> None:
    """Close every pool :func:`prestart` opened that no :func:`run_units` took."""
    while _PRESTARTED:
        _PRESTARTED.popitem()[1].__exit__(None, None, None)


def run_units(units: Sequence[WorkUnit], run_unit: Callable[[Any, Any, Any], Any], loader: Callable[[], Any],
              options: RayOptions, land: Callable[[WorkUnit, Any], None], *, progress: bool = True,
              desc: str = "") -> None:
    """One batch of units on a fresh pool (see :class:`RayGrid`), or on the one :func:`prestart`
    opened for the same arguments; nothing to do: Ray is not started (a prestarted pool is closed)."""
    pool = _PRESTARTED.pop((options, loader, run_unit), None)
    if not units:
        if pool is not None:
            pool.__exit__(None, None, None)
        return
    grid = pool if pool is not None else RayGrid(options, loader, run_unit).__enter__()
    try:
        grid.run(units, land, progress=progress, desc=desc)
    finally:
        grid.__exit__(None, None, None)


def pool_or_none(options: RayOptions | None, loader: Callable[[], Any], run_unit: Callable[..., Any]) -> Any:
    """A :class:`RayGrid` for ``options``, or a do-nothing context (``None`` inside) without ``--ray``."""
    from contextlib import nullcontext

    return nullcontext() if options is None else RayGrid(options, loader, run_unit)


__all__ = ["LOCAL", "ModelSpec", "RayGrid", "RayOptions", "WorkUnit", "add_ray_arguments", "check_reachable",
           "connect", "pool_or_none", "prestart", "ray_options", "release_prestarted", "run_units"]
