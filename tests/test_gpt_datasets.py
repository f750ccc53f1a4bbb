"""Training data from prepared prefixes: megatron-core's GPTDataset, blends, splits and seeded order."""

import numpy as np
import pytest

from conftest import SHAKESPEARE
from grt_megatron.data import DataError, load_tokenizer
from grt_megatron.data.gpt_datasets import GPTDatasets, build_gpt_datasets
from grt_megatron.data.indexed import prefix_paths
from grt_megatron.data.prepare import prepare_dataset


@pytest.fixture(scope="module")
def two_prefixes(pydoc_prefix, tmp_path_factory):
    pydoc, _ = pydoc_prefix
    tok = load_tokenizer(prefix_paths(pydoc)["tokenizer"])
    shakespeare = tmp_path_factory.mktemp("blend") / "shakespeare"
    prepare_dataset([str(SHAKESPEARE)], shakespeare, tok, progress=False)
    return [str(pydoc), str(shakespeare)], tok


def build(prefixes, tok, tmp_path, weights=None, seed=1, train=2000, split="969,30,1", valid_seed=None):
    return build_gpt_datasets(prefixes, weights, tok, seq_length=64, seed=seed, train_samples=train,
                              valid_samples=64, split=split, cache_dir=str(tmp_path / "cache"),
                              valid_seed=valid_seed)


def test_a_fixed_validation_seed_gives_every_run_seed_the_same_windows(world, two_prefixes, tmp_path):
    prefixes, tok = two_prefixes
    a, b = (build(prefixes[:1], tok, tmp_path, seed=s, valid_seed=0) for s in (1, 2))
    assert not np.array_equal(GPTDatasets.rows(a.train, 0, 16), GPTDatasets.rows(b.train, 0, 16))
    assert np.array_equal(GPTDatasets.rows(a.valid, 0, 64), GPTDatasets.rows(b.valid, 0, 64))
    c = build(prefixes[:1], tok, tmp_path, seed=2)  # without it, the run's seed cuts the windows
    assert not np.array_equal(GPTDatasets.rows(b.valid, 0, 64), GPTDatasets.rows(c.valid, 0, 64))


def test_samples_are_contiguous_token_windows(world, two_prefixes, tmp_path):
    prefixes, tok = two_prefixes
    ds = build(prefixes[:1], tok, tmp_path)
    rows = GPTDatasets.rows(ds.train, 0, 8)
    assert rows.shape == (8, 65) and rows.max() < tok.vocab_size
    sample = ds.train[3]
    assert np.array_equal(rows[3, :-1], sample["tokens"].numpy())
    assert np.array_equal(rows[3, 1:], sample["labels"].numpy())  # labels are the next tokens
    assert len(ds.train) >= 2000 and len(ds.valid) >= 64
    assert any((tmp_path / "cache").rglob("*.npy"))  # megatron's index cache


def test_blend_follows_weights(world, two_prefixes, tmp_path):
    prefixes, tok = two_prefixes
    ds = build(prefixes, tok, tmp_path, weights=[0.25, 0.75], train=4000)
    share = np.bincount(np.asarray(ds.train.dataset_index[:4000]), minlength=2) / 4000
    assert share == pytest.approx([0.25, 0.75], abs=0.01)
    # And the samples really come from those datasets: shakespeare windows decode to Shakespeare.
    from_second = int(np.flatnonzero(np.asarray(ds.train.dataset_index[:100]) == 1)[0])
    assert "\n" in tok.decode(GPTDatasets.rows(ds.train, from_second, 1)[0])


def test_same_seed_same_order_other_seed_other_order(world, two_prefixes, tmp_path):
    prefixes, tok = two_prefixes
    a = GPTDatasets.rows(build(prefixes, tok, tmp_path / "a", [1, 1], seed=5).train, 0, 32)
    b = GPTDatasets.rows(build(prefixes, tok, tmp_path / "b", [1, 1], seed=5).train, 0, 32)
    c = GPTDatasets.rows(build(prefixes, tok, tmp_path / "c", [1, 1], seed=6).train, 0, 32)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # A rebuilt dataset reading the cache gives the same order (what a resumed run does).
    again = GPTDatasets.rows(build(prefixes, tok, tmp_path / "a", [1, 1], seed=5).train, 0, 32)
    assert np.array_equal(a, again)


def test_train_and_valid_do_not_share_documents(world, two_prefixes, tmp_path):
    prefixes, tok = two_prefixes
    ds = build(prefixes[1:], tok, tmp_path, split="90,10,0")
    train_docs = set(np.asarray(ds.train.document_index).tolist())
    valid_docs = set(np.asarray(ds.valid.document_index).tolist())
    assert train_docs and valid_docs and not train_docs & valid_docs


@pytest.mark.parametrize("kwargs,needle", [
    (dict(weights=[1.0]), "data.weights has 1 entries for 2 data.prefixes"),
    (dict(weights=[1.0, -1.0]), "data.weights must be > 0"),
    (dict(split="1,0,0"), "data.split='1,0,0'"),
    (dict(split="abc"), "data.split='abc'"),
])
def test_bad_blend_config(world, two_prefixes, tmp_path, kwargs, needle):
    prefixes, tok = two_prefixes
    with pytest.raises(DataError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        build(prefixes, tok, tmp_path, **kwargs)


def test_prefix_from_another_tokenizer_is_refused(world, two_prefixes, tmp_path):
    from grt_megatron.data import SentencePieceTokenizer, load_documents

    prefixes, _ = two_prefixes
    other = SentencePieceTokenizer.train(load_documents(str(SHAKESPEARE)), vocab_size=400)
    with pytest.raises(DataError, match="tokenized with another tokenizer"):
        build(prefixes, other, tmp_path)


def test_too_small_prefix_is_refused_not_looped_on(world, two_prefixes, tmp_path):
    _, tok = two_prefixes
    (tmp_path / "small.jsonl").write_text("".join(f'{{"text": "document number {i}"}}\n' for i in range(5)))
    prepare_dataset([str(tmp_path / "small.jsonl")], tmp_path / "small", tok, progress=False)
    with pytest.raises(DataError, match="has 5 documents: data.split='969,30,1' leaves it no validation document"):
        build([str(tmp_path / "small")], tok, tmp_path)
    ds = build([str(tmp_path / "small")], tok, tmp_path, split="60,40,0")  # enough with a bigger valid share
    assert len(ds.valid) >= 64
