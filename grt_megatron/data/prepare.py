"""`grt-prepare-data`: text → tokenizer → Megatron indexed dataset (`PREFIX.bin/.idx`).

    grt-prepare-data --input corpus.jsonl --input wikitext:wikitext-2-raw-v1@train \\
        --output-prefix data/mix --train-tokenizer --vocab-size 8192 --workers 2

Flags follow Megatron-LM's `preprocess_data.py` where they overlap. Documents are tokenized in worker
processes (order kept), EOD appended to each; output appears only when complete (see indexed.py).
Ctrl-C or SIGTERM at any point exits 130 / 143 with one line, leaving nothing under the prefix.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

from tqdm import tqdm

from grt_megatron import __version__
from grt_megatron.data.indexed import (IndexedDatasetWriter, check_output_free, prefix_paths,
                                       remove_stale_temporaries, signals_deferred)
from grt_megatron.data.sources import (DataError, EmptyCorpusError, SourcePolicy, SourceStats, check_sources,
                                       iter_documents)
from grt_megatron.data.tokenizer import SentencePieceTokenizer, Tokenizer, load_tokenizer
from grt_megatron.data.tokenizer_workers import TokenizerWorkers, TokenizerWorkerError
from grt_megatron.errors import Interrupted, raise_interrupted, raised_from

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


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _encoded(docs: Iterable[str], tokenizer: Tokenizer, workers: int) -> Iterator[list[list[int]]]:
    if workers <= 1:
        for chunk in _chunks(docs, CHUNK_DOCUMENTS):
            yield tokenizer.encode_batch(chunk)
        return
    with TokenizerWorkers(tokenizer, workers) as pool:
        yield from pool.imap(_chunks(docs, CHUNK_DOCUMENTS))


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
    on_stage: Optional[Callable[[str], None]] = None,
) -> PrepareSummary:
    """Tokenize `inputs` into `output_prefix`.bin/.idx; with `train_vocab_size` (and no `tokenizer`),
    first train a sentencepiece tokenizer on them, saved as `output_prefix`.tokenizer.model.

    Whatever stops it (an error, KeyboardInterrupt, what a signal handler raises) removes every temporary
    file it made before going on; an existing prefix is replaced (`overwrite`) only once the new one is
    complete, by exactly the new run's files. `on_stage` is told "tokenizer training", "tokenization",
    and "written" once the prefix is complete."""
    if (tokenizer is None) == (train_vocab_size is None):
        raise DataError("give exactly one of a tokenizer (--tokenizer) or --train-tokenizer --vocab-size N")
    policy = policy or SourcePolicy()
    stage = on_stage or (lambda name: None)
    start = time.perf_counter()
    check_output_free(output_prefix, overwrite)  # before spending time on training
    check_sources(inputs)
    removed = remove_stale_temporaries(output_prefix)
    if removed:
        print(f"removed {len(removed)} temporary files of dead earlier runs on this host: "
              f"{', '.join(p.name for p in removed)}", flush=True)
    trained = tokenizer is None
    if trained:
        stage("tokenizer training")
        try:
            tokenizer = SentencePieceTokenizer.train(iter_documents(inputs, policy), train_vocab_size, tokenizer_type)
        except EmptyCorpusError:
            raise EmptyCorpusError(f"input {', '.join(inputs)}: the corpus is empty") from None
    stage("tokenization")
    stats = SourceStats()
    eos = tokenizer.eos_id
    # The writer's `with` removes its temporaries (the trained tokenizer's among them) on any exception;
    # `closing` stops the worker pool at once rather than whenever the generator is collected.
    with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size, overwrite=overwrite) as writer:
        if trained:
            tokenizer.save(writer.tmp["tokenizer"])
        with tqdm(desc=f"tokenize {Path(output_prefix).name}", unit=" docs", disable=not progress,
                  dynamic_ncols=True) as bar, \
                closing(_encoded(iter_documents(inputs, policy, stats), tokenizer, workers)) as batches:
            for encoded in batches:
                for ids in encoded:
                    writer.add_document([*ids, eos])
                bar.update(len(encoded))
                bar.set_postfix(tokens=f"{writer.tokens:,}", refresh=False)
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
        # A signal during the commit takes effect after it, once the caller has heard the prefix is complete.
        with signals_deferred():
            writer.commit(meta, tokenizer_file=writer.tmp["tokenizer"] if trained else None)
            stage("written")
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
                        help=".txt / .jsonl / .json / .parquet file; a directory (every such file under it, "
                             "recursively, in sorted path order); builtin:pydoc_topics; synthetic:chains[:hops=1-4,"
                             "chains=2,examples=20000,seed=0,queries=1] (a depth probe); or a Hugging Face "
                             "dataset name[:config][@split]; repeat for several")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json (a file-name prefix, not a directory)")
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="a sentencepiece .model, or a Hugging Face tokenizer folder or name")
    tok.add_argument("--train-tokenizer", action="store_true",
                     help="train a sentencepiece tokenizer on the inputs (saved as PREFIX.tokenizer.model)")
    parser.add_argument("--vocab-size", type=int, default=None, help="with --train-tokenizer (default 8192)")
    parser.add_argument("--tokenizer-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--json-key", default="text", help="text field of .jsonl/.parquet/datasets rows")
    parser.add_argument("--on-bad-record", choices=("fail", "skip"), default="fail",
                        help="a jsonl line that is not JSON or lacks the key; a text value that is not a string")
    parser.add_argument("--on-decode-error", choices=("fail", "replace"), default="fail",
                        help="bytes that are not UTF-8")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _interrupted_line(signum: int, stage: str, prefix: str) -> str:
    name = signal.Signals(signum).name
    if stage == "written":
        return f"interrupted ({name}) after {prefix} was written; it is complete"
    return f"interrupted ({name}) during {stage}; nothing written under {prefix}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    previous_sigterm = signal.signal(signal.SIGTERM, raise_interrupted)
    stage = "start-up"

    def on_stage(name: str) -> None:
        nonlocal stage
        stage = name
        if name == "tokenizer training":
            print(f"training a {args.tokenizer_type} tokenizer ({args.vocab_size} pieces) on the inputs", flush=True)
        elif name == "tokenization":
            print(f"tokenizing into {args.output_prefix}", flush=True)

    try:
        from grt_megatron.console import import_frozen, quiet_known_warnings

        quiet_known_warnings()
        if args.workers < 1:
            raise DataError(f"--workers must be >= 1, got {args.workers}")
        if args.vocab_size is not None and not args.train_tokenizer:  # it would be ignored in silence
            raise DataError(f"--vocab-size {args.vocab_size} applies to --train-tokenizer; --tokenizer's own "
                            "vocabulary is used as it is")
        if args.vocab_size is None:
            args.vocab_size = 8192
        # megatron-core's dataset writer (torch under it), which every preparation uses: imported with the
        # collector off, then frozen, as the other commands do (a small corpus on a 2-core CPU: 6.1 -> 4.4 s,
        # no collections walking torch's objects at import or at exit).
        import_frozen("megatron.core.datasets.indexed_dataset")
        policy = SourcePolicy(args.json_key, args.on_bad_record, args.on_decode_error)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        summary = prepare_dataset(
            args.input, args.output_prefix, tokenizer,
            train_vocab_size=args.vocab_size if args.train_tokenizer else None,
            tokenizer_type=args.tokenizer_type, policy=policy, workers=args.workers,
            overwrite=args.overwrite, progress=not args.no_progress, on_stage=on_stage,
        )
    except DataError as err:
        print(f"grt-prepare-data: error: {err}", file=sys.stderr)
        sys.exit(2)
    except TokenizerWorkerError as err:
        print(f"grt-prepare-data: error: {err}; nothing written under {args.output_prefix}", file=sys.stderr)
        sys.exit(1)
    except BaseException as err:
        # The signal's own exception, or one that C code it interrupted wrapped it in (an extension's import).
        stop = raised_from(err, (KeyboardInterrupt, Interrupted))
        if stop is None:
            raise
        signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
        print(f"grt-prepare-data: {_interrupted_line(signum, stage, args.output_prefix)}", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    print(summary.line())


if __name__ == "__main__":
    main()
