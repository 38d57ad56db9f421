"""transformers models refit through dcr's Python package. A tiny, randomly
initialised Llama trains for a few AdamW steps in BF16; after each step its
live parameters are diffed against the sender's baseline and applied in place
into a second copy laid out the way vLLM lays it out (fused qkv_proj and
gate_up_proj), loaded by a small vLLM-style loader. Every parameter of that
copy must equal, byte for byte, a dense load of the trainer's weights through
the same loader. The same for tiny Qwen3-MoE and DeepSeek-V3 models (stacked
experts, MLA's fused q_a / kv_a projection) published through a sender map,
and for a receiver process killed between two versions that rejoins. No
downloads: models are built from configs.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

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


def test_trace_counts_only_writes_that_overlap_a_copy_and_follow_it():
    # vLLM's vocab-parallel loader: copy the rank's rows, then zero the rest
    # of the padded parameter (an empty slice when there is no padding).
    w = {"emb": torch.arange(24, dtype=torch.float32).reshape(6, 4), "other": torch.ones(3)}
    for padded in (6, 8):
        params = {"p": torch.full((padded, 4), 7.0), "q": torch.zeros(3)}

        def loader(weights):
            for name, t in weights:
                if name == "emb":
                    params["p"][: t.shape[0]].data.copy_(t)
                    params["p"][t.shape[0]:].data.fill_(0)
                else:
                    params["q"].fill_(5)  # before the copy: the copy holds the final bits
                    params["q"].copy_(t)

        layout, residuals = record_layout(params, loader, w)
        assert residuals == [], padded
        assert {c["tensor"] for c in layout["copies"]} == {"emb", "other"}
        assert torch.equal(params["p"][6:], torch.zeros(padded - 6, 4))

    # A write after the copy into its region: residual; next to it: not.
    params = {"p": torch.zeros(8, 4)}

    def clobbering(weights):
        for _, t in weights:
            params["p"][:6].copy_(t)
            params["p"][5:7].mul_(2)

    layout, residuals = record_layout(params, clobbering, {"emb": w["emb"]})
    assert residuals == ["emb"] and layout["copies"] == []


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


# ---------------------------------------------------------------- MoE and MLA
#
# transformers holds a layer's routed experts stacked ([E, 2I, H] gate then
# up, and [E, H, I]); the checkpoint format (and dcr's canonical tensors) has
# one tensor per expert, as the Hub's Qwen3-MoE and DeepSeek-V3 files do. The
# trainer publishes through a *sender* map (canonical expert boxes of its
# stacked buffers); the engine is vLLM-shaped (fused qkv / gate_up, experts
# stacked as w13 = gate then up, and w2; DeepSeek's fused_qkv_a_proj = q_a_proj
# then kv_a_proj_with_mqa), loaded by a vLLM-style loader, and its receiver
# map is recorded from that loader.

def tiny_moe(family):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=32, tie_word_embeddings=False, num_experts_per_tok=2)
    if family == "qwen3-moe":
        cfg = transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=16, num_experts=4, decoder_sparse_step=1,
                                          **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                                            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                                            topk_group=1, **common)
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).to(torch.bfloat16), cfg


def expert_count(cfg):
    return getattr(cfg, "num_experts", None) or cfg.n_routed_experts


def canonical_boxes(trainer: dict, cfg):
    """The checkpoint tensors as boxes of the trainer's parameters:
    name -> (trainer parameter, first index along dim 0 (an expert) or None, row, rows)."""
    boxes = {}
    w = cfg.moe_intermediate_size
    for name, t in trainer.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                boxes[f"{pre}{e}.gate_proj.weight"] = (name, e, 0, w)
                boxes[f"{pre}{e}.up_proj.weight"] = (name, e, w, w)
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                boxes[f"{pre}{e}.down_proj.weight"] = (name, e, 0, t.shape[1])
        else:
            boxes[name] = (name, None, 0, t.shape[0])
    return dict(sorted(boxes.items()))


def export(trainer: dict, boxes: dict) -> dict:
    """The checkpoint of the trainer's current weights (copies: one storage each)."""
    out = {}
    for name, (src, e, row, rows) in boxes.items():
        t = trainer[src] if e is None else trainer[src][e]
        out[name] = t.narrow(0, row, rows).clone()
    return out


