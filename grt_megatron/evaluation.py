"""`grt-eval`: lm-evaluation-harness tasks on a checkpoint or an exported model, at one or more depths R.

    grt-eval --checkpoint runs/a --tasks hellaswag,lambada_openai --num-recurrences 1,2,4 --output evals/a
    grt-eval --model-dir hf/grt-tiny --tasks my_task --include-path my_tasks/ --limit 100 --output evals/b

A checkpoint (or a run directory: its newest complete checkpoint) is exported to a temporary Hugging Face
folder under `--output` first. The model runs through lm-eval's `HFLM` with its `config.num_recurrences`
set to each R in turn (the exported model's default depth). Writes `results_R{r}.json` (lm-eval's results),
`results.md` (value ± stderr of every metric at every R) and, for more than one R, `accuracy_vs_R.png`.
Needs the optional extra: `pip install grt-megatron[eval]`.
"""

from __future__ import annotations

import argparse
import difflib
import json
import signal
import sys
import tempfile
from pathlib import Path

PROG = "grt-eval"


class EvalError(Exception):
    """Bad input: one line, exit 2."""


def _recurrences(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas (1,2,4)")
    return values


def _batch_size(text: str):
    if text == "auto" or (text.isdigit() and int(text) > 0):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: a positive integer or auto")


def task_manager(names: list[str], include_path: str | None):
    """lm-eval's task index holding every task named. Indexing lm-eval's own ~15k task configs takes a
    while, so tasks that all come from `--include-path` are looked up there alone."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise EvalError(f"--include-path {include_path}: no such directory")
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=include_path)
    for name in names:
        if name not in manager.all_tasks:
            broken = unreadable_task_files(include_path) if include_path is not None else []
            if broken:  # lm-eval skips a YAML it cannot parse: the task it defines is then simply unknown
                raise EvalError(f"unknown task {name!r}; a task file in --include-path does not parse: {broken[0]}")
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            raise EvalError(f"unknown task {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else
                                                          "; see `lm-eval ls tasks`, or pass --include-path"))
    return manager


def unreadable_task_files(folder: str) -> list[str]:
    """The YAML files under `folder` that do not parse, as 'path (line N: problem)'. lm-eval's own tags
    (`!function ...`) are accepted without being run."""
    import yaml

    class TaskLoader(yaml.SafeLoader):
        pass

    TaskLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
    broken = []
    for path in sorted(Path(folder).rglob("*.yaml")):
        try:
            yaml.load(path.read_text(), Loader=TaskLoader)
        except (yaml.YAMLError, OSError, UnicodeDecodeError) as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            broken.append(f"{path} ({where}{getattr(err, 'problem', None) or type(err).__name__})")
    return broken


def load_model(model_dir: Path, device: str, dtype: str):
    """The exported model and tokenizer, for lm-eval (no K/V cache: scoring is one forward per window)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grt_megatron.device import WEIGHT_DTYPES

    if getattr(AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True), "model_type", None) != "grt":
        raise EvalError(f"--model-dir {model_dir}: not an exported GRT (model_type is not 'grt')")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=True,
                                                 dtype=WEIGHT_DTYPES[dtype])
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    return model.to(device).eval(), tokenizer


def metrics(results: dict) -> dict[str, dict[str, tuple[float, float | None]]]:
    """{task: {metric: (value, stderr)}} from lm-eval's results (filters other than `none` keep their name)."""
    out = {}
    for task, values in results["results"].items():
        row = {}
        for key, value in values.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filt}")
            row[metric if filt == "none" else key] = (float(value), stderr if isinstance(stderr, float) else None)
        out[task] = row
    return out


def main_metric(results: dict, task: str, available: dict) -> str:
    """The first metric of the task's config (acc, word_perplexity, ...), else the first one reported."""
    for entry in results.get("configs", {}).get(task, {}).get("metric_list", []) or []:
        if entry.get("metric") in available:
            return entry["metric"]
    return next(iter(available))


