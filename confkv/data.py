"""Corpora and needle-in-a-haystack samples.

No dataset hub is reachable on the development machines, so the built-in
corpora are long English texts that ship with Python itself:

- ``"pydoc-topics"``: the help topics of the Python reference
  (``pydoc_data.topics.topics``, the text behind ``help("assert")`` etc.),
  concatenated in sorted key order: ~465K characters, ~113K SmolLM2 tokens.
- ``"stdlib-docs"``: the docstrings of a fixed list of pure-Python stdlib
  modules (module docstring, then each public class/function and each public
  method of those classes, sorted by name): ~230K characters of API prose.

Both depend only on the Python version (3.11 here); they are deterministic for a
given interpreter. Also accepted: a path to a UTF-8 text file, and
``"hf:<dataset>[:<config>][:<split>]"`` (needs the optional ``datasets`` package
and a reachable hub).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from confkv.errors import ConfKVError

__all__ = [
    "BUILTIN_CORPORA",
    "CorpusError",
    "DEFAULT_NEEDLE_TEMPLATE",
    "DEFAULT_QUESTION_TEMPLATE",
    "NiahSample",
    "corpus_tokens",
    "load_corpus",
    "make_niah_sample",
    "score_niah",
]


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


_BUILTIN_LOADERS = {"pydoc-topics": _pydoc_topics, "stdlib-docs": _stdlib_docs}
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


# --------------------------------------------------------------------------- needle in a haystack

DEFAULT_NEEDLE_TEMPLATE = "The special magic number is {answer}. Remember it."
DEFAULT_QUESTION_TEMPLATE = "What is the special magic number? The special magic number is"


@dataclass
class NiahSample:
    """One needle-in-a-haystack prompt.

    Attributes:
        input_ids: [1, L] haystack with the needle inserted, then the question (L ~= context_tokens).
        context_ids: [1, L_ctx] haystack + needle only (the streamed part).
        question_ids: [1, L_q] the question, fed after the context; ``input_ids`` is
            ``cat([context_ids, question_ids], dim=1)``.
        answer: the string the model must produce (the passkey number by default).
        needle_position: index in ``context_ids`` of the needle's first token.
        needle_length: number of needle tokens.
        depth: requested depth fraction in [0, 1].
        trial: trial index (seeds the passkey).
    """

    input_ids: torch.Tensor
    context_ids: torch.Tensor
    question_ids: torch.Tensor
    answer: str
    needle_position: int
    needle_length: int
    depth: float
    trial: int

    @property
    def actual_depth(self) -> float:
        """Needle start as a fraction of the context length."""
        return self.needle_position / max(1, self.context_ids.shape[1])


def _special_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts in front of a text by default (e.g. Gemma's <bos>;
    empty for SmolLM2 and GPT-2)."""
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    plain = _encode(tokenizer, "a")
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return with_special[:start]
    return []


def _passkey(trial: int, seed: int) -> str:
    """A 5-7 digit number, deterministic in (trial, seed)."""
    rng = random.Random(1_000_003 * seed + trial)
    digits = rng.choice((5, 6, 7))
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")


def _boundary_kind(pieces: list[str], i: int) -> int:
    """How good a place it is to insert before token ``i`` (0 <= i < len(pieces)):
    2 = start of text, paragraph break, or end of a sentence; 1 = line break; 0 = neither.
    ``pieces`` are the decoded tokens."""
    if i == 0:
        return 2
    prev, nxt = pieces[i - 1], pieces[i]
    if prev.endswith("\n"):
        before = "".join(pieces[max(0, i - 3) : i]).rstrip("\n")
        paragraph = prev.endswith("\n\n") or before.endswith("\n")
        return 2 if paragraph or _SENTENCE_END.search(before) else 1
    if _SENTENCE_END.search(prev) and nxt[:1] in (" ", "\t"):
        return 2
    return 0


def _insertion_index(pieces: list[str], target: int, window: int) -> int:
    """Index in [0, len(pieces)) nearest to ``target`` (ties: earlier) with the best
    boundary found within +-window: sentence/paragraph end, else line break, else a
    word boundary (next token starts with a space), else ``target`` itself."""
    n = len(pieces)
    target = min(max(target, 0), n - 1)
    candidates = [i for delta in range(window + 1) for i in (target - delta, target + delta) if 0 <= i < n]
    for wanted in (2, 1):
        for i in candidates:
            if _boundary_kind(pieces, i) >= wanted:
                return i
    for i in candidates:
        if pieces[i][:1] == " ":
            return i
    return target


