"""The GRT language model: embedding → gated recurrent block → final norm → (tied) output layer.

Dense GPT and every depth-reuse baseline are this class with other `GRTConfig` values.
Tensors inside are megatron's [sequence, batch, hidden]; the public interface is [batch, sequence].
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.utils.checkpoint
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from grt_megatron.model.config import GRTConfig
from grt_megatron.model.init import piece_rng
from grt_megatron.model.layers import document_attention_mask
from grt_megatron.model.loss import chunked_vocab_parallel_cross_entropy
from grt_megatron.model.ouro import EXIT_RULES, build_exit_head, exit_log_probs, exit_steps, looped_loss
from grt_megatron.model.specs import ColumnLinear, get_grt_block_spec, get_norm_spec


def attention_mask_of(config: GRTConfig, document_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The layers' attention mask: None (causal, the kernel's own) or, given each position's document
    ([b, s], packed documents: `data.reset_attention_mask`), causal within each document."""
    if document_ids is None:
        return None
    if config.layer_spec != "local":
        # Transformer Engine's attention is built causal here and would ignore the mask: refuse, never
        # attend across documents silently (the run config resolves `auto` to local for this reason).
        raise ValueError(f"document attention masks need model.layer_spec=local, got {config.layer_spec!r}")
    return document_attention_mask(document_ids)


def build_embedding(config: GRTConfig, init_seed: int) -> LanguageModelEmbedding:
    with piece_rng(init_seed, "embedding"):
        return LanguageModelEmbedding(
            config=config,
            vocab_size=config.padded_vocab_size,
            max_sequence_length=config.max_sequence_length,
            position_embedding_type="rope" if config.position_embedding == "rope" else "learned_absolute",
        )


def build_rotary(config: GRTConfig) -> Optional[RotaryEmbedding]:
    if config.position_embedding != "rope":
        return None
    return RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=config.rotary_base,
                           use_cpu_initialization=config.use_cpu_initialization)


def build_final_norm(config: GRTConfig, init_seed: int) -> torch.nn.Module:
    with piece_rng(init_seed, "final_norm"):
        return build_module(get_norm_spec(), config=config, hidden_size=config.hidden_size,
                            eps=config.layernorm_epsilon)


def build_output_layer(config: GRTConfig, init_seed: int, tied: bool) -> ColumnLinear:
    """The LM head; with `tied` it owns no weight and is called with the embedding's."""
    with piece_rng(init_seed, "output_layer"):
        return ColumnLinear(
            config.hidden_size, config.padded_vocab_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False, skip_weight_param_allocation=tied,
        )


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """logits [s, b, V/TP] (the model's dtype: never cast to fp32 whole, see loss.py), labels [b, s] ->
    per-token loss [b, s] (fp32). `fused`: the chunks' arithmetic compiled (`train.compile`)."""
    loss = chunked_vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), fused=fused)
    return loss.transpose(0, 1).contiguous()


PARTS = ("embedding", "block", "final_norm", "output_layer")


