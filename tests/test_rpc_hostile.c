/* Hostile input against the engine's server: garbage bytes, truncated
 * frames, huge length prefixes, thousands of reset streams, a client that
 * never reads, oversized metadata and non-gRPC requests. The server runs
 * in-process with the Echo service on its own loop thread; the hostile
 * clients are raw sockets speaking hand-built HTTP/2 (tests/support/h2_raw.h).
 * After each case the server must still answer a normal Unary call, and its
 * counters must show no call or connection left behind.
 *
 * Every wait on the network has a deadline, and an alarm ends the whole
 * program, so a bug fails the test instead of hanging it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include "echo.pb-c.h"
#include "support/h2_raw.h"
#include "rpc/rpc.h"
#include "support/rpc_fixture.h"
#include "support/testutil.h"

typedef Shardplane__Testing__EchoRequest EchoRequest;
typedef Shardplane__Testing__EchoReply EchoReply;
#define EPATH(m) "/shardplane.testing.Echo/" m

/* Deadline for any single wait on the server (answers, closes, stats). */
#define IO_TIMEOUT_MS 5000
/* The whole program must finish well inside ctest's budget. */
#define WATCHDOG_S 55
/* The never-reading client may cost the server its per-call queue
 * (SP_RPC_DEFAULT_MAX_PENDING, 8 MiB), two write buffers and allocator
 * slack; anything near the 10 GiB it asked for is a bug. */
#define RSS_GROWTH_MAX (64u << 20)

/* ---------------- server on a loop thread ---------------- */

static struct {
  sp_test_server ts;
  int port;
  const char *addr;
} g;

static sp_rpc_server_stats stats(void) { return sp_test_server_stats(&g.ts); }

static int group_setup(void **state) {
  (void)state;
  signal(SIGPIPE, SIG_IGN);
  sp_test_server_start(&g.ts, NULL);
  g.port = g.ts.port;
  g.addr = g.ts.addr;
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  sp_test_server_stop(&g.ts, 2000);
  return 0;
}

/* ---------------- small helpers ---------------- */

static uint64_t now_ms(void) { return uv_hrtime() / 1000000u; }

static size_t rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  assert_non_null(f);
  unsigned long size = 0, resident = 0;
  int n = fscanf(f, "%lu %lu", &size, &resident);
  fclose(f);
  assert_int_equal(n, 2);
  return (size_t)resident * (size_t)sysconf(_SC_PAGESIZE);
}

/* RSS growth since `base` (0 if it shrank). */
static size_t rss_growth(size_t base) {
  size_t now = rss_bytes();
  return now > base ? now - base : 0;
}

/* Waits until the server holds no call and no connection. */
static void wait_idle(const char *when) {
  uint64_t deadline = now_ms() + IO_TIMEOUT_MS;
  sp_rpc_server_stats st;
  for (;;) {
    st = stats();
    if (st.calls_open == 0 && st.connections_open == 0) return;
    if (now_ms() >= deadline) break;
    sp_test_sleep_ms(10);
  }
  fail_msg("%s: server still holds %llu calls, %llu connections", when,
           (unsigned long long)st.calls_open,
           (unsigned long long)st.connections_open);
}

/* Waits until the server has at least `calls` calls open. */
static void wait_calls(uint64_t calls) {
  uint64_t deadline = now_ms() + IO_TIMEOUT_MS;
  while (stats().calls_open < calls) {
    if (now_ms() >= deadline) fail_msg("the call never reached the server");
    sp_test_sleep_ms(5);
  }
}

/* One Unary call from a normal client; returns the Echo service's count of
 * handlers still holding work (parsed from "__stats__"), after checking a
 * plain echo works. */
