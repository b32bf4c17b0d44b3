/* The gRPC engine from C: wire helpers, then a real server on a loop thread
 * driven by the engine's own client over loopback. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "echo.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"
#include "rpc/rpc.h"
#include "support/coord_fixture.h"
#include "support/rpc_fixture.h"
#include "rpc/rpc_mem.h"
#include "rpc/rpc_wire.h"
#include "support/testutil.h"

typedef Shardplane__Testing__EchoRequest EchoRequest;
typedef Shardplane__Testing__EchoReply EchoReply;
#define EPATH(m) "/shardplane.testing.Echo/" m

/* ---------------- wire helpers ---------------- */

static void test_percent_encoding(void **state) {
  (void)state;
  char enc[256], dec[256];
  const char *msg = "50% done \xc3\xbc\n";
  sp_rpc_pct_encode(msg, enc, sizeof enc);
  assert_string_equal(enc, "50%25 done %C3%BC%0A");
  sp_rpc_pct_decode(enc, strlen(enc), dec, sizeof dec);
  assert_string_equal(dec, msg);
  /* bad escapes are kept, never crash */
  sp_rpc_pct_decode("%zz%4", 5, dec, sizeof dec);
  assert_string_equal(dec, "%zz%4");
  /* truncation never splits an escape */
  char small[5];
  sp_rpc_pct_encode("a%b", small, sizeof small);
  assert_string_equal(small, "a%25");
  sp_rpc_pct_encode("ab%", small, sizeof small);
  assert_string_equal(small, "ab");
}

static void test_timeout(void **state) {
  (void)state;
  assert_int_equal(sp_rpc_timeout_parse("2500m", 5), 2500);
  assert_int_equal(sp_rpc_timeout_parse("3S", 2), 3000);
  assert_int_equal(sp_rpc_timeout_parse("2M", 2), 120000);
  assert_int_equal(sp_rpc_timeout_parse("1H", 2), 3600000);
  assert_int_equal(sp_rpc_timeout_parse("1500u", 5), 2); /* rounds up */
  assert_int_equal(sp_rpc_timeout_parse("1n", 2), 1);
  assert_int_equal(sp_rpc_timeout_parse("99999999S", 9), 99999999000LL);
  assert_int_equal(sp_rpc_timeout_parse("123456789S", 10), -1); /* 9 digits */
  assert_int_equal(sp_rpc_timeout_parse("10x", 3), -1);
  assert_int_equal(sp_rpc_timeout_parse("m", 1), -1);
  assert_int_equal(sp_rpc_timeout_parse("-5m", 3), -1);
  assert_int_equal(sp_rpc_timeout_parse("", 0), -1);
  const uint64_t ms[] = {0, 1, 2500, 99999999, 100000000, 86400000000ull};
  for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
    char out[16];
    sp_rpc_timeout_format(ms[i], out);
    int64_t back = sp_rpc_timeout_parse(out, strlen(out));
    assert_true(back >= (int64_t)ms[i]); /* never shorter */
    assert_true(strlen(out) <= 9);
  }
}

static void test_base64(void **state) {
  (void)state;
  const uint8_t raw[] = {0, 1, 2, 0xff, 0xfe};
  char enc[16];
  uint8_t dec[16];
  assert_int_equal(sp_rpc_b64_encode(raw, 3, enc), 4);
  assert_string_equal(enc, "AAEC"); /* what grpcio sends for 00 01 02 */
  assert_int_equal(sp_rpc_b64_encode(raw, 5, enc), 7); /* unpadded */
  assert_int_equal(sp_rpc_b64_decode(enc, strlen(enc), dec), 5);
  assert_memory_equal(dec, raw, 5);
  assert_int_equal(sp_rpc_b64_decode("AAE=", 4, dec), 2); /* padded */
  assert_int_equal(sp_rpc_b64_decode("AAEC,AAEC", 9, dec), 6);
  assert_int_equal(sp_rpc_b64_decode("A", 1, dec), -1);
  assert_int_equal(sp_rpc_b64_decode("AA*C", 4, dec), -1);
  assert_true(sp_rpc_md_key_valid("x-trace_id.1", 12));
  assert_false(sp_rpc_md_key_valid("X-Upper", 7));
  assert_false(sp_rpc_md_key_valid("", 0));
  assert_true(sp_rpc_md_key_is_bin("a-bin", 5));
  assert_false(sp_rpc_md_key_is_bin("bin", 3));
}

typedef struct collected {
  size_t n, bytes;
  uint8_t last[64];
} collected;

static int collect(void *ud, const uint8_t *msg, size_t len) {
  collected *c = ud;
  c->n++;
  c->bytes += len;
  memcpy(c->last, msg, len < sizeof c->last ? len : sizeof c->last);
  return 0;
}

