"""Every field of the run configuration can be set on the command line: hydra refuses to override a key the
composed config does not have ("Could not override 'train.X'"), so each dataclass field must appear in the
recipes, whichever train/data recipe is chosen."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grt_megatron.training import config as run_config
from grt_megatron.training.cli import RECIPES

SECTIONS = {"train": run_config.TrainConfig, "data": run_config.DataConfig, "parallel": run_config.ParallelConfig,
            "deepspeed": run_config.DeepSpeedConfig, "logging": run_config.LoggingConfig,
            "checkpoint": run_config.CheckpointConfig, "run": run_config.RunDirConfig}
CHOICES = [(group, f.stem) for group in ("train", "data") for f in sorted((RECIPES / group).glob("*.yaml"))]


@pytest.mark.parametrize("group,recipe", CHOICES, ids=[f"{g}={r}" for g, r in CHOICES])
def test_every_field_is_in_the_composed_config(group, recipe):
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = compose("train", overrides=[f"{group}={recipe}", "run.dir=unused"])
    absent = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
              if f.name not in cfg[section] and not OmegaConf.is_missing(cfg[section], f.name)]
    assert not absent, f"recipes lack these keys, so `key=value` on the command line is refused: {absent}"


def test_new_numerics_settings_override_from_the_command_line():
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = compose("train", overrides=["train.tf32=false", "train.deterministic=true", "train.depth_sweep=2",
                                          "parallel.timeout_minutes=90", "deepspeed.grad_accum_dtype=bf16",
                                          "deepspeed.communication_data_type=bf16", "run.dir=unused"])
    run = run_config.build_run_config(cfg, world_size=1)
    assert (run.train.tf32, run.train.deterministic, run.train.depth_sweep) == (False, True, 2)
    assert run.parallel.timeout_minutes == 90
    assert (run.deepspeed.grad_accum_dtype, run.deepspeed.communication_data_type) == ("bf16", "bf16")
