/* libFuzzer target over the engine's pure wire helpers (rpc_wire.h): the
 * message deframer, grpc-message percent coding, grpc-timeout, base64 for
 * -bin metadata, metadata lists and address splitting; and the protobuf
 * pre-scan (rpc_pbcheck.h) over coordinator request types. Besides sanitizer
 * findings it checks invariants: the deframer accounts for every byte,
 * encodings round-trip, and outputs respect their buffer sizes. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_targets.h"
#include "rpc/rpc_pbcheck.h"
#include "rpc/rpc_wire.h"
#include "shardplane/v1/coordinator.pb-c.h"

#define CHECK(cond)                                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "fuzz_rpc_wire: check failed: %s (%s:%d)\n", #cond, \
              __FILE__, __LINE__);                                        \
      abort();                                                            \
    }                                                                     \
  } while (0)

typedef struct deframe_state {
  size_t msgs, bytes;
} deframe_state;

static int on_msg(void *ud, const uint8_t *msg, size_t len) {
  deframe_state *s = ud;
  /* touch every byte so ASan sees reads past the message */
  volatile uint8_t x = 0;
  for (size_t i = 0; i < len; i++) x ^= msg[i];
  (void)x;
  s->msgs++;
  s->bytes += len;
  /* a handler error must stop the deframer and come back unchanged */
  return len == 13 ? 42 : 0;
}

static void fuzz_deframer(const uint8_t *d, size_t n, uint8_t sel,
                          uint8_t split) {
  sp_rpc_deframer df;
  size_t max = (size_t)1 << (sel & 15); /* 1 B .. 32 KiB */
  sp_rpc_deframer_init(&df, max);
  deframe_state s = {0};
  size_t step = (size_t)(split % 64) + 1, off = 0;
  int rc = 0;
  while (off < n && rc == 0) {
    size_t take = n - off < step ? n - off : step;
    uint64_t announced = 0;
    rc = sp_rpc_deframer_feed(&df, d + off, take, on_msg, &s, &announced);
    if (rc == SP_ETOOBIG) CHECK(announced > max);
    off += take;
  }
  CHECK(rc == 0 || rc == 42 || rc == SP_ETOOBIG || rc == SP_EUNSUPPORTED ||
        rc == SP_EFORMAT);
  if (rc == 0) {
    /* every byte is a prefix, a delivered body, or pending */
    size_t pending = df.in_body ? 5 + df.have : df.hdr_have;
    CHECK(s.bytes + 5 * s.msgs + pending == n);
    CHECK(sp_rpc_deframer_partial(&df) == (pending > 0));
  }
  sp_rpc_deframer_free(&df);
}

static void fuzz_percent(const uint8_t *d, size_t n, uint8_t sel) {
  /* decoding tolerates anything and respects the buffer size */
  size_t cap = (size_t)(sel % 64) + 1;
  char small[64];
  memset(small, 0x7f, sizeof small);
  sp_rpc_pct_decode((const char *)d, n, small, cap);
  CHECK(strlen(small) < cap);
  char *full = malloc(n + 1);
  CHECK(full != NULL);
  sp_rpc_pct_decode((const char *)d, n, full, n + 1);
  free(full);

  /* encode then decode gives the text back (up to its first NUL), and a
   * truncated encoding decodes to a prefix of it */
  char *text = malloc(n + 1);
  CHECK(text != NULL);
  memcpy(text, d, n);
  text[n] = '\0';
  size_t tlen = strlen(text);
  char *enc = malloc(3 * tlen + 1);
  char *dec = malloc(tlen + 1);
  CHECK(enc != NULL && dec != NULL);
  size_t elen = sp_rpc_pct_encode(text, enc, 3 * tlen + 1);
  CHECK(elen == strlen(enc));
  sp_rpc_pct_decode(enc, elen, dec, tlen + 1);
  CHECK(strcmp(dec, text) == 0);
  elen = sp_rpc_pct_encode(text, enc, cap);
  CHECK(elen < cap);
  sp_rpc_pct_decode(enc, elen, dec, tlen + 1);
  CHECK(strncmp(dec, text, strlen(dec)) == 0);
  free(text);
  free(enc);
  free(dec);
}

static void fuzz_timeout(const uint8_t *d, size_t n) {
  int64_t ms = sp_rpc_timeout_parse((const char *)d, n);
  CHECK(ms >= -1);
  if (ms >= 0) CHECK(n >= 2 && n <= 9);
  /* format then parse never shortens a deadline and fits the 8 digits */
  if (n >= 8) {
    uint64_t v = 0;
    memcpy(&v, d, 8);
    v >>= (d[0] & 31); /* all magnitudes, not only huge ones */
    char out[16];
    sp_rpc_timeout_format(v, out);
    CHECK(strlen(out) <= 9);
    int64_t back = sp_rpc_timeout_parse(out, strlen(out));
    CHECK(back >= 0);
    if (v < 99999999ull * 3600000ull) CHECK((uint64_t)back >= v);
    if (v < 100000000u) CHECK((uint64_t)back == v);
  }
}

