/*
 * Cache snapshots: skv_cache_save / skv_cache_load and their buffer variants
 * (docs/DESIGN.md section 11 specifies the format).
 *
 * A snapshot is a preamble (magic, format version, flags), a CONF section with the
 * model fields of the config one by one, one SLOT section per (layer, sequence) in
 * slot order with its state and the used part of each of its tensors, and an END
 * section with the file's size and the CRC32C of everything before it. Every section
 * is tag, reserved word, payload length, payload, CRC32C of the four. All fields are
 * fixed-width little-endian; no C struct is ever copied as bytes.
 *
 * Saving reads the arenas through the backend's copy2d (device memory for cuda) in
 * bounded chunks through a host staging buffer, so a snapshot of any size needs
 * O(1 MiB) of scratch besides the id lists of one slot. Loading runs the same reader
 * twice: a checking pass over the whole input (every length against the bytes present,
 * every checksum, every state and id), which allocates nothing but bounded scratch, then,
 * only when it passes, the cache is created and the copying pass runs the same checks
 * again while it writes the arenas (a file that changes in between fails cleanly).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "skv_internal.h"

#define SNAP_VERSION 1u
#define SNAP_PREAMBLE 16u      /* magic[8], u32 version, u32 flags */
#define SNAP_SEC_HEAD 16u      /* u32 tag, u32 reserved, u64 payload length */
#define SNAP_SEC_CRC 4u        /* u32 CRC32C of head + payload */
#define SNAP_CONF_BYTES 96u    /* version 1's CONF payload */
#define SNAP_STATE_BYTES 40u   /* a SLOT payload's state fields */
#define SNAP_END_BYTES 16u     /* u64 file size, u32 CRC32C of the bytes before END, u32 reserved */
#define SNAP_STAGE (1u << 20)  /* host staging buffer for tensor data */

static const unsigned char snap_magic[8] = {'S', 'K', 'V', 'S', 'N', 'A', 'P', 0};
#define SNAP_TAG(a, b, c, d) ((uint32_t)(a) | (uint32_t)(b) << 8 | (uint32_t)(c) << 16 | (uint32_t)(d) << 24)
#define TAG_CONF SNAP_TAG('C', 'O', 'N', 'F')
#define TAG_SLOT SNAP_TAG('S', 'L', 'O', 'T')
#define TAG_END SNAP_TAG('E', 'N', 'D', 0)

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
static uint32_t snap_crc(uint32_t crc, const void *data, size_t n)
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

/* ---- little-endian fields ------------------------------------------------------------------ */

/* v as 4 little-endian bytes at p. */
static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
/* v as 8 little-endian bytes at p. */
static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
/* The little-endian u32 at p. */
static uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
/* The little-endian u64 at p. */
static uint64_t get_u64(const unsigned char *p) { return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32; }
/* A float's IEEE bit pattern. */
static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
/* The float of an IEEE bit pattern. */
static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Whether this host stores integers little-endian (then tensor data needs no byte swaps). */
static int snap_host_le(void)
{
    const uint16_t one = 1;
    unsigned char b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* Converts n elements of esize bytes (2 or 4) between host order and little-endian, in place. */
static void snap_swap(void *data, size_t n, size_t esize)
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

/* One model field of skv_config: its name in messages and format, and where it is. */
typedef enum { F_I32, F_I64, F_F32 } snap_ftype;
typedef struct {
    const char *name;
    snap_ftype type;
    size_t off;
} snap_field;

#define FLD(name, type, member) {name, type, offsetof(skv_config, member)}
static const snap_field snap_fields[] = {
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
};
#undef FLD
#define SNAP_N_FIELDS (sizeof snap_fields / sizeof snap_fields[0])

/* Bytes of one field in the format. */
static size_t snap_field_bytes(snap_ftype t) { return t == F_I64 ? 8 : 4; }

/* The field's value as 64 bits (an int sign-extended, a float's bit pattern). */
static uint64_t snap_field_get(const skv_config *c, const snap_field *f)
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
        return f32_bits(v);
    }
    int32_t v; /* int32_t fields and the enums (int) alike: both 4 bytes, checked at compile time below */
    memcpy(&v, p, sizeof v);
    return (uint64_t)(int64_t)v;
}

/* Sets the field from its 64-bit form (as snap_field_get gives it). */
static void snap_field_set(skv_config *c, const snap_field *f, uint64_t v)
{
    char *p = (char *)c + f->off;
    if (f->type == F_I64) {
        int64_t x = (int64_t)v;
        memcpy(p, &x, sizeof x);
    } else if (f->type == F_F32) {
        float x = bits_f32((uint32_t)v);
        memcpy(p, &x, sizeof x);
    } else {
        int32_t x = (int32_t)(uint32_t)v;
        memcpy(p, &x, sizeof x);
    }
}

/* Writes a field's value into a message ("12", "0.5 (bits 0x3f000000)"). */
static void snap_field_fmt(char *buf, size_t cap, const snap_field *f, uint64_t v)
{
    if (f->type == F_F32)
        snprintf(buf, cap, "%.9g (bits 0x%08x)", (double)bits_f32((uint32_t)v), (unsigned)(uint32_t)v);
    else
        snprintf(buf, cap, "%lld", (long long)(int64_t)v);
}

