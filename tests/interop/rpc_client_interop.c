/* The engine's client (async sp_rpc_client_* on a uv loop, and the blocking
 * sp_rpc_sync_* wrapper) against a grpcio server (tests/interop/
 * grpcio_server.py), i.e. a peer nobody here wrote.
 *
 *   rpc_client_interop HOST:PORT
 *
 * Prints one line per case and "rpc_client_interop: N passed, M failed";
 * exits 0 only when every case passed. Run by run_rpc_client_interop.py. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "echo.pb-c.h"
#include "rpc/rpc.h"

typedef Shardplane__Testing__EchoRequest sp_ix_req;
typedef Shardplane__Testing__EchoReply sp_ix_reply;
#define SP_IX_REQ_INIT SHARDPLANE__TESTING__ECHO_REQUEST__INIT
#define SP_IX_REPLY_DESC (&shardplane__testing__echo_reply__descriptor)

#define P_UNARY "/shardplane.testing.Echo/Unary"
#define P_SSTREAM "/shardplane.testing.Echo/ServerStream"
#define P_CSTREAM "/shardplane.testing.Echo/ClientStream"
#define P_BIDI "/shardplane.testing.Echo/Bidi"
#define SP_IX_WAIT_MS 10000 /* bound on every wait */

static const char *g_addr;
/* --tls-ca and the rest: every client of the run uses them (NULL: h2c). */
static sp_rpc_tls_client_opts g_tls_opts;
static const sp_rpc_tls_client_opts *g_tls;
static char g_why[1024];

/* Records why a case failed; the case returns false right after. */
static bool sp_ix_failf(int line, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static bool sp_ix_failf(int line, const char *fmt, ...) {
  int n = snprintf(g_why, sizeof g_why, "line %d: ", line);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_why + n, sizeof g_why - (size_t)n, fmt, ap);
  va_end(ap);
  return false;
}

#define CHECK(cond, ...)                                    \
  do {                                                      \
    if (!(cond)) return sp_ix_failf(__LINE__, __VA_ARGS__); \
  } while (0)
/* In a case with cleanup: record, then jump to its out: label. */
#define EXPECT(cond, ...)                 \
  do {                                    \
    if (!(cond)) {                        \
      sp_ix_failf(__LINE__, __VA_ARGS__); \
      goto out;                           \
    }                                     \
  } while (0)
#define EXPECT_CODE(st, want)                                   \
  EXPECT((st).code == (want), "status %s (%d) \"%s\", want %s", \
         sp_rpc_code_name((st).code), (st).code, (st).message,  \
         sp_rpc_code_name(want))
#define CHECK_CODE(st, want)                                   \
  CHECK((st).code == (want), "status %s (%d) \"%s\", want %s", \
        sp_rpc_code_name((st).code), (st).code, (st).message,  \
        sp_rpc_code_name(want))

static uint64_t sp_ix_now_ms(void) { return uv_hrtime() / 1000000u; }

static void sp_ix_sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Status messages with non-ASCII, '%' and control characters: the server
 * percent-encodes them, the engine must decode them exactly. */
static const char *const k_messages[] = {
    "plain message",
    "100% done, %41 is not A, %zz, trailing %",
    "na\xc3\xafve caf\xc3\xa9 \xe2\x98\x83 \xe6\x97\xa5\xe6\x9c\xac "
    "\xf0\x9f\x9a\x80",
    "tab\there newline\nthere",
};
#define N_MESSAGES (sizeof k_messages / sizeof k_messages[0])

static const uint8_t k_bin[] = {0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff,
                                0xc3, 0xa9, 0xe2, 0x98, 0x83, 0x00};

/* ------------------------------------------------------------------ */
/* async fixture: a loop, a client, calls that collect their replies    */
/* ------------------------------------------------------------------ */

typedef struct sp_ix {
  uv_loop_t loop;
  sp_rpc_client *cl;
  bool closed;
} sp_ix;

typedef struct sp_ix_call {
  sp_ix *ix;
  sp_rpc_ccall *call;
  bool done;
  sp_rpc_status st;
  sp_ix_reply *replies[600];
  size_t n, n_bad;
  /* metadata captured in on_close (headers and trailers) */
  uint8_t md_echo[64], md_bin[64], md_trailer[16];
  long md_echo_len, md_bin_len, md_trailer_len;
  /* bidi lock-step: send the next request from on_message */
  int lockstep_left;
  size_t sent_before_reply[600];
  size_t sent;
  /* cancel after this many replies (0: never) */
  size_t cancel_after;
  uint64_t t_start, t_end;
  bool orphan; /* freed by on_close */
} sp_ix_call;

static void sp_ix_closed(void *arg) { ((sp_ix *)arg)->closed = true; }

static void sp_ix_guard_fired(uv_timer_t *t) { *(bool *)t->data = true; }

/* Runs the loop until *flag or timeout; returns *flag. */
static bool sp_ix_run_until(uv_loop_t *loop, const bool *flag,
                            uint64_t timeout_ms) {
  bool expired = false;
  uv_timer_t guard;
  uv_timer_init(loop, &guard);
  guard.data = &expired;
  uv_timer_start(&guard, sp_ix_guard_fired, timeout_ms, 0);
  while (!*flag && !expired) uv_run(loop, UV_RUN_ONCE);
  uv_close((uv_handle_t *)&guard, NULL);
  uv_run(loop, UV_RUN_NOWAIT);
  return *flag;
}

