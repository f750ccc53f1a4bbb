"""The run's data: a tokenizer, prepared prefixes (preparing a raw `data.source` first) and the
train/valid GPT datasets, set up identically on every rank."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from grt_megatron.data import DataError, SourcePolicy, Tokenizer, load_tokenizer
from grt_megatron.data.gpt_datasets import GPTDatasets, build_gpt_datasets
from grt_megatron.data.indexed import verify_prefix
from grt_megatron.data.prepare import prepare_dataset, tokenizer_of_prefix
from grt_megatron.data.synthetic import answer_token_mask, parse_synthetic, synthetic_spec_of_prefix
from grt_megatron.distributed import DistributedInfo
from grt_megatron.model import ConfigError
from grt_megatron.training.config import RunConfig

_NOISE_STREAM = 0x6e6f


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    prefixes: list[str]
    datasets: GPTDatasets
    valid_rows: np.ndarray
    """The fixed evaluation set: eval_iters × global batch validation samples, [n, seq_length + 1]."""
    loss_mask: Optional[Callable[[np.ndarray], np.ndarray]] = None
    """rows -> [n, seq_length] weights of the label positions the loss counts (`data.loss_on=answers`);
    None: every position."""

    def train_rows(self, iteration: int, global_batch: int, first: int, count: int) -> np.ndarray:
        """Rows [first, first + count) of iteration's global batch: samples i·G + first ... of the stream."""
        return GPTDatasets.rows(self.datasets.train, iteration * global_batch + first, count)


def sample_noise_seeds(seed: int, iteration: int, rows: range) -> list[int]:
    """One seed per global batch row: the model's training noise for a sample depends on
    (seed, iteration, row) only, not on the data-parallel rank or micro-batch that runs it."""
    return [int(np.random.SeedSequence([seed, iteration, row, _NOISE_STREAM]).generate_state(1)[0])
            for row in rows]


class BatchPrefetcher:
    """This rank's share of each iteration's global batch (its rows and their noise seeds), read in a
    background thread while the step before runs, so the device never waits for the host to index the
    dataset. On a GPU the rows are pinned, so that the copy to the device can be non-blocking.

    `for iteration, (rows, seeds, weights) in prefetcher:` runs over iterations [start, stop); `weights` are
    the loss mask's (`data.loss_on=answers`, computed here off the step's path too), else None."""

    def __init__(self, data: TrainingData, seed: int, global_batch: int, first_row: int, per_rank: int,
                 start: int, stop: int, pin: bool):
        self.data, self.seed, self.global_batch = data, seed, global_batch
        self.first_row, self.per_rank, self.pin = first_row, per_rank, pin
        self.start, self.stop = start, stop
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")

    def _load(self, iteration: int) -> tuple[torch.Tensor, list[int], Optional[torch.Tensor]]:
        rows = self.data.train_rows(iteration, self.global_batch, self.first_row, self.per_rank)
        weights = None if self.data.loss_mask is None else torch.from_numpy(self.data.loss_mask(rows))
        rows = torch.from_numpy(rows)
        seeds = sample_noise_seeds(self.seed, iteration, range(self.first_row, self.first_row + self.per_rank))
        if self.pin:
            rows, weights = rows.pin_memory(), None if weights is None else weights.pin_memory()
        return rows, seeds, weights

    def __iter__(self):
        coming = self.pool.submit(self._load, self.start) if self.start < self.stop else None
        for iteration in range(self.start, self.stop):
            batch = coming.result()
            coming = self.pool.submit(self._load, iteration + 1) if iteration + 1 < self.stop else None
            yield iteration, batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def on_main_rank(info: DistributedInfo, work):
    """Run `work()` on rank 0 only, with its outcome shared: if rank 0 fails with a DataError/ConfigError,
    every rank raises it, instead of the others waiting forever at the next collective."""
    result, failure = None, None
    if info.is_main:
        try:
            result = work()
        except (DataError, ConfigError) as err:
            failure = (isinstance(err, ConfigError), str(err))
    box = [failure]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        is_config, message = box[0]
        raise (ConfigError if is_config else DataError)(message)
    return result


