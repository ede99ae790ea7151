/*
 * The snapshot format (docs/DESIGN.md section 11): CRC32C, little-endian fields, the model
 * fields of the CONF section, the tensors of a slot and the checks of its state, the
 * reader's primitives and its CONF reader, and skv_snapshot_config, which reads a snapshot's
 * config and the memory a load will allocate without loading it. lib/skv_snapshot.c writes
 * and reads whole caches with these.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "skv_numerics.h"
#include "skv_snapshot.h"

const unsigned char skv_snap_magic[8] = {'S', 'K', 'V', 'S', 'N', 'A', 'P', 0};

/* ---- CRC32C (Castagnoli, reflected polynomial 0x82F63B78), slicing by 8 ----------------- */

static uint32_t snap_crc_tab[8][256];
static pthread_once_t snap_crc_once = PTHREAD_ONCE_INIT;

/* Builds the eight lookup tables of the slicing-by-8 CRC32C. */
static void snap_crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        snap_crc_tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            snap_crc_tab[t][i] = (snap_crc_tab[t - 1][i] >> 8) ^ snap_crc_tab[0][snap_crc_tab[t - 1][i] & 0xff];
}

/* Continues a CRC32C: crc is the running value (0 to start), the result the CRC of everything so far. */
uint32_t skv_snap_crc(uint32_t crc, const void *data, size_t n)
{
    const unsigned char *p = data;
    uint32_t c = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo = c ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        c = snap_crc_tab[7][lo & 0xff] ^ snap_crc_tab[6][(lo >> 8) & 0xff] ^ snap_crc_tab[5][(lo >> 16) & 0xff] ^
            snap_crc_tab[4][lo >> 24] ^ snap_crc_tab[3][hi & 0xff] ^ snap_crc_tab[2][(hi >> 8) & 0xff] ^
            snap_crc_tab[1][(hi >> 16) & 0xff] ^ snap_crc_tab[0][hi >> 24];
    }
    while (n--) c = snap_crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return ~c;
}

void skv_snap_crc_ready(void) { pthread_once(&snap_crc_once, snap_crc_init); }


/* ---- little-endian fields ------------------------------------------------------------------ */

/* floats as their IEEE bit patterns: skv_bits_from_f32 and skv_f32_from_bits (skv_numerics.h) */