static unsigned unary_ping(void) {
  sp_rpc_sync *s;
  assert_int_equal(sp_rpc_sync_open(g.addr, IO_TIMEOUT_MS, &s), 0);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "ping";
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor,
                        IO_TIMEOUT_MS, &resp, &st),
      0);
  if (st.code != SP_RPC_OK)
    fail_msg("Unary after hostile input: %s %s", sp_rpc_code_name(st.code),
             st.message);
  assert_string_equal(((EchoReply *)resp)->text, "ping");
  protobuf_c_message_free_unpacked(resp, NULL);
  req.text = "__stats__";
  assert_int_equal(
      sp_rpc_sync_unary(s, EPATH("Unary"), &req.base,
                        &shardplane__testing__echo_reply__descriptor,
                        IO_TIMEOUT_MS, &resp, &st),
      0);
  assert_int_equal(st.code, SP_RPC_OK);
  unsigned cancelled = 0, active = 0;
  assert_int_equal(sscanf(((EchoReply *)resp)->text, "cancelled=%u active=%u",
                          &cancelled, &active),
                   2);
  protobuf_c_message_free_unpacked(resp, NULL);
  sp_rpc_sync_close(s);
  return active;
}

/* The check after every case: the hostile client's connection and calls
 * are gone, a normal call works, no handler still holds work, and the
 * checking client leaves nothing behind either. */
static void expect_server_healthy(void) {
  wait_idle("after the hostile client");
  assert_int_equal(unary_ping(), 0);
  wait_idle("after the check call");
}

/* ---------------- raw sockets ---------------- */

/* A blocking loopback connection with send/receive timeouts; rcvbuf > 0
 * shrinks the receive buffer (set before connecting so the advertised
 * window stays small). */
static int tcp_open(int rcvbuf) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  assert_true(fd >= 0);
  if (rcvbuf > 0)
    assert_int_equal(
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf), 0);
  struct timeval tv = {IO_TIMEOUT_MS / 1000, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct sockaddr_in sa = {0};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)g.port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
  return fd;
}

/* False when the server already hung up, which hostile input may cause. */
static bool send_all(int fd, const void *data, size_t len) {
  const uint8_t *p = data;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    len -= (size_t)n;
  }
  return true;
}

static bool send_buf(int fd, sp_h2buf *b) {
  bool ok = send_all(fd, b->p, b->len);
  b->len = 0;
  return ok;
}

static void ack_settings(int fd, sp_h2_reader *r) {
  sp_h2buf b = {0};
  while (r->settings_acked < r->settings) {
    sp_h2_settings_ack(&b);
    r->settings_acked++;
  }
  if (b.len) send_all(fd, b.p, b.len);
  sp_h2buf_free(&b);
}

typedef bool (*until_fn)(const sp_h2_reader *r, uint32_t arg);

enum { PUMP_DONE = 1, PUMP_CLOSED = 0, PUMP_TIMEOUT = -1 };

/* Reads what the server sends into r, ACKing its SETTINGS, until
 * until(r, arg) holds (PUMP_DONE), the server closes or resets the
 * connection (PUMP_CLOSED), or timeout_ms passes (PUMP_TIMEOUT). With
 * timeout_ms 0 it only takes what is already there. */
static int pump(int fd, sp_h2_reader *r, until_fn until, uint32_t arg,
                int timeout_ms) {
  uint64_t deadline = now_ms() + (uint64_t)timeout_ms;
  for (;;) {
    if (until != NULL && until(r, arg)) return PUMP_DONE;
    uint64_t now = now_ms();
    int left = now >= deadline ? 0 : (int)(deadline - now);
    struct pollfd p = {fd, POLLIN, 0};
    int pr = poll(&p, 1, left);
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) return PUMP_TIMEOUT;
    uint8_t buf[65536];
    ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return PUMP_CLOSED;
    sp_h2_reader_feed(r, buf, (size_t)n);
    assert_false(r->error); /* the server's own output must be valid */
    ack_settings(fd, r);
  }
}

static bool until_stream_done(const sp_h2_reader *r, uint32_t sid) {
  return sp_h2_stream_done(sp_h2_reader_stream(r, sid));
}

static bool until_settings(const sp_h2_reader *r, uint32_t n) {
  return r->settings >= n;
}

static bool until_pings(const sp_h2_reader *r, uint32_t n) {
  return r->pings_acked >= n;
}

static bool until_goaway(const sp_h2_reader *r, uint32_t unused) {
  (void)unused;
  return r->goaway;
}

