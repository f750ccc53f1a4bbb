"""Training data: megatron-core's GPTDataset over prepared prefixes, blended by weight, split
train/valid/test, shuffled by seed, index caches in a cache dir.

Sample k of the training stream is `train[k]`; the global batch of iteration i is samples
[i·G, (i+1)·G). The order is a function of (seed, consumed samples, the dataset sizes), so a resumed run
that keeps `data.train_samples` continues exactly. megatron-core's C++ index helpers come prebuilt in
its wheel (`megatron.core.datasets.helpers_cpp`); nothing is compiled here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from grt_megatron.data.indexed import verify_prefix
from grt_megatron.data.sources import DataError
from grt_megatron.data.tokenizer import MegatronTokenizerView, Tokenizer


@dataclass
class GPTDatasets:
    train: object
    valid: object

    @staticmethod
    def rows(dataset, start: int, count: int) -> np.ndarray:
        """Samples [start, start + count) as [count, seq_length + 1] token rows (inputs + next token)."""
        out = []
        for k in range(start, start + count):
            sample = dataset[k]
            out.append(np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]]))
        return np.stack(out).astype(np.int64)


def parse_split(split: str) -> list[float]:
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or min(parts) < 0 or parts[0] <= 0 or parts[1] <= 0:
        raise DataError(f"data.split={split!r}: expected train,valid,test weights such as 969,30,1 "
                        "(train and valid > 0)")
    return parts


def _documents(prefix: str) -> int:
    from megatron.core.datasets.indexed_dataset import _IndexReader

    return len(_IndexReader(prefix + ".idx", multimodal=False).sequence_lengths)


def effective_split(prefixes: Sequence[str], split: str) -> str:
    """The split megatron is given. Each prefix must keep training and validation documents (megatron
    loops forever on an empty part it is asked samples from). The test part is never read by training;
    where it would hold no document of some prefix, it is dropped (weight 0) instead."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    weights = parse_split(split)
    total = sum(weights)
    matrix = convert_split_vector_to_split_matrix([w / total for w in weights])
    drop_test = False
    for prefix in prefixes:
        n = _documents(prefix)
        counts = [0 if b is None else int(round(b[1] * n)) - int(round(b[0] * n)) for b in matrix]
        for part, name in ((0, "training"), (1, "validation")):
            if counts[part] == 0:
                raise DataError(f"data prefix {prefix!r} has {n} documents: data.split={split!r} leaves it no "
                                f"{name} document (use a larger corpus or give that part more weight)")
        drop_test |= weights[2] > 0 and counts[2] == 0
    return f"{weights[0]:g},{weights[1]:g},0" if drop_test else split


def build_gpt_datasets(
    prefixes: Sequence[str],
    weights: Optional[Sequence[float]],
    tokenizer: Tokenizer,
    *,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    split: str = "969,30,1",
    cache_dir: Optional[str] = None,
    valid_seed: Optional[int] = None,
) -> GPTDatasets:
    """`seed` orders the training samples; `valid_seed` (default `seed`) cuts and orders the validation
    windows, so runs of different seeds can be evaluated on the same windows."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if not prefixes:
        raise DataError("data.prefixes is empty")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise DataError(f"data.weights has {len(weights)} entries for {len(prefixes)} data.prefixes")
        if min(weights) <= 0:
            raise DataError(f"data.weights must be > 0, got {list(weights)}")
    for prefix in prefixes:
        verify_prefix(prefix, tokenizer.identity)
    split = effective_split(prefixes, split)

    def build(random_seed: int):
        config = _dataset_config(random_seed, seq_length, prefixes, weights, split, cache_dir, tokenizer)
        # megatron logs every index it builds at INFO; keep that out of the run's output.
        logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
        return BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, valid_samples, 0], lambda: True,
                                             config).build()

    train, valid, _ = build(seed)
    if valid_seed is not None and valid_seed != seed:
        _, valid, _ = build(valid_seed)
    if train is None or valid is None:
        raise DataError(f"data.split={split!r} leaves no documents for training or validation")
    return GPTDatasets(train=train, valid=valid)


def _dataset_config(seed, seq_length, prefixes, weights, split, cache_dir, tokenizer):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        # One prefix: no blend weights (megatron would wrap it in a blend of one, and say so).
        blend=(list(prefixes), list(weights) if weights is not None and len(prefixes) > 1 else None),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=MegatronTokenizerView(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
