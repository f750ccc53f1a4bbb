"""Bytes a training step moves through memory outside its matmuls and attention, at the GPU check's medium
shape, for each precision and optimizer choice: which of them leaves the least memory-bound work to a GPU.
Counted on this machine's CPU; bytes do not depend on the device (times do).

    python tools/bench/memory_traffic.py [--model medium_grt_isoflops] [--seq 1024] [--batch 8]
                                         [--accumulation 8] [--configs bf16,bf16-mixed+fused,...] [--compile]

Configs: `bf16` (DeepSpeed's BF16 optimizer over fp32 master weights, the paper recipe's default),
`bf16-mixed` (fp32 weights, autocast, no master copy), each with `+fused` for `train.fused_adam=true`.

Every aten op of a training step is intercepted (a TorchDispatchMode, eager mode: no `train.compile`, which
fuses many of the elementwise passes counted here) and, unless it is a matmul, attention, a view, an
allocation or a collective, counted as the bytes it reads plus the bytes it writes: its tensor arguments,
those it writes in place once more (read and written), the outputs it makes; a gather (embedding, index)
reads its output's worth of the table, not the whole table, and a scatter writes its rows; a fill, a copy's
destination and an `out=` are written, not read. Each op is charged to the Python frame that asked for it,
or in the backward to its autograd node; `loss_share` is the loss's part (model/loss.py, megatron's
cross-entropy).

The steps are grt-train's own (`parallelize` and the step runner's `train_step`, with its loss, non-finite
guard and clipping). A step of two micro-batches and one of one are counted: a micro-batch after the first
(forward, backward, its gradients added to the step's) is their difference, and the rest of a step (the first
micro-batch's difference from the others, gradient norm, clipping, AdamW, DeepSpeed's master-weight copies)
what the step of one adds to it; both at two small batch sizes (`--count-batches`, 2 and 3). A step of
`--accumulation` micro-batches of `--batch` sequences then moves accumulation × (fixed + batch × per
sequence) + boundary bytes, where fixed (weight casts, the shared core's gradient sums, the gradients'
accumulation) and per sequence (activations, the loss) are solved from the two batch sizes. Both counted
batches must take the loss's path that `--batch` takes (one chunk of logits, or several: model/loss.py).
The times are that many bytes at the H200's 4.8 TB/s: a floor, not a prediction. Prints a table and writes
tools/bench/results/memory_traffic.json.

`--compile` counts the same steps with `train.compile=true` (writes memory_traffic_compiled.json). The ops
outside its graphs are counted as above. A compiled graph's fused kernels run no aten op, so each graph is
counted as inductor lowers it (`InductorBytes`: each kernel's loads and stores, each buffer once) and added
at every run; its extern kernels (matmuls, attention) run through the dispatcher as before. Inductor lowers
for this CPU: its fusion choices for a GPU (Triton) may differ in places.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import inspect
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a script

from tools.bench import common  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from grt_megatron.distributed import init_distributed  # noqa: E402

CONFIGS = {"bf16": ("bf16", False), "bf16+fused": ("bf16", True),
           "bf16-mixed": ("bf16-mixed", False), "bf16-mixed+fused": ("bf16-mixed", True)}
"""name: (train.precision, train.fused_adam)."""
H200_BYTES_PER_S = 4.8e12
"""The H200's HBM3e bandwidth (NVIDIA's figure); H100 SXM: 3.35e12."""
COMPUTE_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_forward",
               "_flash_attention_backward"}
"""Compute-bound: not counted (their operands are read once per tile, at the tensor cores' pace)."""
WRITE_ONLY = {"zero_", "fill_", "normal_", "uniform_", "bernoulli_", "random_", "copy_", "index_fill_",
              "masked_fill_", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "arange",
              "scalar_tensor", "set_"}
"""Ops whose written arguments are written, not read first (copy_ reads its source, counted as an argument).
An `out=` argument is written only, whatever the op."""
READ_ONLY_ARGUMENTS = {"_fused_adamw_": ("grads",), "_fused_adam_": ("grads",)}
"""Arguments a schema marks written that the kernel only reads (fused AdamW writes its gradients back only
with a gradient scale, which bf16 never has)."""
NO_DATA_OPS = {"_unsafe_view", "_reshape_alias", "alias", "detach", "lift_fresh", "_local_scalar_dense"}
"""Ops that move no data though their schemas do not say they alias (matmul's `_unsafe_view` of its product)."""
GATHERS = {"embedding": "weight", "index": "self", "index_select": "self", "gather": "self"}
"""op: the argument it gathers from; it reads as many bytes of it as it writes, not the whole tensor."""
SCATTERS = {"index_put_": "values", "_index_put_impl_": "values", "index_put": "values"}
"""op: the argument whose bytes it writes into its `self` (`x[rows, columns] -= y`), not the whole `self`."""
VOCAB = 50257
"""The GPU check's vocabulary (GPT-2's)."""


def _nbytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def op_bytes(func, args, kwargs, out) -> int | None:
    """Bytes op `func` read and wrote; None where it is not counted (compute, view, allocation, collective)."""
    name = func.overloadpacket.__name__
    schema = func._schema
    if (name in COMPUTE_OPS or name in NO_DATA_OPS or name.startswith("empty")
            or func.namespace not in ("aten", "prims")
            or any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)):
        return None
    values = {a.name: args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)}
    write_only = name.removeprefix("_foreach_") in WRITE_ONLY
    out_bytes = sum(_nbytes(t) for t in tree_leaves(out))
    total, written = 0, set()
    for argument in schema.arguments:
        is_write = (argument.alias_info is not None and argument.alias_info.is_write
                    and argument.name not in READ_ONLY_ARGUMENTS.get(name, ()))
        for tensor in tree_leaves(values[argument.name]):
            if not isinstance(tensor, torch.Tensor):
                continue
            n = _nbytes(tensor)
            if GATHERS.get(name) == argument.name:
                n = out_bytes
            scattered = name in SCATTERS and argument.name == "self"
            if scattered:  # its rows written, read first only to accumulate
                n = _nbytes(values[SCATTERS[name]])
            if is_write:
                written.add(tensor.untyped_storage().data_ptr())
                read_too = not (write_only or argument.kwarg_only or (scattered and not values.get("accumulate")))
                total += 2 * n if read_too else n  # kwarg-only: `out=`
            else:
                total += n
    for tensor in tree_leaves(out):
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in written:
            total += _nbytes(tensor)
    return total


