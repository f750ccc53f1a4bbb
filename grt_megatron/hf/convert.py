"""`grt-convert-hf`: a training checkpoint (any layout) to a Hugging Face folder, and back.

    grt-convert-hf --checkpoint runs/a/checkpoints/step_00001000 --output hf/grt-small [--dtype bf16]
    grt-convert-hf --from-hf hf/grt-small --output runs/ft/checkpoints/step_00000000

The folder holds `config.json` (model type `grt`, `auto_map`), `configuration_grt.py` and `modeling_grt.py`
(torch + transformers only), `model.safetensors` (sharded when large), the tokenizer and
`generation_config.json`; `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads it, and
`AutoModel` its base model (the hidden states). `--checkpoint` also takes a run or checkpoints directory, as
`resume=` does: its newest complete checkpoint is exported.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from grt_megatron.checkpoint.store import CheckpointError
from grt_megatron.device import WEIGHT_DTYPES
from grt_megatron.errors import first_line
from grt_megatron.files import file_in_the_way

HF_FILES = Path(__file__).parent


# ---- names and shapes: one plain (one-process, TP 1) state dict <-> the HF model's -------------------------
def _layer_map(i: int) -> dict[str, str]:
    src, dst = f"block.layers.{i}.", f"model.layers.{i}."
    return {src + a: dst + b for a, b in (
        ("input_layernorm.weight", "input_layernorm.weight"), ("input_layernorm.bias", "input_layernorm.bias"),
        ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
        ("self_attention.linear_proj.bias", "self_attn.o_proj.bias"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        ("pre_mlp_layernorm.bias", "post_attention_layernorm.bias"),
        ("mlp.linear_fc1.weight", "mlp.fc1.weight"), ("mlp.linear_fc1.bias", "mlp.fc1.bias"),
        ("mlp.linear_fc2.weight", "mlp.fc2.weight"), ("mlp.linear_fc2.bias", "mlp.fc2.bias"),
    )}


def name_map(num_layers: int) -> dict[str, str]:
    """Plain grt-megatron name -> HF name, for every tensor that is renamed only (QKV is split apart)."""
    out = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "embedding.position_embeddings.weight": "model.embed_positions.weight",
           "final_norm.weight": "model.norm.weight", "final_norm.bias": "model.norm.bias",
           "output_layer.weight": "lm_head.weight", "block.injection.weight": "model.injection.weight",
           "exit_head.weight": "model.exit_head.weight", "exit_head.bias": "model.exit_head.bias"}
    for piece in ("gate_norm_state", "gate_norm_prelude", "gate_fc1", "gate_fc2"):
        for kind in ("weight", "bias"):
            out[f"block.{piece}.{kind}"] = f"model.{piece}.{kind}"
    for i in range(num_layers):
        out.update(_layer_map(i))
    return out


def _split_qkv(t: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused QKV rows are grouped per head: [q_h, k_h, v_h] for each head h."""
    per_head = t.reshape(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:])
    return tuple(per_head[:, i].reshape(-1, *t.shape[1:]).contiguous() for i in range(3))


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    parts = [x.reshape(heads, x.shape[0] // heads, *x.shape[1:]) for x in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(-1, *q.shape[1:]).contiguous()


# RRT: the deltas of core layer k's linear (`block.lora.layers.k.<linear>.a/.b`, model/relaxed.py) live on
# HF layer P + k's linear as `recursion_a` / `recursion_b`; QKV's B splits like its weight's rows, A is shared.
_LORA_LINEARS = {"linear_proj": "self_attn.o_proj", "linear_fc1": "mlp.fc1", "linear_fc2": "mlp.fc2"}
_LORA_KINDS = {"a": "recursion_a", "b": "recursion_b"}


def _lora_to_hf(name: str, t: torch.Tensor, model: dict) -> dict[str, torch.Tensor]:
    _, _, _, k, linear, kind = name.split(".")  # block.lora.layers.<k>.<linear>.<a|b>
    layer = f"model.layers.{model['prelude_layers'] + int(k)}."
    if linear != "linear_qkv":
        return {f"{layer}{_LORA_LINEARS[linear]}.{_LORA_KINDS[kind]}": t}
    if kind == "a":
        return {f"{layer}self_attn.{proj}.recursion_a": t.clone() for proj in ("q_proj", "k_proj", "v_proj")}
    parts = _split_qkv(t.transpose(0, 1), model["num_attention_heads"])  # rows of B [R, 3d, rank] per head
    return {f"{layer}self_attn.{proj}.recursion_b": part.transpose(0, 1).contiguous()
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts)}


def _lora_from_hf(hf: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    out = {}
    back = {v: k for k, v in _LORA_LINEARS.items()}
    for k in range(model["core_layers"]):
        layer = f"model.layers.{model['prelude_layers'] + k}."
        prefix = f"block.lora.layers.{k}."
        for hf_linear, linear in back.items():
            for kind, hf_kind in _LORA_KINDS.items():
                out[f"{prefix}{linear}.{kind}"] = hf[f"{layer}{hf_linear}.{hf_kind}"]
        a = [hf[f"{layer}self_attn.{proj}.recursion_a"] for proj in ("q_proj", "k_proj", "v_proj")]
        if not (torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])):
            raise CheckpointError(f"{layer}self_attn: q/k/v_proj.recursion_a differ; grt-megatron's fused QKV "
                                  "shares one A per recursion (fine-tune the B factors only, or keep the HF model)")
        b = [hf[f"{layer}self_attn.{proj}.recursion_b"].transpose(0, 1) for proj in ("q_proj", "k_proj", "v_proj")]
        out[f"{prefix}linear_qkv.a"] = a[0]
        out[f"{prefix}linear_qkv.b"] = _join_qkv(*b, model["num_attention_heads"]).transpose(0, 1).contiguous()
    return out