static bool sp_ix_open(sp_ix *ix, size_t max_message) {
  memset(ix, 0, sizeof *ix);
  CHECK(uv_loop_init(&ix->loop) == 0, "uv_loop_init");
  sp_rpc_client_opts o = {
      .connect_timeout_ms = 5000, .max_message = max_message, .tls = g_tls};
  int rc = sp_rpc_client_open(&ix->loop, g_addr, &o, &ix->cl);
  CHECK(rc == 0, "sp_rpc_client_open: %s", sp_strerror(rc));
  return true;
}

/* Closes the client and checks that the loop is left with no handles. */
static bool sp_ix_close(sp_ix *ix) {
  sp_rpc_client_close(ix->cl, sp_ix_closed, ix);
  bool ok = sp_ix_run_until(&ix->loop, &ix->closed, SP_IX_WAIT_MS);
  uv_run(&ix->loop, UV_RUN_NOWAIT);
  int rc = uv_loop_close(&ix->loop);
  CHECK(ok, "client close did not complete");
  CHECK(rc == 0, "handles left on the loop after close: %s", uv_strerror(rc));
  return true;
}

static void sp_ix_call_release(sp_ix_call *c) {
  for (size_t i = 0; i < c->n; i++)
    if (c->replies[i])
      shardplane__testing__echo_reply__free_unpacked(c->replies[i], NULL);
  free(c);
}

/* Frees a finished call; one still open is cancelled and freed by its
 * on_close (so a failed case never leaves the engine a dangling user). */
static void sp_ix_call_free(sp_ix_call *c) {
  if (c == NULL) return;
  if (!c->done) {
    c->orphan = true;
    sp_rpc_ccall_cancel(c->call);
    return;
  }
  sp_ix_call_release(c);
}

static void sp_ix_copy_md(const sp_rpc_ccall *call, const char *key,
                          uint8_t *dst, size_t cap, long *len) {
  size_t l;
  const uint8_t *v = sp_rpc_ccall_metadata(call, key, &l);
  *len = -1;
  if (v == NULL || l > cap) return;
  memcpy(dst, v, l);
  *len = (long)l;
}

static void on_ix_message(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                          void *user) {
  sp_ix_call *c = user;
  sp_ix_reply *r = shardplane__testing__echo_reply__unpack(NULL, len, data);
  if (r == NULL || c->n >= sizeof c->replies / sizeof c->replies[0]) {
    if (r) shardplane__testing__echo_reply__free_unpacked(r, NULL);
    c->n_bad++;
    return;
  }
  c->sent_before_reply[c->n] = c->sent;
  c->replies[c->n++] = r;
  if (c->cancel_after && c->n == c->cancel_after) {
    sp_rpc_ccall_cancel(call);
    return;
  }
  if (c->lockstep_left > 0) {
    char text[32];
    snprintf(text, sizeof text, "m%zu", c->sent);
    sp_ix_req q = SP_IX_REQ_INIT;
    q.text = text;
    if (sp_rpc_ccall_send_msg(call, &q.base) == 0) c->sent++;
    c->lockstep_left--;
  } else if (c->lockstep_left == 0) {
    sp_rpc_ccall_close_send(call);
    c->lockstep_left = -1;
  }
}

static void on_ix_close(sp_rpc_ccall *call, const sp_rpc_status *st,
                        void *user) {
  sp_ix_call *c = user;
  if (c->orphan) {
    sp_ix_call_release(c);
    return;
  }
  c->st = *st;
  c->done = true;
  c->t_end = sp_ix_now_ms();
  sp_ix_copy_md(call, "x-echo", c->md_echo, sizeof c->md_echo, &c->md_echo_len);
  sp_ix_copy_md(call, "x-echo-bin", c->md_bin, sizeof c->md_bin,
                &c->md_bin_len);
  sp_ix_copy_md(call, "x-trailer", c->md_trailer, sizeof c->md_trailer,
                &c->md_trailer_len);
  c->call = NULL;
}

static const sp_rpc_ccall_cbs k_ix_cbs = {on_ix_message, on_ix_close};

/* Starts a call; lockstep_left is -2 (not lock-step) by default. */
static sp_ix_call *sp_ix_start(sp_ix *ix, const char *path, const sp_rpc_md *md,
                               size_t n_md, uint64_t timeout_ms) {
  sp_ix_call *c = calloc(1, sizeof *c);
  if (c == NULL) return NULL;
  c->ix = ix;
  c->lockstep_left = -2;
  c->md_echo_len = c->md_bin_len = c->md_trailer_len = -1;
  c->t_start = sp_ix_now_ms();
  if (sp_rpc_client_start(ix->cl, path, md, n_md, timeout_ms, &k_ix_cbs, c,
                          &c->call) != 0) {
    free(c);
    return NULL;
  }
  return c;
}

/* Starts a call with one request and half-closes. */
static sp_ix_call *sp_ix_unary(sp_ix *ix, const char *path, const sp_ix_req *q,
                               const sp_rpc_md *md, size_t n_md,
                               uint64_t timeout_ms) {
  sp_ix_call *c = sp_ix_start(ix, path, md, n_md, timeout_ms);
  if (c == NULL) return NULL;
  if (sp_rpc_ccall_send_msg(c->call, &q->base) != 0 ||
      sp_rpc_ccall_close_send(c->call) != 0)
    sp_rpc_ccall_cancel(c->call);
  return c;
}

static bool sp_ix_wait(sp_ix *ix, sp_ix_call *c) {
  CHECK(c != NULL, "call did not start");
  CHECK(sp_ix_run_until(&ix->loop, &c->done, SP_IX_WAIT_MS),
        "call did not end within %d ms", SP_IX_WAIT_MS);
  return true;
}

/* ------------------------------------------------------------------ */
/* server-side counters through __stats__ (blocking API)               */
/* ------------------------------------------------------------------ */