def _caller() -> str:
    """The autograd node running (in a backward), else the nearest frame outside torch."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward: {node.name()}"
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path or "/torch/optim/" in path:
            short = path.split("site-packages/")[-1].replace(str(common.REPO) + "/", "")
            return f"{short}: {frame.name}"
    return "?"


_COUNTING: list["CountBytes"] = []
"""The `CountBytes` modes entered, innermost last: where `InductorBytes` adds a compiled graph's run."""


class CountBytes(TorchDispatchMode):
    """Counts `op_bytes` of every op run inside it, by caller: `bytes`, `ops`, `by_caller`; and, under
    `InductorBytes`, the fused kernels of every compiled graph run inside it."""

    def __init__(self):
        super().__init__()
        self.bytes, self.ops = 0, 0
        self.by_caller: collections.Counter = collections.Counter()
        self.graph_runs: collections.Counter = collections.Counter()  # compiled graphs' runs, by caller

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this dynamo runs every compiled region eagerly while a dispatch mode is active, and the count
        # would be eager's; with it the graphs run compiled, and the mode sees only their extern kernels.
        return True

    def __enter__(self):
        _COUNTING.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _COUNTING.remove(self)
        return super().__exit__(*exc)

    def add(self, n: int, caller: str, ops: int = 1) -> None:
        self.bytes += n
        self.ops += ops
        self.by_caller[caller] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        n = op_bytes(func, args, kwargs, out)
        if n:
            self.add(n, _caller())
        return out


def kernel_bytes(graph) -> dict[str, int]:
    """Inductor's count of what each fused kernel of lowered `graph` (a GraphLowering) reads and writes: each
    buffer it loads from or stores to once, at most its size (the scheduler's own estimate,
    `get_read_write_buffer_accesses`), its ordering-only dependencies left out: a kernel that stores into a
    graph input (the loss's gradient chunk) has a dependency on the input but never loads it, and inductor's
    estimate would count its bytes as read. Extern kernels (matmuls, attention, fallbacks to aten) are left
    out: they run through the dispatcher, where `CountBytes` counts what is not compute."""
    from torch._inductor.dependencies import MemoryDep
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    counts = {}
    with V.set_graph_handler(graph):
        for node in graph.scheduler.nodes:
            if isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)):
                continue
            read_writes = node.read_writes  # the graph is built: its scheduler's state is ours to borrow
            node.read_writes = dataclasses.replace(
                read_writes, reads=type(read_writes.reads)(d for d in read_writes.reads if isinstance(d, MemoryDep)))
            try:
                counts[node.get_name()] = sum(node.get_read_write_buffer_accesses(include_reads=True,
                                                                                  include_writes=True).values())
            finally:
                node.read_writes = read_writes
    return counts