/* Whether this host stores integers little-endian (then tensor data needs no byte swaps). */
static int snap_host_le(void)
{
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* Converts n elements of esize bytes (2 or 4) between host order and little-endian, in place. */
void skv_snap_swap(void *data, size_t n, size_t esize)
{
    if (snap_host_le()) return;
    unsigned char *p = data;
    for (size_t i = 0; i < n; i++, p += esize)
        for (size_t a = 0, b = esize - 1; a < b; a++, b--) {
            unsigned char t = p[a];
            p[a] = p[b];
            p[b] = t;
        }
}


/* ---- the config fields, in format order ---------------------------------------------------- */


#define FLD(name, type, member) {name, type, offsetof(skv_config, member)}
const snap_field skv_snap_fields[] = {
    FLD("n_layers", F_I32, n_layers),
    FLD("n_q_heads", F_I32, n_q_heads),
    FLD("n_kv_heads", F_I32, n_kv_heads),
    FLD("head_dim", F_I32, head_dim),
    FLD("rank", F_I32, rank),
    FLD("chunk_size", F_I32, chunk_size),
    FLD("budget", F_I32, budget),
    FLD("n_outlier_chunks", F_I32, n_outlier_chunks),
    FLD("n_local_chunks", F_I32, n_local_chunks),
    FLD("rope.theta", F_F32, rope.theta),
    FLD("rope.rotary_dim", F_I32, rope.rotary_dim),
    FLD("rope.interleaved", F_I32, rope.interleaved),
    FLD("rope.llama3_scaling", F_I32, rope.llama3_scaling),
    FLD("rope.scaling_factor", F_F32, rope.scaling_factor),
    FLD("rope.low_freq_factor", F_F32, rope.low_freq_factor),
    FLD("rope.high_freq_factor", F_F32, rope.high_freq_factor),
    FLD("rope.original_max_position", F_I32, rope.original_max_position),
    FLD("attn_scale", F_F32, attn_scale),
    FLD("batch_size", F_I32, batch_size),
    FLD("max_prompt_len", F_I64, max_prompt_len),
    FLD("gen_capacity", F_I32, gen_capacity),
    FLD("factorize", F_I32, factorize),
    FLD("reproducible", F_I32, reproducible),
    /* version 2 */
    FLD("select_mode", F_I32, select_mode),
    FLD("select_mass", F_F32, select_mass),
    FLD("select_min_chunks", F_I32, select_min_chunks),
    FLD("rank_max", F_I32, rank_max),
    FLD("rank_error_target", F_F32, rank_error_target),
    FLD("dense_layers", F_I64, dense_layers),
    /* version 3 */
    FLD("select_candidates", F_I32, select_candidates),
    /* version 4 */
    FLD("model_kv_heads", F_I32, model_kv_heads),
    FLD("kv_head_begin", F_I32, kv_head_begin),
};
#undef FLD
const size_t skv_snap_n_fields = sizeof skv_snap_fields / sizeof skv_snap_fields[0];

/* The field's value as 64 bits (an int sign-extended, a float's bit pattern). */
uint64_t skv_snap_field_get(const skv_config *c, const snap_field *f)
{
    const char *p = (const char *)c + f->off;
    if (f->type == F_I64) {
        int64_t v;
        memcpy(&v, p, sizeof v);
        return (uint64_t)v;
    }
    if (f->type == F_F32) {
        float v;
        memcpy(&v, p, sizeof v);
        return skv_bits_from_f32(v);
    }
    int32_t v; /* int32_t fields and the enums (int) alike: both 4 bytes, checked at compile time below */
    memcpy(&v, p, sizeof v);
    return (uint64_t)(int64_t)v;
}

/* Sets the field from its 64-bit form (as snap_field_get gives it). */
void skv_snap_field_set(skv_config *c, const snap_field *f, uint64_t v)
{
    char *p = (char *)c + f->off;
    if (f->type == F_I64) {
        int64_t x = (int64_t)v;
        memcpy(p, &x, sizeof x);
    } else if (f->type == F_F32) {
        float x = skv_f32_from_bits((uint32_t)v);
        memcpy(p, &x, sizeof x);
    } else {
        int32_t x = (int32_t)(uint32_t)v;
        memcpy(p, &x, sizeof x);
    }
}

/* Writes a field's value into a message ("12", "0.5 (bits 0x3f000000)"). */
void skv_snap_field_fmt(char *buf, size_t cap, const snap_field *f, uint64_t v)
{
    if (f->type == F_F32)
        snprintf(buf, cap, "%.9g (bits 0x%08x)", (double)skv_f32_from_bits((uint32_t)v), (unsigned)(uint32_t)v);
    else
        snprintf(buf, cap, "%lld", (long long)(int64_t)v);
}

/* skv_config's enum fields are read and written as int32 (snap_field_get/set). */
typedef char snap_enum_is_4_bytes[(sizeof(skv_factorize_route) == 4 && sizeof(skv_select_mode) == 4 &&
                                   sizeof(int32_t) == 4) ? 1 : -1];
/* dense_layers (uint64_t) is read and written as int64, its bits unchanged */
typedef char snap_u64_is_8_bytes[sizeof(uint64_t) == sizeof(int64_t) ? 1 : -1];

/* The config a cache holds for *c's model fields: reproducible and select_candidates turn
   factorize AUTO into CANONICAL. */
static void snap_normalize(skv_config *c)
{
    if ((c->reproducible || c->select_candidates) && c->factorize == SKV_FACTORIZE_AUTO)
        c->factorize = SKV_FACTORIZE_CANONICAL;
}


/* ---- slot contents: the tensors of one (layer, sequence), in format order --------------- */

/*
 * The tensors a prefilled slot with state *s contributes, in format order, into t[];
 * returns their count. Only shapes come from *s, whose fields were checked (snap_check_state).
 */
int skv_snap_tensors(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, uint32_t v, snap_tensor *t)
{
    const size_t Hk = (size_t)g->n_kv_heads, D = (size_t)g->head_dim, r = (size_t)skv_cfg_rank(g), c = (size_t)g->chunk_size;
    const size_t O = (size_t)g->n_outlier_chunks, S = (size_t)lay->S, cap = (size_t)g->gen_capacity;
    const size_t n = (size_t)s->n, nc = (size_t)s->n_cand, nl = (size_t)s->n_local, ng = (size_t)s->n_gen;
    int k = 0;
#define T(nm, kd, wh, reg, rws, re, pt) \
    (t[k].name = nm, t[k].kind = kd, t[k].where = wh, t[k].region = reg, t[k].rows = rws, t[k].row_elems = re, \
     t[k].pitch = pt, k++)
    if (s->dense) { /* a dense layer: the prompt's exact keys and values, the generated tokens */
        T("dense_k", T_BF16, R_SLOT, lay->dn_k, 1, Hk * n * D, 0);
        T("dense_v", T_BF16, R_SLOT, lay->dn_v, 1, Hk * n * D, 0);
        T("generated_k", T_BF16, R_SLOT, lay->dn_gen_k, Hk, ng * D, cap * D);
        T("generated_v", T_BF16, R_SLOT, lay->dn_gen_v, Hk, ng * D, cap * D);
        return k;
    }
    T("U", T_BF16, R_SLOT, lay->u, 1, n * r, 0);
    T("W", T_BF16, R_SLOT, lay->w, 1, r * Hk * D, 0);
    T("landmarks", T_BF16, R_SLOT, lay->landmarks, 1, Hk * nc * D, 0);
    T("candidate_ids", T_CAND, R_SLOT, lay->cand_ids, 1, Hk * nc, 0);
    T("outlier_ids", T_OUT, R_SLOT, lay->out_ids, 1, Hk * O, 0);
    T("outlier_k", T_BF16, R_SLOT, lay->out_k, 1, Hk * O * c * D, 0);
    T("outlier_v", T_BF16, R_SLOT, lay->out_v, 1, Hk * O * c * D, 0);
    T("local_k", T_BF16, R_SLOT, lay->loc_k, 1, Hk * nl * D, 0);
    T("local_v", T_BF16, R_SLOT, lay->loc_v, 1, Hk * nl * D, 0);
    T("generated_k", T_BF16, R_SLOT, lay->gen_k, Hk, ng * D, cap * D);
    T("generated_v", T_BF16, R_SLOT, lay->gen_v, Hk, ng * D, cap * D);
    if (s->has_selection) {
        if (v >= 2) T("selection_count", T_SELCNT, R_SLOT, lay->sel_cnt, 1, Hk, 0);
        T("selection_idx", T_SELIDX, R_SLOT, lay->sel_idx, 1, Hk * S, 0);
        T("selection_ids", T_SELIDS, R_SLOT, lay->sel_ids, 1, Hk * S, 0);
    }
    T("values", T_BF16, R_VALUES, 0, 1, Hk * nc * c * D, 0);
#undef T
    return k;
}

/*
 * Whether a slot's state fields are one a cache of config g can be in; a reason into why.
 * Not prefilled: every other field 0. Prefilled: the prompt shape prefill would give for
 * n, 0 <= n_gen <= gen_capacity, has_selection == (n_gen > 0).
 */
int skv_snap_check_state(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, char *why, size_t cap)
{
    if (s->prefilled != 0 && s->prefilled != 1) return snprintf(why, cap, "prefilled = %d: must be 0 or 1", s->prefilled), 0;
    if (s->has_selection != 0 && s->has_selection != 1)
        return snprintf(why, cap, "has_selection = %d: must be 0 or 1", s->has_selection), 0;
    if (!s->prefilled) {
        if (s->n || s->n_chunks || s->n_cand || s->n_local || s->n_gen || s->has_selection || s->rank)
            return snprintf(why, cap, "a slot that is not prefilled has a nonzero shape, rank or step count"), 0;
        return 1;
    }
    if (s->n_gen < 0 || s->n_gen > g->gen_capacity)
        return snprintf(why, cap, "n_gen = %d: must be in [0, gen_capacity = %d]", s->n_gen, g->gen_capacity), 0;
    if (s->has_selection != (s->n_gen > 0))
        return snprintf(why, cap, "has_selection = %d with n_gen = %d: a selection exists exactly after a step",
                        s->has_selection, s->n_gen),
               0;
    if (s->dense) { /* a dense layer's slot: the whole prompt is its local window */
        if (s->n < 1 || s->n > g->max_prompt_len || s->n_chunks || s->n_cand || s->n_local != s->n || s->rank)
            return snprintf(why, cap,
                            "a dense layer's slot with n = %lld, n_chunks = %d, n_cand = %d, n_local = %d, rank = %d "
                            "(want 1 <= n <= max_prompt_len = %lld, 0, 0, n, 0)",
                            (long long)s->n, s->n_chunks, s->n_cand, s->n_local, s->rank,
                            (long long)g->max_prompt_len),
                   0;
        return 1;
    }
    if (g->rank > 0 ? s->rank != g->rank : (s->rank < 1 || s->rank > g->rank_max))
        return snprintf(why, cap, "rank = %d: config rank = %d, rank_max = %d", s->rank, g->rank, g->rank_max), 0;
    const int64_t c = g->chunk_size, lo = ((int64_t)g->n_outlier_chunks + lay->min_cand + g->n_local_chunks) * c;
    if (s->n < lo || s->n < s->rank || s->n > g->max_prompt_len)
        return snprintf(why, cap,
                        "n = %lld: a prefilled prompt has between max(%lld, rank = %d) and max_prompt_len = %lld tokens",
                        (long long)s->n, (long long)lo, s->rank, (long long)g->max_prompt_len),
               0;
    const int64_t N = s->n / c - g->n_local_chunks;
    if (s->n_chunks != N || s->n_cand != N - g->n_outlier_chunks || s->n_local != s->n - N * c)
        return snprintf(why, cap,
                        "n_chunks = %d, n_cand = %d, n_local = %d do not follow from n = %lld (want %lld, %lld, %lld)",
                        s->n_chunks, s->n_cand, s->n_local, (long long)s->n, (long long)N,
                        (long long)(N - g->n_outlier_chunks), (long long)(s->n - N * c)),
               0;
    return 1;
}

/* The payload bytes of a SLOT section with state *s into *bytes; 0 on size_t overflow. */
int skv_snap_slot_bytes(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, uint32_t v,
                        size_t *bytes)
{
    size_t total = SNAP_STATE_OF(v), e;
    if (!s->prefilled) return *bytes = total, 1;
    snap_tensor t[SNAP_MAX_TENSORS];
    int nt = skv_snap_tensors(g, lay, s, v, t);
    for (int i = 0; i < nt; i++)
        if (!skv_mul_size(t[i].rows, t[i].row_elems, &e) || !skv_mul_size(e, snap_esize(t[i].kind), &e) ||
            !skv_add_size(total, e, &total))
            return 0;
    *bytes = total;
    return 1;
}

/*
 * The states of all slots together are a cache's: any generated token means every slot is
 * prefilled (decode needs that), the sequences of a layer step together, and the layers
 * are at most one step apart.
 */
int skv_snap_check_states(const skv_config *g, const skv_seq_state *st, char *why, size_t cap)
{
    const int32_t L = g->n_layers, B = g->batch_size;
    int32_t lo = INT32_MAX, hi = -1, any_unprefilled = -1;
    for (int32_t l = 0; l < L; l++)
        for (int32_t b = 0; b < B; b++) {
            const skv_seq_state *s = &st[(size_t)l * B + b];
            if (!s->prefilled && any_unprefilled < 0) any_unprefilled = l * B + b;
            if (s->n_gen != st[(size_t)l * B].n_gen)
                return snprintf(why, cap, "layer %d: sequence %d has n_gen = %d, sequence 0 %d (a layer's sequences "
                                          "step together)", l, b, s->n_gen, st[(size_t)l * B].n_gen), 0;
            lo = s->n_gen < lo ? s->n_gen : lo;
            hi = s->n_gen > hi ? s->n_gen : hi;
        }
    if (hi > 0 && any_unprefilled >= 0)
        return snprintf(why, cap, "layer %d of sequence %d is not prefilled but other slots have decode steps",
                        any_unprefilled / B, any_unprefilled % B), 0;
    if (hi - lo > 1)
        return snprintf(why, cap, "layers hold between %d and %d generated tokens; they are at most one step apart",
                        lo, hi), 0;
    return 1;
}


/* ---- reader ------------------------------------------------------------------------------- */

/* Reads exactly n bytes (the caller checked that they are there); updates both checksums. */
skv_status skv_snap_in_read(snap_in *in, void *dst, size_t n, const char *what)
{
    if (n > in->size - in->pos)
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: truncated: %s at byte %zu needs %zu bytes, %zu remain",
                        what, in->pos, n, in->size - in->pos);
    if (in->f) {
        if (n && fread(dst, 1, n, in->f) != n) {
            if (ferror(in->f))
                return skv_fail(NULL, SKV_ERR_IO, "skv_cache_load: reading %s at byte %zu failed: %s", in->path,
                                in->pos, strerror(errno));
            return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: %s ended at byte %zu (it shrank while being read)",
                            in->path, in->pos);
        }
    } else if (n) {
        memcpy(dst, in->buf + in->pos, n);
    }
    in->file_crc = skv_snap_crc(in->file_crc, dst, n);
    in->sec_crc = skv_snap_crc(in->sec_crc, dst, n);
    in->pos += n;
    return SKV_OK;
}