static bool sp_ix_stats(unsigned *cancelled, unsigned *active) {
  sp_rpc_sync *s;
  sp_rpc_client_opts o = {.connect_timeout_ms = 5000, .tls = g_tls};
  CHECK(sp_rpc_sync_open_opts(g_addr, &o, &s) == 0, "sp_rpc_sync_open");
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "__stats__";
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  int rc = sp_rpc_sync_unary(s, P_UNARY, &q.base, SP_IX_REPLY_DESC, 5000, &resp,
                             &st);
  sp_rpc_sync_close(s);
  CHECK(rc == 0 && st.code == SP_RPC_OK && resp != NULL,
        "__stats__: rc %d status %d %s", rc, st.code, st.message);
  int n = sscanf(((sp_ix_reply *)resp)->text, "cancelled=%u active=%u",
                 cancelled, active);
  protobuf_c_message_free_unpacked(resp, NULL);
  CHECK(n == 2, "__stats__ reply unparsable");
  return true;
}

/* Polls until cancelled >= want_cancelled and active == want_active. */
static bool sp_ix_wait_stats(unsigned want_cancelled, unsigned want_active) {
  unsigned c = 0, a = 0;
  uint64_t end = sp_ix_now_ms() + 5000;
  for (;;) {
    if (!sp_ix_stats(&c, &a)) return false;
    if (c >= want_cancelled && a == want_active) return true;
    if (sp_ix_now_ms() > end) break;
    sp_ix_sleep_ms(20);
  }
  return sp_ix_failf(__LINE__,
                     "server stats cancelled=%u active=%u, want "
                     "cancelled>=%u active=%u",
                     c, a, want_cancelled, want_active);
}

/* ------------------------------------------------------------------ */
/* async cases                                                         */
/* ------------------------------------------------------------------ */