def to_hf_state(plain: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """A plain fp32 state dict (vocab padding cut to `model['vocab_size']` here) -> HF names."""
    heads, vocab = model["num_attention_heads"], model["vocab_size"]
    names = name_map(model["prelude_layers"] + model["core_layers"] + model["coda_layers"])
    out = {}
    for name, t in plain.items():
        if name.startswith("block.lora."):
            out.update(_lora_to_hf(name, t, model))
            continue
        if ".self_attention.linear_qkv." in name:
            prefix, kind = name.split(".self_attention.linear_qkv.")
            hf = prefix.replace("block.layers.", "model.layers.") + ".self_attn."
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(t, heads)):
                out[f"{hf}{proj}.{kind}"] = part
            continue
        if name not in names:
            raise CheckpointError(f"tensor {name} has no Hugging Face name (a model this export does not know)")
        out[names[name]] = t[:vocab].contiguous() if name in ("embedding.word_embeddings.weight",
                                                              "output_layer.weight") else t
    return out


def from_hf_state(hf: dict[str, torch.Tensor], model: dict, padded_vocab: int) -> dict[str, torch.Tensor]:
    """HF state dict -> plain names, vocabulary zero-padded to `padded_vocab` rows."""
    heads = model["num_attention_heads"]
    back = {v: k for k, v in name_map(model["prelude_layers"] + model["core_layers"] + model["coda_layers"]).items()}
    out, qkv = _lora_from_hf(hf, model) if model.get("lora_rank", 0) else {}, {}
    for name, t in hf.items():
        if name.endswith((".recursion_a", ".recursion_b")):
            continue
        if ".self_attn." in name and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            prefix, proj, kind = name.rsplit(".", 2)
            qkv.setdefault((prefix, kind), {})[proj] = t
            continue
        if name == "lm_head.weight" and model["tie_embeddings"]:
            continue
        plain = back[name]
        if plain in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        out[plain] = t
    for (prefix, kind), parts in qkv.items():
        plain = prefix.replace("model.layers.", "block.layers.").replace(".self_attn", ".self_attention")
        out[f"{plain}.linear_qkv.{kind}"] = _join_qkv(parts["q_proj"], parts["k_proj"], parts["v_proj"], heads)
    return out


# grt-megatron model field -> HF config field: one table for both directions.
_CONFIG_FIELDS = {name: name for name in (
    "vocab_size", "hidden_size", "num_attention_heads", "ffn_hidden_size", "normalization", "activation",
    "add_bias_linear", "layernorm_epsilon", "position_embedding", "rotary_base", "prelude_layers", "core_layers",
    "coda_layers", "injection", "gate", "gate_temperature", "gate_bias_init", "initial_state", "depth_sampler",
    "heavy_tail_sigma", "heavy_tail_k", "noise_sigma", "init_method_std", "lora_rank", "exit_head")}
_CONFIG_FIELDS.update(max_sequence_length="max_position_embeddings", recurrences="num_recurrences",
                      tie_embeddings="tie_word_embeddings", exit_threshold="exit_rule_threshold")

