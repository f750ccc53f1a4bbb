"""`grt-train`: train a GRT (or dense/baseline) model from hydra recipes.

    grt-train model=tiny data=pydoc train.iters=300 run.dir=runs/tiny seed=1 train.precision=fp32 \
              logging.wandb=disabled

`data=` takes a recipe from recipes/data/ or, for convenience, a prepared prefix (rewritten to
`data=indexed data.prefixes=[PREFIX]`) or a raw corpus: a file, a directory of text files or a Hugging
Face dataset name (rewritten to `data=corpus data.source=...`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

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


def compose_run_config(overrides: Sequence[str], world_size: Optional[int] = None):
    """The RunConfig grt-train builds from these command-line overrides (the `data=` shorthand included) at
    `world_size` processes (default: the launcher's), composed and checked without starting anything:
    what grt-submit and grt-grid refuse before a job starts. Overrides that do not compose raise hydra's or
    OmegaConf's error; settings grt-train refuses raise ConfigError (or DataError for a probe prefix)."""
    from hydra import compose, initialize_config_dir

    from grt_megatron.training.config import build_run_config

    with initialize_config_dir(config_dir=str(RECIPES.resolve()), version_base="1.3"):
        cfg = compose("train", overrides=rewrite_data_argument(list(overrides)))
    return build_run_config(cfg, world_size=world_size)


# Exit statuses (README "Exit codes"): 0 trained, or stopped on request with a checkpoint to resume from;
# 1 an unexpected error (a bug: traceback); 2 refused before training (bad setting or input, run.dir in
# use or not writable); 3 training diverged (non-finite steps beyond train.max_skipped_steps, or
# non-finite weights at a save); 4 a checkpoint could not be written (full disk, I/O error); 128 + N
# ended by signal N outside the training loop (130 SIGINT, 143 SIGTERM), or 130 after Ctrl-C in it.
EXIT_REFUSED, EXIT_DIVERGED, EXIT_CHECKPOINT_WRITE = 2, 3, 4


def _fail(message: str, status: int = EXIT_REFUSED) -> None:
    print(f"grt-train: error: {message}", file=sys.stderr)
    sys.exit(status)


def _record(cfg: DictConfig) -> dict:
    """What hydra would have written into `.hydra/` (its own writer is off: it wrote before any check)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    return {"config_yaml": OmegaConf.to_yaml(cfg), "overrides": list(HydraConfig.get().overrides.task)}


@hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    from grt_megatron.checkpoint import CheckpointError, CheckpointWriteError
    from grt_megatron.console import freeze_imported_objects
    from grt_megatron.data import DataError
    from grt_megatron.errors import raised_from
    from grt_megatron.model import ConfigError
    from grt_megatron.training.config import build_run_config
    from grt_megatron.training.signals import Interrupted, exit_code_after_stop
    from grt_megatron.training.step_guard import TrainingDiverged
    from grt_megatron.training.trainer import run_training

    freeze_imported_objects()
    try:
        run_cfg = build_run_config(cfg)
        result = run_training(run_cfg, _record(cfg))
    except CheckpointWriteError as err:
        _fail(str(err), EXIT_CHECKPOINT_WRITE)
        return
    except TrainingDiverged as err:
        _fail(str(err), EXIT_DIVERGED)
        return
    except (ConfigError, DataError, CheckpointError) as err:
        _fail(str(err))
        return
    except Exception as err:
        # A signal during set-up raises `Interrupted`; C code it interrupts may wrap it into another error
        # (hydra would then print a traceback and exit 1): unwrap it so the run ends as the signal says.
        stop = raised_from(err, Interrupted)
        if stop is None:
            raise
        raise stop from err
    if int(os.environ.get("RANK", "0")) == 0:  # set by the launcher, or by init_distributed
        _report(result, run_cfg)
    status = exit_code_after_stop(result.stopped_by)
    if status:
        sys.exit(status)


def _report(result, run_cfg) -> None:
    skipped = f"; {result.skipped_steps} optimizer steps skipped (see skip_reason in metrics.jsonl)" \
        if result.skipped_steps else ""
    if result.stopped_by:
        how = "exiting 130" if result.stopped_by == "SIGINT" else "exiting 0"
        print(f"stopped by {result.stopped_by} at step {result.steps}: checkpoint {result.checkpoint} saved; "
              f"{how} (resume=auto continues){skipped}")
    elif result.start_step >= run_cfg.train.iters:
        print(f"nothing to do: the run is already at step {result.start_step} of train.iters="
              f"{run_cfg.train.iters} (raise train.iters to train further)")
    else:
        print(f"done: {result.steps} steps in {result.seconds:.1f} s; final train loss "
              f"{result.final_train_loss:.4f}, valid loss {result.final_valid_loss:.4f}; "
              f"metrics in {Path(run_cfg.run.dir) / 'metrics.jsonl'}{skipped}")
        if result.sample is not None:
            print("sample:\n" + result.sample)


def main() -> None:
    from grt_megatron.console import collect_nothing_while_importing
    from grt_megatron.errors import raised_from
    from grt_megatron.training.signals import Interrupted, raise_on_signals

    raise_on_signals()  # first: a signal during imports, data preparation or resume ends with one line
    collect_nothing_while_importing()  # until _hydra_main's imports are done
    try:
        from grt_megatron.console import quiet_known_warnings

        if not RECIPES.is_dir():
            _fail(f"recipes folder {RECIPES} not found; set GRT_RECIPES to the repository's recipes/")
        quiet_known_warnings()
        sys.argv = [sys.argv[0], *rewrite_data_argument(sys.argv[1:])]
        _hydra_main()
    except BaseException as err:
        # The signal's own exception, or one that C code it interrupted wrapped it in (an import before hydra
        # starts; inside hydra, `_hydra_main` unwraps it, since hydra turns any Exception into exit 1).
        stop = None if isinstance(err, SystemExit) else raised_from(err, Interrupted)  # an exit keeps its status
        if stop is None:
            raise
        print(f"grt-train: stopped by {stop.name} during {stop.where}; checkpoints already written are "
              "complete (resume=auto continues from the newest)", file=sys.stderr)
        sys.exit(stop.exit_code)


if __name__ == "__main__":
    main()
