"""confkv.data: built-in corpora, file errors, corpus tokens, needle-in-a-haystack samples."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from confkv.data import corpora
from confkv.data import (
    BUILTIN_CORPORA,
    CorpusError,
    corpus_tokens,
    load_corpus,
    make_niah_sample,
    score_niah,
)
from confkv.models import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    """Byte-level tokenizer: one token per UTF-8 byte, so lengths are easy to reason about."""
    return tiny_tokenizer()


# --------------------------------------------------------------------------- corpora


def test_builtin_corpora_are_long_english_and_deterministic() -> None:
    assert set(BUILTIN_CORPORA) >= {"pydoc-topics", "stdlib-docs"}
    topics = load_corpus("pydoc-topics")
    assert len(topics) > 400_000 and topics.startswith('The "assert" statement')
    docs = load_corpus("stdlib-docs")
    assert len(docs) > 200_000  # ~100K SmolLM2 tokens
    assert docs.startswith("Module argparse") and "ArgumentParser" in docs
    assert corpora._stdlib_docs() == docs and corpora._pydoc_topics() == topics
    for text in (topics, docs):
        assert text.count(" the ") > 1000


def test_text_file_corpus(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("Call me Ishmael. " * 10, encoding="utf-8")
    assert load_corpus(str(path)).startswith("Call me Ishmael.")
    path.write_text("Changed.", encoding="utf-8")
    assert load_corpus(str(path)) == "Changed.", "files are re-read, not memoized"


@pytest.mark.parametrize(
    "content, problem",
    [(None, "does not exist"), (b"", "empty"), (b"  \n\t\n", "empty"), (b"abc\x00\x01def", "binary"),
     (b"caf\xe9 au lait", "not UTF-8")],
)
def test_bad_file_errors_name_path_and_problem(tmp_path: Path, content: bytes | None, problem: str) -> None:
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CorpusError, match=problem) as info:
        load_corpus(str(path))
    assert str(path) in str(info.value)


def test_directory_and_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="directory"):
        load_corpus(str(tmp_path))
    with pytest.raises(CorpusError, match="unknown corpus 'wikitext'.*pydoc-topics"):
        load_corpus("wikitext")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "secret.txt"
    path.write_text("hidden")
    path.chmod(0)
    with pytest.raises(CorpusError, match="not readable"):
        load_corpus(str(path))


def test_hf_spec_parsing_and_missing_datasets() -> None:
    assert corpora._parse_hf_spec("hf:pg19") == ("pg19", None, "test")
    assert corpora._parse_hf_spec("hf:pg19:validation") == ("pg19", None, "validation")
    assert corpora._parse_hf_spec("hf:wikitext:wikitext-2-raw-v1") == ("wikitext", "wikitext-2-raw-v1", "test")
    assert corpora._parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:train[:10]") == ("wikitext", "wikitext-2-raw-v1", "train[:10]")
    assert corpora._parse_hf_spec("hf:pg19:train[:10]") == ("pg19", None, "train[:10]")
    with pytest.raises(CorpusError, match="bad hub corpus spec"):
        corpora._parse_hf_spec("hf:")
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(CorpusError, match="datasets"):
            load_corpus("hf:wikitext:wikitext-2-raw-v1")


# --------------------------------------------------------------------------- tokens


def test_corpus_tokens_shape_and_offsets(tok) -> None:
    first = corpus_tokens(tok, "pydoc-topics", 100)
    assert first.shape == (1, 100) and first.dtype == torch.long
    shifted = corpus_tokens(tok, "pydoc-topics", 50, offset=30)
    assert torch.equal(shifted[0], first[0, 30:80])
    assert tok.decode(first[0]).startswith('The "assert" statement')


def test_corpus_tokens_too_short_is_a_clear_error(tok, tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("0123456789")
    assert corpus_tokens(tok, str(path), 10).shape == (1, 10)
    with pytest.raises(CorpusError, match="has 10 tokens.*needs 12"):
        corpus_tokens(tok, str(path), 10, offset=2)
    with pytest.raises(ValueError):
        corpus_tokens(tok, str(path), 0)


# --------------------------------------------------------------------------- needle in a haystack


@pytest.mark.parametrize("context_tokens", [300, 1000, 2500])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_niah_sample_length_and_needle_depth(tok, context_tokens: int, depth: float) -> None:
    sample = make_niah_sample(tok, context_tokens=context_tokens, depth=depth, trial=1)
    assert sample.input_ids.shape == (1, context_tokens)
    assert torch.equal(sample.input_ids, torch.cat([sample.context_ids, sample.question_ids], dim=1))
    pos, n = sample.needle_position, sample.needle_length
    needle = tok.decode(sample.context_ids[0, pos : pos + n])
    assert needle.strip() == f"The special magic number is {sample.answer}. Remember it."
    context_len = sample.context_ids.shape[1]
    window = max(16, context_len // 20) + n
    assert abs(pos - depth * context_len) <= window
    if depth == 0.0:
        assert pos == 0
    # at a boundary: start of text, after a line break, or after a sentence's end
    # (at 300 byte-tokens the +-16-token window may only offer a word boundary)
    before = tok.decode(sample.context_ids[0, :pos])
    after = tok.decode(sample.context_ids[0, pos + n :])
    line_or_sentence = before.endswith("\n") or before.rstrip(" ").endswith((".", "!", "?", '."', ".)"))
    assert pos == 0 or line_or_sentence or (context_tokens < 1000 and after.startswith(" "))
    assert tok.decode(sample.question_ids[0]) == "\n\nWhat is the special magic number? The special magic number is"


def test_niah_passkeys_are_seeded_by_trial(tok) -> None:
    answers = [make_niah_sample(tok, context_tokens=200, depth=0.5, trial=t).answer for t in range(20)]
    assert all(a.isdigit() and 5 <= len(a) <= 7 for a in answers)
    assert len(set(answers)) == 20
    again = make_niah_sample(tok, context_tokens=200, depth=0.5, trial=3)
    assert again.answer == answers[3]
    assert make_niah_sample(tok, context_tokens=200, depth=0.5, trial=3, seed=1).answer != answers[3]


def test_niah_custom_needle_question_and_haystack(tok, tmp_path: Path) -> None:
    hay = tmp_path / "hay.txt"
    hay.write_text("The sky was grey. The sea was calm.\n" * 200)
    sample = make_niah_sample(
        tok,
        context_tokens=600,
        depth=0.5,
        trial=0,
        haystack=str(hay),
        needle_template="The best thing to do in Paris is {answer}.",
        question_template="What is the best thing to do in Paris? The best thing to do in Paris is",
        answer="to eat a croissant",
    )
    assert sample.input_ids.shape == (1, 600)
    text = tok.decode(sample.context_ids[0])
    assert "The best thing to do in Paris is to eat a croissant." in text
    assert sample.answer == "to eat a croissant"


def test_niah_keeps_the_tokenizers_bos(tok) -> None:
    """Tokenizers that prepend <bos> by default (Gemma) get it at the start of the context."""
    from tokenizers.processors import TemplateProcessing

    from confkv.models import tiny_tokenizer

    bos_tok = tiny_tokenizer()
    bos_tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos_tok.bos_token_id)]
    )
    assert bos_tok("a").input_ids == [bos_tok.bos_token_id, ord("a")]
    for depth in (0.0, 0.5):
        sample = make_niah_sample(bos_tok, context_tokens=800, depth=depth, trial=2)
        assert sample.input_ids.shape == (1, 800)
        assert sample.context_ids[0, 0].item() == bos_tok.bos_token_id
        pos = sample.needle_position
        assert bos_tok.decode(sample.context_ids[0, pos : pos + sample.needle_length]).startswith(
            ("The special", " The special")
        )
    plain = make_niah_sample(bos_tok, context_tokens=800, depth=0.0, trial=2, add_special_tokens=False)
    assert plain.needle_position == 0 and plain.context_ids[0, 0].item() != bos_tok.bos_token_id


def test_niah_rejects_bad_arguments(tok) -> None:
    with pytest.raises(ValueError, match="depth"):
        make_niah_sample(tok, context_tokens=500, depth=1.5, trial=0)
    with pytest.raises(ValueError, match="too short"):
        make_niah_sample(tok, context_tokens=50, depth=0.5, trial=0)
    with pytest.raises(CorpusError):
        make_niah_sample(tok, context_tokens=10_000_000, depth=0.5, trial=0)


@pytest.mark.parametrize(
    "generated, ok",
    [(" 483920.", True), (" 483920", True), ("483,920 is the number", True), (" The number is 483920", True),
     (" 4839201", False), (" 48392", False), (" 123456 or 483920", False), (" I don't know", False), ("", False)],
)
def test_score_niah_numbers(generated: str, ok: bool) -> None:
    assert score_niah(generated, "483920") is ok


def test_score_niah_text_answer() -> None:
    assert score_niah(" To Eat a croissant in the morning", "to eat a croissant")
    assert not score_niah(" sleep", "to eat a croissant")


# --------------------------------------------------------------------------- with the real SmolLM2


@pytest.mark.integration
def test_builtin_corpora_sizes_in_smollm2_tokens(smollm2) -> None:
    _, tok = smollm2
    assert 100_000 < corpora._corpus_ids(tok, "pydoc-topics").numel() < 130_000  # ~113K
    assert corpora._corpus_ids(tok, "stdlib-docs").numel() > 20_000  # ~100K


@pytest.mark.integration
def test_smollm2_retrieves_the_passkey_with_full_attention(smollm2) -> None:
    """METHOD.md: passkey retrieval with full KV works at middle depths (here 1K tokens)."""
    model, tok = smollm2
    sample = make_niah_sample(tok, context_tokens=1024, depth=0.5, trial=0)
    with torch.no_grad():
        out = model.generate(sample.input_ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.eos_token_id)
    generated = tok.decode(out[0, sample.input_ids.shape[1]:])
    assert score_niah(generated, sample.answer), generated