static bool case_async_unary(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  uint8_t payload[300];
  for (size_t i = 0; i < sizeof payload; i++) payload[i] = (uint8_t)i;
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "hello \xe2\x98\x83";
  q.payload.data = payload;
  q.payload.len = sizeof payload;
  sp_rpc_md md[] = {{"x-echo", (const uint8_t *)"hi there, 100%", 14},
                    {"x-echo-bin", k_bin, sizeof k_bin}};
  sp_ix_call *c = sp_ix_unary(&ix, P_UNARY, &q, md, 2, 5000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 1 && c->n_bad == 0, "%zu replies (%zu bad)", c->n, c->n_bad);
  EXPECT(strcmp(c->replies[0]->text, q.text) == 0, "text \"%s\"",
         c->replies[0]->text);
  EXPECT(c->replies[0]->payload.len == sizeof payload &&
             memcmp(c->replies[0]->payload.data, payload, sizeof payload) == 0,
         "payload differs");
  EXPECT(c->md_echo_len == 14 && memcmp(c->md_echo, "hi there, 100%", 14) == 0,
         "x-echo header (len %ld)", c->md_echo_len);
  EXPECT(c->md_bin_len == (long)sizeof k_bin &&
             memcmp(c->md_bin, k_bin, sizeof k_bin) == 0,
         "x-echo-bin header (len %ld)", c->md_bin_len);
  EXPECT(c->md_trailer_len == 4 && memcmp(c->md_trailer, "done", 4) == 0,
         "x-trailer trailer (len %ld)", c->md_trailer_len);
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

/* The server reports what it received as request metadata. */
static bool case_async_request_metadata(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "__md__";
  sp_rpc_md md[] = {{"x-echo", (const uint8_t *)"v a l u e", 9},
                    {"x-echo-bin", k_bin, sizeof k_bin}};
  sp_ix_call *c = sp_ix_unary(&ix, P_UNARY, &q, md, 2, 5000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 1, "%zu replies", c->n);
  EXPECT(strcmp(c->replies[0]->text, "v a l u e") == 0,
         "server saw x-echo \"%s\"", c->replies[0]->text);
  EXPECT(c->replies[0]->payload.len == sizeof k_bin &&
             memcmp(c->replies[0]->payload.data, k_bin, sizeof k_bin) == 0,
         "server saw x-echo-bin of %zu bytes", c->replies[0]->payload.len);
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

static bool case_async_server_stream(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  uint8_t payload[100];
  memset(payload, 'p', sizeof payload);
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "s";
  q.payload.data = payload;
  q.payload.len = sizeof payload;
  q.repeat = 500;
  sp_ix_call *c = sp_ix_unary(&ix, P_SSTREAM, &q, NULL, 0, 10000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 500 && c->n_bad == 0, "%zu replies", c->n);
  for (size_t i = 0; i < c->n; i++)
    EXPECT(c->replies[i]->index == i && strcmp(c->replies[i]->text, "s") == 0 &&
               c->replies[i]->payload.len == sizeof payload,
           "reply %zu: index %u", i, c->replies[i]->index);
  EXPECT(c->md_trailer_len == 4, "x-trailer missing");
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

/* 40 x 256 KiB: more than the client's HTTP/2 windows. */
static bool case_async_server_stream_large(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  sp_ix_call *c = NULL;
  size_t plen = 256u << 10;
  uint8_t *payload = malloc(plen);
  EXPECT(payload != NULL, "malloc");
  for (size_t i = 0; i < plen; i++) payload[i] = (uint8_t)(i * 7);
  sp_ix_req q = SP_IX_REQ_INIT;
  q.payload.data = payload;
  q.payload.len = plen;
  q.repeat = 40;
  c = sp_ix_unary(&ix, P_SSTREAM, &q, NULL, 0, 10000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 40 && c->n_bad == 0, "%zu replies", c->n);
  for (size_t i = 0; i < c->n; i++)
    EXPECT(c->replies[i]->index == i && c->replies[i]->payload.len == plen &&
               memcmp(c->replies[i]->payload.data, payload, plen) == 0,
           "reply %zu differs", i);
  ok = true;
out:
  free(payload);
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

static bool case_async_client_stream(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  sp_ix_call *c = sp_ix_start(&ix, P_CSTREAM, NULL, 0, 5000);
  char want[512] = "";
  EXPECT(c != NULL, "start");
  for (int i = 0; i < 50; i++) {
    char t[16];
    snprintf(t, sizeof t, "%d,", i);
    strcat(want, t);
    sp_ix_req q = SP_IX_REQ_INIT;
    q.text = t;
    int rc = sp_rpc_ccall_send_msg(c->call, &q.base);
    EXPECT(rc == 0, "send %d: %s", i, sp_strerror(rc));
  }
  EXPECT(sp_rpc_ccall_close_send(c->call) == 0, "close_send");
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 1, "%zu replies", c->n);
  EXPECT(strcmp(c->replies[0]->text, want) == 0, "text \"%s\"",
         c->replies[0]->text);
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

/* Send one, read one: the next request goes out only from on_message, so
 * a peer that waited for the half-close would stall the call. */
static bool case_async_bidi_lockstep(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  sp_ix_call *c = sp_ix_start(&ix, P_BIDI, NULL, 0, 5000);
  EXPECT(c != NULL, "start");
  c->lockstep_left = 19;
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "m0";
  EXPECT(sp_rpc_ccall_send_msg(c->call, &q.base) == 0, "first send");
  c->sent = 1;
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 20, "%zu replies", c->n);
  for (size_t i = 0; i < c->n; i++) {
    char t[32];
    snprintf(t, sizeof t, "m%zu", i);
    EXPECT(strcmp(c->replies[i]->text, t) == 0 && c->replies[i]->index == i,
           "reply %zu is \"%s\"/%u", i, c->replies[i]->text,
           c->replies[i]->index);
    EXPECT(c->sent_before_reply[i] == i + 1,
           "reply %zu arrived after %zu requests", i, c->sent_before_reply[i]);
  }
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

static bool case_async_deadline(void) {
  unsigned c0, a0;
  if (!sp_ix_stats(&c0, &a0)) return false;
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "slow";
  q.delay_ms = 3000;
  sp_ix_call *c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 300);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_DEADLINE_EXCEEDED);
  /* the client's timer or grpcio's ("Deadline Exceeded") may end it */
  EXPECT(strcasecmp(c->st.message, "deadline exceeded") == 0, "message \"%s\"",
         c->st.message);
  uint64_t took = c->t_end - c->t_start;
  EXPECT(took >= 250 && took < 1500, "ended after %llu ms",
         (unsigned long long)took);
  EXPECT(c->n == 0, "%zu replies", c->n);
  ok = true;
out:
  sp_ix_call_free(c);
  /* the grpcio handler saw its call end */
  return sp_ix_close(&ix) && ok && sp_ix_wait_stats(c0 + 1, 0);
}

static bool sp_ix_expect_error(sp_ix *ix, const char *path, int code,
                               const char *msg, bool one_ok_first) {
  bool ok = false;
  sp_ix_call *c = sp_ix_start(ix, path, NULL, 0, 5000);
  EXPECT(c != NULL, "start");
  if (one_ok_first) {
    sp_ix_req q0 = SP_IX_REQ_INIT;
    q0.text = "first";
    EXPECT(sp_rpc_ccall_send_msg(c->call, &q0.base) == 0, "send");
  }
  sp_ix_req q = SP_IX_REQ_INIT;
  q.fail_code = code;
  q.fail_message = (char *)msg;
  EXPECT(sp_rpc_ccall_send_msg(c->call, &q.base) == 0, "send");
  EXPECT(sp_rpc_ccall_close_send(c->call) == 0, "close_send");
  if (!sp_ix_wait(ix, c)) goto out;
  EXPECT(c->st.code == code && strcmp(c->st.message, msg) == 0,
         "%s: status %d \"%s\", want %d \"%s\"", path, c->st.code,
         c->st.message, code, msg);
  /* only Bidi answers the first request before the failing one */
  size_t want = one_ok_first && strcmp(path, P_BIDI) == 0 ? 1 : 0;
  EXPECT(c->n == want, "%s: %zu replies, want %zu", path, c->n, want);
  ok = true;
out:
  sp_ix_call_free(c);
  return ok;
}

static bool case_async_status_error(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = true;
  for (size_t i = 0; ok && i < N_MESSAGES; i++)
    ok = sp_ix_expect_error(&ix, P_UNARY, SP_RPC_FAILED_PRECONDITION,
                            k_messages[i], false);
  /* Trailers-Only from a server stream; trailers after data from bidi */
  ok = ok &&
       sp_ix_expect_error(&ix, P_SSTREAM, SP_RPC_ABORTED, k_messages[2], false);
  ok = ok && sp_ix_expect_error(&ix, P_BIDI, SP_RPC_OUT_OF_RANGE, k_messages[1],
                                true);
  ok = ok && sp_ix_expect_error(&ix, P_CSTREAM, SP_RPC_DATA_LOSS, k_messages[3],
                                true);
  ok =
      ok && sp_ix_expect_error(&ix, P_UNARY, SP_RPC_UNAUTHENTICATED, "", false);
  return sp_ix_close(&ix) && ok;
}

static bool case_async_unknown_method(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  static const char *const paths[] = {"/shardplane.testing.Echo/Nope",
                                      "/no.such.Service/Unary"};
  bool ok = false;
  sp_ix_call *c = NULL;
  for (size_t i = 0; i < 2; i++) {
    sp_ix_req q = SP_IX_REQ_INIT;
    c = sp_ix_unary(&ix, paths[i], &q, NULL, 0, 5000);
    if (!sp_ix_wait(&ix, c)) goto out;
    EXPECT(c->st.code == SP_RPC_UNIMPLEMENTED, "%s: status %s \"%s\"", paths[i],
           sp_rpc_code_name(c->st.code), c->st.message);
    /* grpcio 1.51 answers "Method not found!" */
    EXPECT(c->st.message[0] != '\0', "%s: no grpc-message", paths[i]);
    sp_ix_call_free(c);
    c = NULL;
  }
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

static void on_cancel_timer(uv_timer_t *t) {
  sp_ix_call *c = t->data;
  if (c->call) sp_rpc_ccall_cancel(c->call);
}

static bool case_async_cancel(void) {
  unsigned c0, a0;
  if (!sp_ix_stats(&c0, &a0)) return false;
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  sp_ix_call *s = NULL;
  /* a delayed unary, cancelled once the handler is waiting */
  sp_ix_req q = SP_IX_REQ_INIT;
  q.delay_ms = 5000;
  sp_ix_call *c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 10000);
  EXPECT(c != NULL, "start");
  uv_timer_t t;
  uv_timer_init(&ix.loop, &t);
  t.data = c;
  uv_timer_start(&t, on_cancel_timer, 300, 0);
  bool done = sp_ix_wait(&ix, c);
  uv_close((uv_handle_t *)&t, NULL);
  if (!done) goto out;
  EXPECT_CODE(c->st, SP_RPC_CANCELLED);
  EXPECT(strcmp(c->st.message, "cancelled by the client") == 0,
         "message \"%s\"", c->st.message);
  EXPECT(c->t_end - c->t_start < 2000, "cancel took %llu ms",
         (unsigned long long)(c->t_end - c->t_start));
  EXPECT(c->n == 0, "%zu replies", c->n);
  /* a long server stream, cancelled from on_message after 10 replies */
  static uint8_t kib[1024];
  sp_ix_req r = SP_IX_REQ_INIT;
  r.repeat = 1000000;
  r.payload.data = kib;
  r.payload.len = sizeof kib;
  s = sp_ix_start(&ix, P_SSTREAM, NULL, 0, 10000);
  EXPECT(s != NULL, "start");
  s->cancel_after = 10;
  EXPECT(sp_rpc_ccall_send_msg(s->call, &r.base) == 0, "send");
  EXPECT(sp_rpc_ccall_close_send(s->call) == 0, "close_send");
  if (!sp_ix_wait(&ix, s)) goto out;
  EXPECT(s->st.code == SP_RPC_CANCELLED && s->n == 10,
         "stream: status %s, %zu replies (want 10)",
         sp_rpc_code_name(s->st.code), s->n);
  ok = true;
out:
  sp_ix_call_free(c);
  sp_ix_call_free(s);
  return sp_ix_close(&ix) && ok && sp_ix_wait_stats(c0 + 2, 0);
}

/* Closing the client ends its open calls with CANCELLED. */
static bool case_async_client_close(void) {
  unsigned c0, a0;
  if (!sp_ix_stats(&c0, &a0)) return false;
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  sp_ix_req q = SP_IX_REQ_INIT;
  q.delay_ms = 5000;
  sp_ix_call *c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 10000);
  /* wait until the grpcio handler runs, then close under it */
  uint64_t end = sp_ix_now_ms() + 5000;
  unsigned cn = 0, an = 0;
  while (c != NULL && sp_ix_now_ms() < end && sp_ix_stats(&cn, &an) &&
         an == 0) {
    uv_run(&ix.loop, UV_RUN_NOWAIT);
    sp_ix_sleep_ms(10);
  }
  bool started = an == 1;
  bool closed_ok = sp_ix_close(&ix);
  bool ok = false;
  EXPECT(c != NULL, "start");
  EXPECT(started, "the handler never started (active=%u)", an);
  EXPECT(c->done, "on_close did not run on client close");
  EXPECT_CODE(c->st, SP_RPC_CANCELLED);
  EXPECT(strcmp(c->st.message, "client closed") == 0, "message \"%s\"",
         c->st.message);
  ok = true;
out:
  if (c != NULL && c->done) sp_ix_call_release(c);
  return closed_ok && ok && sp_ix_wait_stats(c0 + 1, 0);
}

static bool case_async_concurrent(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  enum { N = 150 };
  sp_ix_call *calls[N];
  char texts[N][16];
  bool ok = false;
  for (int i = 0; i < N; i++) {
    snprintf(texts[i], sizeof texts[i], "c%d", i);
    sp_ix_req q = SP_IX_REQ_INIT;
    q.text = texts[i];
    q.delay_ms = (uint32_t)(i % 3) * 20;
    calls[i] = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 10000);
  }
  for (int i = 0; i < N; i++) {
    if (!sp_ix_wait(&ix, calls[i])) goto out;
    EXPECT(calls[i]->st.code == SP_RPC_OK && calls[i]->n == 1 &&
               strcmp(calls[i]->replies[0]->text, texts[i]) == 0,
           "call %d: status %d \"%s\", %zu replies", i, calls[i]->st.code,
           calls[i]->st.message, calls[i]->n);
  }
  ok = true;
out:
  for (int i = 0; i < N; i++) sp_ix_call_free(calls[i]);
  return sp_ix_close(&ix) && ok;
}

