"""The run configuration: typed sections that hydra recipes fill in (`recipes/`).

The model section stays a plain mapping validated by `GRTConfig.from_recipe`; every other section is a
dataclass here, so a misspelt or mistyped key fails before anything is built, naming the key.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grt_megatron.distributed import world_size_from_env
from grt_megatron.model.config import ConfigError, GRTConfig
from grt_megatron.parallel import validate_layout


def budget_iters(base_iters: int, budget: float) -> int:
    """`${budget_iters:BASE,BUDGET}` in recipes: the steps of a token budget given as a multiple of 1×."""
    if base_iters is None:
        raise ConfigError("experiment.base_iters must be set to scale train.iters by experiment.budget")
    if budget <= 0:
        raise ConfigError(f"experiment.budget must be > 0, got {budget}")
    return max(1, round(int(base_iters) * float(budget)))


if not OmegaConf.has_resolver("budget_iters"):
    OmegaConf.register_new_resolver("budget_iters", budget_iters)


@dataclass
class TrainConfig:
    iters: int = 20_000
    micro_batch_size: Optional[int] = 8
    """Samples per forward on one data-parallel rank; gradient accumulation makes up the global batch.
    None: the rank's whole share of the global batch in one micro-batch (no accumulation), whatever the
    number of processes."""
    global_batch_size: int = 480
    seq_length: Optional[int] = None
    """Tokens per sample; defaults to model.max_sequence_length."""
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 2000
    decay_iters: Optional[int] = None
    """Cosine decay length; defaults to `iters`."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm to this; 0 or null: no clipping (the norm is still measured and
    logged). The same in every layout."""
    max_skipped_steps: int = 5
    """Optimizer steps with a non-finite loss or gradient norm are skipped (no update, logged with
    `skipped: true`); more than this many in a row stop the run with exit status 3."""
    loss_spike_factor: Optional[float] = None
    """A step whose loss is above this × the median of the last `loss_spike_window` losses is a spike:
    logged (`loss_spike: true`), and skipped with `skip_loss_spikes`. None: no spike detection."""
    loss_spike_window: int = 100
    skip_loss_spikes: bool = False
    inject_nan_at: list[int] = field(default_factory=list)
    """Testing the skip policy: these steps' losses are made NaN before their backward."""
    precision: str = "bf16"
    """fp32; bf16 (bf16 weights, fp32 master copies and gradient accumulation in DeepSpeed's BF16 optimizer);
    bf16-mixed (fp32 weights and optimizer, the forward under torch.autocast(bfloat16); no master copy, the
    weights cast to bf16 each forward and their gradients to fp32 each backward: parallel/mixed_precision.py)."""
    tf32: bool = True
    """On Ampere and later GPUs, fp32 matmuls use TF32 tensor cores (10-bit mantissa products, fp32
    accumulation; PyTorch's default is off). false: full fp32 (MFU is then against the fp32 peak)."""
    compile: bool = False
    """torch.compile the recurrence step (injection, core, gate) and every other transformer layer
    (parallel/compile.py). Any R runs one compiled step; the first steps of a run pay the compilation."""
    deterministic: bool = False
    """Deterministic kernels only (`torch.use_deterministic_algorithms`, cuBLAS's fixed workspace): on a
    GPU a resumed run then repeats the uninterrupted one bit for bit, at some cost in speed (atomics-based
    kernels such as the embedding's backward take slower deterministic paths). On CPU runs are already
    deterministic."""
    optimizer: str = "torch"
    """`torch`: torch.optim.AdamW built by us; `deepspeed`: the AdamW of DeepSpeed's config."""
    torch_adam: bool = False
    """With optimizer=deepspeed, required: DeepSpeed builds torch's AdamW instead of its FusedAdam (whose
    state checkpoints cannot hold, and which JIT-compiles for about a minute on first use)."""
    fused_adam: bool = False
    """With optimizer=torch: torch's fused AdamW, one kernel over the fp32 master weights and moments
    instead of the ~10 elementwise passes of its default (on an H200 the default took 7.8 ms of a 68 ms
    medium-dense step). Off until a GPU check has run it with a resume (tools/gpu_check.py)."""
    log_interval: int = 1
    eval_interval: int = 1000
    eval_iters: int = 10
    exit_interval: Optional[int] = None
    """Save and exit (status 0) after every step that is a multiple of this, before `iters`: one job of a
    chain of jobs (`grt-submit --chain`) trains this many steps."""
    depth_sweep: Optional[int] = None
    """At the end of training, validation loss at R = 1 … R + this (noise off), logged as
    `split: depth_sweep` records: under- and over-recurrence at inference. None: no sweep."""
    sample_tokens: int = 0
    """Print a sample of this many tokens at the end of training (0: none)."""
    sample_prompt: str = ""