/* skv_config's enum fields are read and written as int32 (snap_field_get/set). */
typedef char snap_enum_is_4_bytes[(sizeof(skv_factorize_route) == 4 && sizeof(int32_t) == 4) ? 1 : -1];

/* The config a cache holds for *c's model fields: reproducible turns factorize AUTO into CANONICAL. */
static void snap_normalize(skv_config *c)
{
    if (c->reproducible && c->factorize == SKV_FACTORIZE_AUTO) c->factorize = SKV_FACTORIZE_CANONICAL;
}

/* ---- slot contents: the tensors of one (layer, sequence), in format order --------------- */

enum { T_BF16, T_CAND, T_OUT, T_SELIDX, T_SELIDS }; /* kinds: bf16 data, or int32 ids of one role */
enum { R_SLOT, R_VALUES };                         /* where a tensor lives: a per-slot region, or the value store */

/* One tensor of a slot: rows of row_elems elements, row r at element r * pitch of its region. */
typedef struct {
    const char *name;
    int kind, where;
    size_t region; /* byte offset in the slot's device region (R_SLOT) */
    size_t rows, row_elems, pitch;
} snap_tensor;

#define SNAP_MAX_TENSORS 15

/* Element size of a tensor kind. */
static size_t snap_esize(int kind) { return kind == T_BF16 ? sizeof(skv_bf16) : sizeof(int32_t); }

/*
 * The tensors a prefilled slot with state *s contributes, in format order, into t[];
 * returns their count. Only shapes come from *s, whose fields were checked (snap_check_state).
 */
