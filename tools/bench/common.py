"""What the benchmarks in tools/bench share: the repository's paths, quiet imports, their command line's
`--output`, a recipe's run config and DeepSpeed engine in this one process, and the result file.

A benchmark run as a script puts the repository on sys.path itself, then imports this module before torch.
megatron-core, DeepSpeed and hydra are imported inside the functions that use them, so that the benchmarks
that use none of them (decoding, data preparation, scaling) do not load them before they measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from grt_megatron.console import quiet_known_warnings
from grt_megatron.files import write_atomic

REPO = Path(__file__).resolve().parents[2]

# The import-time warnings of megatron-core and DeepSpeed; the benchmarks import them after this module.
quiet_known_warnings()

# The vocabulary of the CPU training-step benchmarks; their tokens are random.
CPU_VOCAB = 2048
# Their shapes: the recipe, and the hidden size it is scaled down to (None: the recipe's own).
CPU_SHAPES = {"tiny": ("tiny", None), "small": ("small_grt_isoflops", 256)}


def argument_parser(doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The CPU training-step benchmarks' flags: which shapes, how many timed and warm-up steps, the batch."""
    parser.add_argument("--shapes", default=",".join(CPU_SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)


def parse_args(parser: argparse.ArgumentParser, benchmark: str) -> argparse.Namespace:
    """The benchmark's own flags plus `--output`, added last so that `--help` lists it last."""
    parser.add_argument("--output", default=str(REPO / "tools" / "bench" / "results" / f"{benchmark}.json"))
    return parser.parse_args()


def run_config(model: str, batch: int, precision: str, *overrides: str, accumulation: int = 1):
    """The `train` config of recipe `model` at its full R (fixed depth sampler), `accumulation` micro-batches
    of `batch` sequences a step, plus `overrides`."""
    from hydra import compose, initialize_config_dir

    from grt_megatron.training.config import build_run_config

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", "model.depth_sampler=fixed", *overrides,
                                          f"train.micro_batch_size={batch}",
                                          f"train.global_batch_size={batch * accumulation}",
                                          f"train.precision={precision}", "run.dir=unused"])
    return build_run_config(cfg)


def deepspeed_engine(model, run):
    """`model` in the framework's DeepSpeed engine, this process alone (no data parallelism)."""
    from grt_megatron.parallel.deepspeed_engine import build_engine

    return build_engine(model, run, dp_size=1)


def cpu_run_config(recipe: str, batch: int, width: int | None = None, seq: int = 128, precision: str = "fp32",
                   overrides: tuple[str, ...] = ()):
    """(run config, model config) of recipe `recipe` in `precision` (plus grt-train `overrides`) at the CPU
    benchmarks' vocabulary; `width` scales the hidden size down (4 heads, `seq` tokens) so that the larger
    shapes run on a CPU in minutes."""
    scaled = [] if width is None else [f"model.hidden_size={width}", "model.num_attention_heads=4",
                                       f"model.max_sequence_length={seq}"]
    run = run_config(recipe, batch, precision, *scaled, *overrides)
    return run, run.model_config(CPU_VOCAB)


def cpu_step_engine(recipe: str, batch: int, seed: int, width: int | None = None, seq: int = 128,
                    precision: str = "fp32"):
    """(run config, model config, engine) of `cpu_run_config(recipe, batch, width, seq, precision)`, weights
    from `seed`; under `bf16-mixed` the model's forward runs under autocast, as `parallelize` applies it."""
    import torch

    from grt_megatron.model import GRTLanguageModel
    from grt_megatron.parallel.mixed_precision import apply_mixed_precision

    run, model_cfg = cpu_run_config(recipe, batch, width, seq, precision)
    torch.manual_seed(seed)
    model = GRTLanguageModel(model_cfg, init_seed=seed)
    apply_mixed_precision(model, precision, torch.device("cpu"))
    return run, model_cfg, deepspeed_engine(model, run)


