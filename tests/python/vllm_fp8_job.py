"""A block-FP8 vLLM engine follows a BF16 trainer, for tests/python/test_vllm_fp8.py.

vLLM's FP8 GEMM kernels do not run on every CPU (block FP8 needs AMX), so
the engine here is vLLM's own model, built and loaded by vLLM's own model
loader from a block-FP8 checkpoint (its FP8 weight loading, scale handling
and post-load processing), with only the GEMM kernel left out: no forward
pass runs. The dcr backend's worker engine (``DcrWeightTransferEngine``) is
created on it in this process, as vLLM's worker creates it, joins the run
and reaches each version through ``receive_weights``.

The trainer (a transformers Qwen3 or Qwen3-MoE with hidden sizes that are
multiples of 128, real AdamW steps) publishes BF16 with
``dcr.ShardPublisher``; a BF16 receiver follows the same run beside the FP8
engine. Version 2 also zeroes a 128 x 128 block of one weight, version 3
triples another block (its amax changes), and version 2's first attempt
fails after every receiver acked it (``acked:2``): the engines hold a
version that was not committed, and the retry overwrites it.

After every version, the engine's parameters (load form, every E4M3 weight
and scale) are compared with a fresh load, through the model's own loader,
of the block-FP8 checkpoint made from the trainer's BF16 checkpoint of that
version (``dcr.quantize_fp8_blocks``: DeepSeek-V3's ``weight_scale_inv``
convention); after the last, the live parameters are compared with a second
vLLM model loaded from that checkpoint by vLLM's model loader. What it saw
is written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from vllm_job import make_model, train_step  # noqa: E402

BLOCK = 128
# Every linear dimension a multiple of 128 (block FP8): q 256, k and v 128, MLP 384, experts 128.
SIZES = dict(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=128, moe_intermediate_size=128)


def checkpoint_tensors(model) -> dict:
    """The trainer's tensors in checkpoint coordinates (the names and shapes
    ``save_pretrained`` writes, as views of the live parameters):
    transformers 5 holds a Qwen3-MoE's experts fused ([E, 2I, H] gate and
    up, [E, H, I] down) and saves them per expert."""
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = p.data[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = p.data[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = p.data[e]
        else:
            out[name] = p.data
    return out


def trainer_sender(model) -> tuple:
    """The trainer as one sender: its parameters as buffers, and the map of
    the checkpoint's tensors (checkpoint_tensors) onto them."""
    from dcr.trace import _box

    params = {n: p.data for n, p in model.named_parameters()}
    by_storage = {p.untyped_storage().data_ptr(): n for n, p in params.items()}
    tensors, copies = [], []
    for name, view in checkpoint_tensors(model).items():
        buf = by_storage[view.untyped_storage().data_ptr()]
        at = _box(view, params[buf])  # the view's offset in its parameter
        assert at is not None, f"{name} is not a box of {buf}"
        tensors.append({"name": name, "dtype": "BF16", "shape": list(view.shape)})
        copies.append({"tensor": name, "offset": [0] * view.dim(), "extent": list(view.shape), "buffer": buf,
                       "buffer_offset": at})
    buffers = [{"id": n, "dtype": "BF16", "shape": list(p.shape)} for n, p in params.items()]
    return params, {"format": "dcr-layout", "format_version": 1, "tensors": tensors, "buffers": buffers,
                    "copies": copies}


def quantized(name: str) -> bool:
    """The tensors a block-FP8 checkpoint holds in E4M3: every projection
    (attention, MLP, experts); not embeddings, norms or the MoE router."""
    return name.endswith("_proj.weight")


