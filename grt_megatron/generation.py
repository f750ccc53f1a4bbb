"""Plain autoregressive sampling from a training model (no KV cache): for demos and quick looks.

Evaluation mode: noise off, the configured R. The Hugging Face export brings the cached version.
"""

from __future__ import annotations

import torch

from grt_megatron.data.tokenizer import Tokenizer


@torch.no_grad()
def sample_text(model, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed: int = 0,
                device: torch.device | str = "cpu", temperature: float = 0.8, top_k: int = 40) -> str:
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    window = model.config.max_sequence_length
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -window:])[:, -1, :].float()
        if temperature <= 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_id], dim=1)
    model.train(was_training)
    new = tokens[0, len(ids):].tolist() if prompt else tokens[0, 1:].tolist()
    return prompt + tokenizer.decode(new)