/* Preface and SETTINGS (n pairs) on a new connection. */
static int h2_open(const uint16_t *ids, const uint32_t *vals, size_t n,
                   int rcvbuf) {
  int fd = tcp_open(rcvbuf);
  sp_h2buf b = {0};
  sp_h2_preface(&b);
  sp_h2_settings(&b, ids, vals, n);
  assert_true(send_buf(fd, &b));
  sp_h2buf_free(&b);
  return fd;
}

/* HEADERS for a gRPC call to path, then optionally one packed request
 * message, with END_STREAM on the last frame when end is set. */
static void put_call(sp_h2buf *b, uint32_t sid, const char *path,
                     const EchoRequest *req, bool end) {
  sp_h2buf blk = {0};
  sp_h2_grpc_request_block(&blk, path);
  sp_h2_headers(b, sid, &blk, end && req == NULL, 0);
  sp_h2buf_free(&blk);
  if (req != NULL) {
    size_t n = shardplane__testing__echo_request__get_packed_size(req);
    uint8_t *m = malloc(n ? n : 1);
    assert_non_null(m);
    shardplane__testing__echo_request__pack(req, m);
    sp_h2_grpc_message(b, sid, m, n, end);
    free(m);
  }
}

/* Sends b and waits for stream sid to end; returns its record. */
static const sp_h2_stream *exchange(int fd, sp_h2_reader *r, sp_h2buf *b,
                                    uint32_t sid) {
  assert_true(send_buf(fd, b));
  int rc = pump(fd, r, until_stream_done, sid, IO_TIMEOUT_MS);
  if (rc != PUMP_DONE)
    fail_msg("stream %u: no answer (%s)", (unsigned)sid,
             rc == PUMP_CLOSED ? "connection closed" : "timed out");
  return sp_h2_reader_stream(r, sid);
}

/* A valid Unary call on an existing connection must still succeed. */
static void expect_unary_ok(int fd, sp_h2_reader *r, uint32_t sid) {
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "still here";
  sp_h2buf b = {0};
  put_call(&b, sid, EPATH("Unary"), &req, true);
  const sp_h2_stream *s = exchange(fd, r, &b, sid);
  sp_h2buf_free(&b);
  assert_int_equal(s->http_status, 200);
  assert_int_equal(s->grpc_status, SP_RPC_OK);
  assert_true(s->data_bytes > 5);
}

/* ---------------- cases ---------------- */

static void test_garbage_bytes(void **state) {
  (void)state;
  sp_test_rng rng = {0x5eed};
  for (int i = 0; i < 24; i++) {
    size_t n = 1 + (size_t)sp_test_rng_below(&rng, i < 12 ? 64 : 65536);
    uint8_t *junk = malloc(n);
    assert_non_null(junk);
    for (size_t k = 0; k < n; k++) junk[k] = (uint8_t)sp_test_rng_next(&rng);
    bool with_preface = i % 2 == 1;
    /* a junk start that happened to match the preface would just wait */
    if (junk[0] == 'P') junk[0] = 'Q';
    int fd = tcp_open(0);
    sp_h2buf b = {0};
    if (with_preface) sp_h2_preface(&b);
    sp_h2buf_put(&b, junk, n);
    send_buf(fd, &b); /* the server may hang up half-way */
    if (!with_preface) {
      /* a bad preface: the server must hang up on its own, promptly */
      sp_h2_reader r;
      sp_h2_reader_init(&r);
      assert_int_equal(pump(fd, &r, NULL, 0, IO_TIMEOUT_MS), PUMP_CLOSED);
      sp_h2_reader_free(&r);
    }
    /* after the preface the junk may parse as a frame still incomplete:
     * hang up ourselves */
    close(fd);
    sp_h2buf_free(&b);
    free(junk);
  }
  expect_server_healthy();
}

static void test_http1_request(void **state) {
  (void)state;
  static const char *const reqs[] = {
      "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
      "POST /shardplane.testing.Echo/Unary HTTP/1.1\r\nHost: localhost\r\n"
      "Content-Type: application/grpc\r\nContent-Length: 5\r\n\r\n\0\0\0\0\0",
      /* an h2c upgrade attempt: the server only speaks prior knowledge */
      "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, "
      "HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
  };
  for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++) {
    int fd = tcp_open(0);
    send_all(fd, reqs[i], strlen(reqs[i]));
    sp_h2_reader r;
    sp_h2_reader_init(&r);
    assert_int_equal(pump(fd, &r, NULL, 0, IO_TIMEOUT_MS), PUMP_CLOSED);
    sp_h2_reader_free(&r);
    close(fd);
  }
  expect_server_healthy();
}

