"""Preprocessing throughput of grt-prepare-data (tokens/s) on the shared corpora, 1 and 2 workers.

    python tools/bench/prepare_throughput.py [--corpus ../shared/data/books.jsonl] [--repeat 2]

Tokenizers: the sentencepiece BPE grt-prepare-data trains (8192 pieces, trained once on the corpus;
the training time is reported on its own) and a byte-level BPE Hugging Face tokenizer of the same size
built here (the kind GPT-2 uses; no hub access needed). Prints a table, writes
tools/bench/results/prepare_throughput.json.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench.common import REPO, argument_parser, parse_args, write_result  # noqa: E402

from grt_megatron.data import SentencePieceTokenizer, load_documents, load_tokenizer  # noqa: E402
from grt_megatron.data.prepare import prepare_dataset  # noqa: E402


def hf_bytelevel_bpe(documents, vocab_size: int, folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(folder)
    return load_tokenizer(folder)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "books.jsonl"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=2, help="runs per setting; the best is kept")
    args = parse_args(parser, "prepare_throughput")
    corpus = Path(args.corpus)
    docs = load_documents(str(corpus))
    work = Path(tempfile.mkdtemp(prefix="grt-prepare-bench-"))
    try:
        start = time.perf_counter()
        sp = SentencePieceTokenizer.train(docs, args.vocab_size)
        sp_train_s = time.perf_counter() - start
        start = time.perf_counter()
        hf = hf_bytelevel_bpe(docs, args.vocab_size, work / "hf")
        hf_train_s = time.perf_counter() - start
        rows = []
        for name, tok in (("sentencepiece-bpe", sp), ("hf-bytelevel-bpe", hf)):
            for workers in (1, 2):
                best = None
                for i in range(args.repeat):
                    prefix = work / f"{name}-{workers}-{i}"
                    summary = prepare_dataset([str(corpus)], prefix, tok, workers=workers, progress=False)
                    if best is None or summary.seconds < best.seconds:
                        best = summary
                rows.append({"tokenizer": name, "workers": workers, "documents": best.documents,
                             "tokens": best.tokens, "seconds": best.seconds, "tokens_per_s": best.tokens_per_s,
                             "mb_per_s": corpus.stat().st_size / 1e6 / best.seconds})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{corpus.name}: {corpus.stat().st_size / 1e6:.1f} MB, {len(docs)} documents, {os.cpu_count()} CPUs; "
          f"best of {args.repeat}")
    print(f"{'tokenizer':<20}{'workers':>8}{'tokens':>12}{'seconds':>9}{'tokens/s':>12}{'MB/s':>7}")
    for r in rows:
        print(f"{r['tokenizer']:<20}{r['workers']:>8}{r['tokens']:>12,}{r['seconds']:>9.2f}"
              f"{r['tokens_per_s']:>12,.0f}{r['mb_per_s']:>7.2f}")
    print(f"tokenizer training ({args.vocab_size}): sentencepiece {sp_train_s:.1f} s, hf byte-level BPE {hf_train_s:.1f} s")
    out = write_result(args.output, {"benchmark": "prepare_throughput", "corpus": corpus.name, "cpus": os.cpu_count(),
                                     "vocab_size": args.vocab_size, "sentencepiece_train_s": sp_train_s,
                                     "hf_train_s": hf_train_s, "results": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