class InductorBytes:
    """While active, each graph torch.compile lowers records `kernel_bytes` (inductor's graph and AOT autograd
    caches off: a graph loaded from them is not lowered, and its bytes would be unknown), and each run of a
    compiled graph inside a `CountBytes` adds them there, charged to the frame that ran the forward graph (a
    backward graph to its forward's frame). `lowered` counts the graphs lowered so far."""

    def __init__(self):
        self.lowered = 0
        self.forward_callers: dict = {}

    def __enter__(self):
        from torch._inductor.output_code import CompiledFxGraph

        self._configs = [torch._inductor.config.patch(fx_graph_cache=False),
                         torch._functorch.config.patch(enable_autograd_cache=False)]
        for config in self._configs:
            config.__enter__()
        init, call = CompiledFxGraph.__init__, CompiledFxGraph.__call__
        self._originals = (CompiledFxGraph, init, call)
        counter = self

        def counted_init(compiled, *args, **kwargs):
            init(compiled, *args, **kwargs)
            compiled.grt_kernel_bytes = kernel_bytes(inspect.signature(init).bind(compiled, *args, **kwargs)
                                                     .arguments["graph"])
            counter.lowered += 1

        def counted_call(compiled, inputs):
            if _COUNTING:
                kernels = getattr(compiled, "grt_kernel_bytes", None)
                if kernels is None:
                    raise RuntimeError("a compiled graph that was not lowered under InductorBytes ran: its bytes "
                                       "are unknown (enter InductorBytes before the first compiled step)")
                graph_id = compiled.fx_kwargs.get("graph_id")
                if compiled.fx_kwargs["is_backward"]:
                    caller = f"compiled backward: {counter.forward_callers.get(graph_id, '?')}"
                else:
                    counter.forward_callers[graph_id] = _caller()
                    caller = f"compiled: {counter.forward_callers[graph_id]}"
                _COUNTING[-1].add(sum(kernels.values()), caller, ops=len(kernels))
                _COUNTING[-1].graph_runs[caller] += 1
            return call(compiled, inputs)

        CompiledFxGraph.__init__, CompiledFxGraph.__call__ = counted_init, counted_call
        return self

    def __exit__(self, *exc):
        compiled_fx_graph, init, call = self._originals
        compiled_fx_graph.__init__, compiled_fx_graph.__call__ = init, call
        for config in reversed(self._configs):
            config.__exit__(*exc)


def _minus(a: CountBytes, b: CountBytes) -> SimpleNamespace:
    """What `a` counted beyond `b`: bytes, ops and bytes by caller."""
    by_caller, graph_runs = collections.Counter(a.by_caller), collections.Counter(a.graph_runs)
    by_caller.subtract(b.by_caller)
    graph_runs.subtract(b.graph_runs)
    return SimpleNamespace(bytes=a.bytes - b.bytes, ops=a.ops - b.ops, by_caller=by_caller, graph_runs=graph_runs)


