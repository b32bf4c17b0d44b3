#include "h2_raw.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sp_h2buf_put(sp_h2buf *b, const void *d, size_t n) {
  if (n == 0) return;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n) cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (p == NULL) {
      fprintf(stderr, "h2_raw: out of memory\n");
      abort();
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, d, n);
  b->len += n;
}

void sp_h2buf_free(sp_h2buf *b) {
  free(b->p);
  memset(b, 0, sizeof *b);
}

static void put_u8(sp_h2buf *b, uint8_t v) { sp_h2buf_put(b, &v, 1); }

static void put_u32(sp_h2buf *b, uint32_t v) {
  uint8_t x[4] = {(uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8),
                  (uint8_t)v};
  sp_h2buf_put(b, x, 4);
}

void sp_h2_preface(sp_h2buf *b) {
  sp_h2buf_put(b, NGHTTP2_CLIENT_MAGIC, NGHTTP2_CLIENT_MAGIC_LEN);
}

void sp_h2_frame(sp_h2buf *b, uint8_t type, uint8_t flags, uint32_t sid,
                 const void *payload, size_t len) {
  uint8_t h[9] = {(uint8_t)(len >> 16),
                  (uint8_t)(len >> 8),
                  (uint8_t)len,
                  type,
                  flags,
                  (uint8_t)((sid >> 24) & 0x7f),
                  (uint8_t)(sid >> 16),
                  (uint8_t)(sid >> 8),
                  (uint8_t)sid};
  sp_h2buf_put(b, h, 9);
  sp_h2buf_put(b, payload, len);
}

void sp_h2_settings(sp_h2buf *b, const uint16_t *ids, const uint32_t *vals,
                    size_t n) {
  sp_h2buf p = {0};
  for (size_t i = 0; i < n; i++) {
    put_u8(&p, (uint8_t)(ids[i] >> 8));
    put_u8(&p, (uint8_t)ids[i]);
    put_u32(&p, vals[i]);
  }
  sp_h2_frame(b, NGHTTP2_SETTINGS, 0, 0, p.p, p.len);
  sp_h2buf_free(&p);
}

void sp_h2_settings_ack(sp_h2buf *b) {
  sp_h2_frame(b, NGHTTP2_SETTINGS, NGHTTP2_FLAG_ACK, 0, NULL, 0);
}

void sp_h2_window_update(sp_h2buf *b, uint32_t sid, uint32_t inc) {
  sp_h2buf p = {0};
  put_u32(&p, inc & 0x7fffffffu);
  sp_h2_frame(b, NGHTTP2_WINDOW_UPDATE, 0, sid, p.p, p.len);
  sp_h2buf_free(&p);
}

void sp_h2_rst_stream(sp_h2buf *b, uint32_t sid, uint32_t code) {
  sp_h2buf p = {0};
  put_u32(&p, code);
  sp_h2_frame(b, NGHTTP2_RST_STREAM, 0, sid, p.p, p.len);
  sp_h2buf_free(&p);
}

void sp_h2_ping(sp_h2buf *b, const uint8_t opaque[8]) {
  sp_h2_frame(b, NGHTTP2_PING, 0, 0, opaque, 8);
}

/* HPACK integer with an n-bit prefix (RFC 7541 §5.1); `first` holds the
 * bits above the prefix. */
static void hpack_int(sp_h2buf *b, uint8_t first, int nbits, size_t v) {
  size_t max = ((size_t)1 << nbits) - 1;
  if (v < max) {
    put_u8(b, (uint8_t)(first | v));
    return;
  }
  put_u8(b, (uint8_t)(first | max));
  v -= max;
  while (v >= 128) {
    put_u8(b, (uint8_t)(0x80 | (v & 0x7f)));
    v >>= 7;
  }
  put_u8(b, (uint8_t)v);
}

void sp_h2_hpack_lit(sp_h2buf *blk, const char *name, const void *value,
                     size_t vlen) {
  size_t nlen = strlen(name);
  put_u8(blk, 0x00);             /* literal without indexing, new name */
  hpack_int(blk, 0x00, 7, nlen); /* no Huffman */
  sp_h2buf_put(blk, name, nlen);
  hpack_int(blk, 0x00, 7, vlen);
  sp_h2buf_put(blk, value, vlen);
}

static void lit(sp_h2buf *blk, const char *name, const char *value) {
  sp_h2_hpack_lit(blk, name, value, strlen(value));
}

void sp_h2_grpc_request_block(sp_h2buf *blk, const char *path) {
  lit(blk, ":method", "POST");
  lit(blk, ":scheme", "http");
  lit(blk, ":path", path);
  lit(blk, ":authority", "localhost");
  lit(blk, "te", "trailers");
  lit(blk, "content-type", "application/grpc");
}

