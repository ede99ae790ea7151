/*
 * skv_cuda_factor.cu - the factorization's workspace and dispatch (skv_cuda_factor.cuh lists the
 * files of the routes): skv_cuda_factor_bytes, skv_cuda_factor_create / destroy (the cache's
 * prefill workspace and the op-level factorize slot's, in skv_cuda_backend.cu), skv_cuda_factorize
 * (picks the route: FAST, EXACT, CANONICAL; then counts a failed solver call on the device with
 * skv_cf_infos) and skv_cuda_factor_counts.
 */
#include "skv_cuda_factor.cuh"

/* ---- sizes ---------------------------------------------------------------------- */

typedef struct skv_cf_sizes {
    int64_t m_max, proj_rows, gram_batch, canon_rows, canon_urows;
    size_t canon_bytes; /* the canonical route's buffers beyond those it shares */
    int fast_ok, canon_ubufs;
    size_t gd_bytes, evals_bytes, scratch_bytes, xy_bytes, c_bytes, lt_bytes, qs_bytes, total;
} skv_cf_sizes;

/* 0 on invalid arguments or size_t overflow. */
static int skv_cf_sizes_of(int64_t n_max, int32_t d, int32_t r, skv_cf_sizes *s)
{
    if (n_max < 1 || d < 1 || r < 1) return 0;
    s->m_max = n_max < d ? n_max : d;
    s->fast_ok = skv_factor_route_for(n_max, d, r, SKV_FACTORIZE_AUTO) == SKV_ROUTE_FAST;
    s->proj_rows = SKV_CF_PROJ_ELEMS / d;
    if (s->proj_rows < 1) s->proj_rows = 1;
    if (s->proj_rows > n_max) s->proj_rows = n_max;
    size_t mm, pr, t, dd = 0, dr = 0;
    if (!skv_mul_size((size_t)s->m_max, (size_t)s->m_max, &mm)) return 0;
    if (!skv_mul_size((size_t)s->proj_rows, (size_t)d, &pr)) return 0;
    if (!skv_mul_size(mm > pr ? mm : pr, sizeof(float), &s->scratch_bytes)) return 0;
    if (n_max >= d) { /* batched block Grams: as many d x d fp32 blocks as fit in SKV_CF_GRAM_BATCH_BYTES, >= 1 */
        size_t blk, nblk = (size_t)((n_max + SKV_CF_GRAM_ROWS - 1) / SKV_CF_GRAM_ROWS), fit;
        if (!skv_mul_size(mm, sizeof(float), &blk)) return 0;
        fit = SKV_CF_GRAM_BATCH_BYTES / blk;
        if (fit < 1) fit = 1;
        if (fit > nblk) fit = nblk;
        s->gram_batch = (int64_t)fit;
        if (!skv_mul_size(fit, blk, &blk)) return 0;
        if (blk > s->scratch_bytes) s->scratch_bytes = blk;
    } else {
        s->gram_batch = 1;
    }
    s->xy_bytes = s->c_bytes = s->lt_bytes = s->qs_bytes = 0;
    if (s->fast_ok) {
        size_t part;
        if (!skv_mul_size((size_t)d, (size_t)d, &dd) || !skv_mul_size(dd, SKV_CF_SPLITS * sizeof(double), &part))
            return 0;
        if (part > s->scratch_bytes) s->scratch_bytes = part;
        if (!skv_mul_size((size_t)d, (size_t)r, &dr) || !skv_mul_size(dr, sizeof(double), &s->xy_bytes)) return 0;
        s->c_bytes = (size_t)r * r * sizeof(double);
        s->lt_bytes = skv_cf_fast_lt_bytes(r);
        if (!skv_mul_size(dr, SKV_CF_QTERMS * sizeof(skv_bf16), &s->qs_bytes)) return 0;
    }
    { /* the canonical route: token blocks of canon_rows rows, [rows, d] + [rows, r] doubles, in scratch */
        int64_t cr = ((int64_t)1 << 23) / ((int64_t)d + r);
        if (cr < 1) cr = 1;
        if (cr > n_max) cr = n_max;
        s->canon_rows = cr;
        size_t need;
        if (!skv_mul_size((size_t)cr, ((size_t)d + r) * sizeof(double), &need)) return 0;
        if (need > s->scratch_bytes) s->scratch_bytes = need;
        /* the int8 exact Gram (skv_cuda_canon_i8.h): its int32 products and digit planes, at least one
           block of any digit count; above the cap the scratch stays and the plan decides per call */
        need = skv_cc_i8_need(d);
        if (need && need <= SKV_CC_I8_GROW_CAP && need > s->scratch_bytes) s->scratch_bytes = need;
        /* U's token blocks in the scratch as sized: two buffers of fixed-point A and one T, of as
           many rows as fit, at most canon_rows (the scratch holds one buffer of canon_rows and T,
           so at least about canon_rows / 2 fit); one buffer of canon_rows if not even one row does */
        int64_t ur = (int64_t)(s->scratch_bytes / ((2 * (size_t)d + (size_t)r) * sizeof(double)));
        if (ur > cr) ur = cr;
        s->canon_ubufs = ur >= 1 ? 2 : 1;
        s->canon_urows = ur >= 1 ? ur : cr;
        size_t rr = (size_t)r * r * sizeof(double), cb = 2 * rr + (size_t)r * sizeof(double) +
                                                          (size_t)d * (sizeof(int32_t) + sizeof(unsigned)) +
                                                          (size_t)r * sizeof(int32_t);
        if (r > 160) cb += rr; /* the packed Cholesky scratch (SKV_CC_CHOL_SMEM_R) */
        if (s->m_max < d) cb += (size_t)d * d * sizeof(double);
        if (!s->fast_ok) cb += 2 * (size_t)d * r * sizeof(double);
        s->canon_bytes = cb;
    }
    if (!skv_mul_size(mm, sizeof(double), &s->gd_bytes)) return 0;
    if (!skv_mul_size((size_t)s->m_max, sizeof(double), &s->evals_bytes)) return 0;
    t = s->gd_bytes;
    if (!skv_add_size(t, s->evals_bytes, &t)) return 0;
    if (!skv_add_size(t, s->scratch_bytes, &t)) return 0;
    if (!skv_add_size(t, 2 * s->xy_bytes, &t)) return 0;
    if (!skv_add_size(t, s->c_bytes + s->lt_bytes + s->qs_bytes, &t)) return 0;
    if (!skv_add_size(t, SKV_CF_NINFO * sizeof(int) + sizeof(skv_cf_state), &t)) return 0;
    if (!skv_add_size(t, SKV_CF_BLAS_WS, &t)) return 0;
    if (!skv_add_size(t, s->canon_bytes, &t)) return 0;
    s->total = t;
    return 1;
}