def _resolve_tokenizer_and_prefixes(cfg: RunConfig, run_dir: Path, info: DistributedInfo, resuming: bool):
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer) if d.tokenizer else None
    if d.source and resuming and Path(f"{run_dir / 'data' / 'corpus'}.idx").is_file():
        # A resumed run reads the corpus it prepared at its start (re-preparing could train another
        # tokenizer); it is verified like any prefix.
        prefixes = [str(run_dir / "data" / "corpus")]
        verify_prefix(prefixes[0])
    elif d.source:
        prefix = run_dir / "data" / "corpus"

        def announce(stage: str) -> None:
            # Tokenizer training has no progress bar and can take minutes on a large corpus: say what
            # the run is doing before it goes quiet.
            if stage != "written":
                print(f"preparing {prefix}: {stage} on {d.source}", flush=True)

        def prepare():
            summary = prepare_dataset(
                [d.source], prefix, tokenizer, train_vocab_size=None if tokenizer else d.vocab_size,
                policy=SourcePolicy(d.text_key, d.on_bad_record, d.on_decode_error), overwrite=True,
                progress=cfg.logging.progress, on_stage=announce,
            )
            print(f"prepared {summary.line()}", flush=True)

        on_main_rank(info, prepare)
        prefixes = [str(prefix)]
    else:
        prefixes = list(d.prefixes)
        for prefix in prefixes:  # a missing or broken prefix is the first thing to report
            verify_prefix(prefix)
    if tokenizer is None:
        tokenizer = tokenizer_of_prefix(prefixes[0])
        if tokenizer is None:
            raise ConfigError(f"data.tokenizer is not set and {prefixes[0]}.tokenizer.model does not exist: "
                              "name the tokenizer the prefixes were prepared with")
    return tokenizer, prefixes


def default_train_samples(cfg: RunConfig) -> int:
    return cfg.data.train_samples or cfg.train.iters * cfg.train.global_batch_size


def setup_training_data(cfg: RunConfig, run_dir: Path, info: DistributedInfo, seq_length: int,
                        train_samples: int, resuming: bool = False) -> TrainingData:
    """`train_samples`: length of the training sample stream (its order depends on it)."""
    tokenizer, prefixes = _resolve_tokenizer_and_prefixes(cfg, run_dir, info, resuming)
    g = cfg.train.global_batch_size
    valid_samples = cfg.train.eval_iters * g
    kwargs = dict(
        seq_length=seq_length, seed=cfg.seed, train_samples=train_samples,
        valid_samples=valid_samples, split=cfg.data.split,
        cache_dir=cfg.data.cache_dir or str(run_dir / "data" / "cache"), valid_seed=cfg.data.valid_seed,
    )
    # Called on every rank at once: megatron's builder itself builds the index caches on rank 0, waits at
    # a barrier, then lets the other ranks read them. Our checks before it are deterministic, so a bad
    # prefix fails on every rank alike.
    datasets = build_gpt_datasets(prefixes, cfg.data.weights, tokenizer, **kwargs)
    if len(datasets.train) < kwargs["train_samples"]:
        raise DataError(f"the training split holds {len(datasets.train)} samples, fewer than the "
                        f"{kwargs['train_samples']} asked for")
    valid_rows = GPTDatasets.rows(datasets.valid, 0, min(valid_samples, len(datasets.valid)))
    loss_mask = answers_loss_mask(prefixes, tokenizer, valid_rows) if cfg.data.loss_on == "answers" else None
    return TrainingData(tokenizer, prefixes, datasets, valid_rows, loss_mask)


def answers_loss_mask(prefixes: list[str], tokenizer: Tokenizer, valid_rows: np.ndarray):
    """`data.loss_on=answers`: the mask function of the synthetic task every prefix was prepared from."""
    patterns = set()
    for prefix in prefixes:
        spec = synthetic_spec_of_prefix(prefix)
        if spec is None:
            raise DataError(f"data.loss_on=answers: {prefix} was not prepared from a synthetic task alone (its "
                            f"meta.json names its inputs), so its answers are unknown; use data.loss_on=all")
        patterns.add(parse_synthetic(spec).answer_pattern)
    if len(patterns) != 1:
        raise DataError(f"data.loss_on=answers: data.prefixes {prefixes} mix synthetic tasks with different answers")
    mask = functools.partial(answer_token_mask, token_texts=tokenizer.token_texts(), eos_id=tokenizer.eos_id,
                             pattern=patterns.pop())
    if not mask(valid_rows).any():
        raise DataError(f"data.loss_on=answers: the validation windows hold no answer token of {prefixes} (is "
                        "train.seq_length shorter than one document?)")
    return mask
