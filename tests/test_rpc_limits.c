/* The server's limits against clients that hold resources without using
 * them: a unary request that never half-closes (freed after the request
 * timeout), connections that never send a request or a whole preface
 * (closed after the preface timeout), idle connections (GOAWAY after the
 * idle timeout), every connection slot taken by idle clients (the longest
 * idle one makes room), and the total budget of buffered bytes
 * (RESOURCE_EXHAUSTED). The Echo service runs in-process on its own loop
 * thread with short limits; hostile clients are raw sockets. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include "echo.pb-c.h"
#include "rpc/rpc.h"
#include "support/h2_raw.h"
#include "support/rpc_fixture.h"
#include "support/testutil.h"

typedef Shardplane__Testing__EchoRequest EchoRequest;
typedef Shardplane__Testing__EchoReply EchoReply;
#define EPATH(m) "/shardplane.testing.Echo/" m

/* Short limits, so each case takes well under a second of waiting; the
 * waits allow ten times as much for a loaded machine. */
#define LIMIT_MS 300
#define WAIT_MS 5000

static sp_test_server g_ts;

static uint64_t now_ms(void) { return uv_hrtime() / 1000000u; }

static void start(const sp_rpc_server_opts *o) {
  signal(SIGPIPE, SIG_IGN);
  sp_test_server_start(&g_ts, o);
}

static void stop(void) { sp_test_server_stop(&g_ts, 2000); }

static sp_rpc_server_stats stats(void) { return sp_test_server_stats(&g_ts); }

/* Waits until the server holds no call and no connection. */
static void wait_idle(const char *when) {
  uint64_t deadline = now_ms() + WAIT_MS;
  sp_rpc_server_stats st;
  for (;;) {
    st = stats();
    if (st.calls_open == 0 && st.connections_open == 0) return;
    if (now_ms() >= deadline) break;
    sp_test_sleep_ms(10);
  }
  fail_msg("%s: the server still holds %llu calls, %llu connections", when,
           (unsigned long long)st.calls_open,
           (unsigned long long)st.connections_open);
}

static void wait_connections(uint64_t n) {
  uint64_t deadline = now_ms() + WAIT_MS;
  while (stats().connections_open < n) {
    if (now_ms() >= deadline)
      fail_msg("the server has %llu connections, expected %llu",
               (unsigned long long)stats().connections_open,
               (unsigned long long)n);
    sp_test_sleep_ms(5);
  }
}

/* A plain Unary call from a normal client. */
static void unary_ok(void) {
  sp_rpc_sync *s;
  assert_int_equal(sp_rpc_sync_open(g_ts.addr, WAIT_MS, &s), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "ping";
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor, WAIT_MS,
                        &resp, &st),
      0);
  if (st.code != SP_RPC_OK)
    fail_msg("Unary: %s %s", sp_rpc_code_name(st.code), st.message);
  assert_string_equal(((EchoReply *)resp)->text, "ping");
  protobuf_c_message_free_unpacked(resp, NULL);
  sp_rpc_sync_close(s);
}

static int tcp_open(void) {
  int fd = sp_h2_connect(g_ts.port);
  if (fd < 0) fail_msg("connect: %s", strerror(errno));
  return fd;
}

static void send_buf(int fd, sp_h2buf *b) {
  assert_true(sp_h2_send_all(fd, b->p, b->len));
  b->len = 0;
}

/* A connection that sent the preface and SETTINGS, and nothing else. */
static int h2_open(void) {
  int fd = tcp_open();
  sp_h2buf b = {0};
  sp_h2_preface(&b);
  sp_h2_settings(&b, NULL, NULL, 0);
  send_buf(fd, &b);
  sp_h2buf_free(&b);
  return fd;
}

/* Reads into r (ACKing SETTINGS) until the server closes the connection
 * (true) or timeout_ms passes (false). */
static bool read_until_closed(int fd, sp_h2_reader *r, int timeout_ms) {
  uint64_t deadline = now_ms() + (uint64_t)timeout_ms;
  for (;;) {
    uint64_t now = now_ms();
    if (now >= deadline) return false;
    struct pollfd p = {fd, POLLIN, 0};
    int pr = poll(&p, 1, (int)(deadline - now));
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return false;
    uint8_t buf[65536];
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return true; /* EOF or reset */
    if (r != NULL) {
      sp_h2_reader_feed(r, buf, (size_t)n);
      assert_false(r->error);
      sp_h2buf b = {0};
      while (r->settings_acked < r->settings) {
        sp_h2_settings_ack(&b);
        r->settings_acked++;
      }
      if (b.len) send(fd, b.p, b.len, MSG_NOSIGNAL);
      sp_h2buf_free(&b);
    }
  }
}