@dataclass
class DataConfig:
    source: Optional[str] = None
    """A raw corpus — `builtin:pydoc_topics`, a .txt/.jsonl/.parquet file or a Hugging Face dataset
    `name[:config][@split]` — prepared into `{run.dir}/data/corpus` when the run starts."""
    prefixes: list[str] = field(default_factory=list)
    """Prepared Megatron indexed datasets (`grt-prepare-data`); set this or `source`."""
    weights: Optional[list[float]] = None
    """Blend weights, one per prefix (None: proportional to their sizes)."""
    split: str = "969,30,1"
    """train,valid,test weights over documents, as in Megatron-LM."""
    tokenizer: Optional[str] = None
    """A sentencepiece .model or HF tokenizer folder/name; None: the one prepared with the first prefix
    (`PREFIX.tokenizer.model`), or, with `source`, train one of `vocab_size`."""
    valid_seed: Optional[int] = 0
    """Seed that cuts and orders the validation windows: fixed (0) so that runs of different seeds are
    evaluated on the same windows; None: the run's seed (what runs before this field did)."""
    vocab_size: int = 8192
    text_key: str = "text"
    on_bad_record: str = "fail"
    on_decode_error: str = "fail"
    cache_dir: Optional[str] = None
    """Where megatron writes its dataset indices (default `{run.dir}/data/cache`)."""
    loss_on: str = "all"
    """`all`: the loss of every token (language modelling). `answers`: only the answer tokens of a synthetic
    task's documents (every prefix prepared from one, data/synthetic.py), as algorithmic tasks are trained:
    the prompts' random bindings are noise that would dominate the loss. Validation loss then means the
    answer tokens' too; a row's first document (cut by the window) is not scored."""
    reset_attention_mask: bool = False
    """Attention stays within each packed document: a token attends to no token up to the last EOS before
    it (Megatron-LM's `--reset-attention-mask`), in training, validation and the depth probe. Rows pack
    several documents; a synthetic task's earlier documents bind the same names, which a short model cannot
    tell apart from the current one's. Positions are not reset (rotary positions are relative anyway).
    Needs model.layer_spec local (`auto` resolves to it): TE's attention here is causal-only."""
    train_samples: Optional[int] = None
    """Size of the training sample stream (default train.iters × global batch). The data order depends
    on it: keep it when extending a run."""


@dataclass
class ProbeConfig:
    """The depth probe (training/probe.py): a synthetic task's held-out examples scored at every validation."""

    task: Optional[str] = None
    """A prefix prepared from a synthetic task (`data/chains_1k`: its meta.json names the task), or the task
    spec itself (`synthetic:chains:hops=1-4,examples=50000`, quoted on a hydra command line). The held-out
    examples avoid that training corpus's prompts. None: no probe."""
    hops: list[int] = field(default_factory=list)
    """The k values scored; empty: the task's training range and twice its top (length generalisation)."""
    examples: int = 128
    """Held-out examples per k."""


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    sp: bool = False
    pp_split_points: Optional[list[str]] = None
    """The pipeline units where stages 2..pp begin, e.g. [core, layer.3] (as torchtitan's
    `pipeline_parallel_split_points`); units: embedding, layer.<i>, core, final_norm, head. None: stages
    balanced by forward FLOPs (`parallel.pipeline_stages.balanced_stage_starts`). grt-train prints the stages."""
    timeout_minutes: int = 30
    """How long a collective may wait (NCCL's own default is 10 min): the other ranks wait in one while
    rank 0 alone prepares a corpus (`data.source`) or verifies a checkpoint's hashes on resume."""


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    grad_accum_dtype: str = "fp32"
    """With bf16: the dtype gradients are accumulated in over micro-batches (and, for ZeRO 1, reduced
    from). fp32, as Megatron-LM's `--accumulate-allreduce-grads-in-fp32`; bf16 rounds every addition."""
    communication_data_type: str = "fp32"
    """With bf16: the dtype of the data-parallel gradient reduction. bf16 halves its bytes at the cost of
    rounding the sum."""


