"""Text for the evaluations: corpora (:mod:`~confkv.data.corpora`) and needle-in-a-haystack
samples (:mod:`~confkv.data.needles`)."""

from confkv.data.corpora import BUILTIN_CORPORA, CorpusError, corpus_tokens, load_corpus
from confkv.data.needles import (DEFAULT_NEEDLE_TEMPLATE, DEFAULT_QUESTION_TEMPLATE, NiahSample, make_niah_sample,
                                 score_niah)

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