/* A unary request that never half-closes, from a client that set no
 * deadline, was buffered forever (+8.7 MiB per stream with no total cap).
 * Now the call ends DEADLINE_EXCEEDED after the request timeout and its
 * buffers go back. */
static void test_unary_never_half_closed(void **state) {
  (void)state;
  sp_rpc_server_opts o = {.request_timeout_ms = LIMIT_MS};
  start(&o);
  sp_rpc_sync *s;
  assert_int_equal(sp_rpc_sync_open(g_ts.addr, WAIT_MS, &s), 0);
  sp_rpc_sync_stream *st;
  assert_int_equal(sp_rpc_sync_stream_open(s, EPATH("Unary"), 0, NULL, 0, &st),
                   0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  size_t big = 1u << 20;
  uint8_t *payload = calloc(1, big);
  assert_non_null(payload);
  req.payload.data = payload;
  req.payload.len = big;
  uint64_t t0 = now_ms();
  assert_int_equal(sp_rpc_sync_stream_send(st, &req.base), 0);
  ProtobufCMessage *m = NULL;
  sp_rpc_status status;
  int rc = sp_rpc_sync_stream_recv(st, NULL, WAIT_MS, &m, &status);
  uint64_t took = now_ms() - t0;
  if (rc == SP_ETIMEDOUT)
    fail_msg("the server still holds the request after %d ms", WAIT_MS);
  assert_int_equal(rc, SP_ENOENT);
  assert_int_equal(status.code, SP_RPC_DEADLINE_EXCEEDED);
  assert_non_null(strstr(status.message, "request timeout"));
  printf(
      "unary request never half-closed: %s after %llu ms (limit %d ms): "
      "%s\n",
      sp_rpc_code_name(status.code), (unsigned long long)took, LIMIT_MS,
      status.message);
  assert_true(took + 20 >= LIMIT_MS);
  sp_rpc_sync_stream_close(st);
  sp_rpc_sync_close(s);
  free(payload);
  wait_idle("after the timed-out request");
  sp_rpc_server_stats x = stats();
  assert_int_equal(x.buffered_bytes, 0);
  assert_int_equal(x.calls_request_timeout, 1);
  assert_true(x.buffered_peak >= big);
  /* a client deadline shorter than the limit still rules */
  assert_int_equal(sp_rpc_sync_open(g_ts.addr, WAIT_MS, &s), 0);
  assert_int_equal(
      sp_rpc_sync_stream_open(s, EPATH("Unary"), 100, NULL, 0, &st), 0);
  req.payload.len = 0;
  assert_int_equal(sp_rpc_sync_stream_send(st, &req.base), 0);
  assert_int_equal(sp_rpc_sync_stream_recv(st, NULL, WAIT_MS, &m, &status),
                   SP_ENOENT);
  assert_int_equal(status.code, SP_RPC_DEADLINE_EXCEEDED);
  assert_null(strstr(status.message, "request timeout"));
  sp_rpc_sync_stream_close(st);
  sp_rpc_sync_close(s);
  /* and a request that completes may take its time to be answered */
  assert_int_equal(sp_rpc_sync_open(g_ts.addr, WAIT_MS, &s), 0);
  req.text = "late";
  req.delay_ms = 2 * LIMIT_MS;
  ProtobufCMessage *resp = NULL;
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor, 0, &resp,
                        &status),
      0);
  assert_int_equal(status.code, SP_RPC_OK);
  protobuf_c_message_free_unpacked(resp, NULL);
  sp_rpc_sync_close(s);
  wait_idle("at the end");
  stop();
}

/* Connections that never send a request, or only half the preface, held
 * their descriptors indefinitely (10,000 and 2,000 still open after two
 * minutes). Now they are closed after the preface timeout. */