static int snap_tensors(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, snap_tensor *t)
{
    const size_t Hk = (size_t)g->n_kv_heads, D = (size_t)g->head_dim, r = (size_t)g->rank, c = (size_t)g->chunk_size;
    const size_t O = (size_t)g->n_outlier_chunks, S = (size_t)lay->S, cap = (size_t)g->gen_capacity;
    const size_t n = (size_t)s->n, nc = (size_t)s->n_cand, nl = (size_t)s->n_local, ng = (size_t)s->n_gen;
    int k = 0;
#define T(nm, kd, wh, reg, rws, re, pt) \
    (t[k].name = nm, t[k].kind = kd, t[k].where = wh, t[k].region = reg, t[k].rows = rws, t[k].row_elems = re, \
     t[k].pitch = pt, k++)
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
static int snap_check_state(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, char *why, size_t cap)
{
    if (s->prefilled != 0 && s->prefilled != 1) return snprintf(why, cap, "prefilled = %d: must be 0 or 1", s->prefilled), 0;
    if (s->has_selection != 0 && s->has_selection != 1)
        return snprintf(why, cap, "has_selection = %d: must be 0 or 1", s->has_selection), 0;
    if (!s->prefilled) {
        if (s->n || s->n_chunks || s->n_cand || s->n_local || s->n_gen || s->has_selection)
            return snprintf(why, cap, "a slot that is not prefilled has a nonzero shape or step count"), 0;
        return 1;
    }
    const int64_t c = g->chunk_size, lo = ((int64_t)g->n_outlier_chunks + lay->S + g->n_local_chunks) * c;
    if (s->n < lo || s->n > g->max_prompt_len)
        return snprintf(why, cap, "n = %lld: a prefilled prompt has between %lld and max_prompt_len = %lld tokens",
                        (long long)s->n, (long long)lo, (long long)g->max_prompt_len),
               0;
    const int64_t N = s->n / c - g->n_local_chunks;
    if (s->n_chunks != N || s->n_cand != N - g->n_outlier_chunks || s->n_local != s->n - N * c)
        return snprintf(why, cap,
                        "n_chunks = %d, n_cand = %d, n_local = %d do not follow from n = %lld (want %lld, %lld, %lld)",
                        s->n_chunks, s->n_cand, s->n_local, (long long)s->n, (long long)N,
                        (long long)(N - g->n_outlier_chunks), (long long)(s->n - N * c)),
               0;
    if (s->n_gen < 0 || s->n_gen > g->gen_capacity)
        return snprintf(why, cap, "n_gen = %d: must be in [0, gen_capacity = %d]", s->n_gen, g->gen_capacity), 0;
    if (s->has_selection != (s->n_gen > 0))
        return snprintf(why, cap, "has_selection = %d with n_gen = %d: a selection exists exactly after a step",
                        s->has_selection, s->n_gen),
               0;
    return 1;
}

/* The payload bytes of a SLOT section with state *s into *bytes; 0 on size_t overflow. */
static int snap_slot_bytes(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, size_t *bytes)
{
    size_t total = SNAP_STATE_BYTES, e;
    if (!s->prefilled) return *bytes = total, 1;
    snap_tensor t[SNAP_MAX_TENSORS];
    int nt = snap_tensors(g, lay, s, t);
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
static int snap_check_states(const skv_config *g, const skv_seq_state *st, char *why, size_t cap)
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

/* Slot i's value store: in the device arena or the host arena, as the cache placed it. */
static char *snap_value_store(const skv_cache_parts *p, size_t i)
{
    if ((int64_t)i < p->lay->n_dev_slots) return p->dev + p->lay->dev_values + i * p->lay->slot_values;
    return p->host + (i - (size_t)p->lay->n_dev_slots) * p->lay->slot_host;
}

/* Start of a tensor's region in the arenas of slot i. */
static char *snap_region(const skv_cache_parts *p, size_t i, const snap_tensor *t)
{
    if (t->where == R_VALUES) return snap_value_store(p, i);
    return p->dev + i * p->lay->slot_device + t->region;
}

/* ---- writer ------------------------------------------------------------------------------- */

/* Where a save goes: a buffer (buf, cap) or a stream (f); running checksums. */
typedef struct {
    unsigned char *buf;
    size_t cap, pos;
    FILE *f;
    const char *path; /* for messages */
    uint32_t file_crc, sec_crc;
    char *err;        /* the cache's message buffer */
} snap_out;

/* Appends n bytes to the output and both checksums. */
static skv_status out_write(snap_out *o, const void *data, size_t n)
{
    o->file_crc = snap_crc(o->file_crc, data, n);
    o->sec_crc = snap_crc(o->sec_crc, data, n);
    if (o->f) {
        if (n && fwrite(data, 1, n, o->f) != n)
            return skv_fail(o->err, SKV_ERR_IO, "skv_cache_save: writing %s at byte %zu failed: %s", o->path, o->pos,
                            strerror(errno));
    } else {
        if (n > o->cap - o->pos) /* the size was computed first: cannot happen */
            return skv_fail(o->err, SKV_ERR_INVALID_ARGUMENT, "skv_cache_save_buffer: buffer ended at byte %zu",
                            o->pos);
        if (n) memcpy(o->buf + o->pos, data, n);
    }
    o->pos += n;
    return SKV_OK;
}

/* A section's head; starts its checksum. */
static skv_status out_section(snap_out *o, uint32_t tag, uint64_t len)
{
    unsigned char h[SNAP_SEC_HEAD];
    put_u32(h, tag);
    put_u32(h + 4, 0);
    put_u64(h + 8, len);
    o->sec_crc = 0;
    return out_write(o, h, sizeof h);
}

/* Ends a section with its checksum. */
static skv_status out_section_end(snap_out *o)
{
    unsigned char b[4];
    put_u32(b, o->sec_crc);
    return out_write(o, b, sizeof b);
}

/* Writes one tensor of slot i: the arena through the staging buffer, converted to little-endian. */
static skv_status out_tensor(snap_out *o, const skv_cache_parts *p, size_t i, const snap_tensor *t, unsigned char *stage)
{
    const size_t es = snap_esize(t->kind), row_bytes = t->row_elems * es, per = SNAP_STAGE / es * es;
    const char *base = snap_region(p, i, t);
    for (size_t r = 0; r < t->rows; r++)
        for (size_t off = 0; off < row_bytes; off += per) {
            size_t n = row_bytes - off < per ? row_bytes - off : per;
            skv_status st = p->ops->copy2d(stage, 0, base + r * t->pitch * es + off, 0, n, 1);
            if (st)
                return skv_fail(o->err, st, "skv_cache_save: reading %s of slot %zu from the cache failed: %s%s%s",
                                t->name, i, skv_status_string(st), *skv_backend_detail() ? ": " : "",
                                skv_backend_detail());
            snap_swap(stage, n / es, es);
            if ((st = out_write(o, stage, n))) return st;
        }
    return SKV_OK;
}

/* The snapshot's size for the cache's config and states into *size; SKV_ERR_SIZE_OVERFLOW if it
   does not fit a size_t. Reads no tensor. */
static skv_status snap_size(const skv_cache_parts *p, size_t *size)
{
    size_t total = SNAP_PREAMBLE + SNAP_SEC_HEAD + SNAP_CONF_BYTES + SNAP_SEC_CRC, b;
    for (int64_t i = 0; i < p->lay->n_slots; i++)
        if (!snap_slot_bytes(p->cfg, p->lay, &p->slots[i], &b) || !skv_add_size(b, SNAP_SEC_HEAD + SNAP_SEC_CRC, &b) ||
            !skv_add_size(total, b, &total))
            return skv_fail(p->err, SKV_ERR_SIZE_OVERFLOW, "skv_cache_save: the snapshot's size overflows size_t");
    if (!skv_add_size(total, SNAP_SEC_HEAD + SNAP_END_BYTES + SNAP_SEC_CRC, &total))
        return skv_fail(p->err, SKV_ERR_SIZE_OVERFLOW, "skv_cache_save: the snapshot's size overflows size_t");
    *size = total;
    return SKV_OK;
}

/* Writes the whole snapshot of a synchronized cache (size bytes, from snap_size). */
static skv_status snap_write(snap_out *o, const skv_cache_parts *p, size_t size)
{
    const skv_config *g = p->cfg;
    unsigned char b[SNAP_CONF_BYTES], *stage = malloc(SNAP_STAGE);
    if (!stage) return skv_fail(o->err, SKV_ERR_OUT_OF_MEMORY, "skv_cache_save: out of memory for the staging buffer");
    skv_status st;
    memcpy(b, snap_magic, 8);
    put_u32(b + 8, SNAP_VERSION);
    put_u32(b + 12, 0);
    if ((st = out_write(o, b, SNAP_PREAMBLE))) goto done;
    /* CONF */
    size_t at = 0;
    for (size_t f = 0; f < SNAP_N_FIELDS; f++) {
        uint64_t v = snap_field_get(g, &snap_fields[f]);
        if (snap_fields[f].type == F_I64) put_u64(b + at, v);
        else put_u32(b + at, (uint32_t)v);
        at += snap_field_bytes(snap_fields[f].type);
    }
    if ((st = out_section(o, TAG_CONF, SNAP_CONF_BYTES)) || (st = out_write(o, b, SNAP_CONF_BYTES)) ||
        (st = out_section_end(o)))
        goto done;
    /* SLOT per (layer, sequence) */
    for (int64_t i = 0; i < p->lay->n_slots; i++) {
        const skv_seq_state *s = &p->slots[i];
        size_t len;
        snap_slot_bytes(g, p->lay, s, &len); /* snap_size checked it */
        put_u32(b, (uint32_t)(i / g->batch_size));
        put_u32(b + 4, (uint32_t)(i % g->batch_size));
        put_u32(b + 8, (uint32_t)s->prefilled);
        put_u32(b + 12, (uint32_t)s->has_selection);
        put_u64(b + 16, (uint64_t)s->n);
        put_u32(b + 24, (uint32_t)s->n_chunks);
        put_u32(b + 28, (uint32_t)s->n_cand);
        put_u32(b + 32, (uint32_t)s->n_local);
        put_u32(b + 36, (uint32_t)s->n_gen);
        if ((st = out_section(o, TAG_SLOT, len)) || (st = out_write(o, b, SNAP_STATE_BYTES))) goto done;
        if (s->prefilled) {
            snap_tensor t[SNAP_MAX_TENSORS];
            int nt = snap_tensors(g, p->lay, s, t);
            for (int k = 0; k < nt; k++)
                if ((st = out_tensor(o, p, (size_t)i, &t[k], stage))) goto done;
        }
        if ((st = out_section_end(o))) goto done;
    }
    /* END: the size, and the checksum of everything before this section */
    {
        const uint32_t whole = o->file_crc;
        put_u64(b, (uint64_t)size);
        put_u32(b + 8, whole);
        put_u32(b + 12, 0);
        if ((st = out_section(o, TAG_END, SNAP_END_BYTES)) || (st = out_write(o, b, SNAP_END_BYTES)) ||
            (st = out_section_end(o)))
            goto done;
    }
    if (o->pos != size)
        st = skv_fail(o->err, SKV_ERR_FORMAT, "skv_cache_save: wrote %zu bytes, the computed size is %zu", o->pos,
                      size);
done:
    free(stage);
    return st;
}

/* Checks the cache argument and synchronizes it (cuda: a deferred error is returned). */
static skv_status snap_save_begin(skv_cache *cache, const char *fn, skv_cache_parts *p, size_t *size)
{
    if (!cache) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    pthread_once(&snap_crc_once, snap_crc_init);
    skv_status st = skv_cache_sync(cache);
    if (st) return st;
    skv_cache_parts_get(cache, p);
    return snap_size(p, size);
}

SKV_API skv_status skv_cache_save_buffer(skv_cache *cache, void *buf, size_t cap, size_t *size)
{
    static const char fn[] = "skv_cache_save_buffer";
    skv_cache_parts p;
    size_t need = 0;
    if (cache && !size) {
        skv_cache_parts_get(cache, &p);
        return skv_fail(p.err, SKV_ERR_NULL_POINTER, "%s: size is NULL", fn);
    }
    skv_status st = snap_save_begin(cache, fn, &p, &need);
    if (st) return st;
    *size = need;
    if (!buf) return SKV_OK;
    if (cap < need)
        return skv_fail(p.err, SKV_ERR_INVALID_ARGUMENT, "%s: cap = %zu bytes, the snapshot needs %zu (in *size)", fn,
                        cap, need);
    snap_out o = {(unsigned char *)buf, cap, 0, NULL, NULL, 0, 0, p.err};
    return snap_write(&o, &p, need);
}

SKV_API skv_status skv_cache_save(skv_cache *cache, const char *path)
{
    static const char fn[] = "skv_cache_save";
    static unsigned counter;
    skv_cache_parts p;
    size_t need;
    if (cache && !path) {
        skv_cache_parts_get(cache, &p);
        return skv_fail(p.err, SKV_ERR_NULL_POINTER, "%s: path is NULL", fn);
    }
    skv_status st = snap_save_begin(cache, fn, &p, &need);
    if (st) return st;
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 48);
    if (!tmp) return skv_fail(p.err, SKV_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    int fd = -1;
    for (int attempt = 0; attempt < 100 && fd < 0; attempt++) {
        unsigned n = __atomic_fetch_add(&counter, 1u, __ATOMIC_RELAXED);
        snprintf(tmp, plen + 48, "%s.tmp-%ld-%u", path, (long)getpid(), n);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) {
        st = skv_fail(p.err, SKV_ERR_IO, "%s: cannot create the temporary file %s: %s", fn, tmp, strerror(errno));
        free(tmp);
        return st;
    }
    FILE *f = fdopen(fd, "wb");
    if (!f) {
        st = skv_fail(p.err, SKV_ERR_IO, "%s: fdopen(%s): %s", fn, tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        free(tmp);
        return st;
    }
    snap_out o = {NULL, 0, 0, f, tmp, 0, 0, p.err};
    st = snap_write(&o, &p, need);
    if (!st && fflush(f) != 0)
        st = skv_fail(p.err, SKV_ERR_IO, "%s: writing %s failed: %s", fn, tmp, strerror(errno));
    if (!st && fsync(fileno(f)) != 0)
        st = skv_fail(p.err, SKV_ERR_IO, "%s: fsync(%s): %s", fn, tmp, strerror(errno));
    if (fclose(f) != 0 && !st) st = skv_fail(p.err, SKV_ERR_IO, "%s: closing %s failed: %s", fn, tmp, strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st = skv_fail(p.err, SKV_ERR_IO, "%s: rename(%s, %s): %s", fn, tmp, path, strerror(errno));
    if (st) unlink(tmp);
    free(tmp);
    return st;
}

/* ---- reader ------------------------------------------------------------------------------- */

/* Where a load comes from: a buffer (buf, size) or a stream (f of size bytes); running checksums. */
typedef struct {
    const unsigned char *buf;
    FILE *f;
    const char *path;
    size_t size, pos;
    uint32_t file_crc, sec_crc;
} snap_in;

/* Reads exactly n bytes (the caller checked that they are there); updates both checksums. */
static skv_status in_read(snap_in *in, void *dst, size_t n, const char *what)
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
    in->file_crc = snap_crc(in->file_crc, dst, n);
    in->sec_crc = snap_crc(in->sec_crc, dst, n);
    in->pos += n;
    return SKV_OK;
}

/* Goes back to the start of the input (for the second pass). */
static skv_status in_rewind(snap_in *in)
{
    in->pos = 0;
    in->file_crc = in->sec_crc = 0;
    if (in->f && fseek(in->f, 0, SEEK_SET) != 0)
        return skv_fail(NULL, SKV_ERR_IO, "skv_cache_load: fseek(%s): %s", in->path, strerror(errno));
    return SKV_OK;
}

/* Reads a section's head: the tag must be want and the payload length exactly len, all present. */
static skv_status in_section(snap_in *in, uint32_t want, const char *name, uint64_t len, const char *where)
{
    unsigned char h[SNAP_SEC_HEAD];
    const size_t at = in->pos;
    in->sec_crc = 0;
    skv_status st = in_read(in, h, sizeof h, name);
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
static skv_status in_section_end(snap_in *in, const char *name, const char *where)
{
    const uint32_t want = in->sec_crc;
    const size_t at = in->pos;
    unsigned char b[4];
    skv_status st = in_read(in, b, sizeof b, "a section checksum");
    if (st) return st;
    if (get_u32(b) != want)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: section %s%s: checksum at byte %zu is 0x%08x, the data's CRC32C is 0x%08x",
                        name, where, at, (unsigned)get_u32(b), (unsigned)want);
    return SKV_OK;
}

/* Strictly increasing ids of one head, each in [0, hi). Returns the first bad index or -1. */
static int64_t snap_bad_ids(const int32_t *x, size_t n, int64_t hi)
{
    for (size_t j = 0; j < n; j++)
        if (x[j] < 0 || x[j] >= hi || (j && x[j] <= x[j - 1])) return (int64_t)j;
    return -1;
}

/*
 * Reads one SLOT payload's tensors (after its state) and checks them: bf16 data finite,
 * candidate and outlier ids of each head strictly increasing and together the chunks
 * 0..N-1, the selection's indices strictly increasing candidates and its ids their chunk
 * ids. With p non-NULL the data is written into slot i of that cache.
 */
static skv_status in_slot_tensors(snap_in *in, const skv_config *g, const skv_layout *lay, const skv_seq_state *s,
                                  const skv_cache_parts *p, size_t i, unsigned char *stage, const char *where)
{
    snap_tensor t[SNAP_MAX_TENSORS];
    const int nt = snap_tensors(g, lay, s, t);
    const size_t Hk = (size_t)g->n_kv_heads, O = (size_t)g->n_outlier_chunks, S = (size_t)lay->S;
    const size_t nc = (size_t)s->n_cand;
    int32_t *ids[5] = {NULL, NULL, NULL, NULL, NULL}; /* by kind */
    skv_status st = SKV_OK;
    for (int k = 0; k < nt && !st; k++) {
        const snap_tensor *tk = &t[k];
        const size_t es = snap_esize(tk->kind), row_bytes = tk->row_elems * es; /* sizes checked by snap_slot_bytes */
        char *base = p ? snap_region(p, i, tk) : NULL;
        if (tk->kind != T_BF16) { /* an id list: read whole (its bytes are present), check, then store */
            int32_t *x = malloc(row_bytes ? row_bytes : 1);
            if (!x) {
                st = skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "skv_cache_load: out of memory for %s%s", tk->name, where);
                break;
            }
            ids[tk->kind] = x;
            const size_t at = in->pos;
            if ((st = in_read(in, x, row_bytes, tk->name))) break;
            snap_swap(x, tk->row_elems, es);
            const size_t per = tk->kind == T_CAND ? nc : tk->kind == T_OUT ? O : S;
            const int64_t hi = tk->kind == T_SELIDX ? (int64_t)nc : (int64_t)s->n_chunks;
            for (size_t h = 0; h < Hk && !st; h++) {
                const int32_t *xh = x + h * per;
                int64_t bad = -1;
                if (tk->kind == T_SELIDS) {
                    const int32_t *cand = ids[T_CAND] + h * nc, *sidx = ids[T_SELIDX] + h * S;
                    for (size_t j = 0; j < S && bad < 0; j++)
                        if (xh[j] != cand[sidx[j]]) bad = (int64_t)j;
                } else {
                    bad = snap_bad_ids(xh, per, hi);
                }
                if (bad >= 0)
                    st = skv_fail(NULL, SKV_ERR_FORMAT,
                                  "skv_cache_load: %s%s, head %zu, entry %lld (byte %zu) = %d: %s", tk->name, where, h,
                                  (long long)bad, at + (h * per + (size_t)bad) * es, xh[bad],
                                  tk->kind == T_SELIDS ? "not the chunk id of the selected candidate"
                                  : tk->kind == T_SELIDX ? "selected candidate indices are strictly increasing in [0, n_cand)"
                                                         : "chunk ids are strictly increasing in [0, n_chunks)");
                if (!st && tk->kind == T_OUT) { /* outliers and candidates: disjoint, so together all N chunks */
                    const int32_t *cand = ids[T_CAND] + h * nc;
                    for (size_t a = 0, b = 0; a < O && b < nc && !st;) {
                        if (xh[a] == cand[b])
                            st = skv_fail(NULL, SKV_ERR_FORMAT,
                                          "skv_cache_load: %s%s, head %zu: chunk %d is both an outlier and a candidate",
                                          tk->name, where, h, xh[a]);
                        else if (xh[a] < cand[b]) a++;
                        else b++;
                    }
                }
            }
            if (!st && p && row_bytes) {
                /* the arena takes host-order ints; x was converted in place */
                st = p->ops->copy2d(base, 0, x, 0, row_bytes, 1);
                if (st) st = skv_fail(NULL, st, "skv_cache_load: copying %s%s into the cache failed: %s", tk->name,
                                      where, skv_status_string(st));
            }
            continue;
        }
        const size_t per = SNAP_STAGE / es * es;
        for (size_t r = 0; r < tk->rows && !st; r++)
            for (size_t off = 0; off < row_bytes && !st; off += per) {
                const size_t n = row_bytes - off < per ? row_bytes - off : per, at = in->pos;
                if ((st = in_read(in, stage, n, tk->name))) break;
                snap_swap(stage, n / es, es);
                const skv_bf16 *x = (const skv_bf16 *)stage;
                for (size_t j = 0; j < n / es; j++)
                    if ((x[j] & 0x7f80u) == 0x7f80u) {
                        st = skv_fail(NULL, SKV_ERR_FORMAT,
                                      "skv_cache_load: %s%s: element %zu (byte %zu) is NaN or Inf (bits 0x%04x)",
                                      tk->name, where, (r * tk->row_elems * es + off) / es + j, at + j * es,
                                      (unsigned)x[j]);
                        break;
                    }
                if (!st && p) {
                    st = p->ops->copy2d(base + r * tk->pitch * es + off, 0, stage, 0, n, 1);
                    if (st) st = skv_fail(NULL, st, "skv_cache_load: copying %s%s into the cache failed: %s", tk->name,
                                          where, skv_status_string(st));
                }
            }
    }
    for (int k = 0; k < 5; k++) free(ids[k]);
    return st;
}

/*
 * Reads the preamble and the CONF section into *snap (the defaults, then the model fields).
 * A config that fails validation is a corrupted snapshot (SKV_ERR_FORMAT).
 */
static skv_status in_header(snap_in *in, skv_config *snap, skv_layout *lay)
{
    unsigned char b[SNAP_CONF_BYTES];
    skv_status st = in->size < 8 ? SKV_ERR_FORMAT : in_read(in, b, 8, "the magic");
    if (st == SKV_ERR_IO) return st;
    if (st || memcmp(b, snap_magic, 8) != 0)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: not a snapshot: the first 8 bytes are not the magic \"SKVSNAP\\0\" (%zu bytes)",
                        in->size);
    if ((st = in_read(in, b, 8, "the format version"))) return st;
    const uint32_t v = get_u32(b);
    if (v != SNAP_VERSION)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: format version %u (byte 8); this library (%s) reads version %u", (unsigned)v,
                        skv_version_string(), SNAP_VERSION);
    if (get_u32(b + 4) != 0)
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: flags (byte 12) = 0x%08x, version %u defines none",
                        (unsigned)get_u32(b + 4), SNAP_VERSION);
    if ((st = in_section(in, TAG_CONF, "CONF", SNAP_CONF_BYTES, ""))) return st;
    if ((st = in_read(in, b, SNAP_CONF_BYTES, "CONF"))) return st;
    if ((st = in_section_end(in, "CONF", ""))) return st;
    skv_config_init(snap, sizeof *snap);
    size_t at = 0;
    for (size_t f = 0; f < SNAP_N_FIELDS; f++) {
        snap_field_set(snap, &snap_fields[f], snap_fields[f].type == F_I64 ? get_u64(b + at) : get_u32(b + at));
        at += snap_field_bytes(snap_fields[f].type);
    }
    if (snap->reproducible && snap->factorize != SKV_FACTORIZE_CANONICAL)
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section CONF: reproducible = 1 with factorize = %d "
                                              "(a reproducible cache holds CANONICAL = 4)", (int)snap->factorize);
    char why[SKV_ERRMSG_CAP];
    snap->backend = SKV_BACKEND_REF; /* validation only; no backend is probed */
    if ((st = skv_layout_compute(why, snap, lay)))
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section CONF holds an invalid config: %s", why);
    snap->backend = SKV_BACKEND_AUTO;
    return SKV_OK;
}

