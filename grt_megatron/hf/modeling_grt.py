"""Gated Recurrent Transformer for Hugging Face transformers: `GRTModel` (AutoModel, the hidden states) and
`GRTForCausalLM` (AutoModelForCausalLM, with `generate()`).

Self-contained (imports only torch and transformers): it is copied next to the weights of an exported
model and loaded with `trust_remote_code=True`. Inference only adds no noise; the equations are those of
grt-megatron's `recurrent_block.py`:

    h_pre = Prelude(embed(tokens));  h_0 = h_pre
    for r in 1..R:  x_r = W_in [h_{r-1}, h_pre];  o_r = Core(x_r)
                    g_r = sigmoid(W_2 silu(W_1 [LN(h_{r-1}), LN(h_pre)] + b_1) + b_2);  h_r = g_r h_{r-1} + (1-g_r) o_r
    logits = Head(Norm(Coda(h_R)))

A Relaxed Recursive Transformer (`lora_rank` > 0, Bae et al.) adds to every linear of every core layer a
low-rank delta per recursion, y = W x + B_r (A_r x) (`RecursionLinear`; past the trained R the last one's);
they are kept as factors, not merged, so the export stays the shared core's size.

An Ouro-style looped LM (`exit_head`, no gate, no re-injection, no coda) scores every recurrence's state
y_t = Norm(h_t) with its exit head, lambda_t = sigmoid(w·y_t + c), p_t = lambda_t prod_{j<t}(1 − lambda_j) (the
last step takes the rest); a token's output is y_R, or with `exit_threshold` the y_t of the first step whose
cumulative p reaches it (Ouro's exit rule; every step still runs, so the cache holds every recurrence).

The K/V cache has a slot per layer *execution*: prelude layers, each core layer at each recurrence, coda
layers; sharing one slot across recurrences would let later recurrences overwrite earlier ones. With
`kv_cache="average"` the core keeps one slot per core layer holding the mean K/V over recurrences (smaller,
approximate for past tokens). A cache is laid out for one depth: reusing it with another R is refused.

`output_hidden_states=True` gives one tensor per layer execution *boundary*, 1 + P + R + C of them: the
embeddings (tokens + learned positions), each prelude layer's output, the state h_r after each recurrence
(the gated blend, not the core layers inside it; fewer when adaptive exit stopped every token early), each
coda layer's output, the last replaced by the final norm's output (= `last_hidden_state`), as in every
transformers LM. Attention weights are never formed (torch's scaled_dot_product_attention), so
`output_attentions=True` is refused.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .configuration_grt import GRTConfig

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the outputs' `past_key_values` field to `cache`. An export is run by whatever
# transformers its user has, so the outputs carry the cache under the field that version has (both accept
# either name as an argument).
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}
KV_CACHES = ("per_recurrence", "average")
# Per-call settings that also live in the generation config (generation_config.json of an export).
GENERATION_OPTIONS = ("num_recurrences", "kv_cache", "exit_threshold")


def _norm(config: GRTConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RecurrentKVCache(DynamicCache):
    """A DynamicCache whose layer index is a slot (see `GRTModel.slot`); slots are created on first use.
    `average`: core slots hold the mean K/V over recurrences; a chunk's K/V are summed in `pending`
    while its recurrences run and committed once they are done. Its first forward fixes `recurrences`
    and `average`: with another depth the slots would hold other layer executions' K/V."""

    def __init__(self, average: bool = False, recurrences: Optional[int] = None):
        super().__init__()
        self.average = average
        self.recurrences = recurrences
        self.pending: dict[int, list] = {}

    def bind(self, recurrences: int, average: bool) -> None:
        if self.recurrences is None:
            self.recurrences, self.average = recurrences, average
        elif (self.recurrences, self.average) != (recurrences, average):
            built, now = (f"num_recurrences={r}, kv_cache={KV_CACHES[a]!r}"
                          for r, a in ((self.recurrences, self.average), (recurrences, average)))
            raise ValueError(f"this cache was built with {built} but this call runs {now}: its slots hold the K/V "
                             "of one depth's layer executions; pass the same settings, or start without a cache")

    def past(self, slot: int):
        if slot < len(self.layers) and getattr(self.layers[slot], "keys", None) is not None \
                and self.layers[slot].keys.numel():
            return self.layers[slot].keys, self.layers[slot].values
        return None

    def accumulate(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if slot in self.pending:
            self.pending[slot][0] += k
            self.pending[slot][1] += v
            self.pending[slot][2] += 1
        else:
            self.pending[slot] = [k.clone(), v.clone(), 1]

    def commit(self) -> None:
        for slot, (k, v, n) in sorted(self.pending.items()):
            self.update(k / n, v / n, slot)
        self.pending = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)