static void test_deframer(void **state) {
  (void)state;
  uint8_t stream[64];
  size_t off = 0;
  for (int m = 0; m < 3; m++) {
    sp_rpc_frame_prefix(stream + off, 4);
    memcpy(stream + off + 5, "abcd", 4);
    off += 9;
  }
  sp_rpc_frame_prefix(stream + off, 0); /* an empty message */
  off += 5;
  /* byte by byte: DATA frame boundaries never follow messages */
  sp_rpc_deframer d;
  sp_rpc_deframer_init(&d, 1024);
  collected c = {0};
  for (size_t i = 0; i < off; i++) {
    assert_int_equal(sp_rpc_deframer_feed(&d, stream + i, 1, collect, &c, NULL),
                     0);
    if (i + 1 < off && i % 9 != 8) assert_true(sp_rpc_deframer_partial(&d));
  }
  assert_int_equal(c.n, 4);
  assert_int_equal(c.bytes, 12);
  assert_false(sp_rpc_deframer_partial(&d));
  /* all at once */
  memset(&c, 0, sizeof c);
  assert_int_equal(sp_rpc_deframer_feed(&d, stream, off, collect, &c, NULL), 0);
  assert_int_equal(c.n, 4);
  sp_rpc_deframer_free(&d);
  /* a 4 GiB prefix is refused before anything is allocated */
  uint8_t huge[5] = {0, 0xff, 0xff, 0xff, 0xff};
  uint64_t announced = 0;
  sp_rpc_deframer_init(&d, 4u << 20);
  assert_int_equal(sp_rpc_deframer_feed(&d, huge, 5, collect, &c, &announced),
                   SP_ETOOBIG);
  assert_int_equal(announced, 0xffffffffu);
  sp_rpc_deframer_free(&d);
  uint8_t compressed[5] = {1, 0, 0, 0, 0};
  sp_rpc_deframer_init(&d, 64);
  assert_int_equal(sp_rpc_deframer_feed(&d, compressed, 5, collect, &c, NULL),
                   SP_EUNSUPPORTED);
  sp_rpc_deframer_free(&d);
  uint8_t badflag[5] = {7, 0, 0, 0, 0};
  sp_rpc_deframer_init(&d, 64);
  assert_int_equal(sp_rpc_deframer_feed(&d, badflag, 5, collect, &c, NULL),
                   SP_EFORMAT);
  sp_rpc_deframer_free(&d);
}

static void test_addresses(void **state) {
  (void)state;
  char host[64];
  int port;
  assert_int_equal(sp_rpc_split_addr("127.0.0.1:7700", host, 64, &port), 0);
  assert_string_equal(host, "127.0.0.1");
  assert_int_equal(port, 7700);
  assert_int_equal(sp_rpc_split_addr("[::1]:0", host, 64, &port), 0);
  assert_string_equal(host, "::1");
  assert_int_equal(sp_rpc_split_addr("localhost:80", host, 64, &port), 0);
  assert_int_equal(sp_rpc_split_addr("::1:80", host, 64, &port), SP_EINVAL);
  assert_int_equal(sp_rpc_split_addr("host:65536", host, 64, &port), SP_EINVAL);
  assert_int_equal(sp_rpc_split_addr("host:", host, 64, &port), SP_EINVAL);
  assert_int_equal(sp_rpc_split_addr(":80", host, 64, &port), SP_EINVAL);
  assert_int_equal(sp_rpc_split_addr("noport", host, 64, &port), SP_EINVAL);
  assert_string_equal(sp_rpc_code_name(SP_RPC_UNAVAILABLE), "UNAVAILABLE");
  assert_string_equal(sp_rpc_code_name(99), "UNKNOWN");
}

/* ---------------- against a live server ---------------- */

static sp_test_server g_srv;
static sp_rpc_sync *g_cli;

static int setup(void **state) {
  (void)state;
  sp_test_server_start(&g_srv, NULL);
  assert_int_equal(sp_rpc_sync_open(g_srv.addr, 5000, &g_cli), 0);
  return 0;
}

/* The same calls with no HPACK dynamic tables (the coordinator's setting):
 * our client must open its first header block after the SETTINGS ACK with
 * a table size update, and read responses encoded without indexing. */
static int setup_no_tables(void **state) {
  (void)state;
  sp_rpc_server_opts o = {.no_header_tables = true};
  sp_test_server_start(&g_srv, &o);
  assert_int_equal(sp_rpc_sync_open(g_srv.addr, 5000, &g_cli), 0);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  sp_rpc_sync_close(g_cli);
  sp_test_server_stop(&g_srv, 1000);
  return 0;
}

static EchoReply *unary(const EchoRequest *req, uint64_t timeout_ms,
                        sp_rpc_status *st) {
  ProtobufCMessage *resp = NULL;
  assert_int_equal(
      sp_rpc_sync_unary(g_cli, EPATH("Unary"), &req->base,
                        &shardplane__testing__echo_reply__descriptor,
                        timeout_ms, &resp, st),
      0);
  return (EchoReply *)resp;
}