static void test_preface_timeout(void **state) {
  (void)state;
  sp_rpc_server_opts o = {.preface_timeout_ms = LIMIT_MS};
  start(&o);
  enum { N = 40 };
  int fd[N];
  for (int i = 0; i < N; i++) {
    fd[i] = tcp_open();
    if (i % 2 == 1) { /* slowloris: 12 of the preface's 24 bytes */
      sp_h2buf b = {0};
      sp_h2_preface(&b);
      b.len = 12;
      send_buf(fd[i], &b);
      sp_h2buf_free(&b);
    }
  }
  wait_connections(N);
  uint64_t t0 = now_ms();
  for (int i = 0; i < N; i++) {
    if (!read_until_closed(fd[i], NULL, WAIT_MS))
      fail_msg("connection %d still open %d ms after connecting", i, WAIT_MS);
    close(fd[i]);
  }
  printf(
      "%d idle and half-preface connections closed within %llu ms "
      "(limit %d ms)\n",
      N, (unsigned long long)(now_ms() - t0), LIMIT_MS);
  wait_idle("after the preface timeout");
  assert_int_equal(stats().connections_preface_closed, N);
  unary_ok();
  stop();
}

/* A connection with no open call is closed with GOAWAY after the idle
 * timeout; one with a call open stays. */
