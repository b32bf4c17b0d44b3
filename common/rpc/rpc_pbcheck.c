#include "rpc_pbcheck.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/sp_error.h"

int sp_rpc_utf8_valid(const uint8_t *s, size_t n, size_t *bad) {
  size_t i = 0;
  while (i < n) {
    /* ASCII runs, the common case for names and keys, 8 bytes at a time */
    while (i + 8 <= n) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    uint8_t c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t k;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF)
      k = 1, cp = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF)
      k = 2, cp = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4)
      k = 3, cp = c & 0x07, min = 0x10000;
    else
      goto fail; /* continuation byte, C0/C1 overlong lead, or > F4 */
    if (n - i <= k) goto fail;
    for (size_t j = 1; j <= k; j++) {
      if ((s[i + j] & 0xC0) != 0x80) goto fail;
      cp = cp << 6 | (s[i + j] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) goto fail;
    i += k + 1;
  }
  return 1;
fail:
  if (bad != NULL) *bad = i;
  return 0;
}

typedef struct pbscan {
  char *err;
  size_t cap;
  /* what protobuf-c will allocate, estimated as the scan goes, and the
   * most allowed (0: no limit) */
  size_t decoded, max_decoded;
  /* the message as a whole, which the budget is for */
  const ProtobufCMessageDescriptor *top;
} pbscan;

/* What malloc adds to each allocation, for the estimate. */
#define ALLOC_OVERHEAD 16u

static int scan_fail(pbscan *sc, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int scan_fail(pbscan *sc, const char *fmt, ...) {
  if (sc->err != NULL && sc->cap > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sc->err, sc->cap, fmt, ap);
    va_end(ap);
  }
  return SP_EFORMAT;
}

/* A varint at p[*off..n): its value, or false when it runs past the end
 * or over 10 bytes. */
static inline bool get_varint(const uint8_t *p, size_t n, size_t *off,
                              uint64_t *v) {
  if (*off < n && p[*off] < 0x80) { /* one byte: most tags and values */
    *v = p[(*off)++];
    return true;
  }
  uint64_t x = 0;
  for (unsigned i = 0; i < 10; i++) {
    if (*off >= n) return false;
    uint8_t b = p[(*off)++];
    x |= (uint64_t)(b & 0x7F) << (7 * i);
    if ((b & 0x80) == 0) {
      *v = x;
      return true;
    }
  }
  return false;
}

static size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

