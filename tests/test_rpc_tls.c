/* The gRPC engine over TLS: the Echo service behind a TLS server, driven
 * by the engine's client and by plain OpenSSL clients configured to break
 * the rules (old versions, no ALPN h2). Certificates are made fresh for
 * the run (tests/support/test_certs.h). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/clock.h"
#include "echo.pb-c.h"
#include "rpc/rpc.h"
#include "support/rpc_fixture.h"
#include "support/test_certs.h"
#include "support/testutil.h"

typedef Shardplane__Testing__EchoRequest EchoRequest;
typedef Shardplane__Testing__EchoReply EchoReply;
#define EPATH(m) "/shardplane.testing.Echo/" m

static char *g_dir;
static sp_test_certs g_certs;

/* A failure must be told at once, not after the 10 s connect timeout the
 * clients here get: no retry, no hang. */
#define PROMPT_S 3.0
#define CONNECT_TIMEOUT_MS 10000

static void start_tls_server(sp_test_server *ts, const char *client_ca,
                             size_t max_message) {
  sp_rpc_tls_server_opts tls = {.cert_file = g_certs.server_cert,
                                .key_file = g_certs.server_key,
                                .client_ca_file = client_ca};
  sp_rpc_server_opts o = {.tls = &tls, .max_message = max_message};
  sp_test_server_start(ts, &o);
}

static sp_rpc_sync *open_client(const char *addr,
                                const sp_rpc_tls_client_opts *tls,
                                size_t max_message) {
  sp_rpc_client_opts o = {.connect_timeout_ms = CONNECT_TIMEOUT_MS,
                          .tls = tls,
                          .max_message = max_message};
  sp_rpc_sync *s = NULL;
  assert_int_equal(sp_rpc_sync_open_opts(addr, &o, &s), 0);
  return s;
}

/* One Unary echo of text; the reply (or NULL) and its status. */
static EchoReply *echo(sp_rpc_sync *s, const char *text, sp_rpc_status *st) {
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = (char *)text;
  ProtobufCMessage *resp = NULL;
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor, 5000,
                        &resp, st),
      0);
  return (EchoReply *)resp;
}

/* A call that must fail promptly with UNAVAILABLE and a message holding
 * `want`. */
static void expect_refused(sp_rpc_sync *s, const char *want) {
  sp_rpc_status st;
  double t0 = sp_clock_s();
  EchoReply *r = echo(s, "x", &st);
  double took = sp_clock_s() - t0;
  if (r != NULL) protobuf_c_message_free_unpacked(&r->base, NULL);
  print_message("    -> %s: %s (%.0f ms)\n", sp_rpc_code_name(st.code),
                st.message, took * 1000);
  assert_null(r);
  assert_int_equal(st.code, SP_RPC_UNAVAILABLE);
  if (strstr(st.message, want) == NULL)
    fail_msg("message \"%s\" does not say \"%s\"", st.message, want);
  assert_true(took < PROMPT_S);
}

/* ---------------- calls over TLS ---------------- */