/* The grpcio server answers 5 MiB: over the client's 4 MiB limit. */
static bool case_async_response_too_big(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "__big__";
  q.repeat = 5u << 20;
  sp_ix_call *c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 10000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_RESOURCE_EXHAUSTED);
  EXPECT(strstr(c->st.message, "over the limit") != NULL, "message \"%s\"",
         c->st.message);
  EXPECT(c->n == 0, "%zu replies", c->n);
  sp_ix_call_free(c);
  /* the same client goes on working */
  q.repeat = 1u << 20;
  c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 10000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 1 && c->replies[0]->payload.len == (1u << 20),
         "1 MiB reply: %zu replies", c->n);
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

/* grpcio 1.51 compresses when the handler asks for gzip even though the
 * engine advertised no codec but identity (it sends no
 * grpc-accept-encoding): the engine must fail that
 * call cleanly (INTERNAL, with a message, no garbage delivered) and keep
 * the connection usable. */
static bool case_async_compressed_response(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 0)) return false;
  bool ok = false;
  static uint8_t pl[4096];
  memset(pl, 'a', sizeof pl);
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "__gzip__";
  q.payload.data = pl;
  q.payload.len = sizeof pl;
  sp_ix_call *c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 5000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_INTERNAL);
  EXPECT(c->st.message[0] != '\0', "no status message");
  EXPECT(c->n == 0 && c->n_bad == 0, "%zu replies, %zu undecodable", c->n,
         c->n_bad);
  sp_ix_call_free(c);
  q.text = "plain";
  c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 5000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 1 && c->replies[0]->payload.len == sizeof pl, "%zu replies",
         c->n);
  ok = true;
