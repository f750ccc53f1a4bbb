"""Document attention (`data.reset_attention_mask`): in a row that packs several documents, a token sees its
own document only. Checked the way it can fail: another first document must not change a word of the
second's logits, in every model family (dense, GRT, MoR, Ouro, RRT), and one document equals causal."""

import pytest
import torch
from conftest import REPO, tiny_config
from hydra import compose, initialize_config_dir

from grt_megatron.model import GRTLanguageModel
from grt_megatron.model.layers import document_attention_mask, document_ids_of
from grt_megatron.errors import ConfigError

EOS = 1


def test_document_ids_close_each_document_at_its_eos():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 9, 9, 9, 9, 9, 9]])
    assert document_ids_of(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    mask = document_attention_mask(document_ids_of(tokens, EOS))[0, 0]
    # Position 3 (the second document's first token) attends to itself only; the EOS at 2 to 0, 1, 2.
    assert (~mask[3]).nonzero().flatten().tolist() == [3]
    assert (~mask[2]).nonzero().flatten().tolist() == [0, 1, 2]
    assert (~mask[4]).nonzero().flatten().tolist() == [3, 4]


def _rows(vocab, first=9, second=14, seed=0):
    """Two rows that differ only in their first document (same length), then EOS and one shared document."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(2, vocab, (second,), generator=g)
    rows = [torch.cat([torch.randint(2, vocab, (first,), generator=g), torch.tensor([EOS]), shared]) for _ in range(2)]
    return torch.stack(rows), first + 1


FAMILIES = {
    "dense": dict(gate="none", injection="none", recurrences=1, core_layers=2),
    "grt": dict(),
    "grt_rope": dict(position_embedding="rope"),
    "mor": dict(routing="expert_choice", gate="none", injection="none", depth_sampler="fixed", noise_sigma=0.0),
    "ouro": dict(exit_head=True, gate="none", injection="none", depth_sampler="fixed", noise_sigma=0.0),
    "rrt": dict(lora_rank=4),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_other_documents_do_not_change_a_documents_logits(world, family):
    model = GRTLanguageModel(tiny_config(**FAMILIES[family])).eval()
    rows, start = _rows(model.config.vocab_size)
    with torch.no_grad():
        documents = document_ids_of(rows, EOS)
        packed = model(rows, document_ids=documents)
        causal = model(rows)
    # Document attention: the second document's logits do not depend on the first document's tokens ...
    torch.testing.assert_close(packed[0, start:], packed[1, start:], rtol=0, atol=1e-5)
    # ... while causal attention reads them (so the check above can fail).
    assert (causal[0, start:] - causal[1, start:]).abs().max() > 1e-3
    # The first document (and its EOS) sees nothing else under either mask.
    torch.testing.assert_close(packed[:, :start], causal[:, :start], rtol=0, atol=1e-5)


def test_one_document_is_causal_attention_and_trains(world):
    """All-zero document ids give the causal kernel's numbers (the mask's sense is right), forward and
    backward, GRT with noise on."""
    config = tiny_config()
    tokens = torch.randint(2, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for documents in (None, torch.zeros(2, 16, dtype=torch.long)):
        model = GRTLanguageModel(config).train()
        loss = model(tokens[:, :-1], tokens[:, 1:], noise_seeds=[3, 4], document_ids=documents).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_mor_training_keeps_every_row_finite_with_documents(world):
    """MoR's top-k compacts each row; the document mask is cut down to the kept positions, which may leave a
    real token with only itself to attend to: nothing may become NaN."""
    model = GRTLanguageModel(tiny_config(**FAMILIES["mor"])).train()
    rows = torch.randint(2, 300, (3, 25), generator=torch.Generator().manual_seed(2))
    rows[:, ::3] = EOS  # many short documents
    loss = model(rows[:, :-1], rows[:, 1:], document_ids=document_ids_of(rows[:, :-1], EOS)).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_transformer_engine_spec_refuses_document_masks():
    from grt_megatron.training.config import build_run_config

    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = build_run_config(compose("train", overrides=["model=tiny", "run.dir=unused",
                                                           "data.reset_attention_mask=true"]), world_size=1)
        assert cfg.model_config(300).layer_spec == "local"  # auto resolves to the spec that honours the mask
        cfg = build_run_config(compose("train", overrides=["model=tiny", "run.dir=unused",
                                                           "model.layer_spec=local"]), world_size=1)
    cfg.data.reset_attention_mask = True
    cfg.model["layer_spec"] = "transformer_engine"
    with pytest.raises(ConfigError, match="data.reset_attention_mask=true needs model.layer_spec=local"):
        cfg.model_config(300)