static void test_unary_and_streams(void **state) {
  (void)state;
  sp_test_server ts;
  start_tls_server(&ts, NULL, 0);
  sp_rpc_tls_client_opts tls = {.ca_file = g_certs.ca};
  sp_rpc_sync *s = open_client(ts.addr, &tls, 0);
  sp_rpc_status st;
  EchoReply *r = echo(s, "over tls", &st);
  assert_int_equal(st.code, SP_RPC_OK);
  assert_non_null(r);
  assert_string_equal(r->text, "over tls");
  protobuf_c_message_free_unpacked(&r->base, NULL);

  /* server streaming: 200 replies on the same connection */
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "s";
  req.repeat = 200;
  sp_rpc_sync_stream *ss;
  assert_int_equal(
      sp_rpc_sync_stream_open(s, EPATH("ServerStream"), 5000, NULL, 0, &ss), 0);
  assert_int_equal(sp_rpc_sync_stream_send(ss, &req.base), 0);
  assert_int_equal(sp_rpc_sync_stream_close_send(ss), 0);
  ProtobufCMessage *m;
  for (uint32_t i = 0; i < 200; i++) {
    assert_int_equal(
        sp_rpc_sync_stream_recv(
            ss, &shardplane__testing__echo_reply__descriptor, 2000, &m, &st),
        0);
    assert_int_equal(((EchoReply *)m)->index, i);
    protobuf_c_message_free_unpacked(m, NULL);
  }
  assert_int_equal(
      sp_rpc_sync_stream_recv(ss, &shardplane__testing__echo_reply__descriptor,
                              2000, &m, &st),
      SP_ENOENT);
  assert_int_equal(st.code, SP_RPC_OK);
  sp_rpc_sync_stream_close(ss);

  /* bidirectional: each message answered in turn */
  assert_int_equal(
      sp_rpc_sync_stream_open(s, EPATH("Bidi"), 5000, NULL, 0, &ss), 0);
  for (uint32_t i = 0; i < 20; i++) {
    EchoRequest b = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
    char text[16];
    snprintf(text, sizeof text, "b%u", i);
    b.text = text;
    assert_int_equal(sp_rpc_sync_stream_send(ss, &b.base), 0);
    assert_int_equal(
        sp_rpc_sync_stream_recv(
            ss, &shardplane__testing__echo_reply__descriptor, 2000, &m, &st),
        0);
    assert_string_equal(((EchoReply *)m)->text, text);
    protobuf_c_message_free_unpacked(m, NULL);
  }
  assert_int_equal(sp_rpc_sync_stream_close_send(ss), 0);
  assert_int_equal(
      sp_rpc_sync_stream_recv(ss, &shardplane__testing__echo_reply__descriptor,
                              2000, &m, &st),
      SP_ENOENT);
  assert_int_equal(st.code, SP_RPC_OK);
  sp_rpc_sync_stream_close(ss);
  sp_rpc_sync_close(s);
  sp_rpc_server_stats stats = sp_test_server_stats(&ts);
  assert_int_equal(stats.connections_total, 1);
  sp_test_server_stop(&ts, 1000);
}

/* The certificate's DNS name works too (verified and sent as SNI). */
static void test_dns_name(void **state) {
  (void)state;
  sp_test_server ts;
  start_tls_server(&ts, NULL, 0);
  sp_rpc_tls_client_opts tls = {.ca_file = g_certs.ca,
                                .server_name = "localhost"};
  sp_rpc_sync *s = open_client(ts.addr, &tls, 0);
  sp_rpc_status st;
  EchoReply *r = echo(s, "by name", &st);
  assert_int_equal(st.code, SP_RPC_OK);
  assert_string_equal(r->text, "by name");
  protobuf_c_message_free_unpacked(&r->base, NULL);
  sp_rpc_sync_close(s);
  sp_test_server_stop(&ts, 1000);
}

/* 8 MiB each way: many records, many writes, flow control over TLS. */
static void test_large_message(void **state) {
  (void)state;
  const size_t big = 8u << 20, limit = big + (64u << 10);
  sp_test_server ts;
  start_tls_server(&ts, NULL, limit);
  sp_rpc_tls_client_opts tls = {.ca_file = g_certs.ca};
  sp_rpc_sync *s = open_client(ts.addr, &tls, limit);
  uint8_t *payload = malloc(big);
  assert_non_null(payload);
  sp_test_rng rng = {42};
  for (size_t i = 0; i < big; i++) payload[i] = (uint8_t)sp_test_rng_next(&rng);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "big";
  req.payload.data = payload;
  req.payload.len = big;
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor, 20000,
                        &resp, &st),
      0);
  assert_int_equal(st.code, SP_RPC_OK);
  EchoReply *r = (EchoReply *)resp;
  assert_int_equal(r->payload.len, big);
  assert_memory_equal(r->payload.data, payload, big);
  protobuf_c_message_free_unpacked(resp, NULL);
  free(payload);
  sp_rpc_sync_close(s);
  sp_test_server_stop(&ts, 1000);
}