static size_t put_varint(uint8_t *dst, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    dst[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  dst[n++] = (uint8_t)v;
  return n;
}

/* The wire type protobuf-c reads a field of this type with. */
static unsigned natural_wire_type(ProtobufCType t) {
  switch (t) {
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT: return 5;
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE: return 1;
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_BYTES:
    case PROTOBUF_C_TYPE_MESSAGE: return 2;
    default: return 0; /* the varint types, bool and enum */
  }
}

/* A packed repeated scalar's payload must hold whole elements; *count
 * gets how many. */
static bool packed_ok(unsigned wt, const uint8_t *p, size_t n, size_t *count) {
  if (wt == 5 || wt == 1) {
    *count = n / (wt == 5 ? 4 : 8);
    return n % (wt == 5 ? 4 : 8) == 0;
  }
  size_t off = 0, k = 0;
  uint64_t v;
  while (off < n) {
    if (!get_varint(p, n, &off, &v)) return false;
    k++;
  }
  *count = k;
  return true;
}

/* Adds to the decode estimate; false once it is over the limit. */
static bool charge(pbscan *sc, size_t n) {
  sc->decoded += n;
  return sc->max_decoded == 0 || sc->decoded <= sc->max_decoded;
}

/* Field lookup, one table per message being scanned: the descriptor's
 * binary search cost 35 ns a field, and an 8 MiB message of 2-byte fields
 * has 4 million of them. Numbers below SMALL_IDS (nearly all) are an
 * index. */
#define SMALL_IDS 32
typedef struct fieldmap {
  const ProtobufCMessageDescriptor *d;
  const ProtobufCFieldDescriptor *small[SMALL_IDS];
} fieldmap;

static void fieldmap_init(fieldmap *m, const ProtobufCMessageDescriptor *d) {
  m->d = d;
  memset(m->small, 0, sizeof m->small);
  for (unsigned i = 0; i < d->n_fields; i++)
    if (d->fields[i].id < SMALL_IDS) m->small[d->fields[i].id] = &d->fields[i];
}

/* The densest unknown fields are two bytes, a one-byte tag and a one-byte
 * varint or empty length: for a tag byte, the largest second byte that
 * makes such a field, or -1. Long messages skip runs of them with one
 * table look-up each (2 ns a field instead of 8). */
typedef struct skip2 {
  int16_t lim[256];
} skip2;

static void skip2_init(skip2 *k, const fieldmap *m) {
  for (unsigned t = 0; t < 256; t++) {
    unsigned wt = t & 7, num = t >> 3;
    bool unknown = t < 0x80 && num != 0 && m->small[num] == NULL;
    k->lim[t] = !unknown ? -1 : wt == 0 ? 0x7F : wt == 2 ? 0 : -1;
  }
}

/* Skips the run of two-byte unknown fields at p[*off..n); whether any. */
static inline bool skip2_run(const skip2 *k, const uint8_t *p, size_t n,
                             size_t *off) {
  size_t o = *off;
  while (o + 1 < n && (int)p[o + 1] <= k->lim[p[o]]) o += 2;
  bool any = o != *off;
  *off = o;
  return any;
}

/* Below this size a message is scanned without the table. */
#define SKIP2_MIN 1024

static inline const ProtobufCFieldDescriptor *fieldmap_get(const fieldmap *m,
                                                           uint32_t num) {
  if (num < SMALL_IDS) return m->small[num];
  return protobuf_c_message_descriptor_get_field(m->d, num);
}

/* Names the whole message, not the nested one whose share happened to
 * cross the limit: which one that is depends on the sizes of all. */
static int over_budget(pbscan *sc, const ProtobufCMessageDescriptor *d) {
  (void)d;
  if (sc->err != NULL && sc->cap > 0)
    snprintf(sc->err, sc->cap,
             "%s: decoding it would take more than %zu bytes of memory",
             sc->top->name, sc->max_decoded);
  return SP_ETOOBIG;
}

/* One message's bytes: validates them and computes the size they have
 * without unknown fields (*keep) and whether any were found (*dropped).
 * base is the offset of p in the outermost message, for errors. */
static int check_msg(pbscan *sc, const ProtobufCMessageDescriptor *d,
                     const uint8_t *p, size_t n, size_t base, int depth,
                     size_t *keep, bool *dropped) {
  if (depth > SP_PBCHECK_MAX_DEPTH)
    return scan_fail(sc, "%s: messages nested more than %d deep", d->name,
                     SP_PBCHECK_MAX_DEPTH);
  size_t off = 0, kept = 0;
  bool any = false;
  if (!charge(sc, d->sizeof_message + ALLOC_OVERHEAD))
    return over_budget(sc, d);
  fieldmap fm;
  fieldmap_init(&fm, d);
  skip2 sk;
  bool fast = n >= SKIP2_MIN;
  if (fast) skip2_init(&sk, &fm);
  while (off < n) {
    if (fast && skip2_run(&sk, p, n, &off)) {
      any = true;
      if (off >= n) break;
    }
    size_t start = off;
    uint64_t tag;
    if (!get_varint(p, n, &off, &tag) || tag > UINT32_MAX)
      return scan_fail(sc, "%s: malformed wire data at byte %zu (field tag)",
                       d->name, base + start);
    size_t tag_end = off;
    unsigned wt = (unsigned)(tag & 7);
    uint32_t num = (uint32_t)(tag >> 3);
    if (num == 0)
      return scan_fail(sc, "%s: malformed wire data at byte %zu (field 0)",
                       d->name, base + start);
    size_t vstart = off, plen = 0;
    uint64_t v;
    switch (wt) {
      case 0:
        if (!get_varint(p, n, &off, &v))
          return scan_fail(sc, "%s: malformed wire data at byte %zu (varint)",
                           d->name, base + vstart);
        break;
      case 1:
      case 5: {
        size_t w = wt == 1 ? 8 : 4;
        if (n - off < w)
          return scan_fail(sc,
                           "%s: malformed wire data at byte %zu (truncated)",
                           d->name, base + vstart);
        off += w;
        break;
      }
      case 2:
        if (!get_varint(p, n, &off, &v) || v > n - off)
          return scan_fail(sc, "%s: malformed wire data at byte %zu (length)",
                           d->name, base + vstart);
        vstart = off;
        plen = (size_t)v;
        off += plen;
        break;
      default:
        return scan_fail(sc,
                         "%s: malformed wire data at byte %zu (wire type %u)",
                         d->name, base + start, wt);
    }
    const ProtobufCFieldDescriptor *f = fieldmap_get(&fm, num);
    if (f == NULL) { /* unknown: dropped */
      any = true;
      continue;
    }
    unsigned want = natural_wire_type(f->type);
    bool packed = wt == 2 && want != 2 && f->label == PROTOBUF_C_LABEL_REPEATED;
    if (wt != want && !packed)
      return scan_fail(sc, "%s.%s: wire type %u where %u is expected", d->name,
                       f->name, wt, want);
    size_t sz = off - start;
    size_t elems = 1;
    if (packed && !packed_ok(want, p + vstart, plen, &elems))
      return scan_fail(sc, "%s.%s: malformed packed field at byte %zu", d->name,
                       f->name, base + vstart);
    /* protobuf-c's allocations: an array slot per repeated element, a copy
     * of each string and non-empty bytes, each nested message */
    size_t cost = 0;
    if (f->label == PROTOBUF_C_LABEL_REPEATED)
      cost += elems * (f->type == PROTOBUF_C_TYPE_BYTES
                           ? sizeof(ProtobufCBinaryData)
                           : sizeof(uint64_t));
    if (f->type == PROTOBUF_C_TYPE_STRING)
      cost += plen + 1 + ALLOC_OVERHEAD;
    else if (f->type == PROTOBUF_C_TYPE_BYTES && plen > 0)
      cost += plen + ALLOC_OVERHEAD;
    if (!charge(sc, cost)) return over_budget(sc, d);
    if (f->type == PROTOBUF_C_TYPE_STRING) {
      const uint8_t *s = p + vstart;
      const uint8_t *z = memchr(s, 0, plen);
      if (z != NULL)
        return scan_fail(sc, "%s.%s: contains a NUL byte at offset %zu",
                         d->name, f->name, (size_t)(z - s));
      size_t bad;
      if (!sp_rpc_utf8_valid(s, plen, &bad))
        return scan_fail(sc, "%s.%s: not valid UTF-8 at offset %zu", d->name,
                         f->name, bad);
    } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
      size_t sub = 0;
      bool sub_dropped = false;
      int rc = check_msg(sc, f->descriptor, p + vstart, plen, base + vstart,
                         depth + 1, &sub, &sub_dropped);
      if (rc != 0) return rc;
      if (sub_dropped) {
        any = true;
        sz = (tag_end - start) + varint_size(sub) + sub;
      }
    }
    kept += sz;
  }
  *keep = kept;
  *dropped = any;
  return 0;
}

