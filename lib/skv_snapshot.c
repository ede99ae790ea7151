/*
 * Cache snapshots: skv_cache_save / skv_cache_load and their buffer variants
 * (docs/DESIGN.md section 11 specifies the format; lib/skv_snapshot_format.c holds the
 * format's pieces, the CONF reader and skv_snapshot_config).
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "skv_snapshot.h"

/* Slot i's value store (a sparse slot's): in the device arena or the host arena, as the cache placed it. */
static char *snap_value_store(const skv_cache_parts *p, size_t i)
{
    const int32_t B = p->cfg->batch_size;
    const size_t j = (size_t)skv_layout_sparse_index(p->lay, (int32_t)(i / B), (int32_t)(i % B));
    if ((int64_t)j < p->lay->n_dev_slots) return p->dev + p->lay->dev_values + j * p->lay->slot_values;
    return p->host + (j - (size_t)p->lay->n_dev_slots) * p->lay->slot_host;
}

/* Start of a tensor's region in the arenas of slot i. */
static char *snap_region(const skv_cache_parts *p, size_t i, const snap_tensor *t)
{
    const int32_t B = p->cfg->batch_size;
    if (t->where == R_VALUES) return snap_value_store(p, i);
    return p->dev + skv_layout_slot_offset(p->lay, (int32_t)(i / B), (int32_t)(i % B)) + t->region;
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
    o->file_crc = skv_snap_crc(o->file_crc, data, n);
    o->sec_crc = skv_snap_crc(o->sec_crc, data, n);
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
            skv_snap_swap(stage, n / es, es);
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
        if (!skv_snap_slot_bytes(p->cfg, p->lay, &p->slots[i], SNAP_VERSION, &b) || !skv_add_size(b, SNAP_SEC_HEAD + SNAP_SEC_CRC, &b) ||
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
    memcpy(b, skv_snap_magic, 8);
    put_u32(b + 8, SNAP_VERSION);
    put_u32(b + 12, 0);
    if ((st = out_write(o, b, SNAP_PREAMBLE))) goto done;
    /* CONF */
    size_t at = 0;
    for (size_t f = 0; f < skv_snap_n_fields; f++) {
        uint64_t v = skv_snap_field_get(g, &skv_snap_fields[f]);
        if (skv_snap_fields[f].type == F_I64) put_u64(b + at, v);
        else put_u32(b + at, (uint32_t)v);
        at += snap_field_bytes(skv_snap_fields[f].type);
    }
    if ((st = out_section(o, TAG_CONF, SNAP_CONF_BYTES)) || (st = out_write(o, b, SNAP_CONF_BYTES)) ||
        (st = out_section_end(o)))
        goto done;
    /* SLOT per (layer, sequence) */
    for (int64_t i = 0; i < p->lay->n_slots; i++) {
        const skv_seq_state *s = &p->slots[i];
        size_t len;
        skv_snap_slot_bytes(g, p->lay, s, SNAP_VERSION, &len); /* snap_size checked it */
        put_u32(b, (uint32_t)(i / g->batch_size));
        put_u32(b + 4, (uint32_t)(i % g->batch_size));
        put_u32(b + 8, (uint32_t)s->prefilled);
        put_u32(b + 12, (uint32_t)s->has_selection);
        put_u64(b + 16, (uint64_t)s->n);
        put_u32(b + 24, (uint32_t)s->n_chunks);
        put_u32(b + 28, (uint32_t)s->n_cand);
        put_u32(b + 32, (uint32_t)s->n_local);
        put_u32(b + 36, (uint32_t)s->n_gen);
        put_u32(b + 40, (uint32_t)s->rank);
        put_u32(b + 44, (uint32_t)s->dense);
        if ((st = out_section(o, TAG_SLOT, len)) || (st = out_write(o, b, SNAP_STATE_BYTES))) goto done;
        if (s->prefilled) {
            snap_tensor t[SNAP_MAX_TENSORS];
            int nt = skv_snap_tensors(g, p->lay, s, SNAP_VERSION, t);
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
    skv_snap_crc_ready();
    skv_status st = skv_cache_sync(cache);
    if (st) return st;
    skv_cache_parts_get(cache, p);
    if (p->lay->pooled)
        return skv_fail(p->err, SKV_ERR_UNSUPPORTED,
                        "%s: a cache in the pool mode (config.pool_device_bytes > 0) has no snapshot format yet", fn);
    if (p->lay->value_dtype != SKV_VALUE_BF16)
        return skv_fail(p->err, SKV_ERR_UNSUPPORTED,
                        "%s: a cache with fp8 values (config.value_dtype = SKV_VALUE_FP8) has no snapshot format yet", fn);
    return snap_size(p, size);
}

static skv_status skv_cache_save_buffer_body(skv_cache *cache, void *buf, size_t cap, size_t *size)
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

SKV_API skv_status skv_cache_save_buffer(skv_cache *cache, void *buf, size_t cap, size_t *size)
{
    SKV_ON_DEVICE(cache, skv_cache_save_buffer_body(cache, buf, cap, size));
}

static skv_status skv_cache_save_body(skv_cache *cache, const char *path)
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

SKV_API skv_status skv_cache_save(skv_cache *cache, const char *path)
{
    SKV_ON_DEVICE(cache, skv_cache_save_body(cache, path));
}


/* ---- reader ------------------------------------------------------------------------------- */

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
 * 0..N-1, each head's selection count k in [1, min(S, n_cand, W)] (exactly that in the fixed
 * mode; version 1: S), the selection's first k indices strictly increasing candidates and
 * its ids their chunk ids, the rest -1. With p non-NULL the data is written into slot i of
 * that cache (a version 1 selection's counts too).
 */
static skv_status in_slot_tensors(snap_in *in, const skv_config *g, const skv_layout *lay, const skv_seq_state *s,
                                  const skv_cache_parts *p, size_t i, unsigned char *stage, const char *where)
{
    snap_tensor t[SNAP_MAX_TENSORS];
    const int nt = skv_snap_tensors(g, lay, s, in->version, t);
    const size_t Hk = (size_t)g->n_kv_heads, O = (size_t)g->n_outlier_chunks, S = (size_t)lay->S;
    const size_t nc = (size_t)s->n_cand, kcap0 = S < nc ? S : nc;
    const size_t kcap = lay->W && (size_t)lay->W < kcap0 ? (size_t)lay->W : kcap0; /* rescoring: at most W (4.5.1) */
    int32_t *ids[T_NKINDS] = {NULL}; /* by kind */
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
            if ((st = skv_snap_in_read(in, x, row_bytes, tk->name))) break;
            skv_snap_swap(x, tk->row_elems, es);
            const size_t per = tk->kind == T_CAND ? nc : tk->kind == T_OUT ? O : tk->kind == T_SELCNT ? 1 : S;
            const int64_t hi = tk->kind == T_SELIDX ? (int64_t)nc : (int64_t)s->n_chunks;
            for (size_t h = 0; h < Hk && !st; h++) {
                const int32_t *xh = x + h * per;
                const size_t kh = ids[T_SELCNT] ? (size_t)ids[T_SELCNT][h] : S; /* version 1: S */
                int64_t bad = -1;
                if (tk->kind == T_SELCNT) {
                    if (xh[0] < 1 || (size_t)xh[0] > kcap || (g->select_mode != SKV_SELECT_MASS && (size_t)xh[0] != kcap))
                        bad = 0;
                } else if (tk->kind == T_SELIDS) {
                    const int32_t *cand = ids[T_CAND] + h * nc, *sidx = ids[T_SELIDX] + h * S;
                    for (size_t j = 0; j < S && bad < 0; j++)
                        if (xh[j] != (j < kh ? cand[sidx[j]] : -1)) bad = (int64_t)j;
                } else if (tk->kind == T_SELIDX) {
                    bad = snap_bad_ids(xh, kh, hi);
                    for (size_t j = kh; j < S && bad < 0; j++)
                        if (xh[j] != -1) bad = (int64_t)j;
                } else {
                    bad = snap_bad_ids(xh, per, hi);
                }
                if (bad >= 0)
                    st = skv_fail(NULL, SKV_ERR_FORMAT,
                                  "skv_cache_load: %s%s, head %zu, entry %lld (byte %zu) = %d: %s", tk->name, where, h,
                                  (long long)bad, at + (h * per + (size_t)bad) * es, xh[bad],
                                  tk->kind == T_SELIDS   ? "not the chunk id of the selected candidate (-1 past the count)"
                                  : tk->kind == T_SELIDX ? "selected candidate indices are strictly increasing in "
                                                           "[0, n_cand), then -1 past the count"
                                  : tk->kind == T_SELCNT ? "a selection count is in [1, min(S, n_cand)] (that in the "
                                                           "fixed mode)"
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
            if (!st && p && tk->kind == T_SELIDS && !ids[T_SELCNT]) { /* version 1: every head selected S */
                for (size_t h = 0; h < Hk; h++) x[h] = (int32_t)S;
                st = p->ops->copy2d(snap_region(p, i, &(snap_tensor){"selection_count", T_SELCNT, R_SLOT,
                                                                     lay->sel_cnt, 1, Hk, 0}),
                                    0, x, 0, Hk * sizeof *x, 1);
                if (st) st = skv_fail(NULL, st, "skv_cache_load: writing the selection counts%s failed: %s", where,
                                      skv_status_string(st));
            }
            continue;
        }
        const size_t per = SNAP_STAGE / es * es;
        for (size_t r = 0; r < tk->rows && !st; r++)
            for (size_t off = 0; off < row_bytes && !st; off += per) {
                const size_t n = row_bytes - off < per ? row_bytes - off : per, at = in->pos;
                if ((st = skv_snap_in_read(in, stage, n, tk->name))) break;
                skv_snap_swap(stage, n / es, es);
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
    for (int k = 0; k < T_NKINDS; k++) free(ids[k]);
    return st;
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
        const uint32_t state_bytes = SNAP_STATE_OF(in->version);
        const size_t at = in->pos;
        in->sec_crc = 0;
        if ((st = skv_snap_in_read(in, h, sizeof h, "a SLOT section head"))) return st;
        if (get_u32(h) != TAG_SLOT || get_u32(h + 4) != 0)
            return skv_fail(NULL, SKV_ERR_FORMAT,
                            "skv_cache_load: section SLOT%s at byte %zu: tag 0x%08x, reserved 0x%08x (want 0x%08x, 0)",
                            where, at, (unsigned)get_u32(h), (unsigned)get_u32(h + 4), (unsigned)TAG_SLOT);
        const uint64_t len = get_u64(h + 8);
        if (len < state_bytes || len > (uint64_t)(in->size - in->pos) ||
            len + SNAP_SEC_CRC > (uint64_t)(in->size - in->pos))
            return skv_fail(NULL, SKV_ERR_FORMAT,
                            "skv_cache_load: truncated: section SLOT%s at byte %zu has a payload of %llu bytes, "
                            "%zu remain",
                            where, at, (unsigned long long)len, in->size - in->pos);
        if ((st = skv_snap_in_read(in, b, state_bytes, "a SLOT state"))) return st;
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
        s.dense = skv_layout_dense(lay, layer);
        if (in->version >= 2) {
            s.rank = (int32_t)get_u32(b + 40);
            if ((int32_t)get_u32(b + 44) != s.dense)
                return skv_fail(NULL, SKV_ERR_FORMAT,
                                "skv_cache_load: section SLOT%s at byte %zu: dense = %d, but CONF's dense_layers "
                                "makes layer %d %s",
                                where, at, (int32_t)get_u32(b + 44), layer, s.dense ? "dense" : "sparse");
        } else {
            s.rank = s.prefilled ? g->rank : 0; /* version 1: the config's rank */
        }
        if (!skv_snap_check_state(g, lay, &s, why, sizeof why))
            return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: section SLOT%s at byte %zu: %s", where, at, why);
        size_t want;
        if (!skv_snap_slot_bytes(g, lay, &s, in->version, &want) || (uint64_t)want != len)
            return skv_fail(NULL, SKV_ERR_FORMAT,
                            "skv_cache_load: section SLOT%s at byte %zu: payload length %llu, its state needs %zu",
                            where, at, (unsigned long long)len, want);
        if (s.prefilled && (st = in_slot_tensors(in, g, lay, &s, p, (size_t)i, stage, where))) return st;
        if ((st = skv_snap_in_section_end(in, "SLOT", where))) return st;
        states[i] = s;
    }
    if (!skv_snap_check_states(g, states, why, sizeof why))
        return skv_fail(NULL, SKV_ERR_FORMAT, "skv_cache_load: the slots' states are not a cache's: %s", why);
    const uint32_t whole = in->file_crc;
    const size_t at = in->pos;
    unsigned char e[SNAP_END_BYTES];
    if ((st = skv_snap_in_section(in, TAG_END, "END", SNAP_END_BYTES, ""))) return st;
    if ((st = skv_snap_in_read(in, e, SNAP_END_BYTES, "END"))) return st;
    if ((st = skv_snap_in_section_end(in, "END", ""))) return st;
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



/* snap_load's second pass, into the new cache k. */
static skv_status snap_load_into(snap_in *in, skv_cache *k, const skv_config *snap_, const skv_layout *lay_,
                                 skv_seq_state *states, unsigned char *stage)
{
    skv_config snap = *snap_;
    skv_layout lay = *lay_;
    skv_status st;
    skv_cache_parts p;
    skv_cache_parts_get(k, &p);
    /* pass 2: the same reader, writing into the new cache */
    if ((st = skv_snap_in_rewind(in)) || (st = skv_snap_in_header(in, &snap, &lay))) return st;
    memset(states, 0, (size_t)lay.n_slots * sizeof *states);
    if ((st = in_body(in, p.cfg, p.lay, &p, states, stage))) return st;
    /* publish: the states, then the backend's own copy of them; the chunk caches start empty */
    memcpy(p.slots, states, (size_t)lay.n_slots * sizeof *states);
    if (p.ops->cache_set_states) {
        char msg[SKV_ERRMSG_CAP] = "";
        if ((st = p.ops->cache_set_states(p.bctx, p.slots, msg, sizeof msg)))
            return skv_fail(NULL, st, "skv_cache_load: %s", msg);
    } else {
        for (int64_t i = p.lay->n_dev_slots; i < p.lay->n_sparse_slots; i++)
            memset(p.dev + p.lay->dev_vcache + (size_t)(i - p.lay->n_dev_slots) * p.lay->slot_vcache +
                       p.lay->vc_slot_of,
                   0xff, p.lay->vc_meta_bytes);
    }
    return SKV_OK;
}

/* Both passes over an opened input; *out on success. */
static skv_status snap_load(snap_in *in, const skv_config *cfg, skv_cache **out)
{
    skv_snap_crc_ready();
    skv_config snap, run;
    skv_layout lay;
    skv_status st = skv_snap_in_header(in, &snap, &lay);
    if (st) return st;
    if ((st = skv_snap_run_config(&snap, cfg, &run))) return st;
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
    int32_t saved; /* pass 2 writes into the cache's device */
    if ((st = skv_cache_device_enter(k, &saved))) goto done;
    st = snap_load_into(in, k, &snap, &lay, states, stage);
    skv_cache_device_leave(k, saved);
    if (st) goto done;
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
    snap_in in = {(const unsigned char *)buf, NULL, NULL, size, 0, 0, 0, 0};
    return snap_load(&in, cfg, out);
}

SKV_API skv_status skv_cache_load(const char *path, const skv_config *cfg, skv_cache **out)
{
    if (out) *out = NULL;
    if (!out) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_load: out is NULL");
    if (!path) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_load: path is NULL");
    snap_in in;
    skv_status st = skv_snap_open(&in, path, "skv_cache_load");
    if (st) return st;
    st = snap_load(&in, cfg, out);
    fclose(in.f);
    return st;
}