def count_step(model: str, config: str, batch: int, seq: int, info, compile: bool = False) -> dict:
    """The bytes of a micro-batch of `batch` sequences after a step's first (`micro_batch`) and of a whole
    step of one micro-batch (`step_of_one`: with the optimizer step), through grt-train's own step
    (`parallelize` and the step runner's `train_step`, as tools/bench/overhead.py runs it) at the GPU
    check's vocabulary. A step of 2 micro-batches and one of 1 are counted, each after an uncounted step
    (DeepSpeed and AdamW make their state in the first): a later micro-batch is their difference.
    `compile`: with `train.compile=true`, its graphs lowered and counted by `InductorBytes` (each engine's
    graphs its own: dynamo is reset after each)."""
    from grt_megatron.model import DepthDraw
    from tools.bench.overhead import framework_runner

    precision, fused = CONFIGS[config]
    rows = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    counts = {}
    for accumulation in (1, 2):
        run = common.run_config(model, batch, precision, f"model.max_sequence_length={seq}",
                                f"train.fused_adam={str(fused).lower()}", f"train.compile={str(compile).lower()}",
                                accumulation=accumulation)
        model_cfg = run.model_config(VOCAB)
        with InductorBytes() as inductor:
            _, runner = framework_runner(run, model_cfg, info)
            step_rows, seeds = rows.repeat(accumulation, 1), list(range(accumulation * batch))
            draw = DepthDraw(model_cfg.recurrences, model_cfg.recurrences)
            runner.train_step(step_rows, seeds, draw, 0)  # compiles, under train.compile
            lowered = inductor.lowered
            with CountBytes() as counts[accumulation]:
                runner.train_step(step_rows, seeds, draw, 1)
            if inductor.lowered != lowered:
                raise SystemExit(f"{model}, {config}: the counted step compiled {inductor.lowered - lowered} more "
                                 "graphs; a step's count would include what the first step had not built")
        del runner
        torch._dynamo.reset()
        gc.collect()  # the engine sits in reference cycles; left to the collector, 24 GiB ran out
    return {"micro_batch": _minus(counts[2], counts[1]), "step_of_one": counts[1]}


def is_loss(caller: str) -> bool:
    """Whether `caller` is the language-model loss: model/loss.py, or megatron's cross-entropy (one chunk)."""
    return "model/loss.py" in caller or "CrossEntropy" in caller or "cross_entropy.py" in caller


def check_loss_path(model: str, seq: int, batches: tuple[int, ...], compile: bool = False) -> None:
    """Refuse batch sizes whose logits take different paths through the loss (one chunk, or several), between
    which the bytes are not linear in the batch. Compiled, the loss always takes its chunks."""
    from grt_megatron.model.loss import CHUNK_BYTES

    if compile:
        return

    model_cfg = common.run_config(model, 1, "bf16").model_config(VOCAB)
    one_chunk = {b: b * seq * model_cfg.padded_vocab_size * 4 <= CHUNK_BYTES for b in batches}
    if len(set(one_chunk.values())) > 1:
        raise SystemExit(f"--count-batches and --batch: at sequence {seq} the logits of batches "
                         f"{[b for b, one in one_chunk.items() if one]} fit the loss's one chunk and those of "
                         f"{[b for b, one in one_chunk.items() if not one]} do not; count batches on the same side")