class GRTLanguageModel(MegatronModule):
    def __init__(self, config: GRTConfig, init_seed: int = 0, parts: Sequence[str] = PARTS,
                 layers: Optional[Sequence[int]] = None):
        """`init_seed` decides the initial weights, piece by piece (see model/init.py). `parts` and the
        block's `layers` (global indices) select what is built, by default everything: a pipeline unit
        is this model built with one part (parallel/pipeline.py), so it holds exactly these weights."""
        super().__init__(config=config)
        self.config: GRTConfig = config
        self.fused_loss = False
        """The loss chunks' arithmetic compiled: set by `train.compile` (parallel/compile.py)."""
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown model parts {sorted(unknown)}; known: {PARTS}")
        self.embedding = build_embedding(config, init_seed) if "embedding" in parts else None
        self.rotary_pos_emb = build_rotary(config) if "block" in parts else None
        self.block = None
        if "block" in parts:
            self.block = build_module(get_grt_block_spec(config), config=config, init_seed=init_seed, layers=layers)
        self.final_norm = build_final_norm(config, init_seed) if "final_norm" in parts else None
        self.output_layer = None
        if "output_layer" in parts:
            self.output_layer = build_output_layer(config, init_seed, tied=config.tie_embeddings)
        self.exit_head = None
        if config.exit_head and "final_norm" in parts:
            self.exit_head = build_exit_head(config, init_seed)
        self.exit_rule = "last"
        """Ouro outside training: score each token at the last step (`last`) or at its exit step (`threshold`)."""
        self.exit_stats = None
        """Ouro: an `ouro.ExitStats` that threshold-rule evaluations add to (`ouro.recording_exit_stats`)."""
        if config.params_dtype != torch.float32:
            # megatron builds norms and position embeddings in fp32 whatever params_dtype says; cast the
            # whole model, as DeepSpeed's bf16 mode would, so that a bf16 model also runs on its own.
            self.to(config.params_dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> hidden [s, b, d] (this rank's slice of the sequence under SP)."""
        b, s = tokens.shape
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        return self.embedding(input_ids=tokens, position_ids=position_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, d] -> logits [s, b, V/TP], through the embedding's weight when tied."""
        weight = self.embedding.word_embeddings.weight if self.config.tie_embeddings else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    def forward(
        self,
        tokens: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        recurrences: Optional[int] = None,
        grad_recurrences: Optional[int] = None,
        noise_seeds: Optional[Sequence[int]] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """tokens [b, s] → per-token loss [b, s] (fp32) when `labels` is given, else logits [b, s, V]
        over the tokenizer's vocabulary (TP-gathered, padding cut). `recurrences`/`grad_recurrences`
        come from the depth sampler in training; `noise_seeds` key each sample's training noise.
        `document_ids` ([b, s], `layers.document_ids_of`): attention stays within each packed document."""
        s = tokens.shape[1]
        if s > self.config.max_sequence_length:
            raise ValueError(f"sequence of {s} tokens exceeds model.max_sequence_length="
                             f"{self.config.max_sequence_length}")
        hidden = self.embed(tokens)
        rope = self.rotary_pos_emb(s) if self.rotary_pos_emb is not None else None
        mask = attention_mask_of(self.config, document_ids)
        if self.exit_head is not None:
            return self.looped_forward(hidden, mask, rope, labels, recurrences, noise_seeds)
        hidden = self.block(hidden, mask, rope, recurrences=recurrences, grad_recurrences=grad_recurrences,
                            noise_seeds=noise_seeds)
        logits = self.logits(self.final_norm(hidden))
        if labels is not None:
            loss = vocab_parallel_loss(logits, labels, self.fused_loss)
            aux = self.block.aux_loss
            if self.training and aux is not None:
                # MoR's router loss, spread over the tokens so that the mean loss carries it once.
                loss = loss + self.config.router_aux_loss_coeff * aux
            return loss
        return self._gathered(logits)

    def looped_forward(self, hidden, mask, rope, labels, recurrences, noise_seeds) -> torch.Tensor:
        """Ouro (ouro.py): the loss or logits of every step's state, weighted or chosen by the exit head.

        Each step's logits exist one at a time: its cross-entropy is computed under activation
        checkpointing (only the normed state is kept; the logits are recomputed in backward), so R steps
        never hold R × [b, s, V] logits. Evaluation at the last step skips the other steps' heads."""
        if self.exit_rule not in EXIT_RULES:
            raise ValueError(f"exit_rule={self.exit_rule!r} is not one of {', '.join(EXIT_RULES)}")
        every_step = self.training or self.exit_rule == "threshold"
        exit_logits, per_step, normed = [], [], None
        for out in self.block.step_outputs(hidden, mask, rope, recurrences=recurrences, noise_seeds=noise_seeds):
            normed = self.final_norm(out)
            if not every_step:
                continue
            exit_logits.append(self.exit_head(normed).squeeze(-1).float().transpose(0, 1))  # [b, s]
            if labels is None:
                per_step.append(self.logits(normed))
            elif torch.is_grad_enabled():
                per_step.append(torch.utils.checkpoint.checkpoint(
                    self._step_loss, normed, labels, use_reentrant=False))
            else:
                per_step.append(self._step_loss(normed, labels))
        if not every_step:  # a fixed R: the last step, as every other model is scored
            return self._step_loss(normed, labels) if labels is not None else self._gathered(self.logits(normed))
        log_p = exit_log_probs(torch.stack(exit_logits))  # [R, b, s]
        if self.training:
            if labels is None:
                raise ValueError("an Ouro model trains with labels (its loss weights every step's)")
            return looped_loss(torch.stack(per_step), log_p, self.config.exit_entropy_coeff)
        steps = exit_steps(log_p, self.config.exit_threshold)  # [b, s]
        if self.exit_stats is not None:
            self.exit_stats.add(log_p, steps)
        if labels is not None:
            return torch.stack(per_step).gather(0, steps[None]).squeeze(0)
        logits = torch.stack(per_step)  # [R, s, b, V/TP]
        index = steps.transpose(0, 1)[None, :, :, None].expand(1, *logits.shape[1:])
        return self._gathered(logits.gather(0, index).squeeze(0))

    def _step_loss(self, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_loss(self.logits(normed), labels, self.fused_loss)

    def _gathered(self, logits: torch.Tensor) -> torch.Tensor:
        """[s, b, V/TP] -> [b, s, vocab]: TP-gathered, padding cut."""
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits[..., : self.config.vocab_size].transpose(0, 1).contiguous()
