"""`train.precision=bf16-mixed` (fp32 weights and optimizer, the forward under autocast) against fp32 and
DeepSpeed's bf16; the device-side gradient clipping; and how often a step makes the host wait for the
device (counted on the CPU, parallel/mixed_precision.py and training/host_waits.py say why)."""

import json
import math
import threading

import pytest
import torch

from conftest import BF16_SHORT, json_from_fresh_process, tiny_config
from grt_megatron.model import DepthDraw

RECIPE = dict(hidden_size=64, num_attention_heads=4, max_sequence_length=32, prelude_layers=1, core_layers=1,
              coda_layers=1, recurrences=3, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
STEPS = 8


def _runner(info, precision, **train):
    """grt-train's model, engine, guard and step runner (trainer.py builds the same), one process."""
    from grt_megatron.parallel.parallelize import parallelize
    from grt_megatron.training.config import build_run_config
    from grt_megatron.training.step_guard import LossSpikeDetector, install_step_guard
    from grt_megatron.training.step_runner import build_step_runner

    run = build_run_config({"model": RECIPE, "data": {"source": "unused"}, "seed": 3,
                            "train": {"precision": precision, "micro_batch_size": 2, "global_batch_size": 4,
                                      "grad_clip": 1.0, "warmup_iters": 2, "lr": 3e-3, **train}}, world_size=1)
    parallel = parallelize(run.model_config(300), run)
    guard = install_step_guard(parallel.engine)
    runner = build_step_runner(parallel, run, info, LossSpikeDetector(None, 100), 0, step_guard=guard)
    return parallel.engine, runner


def _rows(step):
    return torch.randint(0, 300, (4, 33), generator=torch.Generator().manual_seed(100 + step))


def _train(info, precision, steps=STEPS, **train):
    engine, runner = _runner(info, precision, **train)
    draw = DepthDraw(3, 3)
    outs = [runner.train_step(_rows(step), [0, 1, 2, 3], draw, step) for step in range(steps)]
    return engine, outs


def test_bf16_mixed_trains_like_fp32_with_fp32_state_and_bf16_matmuls(world):
    fp32_engine, fp32 = _train(world, "fp32")
    engine, mixed = _train(world, "bf16-mixed")
    # fp32 weights and gradients in the model, the bare optimizer stepping them: no master copy.
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
    assert engine.optimizer is engine.basic_optimizer
    for a, b in zip(fp32, mixed):
        assert b.skip_reason is None and math.isfinite(b.grad_norm)
        assert b.loss == pytest.approx(a.loss, rel=1e-3) and b.grad_norm == pytest.approx(a.grad_norm, rel=2e-2)
    # The same 8 steps moved the loss, and bf16 matmuls ran: not fp32's bits.
    assert mixed[-1].loss < mixed[0].loss - 0.03
    assert any(a.loss != b.loss for a, b in zip(fp32, mixed))
    tokens = _rows(0)[:2, :-1]
    with torch.no_grad():
        logits = engine.module(tokens)
    assert logits.dtype == torch.bfloat16  # the head ran under autocast; the fp32 run's is fp32
    with torch.no_grad():
        assert fp32_engine.module(tokens).dtype == torch.float32


def test_bf16_mixed_rounds_the_layers_residual_stream_and_keeps_the_recurrence_state_fp32(world):
    """What bf16-mixed keeps in fp32, as the docs say: megatron-core's bias-dropout-add casts the residual to
    the sublayer output's dtype, so without linear biases (every recipe) each layer hands on bf16, as in
    bf16; the recurrence's state is carried in fp32 from step to step (model/recurrent_block.py)."""
    from grt_megatron.model import GRTLanguageModel
    from grt_megatron.parallel.mixed_precision import apply_mixed_precision

    model = GRTLanguageModel(tiny_config())
    apply_mixed_precision(model, "bf16-mixed", torch.device("cpu"))
    layer_outputs, states = [], []
    for layer in model.block.layers:
        layer.register_forward_hook(lambda module, args, out: layer_outputs.append(out[0].dtype))
    model.block.register_step_hook(lambda h, h_new, g, **extra: states.append((h.dtype, h_new.dtype)))
    with torch.no_grad():
        model(_rows(0)[:2, :-1])
    assert layer_outputs and set(layer_outputs) == {torch.bfloat16}
    assert len(states) == model.config.recurrences and set(states) == {(torch.float32, torch.float32)}


def test_fp32_residual_connection_keeps_the_stream_fp32_and_nearer_fp32(world):
    """`model.fp32_residual_connection=true` under bf16-mixed: every layer, the core's included, hands on an
    fp32 stream while the matmuls stay bf16, as in a plain PyTorch model under autocast. Against the fp32
    model, a 12-layer stack's gradients are nearer (measured: 7.4e-3 against 1.9e-2 relative, the worst
    tensor). In fp32 the flag changes no bit; under bf16 it is refused (the norms' weights are bf16)."""
    from grt_megatron.model import GRTConfig, GRTLanguageModel
    from grt_megatron.model.config import ConfigError
    from grt_megatron.parallel.mixed_precision import apply_mixed_precision

    tokens = _rows(0)
    deep = dict(prelude_layers=4, core_layers=4, coda_layers=4, recurrences=1, injection="none", gate="none",
                noise_sigma=0.0, depth_sampler="fixed", hidden_size=128)

    def run(precision, fp32_residual, **shape):
        model = GRTLanguageModel(tiny_config(fp32_residual_connection=fp32_residual, **shape), init_seed=3)
        apply_mixed_precision(model, precision, torch.device("cpu"))
        dtypes = set()
        for layer in model.block.layers:
            layer.register_forward_hook(lambda module, args, out: dtypes.add(out[0].dtype))
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}, dtypes

    assert run("bf16-mixed", True)[2] == {torch.float32}  # the tiny GRT: prelude, core (after the injection), coda
    assert run("bf16-mixed", False)[2] == {torch.bfloat16}
    fp32 = run("fp32", False, **deep)
    same = run("fp32", True, **deep)
    assert same[0] == fp32[0] and all(torch.equal(same[1][n], g) for n, g in fp32[1].items())

    def grad_error(result):
        return max(float((result[1][n] - g).norm() / g.norm()) for n, g in fp32[1].items())

    plain, kept = grad_error(run("bf16-mixed", False, **deep)), grad_error(run("bf16-mixed", True, **deep))
    assert 1e-3 < kept < 0.6 * plain, (kept, plain)  # bf16 matmuls still ran; the stream's rounding is gone
    with pytest.raises(ConfigError, match="model.fp32_residual_connection=true needs train.precision=bf16-mixed"):
        GRTConfig.from_recipe({**RECIPE, "fp32_residual_connection": True}, precision="bf16")
    # A precision setting: a resume may turn it on or off (listed), and checkpoints from before it resume as is.
    from grt_megatron.checkpoint.compat import compare_models

    saved = tiny_config().to_dict()
    assert compare_models({k: v for k, v in saved.items() if k != "fp32_residual_connection"}, saved) == ([], [])
    assert compare_models(saved, tiny_config(fp32_residual_connection=True).to_dict()) == (
        [], ["model.fp32_residual_connection: False -> True"])