/*
 * One pass over the slots and the END section. p NULL: checks only; p non-NULL: also
 * writes into that cache and publishes the states into states[] (n_slots entries).
 */
static skv_status in_body(snap_in *in, const skv_config *g, const skv_layout *lay, const skv_cache_parts *p,
                          skv_seq_state *states, unsigned char *stage)
{
    skv_status st;
    char where[64], why[SKV_ERRMSG_CAP];
    for (int64_t i = 0; i < lay->n_slots; i++) {
        const int32_t layer = (int32_t)(i / g->batch_size), seq = (int32_t)(i % g->batch_size);
        snprintf(where, sizeof where, " (layer %d, sequence %d)", layer, seq);
        /* the head: the length is checked against the state below, so read it first as is */
        unsigned char h[SNAP_SEC_HEAD], b[SNAP_STATE_BYTES];
        const size_t at = in->pos;
        in->sec_crc = 0;
        if ((st = in_read(in, h, sizeof h, "a SLOT section head"))) return st;
        if (get_u32(h) != TAG_SLOT || get_u32(h + 4) != 0)
            return skv_fail(NULL, SKV_ERR_FORMAT,
                            "skv_cache_load: section SLOT%s at byte %zu: tag 0x%08x, reserved 0x%08x (want 0x%08x, 0)",
                            where, at, (unsigned)get_u32(h), (unsigned)get_u32(h + 4), (unsigned)TAG_SLOT);
        const uint64_t len = get_u64(h + 8);
        if (len < SNAP_STATE_BYTES || len > (uint64_t)(in->size - in->pos) ||
            len + SNAP_SEC_CRC > (uint64_t)(in->size - in->pos))
            return skv_fail(NULL, SKV_ERR_FORMAT,
                            "skv_cache_load: truncated: section SLOT%s at byte %zu has a payload of %llu bytes, "
                            "%zu remain",
                            where, at, (unsigned long long)len, in->size - in->pos);
        if ((st = in_read(in, b, SNAP_STATE_BYTES, "a SLOT state"))) return st;
        if ((int32_t)get_u32(b) != layer || (int32_t)get_u32(b + 4) != seq)
            return skv_fail(NULL, SKV_ERR_FORMAT,
                            "skv_cache_load: section SLOT%s at byte %zu names layer %d, sequence %d (slots are in "
                            "order)",
                            where, at, (int32_t)get_u32(b), (int32_t)get_u32(b + 4));
        skv_seq_state s;
        memset(&s, 0, sizeof s);
        s.prefilled = (int32_t)get_u32(b + 8);
        s.has_selection = (int32_t)get_u32(b + 12);
        s.n = (int64_t)get_u64(b + 16);
        s.n_chunks = (int32_t)get_u32(b + 24);
        s.n_cand = (int32_t)get_u32(b + 28);
        s.n_local = (int32_t)get_u32(b + 32);
        s.n_gen = (int32_t)get_u32(b + 36);
        if (!snap_check_state(g, lay, &s, why, sizeof why))
            return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section SLOT%s at byte %zu: %s", where, at, why);
        size_t want;
        if (!snap_slot_bytes(g, lay, &s, &want) || (uint64_t)want != len)
            return skv_fail(NULL, SKV_ERR_FORMAT,
                            "skv_cache_load: section SLOT%s at byte %zu: payload length %llu, its state needs %zu",
                            where, at, (unsigned long long)len, want);
        if (s.prefilled && (st = in_slot_tensors(in, g, lay, &s, p, (size_t)i, stage, where))) return st;
        if ((st = in_section_end(in, "SLOT", where))) return st;
        states[i] = s;
    }
    if (!snap_check_states(g, states, why, sizeof why))
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: the slots' states are not a cache's: %s", why);
    const uint32_t whole = in->file_crc;
    const size_t at = in->pos;
    unsigned char e[SNAP_END_BYTES];
    if ((st = in_section(in, TAG_END, "END", SNAP_END_BYTES, ""))) return st;
    if ((st = in_read(in, e, SNAP_END_BYTES, "END"))) return st;
    if ((st = in_section_end(in, "END", ""))) return st;
    if (get_u64(e) != (uint64_t)in->pos || in->pos != in->size)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: section END at byte %zu: the snapshot is %llu bytes, the input %zu%s", at,
                        (unsigned long long)get_u64(e), in->size,
                        in->pos != in->size ? " (bytes follow the END section)" : "");
    if (get_u32(e + 8) != whole || get_u32(e + 12) != 0)
        return skv_fail(NULL, SKV_ERR_FORMAT,
                        "skv_cache_load: section END at byte %zu: the file checksum is 0x%08x, the CRC32C of the "
                        "%zu bytes before END is 0x%08x",
                        at, (unsigned)get_u32(e + 8), at, (unsigned)whole);
    return SKV_OK;
}