static void test_connect_and_close(void **state) {
  (void)state;
  for (int i = 0; i < 64; i++) {
    int fd = tcp_open(0);
    if (i % 2) {
      /* linger 0: the close is a TCP RST instead of a FIN */
      struct linger lg = {1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    }
    close(fd);
  }
  expect_server_healthy();
}

static void test_truncated_frames(void **state) {
  (void)state;
  for (int variant = 0; variant < 5; variant++) {
    int fd;
    sp_h2buf b = {0};
    if (variant == 0) {
      /* the preface itself cut short */
      fd = tcp_open(0);
      sp_h2buf_put(&b, NGHTTP2_CLIENT_MAGIC, 10);
      assert_true(send_buf(fd, &b));
    } else {
      fd = h2_open(NULL, NULL, 0, 0);
      sp_h2_reader r;
      sp_h2_reader_init(&r);
      assert_int_equal(pump(fd, &r, until_settings, 1, IO_TIMEOUT_MS),
                       PUMP_DONE);
      if (variant == 1) {
        /* half a frame header */
        static const uint8_t half[5] = {0, 0, 100, NGHTTP2_HEADERS, 0x4};
        sp_h2buf_put(&b, half, sizeof half);
      } else if (variant == 2) {
        /* a HEADERS frame announcing 100 bytes, 10 sent */
        static const uint8_t hdr[9] = {0, 0, 100, NGHTTP2_HEADERS, 0x4, 0,
                                       0, 0, 1};
        sp_h2buf_put(&b, hdr, sizeof hdr);
        static const uint8_t part[10] = {0,   5,   ':', 'p', 'a',
                                         't', 'h', 1,   '/', 0};
        sp_h2buf_put(&b, part, sizeof part);
      } else {
        /* a routed Unary call whose DATA frame (variant 3) or message
         * (variant 4) stops short: a call is open when the peer leaves */
        put_call(&b, 1, EPATH("Unary"), NULL, false);
        if (variant == 3) {
          static const uint8_t data[9] = {0, 0, 50, NGHTTP2_DATA, 0, 0,
                                          0, 0, 1};
          sp_h2buf_put(&b, data, sizeof data);
          /* prefix announcing 45 bytes, then 15 of them */
          sp_h2buf_put(&b,
                       "\0\0\0\0\x2d"
                       "0123456789abcde",
                       20);
        } else {
          static const uint8_t msg[8] = {0, 0, 0, 0, 100, 1, 2, 3};
          sp_h2_data(&b, 1, msg, sizeof msg, false);
        }
      }
      assert_true(send_buf(fd, &b));
      if (variant >= 3) wait_calls(1);
      sp_h2_reader_free(&r);
    }
    close(fd);
    sp_h2buf_free(&b);
    wait_idle("after a truncated frame");
  }
  expect_server_healthy();
}

/* A 5-byte prefix claiming 0xFFFFFFFF bytes: RESOURCE_EXHAUSTED from the
 * prefix alone, promptly, without allocating the announced size; the
 * connection stays usable. */
static void test_prefix_4gib(void **state) {
  (void)state;
  size_t rss0 = rss_bytes();
  int fd = h2_open(NULL, NULL, 0, 0);
  sp_h2_reader r;
  sp_h2_reader_init(&r);
  static const uint8_t huge[5] = {0, 0xff, 0xff, 0xff, 0xff};
  static const char *const paths[] = {EPATH("Unary"), EPATH("Bidi"),
                                      EPATH("ClientStream")};
  uint32_t sid = 1;
  for (size_t i = 0; i < 3; i++, sid += 2) {
    sp_h2buf b = {0};
    put_call(&b, sid, paths[i], NULL, false);
    sp_h2_data(&b, sid, huge, sizeof huge, false);
    uint64_t t0 = now_ms();
    const sp_h2_stream *s = exchange(fd, &r, &b, sid);
    uint64_t took = now_ms() - t0;
    sp_h2buf_free(&b);
    assert_int_equal(s->grpc_status, SP_RPC_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(s->grpc_message, "4294967295"));
    assert_true(took < 2000);
  }
  expect_unary_ok(fd, &r, sid);
  size_t grown = rss_growth(rss0);
  print_message("4 GiB prefix: RSS grew by %zu KiB\n", grown >> 10);
  assert_true(grown < RSS_GROWTH_MAX);
  sp_h2_reader_free(&r);
  close(fd);
  expect_server_healthy();
}

/* A prefix claiming 3 MiB (under the limit), then END_STREAM after 10 bytes
 * of the stream: INTERNAL, and the connection stays usable. Also a prefix
 * split across DATA frames, which must still parse. */
static void test_prefix_3mib_then_eos(void **state) {
  (void)state;
  int fd = h2_open(NULL, NULL, 0, 0);
  sp_h2_reader r;
  sp_h2_reader_init(&r);
  sp_h2buf b = {0};
  put_call(&b, 1, EPATH("Unary"), NULL, false);
  static const uint8_t short_msg[10] = {0, 0, 0x30, 0, 0, 1, 2, 3, 4, 5};
  sp_h2_data(&b, 1, short_msg, sizeof short_msg, true);
  const sp_h2_stream *s = exchange(fd, &r, &b, 1);
  assert_int_equal(s->grpc_status, SP_RPC_INTERNAL);
  /* same on a streaming method, where messages are delivered one by one */
  put_call(&b, 3, EPATH("Bidi"), NULL, false);
  sp_h2_data(&b, 3, short_msg, sizeof short_msg, true);
  s = exchange(fd, &r, &b, 3);
  assert_int_equal(s->grpc_status, SP_RPC_INTERNAL);
  /* a valid request whose prefix arrives in three DATA frames */
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "split";
  uint8_t msg[64];
  size_t n = shardplane__testing__echo_request__pack(&req, msg + 5);
  msg[0] = 0;
  msg[1] = msg[2] = msg[3] = 0;
  msg[4] = (uint8_t)n;
  put_call(&b, 5, EPATH("Unary"), NULL, false);
  sp_h2_data(&b, 5, msg, 2, false);
  sp_h2_data(&b, 5, msg + 2, 2, false);
  sp_h2_data(&b, 5, msg + 4, n + 1, true);
  s = exchange(fd, &r, &b, 5);
  assert_int_equal(s->grpc_status, SP_RPC_OK);
  sp_h2buf_free(&b);
  expect_unary_ok(fd, &r, 7);
  sp_h2_reader_free(&r);
  close(fd);
  expect_server_healthy();
}

/* 5000 streams opened and reset (CVE-2023-44487 style), in batches of 100,
 * each followed by a PING so the client knows how far the server got.
 * nghttp2's rapid-reset limit may GOAWAY a connection: the client then goes
 * on with a new one until the server has taken 5000 streams. Every fourth
 * stream carries a full ServerStream request, so a handler starts and must
 * be cancelled. */
static void test_rapid_reset(void **state) {
  (void)state;
  const int total = 5000, batch = 100;
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "reset me";
  req.repeat = 1000;
  int taken = 0, conns = 0, goaways = 0;
  while (taken < total) {
    assert_true(++conns <= 50); /* each connection must take some streams */
    int fd = h2_open(NULL, NULL, 0, 0);
    sp_h2_reader r;
    sp_h2_reader_init(&r);
    uint32_t sid = 1;
    uint32_t pings = 0;
    while (taken < total) {
      sp_h2buf b = {0};
      uint32_t first = sid;
      int n = 0;
      for (; n < batch && taken + n < total; n++, sid += 2) {
        bool with_request = n % 4 == 3;
        put_call(&b, sid, with_request ? EPATH("ServerStream") : EPATH("Unary"),
                 with_request ? &req : NULL, with_request);
        sp_h2_rst_stream(&b, sid, NGHTTP2_CANCEL);
      }
      uint8_t opaque[8] = {0};
      memcpy(opaque, &sid, sizeof sid);
      sp_h2_ping(&b, opaque);
      bool sent = send_buf(fd, &b);
      sp_h2buf_free(&b);
      int rc = sent ? pump(fd, &r, until_pings, ++pings, IO_TIMEOUT_MS)
                    : PUMP_CLOSED;
      if (rc == PUMP_DONE && !r.goaway) {
        taken += n;
        continue;
      }
      /* refused from here on: count what the connection took */
      if (!r.goaway)
        fail_msg("%s", rc == PUMP_CLOSED ? "connection closed without GOAWAY"
                                         : "no PING answer in time");
      for (uint32_t s = first; s < sid; s += 2)
        if (s <= r.goaway_last) taken++;
      break;
    }
    if (r.goaway) {
      goaways++;
      /* ENHANCE_YOUR_CALM or INTERNAL_ERROR, depending on the release */
      assert_true(r.goaway_code == NGHTTP2_ENHANCE_YOUR_CALM ||
                  r.goaway_code == NGHTTP2_INTERNAL_ERROR);
    }
    sp_h2_reader_free(&r);
    close(fd);
  }
  print_message(
      "rapid reset: %d streams taken over %d connections, "
      "%d GOAWAYs\n",
      taken, conns, goaways);
  expect_server_healthy();
}

/* ServerStreams asking for 10 million 1 KiB replies each from a client that
 * never reads, with flow control wide open so only TCP pushes back: the
 * server's memory stays bounded (per-call queue, and the connection's budget
 * across all its calls), other clients are served meanwhile, and when the
 * client leaves the handlers are cancelled. */
static void never_reads(int n_streams) {
  wait_idle("before the never-reading client");
  size_t rss0 = rss_bytes();
  static const uint16_t ids[] = {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE};
  static const uint32_t vals[] = {0x7fffffff};
  int fd = h2_open(ids, vals, 1, 64 << 10);
  sp_h2buf b = {0};
  sp_h2_window_update(&b, 0, 0x7fffffff - 65535);
  uint8_t payload[1024];
  memset(payload, 'z', sizeof payload);
  EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
  req.text = "flood";
  req.payload.data = payload;
  req.payload.len = sizeof payload;
  req.repeat = 10000000;
  for (int i = 0; i < n_streams; i++)
    put_call(&b, 1 + 2 * i, EPATH("ServerStream"), &req, true);
  assert_true(send_buf(fd, &b));
  sp_h2buf_free(&b);

  /* wait until the server's output stalls: bytes_out (counted when handed
   * to the socket) stops moving for 500 ms */
  uint64_t deadline = now_ms() + 20000, last = 0, since = now_ms();
  sp_rpc_server_stats st;
  for (;;) {
    st = stats();
    uint64_t now = now_ms();
    if (st.bytes_out != last) {
      last = st.bytes_out;
      since = now;
    } else if (now - since >= 500 && last > 0) {
      break;
    }
    if (now >= deadline) fail_msg("the server never stopped writing");
    sp_test_sleep_ms(50);
  }
  assert_int_equal(st.calls_open, (uint64_t)n_streams);
  assert_true(last > (256u << 10)); /* it streamed until TCP pushed back */
  size_t grown = rss_growth(rss0);
  print_message(
      "never-reading client, %d streams: %llu bytes written, RSS "
      "grew by %zu KiB\n",
      n_streams, (unsigned long long)last, grown >> 10);
  assert_true(grown < RSS_GROWTH_MAX);

  /* another client is served while the stream is stuck; the stuck call is
   * the one handler still holding work */
  assert_int_equal(unary_ping(), n_streams);
  st = stats();
  assert_int_equal(st.calls_open, (uint64_t)n_streams);
  grown = rss_growth(rss0);
  assert_true(grown < RSS_GROWTH_MAX);

  close(fd); /* unread data: the kernel resets the connection */
  expect_server_healthy();
}

static void test_client_never_reads(void **state) {
  (void)state;
  never_reads(1);
}

/* 50 streams x the 8 MiB per-call cap would be 400 MiB; the connection
 * budget (32 MiB) keeps the total under RSS_GROWTH_MAX. */
static void test_client_never_reads_many_streams(void **state) {
  (void)state;
  never_reads(50);
}

/* Request metadata over the 8 KiB limit: RESOURCE_EXHAUSTED, or a stream or
 * connection error from nghttp2 for blocks it refuses to decode. */
static void test_metadata_over_limit(void **state) {
  (void)state;
  for (int variant = 0; variant < 3; variant++) {
    int fd = h2_open(NULL, NULL, 0, 0);
    sp_h2_reader r;
    sp_h2_reader_init(&r);
    sp_h2buf blk = {0}, b = {0};
    sp_h2_grpc_request_block(&blk, EPATH("Unary"));
    if (variant == 0) {
      /* 20 KiB in twenty entries */
      char v[1024];
      memset(v, 'a', sizeof v);
      for (int i = 0; i < 20; i++) {
        char k[16];
        snprintf(k, sizeof k, "x-pad-%02d", i);
        sp_h2_hpack_lit(&blk, k, v, sizeof v);
      }
    } else if (variant == 1) {
      /* one 20 KiB -bin value (base64 of 15 KiB) */
      static char v[20480];
      for (size_t i = 0; i < sizeof v; i++) v[i] = "AQID"[i % 4];
      sp_h2_hpack_lit(&blk, "x-big-bin", v, sizeof v);
    } else {
      /* one 100 KiB value: beyond what nghttp2 decodes at all */
      char *v = malloc(100u << 10);
      assert_non_null(v);
      memset(v, 'b', 100u << 10);
      sp_h2_hpack_lit(&blk, "x-huge", v, 100u << 10);
      free(v);
    }
    sp_h2_headers(&b, 1, &blk, false, 0); /* HEADERS + CONTINUATIONs */
    EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
    req.text = "big headers";
    uint8_t msg[64];
    size_t n = shardplane__testing__echo_request__pack(&req, msg);
    sp_h2_grpc_message(&b, 1, msg, n, true);
    send_buf(fd, &b); /* the server may hang up before taking it all */
    int rc = pump(fd, &r, until_stream_done, 1, IO_TIMEOUT_MS);
    const sp_h2_stream *s = sp_h2_reader_stream(&r, 1);
    if (rc == PUMP_DONE && s->grpc_status >= 0) {
      assert_int_equal(s->grpc_status, SP_RPC_RESOURCE_EXHAUSTED);
      expect_unary_ok(fd, &r, 3); /* a stream-level answer */
    } else {
      /* refused at the HTTP/2 level: a reset stream, a GOAWAY or a closed
       * connection, never a hang */
      assert_true((s != NULL && s->reset) || r.goaway || rc == PUMP_CLOSED);
    }
    print_message("metadata variant %d: %s\n", variant,
                  rc == PUMP_DONE && s->grpc_status >= 0 ? "RESOURCE_EXHAUSTED"
                  : r.goaway                             ? "GOAWAY"
                  : rc == PUMP_DONE                      ? "RST_STREAM"
                                                         : "closed");
    sp_h2buf_free(&blk);
    sp_h2buf_free(&b);
    sp_h2_reader_free(&r);
    close(fd);
  }
  expect_server_healthy();
}

/* Requests that are HTTP/2 but not gRPC get an HTTP error status. */
static void test_not_grpc(void **state) {
  (void)state;
  int fd = h2_open(NULL, NULL, 0, 0);
  sp_h2_reader r;
  sp_h2_reader_init(&r);
  static const struct {
    const char *method, *ctype;
    int http, grpc;
  } cases[] = {
      {"GET", "application/grpc", 405, SP_RPC_UNIMPLEMENTED},
      {"PUT", "application/grpc", 405, SP_RPC_UNIMPLEMENTED},
      {"POST", "text/plain", 415, SP_RPC_INTERNAL},
      {"POST", "application/grpcx", 415, SP_RPC_INTERNAL},
      {"POST", NULL, 415, SP_RPC_INTERNAL},
      {"POST", "application/grpc+proto", 200, SP_RPC_OK},
  };
  uint32_t sid = 1;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++, sid += 2) {
    sp_h2buf blk = {0}, b = {0};
    sp_h2_hpack_lit(&blk, ":method", cases[i].method, strlen(cases[i].method));
    sp_h2_hpack_lit(&blk, ":scheme", "http", 4);
    sp_h2_hpack_lit(&blk, ":path", EPATH("Unary"), strlen(EPATH("Unary")));
    sp_h2_hpack_lit(&blk, ":authority", "localhost", 9);
    sp_h2_hpack_lit(&blk, "te", "trailers", 8);
    if (cases[i].ctype != NULL)
      sp_h2_hpack_lit(&blk, "content-type", cases[i].ctype,
                      strlen(cases[i].ctype));
    sp_h2_headers(&b, sid, &blk, false, 0);
    EchoRequest req = SHARDPLANE__TESTING__ECHO_REQUEST__INIT;
    req.text = "hello";
    uint8_t msg[64];
    size_t n = shardplane__testing__echo_request__pack(&req, msg);
    sp_h2_grpc_message(&b, sid, msg, n, true);
    const sp_h2_stream *s = exchange(fd, &r, &b, sid);
    assert_int_equal(s->http_status, cases[i].http);
    assert_int_equal(s->grpc_status, cases[i].grpc);
    sp_h2buf_free(&blk);
    sp_h2buf_free(&b);
  }
  expect_unary_ok(fd, &r, sid);
  sp_h2_reader_free(&r);
  close(fd);
  expect_server_healthy();
}