out:
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

/* A 5 MiB request (the client allows 8 MiB): grpcio rejects it. */
static bool case_async_request_too_big(void) {
  sp_ix ix;
  if (!sp_ix_open(&ix, 8u << 20)) return false;
  bool ok = false;
  sp_ix_call *c = NULL;
  size_t len = 5u << 20;
  uint8_t *p = calloc(1, len);
  EXPECT(p != NULL, "calloc");
  sp_ix_req q = SP_IX_REQ_INIT;
  q.payload.data = p;
  q.payload.len = len;
  c = sp_ix_unary(&ix, P_UNARY, &q, NULL, 0, 10000);
  free(p);
  p = NULL;
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_RESOURCE_EXHAUSTED);
  sp_ix_call_free(c);
  sp_ix_req q2 = SP_IX_REQ_INIT;
  q2.text = "after";
  c = sp_ix_unary(&ix, P_UNARY, &q2, NULL, 0, 10000);
  if (!sp_ix_wait(&ix, c)) goto out;
  EXPECT_CODE(c->st, SP_RPC_OK);
  EXPECT(c->n == 1 && strcmp(c->replies[0]->text, "after") == 0, "%zu replies",
         c->n);
  ok = true;
out:
  free(p);
  sp_ix_call_free(c);
  return sp_ix_close(&ix) && ok;
}

/* ------------------------------------------------------------------ */
/* blocking API                                                        */
/* ------------------------------------------------------------------ */

static bool sp_ix_sync_open(sp_rpc_sync **s) {
  sp_rpc_client_opts o = {.connect_timeout_ms = 5000, .tls = g_tls};
  int rc = sp_rpc_sync_open_opts(g_addr, &o, s);
  CHECK(rc == 0, "sp_rpc_sync_open: %s", sp_strerror(rc));
  return true;
}

static bool sync_unary_cases(sp_rpc_sync *s) {
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "sync \xc3\xa9";
  uint8_t pl[3] = {0, 0xff, 7};
  q.payload.data = pl;
  q.payload.len = 3;
  ProtobufCMessage *resp = NULL;
  sp_rpc_status st;
  int rc = sp_rpc_sync_unary(s, P_UNARY, &q.base, SP_IX_REPLY_DESC, 5000, &resp,
                             &st);
  CHECK(rc == 0, "rc %d", rc);
  CHECK_CODE(st, SP_RPC_OK);
  sp_ix_reply *r = (sp_ix_reply *)resp;
  bool same = r != NULL && strcmp(r->text, q.text) == 0 &&
              r->payload.len == 3 && memcmp(r->payload.data, pl, 3) == 0;
  if (resp) protobuf_c_message_free_unpacked(resp, NULL);
  CHECK(same, "reply differs");
  return true;
}

static bool case_sync_unary(void) {
  sp_rpc_sync *s;
  if (!sp_ix_sync_open(&s)) return false;
  /* several calls on one connection */
  bool ok = sync_unary_cases(s) && sync_unary_cases(s) && sync_unary_cases(s);
  sp_rpc_sync_close(s);
  return ok;
}