/*
 * The config the loaded cache is created with: the snapshot's model fields and the runtime
 * fields of *cfg (or the defaults); a model field of *cfg that differs is SKV_ERR_INVALID_CONFIG.
 */
static skv_status snap_run_config(const skv_config *snap, const skv_config *cfg, skv_config *run)
{
    skv_config_init(run, sizeof *run);
    if (cfg) {
        skv_config mine;
        char why[SKV_ERRMSG_CAP];
        skv_status st = skv_config_import(why, cfg, &mine);
        if (st) return skv_fail(NULL, st, "skv_cache_load: cfg: %s", why);
        snap_normalize(&mine);
        /* factorize last: with reproducible differing, it differs only as a consequence */
        for (size_t k = 0; k < SNAP_N_FIELDS; k++) {
            const size_t f = k < SNAP_N_FIELDS - 2 ? k : k == SNAP_N_FIELDS - 2 ? SNAP_N_FIELDS - 1 : SNAP_N_FIELDS - 2;
            const uint64_t a = snap_field_get(&mine, &snap_fields[f]), b = snap_field_get(snap, &snap_fields[f]);
            if (a != b) {
                char va[64], vb[64];
                snap_field_fmt(va, sizeof va, &snap_fields[f], a);
                snap_field_fmt(vb, sizeof vb, &snap_fields[f], b);
                return skv_fail(NULL, SKV_ERR_INVALID_CONFIG,
                                "skv_cache_load: cfg->%s = %s, the snapshot's is %s (every model field must equal "
                                "the snapshot's; pass cfg = NULL to take them all)",
                                snap_fields[f].name, va, vb);
            }
        }
        *run = mine;
    } else {
        for (size_t f = 0; f < SNAP_N_FIELDS; f++)
            snap_field_set(run, &snap_fields[f], snap_field_get(snap, &snap_fields[f]));
        run->backend = SKV_BACKEND_AUTO;
    }
    return SKV_OK;
}