@dataclass
class LoggingConfig:
    wandb: str = "auto"
    """auto (online with WANDB_API_KEY, else offline), online, offline, disabled."""
    wandb_project: str = "grt-megatron"
    progress: bool = True
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device at the run's precision, for MFU (model FLOPs utilisation); None:
    known for common GPUs (`grt_megatron.training.metrics.PEAK_TFLOPS`), not reported on CPU."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps (0: only at the end and when SIGUSR1/SIGTERM asks)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted unless permanent."""
    keep_every: Optional[int] = None
    """Checkpoints at multiples of this step are permanent (never pruned)."""
    save_at_end: bool = True
    async_save: bool = False
    """Write checkpoints from a background thread: the step only copies this rank's part to (pinned) host
    memory, then training goes on. One save at a time; the end of training and a signal wait for it.
    (`async` is a Python keyword, hence the name.)"""
    dir: Optional[str] = None
    """Default `{run.dir}/checkpoints`."""


@dataclass
class RunDirConfig:
    dir: str = "runs/default"
    name: Optional[str] = None


@dataclass
class ExperimentConfig:
    """Which cell of an experiment grid a run is (`recipes/experiment/`); `grt-report` groups runs by it."""

    name: Optional[str] = None
    """The cell's recipe, e.g. `cpu/grt_isoflops`; runs of one cell differ only in seed."""
    scale: Optional[str] = None
    comparison: Optional[str] = None
    """`isoflops` or `isoparams` (the dense reference belongs to both)."""
    variant: Optional[str] = None
    """What is compared: dense, grt, heavy_tail, mor, shared or an ablation."""
    budget: float = 1.0
    """Token budget as a multiple of the scale's 1× budget (`train.iters` scales with it)."""
    base_iters: Optional[int] = None
    """Steps at budget 1×."""
    root: str = "runs/experiments"
    """Run directories are `{root}/{name}/budget{budget}/seed{seed}`."""