# Fields added after the first exports: an older folder's config (or checkpoint's model) lacks them.
_CONFIG_DEFAULTS = {"lora_rank": 0, "exit_head": False, "exit_threshold": 0.5}


def hf_config_kwargs(model: dict) -> dict:
    """HF `GRTConfig` fields from a grt-megatron model (`GRTConfig.to_dict()`)."""
    if model["initial_state"] != "prelude":
        raise CheckpointError(f"model.initial_state={model['initial_state']!r}: the export supports only "
                              "'prelude' (a random initial state is not reproducible token by token)")
    if model.get("routing", "none") != "none":
        raise CheckpointError(f"model.routing={model['routing']!r} (Mixture-of-Recursions) is not supported by the "
                              "Hugging Face export: modeling_grt.py has no routers")
    if model.get("exit_head", False) and model["coda_layers"]:
        raise CheckpointError(f"model.exit_head=true (Ouro) with model.coda_layers={model['coda_layers']} is not "
                              "supported by the Hugging Face export (its coda would run at every step: a cache slot "
                              "per step); the ouro_* recipes loop the whole stack, coda_layers=0")
    if model["gate"] not in ("mlp", "none"):
        raise CheckpointError(f"model.gate={model['gate']!r} (an ablation) is not supported by the Hugging Face "
                              "export; export models with gate mlp or none")
    out = {hf: model.get(name, _CONFIG_DEFAULTS.get(name)) for name, hf in _CONFIG_FIELDS.items()}
    out["ffn_hidden_size"] = out["ffn_hidden_size"] or 4 * model["hidden_size"]
    return out


def model_from_hf_config(config) -> dict:
    """grt-megatron model fields (a recipe) from an HF `GRTConfig`; no dropout."""
    return {**{name: getattr(config, hf, _CONFIG_DEFAULTS.get(name)) for name, hf in _CONFIG_FIELDS.items()},
            "hidden_dropout": 0.0, "attention_dropout": 0.0}


# ---- export -------------------------------------------------------------------------------------------------
def _hf_classes():
    from grt_megatron.hf.configuration_grt import GRTConfig as HFGRTConfig
    from grt_megatron.hf.modeling_grt import GRTForCausalLM

    # save_pretrained then copies configuration_grt.py / modeling_grt.py and writes `auto_map`.
    HFGRTConfig.register_for_auto_class()
    GRTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    return HFGRTConfig, GRTForCausalLM


def build_hf_model(plain: dict[str, torch.Tensor], model: dict, dtype: torch.dtype = torch.float32,
                   progress: bool = False):
    """An in-memory `GRTForCausalLM` holding a plain state dict's weights."""
    HFGRTConfig, GRTForCausalLM = _hf_classes()
    config = HFGRTConfig(**hf_config_kwargs(model))
    # save_pretrained adds the classes it saves (AutoConfig, AutoModelForCausalLM) to this map; the base model
    # is not saved by itself, so it is named here for AutoModel.
    config.auto_map = {"AutoModel": "modeling_grt.GRTModel"}
    with torch.device("meta"):
        hf_model = GRTForCausalLM(config)
    state = to_hf_state(plain, model)
    expected = set(hf_model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(f"checkpoint and GRTForCausalLM disagree: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")
    converted = {k: v.to(dtype) for k, v in tqdm(state.items(), desc="convert", unit="tensor", disable=not progress)}
    hf_model.load_state_dict(converted, strict=False, assign=True)
    if config.tie_word_embeddings:
        hf_model.lm_head.weight = hf_model.model.embed_tokens.weight
    return hf_model.eval()


def _save_tokenizer(checkpoint: Path, state: dict, out: Path, max_length: int) -> dict:
    """Tokenizer files into `out`; returns the special token ids for the generation config."""
    kind = state["tokenizer"]["kind"]
    if kind == "SentencePieceTokenizer":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(checkpoint / "tokenizer.model"))
        shutil.copyfile(checkpoint / "tokenizer.model", out / "tokenizer.model")
        shutil.copyfile(HF_FILES / "tokenization_grt.py", out / "tokenization_grt.py")
        eos = sp.id_to_piece(sp.eos_id())
        bos = sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None
        config = {"tokenizer_class": "GRTTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_grt.GRTTokenizer",
                                                                                     None]},
                  "eos_token": eos, "bos_token": bos, "unk_token": sp.id_to_piece(sp.unk_id()), "pad_token": eos,
                  "legacy": True, "add_bos_token": False, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False, "model_max_length": max_length}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        return {"eos_token_id": sp.eos_id(), "bos_token_id": sp.bos_id() if sp.bos_id() >= 0 else sp.eos_id(),
                "pad_token_id": sp.eos_id()}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint / "tokenizer"))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.save_pretrained(str(out))
    return {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id or tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}