@pytest.mark.parametrize("max_norm", [math.inf, 1.0, 0.01])
def test_clip_grad_norm_matches_deepspeeds_bit_for_bit(world, max_norm):
    """The device-side clipping (one `_foreach_norm`, the scale applied without a host comparison) gives
    DeepSpeed's `clip_grad_norm_` norm and clipped gradients to the bit (fp32)."""
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    from grt_megatron.model import GRTConfig, GRTLanguageModel
    from grt_megatron.parallel.deepspeed_engine import MegatronMPU
    from grt_megatron.training.step_guard import clip_grad_norm

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    config = GRTConfig.from_recipe({**RECIPE, "vocab_size": 300})
    ours, theirs = GRTLanguageModel(config, init_seed=1), GRTLanguageModel(config, init_seed=1)
    tokens = _rows(0)
    ours(tokens[:, :-1], tokens[:, 1:]).mean().mul(50).backward()  # a norm well above 1
    for p, q in zip(ours.parameters(), theirs.parameters()):
        q.grad = p.grad.clone()
    norm = clip_grad_norm(ours.parameters(), max_norm)
    want = clip_grad_norm_(list(theirs.parameters()), max_norm, mpu=MegatronMPU())
    assert norm.item() > 1.0 and torch.equal(norm.reshape(1), want.reshape(1))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))