/* Goes back to the start of the input (for the second pass). */
skv_status skv_snap_in_rewind(snap_in *in)
{
    in->pos = 0;
    in->file_crc = in->sec_crc = 0;
    if (in->f && fseek(in->f, 0, SEEK_SET) != 0)
        return skv_fail(NULL, SKV_ERR_IO, "skv_cache_load: fseek(%s): %s", in->path, strerror(errno));
    return SKV_OK;
}

/* Reads a section's head: the tag must be want and the payload length exactly len, all present. */
skv_status skv_snap_in_section(snap_in *in, uint32_t want, const char *name, uint64_t len, const char *where)
{
    unsigned char h[SNAP_SEC_HEAD];
    const size_t at = in->pos;
    in->sec_crc = 0;
    skv_status st = skv_snap_in_read(in, h, sizeof h, name);
    if (st) return st;
    const uint32_t tag = get_u32(h);
    if (tag != want)
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section %s%s at byte %zu: tag 0x%08x, want 0x%08x",
                        name, where, at, (unsigned)tag, (unsigned)want);
    if (get_u32(h + 4) != 0)
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section %s%s at byte %zu: reserved word 0x%08x, want 0",
                        name, where, at, (unsigned)get_u32(h + 4));
    const uint64_t got = get_u64(h + 8);
    if (got != len)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: section %s%s at byte %zu: payload length %llu, want %llu", name,
                        where, at, (unsigned long long)got, (unsigned long long)len);
    if (len + SNAP_SEC_CRC > (uint64_t)(in->size - in->pos))
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: truncated: section %s%s at byte %zu has %llu payload bytes, %zu remain", name,
                        where, at, (unsigned long long)len, in->size - in->pos);
    return SKV_OK;
}