static void fuzz_base64(const uint8_t *d, size_t n) {
  /* decoding: out needs len bytes, and never gets more */
  uint8_t *raw = malloc(n + 1);
  CHECK(raw != NULL);
  long m = sp_rpc_b64_decode((const char *)d, n, raw);
  CHECK(m >= -1 && m <= (long)n);
  free(raw);
  /* encode then decode is the identity */
  char *enc = malloc(4 * (n / 3 + 1) + 1);
  uint8_t *back = malloc(4 * (n / 3 + 1) + 1);
  CHECK(enc != NULL && back != NULL);
  size_t elen = sp_rpc_b64_encode(d, n, enc);
  CHECK(elen == strlen(enc));
  long blen = sp_rpc_b64_decode(enc, elen, back);
  CHECK(blen == (long)n);
  CHECK(n == 0 || memcmp(back, d, n) == 0);
  free(enc);
  free(back);
}

static void fuzz_metadata(const uint8_t *d, size_t n) {
  /* the first byte splits key and value; the list enforces its budget */
  if (n == 0) return;
  size_t klen = d[0] % (n);
  const char *key = (const char *)d + 1;
  if (klen > n - 1) klen = n - 1;
  const uint8_t *val = d + 1 + klen;
  size_t vlen = n - 1 - klen;
  (void)sp_rpc_md_key_valid(key, klen);
  (void)sp_rpc_md_key_is_bin(key, klen);
  (void)sp_rpc_md_value_valid(val, vlen);
  sp_rpc_mdlist l = {0};
  size_t budget = 256;
  for (int i = 0; i < 8; i++) {
    int rc = sp_rpc_mdlist_add(&l, key, klen, val, vlen, budget);
    CHECK(rc == 0 || rc == SP_ETOOBIG);
    CHECK(l.bytes <= budget);
  }
  if (l.n > 0) {
    size_t len = 0;
    const uint8_t *v = sp_rpc_mdlist_get(&l, l.e[0].key, &len);
    CHECK(v != NULL);
    if (memchr(key, '\0', klen) == NULL) CHECK(len == vlen);
  }
  sp_rpc_mdlist_clear(&l);
}

static void fuzz_addr(const uint8_t *d, size_t n) {
  char *s = malloc(n + 1);
  CHECK(s != NULL);
  memcpy(s, d, n);
  s[n] = '\0';
  char host[64];
  int port = -1;
  if (sp_rpc_split_addr(s, host, sizeof host, &port) == 0) {
    CHECK(port >= 0 && port <= 65535);
    CHECK(strlen(host) > 0 && strlen(host) < sizeof host);
  }
  free(s);
}

/* What the pre-scan accepts protobuf-c decodes, and its compacted copy has
 * nothing left to drop. */
static void fuzz_pbcheck(const uint8_t *d, size_t n, uint8_t sel) {
  static const ProtobufCMessageDescriptor *const k_desc[] = {
      &shardplane__v1__session_up__descriptor,
      &shardplane__v1__store_set_request__descriptor,
      &shardplane__v1__attach_request__descriptor,
      &shardplane__v1__store_wait_request__descriptor,
  };
  const ProtobufCMessageDescriptor *desc = k_desc[(sel >> 6) & 3];
  uint8_t *out = NULL;
  size_t out_len = 0;
  char err[256];
  /* a small decode limit, so the budget's refusal is reached too */
  int rc = sp_rpc_pbcheck(desc, d, n, 4096, &out, &out_len, err, sizeof err);
  CHECK(rc == 0 || rc == SP_EFORMAT || rc == SP_ETOOBIG || rc == SP_ENOMEM);
  if (rc == SP_EFORMAT || rc == SP_ETOOBIG) CHECK(err[0] != '\0');
  if (rc != 0) return;
  const uint8_t *m = out != NULL ? out : d;
  size_t mlen = out != NULL ? out_len : n;
  CHECK(out == NULL || out_len <= n);
  ProtobufCMessage *msg = protobuf_c_message_unpack(desc, NULL, mlen, m);
  CHECK(msg != NULL);
  protobuf_c_message_free_unpacked(msg, NULL);
  uint8_t *again = NULL;
  size_t again_len = 0;
  CHECK(sp_rpc_pbcheck(desc, m, mlen, 4096, &again, &again_len, NULL, 0) == 0);
  CHECK(again == NULL);
  free(out);
}

int sp_fuzz_rpc_wire_one(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  uint8_t sel = data[0], split = data[1];
  const uint8_t *d = data + 2;
  size_t n = size - 2;
  fuzz_deframer(d, n, sel, split);
  fuzz_percent(d, n, sel);
  fuzz_timeout(d, n);
  fuzz_base64(d, n);
  fuzz_metadata(d, n);
  fuzz_addr(d, n);
  fuzz_pbcheck(d, n, sel);
  return 0;
}

#ifndef SP_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  return sp_fuzz_rpc_wire_one(data, size);
}
#endif
