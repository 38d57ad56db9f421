"""A transformers model refit through dcr's Python package: a tiny, randomly
initialised Llama trains for a few AdamW steps in BF16; after each step its
live parameters are diffed against the sender's baseline and applied in place
into a second copy laid out the way vLLM lays it out (fused qkv_proj and
gate_up_proj), loaded by a small vLLM-style loader. Every parameter of that
copy must equal, byte for byte, a dense load of the trainer's weights through
the same loader. No downloads: models are built from configs.
"""

from __future__ import annotations

import json

import pytest
import torch

import dcr
from dcr.trace import record_layout

transformers = pytest.importorskip("transformers")

# vLLM's stacked_params_mapping: (fused parameter, checkpoint part, shard id).
STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16), cfg


class FusedLlamaParams:
    """The parameters of a vLLM-style Llama (fused, by vLLM's names) and its loader."""

    def __init__(self, cfg):
        h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.q, self.kv, self.i = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, i
        bf = dict(dtype=torch.bfloat16)
        p = {"model.embed_tokens.weight": torch.zeros(cfg.vocab_size, h, **bf),
             "model.norm.weight": torch.zeros(h, **bf), "lm_head.weight": torch.zeros(cfg.vocab_size, h, **bf)}
        for layer in range(cfg.num_hidden_layers):
            pre = f"model.layers.{layer}."
            p[pre + "self_attn.qkv_proj.weight"] = torch.zeros(self.q + 2 * self.kv, h, **bf)
            p[pre + "self_attn.o_proj.weight"] = torch.zeros(h, self.q, **bf)
            p[pre + "mlp.gate_up_proj.weight"] = torch.zeros(2 * i, h, **bf)
            p[pre + "mlp.down_proj.weight"] = torch.zeros(h, i, **bf)
            p[pre + "input_layernorm.weight"] = torch.zeros(h, **bf)
            p[pre + "post_attention_layernorm.weight"] = torch.zeros(h, **bf)
        self.params = p

    def shard_rows(self, shard):
        return {"q": (0, self.q), "k": (self.q, self.kv), "v": (self.q + self.kv, self.kv),
                0: (0, self.i), 1: (self.i, self.i)}[shard]

    def target(self, name):
        """(parameter name, first row) a checkpoint tensor is loaded into."""
        for fused, part, shard in STACKED:
            if f".{part}." in name:
                return name.replace(part, fused), self.shard_rows(shard)[0]
        return name, 0

    def load_weights(self, weights):
        """vLLM-style: narrow the fused parameter, copy_ the checkpoint tensor in."""
        for name, w in weights:
            pname, row = self.target(name)
            param = self.params[pname]
            param.narrow(0, row, w.shape[0]).copy_(w)

    def layout(self, canonical: dict) -> dict:
        """The receiver layout map of this loader: one box per checkpoint tensor."""
        tensors, copies = [], []
        for name, t in canonical.items():
            shape = list(t.shape)
            pname, row = self.target(name)
            tensors.append({"name": name, "dtype": "BF16", "shape": shape})
            copies.append({"tensor": name, "offset": [0] * len(shape), "extent": shape, "buffer": pname,
                           "buffer_offset": [row] + [0] * (len(shape) - 1)})
        buffers = [{"id": n, "dtype": "BF16", "shape": list(p.shape)} for n, p in self.params.items()]
        return {"format": "dcr-layout", "format_version": 1, "tensors": tensors, "buffers": buffers, "copies": copies}


def bits(t):
    return t.detach().view(torch.int16)


def canonical_copies(layout):
    return sorted(json.dumps(c, sort_keys=True) for c in json.loads(dcr.validate_layout(layout))["copies"])


def test_traced_loader_records_the_fused_layout_and_flags_conversions():
    model, cfg = tiny_llama()
    live = {n: p.data for n, p in model.named_parameters()}
    engine = FusedLlamaParams(cfg)
    layout, residuals = record_layout(engine.params, engine.load_weights, live)
    assert residuals == []
    assert canonical_copies(layout) == canonical_copies(engine.layout(live))
    # The loader really ran: the parameters hold the weights.
    dense = FusedLlamaParams(cfg)
    dense.load_weights(live.items())
    assert all(torch.equal(bits(engine.params[n]), bits(p)) for n, p in dense.params.items())

    # A loader that converts some tensors: those are residuals, the rest still boxes.
    def converting_loader(weights):
        for name, w in weights:
            pname, row = engine.target(name)
            dst = engine.params[pname].narrow(0, row, w.shape[0])
            if name.endswith("norm.weight"):
                dst.copy_(w.float() + 1)  # arithmetic (a Gemma-style norm offset)
            elif name == "lm_head.weight":
                dst.copy_(w)
                dst.mul_(2)  # touched after the copy
            else:
                dst.copy_(w)

    layout2, residuals2 = record_layout(engine.params, converting_loader, live)
    want = sorted(n for n in live if n.endswith("norm.weight")) + ["lm_head.weight"]
    assert residuals2 == sorted(want)
    assert {c["tensor"] for c in layout2["copies"]} == set(live) - set(want)
    dcr.validate_layout(layout2)


@pytest.mark.parametrize("layout_from", ["handwritten", "traced"])
@pytest.mark.parametrize("mode", ["xor", "overwrite"])
def test_llama_refit_into_fused_layout_equals_a_dense_load(mode, layout_from):
    model, cfg = tiny_llama()
    live = {n: p.data for n, p in model.named_parameters()}
    engine = FusedLlamaParams(cfg)
    if layout_from == "traced":  # the loader loads version 0 while it is recorded
        layout, residuals = record_layout(engine.params, engine.load_weights, live)
        assert residuals == []
    else:
        layout = engine.layout(live)
        engine.load_weights(live.items())  # version 0, dense
    ptrs = {n: p.data_ptr() for n, p in engine.params.items()}

    sender = dcr.Sender(live)
    receiver = dcr.Receiver(engine.params, layout)
    assert receiver.digest() == sender.baseline_digest()

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    fractions = []
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

        delta = sender.make_delta(mode=mode, chunk_elements=256)
        fractions.append(delta.changed_words / sum(p.numel() for p in live.values()))
        report = receiver.apply(delta)
        assert report["frames_applied"] == delta.frame_count > 0
        assert receiver.digest() == delta.target_digest

        dense = FusedLlamaParams(cfg)
        dense.load_weights(((n, p.detach()) for n, p in model.named_parameters()))
        for n, p in engine.params.items():
            assert torch.equal(bits(p), bits(dense.params[n])), f"step {step}: {n} differs from a dense load"
            assert p.data_ptr() == ptrs[n], f"{n} was replaced, not updated in place"
        sender.commit(delta)
    # A real optimizer step changes some elements, not all of them.
    assert all(0 < f < 1 for f in fractions), fractions