@pytest.mark.parametrize("precision,waits", [("fp32", 1), ("bf16-mixed", 1), ("bf16", 3)])
def test_host_waits_for_the_device_per_step(world, precision, waits):
    """A step of the trainer's runner reads device values where it must, and before the optimizer step is
    queued. With fp32 weights: once, the gradient norm (the skip decision; the loss, read right after,
    waits for nothing). DeepSpeed's BF16 optimizer compares its own norm on the host twice more."""
    from grt_megatron.training.host_waits import HostWaitCounter, host_resident_tensors

    engine, runner = _runner(world, precision)
    draw = DepthDraw(3, 3)
    runner.train_step(_rows(0), [0, 1, 2, 3], draw, 0)  # Adam's state exists from here
    with HostWaitCounter(host_resident_tensors(engine.basic_optimizer)) as counter:
        out = runner.train_step(_rows(1), [0, 1, 2, 3], draw, 1)
    assert out.skip_reason is None
    assert counter.waits == waits, (counter.waits, counter.reads)
    assert counter.reads >= waits


def test_host_wait_counter_counts_reads_after_work():
    from grt_megatron.training.host_waits import HostWaitCounter

    x = torch.ones(4)
    with HostWaitCounter() as counter:
        y = x * 2
        float(y.sum())  # work, then a read: a wait
        float(y[0])     # a view, then a read: no new work
        float(y.sum())  # work again: a wait
        (y + 1).tolist()  # tolist reads without the dispatcher's _local_scalar_dense: counted all the same
        other = threading.Thread(target=lambda: (x + 1).tolist())  # another thread's reads are not the step's
        other.start()
        other.join()
    assert (counter.reads, counter.waits) == (4, 3)
    assert "tolist" not in torch.Tensor.__dict__  # put back on the way out


_COUNT_TRAINER_WAITS = """
import json, sys
from grt_megatron.training import cli, trainer
from grt_megatron.training.host_waits import HostWaitCounter, host_resident_tensors

waits, step = [], trainer.Trainer._train_step

def counted(self, *args, **kwargs):
    with HostWaitCounter(host_resident_tensors(self.engine.basic_optimizer)) as counter:
        out = step(self, *args, **kwargs)
    waits.append(counter.waits)
    return out

trainer.Trainer._train_step = counted
sys.argv = ["grt-train", *sys.argv[1:]]
cli.main()
print("WAITS " + json.dumps(waits))
"""


@pytest.mark.parametrize("precision,waits", [("bf16-mixed", [1, 1, 1, 1, 1]), ("bf16", [3, 4, 3, 3, 4])])
def test_grt_train_step_waits_as_its_runner(pydoc_prefix, tmp_path, precision, waits):
    """A whole grt-train step (batch, depth draw, runner, metrics, progress) adds no read of its own to the
    runner's: bf16-mixed waits once a step; bf16 three times, and once more at a logged step (log
    interval 3), where DeepSpeed's norm is read for the record. (The first step also creates Adam's state.)"""
    args = ["model=tiny", "data=indexed", f"data.prefixes=[{pydoc_prefix[0]}]", "train.iters=6",
            "train.eval_interval=6", "train.eval_iters=1", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.log_interval=3", f"train.precision={precision}", *BF16_SHORT, "logging.wandb=disabled",
            "logging.progress=false", f"run.dir={tmp_path}"]
    counted = json_from_fresh_process(_COUNT_TRAINER_WAITS, args, "WAITS ", timeout=600)
    assert counted[1:] == waits, counted