/* Both passes over an opened input; *out on success. */
static skv_status snap_load(snap_in *in, const skv_config *cfg, skv_cache **out)
{
    pthread_once(&snap_crc_once, snap_crc_init);
    skv_config snap, run;
    skv_layout lay;
    skv_status st = in_header(in, &snap, &lay);
    if (st) return st;
    if ((st = snap_run_config(&snap, cfg, &run))) return st;
    unsigned char *stage = malloc(SNAP_STAGE);
    skv_seq_state *states = calloc((size_t)lay.n_slots, sizeof *states);
    skv_cache *k = NULL;
    if (!stage || !states) {
        st = skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "skv_cache_load: out of memory for %lld slot states",
                      (long long)lay.n_slots);
        goto done;
    }
    /* pass 1: everything checked before anything is created */
    if ((st = in_body(in, &snap, &lay, NULL, states, stage))) goto done;
    if ((st = skv_cache_create(&run, &k))) goto done;
    skv_cache_parts p;
    skv_cache_parts_get(k, &p);
    /* pass 2: the same reader, writing into the new cache */
    if ((st = in_rewind(in)) || (st = in_header(in, &snap, &lay))) goto done;
    memset(states, 0, (size_t)lay.n_slots * sizeof *states);
    if ((st = in_body(in, p.cfg, p.lay, &p, states, stage))) goto done;
    /* publish: the states, then the backend's own copy of them; the chunk caches start empty */
    memcpy(p.slots, states, (size_t)lay.n_slots * sizeof *states);
    if (p.ops->cache_set_states) {
        char msg[SKV_ERRMSG_CAP] = "";
        if ((st = p.ops->cache_set_states(p.bctx, p.slots, msg, sizeof msg))) {
            st = skv_fail(NULL, st, "skv_cache_load: %s", msg);
            goto done;
        }
    } else {
        for (int64_t i = p.lay->n_dev_slots; i < p.lay->n_slots; i++)
            memset(p.dev + p.lay->dev_vcache + (size_t)(i - p.lay->n_dev_slots) * p.lay->slot_vcache +
                       p.lay->vc_slot_of,
                   0xff, p.lay->vc_meta_bytes);
    }
    *out = k;
    k = NULL;