static void parse_stats(unsigned *cancelled, unsigned *active) {
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "__stats__";
  sp_rpc_status st;
  EchoReply *r = unary(&req, 2000, &st);
  assert_int_equal(st.code, SP_RPC_OK);
  assert_int_equal(sscanf(r->text, "cancelled=%u active=%u", cancelled, active),
                   2);
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

static void test_unary_and_errors(void **state) {
  (void)state;
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "hello";
  uint8_t bytes[3] = {0, 0xff, 7};
  req.payload.data = bytes;
  req.payload.len = 3;
  sp_rpc_status st;
  EchoReply *r = unary(&req, 2000, &st);
  assert_int_equal(st.code, SP_RPC_OK);
  assert_string_equal(r->text, "hello");
  assert_memory_equal(r->payload.data, bytes, 3);
  protobuf_c_message_free_unpacked(&r->base, NULL);

  req.fail_code = SP_RPC_FAILED_PRECONDITION;
  req.fail_message = "rank 3 is in FORWARD; legal: IDLE (100% sure) \xc3\xa9";
  r = unary(&req, 2000, &st);
  assert_null(r);
  assert_int_equal(st.code, SP_RPC_FAILED_PRECONDITION);
  assert_string_equal(st.message, req.fail_message);

  /* unknown method: Trailers-Only UNIMPLEMENTED naming it */
  ProtobufCMessage *resp = NULL;
  assert_int_equal(sp_rpc_sync_unary(g_cli, "/nope.Svc/Missing", &req.base,
                                     NULL, 2000, &resp, &st),
                   0);
  assert_int_equal(st.code, SP_RPC_UNIMPLEMENTED);
  assert_non_null(strstr(st.message, "/nope.Svc/Missing"));

  /* an oversize request is refused, and the connection still works */
  EchoRequest big = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  big.text = "";
  big.payload.len = SP_RPC_DEFAULT_MAX_MESSAGE + 1;
  big.payload.data = calloc(1, big.payload.len);
  assert_non_null(big.payload.data);
  r = unary(&big, 5000, &st);
  free(big.payload.data);
  assert_int_equal(st.code, SP_RPC_RESOURCE_EXHAUSTED);
  req.fail_code = 0;
  r = unary(&req, 2000, &st);
  assert_int_equal(st.code, SP_RPC_OK);
  protobuf_c_message_free_unpacked(&r->base, NULL);
}

static void test_deadline_cancels_handler(void **state) {
  (void)state;
  unsigned c0, a0, c1, a1;
  parse_stats(&c0, &a0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "slow";
  req.delay_ms = 5000;
  sp_rpc_status st;
  uint64_t t0 = uv_hrtime();
  EchoReply *r = unary(&req, 200, &st);
  uint64_t ms = (uv_hrtime() - t0) / 1000000;
  assert_null(r);
  assert_int_equal(st.code, SP_RPC_DEADLINE_EXCEEDED);
  assert_true(ms >= 150 && ms < 2000);
  /* the server's timer fired too: the handler was cancelled, no work left */
  uv_sleep(100);
  parse_stats(&c1, &a1);
  assert_true(c1 >= c0 + 1);
  assert_int_equal(a1, 0);
}

/* A reply's wait bounds a hang, not speed: under AddressSanitizer on a
 * loaded 2-CPU machine the first message of a stream once took over 2 s. */
#define RECV_MS 10000
static void test_server_stream_and_cancel(void **state) {
  (void)state;
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "s";
  req.repeat = 500;
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(g_cli, EPATH("ServerStream"), 5000, NULL, 0, &s),
      0);
  assert_int_equal(sp_rpc_sync_stream_send(s, &req.base), 0);
  assert_int_equal(sp_rpc_sync_stream_close_send(s), 0);
  ProtobufCMessage *m;
  sp_rpc_status st;
  for (uint32_t i = 0; i < 500; i++) {
    assert_int_equal(
        sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                                RECV_MS, &m, &st),
        0);
    assert_int_equal(((EchoReply *)m)->index, i);
    protobuf_c_message_free_unpacked(m, NULL);
  }
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                              RECV_MS, &m, &st),
      SP_ENOENT);
  assert_int_equal(st.code, SP_RPC_OK);
  sp_rpc_sync_stream_close(s);

  /* cancel a long stream mid-flight: the handler is cancelled */
  unsigned c0, a0, c1, a1;
  parse_stats(&c0, &a0);
  req.repeat = 1000000;
  assert_int_equal(
      sp_rpc_sync_stream_open(g_cli, EPATH("ServerStream"), 5000, NULL, 0, &s),
      0);
  sp_rpc_sync_stream_send(s, &req.base);
  sp_rpc_sync_stream_close_send(s);
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                              RECV_MS, &m, &st),
      0);
  protobuf_c_message_free_unpacked(m, NULL);
  sp_rpc_sync_stream_close(s); /* cancels */
  for (int i = 0; i < 50; i++) {
    parse_stats(&c1, &a1);
    if (a1 == 0) break;
    uv_sleep(20);
  }
  assert_true(c1 >= c0 + 1);
  assert_int_equal(a1, 0);
}

static void test_client_stream_and_bidi(void **state) {
  (void)state;
  sp_rpc_sync_stream *s;
  sp_rpc_status st;
  ProtobufCMessage *m;
  assert_int_equal(
      sp_rpc_sync_stream_open(g_cli, EPATH("ClientStream"), 5000, NULL, 0, &s),
      0);
  const char *parts[] = {"ra", "nk", "-", "0"};
  for (int i = 0; i < 4; i++) {
    EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
    req.text = (char *)parts[i];
    assert_int_equal(sp_rpc_sync_stream_send(s, &req.base), 0);
  }
  sp_rpc_sync_stream_close_send(s);
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                              2000, &m, &st),
      0);
  assert_string_equal(((EchoReply *)m)->text, "rank-0");
  protobuf_c_message_free_unpacked(m, NULL);
  sp_rpc_sync_stream_close(s);

  /* bidi in lock-step: each answer arrives before the client half-closes */
  assert_int_equal(
      sp_rpc_sync_stream_open(g_cli, EPATH("Bidi"), 5000, NULL, 0, &s), 0);
  for (uint32_t i = 0; i < 20; i++) {
    char text[16];
    snprintf(text, sizeof text, "m%u", i);
    EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
    req.text = text;
    assert_int_equal(sp_rpc_sync_stream_send(s, &req.base), 0);
    assert_int_equal(
        sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                                2000, &m, &st),
        0);
    assert_string_equal(((EchoReply *)m)->text, text);
    assert_int_equal(((EchoReply *)m)->index, i);
    protobuf_c_message_free_unpacked(m, NULL);
  }
  sp_rpc_sync_stream_close_send(s);
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                              2000, &m, &st),
      SP_ENOENT);
  assert_int_equal(st.code, SP_RPC_OK);
  sp_rpc_sync_stream_close(s);
}