static bool sync_errors(sp_rpc_sync *s) {
  for (size_t i = 0; i < N_MESSAGES; i++) {
    sp_ix_req q = SP_IX_REQ_INIT;
    q.fail_code = SP_RPC_PERMISSION_DENIED;
    q.fail_message = (char *)k_messages[i];
    ProtobufCMessage *resp = NULL;
    sp_rpc_status st;
    int rc = sp_rpc_sync_unary(s, P_UNARY, &q.base, SP_IX_REPLY_DESC, 5000,
                               &resp, &st);
    CHECK(rc == 0 && resp == NULL, "rc %d", rc);
    CHECK_CODE(st, SP_RPC_PERMISSION_DENIED);
    CHECK(strcmp(st.message, k_messages[i]) == 0, "message \"%s\" want \"%s\"",
          st.message, k_messages[i]);
  }
  /* deadline */
  sp_ix_req q = SP_IX_REQ_INIT;
  q.delay_ms = 3000;
  sp_rpc_status st;
  uint64_t t0 = sp_ix_now_ms();
  int rc =
      sp_rpc_sync_unary(s, P_UNARY, &q.base, SP_IX_REPLY_DESC, 300, NULL, &st);
  uint64_t took = sp_ix_now_ms() - t0;
  CHECK(rc == 0, "rc %d", rc);
  CHECK_CODE(st, SP_RPC_DEADLINE_EXCEEDED);
  CHECK(strcasecmp(st.message, "deadline exceeded") == 0, "message \"%s\"",
        st.message);
  CHECK(took >= 250 && took < 1500, "deadline after %llu ms",
        (unsigned long long)took);
  /* unknown method */
  sp_ix_req e = SP_IX_REQ_INIT;
  rc = sp_rpc_sync_unary(s, "/shardplane.testing.Echo/Missing", &e.base,
                         SP_IX_REPLY_DESC, 5000, NULL, &st);
  CHECK(rc == 0, "rc %d", rc);
  CHECK_CODE(st, SP_RPC_UNIMPLEMENTED);
  /* the connection still serves */
  return sync_unary_cases(s);
}

static bool case_sync_errors(void) {
  sp_rpc_sync *s;
  if (!sp_ix_sync_open(&s)) return false;
  bool ok = sync_errors(s);
  sp_rpc_sync_close(s);
  return ok;
}

/* Receives until the end; *n replies whose index matched their position. */
static bool sync_drain(sp_rpc_sync_stream *st, size_t *n, const char *text,
                       sp_rpc_status *status) {
  *n = 0;
  for (;;) {
    ProtobufCMessage *m = NULL;
    int rc = sp_rpc_sync_stream_recv(st, SP_IX_REPLY_DESC, 5000, &m, status);
    if (rc == SP_ENOENT) return true;
    CHECK(rc == 0, "recv: %s", sp_strerror(rc));
    sp_ix_reply *r = (sp_ix_reply *)m;
    bool good = r->index == *n && (text == NULL || strcmp(r->text, text) == 0);
    protobuf_c_message_free_unpacked(m, NULL);
    CHECK(good, "reply %zu out of order or wrong", *n);
    (*n)++;
  }
}

static bool sync_streams(sp_rpc_sync *s) {
  sp_rpc_sync_stream *st;
  sp_rpc_status status;
  size_t n;
  /* server streaming */
  sp_ix_req q = SP_IX_REQ_INIT;
  q.text = "ss";
  q.repeat = 300;
  CHECK(sp_rpc_sync_stream_open(s, P_SSTREAM, 10000, NULL, 0, &st) == 0,
        "open");
  bool ok = sp_rpc_sync_stream_send(st, &q.base) == 0 &&
            sp_rpc_sync_stream_close_send(st) == 0 &&
            sync_drain(st, &n, "ss", &status);
  sp_rpc_sync_stream_close(st);
  if (!ok) return g_why[0] ? false : sp_ix_failf(__LINE__, "server stream");
  CHECK_CODE(status, SP_RPC_OK);
  CHECK(n == 300, "server stream: %zu replies", n);
  /* client streaming */
  CHECK(sp_rpc_sync_stream_open(s, P_CSTREAM, 10000, NULL, 0, &st) == 0,
        "open");
  static const char *const parts[] = {"a", "\xc3\xa9", "", "z"};
  ok = true;
  for (size_t i = 0; i < 4; i++) {
    sp_ix_req p = SP_IX_REQ_INIT;
    p.text = (char *)parts[i];
    ok = ok && sp_rpc_sync_stream_send(st, &p.base) == 0;
  }
  ok = ok && sp_rpc_sync_stream_close_send(st) == 0;
  ProtobufCMessage *m = NULL;
  int rc =
      ok ? sp_rpc_sync_stream_recv(st, SP_IX_REPLY_DESC, 5000, &m, NULL) : -1;
  bool text_ok = rc == 0 && strcmp(((sp_ix_reply *)m)->text, "a\xc3\xa9z") == 0;
  if (m) protobuf_c_message_free_unpacked(m, NULL);
  ok = ok && text_ok && sync_drain(st, &n, NULL, &status) && n == 0;
  sp_rpc_sync_stream_close(st);
  CHECK(ok, "client stream (rc %d)", rc);
  CHECK_CODE(status, SP_RPC_OK);
  /* bidi in lock-step */
  CHECK(sp_rpc_sync_stream_open(s, P_BIDI, 10000, NULL, 0, &st) == 0, "open");
  for (uint32_t i = 0; ok && i < 10; i++) {
    char t[16];
    snprintf(t, sizeof t, "b%u", i);
    sp_ix_req p = SP_IX_REQ_INIT;
    p.text = t;
    m = NULL;
    ok = sp_rpc_sync_stream_send(st, &p.base) == 0 &&
         sp_rpc_sync_stream_recv(st, SP_IX_REPLY_DESC, 5000, &m, NULL) == 0 &&
         strcmp(((sp_ix_reply *)m)->text, t) == 0 &&
         ((sp_ix_reply *)m)->index == i;
    if (m) protobuf_c_message_free_unpacked(m, NULL);
  }
  ok = ok && sp_rpc_sync_stream_close_send(st) == 0 &&
       sync_drain(st, &n, NULL, &status) && n == 0;
  sp_rpc_sync_stream_close(st);
  CHECK(ok, "bidi lock-step");
  CHECK_CODE(status, SP_RPC_OK);
  return true;
}

static bool case_sync_streams(void) {
  sp_rpc_sync *s;
  if (!sp_ix_sync_open(&s)) return false;
  bool ok = sync_streams(s);
  sp_rpc_sync_close(s);
  return ok;
}

