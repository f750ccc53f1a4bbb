"""Corpus loading, the tokenizer, and deterministic batches."""

import json

import numpy as np
import pytest

from conftest import SHAKESPEARE
from grt_megatron.data import DataError, Tokenizer, TokenSplits, eval_windows, load_documents, train_batch
from grt_megatron.data.batches import tokens_from_documents


@pytest.fixture(scope="module")
def pydoc_tokenizer():
    return Tokenizer.train(load_documents("builtin:pydoc_topics"), vocab_size=512)


def test_builtin_corpus_is_real_text():
    docs = load_documents("builtin:pydoc_topics")
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000


def test_tokenizer_round_trips_layout(pydoc_tokenizer, tmp_path):
    text = "def f(x):\n    return x  # two  spaces\n\n\tTabbed 12345 ünïcödé ✓"
    assert pydoc_tokenizer.decode(pydoc_tokenizer.encode(text)) == text
    path = tmp_path / "tok.model"
    pydoc_tokenizer.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.identity == pydoc_tokenizer.identity and loaded.vocab_size == 512
    assert loaded.encode(text) == pydoc_tokenizer.encode(text)


def test_token_stream_appends_eos_per_document(pydoc_tokenizer):
    stream = tokens_from_documents(pydoc_tokenizer, ["a b", "c"])
    assert (stream == pydoc_tokenizer.eos_id).sum() == 2 and stream[-1] == pydoc_tokenizer.eos_id


def test_batches_are_a_function_of_seed_and_iteration():
    tokens = np.arange(10_000, dtype=np.int32)
    a = train_batch(tokens, 32, seed=5, iteration=17, size=8)
    assert a.shape == (8, 33)
    assert np.array_equal(a, train_batch(tokens, 32, seed=5, iteration=17, size=8))
    assert not np.array_equal(a, train_batch(tokens, 32, seed=5, iteration=18, size=8))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous windows: labels are the next tokens
    evals = eval_windows(tokens, 32, max_windows=12)
    assert evals.shape == (12, 33) and np.array_equal(evals, eval_windows(tokens, 32, max_windows=12))
    assert eval_windows(tokens, 32, max_windows=10**6).shape == (9999 // 32, 33)  # bounded by the split


def test_splits_refuse_tiny_corpus():
    with pytest.raises(DataError, match="too few"):
        TokenSplits.from_stream(np.arange(50, dtype=np.int32), 0.1, seq_length=32)


def test_local_text_and_jsonl(tmp_path):
    assert load_documents(str(SHAKESPEARE))[0].startswith("First Citizen")
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"body": "hello"}) + "\n\n" + json.dumps({"body": "world"}) + "\n")
    assert load_documents(str(good), text_key="body") == ["hello", "world"]


@pytest.mark.parametrize("content,needle", [
    ('{"text": "ok"}\nnot json\n', r"c\.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"c\.jsonl:2: no 'text' key"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, needle):
    path = tmp_path / "c.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=needle):
        load_documents(str(path))


def test_missing_empty_and_non_utf8_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_documents(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_documents(str(empty))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"abc\xff\xfe")
    with pytest.raises(DataError, match="not UTF-8"):
        load_documents(str(binary))


def test_unreachable_hf_dataset_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="not a local file, and loading it as a Hugging Face dataset failed"):
        load_documents("no-such-user/no-such-dataset-xyz")


def test_bad_tokenizer_file(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        Tokenizer.load(bad)