static void test_metadata_roundtrip(void **state) {
  (void)state;
  /* the async client, to read the response headers */
  const uint8_t bin[] = {0, 0x80, 0xff, '\n'};
  sp_rpc_md md[] = {{"x-echo", (const uint8_t *)"trace-7", 7},
                    {"x-echo-bin", bin, sizeof bin}};
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(g_cli, EPATH("ServerStream"), 5000, md, 2, &s),
      0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "md";
  req.repeat = 1;
  sp_rpc_sync_stream_send(s, &req.base);
  sp_rpc_sync_stream_close_send(s);
  ProtobufCMessage *m;
  sp_rpc_status st;
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 2000, &m, &st), 0);
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 2000, &m, &st), SP_ENOENT);
  assert_int_equal(st.code, SP_RPC_OK);
  sp_rpc_sync_stream_close(s);
  /* invalid keys are refused on the client before anything is sent */
  sp_rpc_md bad[] = {{"X-Upper", (const uint8_t *)"v", 1}};
  assert_int_equal(
      sp_rpc_sync_stream_open(g_cli, EPATH("Unary"), 1000, bad, 1, &s),
      SP_EINVAL);
  sp_rpc_md ctl[] = {{"x-ctl", (const uint8_t *)"a\nb", 3}};
  assert_int_equal(
      sp_rpc_sync_stream_open(g_cli, EPATH("Unary"), 1000, ctl, 1, &s),
      SP_EINVAL);
}

/* What the async client's call sees of the response headers. */
typedef struct md_probe {
  bool done, replied;
  int code;
  char echo[16];  /* x-echo, as received */
  bool has_ctype; /* content-type listed as metadata */
} md_probe;

static void probe_msg(sp_rpc_ccall *call, const uint8_t *d, size_t n,
                      void *user) {
  (void)call;
  (void)d;
  (void)n;
  ((md_probe *)user)->replied = true;
}

static void probe_close(sp_rpc_ccall *call, const sp_rpc_status *st,
                        void *user) {
  md_probe *p = user;
  p->done = true;
  p->code = st->code;
  size_t len = 0;
  const uint8_t *v = sp_rpc_ccall_metadata(call, "x-echo", &len);
  if (v != NULL && len < sizeof p->echo) memcpy(p->echo, v, len);
  p->has_ctype = sp_rpc_ccall_metadata(call, "content-type", NULL) != NULL;
}

static void probe_client_closed(void *arg) { *(bool *)arg = true; }

/* The async client lists the server's metadata (x-echo, echoed by the
 * Echo service) among a response's headers, and not content-type, which
 * is the protocol's (as the server keeps it out of a request's). */