def sender_layout(trainer: dict, boxes: dict) -> dict:
    tensors, copies = [], []
    for name, (src, e, row, rows) in boxes.items():
        shape = [rows] + list(trainer[src].shape[(1 if e is None else 2):])
        tensors.append({"name": name, "dtype": "BF16", "shape": shape})
        boff = [row] + [0] * (len(shape) - 1)
        copies.append({"tensor": name, "offset": [0] * len(shape), "extent": shape, "buffer": src,
                       "buffer_offset": boff if e is None else [e] + boff})
    buffers = [{"id": n, "dtype": "BF16", "shape": list(t.shape)} for n, t in trainer.items()]
    return {"format": "dcr-layout", "format_version": 1, "tensors": tensors, "buffers": buffers, "copies": copies}


class VllmMoeParams:
    """A vLLM-shaped engine for the tiny Qwen3-MoE / DeepSeek-V3 and its loader
    (vLLM's stacked_params_mapping and expert_params_mapping, in miniature)."""

    def __init__(self, canonical_shapes: dict, cfg):
        self.cfg = cfg
        w = cfg.moe_intermediate_size
        e_count = expert_count(cfg)
        p = {}
        bf = dict(dtype=torch.bfloat16)
        for name, shape in canonical_shapes.items():
            pname, rows = self.target(name)[0], shape[0]
            if ".experts." in name and ".shared_experts." not in name:
                if pname.endswith("w13_weight"):
                    p.setdefault(pname, torch.zeros(e_count, 2 * w, shape[1], **bf))
                else:
                    p.setdefault(pname, torch.zeros(e_count, shape[0], w, **bf))
                continue
            total = sum(s[0] for n, s in canonical_shapes.items() if self.target(n)[0] == pname)
            p.setdefault(pname, torch.zeros([total] + list(shape[1:]), **bf))
            assert rows <= total
        self.params = dict(sorted(p.items()))

    def target(self, name):
        """(parameter, expert or None, first row) that checkpoint tensor ``name`` is loaded into."""
        cfg = self.cfg
        m = re.search(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m and ".shared_experts." not in name:
            pre = name[: m.start()] + ".experts."
            e, part = int(m.group(1)), m.group(2)
            if part == "down":
                return pre + "w2_weight", e, 0
            return pre + "w13_weight", e, 0 if part == "gate" else cfg.moe_intermediate_size
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            hd = cfg.head_dim
            q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
            row = {"q": 0, "k": q, "v": q + kv}[name.split(".self_attn.")[1][0]]
            return re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name), None, row
        if ".self_attn.q_a_proj." in name:
            return name.replace("q_a_proj", "fused_qkv_a_proj"), None, 0
        if ".self_attn.kv_a_proj_with_mqa." in name:
            return name.replace("kv_a_proj_with_mqa", "fused_qkv_a_proj"), None, cfg.q_lora_rank
        m = re.search(r"\.(gate|up)_proj\.weight$", name)
        if m:  # a dense MLP or the shared experts
            rows = cfg.moe_intermediate_size if ".shared_experts." in name else cfg.intermediate_size
            return name[: m.start()] + ".gate_up_proj.weight", None, 0 if m.group(1) == "gate" else rows
        return name, None, 0

    def load_weights(self, weights):
        for name, w in weights:
            pname, e, row = self.target(name)
            param = self.params[pname]
            dst = param if e is None else param[e]
            dst.narrow(0, row, w.shape[0]).copy_(w)