void sp_h2_headers(sp_h2buf *b, uint32_t sid, const sp_h2buf *blk,
                   bool end_stream, size_t max_frame) {
  if (max_frame == 0) max_frame = 16384;
  /* the size update first (see h2_raw.h): 001 prefix, 5-bit value 0 */
  sp_h2buf full = {0};
  put_u8(&full, 0x20);
  sp_h2buf_put(&full, blk->p, blk->len);
  size_t off = 0;
  bool first = true;
  do {
    size_t n = full.len - off < max_frame ? full.len - off : max_frame;
    bool last = off + n == full.len;
    uint8_t flags = last ? NGHTTP2_FLAG_END_HEADERS : 0;
    if (first && end_stream) flags |= NGHTTP2_FLAG_END_STREAM;
    sp_h2_frame(b, first ? NGHTTP2_HEADERS : NGHTTP2_CONTINUATION, flags, sid,
                full.p + off, n);
    off += n;
    first = false;
  } while (off < full.len);
  sp_h2buf_free(&full);
}

void sp_h2_data(sp_h2buf *b, uint32_t sid, const void *d, size_t len,
                bool end_stream) {
  sp_h2_frame(b, NGHTTP2_DATA, end_stream ? NGHTTP2_FLAG_END_STREAM : 0, sid, d,
              len);
}

void sp_h2_grpc_message(sp_h2buf *b, uint32_t sid, const void *msg, size_t len,
                        bool end_stream) {
  sp_h2buf p = {0};
  put_u8(&p, 0);
  put_u32(&p, (uint32_t)len);
  sp_h2buf_put(&p, msg, len);
  sp_h2_data(b, sid, p.p, p.len, end_stream);
  sp_h2buf_free(&p);
}

/* ---------------- reader ---------------- */

void sp_h2_reader_init(sp_h2_reader *r) {
  memset(r, 0, sizeof *r);
  r->header_table_size = 4096; /* RFC 9113 §6.5.2: the initial value */
  if (nghttp2_hd_inflate_new(&r->inf) != 0) {
    fprintf(stderr, "h2_raw: cannot create an HPACK inflater\n");
    abort();
  }
}

void sp_h2_reader_free(sp_h2_reader *r) {
  nghttp2_hd_inflate_del(r->inf);
  sp_h2buf_free(&r->in);
  sp_h2buf_free(&r->block);
  free(r->st);
  memset(r, 0, sizeof *r);
}

const sp_h2_stream *sp_h2_reader_stream(const sp_h2_reader *r, uint32_t sid) {
  for (size_t i = r->n_st; i-- > 0;)
    if (r->st[i].sid == sid) return &r->st[i];
  return NULL;
}

bool sp_h2_stream_done(const sp_h2_stream *s) {
  return s != NULL && (s->ended || s->reset);
}

static sp_h2_stream *stream_get(sp_h2_reader *r, uint32_t sid) {
  for (size_t i = r->n_st; i-- > 0;)
    if (r->st[i].sid == sid) return &r->st[i];
  if (r->n_st == r->cap_st) {
    size_t cap = r->cap_st ? r->cap_st * 2 : 16;
    sp_h2_stream *st = realloc(r->st, cap * sizeof *st);
    if (st == NULL) {
      fprintf(stderr, "h2_raw: out of memory\n");
      abort();
    }
    r->st = st;
    r->cap_st = cap;
  }
  sp_h2_stream *s = &r->st[r->n_st++];
  memset(s, 0, sizeof *s);
  s->sid = sid;
  s->grpc_status = -1;
  return s;
}

static bool name_is(const nghttp2_nv *nv, const char *name) {
  size_t n = strlen(name);
  return nv->namelen == n && memcmp(nv->name, name, n) == 0;
}

static int small_int(const uint8_t *v, size_t len) {
  int x = 0;
  if (len == 0 || len > 6) return -1;
  for (size_t i = 0; i < len; i++) {
    if (v[i] < '0' || v[i] > '9') return -1;
    x = x * 10 + (v[i] - '0');
  }
  return x;
}