static void test_idle_timeout(void **state) {
  (void)state;
  sp_rpc_server_opts o = {.idle_timeout_ms = LIMIT_MS};
  start(&o);
  /* a stream kept open across several idle timeouts still works */
  sp_rpc_sync *s;
  assert_int_equal(sp_rpc_sync_open(g_ts.addr, WAIT_MS, &s), 0);
  sp_rpc_sync_stream *st;
  assert_int_equal(sp_rpc_sync_stream_open(s, EPATH("Bidi"), 0, NULL, 0, &st),
                   0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "one";
  assert_int_equal(sp_rpc_sync_stream_send(st, &req.base), 0);
  ProtobufCMessage *m = NULL;
  sp_rpc_status status;
  /* the blocking client's loop runs only inside its calls: the stream is
   * open on the server once the first answer is back */
  assert_int_equal(
      sp_rpc_sync_stream_recv(st, &shardplane__testing__echo_reply__descriptor,
                              WAIT_MS, &m, &status),
      0);
  protobuf_c_message_free_unpacked(m, NULL);
  /* an idle raw connection that made one call */
  int fd = h2_open();
  sp_h2buf b = {0}, blk = {0};
  sp_h2_grpc_request_block(&blk, EPATH("Unary"));
  sp_h2_headers(&b, 1, &blk, false, 0);
  uint8_t msg[2] = {0x0a, 0x00};
  sp_h2_grpc_message(&b, 1, msg, sizeof msg, true);
  send_buf(fd, &b);
  sp_h2buf_free(&b);
  sp_h2buf_free(&blk);
  sp_h2_reader r;
  sp_h2_reader_init(&r);
  uint64_t t0 = now_ms();
  assert_true(read_until_closed(fd, &r, WAIT_MS));
  uint64_t took = now_ms() - t0;
  close(fd);
  const sp_h2_stream *x = sp_h2_reader_stream(&r, 1);
  assert_non_null(x);
  assert_int_equal(x->grpc_status, SP_RPC_OK);
  assert_true(r.goaway);
  assert_int_equal(r.goaway_code, 0);
  sp_h2_reader_free(&r);
  printf("idle connection: GOAWAY and closed after %llu ms (limit %d ms)\n",
         (unsigned long long)took, LIMIT_MS);
  sp_test_sleep_ms(2 * LIMIT_MS);
  req.text = "two";
  int rc = sp_rpc_sync_stream_send(st, &req.base);
  if (rc != 0) {
    sp_rpc_sync_stream_recv(st, NULL, 100, &m, &status);
    fail_msg("the open stream ended: %s %s", sp_rpc_code_name(status.code),
             status.message);
  }
  rc = sp_rpc_sync_stream_recv(st, &shardplane__testing__echo_reply__descriptor,
                               WAIT_MS, &m, &status);
  if (rc != 0)
    fail_msg("the open stream ended: %s: %s %s", sp_strerror(rc),
             sp_rpc_code_name(status.code), status.message);
  protobuf_c_message_free_unpacked(m, NULL);
  sp_rpc_sync_stream_close(st);
  sp_rpc_sync_close(s);
  assert_true(stats().connections_idle_closed >= 1);
  wait_idle("at the end");
  stop();
}

/* With every connection slot taken by idle clients a new client was
 * refused (at the fd limit, workers too). Now the longest idle connection
 * is closed with GOAWAY to admit it; with every slot busy with calls the
 * new connection is told why and closed. */
static void test_max_connections(void **state) {
  (void)state;
  enum { MAX = 8 };
  sp_rpc_server_opts o = {.max_connections = MAX};
  start(&o);
  int fd[MAX];
  for (int i = 0; i < MAX; i++) fd[i] = h2_open();
  wait_connections(MAX);
  unary_ok(); /* admitted: an idle one made room */
  sp_rpc_server_stats x = stats();
  assert_true(x.connections_idle_closed >= 1);
  printf(
      "%d slots held by idle clients: a new client's call succeeded, %llu "
      "idle connection(s) closed for it\n",
      MAX, (unsigned long long)x.connections_idle_closed);
  for (int i = 0; i < MAX; i++) close(fd[i]);
  wait_idle("after the idle clients");
  /* every slot with an open call: the next connection is refused */
  for (int i = 0; i < MAX; i++) {
    fd[i] = h2_open();
    sp_h2buf b = {0}, blk = {0};
    sp_h2_grpc_request_block(&blk, EPATH("Bidi"));
    sp_h2_headers(&b, 1, &blk, false, 0);
    send_buf(fd[i], &b);
    sp_h2buf_free(&b);
    sp_h2buf_free(&blk);
  }
  uint64_t deadline = now_ms() + WAIT_MS;
  while (stats().calls_open < MAX && now_ms() < deadline) sp_test_sleep_ms(5);
  assert_int_equal(stats().calls_open, MAX);
  int extra = h2_open();
  sp_h2_reader r;
  sp_h2_reader_init(&r);
  assert_true(read_until_closed(extra, &r, WAIT_MS));
  assert_true(r.goaway);
  sp_h2_reader_free(&r);
  close(extra);
  assert_int_equal(stats().connections_refused, 1);
  for (int i = 0; i < MAX; i++) close(fd[i]);
  wait_idle("at the end");
  stop();
}

/* The buffer budget across all connections: a request that would go over
 * it ends with RESOURCE_EXHAUSTED, what fits still works, and nothing
 * stays charged. */
static void test_buffer_budget(void **state) {
  (void)state;
  sp_rpc_server_opts o = {.max_buffered = 1u << 20};
  start(&o);
  sp_rpc_sync *s;
  assert_int_equal(sp_rpc_sync_open(g_ts.addr, WAIT_MS, &s), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  uint8_t *payload = calloc(1, 2u << 20);
  assert_non_null(payload);
  req.payload.data = payload;
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  /* over the budget by itself */
  req.payload.len = 2u << 20;
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor, WAIT_MS,
                        &resp, &st),
      0);
  assert_int_equal(st.code, SP_RPC_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(st.message, "buffers are full"));
  printf("2 MiB request, 1 MiB budget: %s: %s\n", sp_rpc_code_name(st.code),
         st.message);
  /* the request and its echo fit together: fine, several times */
  req.payload.len = 300u << 10;
  for (int i = 0; i < 4; i++) {
    assert_int_equal(
        sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                          &shardplane__testing__echo_reply__descriptor, WAIT_MS,
                          &resp, &st),
        0);
    assert_int_equal(st.code, SP_RPC_OK);
    assert_int_equal(((EchoReply *)resp)->payload.len, 300u << 10);
    protobuf_c_message_free_unpacked(resp, NULL);
  }
  /* the request is held while its answer is built: 600 KiB each way is
   * over, and the send is refused rather than buffered (the Echo handler
   * ignores the refusal and finishes OK without a message, which the
   * client reads as a unary call without an answer) */
  req.payload.len = 600u << 10;
  uint64_t refused = stats().calls_over_budget;
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor, WAIT_MS,
                        &resp, &st),
      0);
  assert_int_not_equal(st.code, SP_RPC_OK);
  assert_int_equal(stats().calls_over_budget, refused + 1);
  sp_rpc_sync_close(s);
  free(payload);
  wait_idle("at the end");
  sp_rpc_server_stats x = stats();
  assert_int_equal(x.buffered_bytes, 0);
  assert_true(x.calls_over_budget >= 2);
  assert_true(x.buffered_peak <= (1u << 20));
  stop();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_unary_never_half_closed),
      cmocka_unit_test(test_preface_timeout),
      cmocka_unit_test(test_idle_timeout),
      cmocka_unit_test(test_max_connections),
      cmocka_unit_test(test_buffer_budget),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