@dataclass
class RunConfig:
    model: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunDirConfig = field(default_factory=RunDirConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    seed: int = 1234
    resume: Optional[str] = None
    """`auto` (the newest complete checkpoint of run.dir, if any) or a checkpoint / run directory."""

    @property
    def checkpoint_root(self) -> Path:
        """Where the run's checkpoints go: checkpoint.dir, else `{run.dir}/checkpoints`."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run.dir) / "checkpoints"

    def model_config(self, vocab_size: int) -> GRTConfig:
        recipe = dict(self.model)
        if self.data.reset_attention_mask:
            if recipe.get("layer_spec", "auto") not in (None, "auto", "local"):
                raise ConfigError(f"data.reset_attention_mask=true needs model.layer_spec=local (or auto), got "
                                  f"{recipe['layer_spec']!r}: Transformer Engine's attention is built causal-only")
            recipe["layer_spec"] = "local"
        if recipe.get("vocab_size") is None:
            recipe["vocab_size"] = vocab_size
        elif recipe["vocab_size"] < vocab_size:
            raise ConfigError(f"model.vocab_size={recipe['vocab_size']} is smaller than the tokenizer's "
                              f"vocabulary ({vocab_size})")
        return GRTConfig.from_recipe(
            recipe,
            precision=self.train.precision,
            tensor_model_parallel_size=self.parallel.tp,
            # Pipeline stages are DeepSpeed's (parallel/pipeline.py); megatron's own pipeline settings
            # stay at 1 so its layers keep their global layer numbers.
            sequence_parallel=self.parallel.sp,
        )

    @property
    def seq_length(self) -> int:
        return self.train.seq_length or int(self.model.get("max_sequence_length", 1024))

    def validate_layout(self, world_size: int) -> int:
        """`validate_layout` of this run at `world_size` processes; its data-parallel size."""
        return validate_layout(
            world_size=world_size, tp=self.parallel.tp, pp=self.parallel.pp, sp=self.parallel.sp,
            zero_stage=self.deepspeed.zero_stage, model=self.model, seq_length=self.seq_length,
            micro_batch=self.train.micro_batch_size, global_batch=self.train.global_batch_size,
            split_points=self.parallel.pp_split_points,
        )

    def to_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.structured(self), resolve=True)  # type: ignore[return-value]


_CHOICES = {
    "train.precision": ("fp32", "bf16", "bf16-mixed"),
    "train.optimizer": ("torch", "deepspeed"),
    "deepspeed.grad_accum_dtype": ("fp32", "bf16"),
    "deepspeed.communication_data_type": ("fp32", "bf16"),
    "logging.wandb": ("auto", "online", "offline", "disabled"),
    "data.on_bad_record": ("fail", "skip"),
    "data.on_decode_error": ("fail", "replace"),
    "data.loss_on": ("all", "answers"),
}


def _finite(value: float, low: float, high: float = math.inf, low_open: bool = False,
            high_open: bool = False) -> bool:
    if not math.isfinite(value):
        return False
    return (value > low if low_open else value >= low) and (value < high if high_open else value <= high)


def check_optimizer_settings(t: TrainConfig, pp: int) -> None:
    """Learning rate, Adam, clipping, skip policy: refused with one line before any data or model work
    (torch would refuse some with a traceback at the optimizer's construction, others never)."""
    checks = [
        ("lr", t.lr, _finite(t.lr, 0, low_open=True), "a finite number > 0"),
        ("min_lr", t.min_lr, _finite(t.min_lr, 0) and t.min_lr <= t.lr,
         f"a finite number >= 0 and <= train.lr={t.lr:g} (the schedule decays from lr to min_lr)"),
        ("beta1", t.beta1, _finite(t.beta1, 0, 1, high_open=True), "in [0, 1)"),
        ("beta2", t.beta2, _finite(t.beta2, 0, 1, high_open=True), "in [0, 1)"),
        ("adam_eps", t.adam_eps, _finite(t.adam_eps, 0, low_open=True), "a finite number > 0"),
        ("weight_decay", t.weight_decay, _finite(t.weight_decay, 0), "a finite number >= 0"),
        ("grad_clip", t.grad_clip, t.grad_clip is None or _finite(t.grad_clip, 0),
         "a finite number >= 0 (0 or null: no clipping)"),
        ("warmup_iters", t.warmup_iters, t.warmup_iters >= 0, ">= 0"),
        ("decay_iters", t.decay_iters, t.decay_iters is None or t.decay_iters >= 1, ">= 1 or null"),
        ("max_skipped_steps", t.max_skipped_steps, t.max_skipped_steps >= 0, ">= 0"),
        ("loss_spike_factor", t.loss_spike_factor, t.loss_spike_factor is None or _finite(t.loss_spike_factor, 1,
                                                                                        low_open=True),
         "a finite number > 1, or null"),
        ("loss_spike_window", t.loss_spike_window, t.loss_spike_window >= 10, ">= 10"),
        ("inject_nan_at", t.inject_nan_at, all(s >= 1 for s in t.inject_nan_at), "a list of steps >= 1"),
    ]
    for name, value, ok, wanted in checks:
        if not ok:
            raise ConfigError(f"train.{name}={value!r} is not valid: it must be {wanted}")
    if t.fused_adam and t.optimizer != "torch":
        raise ConfigError("train.fused_adam=true applies to train.optimizer=torch (train.optimizer=deepspeed "
                          "has its own optimizer settings)")
    if t.optimizer == "deepspeed" and not t.torch_adam:
        # Refused here, before any process group or engine: checkpointer.OptimizerState refused it only
        # after the engine was built, some 10 s into the run.
        raise ConfigError("train.optimizer=deepspeed needs train.torch_adam=true: checkpoints hold torch's "
                          "AdamW state, and DeepSpeed's default there is its own FusedAdam")
    if t.skip_loss_spikes and t.loss_spike_factor is None:
        raise ConfigError("train.skip_loss_spikes=true needs train.loss_spike_factor (e.g. 3.0)")
    if pp > 1 and (t.skip_loss_spikes or t.inject_nan_at):
        raise ConfigError("train.skip_loss_spikes and train.inject_nan_at are not supported with parallel.pp > 1: "
                          "a pipeline learns its loss only after the optimizer step (non-finite gradient norms "
                          "are still skipped)")
    if t.warmup_iters > t.iters and int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: train.warmup_iters={t.warmup_iters} > train.iters={t.iters}: the learning rate never "
              f"reaches train.lr={t.lr:g} (it ends at {t.lr * t.iters / t.warmup_iters:.3g})", file=sys.stderr)


def check_probe(run: RunConfig) -> None:
    """The probe's task spec, its k values and the layout it runs in, refused with one line."""
    probe = run.probe
    if probe.task is None:
        return
    from grt_megatron.data.synthetic import probe_hops, resolve_task

    try:
        probe_hops(resolve_task(probe.task), probe.hops)
    except ValueError as err:
        raise ConfigError(f"probe.task: {err}") from None
    if probe.examples < 1:
        raise ConfigError(f"probe.examples must be >= 1, got {probe.examples}")
    if run.parallel.pp > 1:
        raise ConfigError("probe.task is not supported with parallel.pp > 1: the probe reads the logits, which "
                          "only the last pipeline stage has")


def build_run_config(cfg: DictConfig | dict, world_size: Optional[int] = None) -> RunConfig:
    """Validate a composed hydra config against the schema and its layout at `world_size` processes (by
    default the launcher's); errors name the offending key. grt-submit calls this at a job's size."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
        run: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        first_line = str(err).splitlines()[0]
        raise ConfigError(f"config key {key}: {first_line}" if key else f"config: {first_line}") from None
    for key, allowed in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(run, section), name)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    t = run.train
    for key in ("iters", "micro_batch_size", "global_batch_size", "log_interval", "eval_interval", "eval_iters"):
        if getattr(t, key) is not None and getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    check_optimizer_settings(t, run.parallel.pp)
    if t.seq_length is not None and t.seq_length < 1:
        raise ConfigError(f"train.seq_length must be >= 1 (or null: model.max_sequence_length), got {t.seq_length}")
    if t.sample_tokens < 0:
        raise ConfigError(f"train.sample_tokens must be >= 0 (0: no sample), got {t.sample_tokens}")
    if run.data.train_samples is not None and run.data.train_samples < 1:
        raise ConfigError(f"data.train_samples must be >= 1 (or null: enough for train.iters), got "
                          f"{run.data.train_samples}")
    for key, value in (("seed", run.seed), ("data.valid_seed", run.data.valid_seed)):
        if value is not None and not 0 <= value < 2**32:  # numpy's seeds
            raise ConfigError(f"{key} must be in [0, 2**32), got {value}")
    peak = run.logging.peak_tflops
    if peak is not None and not _finite(peak, 0, low_open=True):
        raise ConfigError(f"logging.peak_tflops must be a finite number > 0 (or null: the device's), got {peak}")
    if t.depth_sweep is not None and t.depth_sweep < 0:
        raise ConfigError(f"train.depth_sweep must be >= 0, got {t.depth_sweep}")
    if t.exit_interval is not None and t.exit_interval < 1:
        raise ConfigError(f"train.exit_interval must be >= 1, got {t.exit_interval}")
    c = run.checkpoint
    if c.interval < 0 or c.keep_last < 1 or (c.keep_every is not None and c.keep_every < 1):
        raise ConfigError(f"checkpoint.interval must be >= 0 and checkpoint.keep_last / keep_every >= 1, got "
                          f"interval={c.interval}, keep_last={c.keep_last}, keep_every={c.keep_every}")
    if run.deepspeed.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.zero_stage={run.deepspeed.zero_stage} is not one of 0, 1, 2, 3")
    if run.parallel.timeout_minutes < 1:
        raise ConfigError(f"parallel.timeout_minutes must be >= 1, got {run.parallel.timeout_minutes}")
    # The layout and the model recipe are checked now: before any process group starts (a wrong layout
    # would hang it) and before any data is prepared (the vocabulary is known only later).
    run.validate_layout(world_size_from_env() if world_size is None else world_size)
    run.model_config(vocab_size=run.model.get("vocab_size") or 1)
    check_probe(run)
    if run.data.loss_on == "answers" and run.parallel.pp > 1:
        raise ConfigError("data.loss_on=answers is not supported with parallel.pp > 1: the pipeline's last stage "
                          "computes the mean loss of every token")
    if bool(run.data.source) == bool(run.data.prefixes):
        raise ConfigError("set exactly one of data.source (a raw corpus) and data.prefixes (prepared data)")
    return run
