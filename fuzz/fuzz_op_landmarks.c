/*
 * fuzz_op_landmarks.c - skv_op_landmarks_outliers on ref or cpu.
 *
 * Carves N <= 64 chunks of c <= 8 tokens, Hk <= 4, D <= 64 (any), 0 <= O < N,
 * outlier_ids NULL when O = 0 (allowed) on some inputs; about half plant one
 * bad argument (N, c, Hk, D out of range, O < 0 or O >= N, a NULL) and some
 * NaN/Inf in k_post. Asserts:
 *  - the status the planted error calls for; on error every output holds its
 *    poison;
 *  - on success, per head: outliers and candidates strictly increasing, in
 *    [0, N), together a partition of 0..N-1; the outliers are exactly the O
 *    lowest under (outlier key, index) and each landmark is the bf16 chunk
 *    mean, both recomputed with skv_numerics.h (the exact-selection contract:
 *    decisions are bit-identical on every backend);
 *  - k_post unchanged, canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"
#include "skv_numerics.h"

static const char OP[] = "skv_op_landmarks_outliers";

enum { BAD_NONE, BAD_N, BAD_C, BAD_HK, BAD_D, BAD_O_NEG, BAD_O_BIG, BAD_NULL_K, BAD_NULL_OUT, BAD_NULL_CAND,
       BAD_NULL_LM, BAD_COUNT };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_backend be = skvf_backend(&d);
    int32_t N = (int32_t)skvf_range(&d, 1, 64);
    int32_t c = (int32_t)skvf_range(&d, 1, 8);
    int32_t Hk = (int32_t)skvf_range(&d, 1, 4);
    int32_t D = (int32_t)skvf_range(&d, 1, 64);
    int32_t O = (int32_t)skvf_range(&d, 0, N - 1);
    int out_null_ok = O == 0 && skvf_bool(&d); /* O = 0: outlier_ids may be NULL */
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;
    int allow_nan = skvf_range(&d, 0, 5) == 0;

    size_t nk = (size_t)N * c * Hk * D, nc = (size_t)N - O;
    skvf_buf k, oid, cid, lm;
    skvf_buf_in(&k, "k_post", nk * sizeof(skv_bf16));
    skvf_buf_out(&oid, "outlier_ids", (size_t)Hk * O * sizeof(int32_t));
    skvf_buf_out(&cid, "candidate_ids", (size_t)Hk * nc * sizeof(int32_t));
    skvf_buf_out(&lm, "landmarks", (size_t)Hk * nc * D * sizeof(skv_bf16));
    skvf_fill_bf16(&d, k.p, nk, allow_nan);
    if (allow_nan && skvf_bool(&d)) skvf_plant_bad(&d, k.p, nk);
    skvf_buf_snap(&k);

    int32_t cN = N, cc = c, cHk = Hk, cD = D, cO = O;
    const skv_bf16 *pk = k.p;
    int32_t *po = out_null_ok ? NULL : oid.p, *pc = cid.p;
    skv_bf16 *pl = lm.p;
    switch (bad) {
    case BAD_N: cN = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : INT32_MAX; break;
    case BAD_C: cc = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 4097, INT32_MAX); break;
    case BAD_HK: cHk = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 65537, INT32_MAX); break;
    case BAD_D: cD = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 1025, INT32_MAX); break;
    case BAD_O_NEG: cO = (int32_t)skvf_range(&d, INT32_MIN, -1); break;
    case BAD_O_BIG: cO = N + (int32_t)skvf_range(&d, 0, 100); break;
    case BAD_NULL_K: pk = NULL; break;
    case BAD_NULL_OUT: po = NULL; if (O == 0) bad = BAD_NONE; break; /* O = 0: NULL is allowed */
    case BAD_NULL_CAND: pc = NULL; break;
    case BAD_NULL_LM: pl = NULL; break;
    default: break;
    }
    unsigned must_fail = 0;
    if (bad >= BAD_N && bad <= BAD_O_BIG) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT) | SKVF_BIT(SKV_ERR_SIZE_OVERFLOW);
    /* a too-large O with a NULL outlier_ids may be reported either way */
    if (bad == BAD_O_BIG && !po) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    if (bad >= BAD_NULL_K) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    size_t n_bad = skvf_bf16_count_bad(k.p, nk);
    if (n_bad) must_fail |= SKVF_BIT(SKV_ERR_NONFINITE);

    char params[200];
    snprintf(params, sizeof params, "backend %s N %d c %d Hk %d D %d O %d outlier_ids %s bad %d nonfinite %zu",
             skv_backend_name(be), cN, cc, cHk, cD, cO, po ? "set" : "NULL", bad, n_bad);
    skv_status st = skv_op_landmarks_outliers(be, cN, cc, cHk, cD, cO, pk, po, pc, pl);
    skvf_expect(st, must_fail, 0, OP, params);
    skvf_buf_unchanged(&k, OP, "(input)");
    if (st != SKV_OK) {
        skvf_buf_unchanged(&oid, OP, "on error");
        skvf_buf_unchanged(&cid, OP, "on error");
        skvf_buf_unchanged(&lm, OP, "on error");
    } else {
        if (po == NULL) skvf_buf_unchanged(&oid, OP, "(NULL outlier_ids passed)");
        skvf_guarded_check(oid.p, "outlier_ids");
        skvf_guarded_check(cid.p, "candidate_ids");
        skvf_guarded_check(lm.p, "landmarks");
        const skv_bf16 *K = k.p;
        const int32_t *OI = oid.p, *CI = cid.p;
        const skv_bf16 *L = lm.p;
        float key[64], mean[64 * 64];
        int32_t order[64];
        char is_out[64];
        for (int32_t h = 0; h < Hk; h++) {
            /* oracle: keys and means by the shared numerics */
            for (int32_t j = 0; j < N; j++)
                key[j] = skv_outlier_key(
                    skv_chunk_landmark_score(K + ((size_t)j * c * Hk + h) * D, (int64_t)Hk * D, c, D, mean + (size_t)j * D));
            for (int32_t j = 0; j < N; j++) { /* insertion sort by (key, index), ascending */
                int32_t m = j;
                while (m > 0 && key[order[m - 1]] > key[j]) {
                    order[m] = order[m - 1];
                    m--;
                }
                order[m] = j;
            }
            memset(is_out, 0, sizeof is_out);
            for (int32_t o = 0; o < O; o++) is_out[order[o]] = 1;
            /* outputs */
            const int32_t *oh = OI + (size_t)h * O, *ch = CI + (size_t)h * nc;
            for (int32_t o = 0; o < O; o++) {
                if (oh[o] < 0 || oh[o] >= N || (o && oh[o] <= oh[o - 1]))
                    skvf_fail("%s: head %d outlier_ids[%d] = %d not increasing in [0, %d) (%s)", OP, h, o, oh[o], N, params);
                if (!is_out[oh[o]])
                    skvf_fail("%s: head %d outlier %d (key %.9g) is not among the %d lowest keys (%s)", OP, h, oh[o],
                              (double)key[oh[o]], O, params);
            }
            int32_t m = 0;
            for (int32_t j = 0; j < N; j++) { /* candidates: exactly the rest, in order */
                if (is_out[j]) continue;
                if (ch[m] != j)
                    skvf_fail("%s: head %d candidate_ids[%d] = %d, expected %d (%s)", OP, h, m, ch[m], j, params);
                const skv_bf16 *l = L + ((size_t)h * nc + m) * D;
                for (int32_t e = 0; e < D; e++)
                    if (l[e] != skv_f32_to_bf16(mean[(size_t)j * D + e]))
                        skvf_fail("%s: head %d landmark of chunk %d dim %d = 0x%04x, expected 0x%04x (%s)", OP, h, j, e,
                                  l[e], skv_f32_to_bf16(mean[(size_t)j * D + e]), params);
                m++;
            }
        }
        skvf_note_checked(be);
    }
    skvf_buf_free(&k);
    skvf_buf_free(&oid);
    skvf_buf_free(&cid);
    skvf_buf_free(&lm);
    return 0;
}