/* Reads and compares a section's checksum. */
skv_status skv_snap_in_section_end(snap_in *in, const char *name, const char *where)
{
    const uint32_t want = in->sec_crc;
    const size_t at = in->pos;
    unsigned char b[4];
    skv_status st = skv_snap_in_read(in, b, sizeof b, "a section checksum");
    if (st) return st;
    if (get_u32(b) != want)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: section %s%s: checksum at byte %zu is 0x%08x, the data's CRC32C is 0x%08x",
                        name, where, at, (unsigned)get_u32(b), (unsigned)want);
    return SKV_OK;
}


/*
 * Reads the preamble and the CONF section into *snap (the defaults, then the model fields).
 * A config that fails validation is a corrupted snapshot (SKV_ERR_FORMAT).
 */
skv_status skv_snap_in_header(snap_in *in, skv_config *snap, skv_layout *lay)
{
    unsigned char b[SNAP_CONF_BYTES];
    skv_status st = in->size < 8 ? SKV_ERR_FORMAT : skv_snap_in_read(in, b, 8, "the magic");
    if (st == SKV_ERR_IO) return st;
    if (st || memcmp(b, skv_snap_magic, 8) != 0)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: not a snapshot: the first 8 bytes are not the magic \"SKVSNAP\\0\" (%zu bytes)",
                        in->size);
    if ((st = skv_snap_in_read(in, b, 8, "the format version"))) return st;
    const uint32_t v = get_u32(b);
    if (v < 1u || v > SNAP_VERSION)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: format version %u (byte 8); this library (%s) reads versions 1 to %u",
                        (unsigned)v, skv_version_string(), SNAP_VERSION);
    if (get_u32(b + 4) != 0)
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: flags (byte 12) = 0x%08x, version %u defines none",
                        (unsigned)get_u32(b + 4), (unsigned)v);
    in->version = v;
    if ((st = skv_snap_in_section(in, TAG_CONF, "CONF", SNAP_CONF_OF(v), ""))) return st;
    if ((st = skv_snap_in_read(in, b, SNAP_CONF_OF(v), "CONF"))) return st;
    if ((st = skv_snap_in_section_end(in, "CONF", ""))) return st;
    skv_config_init(snap, sizeof *snap); /* older versions: the fields they lack keep their defaults */
    size_t at = 0;
    for (size_t f = 0; f < SNAP_N_FIELDS_OF(v); f++) {
        skv_snap_field_set(snap, &skv_snap_fields[f], skv_snap_fields[f].type == F_I64 ? get_u64(b + at) : get_u32(b + at));
        at += snap_field_bytes(skv_snap_fields[f].type);
    }
    if ((snap->reproducible || snap->select_candidates) && snap->factorize != SKV_FACTORIZE_CANONICAL)
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section CONF: %s with factorize = %d "
                                              "(such a cache holds CANONICAL = 4)",
                        snap->reproducible ? "reproducible = 1" : "select_candidates > 0", (int)snap->factorize);
    char why[SKV_ERRMSG_CAP];
    snap->backend = SKV_BACKEND_REF; /* validation only; no backend is probed */
    if ((st = skv_layout_compute(why, snap, lay)))
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section CONF holds an invalid config: %s", why);
    snap->backend = SKV_BACKEND_AUTO;
    return SKV_OK;
}


