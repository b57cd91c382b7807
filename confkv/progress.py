"""Progress for long loops: a tqdm bar on a terminal, a few plain lines anywhere else.

tqdm redraws its bar with carriage returns many times a second. On a terminal that is
one line that moves; in a log file, a CI log or ``nohup.out`` every redraw is kept
(one ``confkv ppl`` run wrote ~100 KB of them). So every confkv command goes through
:func:`progress`:

- the stream (``sys.stderr`` by default) is a terminal, or the code runs in a Jupyter
  kernel: a tqdm bar (``tqdm.auto``);
- anything else: at most ``lines`` plain lines (``desc: 512/2048 (25%) 12 s``), each
  ending in a newline, never a carriage return;
- ``enabled=False`` (the CLI's ``--no-progress``): nothing.

:func:`quiet_library_bars` does the same for the bars transformers and huggingface_hub
draw themselves (loading weights, downloads).
"""

from __future__ import annotations

import functools
import sys
import time
from typing import IO, Iterable, Iterator, TypeVar

T = TypeVar("T")

#: plain lines written when the stream is not a terminal (one per quarter of the loop)
PLAIN_LINES = 4


def is_terminal(stream: IO[str] | None = None) -> bool:
    """True when ``stream`` (default ``sys.stderr``) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # closed or detached stream
        return False


def _in_notebook() -> bool:
    """A Jupyter kernel: tqdm.auto draws a widget there, not carriage returns."""
    return "ipykernel" in sys.modules


def progress(iterable: Iterable[T], *, desc: str = "", total: int | None = None, enabled: bool = True,
             stream: IO[str] | None = None, leave: bool = False, lines: int = PLAIN_LINES) -> Iterator[T]:
    """Iterate over ``iterable`` showing progress on ``stream`` (default ``sys.stderr``).

    Args:
        iterable: what to iterate over; its ``len`` is used when ``total`` is None.
        desc: the label in front of the bar or line.
        total: the number of items (when ``iterable`` has no ``len``).
        enabled: False: no output at all.
        stream: where to write (default ``sys.stderr``, read at call time).
        leave: keep the finished tqdm bar on the terminal.
        lines: at most this many plain lines when ``stream`` is not a terminal (0: none).
    """
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return iter(iterable)
    if is_terminal(stream) or _in_notebook():
        from tqdm.auto import tqdm

        return iter(tqdm(iterable, desc=desc, total=total, file=stream, leave=leave))
    return _plain_lines(iterable, desc=desc, total=total, stream=stream, lines=lines)


def _plain_lines(iterable: Iterable[T], *, desc: str, total: int | None, stream: IO[str], lines: int
                 ) -> Iterator[T]:
    """Yield the items, writing ``desc: done/total (pct%) s`` at each ``1/lines`` of the total."""
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if not total or lines <= 0:
        yield from iterable
        return
    marks = sorted({max(1, round(total * k / lines)) for k in range(1, lines + 1)})
    start = time.perf_counter()
    done = 0
    for item in iterable:
        yield item
        done += 1
        if marks and done >= marks[0]:
            while marks and done >= marks[0]:
                marks.pop(0)
            label = f"{desc}: " if desc else ""
            stream.write(f"{label}{done}/{total} ({100 * done / total:.0f}%) {time.perf_counter() - start:.0f} s\n")
            stream.flush()


def quiet_library_bars(stream: IO[str] | None = None) -> None:
    """Turn off transformers' and huggingface_hub's own tqdm bars when ``stream`` is not a terminal.

    Called before a model is loaded (their "Loading weights" bar, and the bar of a GGUF file's
    conversion, which transformers draws with tqdm whatever its own setting). On a terminal, or in a
    notebook, it changes nothing.
    """
    if is_terminal(stream) or _in_notebook():
        return
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_loading

        if not getattr(gguf_loading.tqdm, "confkv_quiet", False):
            quiet = functools.partial(gguf_loading.tqdm, disable=True)
            quiet.confkv_quiet = True  # type: ignore[attr-defined]
            gguf_loading.tqdm = quiet
    except ImportError:
        pass
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass

