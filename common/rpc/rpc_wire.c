#include "rpc_wire.h"

/* First allocation for a message split across DATA frames; it doubles as
 * bytes arrive, up to the announced size. */
#define SP_RPC_DEFRAME_CHUNK (64u << 10)

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Reassembly buffers from this size on are mappings of their own that grow
 * with mremap: the pages already filled move without a copy or a fault.
 * Through realloc, 16 messages of 8 MiB growing side by side copied and
 * faulted 64 MiB at their last doubling, 10 ms a 64 KiB read, as glibc
 * serves such sizes from its heap once it has freed one. */
#define SP_RPC_DEFRAME_MAP (1u << 20)

static uint8_t *buf_alloc(size_t cap) {
  if (cap < SP_RPC_DEFRAME_MAP) return malloc(cap);
  void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

/* NULL on failure, the old buffer still valid. */
static uint8_t *buf_grow(uint8_t *b, size_t cap, size_t new_cap) {
  if (new_cap < SP_RPC_DEFRAME_MAP) return realloc(b, new_cap);
  if (cap >= SP_RPC_DEFRAME_MAP) {
    void *p = mremap(b, cap, new_cap, MREMAP_MAYMOVE);
    return p == MAP_FAILED ? NULL : p;
  }
  uint8_t *n = buf_alloc(new_cap);
  if (n == NULL) return NULL;
  memcpy(n, b, cap);
  free(b);
  return n;
}

void sp_rpc_deframer_buf_free(uint8_t *buf, size_t cap) {
  if (buf == NULL) return;
  if (cap < SP_RPC_DEFRAME_MAP)
    free(buf);
  else
    munmap(buf, cap);
}

static const char *const k_codes[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *sp_rpc_code_name(int code) {
  if (code < 0 || code > 16) return "UNKNOWN";
  return k_codes[code];
}

size_t sp_rpc_pct_encode(const char *in, char *out, size_t cap) {
  static const char hex[] = "0123456789ABCDEF";
  size_t o = 0;
  if (cap == 0) return 0;
  for (const unsigned char *p = (const unsigned char *)in; *p; p++) {
    bool literal = *p >= 0x20 && *p <= 0x7E && *p != '%';
    size_t need = literal ? 1 : 3;
    if (o + need >= cap) break;
    if (literal) {
      out[o++] = (char)*p;
    } else {
      out[o++] = '%';
      out[o++] = hex[*p >> 4];
      out[o++] = hex[*p & 15];
    }
  }
  out[o] = '\0';
  return o;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void sp_rpc_pct_decode(const char *in, size_t len, char *out, size_t cap) {
  size_t o = 0;
  if (cap == 0) return;
  for (size_t i = 0; i < len && o + 1 < cap; i++) {
    int hi, lo;
    if (in[i] == '%' && i + 2 < len && (hi = hexval(in[i + 1])) >= 0 &&
        (lo = hexval(in[i + 2])) >= 0) {
      out[o++] = (char)(hi << 4 | lo);
      i += 2;
    } else {
      out[o++] = in[i];
    }
  }
  out[o] = '\0';
}

int64_t sp_rpc_timeout_parse(const char *v, size_t len) {
  if (len < 2 || len > 9) return -1;
  uint64_t n = 0;
  for (size_t i = 0; i + 1 < len; i++) {
    if (v[i] < '0' || v[i] > '9') return -1;
    n = n * 10 + (uint64_t)(v[i] - '0');
  }
  /* convert to ms, rounding up so a deadline never fires early */
  switch (v[len - 1]) {
    case 'H': return (int64_t)(n * 3600000u);
    case 'M': return (int64_t)(n * 60000u);
    case 'S': return (int64_t)(n * 1000u);
    case 'm': return (int64_t)n;
    case 'u': return (int64_t)((n + 999) / 1000);
    case 'n': return (int64_t)((n + 999999) / 1000000);
    default: return -1;
  }
}

void sp_rpc_timeout_format(uint64_t ms, char *out) {
  /* at most 8 digits: pick the finest unit that fits */
  if (ms < 100000000u)
    snprintf(out, 16, "%llum", (unsigned long long)ms);
  else if (ms / 1000 < 100000000u)
    snprintf(out, 16, "%lluS", (unsigned long long)((ms + 999) / 1000));
  else if (ms / 60000 < 100000000u)
    snprintf(out, 16, "%lluM", (unsigned long long)((ms + 59999) / 60000));
  else {
    uint64_t h = (ms + 3599999) / 3600000;
    snprintf(out, 16, "%lluH",
             (unsigned long long)(h < 100000000u ? h : 99999999u));
  }
}

static const char k_b64[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t sp_rpc_b64_encode(const uint8_t *in, size_t len, char *out) {
  size_t o = 0, i = 0;
  for (; i + 3 <= len; i += 3) {
    uint32_t v = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8 | in[i + 2];
    out[o++] = k_b64[v >> 18];
    out[o++] = k_b64[(v >> 12) & 63];
    out[o++] = k_b64[(v >> 6) & 63];
    out[o++] = k_b64[v & 63];
  }
  if (len - i == 1) {
    uint32_t v = (uint32_t)in[i] << 16;
    out[o++] = k_b64[v >> 18];
    out[o++] = k_b64[(v >> 12) & 63];
  } else if (len - i == 2) {
    uint32_t v = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8;
    out[o++] = k_b64[v >> 18];
    out[o++] = k_b64[(v >> 12) & 63];
    out[o++] = k_b64[(v >> 6) & 63];
  }
  out[o] = '\0';
  return o;
}

static int b64val(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+' || c == '-') return 62; /* also accept the URL alphabet */
  if (c == '/' || c == '_') return 63;
  return -1;
}

/* One comma-free segment. */
static long b64_segment(const char *in, size_t len, uint8_t *out) {
  while (len > 0 && in[len - 1] == '=') len--;
  if (len % 4 == 1) return -1;
  size_t o = 0;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < len; i++) {
    int v = b64val(in[i]);
    if (v < 0) return -1;
    acc = (acc << 6) | (uint32_t)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out[o++] = (uint8_t)(acc >> bits);
    }
  }
  return (long)o;
}

long sp_rpc_b64_decode(const char *in, size_t len, uint8_t *out) {
  size_t o = 0, start = 0;
  for (size_t i = 0; i <= len; i++) {
    if (i == len || in[i] == ',') {
      size_t s = start, e = i;
      while (s < e && in[s] == ' ') s++;
      while (e > s && in[e - 1] == ' ') e--;
      long n = b64_segment(in + s, e - s, out + o);
      if (n < 0) return -1;
      o += (size_t)n;
      start = i + 1;
    }
  }
  return (long)o;
}

bool sp_rpc_md_key_valid(const char *key, size_t len) {
  if (len == 0) return false;
  for (size_t i = 0; i < len; i++) {
    char c = key[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '_' ||
          c == '.' || c == '-'))
      return false;
  }
  return true;
}

bool sp_rpc_md_key_is_bin(const char *key, size_t len) {
  return len >= 4 && memcmp(key + len - 4, "-bin", 4) == 0;
}

bool sp_rpc_md_value_valid(const uint8_t *v, size_t len) {
  for (size_t i = 0; i < len; i++)
    if (v[i] < 0x20 || v[i] > 0x7E) return false;
  return true;
}

int sp_rpc_mdlist_add(sp_rpc_mdlist *l, const char *key, size_t klen,
                      const uint8_t *v, size_t vlen, size_t budget) {
  size_t cost = klen + vlen + 32;
  if (l->bytes + cost > budget) return SP_ETOOBIG;
  if (l->n == l->cap) {
    /* Most calls carry one or two entries (a user-agent), and a request's
     * list lives as long as its call: start small. */
    size_t cap = l->cap ? l->cap * 2 : 2;
    struct sp_rpc_mdent *e = sp_rpc_mem_realloc(l->mem, l->e, cap * sizeof *e);
    if (e == NULL) return SP_ENOMEM;
    l->e = e;
    l->cap = cap;
  }
  /* key and value share one allocation, owned through the key */
  char *k = sp_rpc_mem_alloc(l->mem, klen + 1 + vlen + 1);
  if (k == NULL) return SP_ENOMEM;
  uint8_t *val = (uint8_t *)k + klen + 1;
  memcpy(k, key, klen);
  k[klen] = '\0';
  if (vlen) memcpy(val, v, vlen);
  val[vlen] = '\0'; /* convenient for ASCII values */
  l->e[l->n++] = (struct sp_rpc_mdent){k, val, vlen};
  l->bytes += cost;
  return 0;
}

const uint8_t *sp_rpc_mdlist_get(const sp_rpc_mdlist *l, const char *key,
                                 size_t *len) {
  for (size_t i = 0; i < l->n; i++) {
    if (strcmp(l->e[i].key, key) == 0) {
      if (len) *len = l->e[i].len;
      return l->e[i].value;
    }
  }
  return NULL;
}

void sp_rpc_mdlist_clear(sp_rpc_mdlist *l) {
  sp_rpc_mem *mem = l->mem;
  for (size_t i = 0; i < l->n; i++) sp_rpc_mem_free(mem, l->e[i].key);
  sp_rpc_mem_free(mem, l->e);
  memset(l, 0, sizeof *l);
  l->mem = mem;
}

void sp_rpc_deframer_init(sp_rpc_deframer *d, size_t max) {
  memset(d, 0, sizeof *d);
  d->max = max;
}

/* Charges a buffer of cap bytes (replacing what is charged) to the shared
 * budget; SP_EAGAIN when it does not fit. */
static int deframer_charge(sp_rpc_deframer *d, size_t cap) {
  if (d->used == NULL) return 0;
  if (cap > d->charged && *d->used + (cap - d->charged) > d->used_max)
    return SP_EAGAIN;
  *d->used = *d->used - d->charged + cap;
  d->charged = cap;
  return 0;
}

static void deframer_release(sp_rpc_deframer *d) {
  sp_rpc_deframer_buf_free(d->buf, d->cap);
  d->buf = NULL;
  if (d->used != NULL) *d->used -= d->charged;
  d->charged = 0;
}

void sp_rpc_deframer_free(sp_rpc_deframer *d) { deframer_release(d); }

uint8_t *sp_rpc_deframer_take(sp_rpc_deframer *d, size_t *charged,
                              size_t *cap) {
  uint8_t *b = d->buf;
  *charged = b != NULL ? d->charged : 0;
  *cap = b != NULL ? d->cap : 0;
  if (b != NULL) {
    d->buf = NULL;
    d->charged = 0;
    d->cap = 0;
  }
  return b;
}

bool sp_rpc_deframer_partial(const sp_rpc_deframer *d) {
  return d->hdr_have > 0 || d->in_body;
}

int sp_rpc_deframer_feed(sp_rpc_deframer *d, const uint8_t *data, size_t len,
                         sp_rpc_msg_fn fn, void *ud, uint64_t *len_out) {
  while (len > 0) {
    if (!d->in_body) {
      size_t take = 5 - d->hdr_have;
      if (take > len) take = len;
      memcpy(d->hdr + d->hdr_have, data, take);
      d->hdr_have += take;
      data += take;
      len -= take;
      if (d->hdr_have < 5) return 0;
      uint32_t n = (uint32_t)d->hdr[1] << 24 | (uint32_t)d->hdr[2] << 16 |
                   (uint32_t)d->hdr[3] << 8 | d->hdr[4];
      if (d->hdr[0] == 1) return SP_EUNSUPPORTED;
      if (d->hdr[0] != 0) return SP_EFORMAT;
      if (n > d->max) {
        if (len_out) *len_out = n;
        return SP_ETOOBIG; /* before any allocation */
      }
      d->hdr_have = 0;
      d->need = n;
      d->have = 0;
      d->in_body = true;
      /* whole message in this chunk: hand it over without copying */
      if (len >= n) {
        d->in_body = false;
        int rc = fn(ud, data, n);
        if (rc != 0) return rc;
        data += n;
        len -= n;
        continue;
      }
      /* Memory follows the bytes that actually arrived, not the size a
       * prefix announces: six bytes must not reserve 4 MiB. */
      deframer_release(d);
      d->cap = n < SP_RPC_DEFRAME_CHUNK ? (n ? n : 1) : SP_RPC_DEFRAME_CHUNK;
      if (deframer_charge(d, d->cap) != 0) return SP_EAGAIN;
      d->buf = buf_alloc(d->cap);
      if (d->buf == NULL) return SP_ENOMEM;
      continue;
    }
    size_t take = d->need - d->have;
    if (take > len) take = len;
    if (d->have + take > d->cap) {
      size_t cap = d->cap;
      while (cap < d->have + take) cap = cap * 2 < d->need ? cap * 2 : d->need;
      if (deframer_charge(d, cap) != 0) return SP_EAGAIN;
      uint8_t *b = buf_grow(d->buf, d->cap, cap);
      if (b == NULL) return SP_ENOMEM;
      d->buf = b;
      d->cap = cap;
    }
    memcpy(d->buf + d->have, data, take);
    d->have += take;
    data += take;
    len -= take;
    if (d->have == d->need) {
      d->in_body = false;
      int rc = fn(ud, d->buf, d->need);
      deframer_release(d);
      if (rc != 0) return rc;
    }
  }
  return 0;
}

struct sp_rpc_outmsg {
  struct sp_rpc_outmsg *next;
  size_t len, off;
  uint8_t data[];
};

int sp_rpc_outq_push(sp_rpc_outq *q, const ProtobufCMessage *msg,
                     const uint8_t *data, size_t len) {
  if (len > SIZE_MAX - sizeof(struct sp_rpc_outmsg) - 5) return SP_ENOMEM;
  struct sp_rpc_outmsg *m = sp_rpc_mem_alloc(q->mem, sizeof *m + len + 5);
  if (m == NULL) return SP_ENOMEM;
  m->next = NULL;
  m->len = len + 5;
  m->off = 0;
  sp_rpc_frame_prefix(m->data, (uint32_t)len);
  if (msg != NULL)
    protobuf_c_message_pack(msg, m->data + 5);
  else if (len > 0 && data != NULL)
    memcpy(m->data + 5, data, len);
  if (q->tail != NULL)
    q->tail->next = m;
  else
    q->head = m;
  q->tail = m;
  q->bytes += m->len;
  return 0;
}

size_t sp_rpc_outq_pull(sp_rpc_outq *q, uint8_t *buf, size_t cap) {
  size_t out = 0;
  while (out < cap && q->head != NULL) {
    struct sp_rpc_outmsg *m = q->head;
    size_t take = m->len - m->off;
    if (take > cap - out) take = cap - out;
    memcpy(buf + out, m->data + m->off, take);
    m->off += take;
    out += take;
    if (m->off == m->len) {
      q->head = m->next;
      if (q->head == NULL) q->tail = NULL;
      q->bytes -= m->len;
      sp_rpc_mem_free(q->mem, m);
    }
  }
  return out;
}

bool sp_rpc_outq_empty(const sp_rpc_outq *q) { return q->head == NULL; }

void sp_rpc_outq_clear(sp_rpc_outq *q) {
  for (struct sp_rpc_outmsg *m = q->head; m;) {
    struct sp_rpc_outmsg *n = m->next;
    sp_rpc_mem_free(q->mem, m);
    m = n;
  }
  q->head = q->tail = NULL;
  q->bytes = 0;
}

void sp_rpc_frame_prefix(uint8_t out[5], uint32_t len) {
  out[0] = 0;
  out[1] = (uint8_t)(len >> 24);
  out[2] = (uint8_t)(len >> 16);
  out[3] = (uint8_t)(len >> 8);
  out[4] = (uint8_t)len;
}

int sp_rpc_code_from_rst(uint32_t e) {
  switch (e) {
    case 0x7: return SP_RPC_UNAVAILABLE;        /* REFUSED_STREAM */
    case 0x8: return SP_RPC_CANCELLED;          /* CANCEL */
    case 0xb: return SP_RPC_RESOURCE_EXHAUSTED; /* ENHANCE_YOUR_CALM */
    case 0xc: return SP_RPC_PERMISSION_DENIED;  /* INADEQUATE_SECURITY */
    default: return SP_RPC_INTERNAL;
  }
}

int sp_rpc_code_from_http(int s) {
  switch (s) {
    case 400:
    case 431: return SP_RPC_INTERNAL;
    case 401: return SP_RPC_UNAUTHENTICATED;
    case 403: return SP_RPC_PERMISSION_DENIED;
    case 404: return SP_RPC_UNIMPLEMENTED;
    case 429:
    case 502:
    case 503:
    case 504: return SP_RPC_UNAVAILABLE;
    default: return SP_RPC_UNKNOWN;
  }
}

int sp_rpc_split_addr(const char *addr, char *host, size_t host_cap,
                      int *port) {
  if (addr == NULL) return SP_EINVAL;
  const char *colon;
  const char *h = addr;
  size_t hlen;
  if (addr[0] == '[') {
    const char *rb = strchr(addr, ']');
    if (rb == NULL || rb[1] != ':') return SP_EINVAL;
    h = addr + 1;
    hlen = (size_t)(rb - h);
    colon = rb + 1;
  } else {
    colon = strrchr(addr, ':');
    if (colon == NULL) return SP_EINVAL;
    hlen = (size_t)(colon - addr);
    if (memchr(addr, ':', hlen) != NULL) return SP_EINVAL; /* bare v6 */
  }
  if (hlen == 0 || hlen >= host_cap) return SP_EINVAL;
  const char *p = colon + 1;
  if (*p == '\0' || strlen(p) > 5) return SP_EINVAL;
  long v = 0;
  for (; *p; p++) {
    if (*p < '0' || *p > '9') return SP_EINVAL;
    v = v * 10 + (*p - '0');
  }
  if (v > 65535) return SP_EINVAL;
  memcpy(host, h, hlen);
  host[hlen] = '\0';
  *port = (int)v;
  return 0;
}