/*
 * The config the loaded cache is created with: the snapshot's model fields and the runtime
 * fields of *cfg (or the defaults); a model field of *cfg that differs is SKV_ERR_INVALID_CONFIG.
 */
skv_status skv_snap_run_config(const skv_config *snap, const skv_config *cfg, skv_config *run)
{
    skv_config_init(run, sizeof *run);
    if (cfg) {
        skv_config mine;
        char why[SKV_ERRMSG_CAP];
        skv_status st = skv_config_import(why, cfg, &mine);
        if (st) return skv_fail(NULL, st, "skv_cache_load: cfg: %s", why);
        if (mine.value_dtype != SKV_VALUE_BF16) /* snapshots hold bf16 value stores */
            return skv_fail(NULL, SKV_ERR_UNSUPPORTED,
                            "skv_cache_load: cfg->value_dtype = %d: snapshots hold bf16 values; fp8 value stores "
                            "have no snapshot format yet", (int)mine.value_dtype);
        snap_normalize(&mine);
        /* factorize last: with reproducible differing, it differs only as a consequence */
        for (size_t k = 0; k < 2 * skv_snap_n_fields; k++) {
            const size_t f = k % skv_snap_n_fields;
            if ((strcmp(skv_snap_fields[f].name, "factorize") == 0) != (k >= skv_snap_n_fields)) continue;
            const uint64_t a = skv_snap_field_get(&mine, &skv_snap_fields[f]), b = skv_snap_field_get(snap, &skv_snap_fields[f]);
            if (a != b) {
                char va[64], vb[64];
                skv_snap_field_fmt(va, sizeof va, &skv_snap_fields[f], a);
                skv_snap_field_fmt(vb, sizeof vb, &skv_snap_fields[f], b);
                return skv_fail(NULL, SKV_ERR_INVALID_CONFIG,
                                "skv_cache_load: cfg->%s = %s, the snapshot's is %s (every model field must equal "
                                "the snapshot's; pass cfg = NULL to take them all)",
                                skv_snap_fields[f].name, va, vb);
            }
        }
        *run = mine;
    } else {
        for (size_t f = 0; f < skv_snap_n_fields; f++)
            skv_snap_field_set(run, &skv_snap_fields[f], skv_snap_field_get(snap, &skv_snap_fields[f]));
        run->backend = SKV_BACKEND_AUTO;
    }
    return SKV_OK;
}