/* Writes the known fields of a message check_msg accepted into dst;
 * returns the bytes written (what check_msg computed as *keep). */
static size_t write_msg(const ProtobufCMessageDescriptor *d, const uint8_t *p,
                        size_t n, uint8_t *dst) {
  size_t off = 0, w = 0;
  fieldmap fm;
  fieldmap_init(&fm, d);
  skip2 sk;
  bool fast = n >= SKIP2_MIN;
  if (fast) skip2_init(&sk, &fm);
  while (off < n) {
    if (fast && skip2_run(&sk, p, n, &off) && off >= n) break;
    size_t start = off;
    uint64_t tag = 0, v = 0; /* check_msg proved every read succeeds */
    get_varint(p, n, &off, &tag);
    size_t tag_end = off;
    unsigned wt = (unsigned)(tag & 7);
    size_t vstart = off, plen = 0;
    if (wt == 0)
      get_varint(p, n, &off, &v);
    else if (wt == 1)
      off += 8;
    else if (wt == 5)
      off += 4;
    else {
      get_varint(p, n, &off, &v);
      vstart = off;
      plen = (size_t)v;
      off += plen;
    }
    const ProtobufCFieldDescriptor *f = fieldmap_get(&fm, (uint32_t)(tag >> 3));
    if (f == NULL) continue;
    if (f->type == PROTOBUF_C_TYPE_MESSAGE && wt == 2) {
      size_t sub = 0;
      bool sub_dropped = false;
      pbscan quiet = {NULL, 0, 0, 0, NULL};
      check_msg(&quiet, f->descriptor, p + vstart, plen, 0, 0, &sub,
                &sub_dropped);
      if (sub_dropped) {
        size_t hdr = tag_end - start;
        memcpy(dst + w, p + start, hdr);
        w += hdr;
        w += put_varint(dst + w, sub);
        w += write_msg(f->descriptor, p + vstart, plen, dst + w);
        continue;
      }
    }
    memcpy(dst + w, p + start, off - start);
    w += off - start;
  }
  return w;
}

int sp_rpc_pbcheck(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                   size_t len, size_t max_decoded, uint8_t **out,
                   size_t *out_len, char *err, size_t err_cap) {
  if (desc == NULL || (data == NULL && len > 0) || out == NULL ||
      out_len == NULL)
    return SP_EINVAL;
  *out = NULL;
  *out_len = 0;
  if (err != NULL && err_cap > 0) err[0] = '\0';
  pbscan sc = {err, err_cap, 0, max_decoded, desc};
  size_t keep = 0;
  bool dropped = false;
  int rc = check_msg(&sc, desc, data, len, 0, 0, &keep, &dropped);
  if (rc != 0 || !dropped) return rc;
  uint8_t *buf = malloc(keep ? keep : 1);
  if (buf == NULL) return SP_ENOMEM;
  *out_len = write_msg(desc, data, len, buf);
  *out = buf;
  return 0;
}
