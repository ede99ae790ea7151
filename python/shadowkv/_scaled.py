"""Model-scaled defaults: the sparse fields (rank, budget, outliers, local window, selection mode)
derived from a model's shape and the context length (docs/DESIGN.md section 2.1).

The rule lives here and only here (SCALING holds its constants): shadowkv.scaled_config and
shadowkv.hf.scaled_config both call it, so a retune after measurements on real models changes
this file alone.
"""
from __future__ import annotations

import math
from typing import Optional

# The rule's constants. Upstream's setting, tuned for Hk*D = 1024 keys at 128k tokens, is rank 160,
# budget 2048, 48 outlier chunks and 4 local chunks of 8 tokens; the rule reproduces it there.
SCALING = dict(
    chunk_size=8,
    # rank = Hk*D * rank_share, but at least min(rank_floor, Hk*D * rank_small_share): small models'
    # pre-RoPE keys are far from low-rank (about half their dimensions for 10% reconstruction error)
    rank_share=160 / 1024,
    rank_floor=160,
    rank_small_share=0.5,
    # budget = context * budget_share, but at least min(budget_floor, context * budget_small_share):
    # a few thousand tokens of context attend too diffusely for upstream's 1.6%
    budget_share=2048 / 131072,
    budget_floor=2048,
    budget_small_share=0.125,
    # outlier chunks: upstream's 48 at 128k, in proportion below it, at least outlier_min
    outlier_share=48 / 131072,  # chunks per token of context
    outlier_min=4,
    outlier_max=48,
    n_local_chunks=4,
    # select_mode "mass": the target p, the cap (budget_cap_factor times the fixed budget, within the
    # context) and the floor (a share of the fixed budget's chunks)
    select_mass=0.95,
    mass_cap_factor=4,
    mass_floor_share=0.25,
    # rescore=True: select_candidates = rescore_factor times the selected chunks, within the context
    # (docs/DESIGN.md 4.5.1); with select_mode "mass" the rescored mass target is rescore_mass
    rescore_factor=4,
    rescore_mass=0.9,
    # rank 0 (adaptive=True): the error target, and the cap as a share of Hk*D
    rank_error_target=0.1,
    rank_max_share=0.75,
)


def _round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m)) * m


def scaled_config(n_kv_heads: int, head_dim: int, context_len: int, n_layers: Optional[int] = None,
                  select_mode: str = "fixed", adaptive_rank: bool = False, n_dense_layers: int = 0,
                  rescore: bool = True) -> dict:
    """The sparse config fields scaled to a model's keys (Hk = n_kv_heads heads of head_dim) and a
    context of context_len tokens (the prompt length the cache will serve; shorter prompts work
    down to shadowkv.min_prompt_len of the result):

        chunk_size, rank, budget, n_outlier_chunks, n_local_chunks, select_mode (and, for "mass",
        select_mass and select_min_chunks; for adaptive_rank, rank 0 with rank_max and
        rank_error_target; for n_dense_layers > 0, dense_layers: the first n_dense_layers layers,
        which needs n_layers; select_candidates unless rescore=False: the selection ranks that
        many landmark-best candidates by their rebuilt keys, docs/DESIGN.md 4.5.1; on SmolLM2 it
        halves the KL of the same budget and keeps the multi-key answers of dense attention).

    Pass the result to shadowkv.config(**fields) or ShadowKVCache(model, **fields); override any
    field by setting it after. The rule (docs/DESIGN.md section 2.1) gives upstream's rank 160,
    budget 2048, 48 outliers and 4 local chunks for Hk*D = 1024 at 128k tokens.
    """
    for name, v in (("n_kv_heads", n_kv_heads), ("head_dim", head_dim), ("context_len", context_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}: {v!r}, expected a positive int")
    if select_mode not in ("fixed", "mass"):
        raise ValueError(f"select_mode {select_mode!r}: expected 'fixed' or 'mass'")
    R = SCALING
    c = R["chunk_size"]
    HkD = n_kv_heads * head_dim
    # rank: a multiple of 8, at most Hk*D, and below the context (the factorization needs n >= r)
    rank = max(HkD * R["rank_share"], min(R["rank_floor"], HkD * R["rank_small_share"]))
    rank = min(_round_up(rank, 8), HkD, max(8, (context_len // 2) // 8 * 8))
    n_chunks = context_len // c
    lc = R["n_local_chunks"]
    outliers = int(round(context_len * R["outlier_share"]))
    outliers = max(R["outlier_min"], min(R["outlier_max"], outliers))
    budget = max(context_len * R["budget_share"], min(R["budget_floor"], context_len * R["budget_small_share"]))
    S = max(1, _round_up(budget, c) // c)
    # keep the shortest prompt the result takes within the context: outliers, budget and local window
    # at most half its chunks (a prompt of context_len leaves half the chunks unselected at least)
    room = max(n_chunks // 2, 3)
    if outliers + S + lc > room:
        outliers = max(1, min(outliers, room // 8))
        lc = max(1, min(lc, room // 8))
        S = max(1, room - outliers - lc)
    out = dict(chunk_size=c, rank=int(rank), budget=S * c, n_outlier_chunks=int(outliers), n_local_chunks=int(lc),
               select_mode=select_mode)
    if select_mode == "mass":
        cap = min(S * R["mass_cap_factor"], max(n_chunks - outliers - lc, 1))
        out.update(budget=cap * c, select_mass=R["select_mass"],
                   select_min_chunks=min(cap, max(1, int(S * R["mass_floor_share"]))))
    if rescore:
        W = min(S * R["rescore_factor"], max(n_chunks - outliers - lc, 1))
        out["select_candidates"] = W
        if select_mode == "mass":  # the cap is every rescored candidate, the target a share of their mass
            out.update(budget=W * c, select_mass=R["rescore_mass"])
    if adaptive_rank:
        out.update(rank=0, rank_max=min(HkD, max(int(rank), _round_up(HkD * R["rank_max_share"], 8)),
                                        max(8, (context_len // 2) // 8 * 8)),
                   rank_error_target=R["rank_error_target"])
    if n_dense_layers:
        if n_layers is None or not 0 < n_dense_layers <= min(n_layers, 64):
            raise ValueError(f"n_dense_layers {n_dense_layers}: needs n_layers (got {n_layers}) and "
                             "0 < n_dense_layers <= min(n_layers, 64)")
        out["dense_layers"] = (1 << n_dense_layers) - 1
    return out
