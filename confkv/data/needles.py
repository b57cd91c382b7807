"""Needle-in-a-haystack samples: a passkey sentence hidden at a depth of a corpus text, and scoring.

The haystack is a built-in corpus (:mod:`confkv.data.corpora`); the needle goes at a
sentence or paragraph boundary near the requested depth, and the haystack is padded so
that every sample of one length has exactly ``context_tokens`` tokens.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import torch

from confkv.data.corpora import _encode, corpus_tokens

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
