"""RULER's synthetic long-context tasks, generated offline and deterministically.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv:2404.06654) builds every sample from templates, random keys and
values, and a filler text, sized with the model's own tokenizer to a target length.
The templates, needle sentences, answer prefixes and task parameters below follow
RULER's (as lm-evaluation-harness 0.4.13 ports them in ``lm_eval/tasks/ruler``); what
differs, because nothing may be downloaded here:

- the "essay" haystack (RULER: Paul Graham's essays, fetched from the web) is sentences of
  a local corpus of :mod:`confkv.data` (``pydoc-topics`` by default), whitespace-collapsed,
  from a start sentence drawn per sample;
- the word lists (RULER: the ``wonderwords`` package's adjectives/nouns/verbs) are the
  distinct lower-case alphabetic words of 4-10 letters of ``stdlib-docs``; NIAH keys are
  ``word-word`` pairs like RULER's ``adjective-noun`` keys;
- QA (SQuAD, HotpotQA) is left out: no local QA source exists.

Each sample is a pure function of (task, length, index, seed, tokenizer): every random
choice comes from ``random.Random(f"{seed}:{task}:{length}:{index}")``. A sample's
``input + " " + gen_prefix`` plus ``max_new_tokens`` fits in ``length`` tokens; the haystack
is the largest that fits (binary search over its size, counted with the tokenizer).

This module imports nothing from transformers: ``tokenizer`` is anything callable as
``tokenizer(text).input_ids`` (a Hugging Face tokenizer).
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Callable

from confkv.errors import ConfigError

# --------------------------------------------------------------------------- RULER's templates

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
#: RULER's needle positions: 40 depths in percent
DEPTHS = [round(100 * i / 39) for i in range(40)]

VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                    "are assgined the value {query}, they are: ")  # RULER's spelling
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_ANSWER_PREFIX = "Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class NiahSpec:
    """One NIAH variant (RULER's ``niah_*`` parameters)."""

    haystack: str  # "repeat" | "essay" | "needle"
    type_needle_k: str = "words"  # "words" | "numbers" | "uuids"
    type_needle_v: str = "numbers"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1


#: task -> (kind, spec, tokens to generate, RULER metric); names as in lm-eval's ``ruler`` group
TASKS: dict[str, tuple[str, Any, int, str]] = {
    "niah_single_1": ("niah", NiahSpec("repeat"), 128, "all"),
    "niah_single_2": ("niah", NiahSpec("essay"), 128, "all"),
    "niah_single_3": ("niah", NiahSpec("essay", type_needle_v="uuids"), 128, "all"),
    "niah_multikey_1": ("niah", NiahSpec("essay", num_needle_k=4), 128, "all"),
    "niah_multikey_2": ("niah", NiahSpec("needle"), 128, "all"),
    "niah_multikey_3": ("niah", NiahSpec("needle", type_needle_k="uuids", type_needle_v="uuids"), 128, "all"),
    "niah_multivalue": ("niah", NiahSpec("essay", num_needle_v=4), 128, "all"),
    "niah_multiquery": ("niah", NiahSpec("essay", num_needle_q=4), 128, "all"),
    "vt": ("vt", None, 30, "all"),
    "cwe": ("cwe", None, 120, "all"),
    "fwe": ("fwe", None, 50, "all"),
}
#: the default selection of ``confkv ruler``: one task per RULER category asked for in issue 15
DEFAULT_TASKS = ("niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
ESSAY_CORPUS = "pydoc-topics"
WORDS_CORPUS = "stdlib-docs"


@dataclass
class RulerSample:
    """One prompt: the model reads ``prompt`` (= ``input + " " + gen_prefix``) and should name every output."""

    task: str
    length: int  # the target: prompt tokens + max_new_tokens <= length
    index: int
    seed: int
    input: str
    gen_prefix: str
    outputs: list[str]
    max_new_tokens: int
    metric: str  # "all" (string_match_all) or "part" (string_match_part)
    prompt_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return f"{self.input} {self.gen_prefix}" if self.gen_prefix else self.input

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- local word lists and haystacks

@lru_cache(maxsize=4)
def _corpus_sentences(corpus: str) -> tuple[str, ...]:
    from confkv.data import load_corpus

    text = " ".join(load_corpus(corpus).split())
    return tuple(s for s in re.split(r"(?<=[.!?])\s+", text) if s)


@lru_cache(maxsize=4)
def word_list(corpus: str = WORDS_CORPUS) -> tuple[str, ...]:
    """Distinct lower-case alphabetic words of 4-10 letters of ``corpus``, sorted (RULER: wonderwords)."""
    from confkv.data import load_corpus

    return tuple(sorted({w for w in re.findall(r"\b[a-z]{4,10}\b", load_corpus(corpus))}))


def _random_value(rng: random.Random, kind: str, words: tuple[str, ...]) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits, as RULER
    if kind == "words":
        return f"{rng.choice(words)}-{rng.choice(words)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ConfigError(f"needle type {kind!r}: choose numbers, words or uuids")


def _count(tokenizer: Any, text: str) -> int:
    try:
        return len(tokenizer(text, verbose=False).input_ids)
    except TypeError:  # a tokenizer without the ``verbose`` flag
        return len(tokenizer(text).input_ids)


def _largest_fitting(build: Callable[[int], RulerSample], tokenizer: Any, length: int, lo: int, hi: int
                     ) -> RulerSample:
    """The sample of the largest size n in [lo, hi] whose prompt + max_new_tokens fits ``length`` tokens."""
    def fits(n: int) -> tuple[bool, RulerSample]:
        sample = build(n)
        sample.prompt_tokens = _count(tokenizer, sample.prompt)
        return sample.prompt_tokens + sample.max_new_tokens <= length, sample

    ok, best = fits(lo)
    if not ok:
        raise ConfigError(f"length {length}: even the smallest {best.task} sample takes {best.prompt_tokens} + "
                          f"{best.max_new_tokens} new tokens; choose a longer length")
    while hi - lo > 1:  # invariant: lo fits, hi does not (or hi is the cap)
        mid = (lo + hi) // 2
        ok, sample = fits(mid)
        if ok:
            lo, best = mid, sample
        else:
            hi = mid
    ok, sample = fits(hi)
    return sample if ok else best


# --------------------------------------------------------------------------- the four families

def _niah(task: str, spec: NiahSpec, tokenizer: Any, length: int, index: int, seed: int, new: int) -> RulerSample:
    words = word_list()
    sentences = _corpus_sentences(ESSAY_CORPUS)
    key = f"{seed}:{task}:{length}:{index}"
    num_needle_k = max(spec.num_needle_k, spec.num_needle_q)

    def build(n: int) -> RulerSample:
        rng = random.Random(key)
        keys, values, needles = [], [], []
        for _ in range(num_needle_k):
            keys.append(_random_value(rng, spec.type_needle_k, words))
            vals = [_random_value(rng, spec.type_needle_v, words) for _ in range(spec.num_needle_v)]
            values.append(vals)
            needles += [NIAH_NEEDLE.format(type_needle_v=spec.type_needle_v, key=keys[-1], value=v) for v in vals]
        rng.shuffle(needles)
        if spec.haystack == "essay":
            start = rng.randrange(max(1, len(sentences) // 2))
            doc = [sentences[(start + i) % len(sentences)] for i in range(n)]
            cuts = sorted(int(len(doc) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
            parts, last = [], 0
            for cut, needle in zip(cuts, needles):
                parts += doc[last:cut] + [needle]
                last = cut
            context = " ".join(parts + doc[last:])
        else:
            if spec.haystack == "repeat":
                lines = [REPEAT_HAYSTACK] * n
            else:  # "needle": distractor needles with other keys
                lines = [NIAH_NEEDLE.format(type_needle_v=spec.type_needle_v,
                                            key=_random_value(rng, spec.type_needle_k, words),
                                            value=_random_value(rng, spec.type_needle_v, words)) for _ in range(n)]
            for position, needle in zip(sorted(rng.sample(range(n + 1), len(needles)), reverse=True), needles):
                lines.insert(position, needle)
            context = "\n".join(lines)
        queried = rng.sample(range(num_needle_k), spec.num_needle_q)
        query_keys = [keys[i] for i in queried]
        answers = [v for i in queried for v in values[i]]
        query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1] if len(query_keys) > 1 else query_keys[0]
        template, type_v = NIAH_TEMPLATE, spec.type_needle_v
        if spec.num_needle_q * spec.num_needle_v == 1:  # RULER's singular wording
            template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
            type_v = type_v[:-1]
            gen_prefix = f"The special magic {type_v} for {query} mentioned in the provided text is"
        else:
            gen_prefix = f"The special magic {type_v} for {query} mentioned in the provided text are"
        text = template.format(type_needle_v=type_v, context=context, query=query)
        return RulerSample(task, length, index, seed, text, gen_prefix, answers, new, "all",
                           meta={"haystack_units": n, "haystack": spec.haystack})

    cap = min(len(sentences), length) if spec.haystack == "essay" else length  # a unit is >= 1 token
    return _largest_fitting(build, tokenizer, length, 1, cap)


def _vt_text(rng: random.Random, n_noise: int, num_chains: int, num_hops: int, var_len: int) -> tuple[str, list[str], str]:
    names: list[str] = []
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=var_len)))
    names = list(dict.fromkeys(names))
    chains, first_vars, value = [], [], ""
    for c in range(num_chains):
        chain_vars = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        start_value = str(rng.randint(10000, 99999))
        chain = [f"VAR {chain_vars[0]} = {start_value}"] + [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} "
                                                            for j in range(num_hops)]
        chains.append(chain)
        if c == 0:
            first_vars, value = chain_vars, start_value
    sentences = [VT_NOISE] * n_noise
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences) + 1), len(chain)))
        for offset, (position, statement) in enumerate(zip(positions, chain)):
            sentences.insert(position + offset, statement)
    context = " ".join(sentences).replace(". \n", ".\n")
    return context, first_vars, value


