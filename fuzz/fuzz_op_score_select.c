/*
 * fuzz_op_score_select.c - skv_op_score_select on ref or cpu.
 *
 * Carves Hk <= 4, G <= 4 (Hq = G Hk), D <= 64, n_cand <= 64, 1 <= S <= n_cand,
 * a scale (0 = default, ordinary, tiny, huge), and each of candidate_ids,
 * sel_ids, amax present or NULL; about half the inputs plant one bad argument
 * (Hq not a multiple of Hk, Hq < Hk, sizes out of range, S > n_cand, a negative
 * candidate id, scale < 0 / NaN / Inf, a NULL, sel_ids without candidate_ids)
 * and some NaN/Inf in q or landmarks. Asserts:
 *  - the status the planted error calls for; on error every output holds its
 *    poison;
 *  - on success, per KV head: sel_idx strictly increasing in [0, n_cand) and
 *    exactly the S best candidates under (select key of amax desc, index asc),
 *    amax (when asked) bit-identical to skv_numerics.h's softmax of the group
 *    (the exact-selection contract), in [0, 1] when not NaN, sel_ids =
 *    candidate_ids[sel_idx];
 *  - q, landmarks, candidate_ids unchanged, canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"
#include "skv_numerics.h"

static const char OP[] = "skv_op_score_select";

enum { BAD_NONE, BAD_GQA, BAD_HQ_LOW, BAD_HK, BAD_D, BAD_NCAND, BAD_S_LOW, BAD_S_HIGH, BAD_CAND_ID, BAD_SCALE,
       BAD_NULL_Q, BAD_NULL_L, BAD_NULL_SEL, BAD_SELIDS_NO_CAND, BAD_COUNT };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_backend be = skvf_backend(&d);
    int32_t Hk = (int32_t)skvf_range(&d, 1, 4), G = (int32_t)skvf_range(&d, 1, 4), Hq = Hk * G;
    int32_t D = (int32_t)skvf_range(&d, 1, 64);
    int32_t nc = (int32_t)skvf_range(&d, 1, 64);
    int32_t S = (int32_t)skvf_range(&d, 1, nc);
    float scale;
    switch (skvf_range(&d, 0, 4)) {
    case 0: scale = 0.0f; break;
    case 1: scale = 1.0f / sqrtf((float)D); break;
    case 2: scale = (float)skvf_range(&d, 1, 1000) / 100.0f; break;
    case 3: scale = fabsf(skvf_float(&d)); if (!isfinite(scale)) scale = 1.0f; break;
    default: scale = 1e30f; break;
    }
    int with_cand = skvf_bool(&d), with_ids = with_cand && skvf_bool(&d), with_amax = skvf_bool(&d);
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;
    int allow_nan = skvf_range(&d, 0, 5) == 0;

    size_t nq = (size_t)Hq * D, nl = (size_t)Hk * nc * D;
    skvf_buf q, lm, cid, si, sid, am;
    skvf_buf_in(&q, "q", nq * sizeof(skv_bf16));
    skvf_buf_in(&lm, "landmarks", nl * sizeof(skv_bf16));
    skvf_buf_in(&cid, "candidate_ids", (size_t)Hk * nc * sizeof(int32_t));
    skvf_buf_out(&si, "sel_idx", (size_t)Hk * S * sizeof(int32_t));
    skvf_buf_out(&sid, "sel_ids", (size_t)Hk * S * sizeof(int32_t));
    skvf_buf_out(&am, "amax", (size_t)Hk * nc * sizeof(float));
    skvf_fill_bf16(&d, q.p, nq, allow_nan);
    skvf_fill_bf16(&d, lm.p, nl, allow_nan);
    if (allow_nan && skvf_bool(&d)) {
        if (skvf_bool(&d)) skvf_plant_bad(&d, q.p, nq);
        else skvf_plant_bad(&d, lm.p, nl);
    }
    int32_t *C = cid.p;
    int32_t id_step = (int32_t)skvf_range(&d, 1, 1000), id0 = (int32_t)skvf_range(&d, 0, 100000);
    for (int32_t h = 0; h < Hk; h++) /* increasing ids, as landmarks_outliers gives them */
        for (int32_t j = 0; j < nc; j++) C[(size_t)h * nc + j] = id0 + j * id_step;
    if (bad == BAD_CAND_ID) {
        with_cand = 1;
        C[skvf_range(&d, 0, (int64_t)Hk * nc - 1)] = (int32_t)skvf_range(&d, INT32_MIN, -1);
    }
    skvf_buf_snap(&q);
    skvf_buf_snap(&lm);
    skvf_buf_snap(&cid);

    int32_t cHq = Hq, cHk = Hk, cD = D, cnc = nc, cS = S;
    float cscale = scale;
    const skv_bf16 *pq = q.p, *pl = lm.p;
    const int32_t *pc = with_cand ? cid.p : NULL;
    int32_t *psi = si.p, *psid = with_ids ? sid.p : NULL;
    float *pam = with_amax ? am.p : NULL;
    switch (bad) {
    case BAD_GQA: if (Hk > 1) cHq = Hq + (int32_t)skvf_range(&d, 1, Hk - 1); else bad = BAD_NONE; break;
    case BAD_HQ_LOW: if (Hk > 1) cHq = (int32_t)skvf_range(&d, 1, Hk - 1); else cHq = (int32_t)skvf_range(&d, INT32_MIN, 0); break;
    case BAD_HK: cHk = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 65537, INT32_MAX); break;
    case BAD_D: cD = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 1025, INT32_MAX); break;
    case BAD_NCAND: cnc = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : INT32_MAX; break;
    case BAD_S_LOW: cS = (int32_t)skvf_range(&d, INT32_MIN, 0); break;
    case BAD_S_HIGH: cS = nc + (int32_t)skvf_range(&d, 1, 1000); break;
    case BAD_SCALE: {
        static const float bad_scales[] = {-1.0f, -1e-30f, INFINITY, -INFINITY, NAN};
        cscale = bad_scales[skvf_range(&d, 0, 4)];
        break;
    }
    case BAD_NULL_Q: pq = NULL; break;
    case BAD_NULL_L: pl = NULL; break;
    case BAD_NULL_SEL: psi = NULL; break;
    case BAD_SELIDS_NO_CAND: pc = NULL; psid = sid.p; break;
    default: break;
    }
    unsigned must_fail = 0;
    if (bad >= BAD_GQA && bad <= BAD_SCALE) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT) | SKVF_BIT(SKV_ERR_SIZE_OVERFLOW);
    if (bad >= BAD_NULL_Q) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    size_t n_bad = skvf_bf16_count_bad(q.p, nq) + skvf_bf16_count_bad(lm.p, nl);
    if (n_bad) must_fail |= SKVF_BIT(SKV_ERR_NONFINITE);

    char params[240];
    snprintf(params, sizeof params,
             "backend %s Hq %d Hk %d D %d n_cand %d S %d scale %g cand %d sel_ids %d amax %d bad %d nonfinite %zu",
             skv_backend_name(be), cHq, cHk, cD, cnc, cS, (double)cscale, pc != NULL, psid != NULL, pam != NULL, bad,
             n_bad);
    skv_status st = skv_op_score_select(be, cHq, cHk, cD, cnc, cS, cscale, pq, pl, pc, psi, psid, pam);
    skvf_expect(st, must_fail, 0, OP, params);
    skvf_buf_unchanged(&q, OP, "(input)");
    skvf_buf_unchanged(&lm, OP, "(input)");
    skvf_buf_unchanged(&cid, OP, "(input)");
    if (st != SKV_OK || !psid) skvf_buf_unchanged(&sid, OP, st ? "on error" : "(NULL sel_ids passed)");
    if (st != SKV_OK || !pam) skvf_buf_unchanged(&am, OP, st ? "on error" : "(NULL amax passed)");
    if (st != SKV_OK) {
        skvf_buf_unchanged(&si, OP, "on error");
    } else {
        skvf_guarded_check(si.p, "sel_idx");
        const skv_bf16 *Q = q.p, *L = lm.p;
        const int32_t *SI = si.p, *SID = sid.p;
        const float *AM = am.p;
        float sc = scale > 0.0f ? scale : 1.0f / sqrtf((float)D), s[64], a[64];
        for (int32_t h = 0; h < Hk; h++) {
            for (int32_t g = 0; g < G; g++) { /* the oracle: skv_numerics.h, as docs/DESIGN.md section 5 */
                const skv_bf16 *qi = Q + (size_t)(h * G + g) * D;
                for (int32_t j = 0; j < nc; j++) s[j] = SKV_MUL(skv_dot_bf16(qi, L + ((size_t)h * nc + j) * D, D), sc);
                skv_softmax_inplace(s, nc);
                for (int32_t j = 0; j < nc; j++)
                    if (g == 0 || s[j] > a[j]) a[j] = s[j];
            }
            if (pam)
                for (int32_t j = 0; j < nc; j++) {
                    float got = AM[(size_t)h * nc + j];
                    if (got == got && !(got >= 0.0f && got <= 1.0f))
                        skvf_fail("%s: amax[%d][%d] = %g outside [0, 1] (%s)", OP, h, j, (double)got, params);
                    if (memcmp(&got, &a[j], sizeof got) && !(got != got && a[j] != a[j]))
                        skvf_fail("%s: amax[%d][%d] = %.9g, expected %.9g (%s)", OP, h, j, (double)got, (double)a[j],
                                  params);
                }
            const int32_t *sh = SI + (size_t)h * S;
            char chosen[64];
            memset(chosen, 0, sizeof chosen);
            for (int32_t k = 0; k < S; k++) {
                if (sh[k] < 0 || sh[k] >= nc || (k && sh[k] <= sh[k - 1]))
                    skvf_fail("%s: head %d sel_idx[%d] = %d not increasing in [0, %d) (%s)", OP, h, k, sh[k], nc, params);
                chosen[sh[k]] = 1;
                if (psid && SID[(size_t)h * S + k] != C[(size_t)h * nc + sh[k]])
                    skvf_fail("%s: head %d sel_ids[%d] = %d, candidate_ids[%d] = %d (%s)", OP, h, k,
                              SID[(size_t)h * S + k], sh[k], C[(size_t)h * nc + sh[k]], params);
            }
            /* every chosen candidate precedes every other one in the order */
            for (int32_t j = 0; j < nc; j++) {
                if (!chosen[j]) continue;
                float kj = skv_select_key(a[j]);
                for (int32_t m = 0; m < nc; m++) {
                    if (chosen[m]) continue;
                    float km = skv_select_key(a[m]);
                    if (!(kj > km || (kj == km && j < m)))
                        skvf_fail("%s: head %d selected %d (amax %.9g) over %d (amax %.9g) (%s)", OP, h, j, (double)a[j],
                                  m, (double)a[m], params);
                }
            }
        }
        skvf_note_checked(be);
    }
    skvf_buf_free(&q);
    skvf_buf_free(&lm);
    skvf_buf_free(&cid);
    skvf_buf_free(&si);
    skvf_buf_free(&sid);
    skvf_buf_free(&am);
    return 0;
}