/* ---- files, and the config query ----------------------------------------------------------- */

skv_status skv_snap_open(snap_in *in, const char *path, const char *fn)
{
    FILE *f = fopen(path, "rb");
    if (!f) return skv_fail(NULL, SKV_ERR_IO, "%s: cannot open %s: %s", fn, path, strerror(errno));
    struct stat sb;
    const char *bad = fstat(fileno(f), &sb) != 0 ? strerror(errno) : !S_ISREG(sb.st_mode) ? "not a regular file" : NULL;
    if (bad) {
        skv_status st = skv_fail(NULL, SKV_ERR_IO, "%s: %s: %s", fn, path, bad);
        fclose(f);
        return st;
    }
    const snap_in fresh = {NULL, f, path, (size_t)sb.st_size, 0, 0, 0, 0};
    *in = fresh;
    return SKV_OK;
}

/* skv_snapshot_config on an opened input: the preamble and CONF only. */
static skv_status snap_query(snap_in *in, const char *fn, skv_config *cfg, size_t *device_bytes, size_t *host_bytes)
{
    skv_snap_crc_ready();
    skv_config snap, run;
    skv_layout lay;
    skv_status st = skv_snap_in_header(in, &snap, &lay);
    if (st) return st;
    if ((st = skv_snap_run_config(&snap, NULL, &run))) return st;
    size_t dev = 0, host = 0;
    if ((st = skv_cache_memory(&run, &dev, &host)))
        return skv_fail(NULL, st, "%s: the snapshot's config: %s", fn, skv_last_error());
    if (cfg) {
        const size_t n = cfg->struct_size;
        run.struct_size = n;
        memcpy(cfg, &run, n);
    }
    if (device_bytes) *device_bytes = dev;
    if (host_bytes) *host_bytes = host;
    return SKV_OK;
}