def random_batch(batch: int, seq: int):
    """(inputs, next-token targets) of `batch` random sequences of `seq` tokens, the same every run."""
    import torch

    tokens = torch.randint(0, CPU_VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def interleaved_steps(engines: dict, recurrences: int, x, y, steps: int) -> tuple[dict, dict]:
    """`steps` training steps of every engine in `engines` ({name: engine}), one engine after another at
    each step so that the machine's noise hits them all, at R = `recurrences` with each step's noise keyed
    by its samples: ({name: each step's seconds}, {name: each step's loss})."""
    times = {name: [] for name in engines}
    losses = {name: [] for name in engines}
    for step in range(steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            loss = engine(x, y, recurrences, recurrences, list(range(step, step + x.shape[0]))).mean()
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())
            times[name].append(time.perf_counter() - start)
    return times, losses


@dataclass
class EngineRuns:
    """What `compare_step_engines` measured: the model config, and per mode each step's seconds and loss,
    the median step time after warm-up and the bytes one forward saves for backward."""
    cfg: object
    times: dict
    losses: dict
    medians: dict
    saved: dict


def compare_step_engines(recipe: str, batch: int, width: int | None, precision: str, modes, prepare,
                         warmup: int, steps: int) -> EngineRuns:
    """One engine per mode of `modes` (`cpu_step_engine`, the same weights; `prepare(mode, engine)` makes it
    that mode: compiled, another code path), their steps interleaved on the same batch (`interleaved_steps`,
    `warmup` + `steps` of them)."""
    import statistics

    engines = {}
    for mode in modes:
        _, cfg, engine = cpu_step_engine(recipe, batch, seed=0, width=width, precision=precision)
        prepare(mode, engine)
        engines[mode] = engine
    x, y = random_batch(batch, cfg.max_sequence_length)
    times, losses = interleaved_steps(engines, cfg.recurrences, x, y, warmup + steps)
    return EngineRuns(cfg, times, losses, {mode: statistics.median(t[warmup:]) for mode, t in times.items()},
                      {mode: saved_for_backward_bytes(engine, x, y, cfg.recurrences)
                       for mode, engine in engines.items()})


def saved_for_backward_bytes(engine, x, y, recurrences: int) -> int:
    """Bytes of the tensors one training forward of `engine` saves for its backward (each storage once, the
    parameters not counted): the activations, and under bf16-mixed the weights' bf16 casts the matmuls
    keep. Read through saved-tensor hooks, which compiled graphs' saves pass through too; no backward runs."""
    import torch

    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = engine(x, y, recurrences, recurrences, list(range(x.shape[0]))).mean()
    del loss
    parameters = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in parameters)


def stamp(benchmark: str, with_torch: bool = False) -> dict:
    """The head of a result file: which benchmark, when, by which command; with torch's version and threads
    for the ones that time torch on the CPU."""
    head = {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"), "command": "python " + " ".join(sys.argv)}
    if with_torch:
        import torch

        # The CPU's vector extensions decide bf16's speed there (grt_megatron.device.cpu_has_fast_bf16_matmuls).
        head.update(torch=torch.__version__, threads=torch.get_num_threads(), cpu=cpu_model(),
                    cpu_capability=torch.backends.cpu.get_cpu_capability())
    return head


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else the platform's processor string."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_result(path: str, payload: dict) -> Path:
    """`payload` as indented JSON at `path`, whole or not at all (an interrupted run leaves the old file)."""
    out = Path(path)
    write_atomic(out, json.dumps(payload, indent=2) + "\n")
    return out


def launch_grt_train(procs: int, overrides: list[str], port: int, timeout: int = 900) -> subprocess.CompletedProcess:
    """`grt-train OVERRIDES` under torchrun on `procs` processes, as a user would launch it (no launcher
    variables inherited); a failed run raises with its error lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}",
           "-m", "grt_megatron.training.cli", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() and "Warn" not in line]
        raise RuntimeError(f"{cmd}: " + "\n".join(errors[-8:]))
    return proc


def prepared_prefix(data: str, tmp: str) -> str:
    """`data` if it is a prepared prefix, else the corpus prepared once into `tmp` (a 2048-piece tokenizer
    trained on it), for every launch of a benchmark to reuse."""
    if Path(data + ".idx").is_file():
        return data
    subprocess.run([sys.executable, "-m", "grt_megatron.data.prepare", "--input", data, "--output-prefix",
                    f"{tmp}/data", "--train-tokenizer", "--vocab-size", "2048"], cwd=REPO, check=True,
                   capture_output=True)
    return f"{tmp}/data"