def check_paths(output: Path, hf_dir: Path | None = None) -> None:
    """What either direction refuses before reading anything: an existing `--output`, and for an import a
    `--from-hf` folder without config.json."""
    if output.exists():
        raise CheckpointError(f"--output {output} exists; refusing to overwrite it")
    blocking = file_in_the_way(output.parent)
    if blocking is not None:
        raise CheckpointError(f"--output {output}: {blocking} is a file, not a folder")
    if hf_dir is not None and not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"--from-hf {hf_dir}: no config.json (not a Hugging Face model folder)")


def check_shard_size(size: str) -> None:
    """`--max-shard-size` as save_pretrained reads it (a number with KB, MB, GB or TB), above 0."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*", str(size), flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise CheckpointError(f"--max-shard-size {size!r}: not a size such as 2GB or 500MB")


def export_checkpoint(checkpoint: Path, output: Path, dtype: str = "fp32", max_shard_size: str = "2GB",
                      progress: bool = True) -> Path:
    from transformers import GenerationConfig

    from grt_megatron.checkpoint.consolidate import consolidate
    from grt_megatron.hf.modeling_grt import GENERATION_OPTIONS

    output = Path(output)
    check_paths(output)
    if dtype not in WEIGHT_DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    plain, _ = consolidate(Path(checkpoint), progress=progress)
    from grt_megatron.checkpoint.store import inspect_checkpoint

    state = inspect_checkpoint(Path(checkpoint)).state
    model = state["model"]
    hf_model = build_hf_model(plain, model, WEIGHT_DTYPES[dtype], progress)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent if output.parent.exists() else None))
    try:
        special = _save_tokenizer(Path(checkpoint), state, tmp, model["max_sequence_length"])
        hf_model.config.update(special)
        # num_recurrences, kv_cache and exit_threshold are generation settings too: generate() reads them here.
        hf_model.generation_config = GenerationConfig(
            **special, **{name: getattr(hf_model.config, name) for name in GENERATION_OPTIONS})
        hf_model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        (tmp / "grt_export.json").write_text(json.dumps({"source": str(checkpoint), "step": state["step"],
                                                         "tokens": state["tokens"], "dtype": dtype,
                                                         "version": state["version"]}, indent=2))
        for file in tmp.iterdir():  # mkdtemp and some writers create owner-only files
            file.chmod(0o644)
        tmp.chmod(0o755)
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


# ---- import -------------------------------------------------------------------------------------------------
def import_hf(hf_dir: Path, output: Path, progress: bool = True) -> Path:
    """An exported folder -> a training checkpoint (step 0, no optimizer state) that `grt-train resume=`
    fine-tunes from in any layout."""
    from transformers import AutoConfig

    from grt_megatron.checkpoint.consolidate import write_weights_checkpoint
    from grt_megatron.model import GRTConfig

    hf_dir, output = Path(hf_dir), Path(output)
    check_paths(output, hf_dir=hf_dir)
    try:
        config = AutoConfig.from_pretrained(str(hf_dir), trust_remote_code=True)
    except (OSError, ValueError) as err:  # not JSON, no model_type, ...: transformers' first line
        raise CheckpointError(f"--from-hf {hf_dir}: its config.json does not load: "
                              f"{first_line(err)}") from None
    if getattr(config, "model_type", None) != "grt":
        raise CheckpointError(f"--from-hf {hf_dir}: model_type {getattr(config, 'model_type', None)!r} is not 'grt'")
    model = GRTConfig.from_recipe(model_from_hf_config(config)).to_dict()
    padded = GRTConfig.from_recipe(model).padded_vocab_size
    tokenizer = _read_tokenizer(hf_dir)  # before the weights: a folder without one fails at once
    hf_state = _read_hf_weights(hf_dir)
    plain = from_hf_state(hf_state, model, padded)
    return write_weights_checkpoint(output, plain, model, tokenizer, reason=f"imported from {hf_dir}",
                                    progress=progress)


def _read_tokenizer(hf_dir: Path):
    """The folder's tokenizer (`tokenizer.model`, or a Hugging Face tokenizer's files): a checkpoint needs one."""
    from grt_megatron.data.tokenizer import load_tokenizer

    from grt_megatron.data.sources import DataError

    if (hf_dir / "tokenizer.model").is_file():
        try:
            return load_tokenizer(hf_dir / "tokenizer.model")
        except DataError as err:
            raise CheckpointError(f"--from-hf {hf_dir}: its tokenizer does not load: {err}") from None
    settings = hf_dir / "tokenizer_config.json"
    if not (hf_dir / "tokenizer.json").is_file() and settings.is_file() and "auto_map" in settings.read_text():
        # The export's own tokenizer is custom code reading tokenizer.model: without it, transformers would
        # only ask whether to run that code (twice) and then fail.
        raise CheckpointError(f"--from-hf {hf_dir}: no tokenizer.model, which its tokenizer_config.json "
                              "(custom code) reads; copy it back into the folder")
    if not any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise CheckpointError(f"--from-hf {hf_dir}: no tokenizer (tokenizer.model, or tokenizer.json / "
                              "tokenizer_config.json); a training checkpoint needs one: save it into the folder")
    try:
        return load_tokenizer(str(hf_dir))
    except Exception as err:  # transformers' own errors (OSError, ValueError, ...): one line, not a traceback
        raise CheckpointError(f"--from-hf {hf_dir}: its tokenizer does not load: {first_line(err)}") from None


def resolve_export_source(path: Path) -> Path:
    """`--checkpoint` as `resume=` reads it: a checkpoint directory as it is (consolidate verifies it), or a run
    or checkpoints directory: its newest complete checkpoint, named on stdout with any newer one skipped."""
    from grt_megatron.checkpoint.store import MANIFEST, checkpoint_root_of, list_checkpoints, resolve_checkpoint

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path}: no such file or directory")
    if not path.is_dir() or (path / MANIFEST).exists() or path.name.startswith("step_"):
        return path
    if not list_checkpoints(checkpoint_root_of(path)):
        raise CheckpointError(f"--checkpoint {path}: not a grt-megatron checkpoint (no {MANIFEST}), nor a run or "
                              "checkpoints directory holding one")
    found, skipped = resolve_checkpoint(str(path), path, option="--checkpoint ")
    for s in skipped:
        print(f"--checkpoint {path}: skipping {s.path.name} ({s.problem})")
    print(f"--checkpoint {path}: exporting its newest complete checkpoint, {found.path}")
    return found.path


def _read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    out = {}
    for name in files:
        if not (hf_dir / name).is_file():
            raise CheckpointError(f"--from-hf {hf_dir}: {name} is missing")
        try:
            out.update(load_file(str(hf_dir / name)))
        except Exception as err:  # safetensors' SafetensorError: a truncated or foreign file
            raise CheckpointError(f"--from-hf {hf_dir}: {name} does not load "
                                  f"({first_line(err)})") from None
    return {k: v.float() for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    from grt_megatron.console import import_frozen, quiet_known_warnings

    parser = argparse.ArgumentParser(prog="grt-convert-hf", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a training checkpoint directory (step_N), any layout, or a run / "
                                             "checkpoints directory (its newest complete checkpoint)")
    source.add_argument("--from-hf", help="an exported Hugging Face folder, to import as a training checkpoint")
    parser.add_argument("--output", required=True, help="the HF folder to write (export) or the checkpoint "
                                                        "directory RUN/checkpoints/step_00000000 (import)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(WEIGHT_DTYPES), help="weights' dtype in the export")
    parser.add_argument("--max-shard-size", default="2GB")
    args = parser.parse_args(argv)
    quiet_known_warnings()
    try:
        # The paths first: a mistyped one fails in a second, not after transformers and megatron are imported.
        if args.checkpoint:
            check_paths(Path(args.output))
            check_shard_size(args.max_shard_size)
            source = resolve_export_source(Path(args.checkpoint))
        else:
            check_paths(Path(args.output), hf_dir=Path(args.from_hf))
        import_frozen("transformers", "grt_megatron.model")  # both directions build both models
        if args.checkpoint:
            out = export_checkpoint(source, Path(args.output), args.dtype, args.max_shard_size)
            print(f"exported {source} -> {out}")
        else:
            out = import_hf(Path(args.from_hf), Path(args.output))
            print(f"imported {args.from_hf} -> {out} (resume=... it to fine-tune, in any layout)")
    except CheckpointError as err:
        print(f"grt-convert-hf: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