def save_fp8_checkpoint(model, bf16_dir: str, fp8_dir: str) -> None:
    """The trainer's BF16 checkpoint (``save_pretrained``) and the block-FP8
    checkpoint made from it, as DeepSeek-V3's are laid out: each projection
    in E4M3 with an F32 ``weight_scale_inv`` per 128 x 128 block, and a
    ``quantization_config`` vLLM reads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import dcr

    model.save_pretrained(bf16_dir)
    os.makedirs(fp8_dir, exist_ok=True)
    for f in sorted(os.listdir(bf16_dir)):
        src = os.path.join(bf16_dir, f)
        if f.endswith(".safetensors"):
            out = {}
            with safe_open(src, framework="pt") as st:
                for k in st.keys():
                    t = st.get_tensor(k)
                    if quantized(k):
                        out[k], out[k[: -len("weight")] + "weight_scale_inv"] = dcr.quantize_fp8_blocks(t, BLOCK)
                    else:
                        out[k] = t
            save_file(out, os.path.join(fp8_dir, f), metadata={"format": "pt"})
        elif f == "config.json":
            with open(src) as fh:
                cfg = json.load(fh)
            routers = [f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])]
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [BLOCK, BLOCK],
                                          "modules_to_not_convert": ["lm_head", *routers]}
            with open(os.path.join(fp8_dir, f), "w") as fh:
                json.dump(cfg, fh)
        elif f.endswith(".json"):
            with open(src) as fh, open(os.path.join(fp8_dir, f), "w") as out_f:
                out_f.write(fh.read())


def without_fp8_gemm() -> None:
    """vLLM's FP8 layers as they are, less the GEMM kernel (which this CPU
    may not have): kernel selection returns a kernel whose weight processing
    keeps the weights as loaded and whose forward pass refuses to run."""
    import vllm.model_executor.layers.quantization.fp8 as fp8

    class NoGemm:
        def process_weights_after_loading(self, layer) -> None:
            pass

        def apply_weights(self, *args, **kwargs):
            raise RuntimeError("no FP8 GEMM kernel in this test")

    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does (no accelerator to empty)
    fp8.init_fp8_linear_kernel = lambda **kwargs: NoGemm()
    fp8.select_fp8_moe_backend = lambda **kwargs: (None, None)
    fp8.Fp8MoEMethod._setup_kernel = lambda self, layer, *args: None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(model_dir: str):
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
                      max_num_seqs=4, enforce_eager=True, seed=0,
                      weight_transfer_config=WeightTransferConfig(backend="dcr")).create_engine_config()


def load_vllm_model(config):
    """vLLM's model loader (safetensors, FP8 weight loaders, post-load processing)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    with set_current_vllm_config(config), torch.device("cpu"):
        return get_model_loader(config.load_config).load_model(vllm_config=config, model_config=config.model_config)


def digests(named) -> dict:
    import hashlib

    import torch

    return {n: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for n, t in named}


def checkpoint_weights(d: str):
    from safetensors import safe_open

    for f in sorted(x for x in os.listdir(d) if x.endswith(".safetensors")):
        with safe_open(os.path.join(d, f), framework="pt") as st:
            for k in st.keys():
                yield k, st.get_tensor(k)


def edit_blocks(model, step: int) -> dict:
    """Version 2 zeroes a block of the first layer's attention output
    projection (a block that becomes all zeros); version 3 triples another
    (its amax changes). Returns the edited block."""
    import torch

    w = model.model.layers[0].self_attn.o_proj.weight
    with torch.no_grad():
        if step == 2:
            w[:BLOCK, :BLOCK] = 0
            return {"block": [0, 0]}
        if step == 3:
            w[BLOCK:2 * BLOCK, :BLOCK] *= 3
            return {"block": [1, 0]}
    return {}


def in_thread(fn) -> tuple:
    """Starts ``fn`` on a thread; returns (thread, list receiving its result or exception)."""
    result: list = []

    def body():
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported through `result`
            result.append(e)
    t = threading.Thread(target=body)
    t.start()
    return t, result


