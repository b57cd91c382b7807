"""Corpora and needle-in-a-haystack samples.

No dataset hub is reachable on the development machines, so the built-in
corpora are long English texts that ship with Python itself:

- ``"pydoc-topics"``: the help topics of the Python reference
  (``pydoc_data.topics.topics``, the text behind ``help("assert")`` etc.),
  concatenated in sorted key order: ~465K characters, ~113K SmolLM2 tokens.
- ``"stdlib-docs"``: the docstrings of a fixed list of pure-Python stdlib
  modules (module docstring, then each public class/function and each public
  method of those classes, sorted by name): ~230K characters of API prose.
- ``"idle-docs"``: the IDLE editor's user guide (``idlelib/help.html``, tags
  stripped), then its README, NEWS, HISTORY and TODO files: ~170K characters of
  user-facing prose and change notes. Added as a held-out text: no tuning used it.

Both depend only on the Python version (3.11 here); they are deterministic for a
given interpreter. Also accepted: a path to a UTF-8 text file, and
``"hf:<dataset>[:<config>][:<split>]"`` (needs the optional ``datasets`` package
and a reachable hub).
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from confkv.errors import ConfKVError



class CorpusError(ConfKVError, ValueError):
    """A corpus could not be loaded or is too short; the message names it and the problem."""


# --------------------------------------------------------------------------- built-in corpora

# Prose-heavy, pure-Python modules that import without side effects on any platform.
_STDLIB_DOC_MODULES: tuple[str, ...] = (
    "argparse", "ast", "asyncio.events", "base64", "bisect", "calendar", "codecs", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "doctest", "email.message", "enum", "fractions", "functools", "gettext", "heapq",
    "http.client", "inspect", "ipaddress", "json", "logging", "mailbox", "numbers", "optparse",
    "pathlib", "pickle", "pprint", "random", "shutil", "statistics", "string", "subprocess",
    "tarfile", "textwrap", "threading", "timeit", "typing", "unittest.case", "urllib.parse",
    "uuid", "zipfile",
)


def _pydoc_topics() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def _stdlib_docs() -> str:
    with warnings.catch_warnings():  # e.g. typing.io / typing.re warn when touched
        warnings.simplefilter("ignore", DeprecationWarning)
        return _collect_docstrings()


def _collect_docstrings() -> str:
    parts: list[str] = []
    for module_name in _STDLIB_DOC_MODULES:
        module = importlib.import_module(module_name)
        docs: list[str] = []
        if module.__doc__:
            docs.append(inspect.cleandoc(module.__doc__))
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if obj.__doc__:
                docs.append(f"{name}: {inspect.cleandoc(obj.__doc__)}")
            if inspect.isclass(obj):
                for attr, member in sorted(vars(obj).items()):
                    if attr.startswith("_") or not inspect.isfunction(member) or not member.__doc__:
                        continue
                    docs.append(f"{name}.{attr}: {inspect.cleandoc(member.__doc__)}")
        if docs:
            parts.append(f"Module {module_name}\n\n" + "\n\n".join(docs))
    if not parts:
        raise CorpusError("corpus 'stdlib-docs' is empty: docstrings are stripped (python -OO?)")
    return "\n\n\n".join(parts)


_IDLE_FILES = ("README.txt", "NEWS.txt", "NEWS2x.txt", "HISTORY.txt", "TODO.txt", "extend.txt")


def _idle_docs() -> str:
    import html  # noqa: PLC0415
    import idlelib  # noqa: PLC0415

    folder = Path(idlelib.__file__).parent
    guide = (folder / "help.html").read_text(encoding="utf-8")
    guide = re.sub(r"(?s)<(script|style)[^>]*>.*?</\1>", " ", guide)
    guide = html.unescape(re.sub(r"<[^>]+>", " ", guide))
    guide = "\n".join(line.strip() for line in guide.splitlines())
    guide = re.sub(r"\n{3,}", "\n\n", re.sub(r"[ \t]+", " ", guide)).strip()
    parts = [guide] + [(folder / name).read_text(encoding="utf-8").strip() for name in _IDLE_FILES
                       if (folder / name).is_file()]
    return "\n\n\n".join(parts)


_BUILTIN_LOADERS = {"pydoc-topics": _pydoc_topics, "stdlib-docs": _stdlib_docs, "idle-docs": _idle_docs}
BUILTIN_CORPORA: tuple[str, ...] = tuple(_BUILTIN_LOADERS)


# --------------------------------------------------------------------------- files and hub datasets

_SPLIT_NAMES = ("train", "test", "validation", "valid", "dev")


def _parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``"hf:<dataset>[:<config>][:<split>]"`` -> (dataset, config, split). With two fields
    the second is a split when it looks like one (train/test/validation[...]), else a config."""
    fields = re.split(r":(?![^\[]*\])", spec[len("hf:"):])  # colons inside [...] slices stay
    if not fields[0] or len(fields) > 3 or any(not f for f in fields):
        raise CorpusError(f"bad hub corpus spec {spec!r}: expected 'hf:<dataset>[:<config>][:<split>]'")
    if len(fields) == 1:
        return fields[0], None, "test"
    if len(fields) == 2:
        second = fields[1]
        if second.split("[")[0] in _SPLIT_NAMES:
            return fields[0], None, second
        return fields[0], second, "test"
    return fields[0], fields[1], fields[2]


