"""Hugging Face configuration of a Gated Recurrent Transformer (`model_type: grt`).

Self-contained (imports only transformers): it is copied next to the weights of an exported model.
"""

from transformers import PretrainedConfig


class GRTConfig(PretrainedConfig):
    """`P+K×R+C`: `prelude_layers` unique layers, a `core_layers`-layer core run `num_recurrences` times
    with an update gate, `coda_layers` unique layers. Dense GPT is P = C = 0, R = 1, no gate, no injection."""

    model_type = "grt"

    def __init__(
        self,
        vocab_size=50257,
        hidden_size=768,
        num_attention_heads=12,
        ffn_hidden_size=3072,
        normalization="LayerNorm",
        activation="gelu",
        add_bias_linear=False,
        layernorm_epsilon=1e-5,
        max_position_embeddings=1024,
        position_embedding="learned",
        rotary_base=10000,
        prelude_layers=1,
        core_layers=1,
        coda_layers=1,
        num_recurrences=1,
        injection="concat_project",
        gate="mlp",
        gate_temperature=1.0,
        gate_bias_init=4.0,
        initial_state="prelude",
        depth_sampler="fixed",
        heavy_tail_sigma=0.5,
        heavy_tail_k=8,
        noise_sigma=0.0,
        kv_cache="per_recurrence",
        exit_threshold=None,
        lora_rank=0,
        exit_head=False,
        exit_rule_threshold=0.5,
        init_method_std=0.02,
        tie_word_embeddings=True,
        use_cache=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.ffn_hidden_size = ffn_hidden_size
        self.normalization = normalization
        self.activation = activation
        self.add_bias_linear = add_bias_linear
        self.layernorm_epsilon = layernorm_epsilon
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding = position_embedding
        self.rotary_base = rotary_base
        self.prelude_layers = prelude_layers
        self.core_layers = core_layers
        self.coda_layers = coda_layers
        self.num_recurrences = num_recurrences
        """R the model was trained with (the mean R for heavy-tail sampling); the default at inference."""
        self.injection = injection
        self.gate = gate
        self.gate_temperature = gate_temperature
        self.gate_bias_init = gate_bias_init
        self.initial_state = initial_state
        self.depth_sampler = depth_sampler
        self.heavy_tail_sigma = heavy_tail_sigma
        self.heavy_tail_k = heavy_tail_k
        self.noise_sigma = noise_sigma
        """Training noise (recorded only: inference never adds noise)."""
        self.kv_cache = kv_cache
        """`per_recurrence`: a K/V slot for each core layer at each recurrence; `average`: one slot per core
        layer holding the mean over recurrences (R× smaller for the core, approximate)."""
        self.exit_threshold = exit_threshold
        """Adaptive exit: a token stops recurring once ‖h_r − h_{r−1}‖ / ‖h_{r−1}‖ falls below this. For an Ouro
        model (`exit_head`), the exit rule's cumulative exit probability instead."""
        self.lora_rank = lora_rank
        """Relaxed Recursive Transformer: > 0 gives every core linear a rank-`lora_rank` delta per recursion."""
        self.exit_head = exit_head
        """Ouro-style looped LM: a learned exit head scores every recurrence; `exit_threshold` then means the
        cumulative exit probability at which a token takes that step's output (None: the last step)."""
        self.exit_rule_threshold = exit_rule_threshold
        """Ouro: the threshold its training run evaluated the exit rule at (`loss_exit_rule`); recorded, pass it
        as `exit_threshold` to use the rule."""
        self.init_method_std = init_method_std
        self.use_cache = use_cache
        self.num_hidden_layers = prelude_layers + core_layers + coda_layers
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