/* Replaces the shared server with one started with opts (NULL: defaults). */
static void restart_server(const sp_rpc_server_opts *opts) {
  sp_test_server_stop(&g.ts, 2000);
  sp_test_server_start(&g.ts, opts);
  g.port = g.ts.port;
  g.addr = g.ts.addr;
}

/* A server without HPACK dynamic tables (the coordinator's setting) says
 * so in its SETTINGS. The first header block a client sends after its ACK
 * must open with a table size update (RFC 7541 §4.2): one that does not is
 * a compression error, and blocks that do (every block h2_raw sends) are
 * served. */
static void test_no_header_tables(void **state) {
  (void)state;
  sp_rpc_server_opts o = {.no_header_tables = true};
  restart_server(&o);

  int fd = h2_open(NULL, NULL, 0, 0);
  sp_h2_reader r;
  sp_h2_reader_init(&r);
  assert_int_equal(pump(fd, &r, until_settings, 1, IO_TIMEOUT_MS), PUMP_DONE);
  assert_int_equal(r.header_table_size, 0); /* and pump has ACKed it */
  sp_h2buf blk = {0}, b = {0};
  sp_h2_grpc_request_block(&blk, EPATH("Unary"));
  sp_h2_frame(&b, NGHTTP2_HEADERS,
              NGHTTP2_FLAG_END_HEADERS | NGHTTP2_FLAG_END_STREAM, 1, blk.p,
              blk.len); /* the block alone, without the size update */
  sp_h2buf_free(&blk);
  assert_true(send_buf(fd, &b));
  sp_h2buf_free(&b);
  pump(fd, &r, until_goaway, 0, IO_TIMEOUT_MS);
  assert_true(r.goaway);
  assert_int_equal(r.goaway_code, NGHTTP2_COMPRESSION_ERROR);
  sp_h2_reader_free(&r);
  close(fd);

  fd = h2_open(NULL, NULL, 0, 0);
  sp_h2_reader_init(&r);
  assert_int_equal(pump(fd, &r, until_settings, 1, IO_TIMEOUT_MS), PUMP_DONE);
  for (uint32_t sid = 1; sid <= 5; sid += 2) expect_unary_ok(fd, &r, sid);
  sp_h2_reader_free(&r);
  close(fd);
  expect_server_healthy(); /* our own client complies too */

  restart_server(NULL);
}

int main(void) {
  /* a hang anywhere (even outside a timed wait) fails instead of waiting
   * for ctest's timeout */
  alarm(WATCHDOG_S);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_garbage_bytes),
      cmocka_unit_test(test_http1_request),
      cmocka_unit_test(test_connect_and_close),
      cmocka_unit_test(test_truncated_frames),
      cmocka_unit_test(test_prefix_4gib),
      cmocka_unit_test(test_prefix_3mib_then_eos),
      cmocka_unit_test(test_rapid_reset),
      cmocka_unit_test(test_client_never_reads),
      cmocka_unit_test(test_client_never_reads_many_streams),
      cmocka_unit_test(test_metadata_over_limit),
      cmocka_unit_test(test_not_grpc),
      cmocka_unit_test(test_no_header_tables),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
