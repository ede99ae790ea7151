/*
 * skv_snapshot.h - the snapshot format, shared by lib/skv_snapshot_format.c (the format:
 * checksums, fields, the config fields, the tensors of a slot and their checks, the
 * reader's primitives, the CONF reader and skv_snapshot_config) and lib/skv_snapshot.c
 * (the cache's save and load). docs/DESIGN.md section 11 specifies the format. Private to
 * the library.
 */
#ifndef SKV_SNAPSHOT_H
#define SKV_SNAPSHOT_H

#include <stdio.h>
#include <stdint.h>

#include "skv_internal.h"

#define SNAP_VERSION 4u        /* what save writes; load reads versions 1 to 4 */
#define SNAP_PREAMBLE 16u      /* magic[8], u32 version, u32 flags */
#define SNAP_SEC_HEAD 16u      /* u32 tag, u32 reserved, u64 payload length */
#define SNAP_SEC_CRC 4u        /* u32 CRC32C of head + payload */
#define SNAP_CONF_BYTES_V1 96u /* version 1's CONF payload */
#define SNAP_CONF_BYTES_V2 124u /* version 2's: version 1's fields, then the 0.3 fields */
#define SNAP_CONF_BYTES_V3 128u /* version 3's: version 2's, then select_candidates (0.4) */
#define SNAP_CONF_BYTES 136u   /* version 4's: version 3's, then the head shard (0.7) */
#define SNAP_STATE_BYTES_V1 40u /* a version 1 SLOT payload's state fields */
#define SNAP_STATE_BYTES 48u   /* version 2's: then u32 rank, u32 dense */
/* The CONF and state bytes of a format version (1 to 4). */
#define SNAP_CONF_OF(v)                                                                                   \
    ((v) == 1u ? SNAP_CONF_BYTES_V1 : (v) == 2u ? SNAP_CONF_BYTES_V2 : (v) == 3u ? SNAP_CONF_BYTES_V3 : SNAP_CONF_BYTES)
#define SNAP_STATE_OF(v) ((v) == 1u ? SNAP_STATE_BYTES_V1 : SNAP_STATE_BYTES)
#define SNAP_END_BYTES 16u     /* u64 file size, u32 CRC32C of the bytes before END, u32 reserved */
#define SNAP_STAGE (1u << 20)  /* host staging buffer for tensor data */

/* The first 8 bytes of every snapshot: "SKVSNAP\0". */
extern const unsigned char skv_snap_magic[8];
#define SNAP_TAG(a, b, c, d) ((uint32_t)(a) | (uint32_t)(b) << 8 | (uint32_t)(c) << 16 | (uint32_t)(d) << 24)
#define TAG_CONF SNAP_TAG('C', 'O', 'N', 'F')
#define TAG_SLOT SNAP_TAG('S', 'L', 'O', 'T')
#define TAG_END SNAP_TAG('E', 'N', 'D', 0)

/* ---- CRC32C (Castagnoli): skv_snap_crc_ready() once before any skv_snap_crc --------------- */

void skv_snap_crc_ready(void);
/* Continues a CRC32C: crc is the running value (0 to start), the result the CRC of everything so far. */
uint32_t skv_snap_crc(uint32_t crc, const void *data, size_t n);

/* ---- little-endian fields ------------------------------------------------------------------ */

/* v as 4 little-endian bytes at p. */
static inline void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
/* v as 8 little-endian bytes at p. */
static inline void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
/* The little-endian u32 at p. */
static inline uint32_t get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
/* The little-endian u64 at p. */
static inline uint64_t get_u64(const unsigned char *p) { return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32; }
/* Converts n elements of esize bytes (2 or 4) between host order and little-endian, in place. */
void skv_snap_swap(void *data, size_t n, size_t esize);

/* ---- the config fields, in format order ---------------------------------------------------- */

/* One model field of skv_config: its name in messages and format, and where it is. */
typedef enum { F_I32, F_I64, F_F32 } snap_ftype;
typedef struct {
    const char *name;
    snap_ftype type;
    size_t off;
} snap_field;

