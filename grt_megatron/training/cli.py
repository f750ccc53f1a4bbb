"""`grt-train`: train a GRT (or dense/baseline) model from hydra recipes.

    grt-train model=tiny data=pydoc train.iters=300 run.dir=runs/tiny seed=1 train.precision=fp32 \
              logging.wandb=disabled

`data=` takes a recipe from recipes/data/ or, for convenience, a prepared prefix (rewritten to
`data=indexed data.prefixes=[PREFIX]`) or a raw corpus: a file or a Hugging Face dataset name
(rewritten to `data=corpus data.source=...`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

RECIPES = Path(os.environ.get("GRT_RECIPES", Path(__file__).resolve().parents[2] / "recipes"))


def rewrite_data_argument(args: list[str], recipes: Path = RECIPES) -> list[str]:
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key == "data" and value and not (recipes / "data" / f"{value}.yaml").is_file():
            if Path(value + ".idx").is_file():
                out += ["data=indexed", f"data.prefixes=[{value}]"]
            else:
                out += ["data=corpus", f"data.source={value}"]
        else:
            out.append(arg)
    return out


def _fail(message: str) -> None:
    print(f"grt-train: error: {message}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from grt_megatron.checkpoint import CheckpointError
    from grt_megatron.data import DataError
    from grt_megatron.model import ConfigError
    from grt_megatron.training.config import build_run_config
    from grt_megatron.training.trainer import run_training

    try:
        run_cfg = build_run_config(cfg)
        result = run_training(run_cfg)
    except (ConfigError, DataError, CheckpointError) as err:
        _fail(str(err))
        return
    if int(os.environ.get("RANK", "0")) != 0:  # set by the launcher, or by init_distributed
        return
    if result.stopped_by:
        print(f"stopped by {result.stopped_by} at step {result.steps}: checkpoint {result.checkpoint} saved; "
              "exiting 0 (resume=auto continues)")
    else:
        print(f"done: {result.steps} steps in {result.seconds:.1f} s; final train loss "
              f"{result.final_train_loss:.4f}, valid loss {result.final_valid_loss:.4f}; "
              f"metrics in {Path(run_cfg.run.dir) / 'metrics.jsonl'}")
        if result.sample is not None:
            print("sample:\n" + result.sample)


def main() -> None:
    from grt_megatron.console import quiet_known_warnings

    if not RECIPES.is_dir():
        _fail(f"recipes folder {RECIPES} not found; set GRT_RECIPES to the repository's recipes/")
    quiet_known_warnings()
    sys.argv = [sys.argv[0], *rewrite_data_argument(sys.argv[1:])]
    _hydra_main()


if __name__ == "__main__":
    main()
