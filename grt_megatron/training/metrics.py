"""Run logging: `metrics.jsonl` (one JSON object per optimizer step and per eval) and wandb."""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, Optional

# Dense peaks (TFLOP/s, no sparsity) by device-name substring (SXM parts): bf16 and TF32 tensor cores, and
# plain fp32 (CUDA cores) for fp32 runs with `train.tf32=false`.
PEAK_TFLOPS = {"bf16": {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0},
               "tf32": {"H200": 494.0, "H100": 494.0, "A100": 156.0, "L40S": 181.0, "A10G": 35.0},
               "fp32": {"H200": 67.0, "H100": 67.0, "A100": 19.5, "L40S": 91.6, "A10G": 31.2}}


def peak_flops_per_device(precision: str, configured_tflops: Optional[float], tf32: bool = True) -> Optional[float]:
    """Peak FLOP/s of this process's device, for MFU: the configured value, else a known GPU's, else None.
    An fp32 run is measured against the TF32 peak when TF32 is on, else against plain fp32's."""
    if configured_tflops:
        return configured_tflops * 1e12
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    if precision == "bf16-mixed":
        precision = "bf16"  # its matmuls run in bf16
    table = PEAK_TFLOPS["tf32" if precision == "fp32" and tf32 else precision]
    for key, tflops in table.items():
        if key in name:
            return tflops * 1e12
    return None


def strict_json_record(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and ±inf are not JSON: they become null, and `nonfinite` lists those fields with their value
    as text ("nan", "inf", "-inf"), so that every line of metrics.jsonl parses with any JSON reader."""
    out, nonfinite = {}, {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key], nonfinite[key] = None, str(value)
        else:
            out[key] = value
    if nonfinite:
        out["nonfinite"] = nonfinite
    return out


def wandb_mode(requested: str) -> str:
    if requested == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return requested


class MetricsLogger:
    """Writes on the main rank only; every line is flushed so a killed run keeps what it logged."""

    def __init__(self, run_dir: Path, enabled: bool, wandb: str, project: str, name: Optional[str],
                 config: dict[str, Any]):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8") if enabled else None
        self._wandb = None
        mode = wandb_mode(wandb)
        if enabled and mode != "disabled":
            import wandb as wandb_lib

            # One wandb run for the whole run directory, across resumes and requeues: its id is kept in
            # the run directory and the run is resumed by that id.
            id_file = Path(run_dir) / "wandb_run_id"
            if not id_file.exists():
                id_file.write_text(secrets.token_hex(4))
            self._wandb = wandb_lib.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config,
                                         id=id_file.read_text().strip(), resume="allow", reinit="finish_previous")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(strict_json_record(record), allow_nan=False) + "\n")
        self._file.flush()
        if self._wandb is not None:
            prefix = record.get("split", "train")
            self._wandb_call(self._wandb.log, {f"{prefix}/{k}": v for k, v in record.items()
                                               if k not in ("step", "split")}, step=record["step"])

    def _wandb_call(self, fn, *args, **kwargs) -> None:
        """wandb never stops training: its service process can die before the trainer (a scheduler's
        SIGTERM reaches every process of a job step); the run then goes on with metrics.jsonl only."""
        try:
            fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any wandb failure
            print(f"wandb failed ({type(err).__name__}: {err}); logging to metrics.jsonl only", flush=True)
            self._wandb = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb_call(self._wandb.finish)
            self._wandb = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