def graph_bytes_per_run(counted: dict, weights: tuple) -> dict:
    """Each compiled graph's runs a micro-batch (after the first) at the counted batches and its bytes a run:
    a layer's or the recurrence step's at --batch, extrapolated with `weights` as the totals are; the loss's
    at each counted batch (its chunks are more in a larger batch, and a chunk's bytes do not grow with it)."""
    graphs = {}
    for caller in {c for b, _ in weights for c, runs in counted[b]["micro_batch"].graph_runs.items() if runs > 0}:
        runs = {b: counted[b]["micro_batch"].graph_runs[caller] for b, _ in weights}
        bytes_at = {b: counted[b]["micro_batch"].by_caller[caller] for b, _ in weights}
        graph = {"runs_per_micro_batch": {str(b): r for b, r in runs.items()}}
        if len(set(runs.values())) == 1 and not is_loss(caller):
            graph["bytes_per_run"] = sum(weight * bytes_at[b] for b, weight in weights) / next(iter(runs.values()))
        else:
            graph["bytes_per_run_at_counted_batches"] = {str(b): bytes_at[b] / runs[b] for b in runs if runs[b]}
        graphs[caller] = graph
    return graphs


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--model", default="medium_grt_isoflops")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size the step is projected to")
    parser.add_argument("--accumulation", type=int, default=8, help="micro-batches an optimizer step")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--count-batches", default="2,3", help="the two micro-batch sizes counted")
    parser.add_argument("--rows", type=int, default=10, help="callers listed per config")
    parser.add_argument("--compile", action="store_true",
                        help="train.compile=true: its graphs' fused kernels counted by inductor "
                             "(default output memory_traffic_compiled.json)")
    args = common.parse_args(parser, "memory_traffic")
    if args.compile and args.output == parser.get_default("output"):
        args.output = args.output.replace("memory_traffic.json", "memory_traffic_compiled.json")
    low, high = (int(b) for b in args.count_batches.split(","))
    check_loss_path(args.model, args.seq, (low, high, args.batch), args.compile)
    torch.manual_seed(0)
    info = init_distributed(seed=0)
    results = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            raise SystemExit(f"--configs: {config!r} is not one of {', '.join(CONFIGS)}")
        start = time.perf_counter()
        counted = {b: count_step(args.model, config, b, args.seq, info, args.compile) for b in (low, high)}
        small, large = counted[low]["micro_batch"], counted[high]["micro_batch"]
        per_sequence = (large.bytes - small.bytes) / (high - low)
        fixed = small.bytes - low * per_sequence
        # The rest of a step (the optimizer step, the first micro-batch's extra): the same at any batch.
        boundary = counted[low]["step_of_one"].bytes - small.bytes
        boundary_check = counted[high]["step_of_one"].bytes - large.bytes
        micro = fixed + args.batch * per_sequence
        step = args.accumulation * micro + boundary
        callers = collections.Counter()
        # Each caller's bytes at --batch, extrapolated linearly from the two counts as the totals are.
        weights = ((low, (high - args.batch) / (high - low)), (high, (args.batch - low) / (high - low)))
        for b, weight in weights:
            for caller, n in counted[b]["micro_batch"].by_caller.items():
                callers[caller] += weight * n * args.accumulation
            for caller, n in counted[b]["step_of_one"].by_caller.items():
                callers[caller] += weight * (n - counted[b]["micro_batch"].by_caller.get(caller, 0))
        row = {"config": config, "precision": CONFIGS[config][0], "fused_adam": CONFIGS[config][1],
               "micro_batch_fixed_bytes": fixed, "per_sequence_bytes": per_sequence,
               "boundary_bytes": boundary, "boundary_bytes_at_the_larger_count": boundary_check,
               "micro_batch_bytes": micro, "step_bytes": step,
               "step_ms_at_h200_bandwidth": 1e3 * step / H200_BYTES_PER_S,
               "ops_per_micro_batch": {str(low): small.ops, str(high): large.ops},
               "loss_share": sum(n for caller, n in callers.items() if is_loss(caller)) / step,
               "top_callers": [[caller, n] for caller, n in callers.most_common(args.rows)],
               "compiled_graphs": graph_bytes_per_run(counted, weights),
               "seconds_to_count": time.perf_counter() - start}
        results.append(row)
        mode = "compiled" if args.compile else "eager"
        print(f"\n{config}, {mode}: {args.model}, seq {args.seq}; a step of {args.accumulation} × {args.batch} "
              f"sequences moves {step / 1e9:.1f} GB ({row['step_ms_at_h200_bandwidth']:.1f} ms at 4.8 TB/s)")
        print(f"  a micro-batch: {fixed / 1e9:.2f} GB fixed + {per_sequence / 1e9:.3f} GB a sequence; "
              f"the rest of a step: {boundary / 1e9:.2f} GB (at batch {high}: {boundary_check / 1e9:.2f})")
        print(f"  the loss (model/loss.py, megatron's cross-entropy): {100 * row['loss_share']:.0f}% of the bytes")
        for caller, n in row["top_callers"]:
            print(f"  {n / 1e9:9.2f} GB  {caller}")
        for caller, graph in sorted(row["compiled_graphs"].items(), key=lambda item: -item[1].get("bytes_per_run", 0)):
            if "bytes_per_run" in graph:
                print(f"  {graph['bytes_per_run'] / 1e9:9.3f} GB a run, {max(graph['runs_per_micro_batch'].values())}"
                      f" runs a micro-batch: {caller}")
    by_name = {row["config"]: row for row in results}
    ratios = {f"{name.replace('-', '_').replace('+', '_')}_over_bf16_step_bytes":
              row["step_bytes"] / by_name["bf16"]["step_bytes"]
              for name, row in by_name.items() if name != "bf16" and "bf16" in by_name}
    for name, value in ratios.items():
        print(f"  {name}: {value:.3f}")
    out = common.write_result(args.output, {**common.stamp("memory_traffic", with_torch=True), "model": args.model,
                                            "seq_length": args.seq, "batch": args.batch,
                                            "accumulation": args.accumulation, "vocab": VOCAB,
                                            "compile": args.compile,
                                            "bandwidth_bytes_per_s": H200_BYTES_PER_S, **ratios,
                                            "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