def _hub_corpus(spec: str) -> str:
    dataset, config, split = _parse_hf_spec(spec)
    try:
        import datasets  # optional, not a dependency
    except ImportError as err:
        raise CorpusError(f"corpus {spec!r} needs the 'datasets' package (pip install datasets) and a reachable hub") from err
    try:
        ds = datasets.load_dataset(dataset, config, split=split)
    except Exception as err:
        raise CorpusError(
            f"could not load hub dataset {dataset!r} (config={config}, split={split}): {type(err).__name__}: {err}. "
            f"No hub reachable? Use a built-in corpus ({', '.join(BUILTIN_CORPORA)}) or a local text file."
        ) from err
    column = "text" if "text" in ds.column_names else next(
        (c for c, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")), None
    )
    if column is None:
        raise CorpusError(f"hub dataset {dataset!r} has no text column (columns: {ds.column_names})")
    text = "\n\n".join(row for row in ds[column] if row)
    if not text.strip():
        raise CorpusError(f"hub dataset {dataset!r} (split {split}) has no text in column {column!r}")
    return text


def _file_corpus(path: Path) -> str:
    if not path.exists():
        raise CorpusError(f"corpus file {path} does not exist")
    if path.is_dir():
        raise CorpusError(f"corpus path {path} is a directory, not a text file")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CorpusError(f"corpus file {path} is not readable: {err.strerror or err}") from err
    if b"\x00" in raw:
        raise CorpusError(f"corpus file {path} looks binary (contains NUL bytes); expected UTF-8 text")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise CorpusError(f"corpus file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from err
    if not text.strip():
        raise CorpusError(f"corpus file {path} is empty")
    return text


@lru_cache(maxsize=8)
def _memoized(name: str) -> str:
    return _BUILTIN_LOADERS[name]() if name in _BUILTIN_LOADERS else _hub_corpus(name)


def load_corpus(name_or_path: str) -> str:
    """The text of a corpus: a built-in name (``BUILTIN_CORPORA``), a path to a UTF-8 text
    file, or ``"hf:<dataset>[:<config>][:<split>]"``. Built-in and hub texts are memoized
    per process; files are re-read on every call.

    Raises:
        CorpusError: unknown name, missing/unreadable/empty/binary file, or unreachable hub.
    """
    if name_or_path in _BUILTIN_LOADERS or name_or_path.startswith("hf:"):
        return _memoized(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.exists() and "/" not in name_or_path and "." not in name_or_path:
        raise CorpusError(
            f"unknown corpus {name_or_path!r}: not a built-in ({', '.join(BUILTIN_CORPORA)}), "
            "not an existing file, and not 'hf:<dataset>[:<config>][:<split>]'"
        )
    return _file_corpus(path)


# --------------------------------------------------------------------------- tokens

# tokenizer -> {corpus name: token ids [N]}; weak so tokenizers are freed normally.
_TOKEN_CACHE: "weakref.WeakKeyDictionary[Any, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (no BOS/EOS)."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _corpus_ids(tokenizer: Any, name_or_path: str) -> torch.Tensor:
    """All token ids of a corpus, [N] int64, memoized per tokenizer object."""
    try:
        per_tok = _TOKEN_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no memo
        per_tok = {}
    if name_or_path not in per_tok:
        per_tok[name_or_path] = torch.tensor(_encode(tokenizer, load_corpus(name_or_path)), dtype=torch.long)
    return per_tok[name_or_path]


def corpus_tokens(tokenizer: Any, name_or_path: str, n_tokens: int, offset: int = 0) -> torch.Tensor:
    """Tokens ``[offset, offset + n_tokens)`` of a corpus, as a LongTensor of shape [1, n_tokens].

    The corpus is tokenized as one text without special tokens (no BOS is prepended).

    Raises:
        CorpusError: the corpus has fewer than ``offset + n_tokens`` tokens.
        ValueError: ``n_tokens < 1`` or ``offset < 0``.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    ids = _corpus_ids(tokenizer, name_or_path)
    if offset + n_tokens > ids.numel():
        raise CorpusError(
            f"corpus {name_or_path!r} has {ids.numel()} tokens with this tokenizer; "
            f"requested {n_tokens} tokens from offset {offset} (needs {offset + n_tokens})"
        )
    return ids[offset : offset + n_tokens].clone().unsqueeze(0)