extern "C" size_t skv_cuda_factor_bytes(int64_t n_max, int32_t d, int32_t r)
{
    skv_cf_sizes s;
    return skv_cf_sizes_of(n_max, d, r, &s) ? s.total : SIZE_MAX;
}

/* Counts a failed solver call of this factorization (info != 0) under tag. One thread. */
static __global__ void skv_cf_infos(const int *__restrict__ info, int n_info, unsigned long long tag,
                                    skv_cf_state *state)
{
    int bad = 0;
    for (int k = 0; k < n_info; k++) bad |= info[k] != 0;
    if (bad) {
        if (state->n_failures++ == 0) state->first_failure_tag = tag;
    }
}

/* ---- create / destroy ------------------------------------------------------------------ */

extern "C" void skv_cuda_factor_destroy(skv_cuda_factor *f)
{
    if (!f) return;
    /* cudaFree synchronizes with outstanding work on the device. Errors are ignored: nothing to report to. */
    if (f->cc_own_g) cudaFree(f->cc_g);
    if (f->cc_own_xy) {
        cudaFree(f->cc_x);
        cudaFree(f->cc_y);
    }
    cudaFree(f->cc_c);
    cudaFree(f->cc_l);
    cudaFree(f->cc_lp);
    cudaFree(f->cc_dsc);
    cudaFree(f->cc_e);
    cudaFree(f->cc_f);
    cudaFree(f->cc_colmax);
    cudaFree(f->solver_ws);
    cudaFree(f->blas_ws);
    cudaFree(f->state);
    cudaFree(f->qs);
    cudaFree(f->lt);
    cudaFree(f->c);
    cudaFree(f->y);
    cudaFree(f->x);
    cudaFree(f->info);
    cudaFree(f->scratch);
    cudaFree(f->evals);
    cudaFree(f->gd);
    free(f->solver_host);
    cudaEvent_t evs[6] = {f->cc_ev_fork, f->cc_ev_join, f->cc_ev_ready[0], f->cc_ev_ready[1], f->cc_ev_free[0],
                          f->cc_ev_free[1]};
    for (int k = 0; k < 6; k++)
        if (evs[k]) cudaEventDestroy(evs[k]);
    if (f->cc_side) cudaStreamDestroy(f->cc_side);
    if (f->params) cusolverDnDestroyParams(f->params);
    if (f->solver) cusolverDnDestroy(f->solver);
    if (f->blas) cublasDestroy(f->blas);
    free(f);
}