_COUNT_WEIGHT_CASTS = """
import json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from grt_megatron.distributed import init_distributed
from grt_megatron.model import GRTConfig, GRTLanguageModel

class CastCounter(TorchDispatchMode):
    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.casts = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and tuple(out.shape) in self.shapes:
            self.casts += 1
        return out

init_distributed(seed=0)
recipe, counts = json.loads(sys.argv[1]), {}
for r in (2, 5):
    model = GRTLanguageModel(GRTConfig.from_recipe({**recipe, "recurrences": r}), init_seed=1)
    # 3 x 32 = 96 tokens: no activation ([96, ...]) has a weight's shape (dims 64, 128, 256, 300).
    tokens = torch.randint(0, 300, (3, 33), generator=torch.Generator().manual_seed(0))
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    weights |= {shape[::-1] for shape in weights}  # a cast of a transposed view counts too
    counter = CastCounter(weights)
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:], r, r).mean()
        loss.backward()
    linears = sum(1 for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n)
    counts[r] = [counter.casts, linears]
print("CASTS " + json.dumps(counts))
"""


@pytest.mark.parametrize("gate", ["mlp", "fixed"])
def test_autocast_casts_each_weight_once_per_forward_whatever_r(gate):
    """Under bf16-mixed the shared core's weights are cast to bf16 once per forward, and their gradients
    back to fp32 once per backward, at any R: autocast caches its cast of a leaf weight, so the local
    linears hand it the weight itself (F.linear), not a transposed view that would be cast at every use.
    Counted in a fresh process: the count is of this one forward and backward, whatever ran before."""
    recipe = json.dumps({**RECIPE, "gate": gate, "vocab_size": 300})
    counts = json_from_fresh_process(_COUNT_WEIGHT_CASTS, [recipe], "CASTS ", timeout=300)
    for r, (casts, linears) in counts.items():
        # Each linear's weight (and the tied head's, which is the embedding's) once each way; the
        # embedding's lookup is not autocast (fp32).
        assert casts == 2 * (linears + 1), (r, casts, linears)
    assert counts["2"][0] == counts["5"][0]


def test_shared_core_gradients_summed_in_bf16_over_r_stay_within_bf16s_own_error(world):
    """Autocast's cached cast of a shared weight is one bf16 tensor used R times, so its R gradients are
    summed in bf16 before the one cast back (as DeepSpeed's bf16 weights sum them). At R = 16 that adds
    little to the error bf16 matmuls make anyway: measured against float64, the core's gradients are within
    1.5x of the error with a cast per use (summed in fp32) and of the unshared prelude's and coda's."""
    from grt_megatron.model import GRTLanguageModel

    config = tiny_config(hidden_size=128, recurrences=16, max_sequence_length=64, gate_bias_init=2.0,
                         noise_sigma=0.0, depth_sampler="fixed")
    model = GRTLanguageModel(config, init_seed=0).train()
    tokens = torch.randint(0, 300, (4, 65), generator=torch.Generator().manual_seed(1))

    def grads(dtype, cache=None):
        model.zero_grad(set_to_none=True)
        model.to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cache is not None, cache_enabled=bool(cache)):
            model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        out = {n: p.grad.double() for n, p in model.named_parameters() if p.ndim == 2 and "embedding" not in n}
        model.float()
        return out

    exact, cached, per_use = grads(torch.float64), grads(torch.float32, cache=True), grads(torch.float32, cache=False)
    shared = [n for n in exact if ".layers.1." in n or "injection" in n or "gate_fc" in n]
    unshared = [n for n in exact if ".layers.0." in n or ".layers.2." in n]
    assert len(shared) == 7 and len(unshared) == 8, (shared, unshared)

    def error(got, names):
        return max(float((got[n] - exact[n]).norm() / exact[n].norm()) for n in names)

    assert 1e-3 < error(cached, shared) < 2e-2  # bf16 ran, and it summed R gradients without losing them
    assert error(cached, shared) < 1.5 * min(error(per_use, shared), error(cached, unshared))