def run(a) -> dict:
    import torch
    from safetensors import safe_open
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    import dcr
    import dcr.vllm as dv

    model = make_model(a.family, **SIZES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    save_fp8_checkpoint(model, os.path.join(a.work, "bf16-v0"), os.path.join(a.work, "fp8-v0"))
    without_fp8_gemm()
    config = engine_config(os.path.join(a.work, "fp8-v0"))
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    engine_model = load_vllm_model(config)

    store = dcr.open_store(a.store)
    trainer = checkpoint_tensors(model)
    with safe_open(os.path.join(a.work, "bf16-v0", "model.safetensors"), framework="pt") as st:
        assert sorted(st.keys()) == sorted(trainer), "the run is not in the checkpoint's coordinates"
    pub = dcr.ShardPublisher(store, os.path.join(a.work, "trainer"), [trainer_sender(model)], ack_timeout_s=120,
                             inject_failures=["acked:2"])
    pub.publish_snapshot(trainer)

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    dv.register()
    engine = WeightTransferEngineFactory.create_engine(config.weight_transfer_config, config,
                                                       torch.device("cpu"), engine_model)
    with set_current_vllm_config(config):
        engine.init_transfer_engine(engine.parse_init_info({"store": a.store, "engine": "fp8",
                                                            "state_dir": os.path.join(a.work, "engine"),
                                                            "poll_s": 0.02}))
    out: dict = {"join": engine.join_report(), "versions": []}

    # A BF16 engine of the same run: the trainer's tensors, following beside the FP8 engine.
    bf16 = {n: torch.zeros_like(t) for n, t in trainer.items()}
    bf16_rx = dcr.Receiver(bf16)
    bf16_thread, bf16_result = in_thread(lambda: bf16_rx.follow(store, os.path.join(a.work, "bf16"), engine="bf16",
                                                                until=a.steps, timeout_s=600, poll_s=0.02))
    def bf16_joined() -> bool:
        """The BF16 engine holds version 0, verified (its record says when): registered is not enough."""
        if not any(key == "receivers/bf16-r0.json" for key, *_ in store.list("receivers/")):
            return False
        return json.loads(store.get("receivers/bf16-r0.json")).get("verified_at", 0) > 0

    deadline = time.monotonic() + 120  # a guard only: the publishes below wait for both engines
    while len(store.list("receivers/")) < 2 or not bf16_joined():
        assert bf16_thread.is_alive() and time.monotonic() < deadline, bf16_result
        time.sleep(0.01)

    def check(v: int, report: dict, edit: dict) -> dict:
        fp8_dir = os.path.join(a.work, f"fp8-v{v}")
        form = dv._LoadForm(engine_model)
        form.load(checkpoint_weights(fp8_dir))
        fresh = form.digests()
        return {"version": v, "engine": engine.load_form_digests(), "fresh": fresh,
                "bf16_same": all(torch.equal(bf16[n].view(torch.int16), trainer[n].view(torch.int16)) for n in bf16),
                "report": {k: report.get(k) for k in ("attempts", "acked", "frame_bytes", "total_bytes")},
                "edit": edit, "blocks": edited_blocks(engine_model)}

    def edited_blocks(m) -> list:
        """The live engine's edited blocks ([0, 0], [1, 0] of the first o_proj):
        each block's scale and whether its E4M3 bytes are all zero."""
        o_proj = m.model.layers[0].self_attn.o_proj
        w, s = o_proj.weight.view(torch.uint8), o_proj.weight_scale_inv
        return [{"scale": float(s[r, 0]), "zero_bytes": bool((w[r * BLOCK:(r + 1) * BLOCK, :BLOCK] == 0).all())}
                for r in (0, 1)]

    out["versions"].append(check(0, {}, {}))
    for step in range(1, a.steps + 1):
        train_step(model, optimizer, step)
        edit = edit_blocks(model, step)
        save_fp8_checkpoint(model, os.path.join(a.work, f"bf16-v{step}"), os.path.join(a.work, f"fp8-v{step}"))
        t, reached = in_thread(lambda: engine.receive_weights(engine.parse_update_info(
            {"version": step, "timeout_s": 300})))
        report = pub.publish(step)
        t.join(300)  # a guard only: publish returned once the engine acked
        assert reached == [None] and engine.version == step, (reached, engine.version)
        out["versions"].append(check(step, report, edit))
        print(f"version {step}: attempts {report.get('attempts')}, frames {report.get('frame_bytes')} bytes",
              flush=True)
    bf16_thread.join(300)
    out["bf16_result"] = repr(bf16_result)
    records = [json.loads(store.get(key)) for key, _, _ in store.list("receivers/")]
    out["receivers"] = {r["id"]: r for r in records}
    # The reference engine: vLLM's model loader on the last version's FP8 checkpoint.
    fresh_model = load_vllm_model(engine_config(os.path.join(a.work, f"fp8-v{a.steps}")))
    out["live"] = digests(engine_model.named_parameters())
    out["fresh_live"] = digests(fresh_model.named_parameters())
    out["total_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--family", choices=["qwen3", "qwen3-moe"], default="qwen3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    a = p.parse_args()
    start = time.monotonic()
    out = run(a)
    out["seconds"] = time.monotonic() - start
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