/* cudaMalloc into *p; a message naming the buffer on failure. */
static skv_status skv_cf_alloc(void **p, size_t bytes, const char *what, char *msg, size_t cap)
{
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e == cudaSuccess) return SKV_OK;
    *p = NULL;
    cudaGetLastError(); /* allocation failures are not sticky: clear the error state */
    if (msg && cap)
        snprintf(msg, cap, "cuda factorize: cudaMalloc of %zu bytes (%s): %s", bytes, what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_DEVICE;
}

/* A handle call failed at create: a device runtime failure (or out of memory). */
static skv_status skv_cf_handle_status(skv_status st)
{
    return st == SKV_ERR_OUT_OF_MEMORY ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_DEVICE;
}

extern "C" skv_status skv_cuda_factor_create(skv_cuda_factor **out, int64_t n_max, int32_t d, int32_t r,
                                             cudaStream_t st, skv_cuda_green *green, char *msg, size_t cap)
{
    *out = NULL;
    if (n_max < 1 || n_max > SKV_CUDA_FACTOR_MAX_N || d < 1 || r < 1 || (int64_t)r > (n_max < d ? n_max : d)) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: workspace for n_max = %lld, d = %d, r = %d: need 1 <= n_max <= %lld, "
                               "d >= 1, 1 <= r <= min(n_max, d)",
                     (long long)n_max, (int)d, (int)r, (long long)SKV_CUDA_FACTOR_MAX_N);
        return SKV_ERR_INVALID_ARGUMENT;
    }
    skv_cf_sizes sz;
    if (!skv_cf_sizes_of(n_max, d, r, &sz)) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: workspace for n_max = %lld, d = %d overflows size_t", (long long)n_max,
                     (int)d);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    skv_cuda_factor *f = (skv_cuda_factor *)calloc(1, sizeof *f);
    if (!f) {
        if (msg && cap) snprintf(msg, cap, "cuda factorize: host allocation of the factorization state failed");
        return SKV_ERR_OUT_OF_MEMORY;
    }
    f->st = st;
    f->n_max = n_max;
    f->m_max = sz.m_max;
    f->proj_rows = sz.proj_rows;
    f->gram_batch = sz.gram_batch;
    f->d = d;
    f->r = r;
    f->fast_ok = sz.fast_ok;
    f->scratch_bytes = sz.scratch_bytes;
    f->canon_rows = sz.canon_rows;
    f->canon_urows = sz.canon_urows;
    f->canon_ubufs = sz.canon_ubufs;

    skv_status s = SKV_OK;
    size_t dev_bytes = 0, host_bytes = 0;

    /* handles */
    if ((s = skv_cf_blas(cublasCreate(&f->blas), "cublasCreate", msg, cap)) != SKV_OK) {
        f->blas = NULL;
        s = skv_cf_handle_status(s);
        goto fail;
    }
    if ((s = skv_cf_blas(cublasSetStream(f->blas, st), "cublasSetStream", msg, cap)) != SKV_OK) goto fail_handle;
    if ((s = skv_cf_solver(cusolverDnCreate(&f->solver), "cusolverDnCreate", msg, cap)) != SKV_OK) {
        f->solver = NULL;
        goto fail_handle;
    }
    if ((s = skv_cf_solver(cusolverDnSetStream(f->solver, st), "cusolverDnSetStream", msg, cap)) != SKV_OK)
        goto fail_handle;
    if ((s = skv_cf_solver(cusolverDnCreateParams(&f->params), "cusolverDnCreateParams", msg, cap)) != SKV_OK) {
        f->params = NULL;
        goto fail_handle;
    }

    /* device workspace */
    if ((s = skv_cf_alloc((void **)&f->gd, sz.gd_bytes, "Gram matrix, double", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc((void **)&f->evals, sz.evals_bytes, "eigenvalues", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc((void **)&f->scratch, sz.scratch_bytes, "scratch", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc((void **)&f->info, SKV_CF_NINFO * sizeof(int), "solver infos", msg, cap)) != SKV_OK)
        goto fail;
    if ((s = skv_cf_alloc((void **)&f->state, sizeof(skv_cf_state), "factorization state", msg, cap)) != SKV_OK)
        goto fail;
    if (f->fast_ok) {
        if ((s = skv_cf_alloc((void **)&f->x, sz.xy_bytes, "iterate X", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->y, sz.xy_bytes, "iterate G X", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->c, sz.c_bytes, "Cholesky block", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->lt, sz.lt_bytes, "Cholesky factor", msg, cap)) != SKV_OK) goto fail;
        cudaError_t e = skv_cf_fast_smem(r); /* its Cholesky kernels' shared memory */
        if ((s = skv_cf_cuda(e, "cudaFuncSetAttribute (Cholesky shared memory)", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->qs, sz.qs_bytes, "bf16 split of Q", msg, cap)) != SKV_OK) goto fail;
    }
    /* the canonical route's buffers */
    if (f->m_max == d) f->cc_g = f->gd;
    else {
        f->cc_own_g = 1;
        if ((s = skv_cf_alloc((void **)&f->cc_g, (size_t)d * d * sizeof(double), "canonical Gram", msg, cap)) != SKV_OK)
            goto fail;
    }
    if (f->fast_ok) f->cc_x = f->x, f->cc_y = f->y;
    else {
        f->cc_own_xy = 1;
        if ((s = skv_cf_alloc((void **)&f->cc_x, (size_t)d * r * sizeof(double), "canonical iterate", msg, cap)) != SKV_OK ||
            (s = skv_cf_alloc((void **)&f->cc_y, (size_t)d * r * sizeof(double), "canonical iterate", msg, cap)) != SKV_OK)
            goto fail;
    }
    if ((s = skv_cf_alloc((void **)&f->cc_c, (size_t)r * r * sizeof(double), "canonical Y^T Y", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_l, ((size_t)r * r + r) * sizeof(double), "canonical Cholesky factor", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_lp, r > SKV_CC_CHOL_SMEM_R ? (size_t)r * r * sizeof(double) : 8,
                          "canonical Cholesky scratch", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_dsc, (size_t)r * sizeof(double), "canonical scales D", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_e, (size_t)d * sizeof(int32_t), "canonical column scales", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_f, (size_t)r * sizeof(int32_t), "canonical Q scales", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_colmax, (size_t)d * sizeof(unsigned), "canonical column maxima", msg, cap)) !=
            SKV_OK)
        goto fail;
    if ((s = skv_cf_canonical_smem(r, msg, cap)) != SKV_OK) goto fail; /* its kernels' shared memory */
    { /* the canonical route's second stream, of st's priority and in st's partition (green), and the
         events recorded on the two (created once: factorize allocates nothing) */
        int prio = 0;
        if (cudaStreamGetPriority(st, &prio) != cudaSuccess) {
            (void)cudaGetLastError();
            prio = 0;
        }
        if ((s = skv_cuda_green_stream(green, &f->cc_side, prio, msg, cap)) != SKV_OK) goto fail;
        cudaEvent_t *evs[6] = {&f->cc_ev_fork, &f->cc_ev_join, &f->cc_ev_ready[0], &f->cc_ev_ready[1],
                               &f->cc_ev_free[0], &f->cc_ev_free[1]};
        for (int k = 0; k < 6; k++)
            if ((s = skv_cuda_green_event(green, evs[k], cudaEventDisableTiming, msg, cap)) != SKV_OK) goto fail;
    }
    {
        skv_cf_state init;
        memset(&init, 0, sizeof init);
        init.first_failure_tag = ~0ull;
        cudaError_t e = cudaMemcpy(f->state, &init, sizeof init, cudaMemcpyHostToDevice);
        if ((s = skv_cf_cuda(e, "cudaMemcpy (factorization state)", msg, cap)) != SKV_OK) goto fail;
    }
    if ((s = skv_cf_alloc(&f->blas_ws, SKV_CF_BLAS_WS, "cuBLAS workspace", msg, cap)) != SKV_OK) goto fail;
    /* after cublasSetStream, which resets the workspace to cuBLAS's own pool */
    if ((s = skv_cf_blas(cublasSetWorkspace(f->blas, f->blas_ws, SKV_CF_BLAS_WS), "cublasSetWorkspace", msg, cap)) !=
        SKV_OK)
        goto fail_handle;

    /* cuSOLVER workspace: the EXACT route's eigenproblem (m_max x m_max) */
    if ((s = skv_cf_solver(cusolverDnXsyevd_bufferSize(f->solver, f->params, CUSOLVER_EIG_MODE_VECTOR,
                                                       CUBLAS_FILL_MODE_UPPER, f->m_max, CUDA_R_64F, f->gd, f->m_max,
                                                       CUDA_R_64F, f->evals, CUDA_R_64F, &dev_bytes, &host_bytes),
                           "cusolverDnXsyevd_bufferSize", msg, cap)) != SKV_OK)
        goto fail_handle;
    f->solver_ws_bytes = dev_bytes;
    f->solver_host_bytes = host_bytes;
    if ((s = skv_cf_alloc(&f->solver_ws, dev_bytes, "cuSOLVER workspace", msg, cap)) != SKV_OK) goto fail;
    if (host_bytes) {
        f->solver_host = malloc(host_bytes);
        if (!f->solver_host) {
            if (msg && cap)
                snprintf(msg, cap, "cuda factorize: host allocation of %zu bytes (cuSOLVER host workspace) failed",
                         host_bytes);
            s = SKV_ERR_OUT_OF_MEMORY;
            goto fail;
        }
    }
    *out = f;
    return SKV_OK;

fail_handle:
    s = skv_cf_handle_status(s);
fail:
    skv_cuda_factor_destroy(f);
    return s;
}

/* ---- factorize ------------------------------------------------------------------------- */

extern "C" skv_status skv_cuda_factorize(skv_cuda_factor *f, skv_factorize_route mode, int64_t n, const skv_bf16 *a,
                                         float *u, float *w, unsigned long long tag, int sync, char *msg, size_t cap)
{
    const int64_t d = f->d, r = f->r;
    if (n < 1 || n > f->n_max || n > SKV_CUDA_FACTOR_MAX_N || r > (n < d ? n : d)) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: n = %lld with d = %lld, r = %lld: need r <= min(n, d) and "
                               "1 <= n <= %lld (workspace n_max; supported maximum %lld)",
                     (long long)n, (long long)d, (long long)r, (long long)f->n_max, (long long)SKV_CUDA_FACTOR_MAX_N);
        return SKV_ERR_INVALID_ARGUMENT;
    }
    if (mode == SKV_FACTORIZE_CANONICAL) { /* no solver infos: the floored Cholesky cannot fail */
        skv_status s = skv_cf_canonical(f, n, a, u, w, msg, cap);
        if (s != SKV_OK || !sync) return s;
        SKV_CF_CHECK_CUDA(cudaStreamSynchronize(f->st), "cudaStreamSynchronize");
        return SKV_OK;
    }
    int fast = f->fast_ok && skv_factor_route_for(n, (int32_t)d, (int32_t)r, mode) == SKV_ROUTE_FAST;
    int n_info = fast ? SKV_CF_NINFO - 1 : 1; /* the check's own Cholesky is not a failure */
    skv_status s;
    SKV_CF_CHECK_CUDA(cudaMemsetAsync(f->info, 0, SKV_CF_NINFO * sizeof(int), f->st), "cudaMemsetAsync (infos)");
    s = fast ? skv_cf_fast(f, n, a, u, w, mode, msg, cap) : skv_cf_exact(f, n, a, u, w, msg, cap);
    if (s != SKV_OK) return s;
    skv_cf_infos<<<1, 1, 0, f->st>>>(f->info, n_info, tag, f->state);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "solver info kernel");
    if (!sync) return SKV_OK;
    /* the solvers' verdict (and any asynchronous error of the work above) */
    int info[SKV_CF_NINFO];
    SKV_CF_CHECK_CUDA(cudaMemcpyAsync(info, f->info, sizeof info, cudaMemcpyDeviceToHost, f->st),
                      "cudaMemcpyAsync (solver infos)");
    SKV_CF_CHECK_CUDA(cudaStreamSynchronize(f->st), "cudaStreamSynchronize");
    for (int k = 0; k < n_info; k++)
        if (info[k] != 0) {
            if (msg && cap)
                if (fast)
                    snprintf(msg, cap, "cuda factorize: Cholesky QR (r = %lld): pivot %d is not finite (overflow)",
                             (long long)r, info[k] - 1);
                else
                    snprintf(msg, cap, "cuda factorize: cusolverDnXsyevd (m = %lld) returned info = %d (%s)",
                             (long long)(n < d ? n : d), info[k],
                             info[k] > 0 ? "the solver did not converge" : "invalid argument");
            return SKV_ERR_NUMERICAL;
        }
    return SKV_OK;
}

extern "C" skv_status skv_cuda_factor_counts(skv_cuda_factor *f, unsigned long long *failures,
                                             unsigned long long *first_failure_tag, char *msg, size_t cap)
{
    skv_cf_state h;
    SKV_CF_CHECK_CUDA(cudaMemcpyAsync(&h, f->state, sizeof h, cudaMemcpyDeviceToHost, f->st),
                      "cudaMemcpyAsync (factorization state)");
    SKV_CF_CHECK_CUDA(cudaStreamSynchronize(f->st), "cudaStreamSynchronize");
    if (failures) *failures = h.n_failures;
    if (first_failure_tag) *first_failure_tag = h.first_failure_tag;
    return SKV_OK;
}