/* ---------------- mutual TLS ---------------- */

static void test_mtls(void **state) {
  (void)state;
  sp_test_server ts;
  start_tls_server(&ts, g_certs.ca, 0);

  print_message("  with a client certificate from the CA: accepted\n");
  sp_rpc_tls_client_opts good = {.ca_file = g_certs.ca,
                                 .cert_file = g_certs.client_cert,
                                 .key_file = g_certs.client_key};
  sp_rpc_sync *s = open_client(ts.addr, &good, 0);
  sp_rpc_status st;
  EchoReply *r = echo(s, "mutual", &st);
  assert_int_equal(st.code, SP_RPC_OK);
  assert_string_equal(r->text, "mutual");
  protobuf_c_message_free_unpacked(&r->base, NULL);
  sp_rpc_sync_close(s);

  print_message("  without a client certificate: refused\n");
  sp_rpc_tls_client_opts none = {.ca_file = g_certs.ca};
  s = open_client(ts.addr, &none, 0);
  expect_refused(s, "certificate required");
  sp_rpc_sync_close(s);

  print_message("  with a certificate from another CA: refused\n");
  sp_rpc_tls_client_opts other = {.ca_file = g_certs.ca,
                                  .cert_file = g_certs.other_cert,
                                  .key_file = g_certs.other_key};
  s = open_client(ts.addr, &other, 0);
  expect_refused(s, "unknown ca");
  sp_rpc_sync_close(s);
  sp_test_server_stop(&ts, 1000);
}

/* ---------------- the client's verification ---------------- */

static void test_client_verification(void **state) {
  (void)state;
  sp_test_server ts;
  start_tls_server(&ts, NULL, 0);

  print_message("  a server certificate from an unknown CA\n");
  sp_rpc_tls_client_opts other = {.ca_file = g_certs.other_ca};
  sp_rpc_sync *s = open_client(ts.addr, &other, 0);
  char want[160];
  snprintf(want, sizeof want,
           "TLS handshake with %s failed: certificate verify failed (unable "
           "to get local issuer certificate)",
           ts.addr);
  expect_refused(s, want);
  sp_rpc_sync_close(s);

  print_message("  a name the certificate does not carry\n");
  sp_rpc_tls_client_opts wrong = {.ca_file = g_certs.ca,
                                  .server_name = "other.example"};
  s = open_client(ts.addr, &wrong, 0);
  expect_refused(s, "certificate verify failed (hostname mismatch)");
  sp_rpc_sync_close(s);

  print_message("  a missing CA file is named\n");
  char *missing = sp_test_path(g_dir, "no-such-ca.pem");
  sp_rpc_tls_client_opts nofile = {.ca_file = missing};
  s = open_client(ts.addr, &nofile, 0);
  expect_refused(s, missing);
  sp_rpc_sync_close(s);
  free(missing);
  sp_test_server_stop(&ts, 1000);
}

/* A server's files are checked when it starts to listen, and the errors
 * name them. */