static void test_response_metadata(void **state) {
  (void)state;
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  sp_rpc_client *cl;
  assert_int_equal(sp_rpc_client_open(&loop, g_srv.addr, NULL, &cl), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "md";
  uint8_t buf[64];
  size_t n = shardplane__testing__echo_request__pack(&req, buf);
  sp_rpc_md md[] = {{"x-echo", (const uint8_t *)"trace-8", 7}};
  static const sp_rpc_ccall_cbs cbs = {.on_message = probe_msg,
                                       .on_close = probe_close};
  md_probe p = {0};
  sp_rpc_ccall *call;
  assert_int_equal(
      sp_rpc_client_start(cl, EPATH("Unary"), md, 1, 5000, &cbs, &p, &call), 0);
  assert_int_equal(sp_rpc_ccall_send(call, buf, n), 0);
  assert_int_equal(sp_rpc_ccall_close_send(call), 0);
  while (!p.done) uv_run(&loop, UV_RUN_ONCE);
  assert_int_equal(p.code, SP_RPC_OK);
  assert_true(p.replied);
  assert_string_equal(p.echo, "trace-8");
  assert_false(p.has_ctype);
  bool closed = false;
  sp_rpc_client_close(cl, probe_client_closed, &closed);
  while (!closed) uv_run(&loop, UV_RUN_ONCE);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void test_health(void **state) {
  (void)state;
  Grpc__Health__V1__HealthCheckRequest req =
      GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = "";
  ProtobufCMessage *resp;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_unary(g_cli, "/grpc.health.v1.Health/Check", &req.base,
                        &grpc__health__v1__health_check_response__descriptor,
                        2000, &resp, &st),
      0);
  assert_int_equal(st.code, SP_RPC_OK);
  assert_int_equal(((Grpc__Health__V1__HealthCheckResponse *)resp)->status,
                   SP_HEALTH_SERVING);
  protobuf_c_message_free_unpacked(resp, NULL);
  req.service = "no.such.Service";
  assert_int_equal(
      sp_rpc_sync_unary(g_cli, "/grpc.health.v1.Health/Check", &req.base,
                        &grpc__health__v1__health_check_response__descriptor,
                        2000, &resp, &st),
      0);
  assert_int_equal(st.code, SP_RPC_NOT_FOUND);
}

static void test_many_concurrent_streams(void **state) {
  (void)state;
  enum { N = 300 };
  static sp_rpc_sync_stream *s[N];
  for (int i = 0; i < N; i++) {
    assert_int_equal(
        sp_rpc_sync_stream_open(g_cli, EPATH("Bidi"), 10000, NULL, 0, &s[i]),
        0);
    EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
    req.text = "x";
    sp_rpc_sync_stream_send(s[i], &req.base);
  }
  /* more than MAX_CONCURRENT_STREAMS (100): nghttp2 queues the rest */
  for (int i = 0; i < N; i++) sp_rpc_sync_stream_close_send(s[i]);
  for (int i = 0; i < N; i++) {
    ProtobufCMessage *m;
    sp_rpc_status st;
    assert_int_equal(sp_rpc_sync_stream_recv(s[i], NULL, 10000, &m, &st), 0);
    assert_int_equal(sp_rpc_sync_stream_recv(s[i], NULL, 10000, &m, &st),
                     SP_ENOENT);
    assert_int_equal(st.code, SP_RPC_OK);
    sp_rpc_sync_stream_close(s[i]);
  }
  sp_rpc_server_stats stats = sp_test_server_stats(&g_srv);
  assert_int_equal(stats.calls_open, 0);
}

/* ---------------- connection management ---------------- */

static void test_connect_failure_and_retry(void **state) {
  (void)state;
  /* a port nobody listens on: UNAVAILABLE once the connect deadline passes */
  sp_test_server probe;
  sp_test_server_start(&probe, NULL);
  char addr[64];
  snprintf(addr, sizeof addr, "%s", probe.addr);
  sp_test_server_stop(&probe, 0);
  sp_rpc_sync *c;
  assert_int_equal(sp_rpc_sync_open(addr, 600, &c), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "x";
  sp_rpc_status st;
  uint64_t t0 = uv_hrtime();
  assert_int_equal(
      sp_rpc_sync_unary(c, EPATH("Unary"), &req.base, NULL, 0, NULL, &st), 0);
  uint64_t ms = (uv_hrtime() - t0) / 1000000;
  assert_int_equal(st.code, SP_RPC_UNAVAILABLE);
  assert_non_null(strstr(st.message, addr));
  assert_true(ms >= 400 && ms < 3000); /* retried with backoff, then gave up */
  sp_rpc_sync_close(c);
  assert_int_equal(sp_rpc_sync_open("not an address", 100, &c), SP_EINVAL);

  /* the server going away fails calls in flight with UNAVAILABLE, not a hang */
  sp_test_server other;
  sp_test_server_start(&other, NULL);
  assert_int_equal(sp_rpc_sync_open(other.addr, 2000, &c), 0);
  req.delay_ms = 3000;
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(c, EPATH("Unary"), 10000, NULL, 0, &s), 0);
  sp_rpc_sync_stream_send(s, &req.base);
  sp_rpc_sync_stream_close_send(s);
  ProtobufCMessage *m;
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 200, &m, &st),
                   SP_ETIMEDOUT);
  sp_test_server_stop(&other, 100); /* grace shorter than the handler */
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 5000, &m, &st), SP_ENOENT);
  assert_true(st.code == SP_RPC_UNAVAILABLE || st.code == SP_RPC_CANCELLED);
  sp_rpc_sync_stream_close(s);
  sp_rpc_sync_close(c);
}

/* A blocking client's loop runs only during its calls, so its cached clock
 * is as old as the last call. Deadlines must count from when a call starts:
 * here the loop sat idle for twice the call's timeout (and longer than the
 * connect timeout) before each call. */
