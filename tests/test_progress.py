"""confkv.progress: a tqdm bar on a terminal, at most a few plain lines (no carriage returns) elsewhere."""

import io

from confkv.progress import PLAIN_LINES, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gives_a_few_plain_lines_and_every_item():
    stream = io.StringIO()
    assert list(progress(range(1000), desc="ppl full", stream=stream)) == list(range(1000))
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert 1 <= len(lines) <= PLAIN_LINES
    assert lines[-1].startswith("ppl full: 1000/1000 (100%)")


def test_short_loops_and_unknown_lengths_stay_within_the_line_budget():
    stream = io.StringIO()
    list(progress(range(2), desc="x", stream=stream))
    assert len(stream.getvalue().splitlines()) == 2  # one line per item at most
    stream = io.StringIO()
    list(progress(iter(range(50)), desc="x", stream=stream))  # no len, no total: silent
    assert stream.getvalue() == ""
    stream = io.StringIO()
    list(progress(iter(range(50)), desc="x", total=50, stream=stream))
    assert len(stream.getvalue().splitlines()) == PLAIN_LINES


def test_disabled_writes_nothing_and_a_terminal_gets_the_bar():
    stream = io.StringIO()
    assert list(progress(range(10), enabled=False, stream=stream)) == list(range(10))
    assert stream.getvalue() == ""
    terminal = _Terminal()
    list(progress(range(10), desc="bar", stream=terminal))
    assert "\r" in terminal.getvalue() and "bar" in terminal.getvalue()  # tqdm's redraws


def test_library_bars_are_quiet_when_the_output_is_not_a_terminal(monkeypatch, capsys):
    """transformers' own bars go off, and so does the bar of a GGUF file's conversion, which transformers draws
    with tqdm whatever its setting (a 339-line carriage-return bar in every log of a GGUF model's run)."""
    import io

    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as transformers_logging

    from confkv.progress import quiet_library_bars

    monkeypatch.setattr(gguf_loading, "tqdm", gguf_loading.tqdm)  # restored after the test
    try:
        quiet_library_bars(io.StringIO())
        assert not transformers_logging.is_progress_bar_enabled()
        assert list(gguf_loading.tqdm(range(3), desc="Converting")) == [0, 1, 2]
        assert "Converting" not in capsys.readouterr().err
        quiet_library_bars(io.StringIO())  # twice: still one wrapper
        assert gguf_loading.tqdm.func.__module__.startswith("tqdm")
    finally:
        transformers_logging.enable_progress_bar()