static void decode_block(sp_h2_reader *r) {
  sp_h2_stream *s = stream_get(r, r->block_sid);
  const uint8_t *in = r->block.p;
  size_t inlen = r->block.len;
  for (;;) {
    nghttp2_nv nv;
    int fl = 0;
    ssize_t rv = nghttp2_hd_inflate_hd2(r->inf, &nv, &fl, in, inlen, 1);
    if (rv < 0) {
      r->error = true;
      return;
    }
    in += rv;
    inlen -= (size_t)rv;
    if (fl & NGHTTP2_HD_INFLATE_EMIT) {
      if (name_is(&nv, ":status")) {
        s->http_status = small_int(nv.value, nv.valuelen);
      } else if (name_is(&nv, "grpc-status")) {
        s->grpc_status = small_int(nv.value, nv.valuelen);
      } else if (name_is(&nv, "grpc-message")) {
        size_t n = nv.valuelen < sizeof s->grpc_message - 1
                       ? nv.valuelen
                       : sizeof s->grpc_message - 1;
        memcpy(s->grpc_message, nv.value, n);
        s->grpc_message[n] = '\0';
      }
    }
    if (fl & NGHTTP2_HD_INFLATE_FINAL) {
      nghttp2_hd_inflate_end_headers(r->inf);
      break;
    }
    if (!(fl & NGHTTP2_HD_INFLATE_EMIT) && inlen == 0) break;
  }
  if (r->block_es) s->ended = true;
  r->block.len = 0;
  r->in_block = false;
}

static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 |
         p[3];
}

/* One complete frame. */
static void on_frame(sp_h2_reader *r, uint8_t type, uint8_t flags, uint32_t sid,
                     const uint8_t *p, size_t len) {
  r->frames++;
  if (r->in_block && type != NGHTTP2_CONTINUATION) {
    r->error = true; /* CONTINUATION must follow directly */
    return;
  }
  switch (type) {
    case NGHTTP2_DATA: {
      sp_h2_stream *s = stream_get(r, sid);
      size_t pad = 0;
      if (flags & NGHTTP2_FLAG_PADDED) {
        if (len < 1) goto bad;
        pad = (size_t)p[0] + 1;
      }
      if (pad > len) goto bad;
      s->data_bytes += len - pad;
      if (flags & NGHTTP2_FLAG_END_STREAM) s->ended = true;
      return;
    }
    case NGHTTP2_HEADERS: {
      size_t off = 0, pad = 0;
      if (flags & NGHTTP2_FLAG_PADDED) {
        if (len < 1) goto bad;
        pad = p[0];
        off = 1;
      }
      if (flags & NGHTTP2_FLAG_PRIORITY) off += 5;
      if (off + pad > len) goto bad;
      r->block.len = 0;
      sp_h2buf_put(&r->block, p + off, len - off - pad);
      r->block_sid = sid;
      r->block_es = (flags & NGHTTP2_FLAG_END_STREAM) != 0;
      r->in_block = true;
      if (flags & NGHTTP2_FLAG_END_HEADERS) decode_block(r);
      return;
    }
    case NGHTTP2_CONTINUATION:
      if (!r->in_block || sid != r->block_sid) goto bad;
      sp_h2buf_put(&r->block, p, len);
      if (flags & NGHTTP2_FLAG_END_HEADERS) decode_block(r);
      return;
    case NGHTTP2_RST_STREAM: {
      if (len != 4) goto bad;
      sp_h2_stream *s = stream_get(r, sid);
      s->reset = true;
      s->rst_code = get_u32(p);
      return;
    }
    case NGHTTP2_SETTINGS:
      if (flags & NGHTTP2_FLAG_ACK) return;
      if (len % 6 != 0) goto bad;
      for (size_t i = 0; i < len; i += 6) {
        uint32_t id = (uint32_t)p[i] << 8 | p[i + 1];
        if (id == NGHTTP2_SETTINGS_HEADER_TABLE_SIZE)
          r->header_table_size = get_u32(p + i + 2);
      }
      r->settings++;
      return;
    case NGHTTP2_PING:
      if (flags & NGHTTP2_FLAG_ACK) r->pings_acked++;
      return;
    case NGHTTP2_GOAWAY:
      if (len < 8) goto bad;
      r->goaway = true;
      r->goaway_last = get_u32(p) & 0x7fffffffu;
      r->goaway_code = get_u32(p + 4);
      return;
    default: return; /* WINDOW_UPDATE, PRIORITY, unknown: nothing to record */
  }
bad:
  r->error = true;
}

void sp_h2_reader_feed(sp_h2_reader *r, const uint8_t *d, size_t n) {
  sp_h2buf_put(&r->in, d, n);
  size_t off = 0;
  while (!r->error && r->in.len - off >= 9) {
    const uint8_t *h = r->in.p + off;
    size_t len = (size_t)h[0] << 16 | (size_t)h[1] << 8 | h[2];
    if (r->in.len - off < 9 + len) break;
    uint32_t sid = get_u32(h + 5) & 0x7fffffffu;
    on_frame(r, h[3], h[4], sid, h + 9, len);
    off += 9 + len;
  }
  if (off > 0) {
    memmove(r->in.p, r->in.p + off, r->in.len - off);
    r->in.len -= off;
  }
}

int sp_h2_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

bool sp_h2_send_all(int fd, const void *data, size_t n) {
  const uint8_t *p = data;
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= (size_t)k;
  }
  return true;
}
