"""Reading corpora (txt/jsonl/parquet/HF) with their error policies, and the tokenizer interface."""

import json
import pickle
import re

import pytest

from conftest import SHAKESPEARE
from grt_megatron.data import DataError, SentencePieceTokenizer, SourcePolicy, load_documents, load_tokenizer
from grt_megatron.data.sources import SourceStats, iter_documents
from grt_megatron.data.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def sp_tokenizer():
    return SentencePieceTokenizer.train(load_documents("builtin:pydoc_topics"), vocab_size=512)


def test_builtin_corpus_is_real_text():
    docs = load_documents("builtin:pydoc_topics")
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000


def test_text_file_documents_rejoin_to_the_normalized_source():
    text = SHAKESPEARE.read_text()
    docs = load_documents(str(SHAKESPEARE))
    normalized = "\n\n".join(p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip())
    assert len(docs) > 100 and "\n\n".join(docs) == normalized


def test_tokenizer_round_trips_layout(sp_tokenizer, tmp_path):
    text = "def f(x):\n    return x  # two  spaces\n\n\tTabbed 12345 ünïcödé ✓"
    assert sp_tokenizer.decode(sp_tokenizer.encode(text)) == text
    loaded = load_tokenizer(sp_tokenizer.save(tmp_path / "tok.model"))
    assert loaded.identity == sp_tokenizer.identity and loaded.vocab_size == 512
    assert loaded.encode_batch([text, "x"]) == [sp_tokenizer.encode(text), sp_tokenizer.encode("x")]
    clone = pickle.loads(pickle.dumps(sp_tokenizer))  # what tokenizer worker processes receive
    assert clone.encode(text) == sp_tokenizer.encode(text)


def test_unigram_tokenizer_trains():
    tok = SentencePieceTokenizer.train(load_documents("builtin:pydoc_topics"), 600, model_type="unigram")
    assert tok.vocab_size == 600 and tok.decode(tok.encode("for x in y:")) == "for x in y:"


def test_hugging_face_tokenizer_folder(tmp_path):
    """A real transformers tokenizer built here (no hub): loaded from its folder by the same interface."""
    from tokenizers import Tokenizer as RawTokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(load_documents("builtin:pydoc_topics"),
                            trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(tmp_path / "hf")
    tok = load_tokenizer(tmp_path / "hf")
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 700 and tok.eos_id == 0
    assert tok.decode(tok.encode("print('hi')\n")) == "print('hi')\n"
    assert tok.identity == load_tokenizer(tmp_path / "hf").identity
    saved = tok.save(tmp_path / "copy")
    assert load_tokenizer(saved).identity == tok.identity


def test_bad_tokenizer_specs(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a sentencepiece model"):
        load_tokenizer(bad)
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="without tokenizer.json"):
        load_tokenizer(tmp_path / "empty_dir")
    (tmp_path / "empty.model").write_bytes(b"")  # sentencepiece loads it as a model of no pieces
    with pytest.raises(DataError, match=r"empty\.model: not a sentencepiece model \(no pieces"):
        load_tokenizer(tmp_path / "empty.model")


def test_jsonl_and_parquet(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"body": "hello"}) + "\n\n" + json.dumps({"body": "world"}) + "\n")
    assert load_documents(str(good), SourcePolicy(text_key="body")) == ["hello", "world"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", None, "two"], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    # A null is a bad record (it used to vanish uncounted): refused naming the row, or skipped and counted.
    with pytest.raises(DataError, match=r"c\.parquet: row 2: 'text' is null, not a string"):
        load_documents(str(tmp_path / "c.parquet"))
    stats = SourceStats()
    skip = SourcePolicy(on_bad_record="skip")
    assert list(iter_documents(str(tmp_path / "c.parquet"), skip, stats)) == ["one", "two"]
    assert stats.skipped_records == 1
    with pytest.raises(DataError, match="no column 'body'"):
        load_documents(str(tmp_path / "c.parquet"), SourcePolicy(text_key="body"))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: row 1: 'text' is int, not a string"):
        load_documents(str(tmp_path / "n.parquet"))


@pytest.mark.parametrize("content,needle", [
    ('{"text": "ok"}\nnot json\n', r"c\.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"c\.jsonl:2: no 'text' key"),
    # Not strings: these became the documents "None" and "5"
    ('{"text": "ok"}\n{"text": null}\n', r"c\.jsonl:2: 'text' is null, not a string"),
    ('{"text": "ok"}\n{"text": 5}\n', r"c\.jsonl:2: 'text' is int, not a string"),
])
def test_bad_jsonl_fails_or_is_skipped_and_counted(tmp_path, content, needle):
    path = tmp_path / "c.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=needle):
        load_documents(str(path))
    stats = SourceStats()
    assert list(iter_documents(str(path), SourcePolicy(on_bad_record="skip"), stats)) == ["ok"]
    assert stats.skipped_records == 1 and stats.documents == 1


def test_non_utf8_fails_or_is_replaced_and_counted(tmp_path):
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"abc\xff\xfedef")
    with pytest.raises(DataError, match=r"bin\.txt: not UTF-8 \(byte 3\)"):
        load_documents(str(binary))
    stats = SourceStats()
    assert list(iter_documents(str(binary), SourcePolicy(on_decode_error="replace"), stats)) == ["abc\ufffd\ufffddef"]
    assert stats.replaced_decode_errors == 1
    lines = tmp_path / "l.jsonl"
    lines.write_bytes(b'{"text": "ok"}\n{"text": "b\xffad"}\n')
    with pytest.raises(DataError, match=r"l\.jsonl:2: not UTF-8"):
        load_documents(str(lines))


def test_missing_and_empty(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_documents(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_documents(str(empty))


def test_unreachable_hf_dataset_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="not a local file, and loading it as a Hugging Face dataset failed"):
        load_documents("no-such-user/no-such-dataset-xyz")