static void test_server_files(void **state) {
  (void)state;
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  char *missing = sp_test_path(g_dir, "missing.pem");
  struct {
    const char *cert, *key, *ca, *want;
  } cases[] = {
      {missing, g_certs.server_key, NULL, missing},
      {g_certs.server_cert, g_certs.client_key, NULL, g_certs.client_key},
      {g_certs.server_cert, g_certs.server_key, g_certs.server_key,
       g_certs.server_key},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sp_rpc_tls_server_opts tls = {.cert_file = cases[i].cert,
                                  .key_file = cases[i].key,
                                  .client_ca_file = cases[i].ca};
    sp_rpc_server_opts o = {.tls = &tls};
    sp_rpc_server *srv;
    assert_int_equal(sp_rpc_server_new(&loop, &o, &srv), 0);
    sp_diag d = {""};
    int rc = sp_rpc_server_listen(srv, "127.0.0.1:0", NULL, &d);
    print_message("    -> %s\n", d.msg);
    assert_true(rc < 0);
    if (strstr(d.msg, cases[i].want) == NULL)
      fail_msg("\"%s\" does not name %s", d.msg, cases[i].want);
    sp_rpc_server_free(srv);
  }
  free(missing);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* A server that accepts and never answers the ClientHello: the connect
 * timeout bounds the handshake. */
static void test_handshake_timeout(void **state) {
  (void)state;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  assert_int_equal(listen(fd, 4), 0); /* the kernel accepts; nobody reads */
  socklen_t len = sizeof sa;
  assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
  char addr[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(sa.sin_port));
  sp_rpc_tls_client_opts tls = {.ca_file = g_certs.ca};
  sp_rpc_client_opts o = {.connect_timeout_ms = 300, .tls = &tls};
  sp_rpc_sync *s;
  assert_int_equal(sp_rpc_sync_open_opts(addr, &o, &s), 0);
  double t0 = sp_clock_s();
  expect_refused(s, "failed: timed out");
  assert_true(sp_clock_s() - t0 >= 0.25);
  sp_rpc_sync_close(s);
  close(fd);
}

/* ---------------- cleartext and TLS mixed ---------------- */

static void test_mixed_cleartext_and_tls(void **state) {
  (void)state;
  print_message("  a cleartext client against a TLS server\n");
  sp_test_server ts;
  start_tls_server(&ts, NULL, 0);
  sp_rpc_sync *s = open_client(ts.addr, NULL, 0);
  expect_refused(s, "does it require TLS?");
  sp_rpc_sync_close(s);
  sp_test_server_stop(&ts, 1000);

  print_message("  a TLS client against a cleartext server\n");
  sp_test_server_start(&ts, NULL);
  sp_rpc_tls_client_opts tls = {.ca_file = g_certs.ca};
  s = open_client(ts.addr, &tls, 0);
  char want[192];
  snprintf(want, sizeof want,
           "TLS handshake with %s failed: wrong version number (does the "
           "peer speak TLS?)",
           ts.addr);
  expect_refused(s, want);
  sp_rpc_sync_close(s);
  sp_test_server_stop(&ts, 1000);
}

/* ---------------- clients that break the rules ---------------- */

/* A handshake by a plain OpenSSL client on a blocking socket: TLS
 * versions up to max_version (0: any), ALPN protocols in wire form (NULL:
 * none offered), no verification. Returns whether the handshake
 * completed; why holds OpenSSL's reason when not. */
/* After a completed handshake: sends the HTTP/2 preface, SETTINGS and
 * GOAWAY, then reads until the server ends; true when it ended with
 * close_notify (SSL_ERROR_ZERO_RETURN) rather than a bare FIN. */
static bool goaway_ends_with_close_notify(SSL *ssl) {
  static const unsigned char out[] =
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
      "\x00\x00\x00\x04\x00\x00\x00\x00\x00" /* SETTINGS */
      "\x00\x00\x08\x07\x00\x00\x00\x00\x00" /* GOAWAY, */
      "\x00\x00\x00\x00\x00\x00\x00\x00";    /* last stream 0, NO_ERROR */
  size_t done = 0;
  if (SSL_write_ex(ssl, out, sizeof out - 1, &done) != 1) return false;
  unsigned char buf[4096];
  size_t got;
  while (SSL_read_ex(ssl, buf, sizeof buf, &got) == 1) {
  }
  return SSL_get_error(ssl, 0) == SSL_ERROR_ZERO_RETURN;
}

static bool raw_handshake_then(int port, int max_version,
                               const unsigned char *alpn, unsigned alpn_len,
                               char *why, size_t cap, bool (*then)(SSL *)) {
  SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
  assert_non_null(ctx);
  /* let this client offer what the server must refuse */
  SSL_CTX_set_security_level(ctx, 0);
  SSL_CTX_set_min_proto_version(ctx, TLS1_VERSION);
  SSL_CTX_set_cipher_list(ctx, "ALL:@SECLEVEL=0");
  if (max_version != 0) SSL_CTX_set_max_proto_version(ctx, max_version);
  if (alpn != NULL)
    assert_int_equal(SSL_CTX_set_alpn_protos(ctx, alpn, alpn_len), 0);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  SSL *ssl = SSL_new(ctx);
  SSL_set_fd(ssl, fd);
  ERR_clear_error();
  bool ok = SSL_connect(ssl) == 1;
  why[0] = '\0';
  if (!ok) ERR_error_string_n(ERR_get_error(), why, cap);
  if (ok && then != NULL) ok = then(ssl);
  ERR_clear_error();
  SSL_free(ssl);
  close(fd);
  SSL_CTX_free(ctx);
  return ok;
}

static bool raw_handshake(int port, int max_version, const unsigned char *alpn,
                          unsigned alpn_len, char *why, size_t cap) {
  return raw_handshake_then(port, max_version, alpn, alpn_len, why, cap, NULL);
}

static void test_rule_breaking_clients(void **state) {
  (void)state;
  sp_test_server ts;
  start_tls_server(&ts, NULL, 0);
  static const unsigned char h2[] = "\x02h2";
  static const unsigned char http11[] = "\x08http/1.1";
  char why[256];

  /* the control: this client can complete a handshake, also in TLS 1.2 */
  assert_true(raw_handshake(ts.port, 0, h2, 3, why, sizeof why));
  assert_true(raw_handshake(ts.port, TLS1_2_VERSION, h2, 3, why, sizeof why));

  print_message("  TLS 1.1 only\n");
  assert_false(raw_handshake(ts.port, TLS1_1_VERSION, h2, 3, why, sizeof why));
  print_message("    -> %s\n", why);
  assert_non_null(strstr(why, "protocol version"));

  print_message("  ALPN without h2\n");
  assert_false(raw_handshake(ts.port, 0, http11, 9, why, sizeof why));
  print_message("    -> %s\n", why);
  assert_non_null(strstr(why, "no application protocol"));

  print_message("  no ALPN at all\n");
  assert_false(raw_handshake(ts.port, 0, NULL, 0, why, sizeof why));
  print_message("    -> %s\n", why);
  assert_non_null(strstr(why, "no application protocol"));

  print_message("  the orderly end after GOAWAY sends close_notify\n");
  assert_true(raw_handshake_then(ts.port, 0, h2, 3, why, sizeof why,
                                 goaway_ends_with_close_notify));

  /* none of it hurt the server */
  sp_rpc_tls_client_opts tls = {.ca_file = g_certs.ca};
  sp_rpc_sync *s = open_client(ts.addr, &tls, 0);
  sp_rpc_status st;
  EchoReply *r = echo(s, "still fine", &st);
  assert_int_equal(st.code, SP_RPC_OK);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  sp_rpc_sync_close(s);
  sp_test_server_stop(&ts, 1000);
}

int main(void) {
  /* peers here close mid-handshake on purpose; a write to them must fail,
   * not kill the test (the programs ignore SIGPIPE too) */
  signal(SIGPIPE, SIG_IGN);
  g_dir = sp_test_mkdtemp();
  int rc = sp_test_certs_make(g_dir, &g_certs);
  if (rc == SP_EUNSUPPORTED) {
    sp_test_rmtree(g_dir);
    free(g_dir);
    return sp_test_skip("no openssl command to make the test certificates");
  }
  if (rc != 0) {
    fprintf(stderr, "cannot make the test certificates in %s: %s\n", g_dir,
            sp_strerror(rc));
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_unary_and_streams),
      cmocka_unit_test(test_dns_name),
      cmocka_unit_test(test_large_message),
      cmocka_unit_test(test_mtls),
      cmocka_unit_test(test_client_verification),
      cmocka_unit_test(test_server_files),
      cmocka_unit_test(test_handshake_timeout),
      cmocka_unit_test(test_mixed_cleartext_and_tls),
      cmocka_unit_test(test_rule_breaking_clients),
  };
  rc = cmocka_run_group_tests_name("tls", tests, NULL, NULL);
  sp_test_certs_free(&g_certs);
  sp_test_rmtree(g_dir);
  free(g_dir);
  return rc;
}