def _one_cache(cache, past_key_values) -> Optional[RecurrentKVCache]:
    """`cache` (transformers 5's name) or `past_key_values` (the older one, which PEFT and many scripts pass)."""
    if past_key_values is not None:
        if cache is not None:
            raise ValueError("pass the cache once: as `cache` or as `past_key_values`, not both")
        cache = past_key_values
    if cache is not None and not isinstance(cache, RecurrentKVCache):
        raise ValueError(f"GRT needs its own RecurrentKVCache (a K/V slot per layer execution, P + K×R + C), not "
                         f"{type(cache).__name__}: pass use_cache=True and reuse the returned `.cache`. PEFT prefix "
                         "tuning (one K/V prefix per layer) is therefore not supported: use LoRA or prompt tuning")
    return cache


class RecursionLinear(nn.Linear):
    """`nn.Linear`, plus in a relaxed (RRT) core layer a rank-`rank` delta per recursion r:
    y = W x + b + B_r (A_r x), `recursion_a` [R, rank, in], `recursion_b` [R, out, rank]. Recursions past the
    trained R use the last delta, as in training. The names avoid PEFT's `lora_` prefix, so a PEFT LoRA on
    top trains only its own adapters."""

    def __init__(self, in_features: int, out_features: int, bias: bool, recursions: int = 0, rank: int = 0):
        super().__init__(in_features, out_features, bias=bias)
        if rank > 0:
            self.recursion_a = nn.Parameter(torch.empty(recursions, rank, in_features))
            self.recursion_b = nn.Parameter(torch.zeros(recursions, out_features, rank))
        else:
            self.register_parameter("recursion_a", None)
            self.register_parameter("recursion_b", None)

    def forward(self, x: torch.Tensor, recursion: Optional[int] = None) -> torch.Tensor:
        y = super().forward(x)
        if self.recursion_a is None:
            return y
        if recursion is None:
            raise ValueError("a relaxed (RRT) core linear needs the recursion it runs")
        r = min(recursion, self.recursion_a.shape[0] - 1)
        return y + F.linear(F.linear(x, self.recursion_a[r]), self.recursion_b[r])


class GRTAttention(nn.Module):
    def __init__(self, config: GRTConfig, lora_rank: int = 0):
        super().__init__()
        d, self.heads = config.hidden_size, config.num_attention_heads
        self.head_dim = d // self.heads
        bias, r = config.add_bias_linear, config.num_recurrences
        self.q_proj = RecursionLinear(d, d, bias, r, lora_rank)
        self.k_proj = RecursionLinear(d, d, bias, r, lora_rank)
        self.v_proj = RecursionLinear(d, d, bias, r, lora_rank)
        self.o_proj = RecursionLinear(d, d, bias, r, lora_rank)

    def forward(self, x, mask, rope, cache: Optional[RecurrentKVCache], slot: int, mode: str,
                recursion: Optional[int] = None):
        b, s, _ = x.shape
        q, k, v = (proj(x, recursion).view(b, s, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if rope is not None:
            cos, sin = rope
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is None:
            keys, values = k, v
        elif mode == "average":
            past = cache.past(slot)
            keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
            cache.accumulate(slot, k, v)
        else:
            keys, values = cache.update(k, v, slot)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1), recursion)