def make_niah_sample(
    tokenizer: Any,
    *,
    context_tokens: int,
    depth: float,
    trial: int,
    haystack: str = "pydoc-topics",
    needle_template: str = DEFAULT_NEEDLE_TEMPLATE,
    question_template: str = DEFAULT_QUESTION_TEMPLATE,
    answer: str | None = None,
    seed: int = 0,
    haystack_offset: int = 0,
    add_special_tokens: bool = True,
) -> NiahSample:
    """Build a passkey-style needle-in-a-haystack prompt of exactly ``context_tokens`` tokens.

    The haystack is the corpus ``haystack`` from token ``haystack_offset`` on; the needle
    (``needle_template.format(answer=...)``) is inserted at the sentence, paragraph or
    line boundary nearest to ``depth`` (0 = start, 1 = end of the haystack; searched
    within +-5% of the length, at least 16 tokens; failing that, at a word boundary);
    the question
    (``question_template.format(answer=...)``) follows after a blank line. The answer is
    a 5-7 digit number drawn from ``(trial, seed)`` unless ``answer`` is given. Plain
    text, no chat template. With ``add_special_tokens`` the context starts with whatever
    the tokenizer prepends by default (Gemma's <bos>; nothing for SmolLM2/GPT-2).

    Returns:
        NiahSample with input_ids [1, context_tokens] = cat(context_ids, question_ids).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if answer is None:
        answer = _passkey(trial, seed)
    needle_text = needle_template.format(answer=answer)
    question = _encode(tokenizer, "\n\n" + question_template.format(answer=answer))
    # A needle after a line break (or at the start) is a line of its own; after a
    # sentence it follows a space, like the next sentence would.
    own_line = _encode(tokenizer, needle_text + "\n")
    in_text = _encode(tokenizer, " " + needle_text)
    prefix = _special_prefix(tokenizer) if add_special_tokens else []
    n_search = context_tokens - len(prefix) - len(question) - max(len(own_line), len(in_text))
    if n_search < 1:
        raise ValueError(f"context_tokens={context_tokens} is too short for the needle and question")
    hay = corpus_tokens(tokenizer, haystack, n_search, offset=haystack_offset)[0].tolist()
    pieces = [tokenizer.decode([t]) for t in hay]
    if answer in "".join(pieces):
        raise ValueError(f"the answer {answer!r} already occurs in the haystack; use another trial/seed")
    at = _insertion_index(pieces, round(depth * n_search), window=max(16, n_search // 20))
    needle = own_line if at == 0 or pieces[at - 1].endswith("\n") else in_text
    # The haystack fills the rest exactly; it only grows past n_search, after the needle.
    n_hay = context_tokens - len(prefix) - len(question) - len(needle)
    hay = corpus_tokens(tokenizer, haystack, n_hay, offset=haystack_offset)[0].tolist()
    context_ids = torch.tensor([prefix + hay[:at] + needle + hay[at:]], dtype=torch.long)
    question_ids = torch.tensor([question], dtype=torch.long)
    return NiahSample(
        input_ids=torch.cat([context_ids, question_ids], dim=1),
        context_ids=context_ids,
        question_ids=question_ids,
        answer=answer,
        needle_position=len(prefix) + at,
        needle_length=len(needle),
        depth=depth,
        trial=trial,
    )


_NUMBER = re.compile(r"\d(?:[\d,]*\d)?")


def score_niah(generated_text: str, answer: str) -> bool:
    """True when the generation contains the answer.

    Numeric answers: the FIRST number in the generation (digit grouping commas removed)
    must equal the answer exactly, so "4839201" or "48392" do not count for "483920".
    Other answers: case-insensitive substring match.
    """
    answer = answer.strip()
    if answer.isdigit():
        match = _NUMBER.search(generated_text)
        return match is not None and match.group(0).replace(",", "") == answer
    return answer.lower() in generated_text.lower()
