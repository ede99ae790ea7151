/*
 * fuzz_op_gather.c - skv_op_gather_values on ref or cpu.
 *
 * Carves Hk <= 4, D <= 64 (any), chunk c <= 8, n_store <= 32, S <= 16 and
 * idx in [0, n_store) (repeats allowed); the store may hold NaN/Inf (values
 * are copied, not checked). About half the inputs plant one bad argument (a
 * size out of range, an index < 0 or >= n_store, a NULL). Asserts:
 *  - the status the planted error calls for; on error v_out holds its poison;
 *  - on success v_out is exactly the gathered chunks, byte for byte;
 *  - store and idx unchanged, canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"

static const char OP[] = "skv_op_gather_values";

enum { BAD_NONE, BAD_HK, BAD_D, BAD_C, BAD_NSTORE, BAD_S, BAD_IDX, BAD_NULL_STORE, BAD_NULL_IDX, BAD_NULL_OUT,
       BAD_COUNT };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_backend be = skvf_backend(&d);
    int32_t Hk = (int32_t)skvf_range(&d, 1, 4), D = (int32_t)skvf_range(&d, 1, 64);
    int32_t c = (int32_t)skvf_range(&d, 1, 8), ns = (int32_t)skvf_range(&d, 1, 32);
    int32_t S = (int32_t)skvf_range(&d, 1, 16);
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;

    size_t block = (size_t)c * D, nst = (size_t)Hk * ns * block, nid = (size_t)Hk * S;
    skvf_buf store, idx, out;
    skvf_buf_in(&store, "store", nst * sizeof(skv_bf16));
    skvf_buf_in(&idx, "idx", nid * sizeof(int32_t));
    skvf_buf_out(&out, "v_out", nid * block * sizeof(skv_bf16));
    skvf_fill_bf16(&d, store.p, nst, 1);
    int32_t *I = idx.p;
    for (size_t i = 0; i < nid; i++) I[i] = (int32_t)skvf_range(&d, 0, ns - 1);
    if (bad == BAD_IDX) {
        int64_t v = skvf_bool(&d) ? skvf_range(&d, INT32_MIN, -1) : ns + skvf_range(&d, 0, 3) * skvf_range(&d, 0, 1 << 20);
        I[skvf_range(&d, 0, (int64_t)nid - 1)] = (int32_t)(v > INT32_MAX ? INT32_MAX : v);
    }
    skvf_buf_snap(&store);
    skvf_buf_snap(&idx);

    int32_t cHk = Hk, cD = D, cc = c, cns = ns, cS = S;
    const skv_bf16 *ps = store.p;
    const int32_t *pi = idx.p;
    skv_bf16 *po = out.p;
    switch (bad) {
    case BAD_HK: cHk = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 65537, INT32_MAX); break;
    case BAD_D: cD = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 1025, INT32_MAX); break;
    case BAD_C: cc = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 4097, INT32_MAX); break;
    case BAD_NSTORE: cns = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, INT32_MAX / 4096 + 1, INT32_MAX); break;
    case BAD_S: cS = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, INT32_MAX / 4096 + 1, INT32_MAX); break;
    case BAD_NULL_STORE: ps = NULL; break;
    case BAD_NULL_IDX: pi = NULL; break;
    case BAD_NULL_OUT: po = NULL; break;
    default: break;
    }
    unsigned must_fail = 0;
    if (bad >= BAD_HK && bad <= BAD_IDX) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT) | SKVF_BIT(SKV_ERR_SIZE_OVERFLOW);
    if (bad >= BAD_NULL_STORE) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);

    char params[200];
    snprintf(params, sizeof params, "backend %s Hk %d D %d c %d n_store %d S %d bad %d", skv_backend_name(be), cHk, cD,
             cc, cns, cS, bad);
    skv_status st = skv_op_gather_values(be, cHk, cD, cc, cns, cS, ps, pi, po);
    skvf_expect(st, must_fail, 0, OP, params);
    skvf_buf_unchanged(&store, OP, "(input)");
    skvf_buf_unchanged(&idx, OP, "(input)");
    if (st != SKV_OK) {
        skvf_buf_unchanged(&out, OP, "on error");
    } else {
        skvf_guarded_check(out.p, "v_out");
        const skv_bf16 *V = out.p, *ST = store.p;
        for (int32_t h = 0; h < Hk; h++)
            for (int32_t s = 0; s < S; s++)
                if (memcmp(V + ((size_t)h * S + s) * block, ST + ((size_t)h * ns + I[(size_t)h * S + s]) * block,
                           block * sizeof(skv_bf16)))
                    skvf_fail("%s: v_out[h %d, s %d] is not store[h %d, idx %d] (%s)", OP, h, s, h,
                              I[(size_t)h * S + s], params);
        skvf_note_checked(be);
    }
    skvf_buf_free(&store);
    skvf_buf_free(&idx);
    skvf_buf_free(&out);
    return 0;
}