def optimizer_step(model, cfg, opt, gen):
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", ["xor", "overwrite"])
@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_moe_and_mla_refit_into_vllm_layout_equals_a_dense_load(family, mode):
    model, cfg = tiny_moe(family)
    trainer = {n: p.data for n, p in model.named_parameters()}
    boxes = canonical_boxes(trainer, cfg)
    v0 = export(trainer, boxes)
    shapes = {n: list(t.shape) for n, t in v0.items()}
    engine = VllmMoeParams(shapes, cfg)
    fused = [n for n in engine.params if "w13_weight" in n or "fused_qkv_a_proj" in n or "qkv_proj" in n]
    assert any("w13_weight" in n for n in fused) and any("w2_weight" in n for n in engine.params)
    if family == "deepseek-v3":
        assert any("fused_qkv_a_proj" in n for n in fused)
    layout, residuals = record_layout(engine.params, engine.load_weights, v0)
    assert residuals == []
    # Every expert went into its slot of the stack: the recorded box names the expert.
    w13 = [c for c in layout["copies"] if c["buffer"].endswith("w13_weight")]
    assert len(w13) == 2 * expert_count(cfg) * sum(1 for n in engine.params if n.endswith("w13_weight"))
    assert sorted({c["buffer_offset"][0] for c in w13}) == list(range(expert_count(cfg)))
    ptrs = {n: p.data_ptr() for n, p in engine.params.items()}

    sender = dcr.Sender(trainer, layout=sender_layout(trainer, boxes))
    receiver = dcr.Receiver(engine.params, layout)
    assert receiver.digest() == sender.baseline_digest()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        optimizer_step(model, cfg, opt, gen)
        delta = sender.make_delta(mode=mode, chunk_elements=512)
        assert delta.changed_words > 0
        receiver.apply(delta)
        assert receiver.digest() == delta.target_digest
        dense = VllmMoeParams(shapes, cfg)
        dense.load_weights(export(trainer, boxes).items())
        for n, p in engine.params.items():
            assert torch.equal(bits(p), bits(dense.params[n])), f"{family} step {step}: {n} differs from a dense load"
            assert p.data_ptr() == ptrs[n], f"{n} was replaced, not updated in place"
        sender.commit(delta)


FOLLOWER = """
import sys, dcr
store = dcr.open_store(sys.argv[1])
until = int(sys.argv[3]) if len(sys.argv) > 3 else None
fol = dcr.Follower(store, sys.argv[2], id="rx-engine", poll_s=0.02, quiet=False)  # logs to stderr
fol.run(until=until, timeout_s=60, on_version=lambda v: print("version", v, flush=True))
"""


