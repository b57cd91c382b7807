"""confkv.profiling.section: records time and a call per span only while timers are active."""

import itertools

import pytest

from confkv import profiling


@pytest.fixture
def ticks(monkeypatch):
    counter = itertools.count()
    monkeypatch.setattr(profiling, "clock", lambda: float(next(counter)))
    return counter


def test_section_records_time_and_calls_when_enabled(ticks):
    timers = profiling.Timers()
    with profiling.enabled(timers):
        for _ in range(3):
            with profiling.section("a"):
                next(ticks)  # one tick passes inside the section: 2 ticks per span
        with profiling.section("b"):
            pass
    assert dict(timers.calls) == {"a": 3, "b": 1}
    assert dict(timers.seconds) == {"a": 6.0, "b": 1.0}


def test_section_records_nothing_when_disabled(ticks):
    assert profiling.ACTIVE is None
    with profiling.section("a"):
        pass
    assert next(ticks) == 0  # the clock was never read
    timers = profiling.Timers()
    with profiling.enabled(timers):
        pass
    with profiling.section("a"):  # after the block: off again
        pass
    assert profiling.ACTIVE is None and not timers.calls and not timers.seconds


def test_exception_inside_a_section_is_recorded_and_propagates(ticks):
    timers = profiling.Timers()
    with pytest.raises(KeyError, match="boom"):
        with profiling.enabled(timers):
            with profiling.section("outer"):
                with profiling.section("inner"):
                    raise KeyError("boom")
    assert profiling.ACTIVE is None
    assert dict(timers.calls) == {"inner": 1, "outer": 1}
    # nested spans: inner is read at ticks 1 and 2, outer at 0 and 3
    assert dict(timers.seconds) == {"inner": 1.0, "outer": 3.0}


def test_a_section_records_into_the_timers_active_when_it_opened(ticks):
    first, second = profiling.Timers(), profiling.Timers()
    with profiling.enabled(first):
        span = profiling.section("a")
        with span:
            with profiling.enabled(second):
                with profiling.section("b"):
                    pass
    assert dict(first.calls) == {"a": 1} and dict(second.calls) == {"b": 1}


def test_with_no_timers_the_section_is_the_standard_do_nothing_context_and_is_restored_after_a_block():
    """Off, an instrumented step calls no code of confkv.profiling (docs/ARCHITECTURE.md counts its files)."""
    import contextlib

    assert profiling.section is contextlib.nullcontext
    outer, inner = profiling.Timers(), profiling.Timers()
    with profiling.enabled(outer):
        assert profiling.section is not contextlib.nullcontext
        with profiling.enabled(inner):
            pass
        with profiling.section("after the inner block"):  # still recorded: the outer block is on
            pass
    assert profiling.section is contextlib.nullcontext and profiling.ACTIVE is None
    assert dict(outer.calls) == {"after the inner block": 1} and not inner.calls