static void test_deadline_after_idle_loop(void **state) {
  (void)state;
  sp_test_server srv;
  sp_test_server_start(&srv, NULL);
  sp_rpc_sync *c;
  assert_int_equal(sp_rpc_sync_open(srv.addr, 2000, &c), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "after idle";
  /* the first call connects; the second uses the open connection */
  for (int i = 0; i < 2; i++) {
    uv_sleep(400);
    ProtobufCMessage *resp = NULL;
    sp_rpc_status st;
    uint64_t t0 = uv_hrtime();
    assert_int_equal(
        sp_rpc_sync_unary(c, EPATH("Unary"), &req.base,
                          &shardplane__testing__echo_reply__descriptor, 200,
                          &resp, &st),
        0);
    uint64_t ms = (uv_hrtime() - t0) / 1000000;
    if (st.code != SP_RPC_OK)
      fail_msg(
          "call %d, after 400 ms idle, with a 200 ms deadline: %s: %s "
          "(after %llu ms)",
          i + 1, sp_rpc_code_name(st.code), st.message, (unsigned long long)ms);
    assert_string_equal(((EchoReply *)resp)->text, "after idle");
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  sp_rpc_sync_close(c);
  char addr[64];
  snprintf(addr, sizeof addr, "%s", srv.addr);
  sp_test_server_stop(&srv, 0);

  /* the connect deadline too: against a port nobody listens on the client
   * retries for its connect timeout, counted from the call, instead of
   * giving up at the first refusal */
  assert_int_equal(sp_rpc_sync_open(addr, 600, &c), 0);
  uv_sleep(800);
  sp_rpc_status st;
  uint64_t t0 = uv_hrtime();
  assert_int_equal(
      sp_rpc_sync_unary(c, EPATH("Unary"), &req.base, NULL, 0, NULL, &st), 0);
  uint64_t ms = (uv_hrtime() - t0) / 1000000;
  assert_int_equal(st.code, SP_RPC_UNAVAILABLE);
  if (ms < 400 || ms >= 3000)
    fail_msg("gave up connecting after %llu ms; the connect timeout is 600 ms",
             (unsigned long long)ms);
  sp_rpc_sync_close(c);
}

static void test_graceful_shutdown_finishes_calls(void **state) {
  (void)state;
  sp_test_server srv;
  sp_test_server_start(&srv, NULL);
  sp_rpc_sync *c;
  assert_int_equal(sp_rpc_sync_open(srv.addr, 2000, &c), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "in flight";
  req.delay_ms = 300;
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(c, EPATH("Unary"), 5000, NULL, 0, &s), 0);
  sp_rpc_sync_stream_send(s, &req.base);
  sp_rpc_sync_stream_close_send(s);
  ProtobufCMessage *m;
  sp_rpc_status st;
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 100, &m, &st),
                   SP_ETIMEDOUT); /* the request reached the server */
  /* Stop with a grace period longer than the handler: the server sends
   * GOAWAY, lets the call finish, then closes. The reply is already in our
   * socket when stop returns. */
  uint64_t t0 = uv_hrtime();
  sp_test_server_stop(&srv, 5000);
  uint64_t ms = (uv_hrtime() - t0) / 1000000;
  assert_true(ms >= 150 && ms < 3000);
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                              2000, &m, &st),
      0);
  assert_string_equal(((EchoReply *)m)->text, "in flight");
  protobuf_c_message_free_unpacked(m, NULL);
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 2000, &m, &st), SP_ENOENT);
  assert_int_equal(st.code, SP_RPC_OK);
  sp_rpc_sync_stream_close(s);
  /* a new call now fails fast: nothing listens any more */
  req.delay_ms = 0;
  assert_int_equal(
      sp_rpc_sync_unary(c, EPATH("Unary"), &req.base, NULL, 500, NULL, &st), 0);
  assert_true(st.code == SP_RPC_UNAVAILABLE ||
              st.code == SP_RPC_DEADLINE_EXCEEDED);
  sp_rpc_sync_close(c);
}

/* The authorize hook sees the path and the request metadata once the
 * headers are in; a refusal reaches the client as its status, Health never
 * asks the hook, and the client sends its token as "Bearer <token>". */
static char g_seen_path[128];
static int g_hook_calls;

static int check_bearer(sp_rpc_call *call, void *arg, char *msg, size_t cap) {
  (void)arg;
  g_hook_calls++;
  snprintf(g_seen_path, sizeof g_seen_path, "%s", sp_rpc_call_path(call));
  size_t n = 0;
  const uint8_t *v = sp_rpc_call_metadata(call, "authorization", &n);
  if (v == NULL || n != 11 || memcmp(v, "Bearer good", 11) != 0) {
    snprintf(msg, cap, "bad token");
    return SP_RPC_UNAUTHENTICATED;
  }
  return SP_RPC_OK;
}

static void test_authorize_hook(void **state) {
  (void)state;
  sp_test_server ts;
  sp_rpc_server_opts so = {.authorize = check_bearer};
  sp_test_server_start(&ts, &so);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "hi";
  const char *tokens[] = {NULL, "bad", "good"};
  for (int i = 0; i < 3; i++) {
    sp_rpc_client_opts co = {.connect_timeout_ms = 5000, .token = tokens[i]};
    sp_rpc_sync *c;
    assert_int_equal(sp_rpc_sync_open_opts(ts.addr, &co, &c), 0);
    ProtobufCMessage *resp = NULL;
    sp_rpc_status st;
    assert_int_equal(
        sp_rpc_sync_unary(c, EPATH("Unary"), &req.base,
                          &shardplane__testing__echo_reply__descriptor, 2000,
                          &resp, &st),
        0);
    if (i < 2) {
      sp_test_expect_status(&st, SP_RPC_UNAUTHENTICATED, "bad token");
      assert_null(resp);
    } else {
      sp_test_expect_status(&st, SP_RPC_OK, NULL);
      assert_string_equal(((EchoReply *)resp)->text, "hi");
      protobuf_c_message_free_unpacked(resp, NULL);
    }
    assert_string_equal(g_seen_path, EPATH("Unary"));
    /* health answers without the hook */
    int before = g_hook_calls;
    Grpc__Health__V1__HealthCheckRequest hq =
        GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    assert_int_equal(
        sp_rpc_sync_unary(c, "/grpc.health.v1.Health/Check", &hq.base,
                          &grpc__health__v1__health_check_response__descriptor,
                          2000, &resp, &st),
        0);
    sp_test_expect_status(&st, SP_RPC_OK, NULL);
    protobuf_c_message_free_unpacked(resp, NULL);
    assert_int_equal(g_hook_calls, before);
    sp_rpc_sync_close(c);
  }
  sp_rpc_server_stats stats = sp_test_server_stats(&ts);
  assert_int_equal(stats.calls_refused, 2);
  sp_test_server_stop(&ts, 1000);
  /* a token that could not be a header value is refused at once */
  const char *bad[] = {"", "two words", "line\nbreak"};
  for (int i = 0; i < 3; i++) {
    sp_rpc_client_opts co = {.token = bad[i]};
    sp_rpc_sync *c = NULL;
    assert_int_equal(sp_rpc_sync_open_opts("127.0.0.1:1", &co, &c), SP_EINVAL);
  }
}