def test_a_killed_receiver_process_rejoins_and_loads_like_a_dense_load(tmp_path):
    """Publisher and Follower over checkpoint files: the receiver's process is
    SIGKILLed after version 1, a new process reopens its target (journal and
    all) and catches up; the target, loaded through the vLLM-style loader,
    equals a dense load of the trainer's weights."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    model, cfg = tiny_moe("qwen3-moe")
    trainer = {n: p.data for n, p in model.named_parameters()}
    boxes = canonical_boxes(trainer, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(3)

    def save(v):
        (tmp_path / f"v{v}").mkdir()
        save_file(export(trainer, boxes), str(tmp_path / f"v{v}" / "model.safetensors"))

    save(0)
    store = dcr.open_store(f"file://{tmp_path}/store")
    pub = dcr.Publisher(store, tmp_path / "state", ack_timeout_s=2, heartbeat_timeout_s=1, chunk_elements=512)
    pub.publish(0, tmp_path / "v0")
    target = tmp_path / "engine"

    def start(*extra):
        return subprocess.Popen([sys.executable, "-c", FOLLOWER, store.url, str(target), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start()
    try:
        optimizer_step(model, cfg, opt, gen)
        save(1)
        pub.publish(1, tmp_path / "v1")
        line = first.stdout.readline()
        assert line.strip() == "version 1", line + (first.stderr.read() if first.poll() is not None else "")
        first.send_signal(signal.SIGKILL)  # between two steps: no chance to record its stop
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    optimizer_step(model, cfg, opt, gen)
    save(2)
    pub.publish(2, tmp_path / "v2")  # the dead receiver is retired, the version commits

    second = start("3")
    try:
        optimizer_step(model, cfg, opt, gen)
        save(3)
        pub.publish(3, tmp_path / "v3")
        out, err = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode == 0, err
    # It reopened the killed receiver's target at version 1 (no new join) and caught up.
    assert "joining from the snapshot" not in err and "at version 2 (attempt" in err, err
    assert out.split() == ["version", "1", "version", "2", "version", "3"], out + err

    ck = dcr.Checkpoint.open(target)
    shapes = {n: list(t.shape) for n, t in export(trainer, boxes).items()}
    engine, dense = VllmMoeParams(shapes, cfg), VllmMoeParams(shapes, cfg)
    engine.load_weights((n, ck.tensor(n)) for n in ck.names())
    dense.load_weights(export(trainer, boxes).items())
    assert sorted(ck.names()) == sorted(boxes)
    for n, p in engine.params.items():
        assert torch.equal(bits(p), bits(dense.params[n])), f"{n}: the rejoined receiver differs from a dense load"


# ---------------------------------------------------------------- residuals

class ConvertingLlamaParams(FusedLlamaParams):
    """A vLLM-style engine that converts on load: norms held zero-centred
    (weight - 1, as Gemma-style kernels take them) and lm_head requantized to
    FP8 with a per-tensor scale. Plus derived state a post-update hook keeps:
    per layer, the product o_proj @ v-part of qkv_proj (an "absorbed" weight,
    as MLA runtimes precompute)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.params["lm_head.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=torch.float8_e4m3fn)
        self.scale = torch.zeros((), dtype=torch.float32)
        self.layers = cfg.num_hidden_layers
        self.absorbed = {}

    def load_weights(self, weights):
        for name, w in weights:
            pname, row = self.target(name)
            dst = self.params[pname].narrow(0, row, w.shape[0])
            if name.endswith("norm.weight"):
                dst.copy_(w.float() - 1)
            elif name == "lm_head.weight":
                self.scale.copy_(w.float().abs().max() / 448)
                dst.copy_((w.float() / self.scale).to(torch.float8_e4m3fn))
            else:
                dst.copy_(w)

    def rederive(self, report=None):
        """o_proj's first kv columns times the v rows of qkv_proj, per layer."""
        for layer in range(self.layers):
            pre = f"model.layers.{layer}.self_attn."
            v = self.params[pre + "qkv_proj.weight"][self.q + self.kv:]
            o = self.params[pre + "o_proj.weight"]
            self.absorbed[layer] = o.float()[:, : self.kv] @ v.float()


def raw(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("mode", ["xor", "overwrite"])
def test_residuals_go_through_the_real_loader_and_the_hook_rederives(mode):
    model, cfg = tiny_llama()
    live = {n: p.data for n, p in model.named_parameters()}
    engine = ConvertingLlamaParams(cfg)
    layout, residuals = record_layout(engine.params, engine.load_weights, live)
    want = sorted(n for n in live if n.endswith("norm.weight")) + ["lm_head.weight"]
    assert residuals == sorted(want)
    engine.rederive()

    hooked = []

    def post_update(report):
        engine.rederive(report)
        hooked.append(report["residuals_loaded"])

    with pytest.raises(dcr.InvalidArgumentError, match="residuals maps"):
        dcr.Receiver(engine.params, layout, residuals=residuals, loader=engine.load_weights)
    sender = dcr.Sender(live)
    receiver = dcr.Receiver(engine.params, layout, residuals={n: live[n] for n in residuals},
                            loader=engine.load_weights, post_update=post_update)
    assert receiver.digest() == sender.baseline_digest()  # residuals included, from their copies
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        delta = sender.make_delta(mode=mode, chunk_elements=256)
        report = receiver.apply(delta)
        assert receiver.digest() == delta.target_digest
        assert "lm_head.weight" in report["residuals_loaded"] and set(report["residuals_loaded"]) <= set(residuals)
        assert hooked[-1] == report["residuals_loaded"] and len(hooked) == step + 1

        dense = ConvertingLlamaParams(cfg)
        dense.load_weights((n, p.detach()) for n, p in model.named_parameters())
        dense.rederive()
        for n, p in engine.params.items():
            assert torch.equal(raw(p), raw(dense.params[n])), f"step {step}: {n} differs from a dense load"
        assert torch.equal(raw(engine.scale), raw(dense.scale)), f"step {step}: the FP8 scale differs"
        for layer, a in dense.absorbed.items():
            assert torch.equal(engine.absorbed[layer], a), f"step {step}: absorbed weight of layer {layer} is stale"
        sender.commit(delta)
