"""`grt-prepare-data`: text → tokenizer → Megatron indexed dataset (`PREFIX.bin/.idx`).

    grt-prepare-data --input corpus.jsonl --input wikitext:wikitext-2-raw-v1@train \
        --output-prefix data/mix --train-tokenizer --vocab-size 8192 --workers 2

Flags follow Megatron-LM's `preprocess_data.py` where they overlap. Documents are tokenized in worker
processes (order kept), EOD appended to each; output appears only when complete (see indexed.py).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from tqdm import tqdm

from grt_megatron import __version__
from grt_megatron.data.indexed import IndexedDatasetWriter, check_output_free, prefix_paths
from grt_megatron.data.sources import DataError, EmptyCorpusError, SourcePolicy, SourceStats, iter_documents
from grt_megatron.data.tokenizer import SentencePieceTokenizer, Tokenizer, load_tokenizer

CHUNK_DOCUMENTS = 64


@dataclass
class PrepareSummary:
    prefix: str
    documents: int
    tokens: int
    skipped_records: int
    replaced_decode_errors: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def line(self) -> str:
        extra = ""
        if self.skipped_records:
            extra += f", {self.skipped_records} bad records skipped"
        if self.replaced_decode_errors:
            extra += f", {self.replaced_decode_errors} records with non-UTF-8 bytes replaced"
        return (f"{self.prefix}: {self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s "
                f"({self.tokens_per_s:,.0f} tokens/s){extra}")


# ---- worker processes: each holds its own tokenizer ----------------------------------------------
_WORKER_TOKENIZER: Optional[Tokenizer] = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_chunk(texts: Sequence[str]) -> list[list[int]]:
    return _WORKER_TOKENIZER.encode_batch(texts)


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _encoded(docs: Iterable[str], tokenizer: Tokenizer, workers: int) -> Iterator[list[list[int]]]:
    if workers <= 1:
        for chunk in _chunks(docs, CHUNK_DOCUMENTS):
            yield tokenizer.encode_batch(chunk)
        return
    # spawn, not fork: the parent may hold torch/OpenMP threads that a forked child would deadlock on.
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        yield from pool.imap(_encode_chunk, _chunks(docs, CHUNK_DOCUMENTS), chunksize=4)


def prepare_dataset(
    inputs: Sequence[str],
    output_prefix: str | os.PathLike,
    tokenizer: Optional[Tokenizer] = None,
    *,
    train_vocab_size: Optional[int] = None,
    tokenizer_type: str = "bpe",
    policy: Optional[SourcePolicy] = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> PrepareSummary:
    """Tokenize `inputs` into `output_prefix`.bin/.idx; with `train_vocab_size` (and no `tokenizer`),
    first train a sentencepiece tokenizer on them, saved as `output_prefix`.tokenizer.model."""
    if (tokenizer is None) == (train_vocab_size is None):
        raise DataError("give exactly one of a tokenizer (--tokenizer) or --train-tokenizer --vocab-size N")
    policy = policy or SourcePolicy()
    start = time.perf_counter()
    trained_file = None
    if tokenizer is None:
        check_output_free(output_prefix, overwrite)  # before spending time on training
        Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
        try:
            tokenizer = SentencePieceTokenizer.train(iter_documents(inputs, policy), train_vocab_size, tokenizer_type)
        except EmptyCorpusError:
            raise EmptyCorpusError(f"input {', '.join(inputs)}: the corpus is empty") from None
        trained_file = tokenizer.save(Path(str(output_prefix) + f".tokenizer.tmp-{os.getpid()}"))
    stats = SourceStats()
    eos = tokenizer.eos_id
    try:
        with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size, overwrite=overwrite) as writer:
            bar = tqdm(desc=f"tokenize {Path(output_prefix).name}", unit=" docs", disable=not progress,
                       dynamic_ncols=True)
            for encoded in _encoded(iter_documents(inputs, policy, stats), tokenizer, workers):
                for ids in encoded:
                    writer.add_document([*ids, eos])
                bar.update(len(encoded))
                bar.set_postfix(tokens=f"{writer.tokens:,}", refresh=False)
            bar.close()
            if writer.documents == 0:
                raise EmptyCorpusError(f"input {', '.join(inputs)}: the corpus is empty")
            seconds = time.perf_counter() - start
            meta = {
                "grt_megatron_version": __version__,
                "inputs": list(inputs),
                "tokenizer": tokenizer.describe(),
                "skipped_records": stats.skipped_records,
                "replaced_decode_errors": stats.replaced_decode_errors,
                "policy": asdict(policy),
                "seconds": seconds,
            }
            writer.commit(meta, tokenizer_file=trained_file)
    finally:
        if trained_file is not None:
            trained_file.unlink(missing_ok=True)  # moved into place by commit, or abandoned
    return PrepareSummary(str(output_prefix), writer.documents, writer.tokens, stats.skipped_records,
                          stats.replaced_decode_errors, seconds)


def tokenizer_of_prefix(prefix: str | os.PathLike) -> Optional[Tokenizer]:
    """The tokenizer trained alongside a prefix (`PREFIX.tokenizer.model`), if there is one."""
    path = prefix_paths(prefix)["tokenizer"]
    return load_tokenizer(path) if path.is_file() else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grt-prepare-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", required=True, metavar="PATH_OR_DATASET",
                        help=".txt / .jsonl / .parquet file, builtin:pydoc_topics, or a Hugging Face dataset "
                             "name[:config][@split]; repeat for several")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="a sentencepiece .model, or a Hugging Face tokenizer folder or name")
    tok.add_argument("--train-tokenizer", action="store_true",
                     help="train a sentencepiece tokenizer on the inputs (saved as PREFIX.tokenizer.model)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="with --train-tokenizer (default 8192)")
    parser.add_argument("--tokenizer-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--json-key", default="text", help="text field of .jsonl/.parquet/datasets rows")
    parser.add_argument("--on-bad-record", choices=("fail", "skip"), default="fail",
                        help="a jsonl line that is not JSON or lacks the key")
    parser.add_argument("--on-decode-error", choices=("fail", "replace"), default="fail",
                        help="bytes that are not UTF-8")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    from grt_megatron.console import quiet_known_warnings

    quiet_known_warnings()
    args = build_parser().parse_args(argv)
    try:
        if args.workers < 1:
            raise DataError(f"--workers must be >= 1, got {args.workers}")
        policy = SourcePolicy(args.json_key, args.on_bad_record, args.on_decode_error)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        summary = prepare_dataset(
            args.input, args.output_prefix, tokenizer,
            train_vocab_size=args.vocab_size if args.train_tokenizer else None,
            tokenizer_type=args.tokenizer_type, policy=policy, workers=args.workers,
            overwrite=args.overwrite, progress=not args.no_progress,
        )
    except DataError as err:
        print(f"grt-prepare-data: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("grt-prepare-data: interrupted; nothing was written", file=sys.stderr)
        sys.exit(130)
    print(summary.line())


if __name__ == "__main__":
    main()