/* With metadata_to_authorize the hook reads the token and the handler
 * sees no metadata at all; without it the handler sees the token too. */
static void test_metadata_to_authorize(void **state) {
  (void)state;
  for (int drop = 0; drop < 2; drop++) {
    sp_test_server ts;
    sp_rpc_server_opts so = {.authorize = check_bearer,
                             .metadata_to_authorize = drop == 1};
    sp_test_server_start(&ts, &so);
    sp_rpc_client_opts co = {.connect_timeout_ms = 5000, .token = "good"};
    sp_rpc_sync *c;
    assert_int_equal(sp_rpc_sync_open_opts(ts.addr, &co, &c), 0);
    EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
    req.text = "__authorization__";
    ProtobufCMessage *resp = NULL;
    sp_rpc_status st;
    int before = g_hook_calls;
    assert_int_equal(
        sp_rpc_sync_unary(c, EPATH("Unary"), &req.base,
                          &shardplane__testing__echo_reply__descriptor, 2000,
                          &resp, &st),
        0);
    sp_test_expect_status(&st, SP_RPC_OK, NULL); /* the hook saw the token */
    assert_int_equal(g_hook_calls, before + 1);
    assert_string_equal(((EchoReply *)resp)->text, drop ? "" : "Bearer good");
    protobuf_c_message_free_unpacked(resp, NULL);
    sp_rpc_sync_close(c);
    sp_test_server_stop(&ts, 1000);
  }
}

/* A burst's memory freed below a block still in use stays resident
 * (glibc trims only the top of its heap): with trim_heap_bytes the
 * server's sweep gives it back once enough calls ended. 32 MiB freed
 * under a pin, then 1,100 calls, must mostly leave the process's RSS
 * within a few sweeps (every 500 ms here). */
static void test_heap_trim(void **state) {
  (void)state;
  if (!sp_rpc_mem_trim_supported()) {
    print_message(
        "SKIPPED: no glibc heap to trim (a sanitizer's "
        "allocator, or not glibc 2.33+)\n");
    skip();
  }
  sp_test_server ts;
  sp_rpc_server_opts so = {.trim_heap_bytes = 1u << 20};
  sp_test_server_start(&ts, &so);
  sp_rpc_sync *c; /* a connection starts the sweep */
  assert_int_equal(sp_rpc_sync_open(ts.addr, 5000, &c), 0);
  Grpc__Health__V1__HealthCheckRequest hq =
      GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_unary(c, "/grpc.health.v1.Health/Check", &hq.base,
                        &grpc__health__v1__health_check_response__descriptor,
                        2000, &resp, &st),
      0);
  protobuf_c_message_free_unpacked(resp, NULL);
  enum { N = 8192, SIZE = 4096 };
  char **blocks = malloc(N * sizeof *blocks);
  assert_non_null(blocks);
  for (int i = 0; i < N; i++) {
    blocks[i] = malloc(SIZE);
    assert_non_null(blocks[i]);
    memset(blocks[i], 1, SIZE);
  }
  /* The highest block stays: the heap's top is in use, so the rest is
   * freed below it (a small block might come from a hole lower down). */
  int pin = 0;
  for (int i = 1; i < N; i++)
    if ((uintptr_t)blocks[i] > (uintptr_t)blocks[pin]) pin = i;
  uint64_t rss_full = sp_test_proc_status_kib("VmRSS");
  for (int i = 0; i < N; i++)
    if (i != pin) free(blocks[i]);
  /* the sweep looks at the heap once calls freed the threshold (at 1 KiB
   * a call: 1,024 calls for 1 MiB) */
  for (int i = 0; i < 1100; i++) {
    assert_int_equal(
        sp_rpc_sync_unary(c, "/grpc.health.v1.Health/Check", &hq.base,
                          &grpc__health__v1__health_check_response__descriptor,
                          2000, &resp, &st),
        0);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  uint64_t rss = rss_full;
  for (int i = 0; i < 20 && rss + 16384 > rss_full; i++) {
    sp_test_sleep_ms(250);
    rss = sp_test_proc_status_kib("VmRSS");
  }
  assert_true(rss + 16384 <= rss_full); /* at least half of it went back */
  sp_rpc_server_stats stats = sp_test_server_stats(&ts);
  assert_true(stats.heap_trims >= 1);
  free(blocks[pin]);
  free(blocks);
  sp_rpc_sync_close(c);
  sp_test_server_stop(&ts, 1000);
}

/* Every call of a registered method is counted once, when it ends, by
 * its status (the handler's, the authorize hook's, a cancel's), with its
 * duration in the buckets; a path no method has is counted nowhere. */