/* cfg's struct_size is one this library knows (cfg NULL: nothing to check). */
static skv_status snap_query_cfg(const char *fn, const skv_config *cfg)
{
    skv_config probe;
    if (cfg && skv_config_init(&probe, cfg->struct_size) != SKV_OK)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT,
                        "%s: cfg->struct_size = %zu is not a skv_config size this library (%s) knows; "
                        "start from skv_config_default()",
                        fn, cfg->struct_size, skv_version_string());
    return SKV_OK;
}

SKV_API skv_status skv_snapshot_config(const char *path, skv_config *cfg, size_t *device_bytes, size_t *host_bytes)
{
    static const char fn[] = "skv_snapshot_config";
    if (!path) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: path is NULL", fn);
    skv_status st = snap_query_cfg(fn, cfg);
    if (st) return st;
    snap_in in;
    if ((st = skv_snap_open(&in, path, fn))) return st;
    st = snap_query(&in, fn, cfg, device_bytes, host_bytes);
    fclose(in.f);
    return st;
}

SKV_API skv_status skv_snapshot_config_buffer(const void *buf, size_t size, skv_config *cfg, size_t *device_bytes,
                                              size_t *host_bytes)
{
    static const char fn[] = "skv_snapshot_config_buffer";
    if (!buf) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: buf is NULL", fn);
    skv_status st = snap_query_cfg(fn, cfg);
    if (st) return st;
    snap_in in = {(const unsigned char *)buf, NULL, NULL, size, 0, 0, 0, 0};
    return snap_query(&in, fn, cfg, device_bytes, host_bytes);
}