def _vt(task: str, tokenizer: Any, length: int, index: int, seed: int, new: int) -> RulerSample:
    num_chains, num_hops = 1, 4
    key = f"{seed}:{task}:{length}:{index}"

    def build(n: int) -> RulerSample:
        rng = random.Random(key)
        # RULER's one in-context example: a short chain (3-letter names) before the question
        ex_context, ex_vars, ex_value = _vt_text(rng, 5, num_chains, num_hops, 3)
        example = (VT_TEMPLATE.format(context=ex_context, query=ex_value) + " "
                   + VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=ex_value) + " ".join(ex_vars))
        context, chain_vars, value = _vt_text(rng, n, num_chains, num_hops, 5)
        text = example + "\n\n" + VT_TEMPLATE.format(context=context, query=value)
        prefix = VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=value).strip()
        return RulerSample(task, length, index, seed, text, prefix, chain_vars, new, "all", meta={"noises": n})

    return _largest_fitting(build, tokenizer, length, num_hops + 1, length)


def _cwe(task: str, tokenizer: Any, length: int, index: int, seed: int, new: int) -> RulerSample:
    vocabulary = word_list()
    key = f"{seed}:{task}:{length}:{index}"
    num_common = 10
    common_repeats, uncommon_repeats = (30, 3) if length >= 4096 else (6, 1)
    example_repeats = (10, 3) if length >= 4096 else (3, 1)

    def listing(rng: random.Random, num_words: int, repeats: tuple[int, int]) -> tuple[str, list[str]]:
        chosen = rng.sample(vocabulary, num_words)
        common, uncommon = chosen[:num_common], chosen[num_common:]
        items = common * repeats[0] + uncommon * repeats[1]
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common

    def build(n: int) -> RulerSample:
        rng = random.Random(key)
        ex_context, ex_answer = listing(rng, 20 if length < 4096 else 40, example_repeats)
        example = (CWE_TEMPLATE.format(context=ex_context) + " " + CWE_ANSWER_PREFIX + " "
                   + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer)))
        context, answer = listing(rng, n, (common_repeats, uncommon_repeats))
        text = example + "\n" + CWE_TEMPLATE.format(context=context)
        return RulerSample(task, length, index, seed, text, CWE_ANSWER_PREFIX, answer, new, "all",
                           meta={"num_words": n})

    return _largest_fitting(build, tokenizer, length, num_common + 1, len(vocabulary))