class GRTMLP(nn.Module):
    def __init__(self, config: GRTConfig, lora_rank: int = 0):
        super().__init__()
        d, f, bias, r = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear, config.num_recurrences
        self.fc1 = RecursionLinear(d, f, bias, r, lora_rank)
        self.fc2 = RecursionLinear(f, d, bias, r, lora_rank)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x, recursion: Optional[int] = None):
        return self.fc2(self.act(self.fc1(x, recursion)), recursion)


class GRTLayer(nn.Module):
    """One transformer layer; a core layer of a relaxed model (`lora_rank` > 0) runs recursion r's deltas."""

    def __init__(self, config: GRTConfig, lora_rank: int = 0):
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = GRTAttention(config, lora_rank)
        self.post_attention_layernorm = _norm(config)
        self.mlp = GRTMLP(config, lora_rank)

    def forward(self, h, mask, rope, cache, slot, mode, recursion=None):
        h = h + self.self_attn(self.input_layernorm(h), mask, rope, cache, slot, mode, recursion)
        return h + self.mlp(self.post_attention_layernorm(h), recursion)


class GRTPreTrainedModel(PreTrainedModel):
    config_class = GRTConfig
    base_model_prefix = "model"
    _no_split_modules = ["GRTLayer"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        std = self.config.init_method_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
            if getattr(module, "recursion_a", None) is not None:  # RRT from scratch: A as LoRA's, B zero
                nn.init.uniform_(module.recursion_a, -module.in_features ** -0.5, module.in_features ** -0.5)
                nn.init.zeros_(module.recursion_b)
        elif isinstance(module, GRTModel) and module.gate_fc2 is not None:
            nn.init.constant_(module.gate_fc2.bias, self.config.gate_bias_init)


class GRTModel(GRTPreTrainedModel):
    """Prelude, recurrent core, coda and final norm: `last_hidden_state` [b, s, d]. `last_recurrences` [b, s]:
    the recurrences each token of the last forward ran (smaller than R where adaptive exit fired)."""

    def __init__(self, config: GRTConfig):
        super().__init__(config)
        if config.initial_state != "prelude":
            raise ValueError(f"initial_state={config.initial_state!r} is not supported at inference (only 'prelude')")
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = (nn.Embedding(config.max_position_embeddings, d)
                                if config.position_embedding == "learned" else None)
        p, k = config.prelude_layers, config.core_layers
        rank = getattr(config, "lora_rank", 0)
        self.layers = nn.ModuleList(GRTLayer(config, rank if p <= i < p + k else 0)
                                    for i in range(config.num_hidden_layers))
        self.injection = nn.Linear(2 * d, d, bias=False) if config.injection == "concat_project" else None
        self.gate_norm_state = self.gate_norm_prelude = self.gate_fc1 = self.gate_fc2 = None
        if config.gate == "mlp":
            self.gate_norm_state, self.gate_norm_prelude = _norm(config), _norm(config)
            self.gate_fc1, self.gate_fc2 = nn.Linear(2 * d, d), nn.Linear(d, d)
        self.norm = _norm(config)
        self.exit_head = nn.Linear(d, 1) if getattr(config, "exit_head", False) else None
        if self.exit_head is not None and (config.coda_layers or config.gate != "none" or config.injection != "none"):
            raise ValueError("exit_head (Ouro) runs with coda_layers=0, gate='none' and injection='none'")
        self.gradient_checkpointing = False  # set by `gradient_checkpointing_enable()`
        self.last_recurrences: Optional[torch.Tensor] = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def slot(self, piece: str, index: int, recurrence: int, recurrences: int, average: bool) -> int:
        """The cache slot of one layer execution."""
        p, k = self.config.prelude_layers, self.config.core_layers
        if piece == "prelude":
            return index
        core = k if average else k * recurrences
        if piece == "core":
            return p + (index if average else recurrence * k + index)
        return p + core + index

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.embed_positions is not None:
            return None
        dim = self.config.hidden_size // self.config.num_attention_heads
        inv = 1.0 / (self.config.rotary_base ** (torch.arange(0, dim, 2, device=positions.device).float() / dim))
        freqs = positions.float()[..., None] * inv  # [b, s, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [b, 1, s, dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(self, i, h, mask, rope, cache, slot, mode, recursion=None):
        """Layer i once (`recursion`: which one, for a core layer). Under activation checkpointing (training)
        each execution, recurrences included, keeps only its input and is recomputed in backward; the cache is
        off then (see `forward`). The recursion is an argument, not state, so the recomputation runs the same
        deltas as the forward."""
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(self.layers[i].__call__, h, mask, rope, None, slot, mode,
                                                     recursion)
        return self.layers[i](h, mask, rope, cache, slot, mode, recursion)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, output_hidden_states=None, output_attentions=None, return_dict=None,
                num_recurrences=None, exit_threshold=None, kv_cache=None, past_key_values=None):
        """`inputs_embeds` replaces the token embeddings (learned positions are still added); `cache` (alias
        `past_key_values`) is a RecurrentKVCache from an earlier call; `num_recurrences`, `exit_threshold`
        and `kv_cache` override the config's for this call."""
        cfg = self.config
        if output_attentions or (output_attentions is None and getattr(cfg, "output_attentions", False)):
            raise ValueError("output_attentions=True is not supported: GRT's attention is torch's "
                             "scaled_dot_product_attention, which never forms the attention weights")
        hidden = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        if not isinstance(hidden, bool):
            raise TypeError(f"output_hidden_states={hidden!r}: True or False (GRT returns all hidden states or none)")
        return_dict = cfg.return_dict if return_dict is None else return_dict
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        recurrences = num_recurrences or cfg.num_recurrences
        threshold = cfg.exit_threshold if exit_threshold is None else exit_threshold
        if (kv_cache or cfg.kv_cache) not in KV_CACHES:
            raise ValueError(f"kv_cache={kv_cache or cfg.kv_cache!r}: one of {', '.join(KV_CACHES)}")
        average = (kv_cache or cfg.kv_cache) == "average"
        core_mode = "average" if average else "write"  # prelude and coda always have their own slots
        cache = _one_cache(cache, past_key_values)
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if use_cache and self.gradient_checkpointing and self.training:
            # Recomputing a layer in backward would write its K/V into the cache a second time.
            logger.warning_once("use_cache=True is incompatible with activation checkpointing in training: "
                                "running without a cache")
            use_cache = False
        if not use_cache:
            cache = None
        elif cache is None:
            cache = RecurrentKVCache()
        if cache is not None:
            cache.bind(recurrences, average)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = h.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(b, past + s, dtype=torch.long, device=h.device)
        valid = attention_mask[:, -(past + s):].bool()
        if position_ids is None:  # left padding: positions count real tokens only
            position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
        if self.embed_positions is not None:
            limit = cfg.max_position_embeddings
            if past + s > limit and int(position_ids.max()) >= limit:  # the embedding would raise IndexError
                raise ValueError(f"position {int(position_ids.max())} is past the {limit} learned positions of this "
                                 "model (max_position_embeddings): shorten the input")
            h = h + self.embed_positions(position_ids)
        rope = self._rope(position_ids, h.dtype)
        query = torch.arange(past, past + s, device=h.device)[:, None]
        key = torch.arange(past + s, device=h.device)[None, :]
        mask = ((key <= query)[None] & valid[:, None, :]) | (key == query)[None]  # a row never empty
        mask = mask[:, None]  # [b, 1, s, past + s]
        states = [h] if hidden else None
        p, k = cfg.prelude_layers, cfg.core_layers
        for i in range(p):
            h = self._run(i, h, mask, rope, cache, self.slot("prelude", i, 0, recurrences, average), "write")
            if hidden:
                states.append(h)
        # The state is carried in fp32 and blended as h + sigmoid(−a)·(o − h), as in training
        # (grt_megatron/model/recurrent_block.py): in bf16 the gate's small update would round away.
        h_pre, state = h, h.float()
        ran = torch.zeros(b, s, dtype=torch.long, device=h.device)
        active = torch.ones(b, s, dtype=torch.bool, device=h.device)
        # Ouro: its exit rule (on the exit head's probabilities) replaces the state-change one.
        exit_rule, step_outputs = (threshold, []) if self.exit_head is not None else (None, None)
        if exit_rule is not None and not 0 < exit_rule <= 1:
            raise ValueError(f"exit_threshold={exit_rule}: an Ouro model's exit rule takes a probability in (0, 1]")
        if self.exit_head is not None:
            threshold = None
        # W_in and W_1 multiply h_pre by the same columns at every step: those products are made once here, as
        # in training, and each step multiplies the state by the state's columns. A linear that is not a
        # plain nn.Linear (a PEFT adapter wraps it) runs whole on the concatenation, its adapter included.
        d = cfg.hidden_size
        injection = gate = None
        if type(self.injection) is nn.Linear:
            injection = (self.injection.weight[:, :d], F.linear(h_pre, self.injection.weight[:, d:]))
        if type(self.gate_fc1) is nn.Linear:
            gate = (self.gate_fc1.weight[:, :d],
                    F.linear(self.gate_norm_prelude(h_pre), self.gate_fc1.weight[:, d:], self.gate_fc1.bias))
        for r in range(recurrences):
            layer_in = state.to(h_pre.dtype)
            if injection is not None:
                x = F.linear(layer_in, injection[0]) + injection[1]
            elif self.injection is not None:
                x = self.injection(torch.cat([layer_in, h_pre], dim=-1))
            elif cfg.injection == "add" and r > 0:
                x = layer_in + h_pre
            else:
                x = layer_in
            for j in range(k):
                x = self._run(p + j, x, mask, rope, cache, self.slot("core", j, r, recurrences, average), core_mode,
                              recursion=r)
            if self.gate_fc1 is None:
                new = x.float()
            else:
                if gate is not None:
                    a = F.linear(self.gate_norm_state(layer_in), gate[0]) + gate[1]
                else:
                    a = self.gate_fc1(torch.cat([self.gate_norm_state(layer_in), self.gate_norm_prelude(h_pre)], -1))
                rate = torch.sigmoid(-(self.gate_fc2(F.silu(a)).float() / cfg.gate_temperature))  # 1 − g
                new = state + rate * (x.float() - state)
            ran += active.long()
            if step_outputs is not None:
                step_outputs.append(self.norm(new.to(h_pre.dtype)))
            if threshold is not None:
                change = (new - state).float().norm(dim=-1) / state.float().norm(dim=-1).clamp_min(1e-12)
                new = torch.where(active[..., None], new, state)
                active = active & (change >= threshold)
            state = new
            if hidden:
                states.append(state.to(h_pre.dtype))
            if threshold is not None and not active.any():
                if cache is not None and not average:  # later recurrences' slots repeat this one's K/V
                    for j in range(k):
                        last = cache.layers[self.slot("core", j, r, recurrences, False)]
                        for later in range(r + 1, recurrences):
                            n = last.keys.shape[2]
                            cache.update(last.keys[:, :, n - s:], last.values[:, :, n - s:],
                                         self.slot("core", j, later, recurrences, False))
                break
        if cache is not None and average:
            cache.commit()
        state = state.to(h_pre.dtype)
        if step_outputs is not None:  # Ouro: each token's exit step's output, no coda
            out, ran = self._exit(step_outputs, exit_rule)
        else:
            for c in range(cfg.coda_layers):
                state = self._run(p + k + c, state, mask, rope, cache,
                                  self.slot("coda", c, 0, recurrences, average), "write")
                if hidden:
                    states.append(state)
            out = self.norm(state)
        if hidden:
            states[-1] = out
        self.last_recurrences = ran
        output = BaseModelOutputWithPast(last_hidden_state=out, **{CACHE_FIELD: cache},
                                         hidden_states=tuple(states) if hidden else None)
        return output if return_dict else output.to_tuple()


    def _exit(self, outputs: list, threshold: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Ouro: each token's output [b, s, d] (the last step's, or with `threshold` its exit step's) and the
        steps it counts [b, s]. As grt-megatron's model/ouro.py: log p_t from log-sigmoids, exit at the first t
        whose cumulative p reaches the threshold, the last step where rounding keeps the sum just under it."""
        b, s = outputs[-1].shape[:2]
        if threshold is None:
            return outputs[-1], torch.full((b, s), len(outputs), dtype=torch.long, device=outputs[-1].device)
        logits = torch.stack([self.exit_head(y).squeeze(-1).float() for y in outputs])  # [R, b, s]
        log_exit, log_stay = F.logsigmoid(logits), F.logsigmoid(-logits)
        survived = torch.cumsum(log_stay, 0) - log_stay
        log_p = torch.cat([log_exit[:-1] + survived[:-1], survived[-1:]])
        reached = log_p.exp().cumsum(0) >= threshold
        reached[-1] = True
        steps = reached.int().argmax(0)  # [b, s], 0-based
        chosen = torch.stack(outputs).gather(0, steps[None, ..., None].expand(1, *outputs[-1].shape)).squeeze(0)
        return chosen, steps.long() + 1


class GRTForCausalLM(GRTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    accepts_loss_kwargs = True  # `num_items_in_batch`: Trainer then leaves the gradient-accumulation scaling to us

    def __init__(self, config: GRTConfig):
        super().__init__(config)
        self.model = GRTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def last_recurrences(self) -> Optional[torch.Tensor]:
        """Recurrences each token of the last forward ran (smaller than R where adaptive exit fired)."""
        return self.model.last_recurrences

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The cache is ours (a slot per layer execution, created in `forward`), not one sized by the config.
        return False

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, output_hidden_states=None, output_attentions=None, return_dict=None,
                logits_to_keep=0, num_items_in_batch=None, num_recurrences=None, exit_threshold=None,
                kv_cache=None, past_key_values=None):
        """GRTModel's arguments, and: `labels` (next-token loss, -100 ignored); `num_items_in_batch`, the
        labelled tokens of a whole accumulated batch (Trainer passes it): the loss is then this batch's summed
        token loss over it, so that gradient accumulation adds up to one big batch; `logits_to_keep` (the last
        N positions only). Unknown keywords are a TypeError, as for any Python function."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
                         output_attentions=output_attentions, return_dict=True, num_recurrences=num_recurrences,
                         exit_threshold=exit_threshold, kv_cache=kv_cache, past_key_values=past_key_values)
        hidden = out.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else out.last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            pred, target = logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device)
            if num_items_in_batch is None:
                loss = F.cross_entropy(pred, target, ignore_index=-100)
            else:
                loss = F.cross_entropy(pred, target, ignore_index=-100, reduction="sum")
                loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                               else num_items_in_batch)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(out, CACHE_FIELD)},
                                        hidden_states=out.hidden_states)
        return output if return_dict else output.to_tuple()

    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        # generate() keeps a keyword in the generation config when the config has that attribute (an export's
        # does, for GENERATION_OPTIONS), so it would never reach forward: hand them over from there.
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, *args, **kwargs)
        for name in GENERATION_OPTIONS:
            if getattr(generation_config, name, None) is not None:
                model_kwargs.setdefault(name, getattr(generation_config, name))
        return generation_config, model_kwargs

    def _prepare_generated_length(self, generation_config, has_default_max_length, has_default_min_length,
                                  model_input_name, input_ids_length, inputs_tensor):
        generation_config = super()._prepare_generated_length(
            generation_config, has_default_max_length=has_default_max_length,
            has_default_min_length=has_default_min_length, model_input_name=model_input_name,
            input_ids_length=input_ids_length, inputs_tensor=inputs_tensor)
        # Learned positions end at max_position_embeddings: refuse up front rather than fail mid-way.
        limit, prompt = self.config.max_position_embeddings, inputs_tensor.shape[1]
        new = generation_config.max_length - input_ids_length
        if self.config.position_embedding == "learned" and prompt + new > limit:
            raise ValueError(f"a prompt of {prompt} tokens (padding included) + {new} new tokens passes the {limit} "
                             "learned positions of this model (max_position_embeddings): ask for at most "
                             f"{max(limit - prompt, 0)} new tokens, or shorten the prompt")
        return generation_config