done:
    skv_cache_free(k);
    free(stage);
    free(states);
    return st;
}

SKV_API skv_status skv_cache_load_buffer(const void *buf, size_t size, const skv_config *cfg, skv_cache **out)
{
    if (out) *out = NULL;
    if (!out) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_load_buffer: out is NULL");
    if (!buf) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_load_buffer: buf is NULL");
    snap_in in = {(const unsigned char *)buf, NULL, NULL, size, 0, 0, 0};
    return snap_load(&in, cfg, out);
}

SKV_API skv_status skv_cache_load(const char *path, const skv_config *cfg, skv_cache **out)
{
    if (out) *out = NULL;
    if (!out) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_load: out is NULL");
    if (!path) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_load: path is NULL");
    FILE *f = fopen(path, "rb");
    if (!f) return skv_fail(NULL, SKV_ERR_IO, "skv_cache_load: cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    const char *bad = fstat(fileno(f), &sb) != 0 ? strerror(errno) : !S_ISREG(sb.st_mode) ? "not a regular file" : NULL;
    if (bad) {
        skv_status st = skv_fail(NULL, SKV_ERR_IO, "skv_cache_load: %s: %s", path, bad);
        fclose(f);
        return st;
    }
    snap_in in = {NULL, f, path, (size_t)sb.st_size, 0, 0, 0};
    skv_status st = snap_load(&in, cfg, out);
    fclose(f);
    return st;
}