extern const snap_field skv_snap_fields[];
extern const size_t skv_snap_n_fields;
/* The fields of version 1 (the first ones; version 2 appends the rest). */
#define SNAP_N_FIELDS_V1 23u
#define SNAP_N_FIELDS_V2 29u /* version 2: the 0.3 fields added */
#define SNAP_N_FIELDS_V3 30u /* version 3: select_candidates added */
/* The fields a version's CONF holds. */
#define SNAP_N_FIELDS_OF(v) \
    ((v) == 1u ? SNAP_N_FIELDS_V1 : (v) == 2u ? SNAP_N_FIELDS_V2 : (v) == 3u ? SNAP_N_FIELDS_V3 : skv_snap_n_fields)
/* Bytes of one field in the format. */
static inline size_t snap_field_bytes(snap_ftype t) { return t == F_I64 ? 8 : 4; }
/* The field's value as 64 bits (an int sign-extended, a float's bit pattern). */
uint64_t skv_snap_field_get(const skv_config *c, const snap_field *f);
/* Sets the field from its 64-bit form (as skv_snap_field_get gives it). */
void skv_snap_field_set(skv_config *c, const snap_field *f, uint64_t v);
/* Writes a field's value into a message ("12", "0.5 (bits 0x3f000000)"). */
void skv_snap_field_fmt(char *buf, size_t cap, const snap_field *f, uint64_t v);

/* ---- slot contents: the tensors of one (layer, sequence), in format order --------------- */

enum { T_BF16, T_CAND, T_OUT, T_SELIDX, T_SELIDS, T_SELCNT, T_NKINDS }; /* kinds: bf16 data, or int32 ids of one role */
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
static inline size_t snap_esize(int kind) { return kind == T_BF16 ? sizeof(skv_bf16) : sizeof(int32_t); }

/* The tensors a prefilled slot with state *s contributes to a snapshot of format version v, in
   format order, into t[]; their count. */
int skv_snap_tensors(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, uint32_t v, snap_tensor *t);
/* Whether a slot's state fields are one a cache of config g can be in; a reason into why. */
int skv_snap_check_state(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, char *why, size_t cap);
/* The payload bytes of a SLOT section of format version v with state *s into *bytes; 0 on size_t overflow. */
int skv_snap_slot_bytes(const skv_config *g, const skv_layout *lay, const skv_seq_state *s, uint32_t v,
                        size_t *bytes);
/* Whether the states of all slots together are a cache's; a reason into why. */
int skv_snap_check_states(const skv_config *g, const skv_seq_state *st, char *why, size_t cap);

/* ---- reader ------------------------------------------------------------------------------- */

/* Where a load comes from: a buffer (buf, size) or a stream (f of size bytes); running checksums. */
typedef struct {
    const unsigned char *buf;
    FILE *f;
    const char *path;
    size_t size, pos;
    uint32_t file_crc, sec_crc;
    uint32_t version; /* the format version, once the preamble is read */
} snap_in;


/* Opens the snapshot file at path for reading into *in (a regular file; its size). fn names the
   caller in messages. */
skv_status skv_snap_open(snap_in *in, const char *path, const char *fn);
/* Reads exactly n bytes (the caller checked that they are there); updates both checksums. */
skv_status skv_snap_in_read(snap_in *in, void *dst, size_t n, const char *what);
/* Goes back to the start of the input (for the second pass). */
skv_status skv_snap_in_rewind(snap_in *in);
/* Reads a section's head: the tag must be want and the payload length exactly len, all present. */
skv_status skv_snap_in_section(snap_in *in, uint32_t want, const char *name, uint64_t len, const char *where);
/* Reads and compares a section's checksum. */
skv_status skv_snap_in_section_end(snap_in *in, const char *name, const char *where);
/* Reads the preamble and the CONF section into *snap and its layout (SKV_ERR_FORMAT for a config
   that fails validation). */
skv_status skv_snap_in_header(snap_in *in, skv_config *snap, skv_layout *lay);
/* The config a load creates the cache with: the snapshot's model fields and the runtime fields
   of *cfg (or the defaults when cfg is NULL); a model field of *cfg that differs is
   SKV_ERR_INVALID_CONFIG. */
skv_status skv_snap_run_config(const skv_config *snap, const skv_config *cfg, skv_config *run);

#endif