static void test_method_stats(void **state) {
  (void)state;
  sp_test_server ts;
  sp_rpc_server_opts so = {.authorize = check_bearer};
  sp_test_server_start(&ts, &so);
  sp_rpc_client_opts co = {.connect_timeout_ms = 5000, .token = "good"};
  sp_rpc_sync *c, *bad;
  assert_int_equal(sp_rpc_sync_open_opts(ts.addr, &co, &c), 0);
  co.token = "bad";
  assert_int_equal(sp_rpc_sync_open_opts(ts.addr, &co, &bad), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "m";
  ProtobufCMessage *resp;
  sp_rpc_status st;
  struct {
    sp_rpc_sync *cli;
    int fail_code;
    uint32_t delay_ms;
    int want;
  } calls[] = {{c, 0, 0, SP_RPC_OK},
               {c, 0, 0, SP_RPC_OK},
               {c, 0, 0, SP_RPC_OK},
               {c, 0, 60, SP_RPC_OK},
               {c, SP_RPC_FAILED_PRECONDITION, 0, SP_RPC_FAILED_PRECONDITION},
               {bad, 0, 0, SP_RPC_UNAUTHENTICATED}};
  for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
    req.fail_code = calls[i].fail_code;
    req.fail_message = calls[i].fail_code ? "no" : "";
    req.delay_ms = calls[i].delay_ms;
    resp = NULL;
    assert_int_equal(
        sp_rpc_sync_unary(calls[i].cli, EPATH("Unary"), &req.base,
                          &shardplane__testing__echo_reply__descriptor, 5000,
                          &resp, &st),
        0);
    assert_int_equal(st.code, calls[i].want);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  }
  assert_int_equal(sp_rpc_sync_unary(c, "/nope.Svc/Missing", &req.base, NULL,
                                     5000, &resp, &st),
                   0);
  assert_int_equal(st.code, SP_RPC_UNIMPLEMENTED);
  /* a stream the client cancels mid-flight */
  req.delay_ms = 0;
  req.fail_code = 0;
  req.repeat = 1000000;
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(c, EPATH("ServerStream"), 0, NULL, 0, &s), 0);
  sp_rpc_sync_stream_send(s, &req.base);
  sp_rpc_sync_stream_close_send(s);
  ProtobufCMessage *m;
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__testing__echo_reply__descriptor,
                              RECV_MS, &m, &st),
      0);
  protobuf_c_message_free_unpacked(m, NULL);
  sp_rpc_sync_stream_close(s);
  sp_rpc_method_stats ms;
  for (int i = 0; i < 250; i++) { /* the server hears of the cancel */
    assert_true(sp_test_server_method_stats(&ts, EPATH("ServerStream"), &ms));
    if (ms.count > 0) break;
    uv_sleep(20);
  }
  assert_int_equal(ms.count, 1);
  assert_int_equal(ms.calls[SP_RPC_CANCELLED], 1);

  assert_true(sp_test_server_method_stats(&ts, EPATH("Unary"), &ms));
  assert_string_equal(ms.path, EPATH("Unary"));
  assert_int_equal(ms.calls[SP_RPC_OK], 4);
  assert_int_equal(ms.calls[SP_RPC_FAILED_PRECONDITION], 1);
  assert_int_equal(ms.calls[SP_RPC_UNAUTHENTICATED], 1);
  assert_int_equal(ms.count, 6);
  uint64_t in_buckets = 0, over_50ms = 0;
  for (size_t i = 0; i <= SP_RPC_DURATION_BUCKETS; i++) {
    in_buckets += ms.bucket[i];
    /* bucket i holds what took more than bound i - 1 */
    if (i > 0 && sp_rpc_duration_bounds[i - 1] >= 0.05)
      over_50ms += ms.bucket[i];
  }
  assert_int_equal(in_buckets, 6);
  assert_true(over_50ms >= 1); /* the call the handler delayed 60 ms */
  /* the loop's clock counts whole milliseconds: a 60 ms timer may end
   * up to 1 ms short of 60 ms of the engine's nanosecond clock */
  assert_true(ms.sum_s >= 0.059);
  printf("  Unary: 6 calls in %.3f s\n", ms.sum_s);
  assert_true(sp_test_server_method_stats(&ts, EPATH("Bidi"), &ms));
  assert_int_equal(ms.count, 0);
  assert_false(sp_test_server_method_stats(&ts, "/nope.Svc/Missing", &ms));
  sp_rpc_sync_close(bad);
  sp_rpc_sync_close(c);
  sp_test_server_stop(&ts, 1000);
}

int main(void) {
  const struct CMUnitTest wire[] = {
      cmocka_unit_test(test_percent_encoding),
      cmocka_unit_test(test_timeout),
      cmocka_unit_test(test_base64),
      cmocka_unit_test(test_deframer),
      cmocka_unit_test(test_addresses),
      cmocka_unit_test(test_authorize_hook),
      cmocka_unit_test(test_metadata_to_authorize),
  };
  const struct CMUnitTest live[] = {
      cmocka_unit_test(test_unary_and_errors),
      cmocka_unit_test(test_deadline_cancels_handler),
      cmocka_unit_test(test_server_stream_and_cancel),
      cmocka_unit_test(test_client_stream_and_bidi),
      cmocka_unit_test(test_metadata_roundtrip),
      cmocka_unit_test(test_response_metadata),
      cmocka_unit_test(test_health),
      cmocka_unit_test(test_many_concurrent_streams),
  };
  const struct CMUnitTest conn[] = {
      cmocka_unit_test(test_connect_failure_and_retry),
      cmocka_unit_test(test_graceful_shutdown_finishes_calls),
      cmocka_unit_test(test_heap_trim),
      cmocka_unit_test(test_deadline_after_idle_loop),
      cmocka_unit_test(test_method_stats),
  };
  int rc = cmocka_run_group_tests_name("wire", wire, NULL, NULL);
  rc |= cmocka_run_group_tests_name("live", live, setup, teardown);
  rc |= cmocka_run_group_tests_name("live, no header tables", live,
                                    setup_no_tables, teardown);
  rc |= cmocka_run_group_tests_name("connections", conn, NULL, NULL);
  return rc;
}
