/*
 * synth.c - the synthetic workload of synth.h. Uses the public API
 * (shadowkv.h), CBLAS and the C library only; its random numbers are the
 * test suite's xoshiro256** stream (tests/common/testutil.c), copied here so
 * that a seed gives the same workload as before it moved out of tests/.
 */
#include "synth.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- random numbers: xoshiro256** seeded by splitmix64 ------------------------------------ */

typedef struct syn_rng { uint64_t s[4]; } syn_rng;

static uint64_t syn_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void syn_rng_seed(syn_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) r->s[i] = syn_splitmix64(&seed);
}

static uint64_t syn_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t syn_rng_u64(syn_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = syn_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = syn_rotl(s[3], 45);
    return result;
}

static double syn_rng_uniform(syn_rng *r) { return (double)(syn_rng_u64(r) >> 11) * 0x1.0p-53; } /* [0, 1) */

static double syn_rng_normal(syn_rng *r) /* N(0, 1), Box-Muller */
{
    double u1 = syn_rng_uniform(r), u2 = syn_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static int64_t syn_rng_range(syn_rng *r, int64_t lo, int64_t hi) /* [lo, hi] */
{
    if (hi <= lo) return lo;
    return lo + (int64_t)(syn_rng_u64(r) % (uint64_t)(hi - lo + 1));
}

/* ---- bf16, inline (the same rounding as skv_bf16_from_float: to nearest even) -------------- */

static inline float syn_bf16_to_f32(skv_bf16 h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline skv_bf16 syn_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (skv_bf16)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (skv_bf16)(u >> 16);
}

#define SYN_SAMPLE 512      /* ordinary tokens kept to calibrate the queries */
#define SYN_NOISE 0.01f     /* isotropic key noise (elements have RMS ~1) */
#define SYN_WITHIN 0.15f    /* per-token latent perturbation inside a chunk */
#define SYN_AR 0.7f         /* latent correlation of neighbouring chunks */
#define SYN_AR_INNOV 0.714f /* sqrt(1 - SYN_AR^2): keeps the walk at unit variance */
#define SYN_F0 0.01         /* RoPE frequency (rad/token) above which dims fade */
#define SYN_SINK_NORM 8.0f  /* sink norm, in units of an ordinary key's */

/* Approximately N(0,1) from one draw: Irwin-Hall sum of four 16-bit uniforms. */
static float fast_normal(syn_rng *r)
{
    uint64_t x = syn_rng_u64(r);
    float s = 0.0f;
    for (int i = 0; i < 4; i++, x >>= 16) s += (float)(x & 0xffff) * (1.0f / 65536.0f);
    return (s - 2.0f) * 1.7320508f;
}

static int rotary_dim(const skv_config *cfg)
{
    return cfg->rope.rotary_dim ? cfg->rope.rotary_dim : cfg->head_dim;
}

/* Members (a, b) of RoPE pair i. */
static void pair_dims(const skv_config *cfg, int i, int *a, int *b)
{
    int R = rotary_dim(cfg);
    *a = cfg->rope.interleaved ? 2 * i : i;
    *b = cfg->rope.interleaved ? 2 * i + 1 : i + R / 2;
}

/* Rotates one head vector by position p (inverse: by -p), with the tables. */
static void rotate(const skvs_workload *w, const float *x, int64_t p, int inverse, float *out)
{
    const skv_config *cfg = &w->cfg;
    int R = rotary_dim(cfg), half = R / 2;
    memcpy(out, x, sizeof(float) * (size_t)cfg->head_dim);
    for (int i = 0; i < half; i++) {
        int a, b;
        pair_dims(cfg, i, &a, &b);
        double cs = w->cos_tab[p * half + i], sn = inverse ? -w->sin_tab[p * half + i] : w->sin_tab[p * half + i];
        out[a] = (float)(x[a] * cs - x[b] * sn);
        out[b] = (float)(x[b] * cs + x[a] * sn);
    }
}

static double dotf(const float *a, const float *b, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

static double dotbf(const float *a, const skv_bf16 *b, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)a[i] * syn_bf16_to_f32(b[i]);
    return s;
}

skv_status skvs_workload_init(skvs_workload *w, const skv_config *cfg, int64_t max_pos,
                              skv_backend backend)
{
    memset(w, 0, sizeof *w);
    w->cfg = *cfg;
    w->max_pos = max_pos < 2 ? 2 : max_pos;
    w->backend = backend;
    w->scale = cfg->attn_scale > 0 ? cfg->attn_scale : 1.0f / sqrtf((float)cfg->head_dim);
    size_t len = skv_rope_table_len(&cfg->rope, cfg->head_dim, w->max_pos);
    if (!len) return SKV_ERR_INVALID_ARGUMENT;
    w->cos_tab = malloc(len * sizeof(float));
    w->sin_tab = malloc(len * sizeof(float));
    if (!w->cos_tab || !w->sin_tab) {
        skvs_workload_free(w);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    return skv_rope_table_build(&cfg->rope, cfg->head_dim, w->max_pos, w->cos_tab, w->sin_tab);
}

void skvs_workload_free(skvs_workload *w)
{
    free(w->cos_tab);
    free(w->sin_tab);
    w->cos_tab = w->sin_tab = NULL;
}

/* Orthonormal rows whose energy fades on fast-rotating RoPE pairs, like real keys. */
static void make_basis(const skvs_workload *w, syn_rng *r, int n_dirs, float *basis)
{
    const skv_config *cfg = &w->cfg;
    int D = cfg->head_dim, P = cfg->n_kv_heads * D, half = rotary_dim(cfg) / 2;
    double *damp = malloc(sizeof(double) * (size_t)D), *g = malloc(sizeof(double) * (size_t)n_dirs * P);
    for (int d = 0; d < D; d++) damp[d] = 1.0;
    for (int i = 0; i < half; i++) {
        int a, b;
        pair_dims(cfg, i, &a, &b);
        double f = atan2(w->sin_tab[half + i], w->cos_tab[half + i]); /* rad per token */
        damp[a] = damp[b] = 1.0 / sqrt(1.0 + (f / SYN_F0) * (f / SYN_F0));
    }
    for (int k = 0; k < n_dirs; k++) {
        double *gk = g + (size_t)k * P;
        for (int e = 0; e < P; e++) gk[e] = syn_rng_normal(r) * damp[e % D];
        for (int j = 0; j < k; j++) { /* modified Gram-Schmidt */
            const double *gj = g + (size_t)j * P;
            double pr = 0;
            for (int e = 0; e < P; e++) pr += gk[e] * gj[e];
            for (int e = 0; e < P; e++) gk[e] -= pr * gj[e];
        }
        double nn = 0;
        for (int e = 0; e < P; e++) nn += gk[e] * gk[e];
        nn = 1.0 / sqrt(nn);
        for (int e = 0; e < P; e++) {
            gk[e] *= nn;
            basis[(size_t)k * P + e] = (float)gk[e];
        }
    }
    free(damp);
    free(g);
}

/* A distinct chunk id in [1, N) not yet taken. */
static int32_t pick_chunk(syn_rng *r, int32_t N, unsigned char *kind, unsigned char mark)
{
    for (;;) {
        int32_t j = (int32_t)syn_rng_range(r, 1, N - 1);
        if (!kind[j]) {
            kind[j] = mark;
            return j;
        }
    }
}

enum { CH_PLAIN = 0, CH_OUTLIER = 1, CH_NEEDLE = 2 };

skv_status skvs_seq_generate(skvs_seq *s, const skvs_workload *w, int64_t n, int32_t max_steps,
                             int keep, uint64_t seed)
{
    const skv_config *cfg = &w->cfg;
    const int Hk = cfg->n_kv_heads, D = cfg->head_dim, c = cfg->chunk_size, P = Hk * D;
    const int64_t n_chunks_all = (n + c - 1) / c;
    const int32_t N = (int32_t)(n / c) - cfg->n_local_chunks;

    memset(s, 0, sizeof *s);
    s->w = w;
    s->n = n;
    s->max_steps = max_steps;
    s->keep = keep;
    s->seed = seed;
    if (N < 8) return SKV_ERR_PROMPT_TOO_SHORT;
    if (D > 1024) return SKV_ERR_INVALID_ARGUMENT; /* fixed-size head buffers */
    if (n + max_steps > w->max_pos || max_steps < 0) return SKV_ERR_INVALID_ARGUMENT;

    syn_rng r;
    syn_rng_seed(&r, seed);
    s->m_bg = P / 4 < 40 ? P / 4 : 40;
    s->m_nd = P / 8 < 24 ? P / 8 : 24;
    s->n_dirs = 1 + s->m_bg + s->m_nd + 1;
    s->n_sinks = c >= 8 ? 4 : (c + 1) / 2;
    s->n_needles = max_steps < 1 ? 1 : max_steps > 64 ? 64 : max_steps;
    if (s->n_needles > (N - 1) / 4) s->n_needles = (N - 1) / 4;
    int32_t n_planted = cfg->n_outlier_chunks / 2;
    if (n_planted > (N - 1) / 4) n_planted = (N - 1) / 4;

    s->k_pre = malloc(sizeof(skv_bf16) * (size_t)n * P);
    s->k_post = malloc(sizeof(skv_bf16) * (size_t)n * P);
    s->v = malloc(sizeof(skv_bf16) * (size_t)n * P);
    s->basis = malloc(sizeof(float) * (size_t)s->n_dirs * P);
    s->sigma = malloc(sizeof(float) * (size_t)s->m_bg);
    s->z_last = malloc(sizeof(float) * (size_t)s->m_bg);
    s->needle_chunk = malloc(sizeof(int32_t) * (size_t)s->n_needles);
    s->needle_u = malloc(sizeof(float) * (size_t)s->n_needles * P);
    s->sink_k = calloc((size_t)P, sizeof(float));
    s->sample_k = malloc(sizeof(skv_bf16) * SYN_SAMPLE * (size_t)P);
    unsigned char *kind = calloc((size_t)n_chunks_all, 1);
    const int64_t blk = 2048;
    float *coef = malloc(sizeof(float) * (size_t)blk * s->n_dirs);
    float *kf = malloc(sizeof(float) * (size_t)blk * P);
    float *z = calloc((size_t)s->m_bg, sizeof(float));
    if (!s->k_pre || !s->k_post || !s->v || !s->basis || !s->sigma || !s->z_last || !s->needle_chunk ||
        !s->needle_u || !s->sink_k || !s->sample_k || !kind || !coef || !kf || !z) {
        free(kind), free(coef), free(kf), free(z);
        skvs_seq_free(s);
        return SKV_ERR_OUT_OF_MEMORY;
    }

    make_basis(w, &r, s->n_dirs, s->basis);
    /* spectrum: sigma_k ~ exp(-k/10), background energy 0.75 of an element-RMS-1 row */
    double e2 = 0;
    for (int k = 0; k < s->m_bg; k++) e2 += exp(-k / 5.0);
    for (int k = 0; k < s->m_bg; k++) s->sigma[k] = (float)sqrt(0.75 * P / e2 * exp(-k / 5.0));
    s->a_mu = 0.5f * sqrtf((float)P);
    const float sd_tail = 0.5f * s->sigma[s->m_bg - 1];
    const float a_nd = 0.9f * sqrtf((float)P / (float)s->m_nd);

    for (int32_t i = 0; i < n_planted; i++) pick_chunk(&r, N, kind, CH_OUTLIER);
    for (int32_t i = 0; i < s->n_needles; i++) s->needle_chunk[i] = pick_chunk(&r, N, kind, CH_NEEDLE);

    /* ordinary tokens: K_pre = coef x basis + noise, in blocks of rows */
    const int m_bg = s->m_bg, nd0 = 1 + m_bg, sink = s->n_dirs - 1;
    int64_t chunk_of_z = -1;
    for (int64_t t0 = 0; t0 < n; t0 += blk) {
        int64_t nb = n - t0 < blk ? n - t0 : blk;
        for (int64_t i = 0; i < nb; i++) {
            int64_t t = t0 + i, j = t / c;
            float *cf = coef + i * s->n_dirs;
            if (j != chunk_of_z) { /* AR(1) walk of chunk latents, stationary N(0, 1) */
                for (int k = 0; k < m_bg; k++)
                    z[k] = j ? SYN_AR * z[k] + SYN_AR_INNOV * (float)syn_rng_normal(&r) : (float)syn_rng_normal(&r);
                chunk_of_z = j;
            }
            cf[0] = s->a_mu;
            for (int k = 0; k < m_bg; k++)
                cf[1 + k] = s->sigma[k] * (kind[j] == CH_OUTLIER ? fast_normal(&r) : z[k] + SYN_WITHIN * fast_normal(&r));
            for (int k = 0; k < s->m_nd; k++) cf[nd0 + k] = sd_tail * fast_normal(&r);
            cf[sink] = t < s->n_sinks ? SYN_SINK_NORM * sqrtf((float)P) : 0.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nb, P, s->n_dirs, 1.0f, coef,
                    s->n_dirs, s->basis, P, 0.0f, kf, P);
        skv_bf16 *dst = s->k_pre + t0 * P;
        for (int64_t e = 0; e < nb * P; e++) dst[e] = syn_f32_to_bf16(kf[e] + SYN_NOISE * fast_normal(&r));
    }
    memcpy(s->z_last, z, sizeof(float) * (size_t)m_bg);

    /* needles: post-RoPE keys u_h at every token; u = RoPE(x, chunk centre), x on needle dims */
    for (int32_t i = 0; i < s->n_needles; i++) {
        float *x = kf, *u = s->needle_u + (size_t)i * P, tmp[1024];
        int64_t j = s->needle_chunk[i], pc = j * c + c / 2;
        memset(x, 0, sizeof(float) * (size_t)P);
        for (int k = 0; k < s->m_nd; k++) {
            float a = a_nd * (float)syn_rng_normal(&r);
            const float *b = s->basis + (size_t)(nd0 + k) * P;
            for (int e = 0; e < P; e++) x[e] += a * b[e];
        }
        for (int h = 0; h < Hk; h++) {
            rotate(w, x + h * D, pc, 0, u + h * D);
            for (int64_t t = j * c; t < (j + 1) * c; t++) {
                rotate(w, u + h * D, t, 1, tmp);
                for (int d = 0; d < D; d++) s->k_pre[(t * Hk + h) * D + d] = syn_f32_to_bf16(tmp[d]);
            }
        }
    }

    for (size_t e = 0; e < (size_t)n * P; e++) s->v[e] = syn_f32_to_bf16(fast_normal(&r));
    skv_status st = skv_op_rope(w->backend, &cfg->rope, D, n, Hk, 0, w->cos_tab, w->sin_tab, s->k_pre, s->k_post);

    for (int t = 0; t < s->n_sinks; t++)
        for (int e = 0; e < P; e++) s->sink_k[e] += syn_bf16_to_f32(s->k_post[(size_t)t * P + e]) / (float)s->n_sinks;
    for (int i = 0; i < SYN_SAMPLE; i++) {
        int64_t t;
        do t = syn_rng_range(&r, s->n_sinks, n - 1);
        while (kind[t / c] == CH_NEEDLE);
        memcpy(s->sample_k + (size_t)i * P, s->k_post + t * P, sizeof(skv_bf16) * (size_t)P);
    }
    s->n_sample = SYN_SAMPLE;
    free(kind), free(coef), free(kf), free(z);
    if (st) skvs_seq_free(s);
    return st;
}

skv_status skvs_seq_release(skvs_seq *s)
{
    skv_status st = SKV_OK;
    const size_t P = (size_t)s->w->cfg.n_kv_heads * s->w->cfg.head_dim, rows = (size_t)(s->n + s->max_steps);
    if (s->keep && s->k_post && !s->ref_k) {
        s->ref_k = malloc(sizeof(float) * rows * P);
        s->ref_v = malloc(sizeof(float) * rows * P);
        if (!s->ref_k || !s->ref_v) {
            free(s->ref_k), free(s->ref_v);
            s->ref_k = s->ref_v = NULL;
            st = SKV_ERR_OUT_OF_MEMORY;
        } else {
            for (size_t e = 0; e < (size_t)s->n * P; e++) {
                s->ref_k[e] = syn_bf16_to_f32(s->k_post[e]);
                s->ref_v[e] = syn_bf16_to_f32(s->v[e]);
            }
        }
    }
    free(s->k_pre), free(s->k_post), free(s->v);
    s->k_pre = s->k_post = s->v = NULL;
    return st;
}

void skvs_seq_free(skvs_seq *s)
{
    if (s->w) {
        s->keep = 0;
        skvs_seq_release(s);
    }
    free(s->ref_k), free(s->ref_v);
    free(s->basis), free(s->sigma), free(s->z_last), free(s->needle_chunk), free(s->needle_u);
    free(s->sink_k), free(s->sample_k), free(s->outliers);
    memset(s, 0, sizeof *s);
}

skv_status skvs_seq_attach(skvs_seq *s, skv_cache *cache, int32_t layer, int32_t seq_idx)
{
    const skv_config *cfg = &s->w->cfg;
    skv_seq_info info;
    skv_status st = skv_cache_seq_info(cache, layer, seq_idx, &info);
    if (st) return st;
    s->n_chunks = info.n_chunks;
    free(s->outliers);
    s->outliers = malloc(sizeof(int32_t) * (size_t)cfg->n_kv_heads * cfg->n_outlier_chunks + 1);
    if (!s->outliers) return SKV_ERR_OUT_OF_MEMORY;
    for (int32_t h = 0; h < cfg->n_kv_heads && !st; h++)
        st = skv_cache_outliers(cache, layer, seq_idx, h, s->outliers + h * cfg->n_outlier_chunks);
    return st;
}

/* ---- decode steps ----------------------------------------------------------- */

/* Mean and variance of l_t = g*a_t + b*b_t + al*c_t over the sample. */
static void moments(const double *a, const double *b, const double *cc, int m, double g, double be,
                    double al, double *mean, double *var)
{
    double s1 = 0, s2 = 0;
    for (int t = 0; t < m; t++) {
        double l = g * a[t] + be * b[t] + al * cc[t];
        s1 += l;
        s2 += l * l;
    }
    *mean = s1 / m;
    *var = s2 / m - *mean * *mean;
}

static double logaddexp(double x, double y)
{
    double m = x > y ? x : y;
    return m + log(exp(x - m) + exp(y - m));
}

/* The tokens of decode step `step` drawn from RNG stream `stream` (0: skvs_step's); with
   append, k and v also go to ref_k / ref_v. */
static skv_status step_tokens(skvs_seq *s, int32_t step, uint64_t stream, int append, skv_bf16 *q, skv_bf16 *k,
                              skv_bf16 *v, int32_t *needle)
{
    const skvs_workload *w = s->w;
    const skv_config *cfg = &w->cfg;
    const int Hq = cfg->n_q_heads, Hk = cfg->n_kv_heads, D = cfg->head_dim, P = Hk * D;
    const int G = Hq / Hk, c = cfg->chunk_size, m = s->n_sample, m_bg = s->m_bg;
    const int64_t pos = s->n + step;
    const double sc = w->scale;
    syn_rng r;
    syn_rng_seed(&r, s->seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(step + 1)) ^ (0xd1b54a32d192ed03ull * stream));

    /* the new token: an ordinary key near the last prompt chunk's latent */
    float *row = malloc(sizeof(float) * (size_t)P), *xq = malloc(sizeof(float) * (size_t)P);
    const int nn = s->n_needles;
    double *a = malloc(sizeof(double) * (3 * (size_t)m + 3 * (size_t)nn));
    skv_bf16 *kpre = calloc((size_t)P, sizeof(skv_bf16)); /* calloc: gcc cannot see every element is set */
    if (!row || !xq || !a || !kpre) {
        free(row), free(xq), free(a), free(kpre);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    /* logits on the sample from the noise direction (a), the needle (bb), the
       sinks (cc); dots of the other needles with the needle, sinks, noise */
    double *bb = a + m, *cc = a + 2 * m, *o_u = cc + m, *o_s = o_u + nn, *o_q = o_s + nn;
    for (int e = 0; e < P; e++) row[e] = s->a_mu * s->basis[e];
    for (int j = 0; j < m_bg; j++) {
        float cf = s->sigma[j] * (SYN_AR * s->z_last[j] + SYN_AR_INNOV * fast_normal(&r));
        for (int e = 0; e < P; e++) row[e] += cf * s->basis[(size_t)(1 + j) * P + e];
    }
    for (int e = 0; e < P; e++) kpre[e] = syn_f32_to_bf16(row[e] + SYN_NOISE * fast_normal(&r));
    skv_status st = skv_op_rope(w->backend, &cfg->rope, D, 1, Hk, pos, w->cos_tab, w->sin_tab, kpre, k);
    for (int e = 0; e < P; e++) v[e] = syn_f32_to_bf16(fast_normal(&r));
    if (st) goto done;
    if (append && s->ref_k)
        for (int e = 0; e < P; e++) {
            s->ref_k[(size_t)pos * P + e] = syn_bf16_to_f32(k[e]);
            s->ref_v[(size_t)pos * P + e] = syn_bf16_to_f32(v[e]);
        }

    const int ni = step % s->n_needles;
    *needle = s->needle_chunk[ni];
    const double n_bg = (double)(pos + 1) - (double)c * s->n_needles - s->n_sinks;
    for (int h = 0; h < Hk; h++) {
        const float *u = s->needle_u + (size_t)ni * P + h * D, *sk = s->sink_k + h * D;
        for (int t = 0; t < m; t++) {
            const skv_bf16 *kt = s->sample_k + (size_t)t * P + h * D;
            bb[t] = sc * dotbf(u, kt, D);
            cc[t] = sc * dotbf(sk, kt, D);
        }
        const double nu = sc * dotf(u, u, D), su = sc * dotf(sk, u, D), ss = sc * dotf(sk, sk, D);
        for (int o = 0; o < nn; o++) {
            o_u[o] = sc * dotf(u, s->needle_u + (size_t)o * P + h * D, D);
            o_s[o] = sc * dotf(sk, s->needle_u + (size_t)o * P + h * D, D);
        }
        for (int g = h * G; g < (h + 1) * G; g++) {
            const double f_n = 0.25 + 0.35 * syn_rng_uniform(&r), f_s = 0.05 + 0.15 * syn_rng_uniform(&r);
            const double f_b = 1.0 - f_n - f_s, sig = 2.5 + 0.7 * syn_rng_uniform(&r);
            /* background direction: a random latent, roped at the query position */
            memset(xq, 0, sizeof(float) * (size_t)D);
            for (int j = 0; j < m_bg; j++) {
                float cf = s->sigma[j] * (float)syn_rng_normal(&r);
                const float *b = s->basis + (size_t)(1 + j) * P + h * D;
                for (int d = 0; d < D; d++) xq[d] += cf * b[d];
            }
            float qn[1024];
            rotate(w, xq, pos, 0, qn);
            for (int t = 0; t < m; t++) a[t] = sc * dotbf(qn, s->sample_k + (size_t)t * P + h * D, D);
            double mean, var, gamma, beta = 0, alpha = 0;
            moments(a, bb, cc, m, 1.0, 0, 0, &mean, &var);
            gamma = var > 0 ? sig / sqrt(var) : 0.0;
            const double nq = sc * dotf(qn, u, D), sq = sc * dotf(qn, sk, D);
            for (int o = 0; o < nn; o++) o_q[o] = sc * dotf(qn, s->needle_u + (size_t)o * P + h * D, D);
            for (int it = 0; it < 4; it++) {
                /* log-partition of the background, Gaussian logits, plus the other needles */
                moments(a, bb, cc, m, gamma, beta, alpha, &mean, &var);
                double lz = log(n_bg > 1 ? n_bg : 1) + mean + 0.5 * var;
                for (int o = 0; o < nn; o++)
                    if (o != ni) lz = logaddexp(lz, log((double)c) + gamma * o_q[o] + beta * o_u[o] + alpha * o_s[o]);
                double l_n = lz + log(f_n / f_b) - log((double)c);
                double l_s = lz + log(f_s / f_b) - log((double)s->n_sinks);
                beta = (l_n - gamma * nq - alpha * su) / nu;
                if (beta < 0) beta = 0;
                alpha = (l_s - gamma * sq - beta * su) / ss; /* < 0 cancels what the rest gives the sinks */
            }
            for (int d = 0; d < D; d++)
                q[(size_t)g * D + d] = syn_f32_to_bf16((float)(gamma * qn[d] + beta * u[d] + alpha * sk[d]));
        }
    }
done:
    free(row), free(xq), free(a), free(kpre);
    return st;
}

skv_status skvs_step(skvs_seq *s, skv_bf16 *q, skv_bf16 *k, skv_bf16 *v, int32_t *needle)
{
    if (s->n_gen >= s->max_steps) return SKV_ERR_CAPACITY;
    skv_status st = step_tokens(s, s->n_gen, 0, 1, q, k, v, needle);
    if (!st) s->n_gen++;
    return st;
}

skv_status skvs_step_stream(skvs_seq *s, int32_t step, uint64_t stream, skv_bf16 *q, skv_bf16 *k, skv_bf16 *v,
                            int32_t *needle)
{
    if (step < 0 || step >= s->max_steps) return SKV_ERR_CAPACITY;
    return step_tokens(s, step, stream, 0, q, k, v, needle);
}

/* ---- references ------------------------------------------------------------- */

/* Rearranges val (and idx) so that val[0..k) are the k largest. */
static void select_top(double *val, int32_t *idx, int64_t m, int64_t k)
{
    int64_t lo = 0, hi = m - 1;
    if (k <= 0 || k >= m) return;
    while (lo < hi) {
        double piv = val[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (val[i] > piv) i++;
            while (val[j] < piv) j--;
            if (i <= j) {
                double tv = val[i];
                val[i] = val[j], val[j] = tv;
                if (idx) {
                    int32_t ti = idx[i];
                    idx[i] = idx[j], idx[j] = ti;
                }
                i++, j--;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

skv_status skvs_reference(const skvs_seq *s, int32_t n_gen, const skv_bf16 *q, int32_t needle,
                          const int32_t *selected, float *out_full, float *out_oracle, float *out_selected,
                          skvs_ref_stats *st)
{
    const skv_config *cfg = &s->w->cfg;
    const int Hq = cfg->n_q_heads, Hk = cfg->n_kv_heads, D = cfg->head_dim, P = Hk * D;
    const int G = Hq / Hk, c = cfg->chunk_size, O = cfg->n_outlier_chunks, S = cfg->budget / c;
    const int64_t n = s->n, T = n + n_gen, ctx = (int64_t)s->n_chunks * c, budget = cfg->budget;
    const int64_t top_n = budget < T ? budget : T;
    if (!s->ref_k || !s->outliers || n_gen < 0 || n_gen > s->n_gen) return SKV_ERR_INVALID_ARGUMENT;
    float *qf = malloc(sizeof(float) * (size_t)G * D), *sf = malloc(sizeof(float) * (size_t)G * T);
    float *of = malloc(sizeof(float) * (size_t)G * D);
    double *p = malloc(sizeof(double) * (size_t)G * T), *val = malloc(sizeof(double) * (size_t)T);
    double *acc = malloc(sizeof(double) * 2 * ((size_t)G * D + G));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)T);
    unsigned char *in = malloc((size_t)T); /* bit 0: oracle set, bit 1: selected set */
    skv_status ret = SKV_OK;
    if (!qf || !sf || !of || !p || !val || !acc || !idx || !in) ret = SKV_ERR_OUT_OF_MEMORY;
    if (st) memset(st, 0, sizeof *st);

    for (int h = 0; h < Hk && !ret; h++) {
        const float *kh = s->ref_k + h * D, *vh = s->ref_v + h * D; /* [T, D], row stride P */
        /* softmax probabilities p[g][t] of the G query heads of KV head h */
        for (int e = 0; e < G * D; e++) qf[e] = syn_bf16_to_f32(q[(size_t)h * G * D + e]);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, G, (int)T, D, s->w->scale, qf, D, kh, P, 0.0f, sf,
                    (int)T);
        for (int g = 0; g < G; g++) {
            const float *sg = sf + (size_t)g * T;
            double *pg = p + (size_t)g * T, mx = sg[0], z = 0;
            for (int64_t t = 1; t < T; t++) mx = sg[t] > mx ? sg[t] : mx;
            for (int64_t t = 0; t < T; t++) z += (pg[t] = exp(sg[t] - mx));
            for (int64_t t = 0; t < T; t++) sf[(size_t)g * T + t] = (float)(pg[t] /= z);
        }
        /* dense output */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, G, D, (int)T, 1.0f, sf, (int)T, vh, P, 0.0f, of, D);
        /* sets: outliers, local window and generated tokens always; the oracle
           adds the top-budget candidates by group max, "selected" the chunks given */
        for (int64_t t = 0; t < T; t++) in[t] = t >= ctx ? 3 : 0;
        for (int o = 0; o < O; o++)
            for (int64_t t = (int64_t)s->outliers[h * O + o] * c, e = t + c; t < e; t++) in[t] = 3;
        if (selected)
            for (int i = 0; i < S; i++) /* -1: past the head's count (SKV_SELECT_MASS) */
                for (int64_t t = (int64_t)selected[h * S + i] * c, e = t + c; t >= 0 && t < e; t++) in[t] |= 2;
        int64_t m = 0;
        for (int64_t t = 0; t < ctx; t++) {
            if (in[t] & 1) continue;
            double best = 0;
            for (int g = 0; g < G; g++) best = fmax(best, p[(size_t)g * T + t]);
            val[m] = best;
            idx[m++] = (int32_t)t;
        }
        select_top(val, idx, m, budget);
        for (int64_t i = 0; i < (budget < m ? budget : m); i++) in[idx[i]] |= 1;
        memset(acc, 0, sizeof(double) * 2 * ((size_t)G * D + G));
        double *z = acc + 2 * G * D;
        for (int64_t t = 0; t < T; t++) {
            if (!in[t]) continue;
            const float *vt = vh + (size_t)t * P;
            for (int k = 0; k < 2; k++) {
                if (!(in[t] >> k & 1)) continue;
                for (int g = 0; g < G; g++) {
                    double pt = p[(size_t)g * T + t], *ag = acc + ((size_t)k * G + g) * D;
                    z[k * G + g] += pt;
                    for (int d = 0; d < D; d++) ag[d] += pt * vt[d];
                }
            }
        }
        float *outs[2] = {out_oracle, selected ? out_selected : NULL};
        for (int g = 0; g < G; g++) {
            size_t i = (size_t)h * G + g;
            if (out_full) memcpy(out_full + i * D, of + (size_t)g * D, sizeof(float) * (size_t)D);
            for (int k = 0; k < 2; k++)
                if (outs[k])
                    for (int d = 0; d < D; d++)
                        outs[k][i * D + d] = (float)(acc[((size_t)k * G + g) * D + d] / z[k * G + g]);
            if (!st) continue;
            /* concentration: share of the top-budget tokens, the needle, the sinks */
            double *pg = p + (size_t)g * T, top = 0;
            memcpy(val, pg, sizeof(double) * (size_t)T);
            select_top(val, NULL, T, top_n);
            for (int64_t t = 0; t < top_n; t++) top += val[t];
            st->topk_mass += top / Hq;
            if (needle >= 0)
                for (int64_t t = (int64_t)needle * c; t < (int64_t)(needle + 1) * c; t++) st->needle_mass += pg[t] / Hq;
            for (int t = 0; t < s->n_sinks; t++) st->sink_mass += pg[t] / Hq;
        }
    }
    free(qf), free(sf), free(of), free(p), free(val), free(acc), free(idx), free(in);
    return ret;
}

double skvs_rel_err(const float *x, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)x[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