def _fwe(task: str, tokenizer: Any, length: int, index: int, seed: int, new: int) -> RulerSample:
    key = f"{seed}:{task}:{length}:{index}"
    alpha, coded_len = 2.0, 6
    vocab_size = max(length // 50, 8)
    zeta = sum(k ** -alpha for k in range(1, 100_000))  # zeta(2) to 1e-5

    def build(n: int) -> RulerSample:
        rng = random.Random(key)
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=coded_len)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."  # RULER: the most frequent "word" is noise
        counts = [int(n * (k ** -alpha) / zeta) for k in range(1, len(ranked) + 1)]
        words = [w for w, c in zip(ranked, counts) for _ in range(c)]
        rng.shuffle(words)
        text = FWE_TEMPLATE.format(context=" ".join(words))
        return RulerSample(task, length, index, seed, text, FWE_ANSWER_PREFIX, ranked[1:4], new, "all",
                           meta={"num_words": n})

    return _largest_fitting(build, tokenizer, length, 16, 4 * length)


# --------------------------------------------------------------------------- the entry point

def make_ruler_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0) -> RulerSample:
    """Sample ``index`` of RULER task ``task`` at ``length`` tokens (deterministic in all arguments).

    Raises:
        ConfigError: unknown task, or a length too short for the task's smallest sample.
    """
    if task not in TASKS:
        raise ConfigError(f"RULER task {task!r}: unknown; known tasks: {', '.join(TASKS)} "
                          f"(QA is not available offline: no local QA source)")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ConfigError(f"RULER length must be a positive number of tokens, got {length!r}")
    kind, spec, new, _ = TASKS[task]
    if kind == "niah":
        return _niah(task, spec, tokenizer, length, index, seed, new)
    return {"vt": _vt, "cwe": _cwe, "fwe": _fwe}[kind](task, tokenizer, length, index, seed, new)


__all__ = ["DEFAULT_TASKS", "NiahSpec", "RulerSample", "TASKS", "make_ruler_sample", "word_list"]