def write_table(by_r: dict[int, dict], path: Path) -> str:
    rs = sorted(by_r)
    first, grt = metrics(by_r[rs[0]]), by_r[rs[0]]["grt"]
    lines = [f"{grt['source']} (trained with R={grt['trained_recurrences']})", "",
             "| task | metric | " + " | ".join(f"R={r}" for r in rs) + " |", "|---|---|" + "---|" * len(rs)]
    for task, row in first.items():
        for metric in row:
            cells = []
            for r in rs:
                value, stderr = metrics(by_r[r])[task].get(metric, (float("nan"), None))
                cells.append(f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else ""))
            lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(by_r: dict[int, dict], path: Path, names: list[str]) -> None:
    """One panel per task named (a group's aggregate, not its subtasks), or per task reported."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = sorted(by_r)
    tasks = [t for t in names if t in metrics(by_r[rs[0]])] or list(metrics(by_r[rs[0]]))
    trained = by_r[rs[0]]["grt"]["trained_recurrences"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 3.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        metric = main_metric(by_r[rs[0]], task, metrics(by_r[rs[0]])[task])
        points = [metrics(by_r[r])[task][metric] for r in rs]
        ax.errorbar(rs, [v for v, _ in points], yerr=[s or 0.0 for _, s in points], marker="o", capsize=3)
        if trained:
            ax.axvline(trained, color="0.6", ls="--", lw=1, label=f"trained R={trained}")
            ax.legend(fontsize=8)
        ax.set(title=task, xlabel="recurrences R", ylabel=metric, xticks=rs)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(args, model_dir: Path, manager, output: Path, source: dict) -> dict[int, dict]:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import handle_non_serializable

    model, tokenizer = load_model(model_dir, args.device, args.dtype)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=args.batch_size,
              softmax_dtype="float32")  # bf16 logits, fp32 log-probabilities
    by_r = {}
    for r in args.num_recurrences or [model.config.num_recurrences]:
        print(f"R={r}: {', '.join(args.tasks)}", flush=True)
        model.config.num_recurrences = r  # the depth every forward of the exported model runs by default
        results = simple_evaluate(model=lm, tasks=args.tasks, task_manager=manager, limit=args.limit,
                                  num_fewshot=args.num_fewshot, log_samples=args.log_samples)
        results["grt"] = {"num_recurrences": r, **source}
        samples = results.pop("samples", {})
        (output / f"results_R{r}.json").write_text(json.dumps(results, indent=2, default=handle_non_serializable))
        for task, rows in samples.items():
            with open(output / f"samples_R{r}_{task}.jsonl", "w") as f:
                f.writelines(json.dumps(row, default=handle_non_serializable) + "\n" for row in rows)
        by_r[r] = results
    return by_r


def _stop(signum, frame) -> None:
    """SIGTERM (a scheduler's, `timeout`'s) unwinds like Ctrl-C, so the temporary export is removed."""
    print(f"{PROG}: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint directory, or a run directory (its newest complete one)")
    source.add_argument("--model-dir", help="a folder written by grt-convert-hf")
    parser.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    parser.add_argument("--num-recurrences", type=_recurrences, default=None,
                        help="depths to evaluate, e.g. 1,2,4 (default: the R the model was trained with)")
    parser.add_argument("--batch-size", type=_batch_size, default=8, help="an integer, or auto (default 8)")
    parser.add_argument("--include-path", default=None, help="a folder of your own lm-eval task YAMLs")
    parser.add_argument("--limit", type=float, default=None, help="at most N documents per task (< 1: a fraction)")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    # device.WEIGHT_DTYPES's names, spelled out: importing it imports torch, and grt-eval checks its arguments first
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--log-samples", action="store_true", help="also write samples_R{r}_{task}.jsonl")
    parser.add_argument("--output", required=True, help="the folder for the results")
    args = parser.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    # lm-eval would take these with a traceback (a limit <= 0) or in silence (1.5 documents as 1, a negative
    # number of shots as none).
    if args.limit is not None and not (0 < args.limit < 1 or (args.limit >= 1 and args.limit.is_integer())):
        print(f"{PROG}: error: --limit {args.limit:g}: a whole number of documents >= 1, or a fraction in (0, 1)",
              file=sys.stderr)
        return 2
    if args.num_fewshot is not None and args.num_fewshot < 0:
        print(f"{PROG}: error: --num-fewshot {args.num_fewshot}: must be >= 0", file=sys.stderr)
        return 2
    if args.limit is not None and args.limit.is_integer():
        args.limit = int(args.limit)
    from grt_megatron.checkpoint.store import CheckpointError, checkpoint_dir

    output, created = Path(args.output), False
    try:
        if not args.tasks:
            raise EvalError("--tasks: name at least one task")
        checkpoint = None
        if args.checkpoint:
            checkpoint, skipped = checkpoint_dir(args.checkpoint)
            for s in skipped:
                print(f"{PROG}: skipping {s.path} ({s.problem})")
            print(f"{PROG}: evaluating {checkpoint}", flush=True)
        elif not (Path(args.model_dir) / "config.json").is_file():
            raise EvalError(f"--model-dir {args.model_dir}: no config.json (not a Hugging Face model folder)")
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise EvalError("lm-evaluation-harness is not installed: pip install grt-megatron[eval]") from None
        from grt_megatron.console import import_frozen, quiet_known_warnings

        quiet_known_warnings()
        import_frozen("lm_eval.tasks", "lm_eval.models.huggingface", *(["grt_megatron.model"] if checkpoint else []))
        from grt_megatron.device import inference_device

        try:
            args.device = str(inference_device(args.device))  # cuda where present; a missing one refused here
        except ValueError as err:
            raise EvalError(str(err)) from None
        manager = task_manager(args.tasks, args.include_path)
        created = not output.exists()
        output.mkdir(parents=True, exist_ok=True)
        # SIGTERM is held while the folder is made: landing between mkdtemp and the finalizer that
        # TemporaryDirectory sets up next, it left the folder behind (seen once in CI). From then on the
        # `with`, or on an earlier unwind the finalizer, removes it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            export_dir = tempfile.TemporaryDirectory(prefix=".grt-eval-export-", dir=output)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        with export_dir as tmp:
            if checkpoint is not None:
                from grt_megatron.hf.convert import export_checkpoint

                model_dir = export_checkpoint(checkpoint, Path(tmp) / "hf")
            else:
                model_dir = Path(args.model_dir)
            config = json.loads((model_dir / "config.json").read_text())
            source = {"source": str(checkpoint or model_dir), "trained_recurrences": config.get("num_recurrences")}
            by_r = evaluate(args, model_dir, manager, output, source)
    except (EvalError, CheckpointError, OSError) as err:
        if created and output.is_dir() and not any(output.iterdir()):
            output.rmdir()  # a refused evaluation leaves no empty folder behind
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(write_table(by_r, output / "results.md"), end="")
    if len(by_r) > 1:
        plot(by_r, output / "accuracy_vs_R.png", args.tasks)
    print(f"results in {output}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