/* Request metadata from a sync stream reaches the server. */
static bool case_sync_metadata(void) {
  sp_rpc_sync *s;
  if (!sp_ix_sync_open(&s)) return false;
  sp_rpc_md md[] = {{"x-echo", (const uint8_t *)"sync-md", 7},
                    {"x-echo-bin", k_bin, sizeof k_bin}};
  sp_rpc_sync_stream *st;
  sp_rpc_status status;
  ProtobufCMessage *m = NULL;
  int rc = sp_rpc_sync_stream_open(s, P_UNARY, 5000, md, 2, &st);
  if (rc == 0) {
    sp_ix_req q = SP_IX_REQ_INIT;
    q.text = "__md__";
    sp_rpc_sync_stream_send(st, &q.base);
    sp_rpc_sync_stream_close_send(st);
    rc = sp_rpc_sync_stream_recv(st, SP_IX_REPLY_DESC, 5000, &m, &status);
    sp_rpc_sync_stream_close(st);
  }
  sp_rpc_sync_close(s);
  sp_ix_reply *r = (sp_ix_reply *)m;
  bool good = rc == 0 && strcmp(r->text, "sync-md") == 0 &&
              r->payload.len == sizeof k_bin &&
              memcmp(r->payload.data, k_bin, sizeof k_bin) == 0;
  if (m) protobuf_c_message_free_unpacked(m, NULL);
  CHECK(good, "server did not see the metadata (rc %d)", rc);
  return true;
}

/* Freeing an open sync stream cancels it; recv times out meanwhile. */
static bool case_sync_cancel(void) {
  unsigned c0, a0;
  if (!sp_ix_stats(&c0, &a0)) return false;
  sp_rpc_sync *s;
  if (!sp_ix_sync_open(&s)) return false;
  sp_rpc_sync_stream *st;
  int rc = sp_rpc_sync_stream_open(s, P_SSTREAM, 10000, NULL, 0, &st);
  int rrc = -1;
  if (rc == 0) {
    sp_ix_req q = SP_IX_REQ_INIT;
    q.repeat = 3;
    q.delay_ms = 5000;
    sp_rpc_sync_stream_send(st, &q.base);
    sp_rpc_sync_stream_close_send(st);
    ProtobufCMessage *m = NULL;
    rrc = sp_rpc_sync_stream_recv(st, SP_IX_REPLY_DESC, 300, &m, NULL);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    sp_rpc_sync_stream_close(st);
  }
  sp_rpc_sync_close(s);
  CHECK(rc == 0, "open: %s", sp_strerror(rc));
  CHECK(rrc == SP_ETIMEDOUT, "recv: %d, want SP_ETIMEDOUT", rrc);
  return sp_ix_wait_stats(c0 + 1, 0);
}

typedef struct sp_ix_case {
  const char *name;
  bool (*fn)(void);
} sp_ix_case;

static const sp_ix_case k_cases[] = {
    {"async_unary_with_metadata", case_async_unary},
    {"async_request_metadata", case_async_request_metadata},
    {"async_server_stream", case_async_server_stream},
    {"async_server_stream_10MiB", case_async_server_stream_large},
    {"async_client_stream", case_async_client_stream},
    {"async_bidi_lockstep", case_async_bidi_lockstep},
    {"async_deadline", case_async_deadline},
    {"async_status_error_message", case_async_status_error},
    {"async_unknown_method", case_async_unknown_method},
    {"async_cancel", case_async_cancel},
    {"async_client_close_cancels", case_async_client_close},
    {"async_concurrent_150", case_async_concurrent},
    {"async_response_too_big", case_async_response_too_big},
    {"async_request_too_big", case_async_request_too_big},
    {"async_compressed_response", case_async_compressed_response},
    {"sync_unary", case_sync_unary},
    {"sync_errors_deadline_unimplemented", case_sync_errors},
    {"sync_streams", case_sync_streams},
    {"sync_request_metadata", case_sync_metadata},
    {"sync_cancel", case_sync_cancel},
};

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--tls-ca") == 0 && v)
      g_tls_opts.ca_file = v;
    else if (strcmp(argv[i], "--tls-cert") == 0 && v)
      g_tls_opts.cert_file = v;
    else if (strcmp(argv[i], "--tls-key") == 0 && v)
      g_tls_opts.key_file = v;
    else if (strcmp(argv[i], "--tls-server-name") == 0 && v)
      g_tls_opts.server_name = v;
    else if (argv[i][0] != '-' && g_addr == NULL) {
      g_addr = argv[i];
      continue;
    } else {
      g_addr = NULL;
      break;
    }
    i++;
  }
  if (g_addr == NULL) {
    fprintf(stderr,
            "usage: rpc_client_interop HOST:PORT [--tls-ca PEM "
            "[--tls-cert PEM --tls-key PEM] [--tls-server-name N]]\n");
    return 2;
  }
  if (g_tls_opts.ca_file != NULL) g_tls = &g_tls_opts;
  alarm(45); /* last resort: never hang (SIGALRM ends the process) */
  int passed = 0, failed = 0;
  for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++) {
    g_why[0] = '\0';
    uint64_t t0 = sp_ix_now_ms();
    bool ok = k_cases[i].fn();
    if (ok) {
      passed++;
      printf("PASS %s (%llu ms)\n", k_cases[i].name,
             (unsigned long long)(sp_ix_now_ms() - t0));
    } else {
      failed++;
      printf("FAIL %s: %s\n", k_cases[i].name, g_why);
    }
    fflush(stdout);
  }
  printf("rpc_client_interop: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
