/* gRPC server: connections, streams, method dispatch, deadlines,
 * backpressure, graceful shutdown. The wire rules it follows, and the
 * nghttp2 1.52 (old API) details it works around: docs/wire-protocol.md. */
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "rpc.h"
#include "h2conn.h"
#include "rpc_internal.h"
#include "rpc_mem.h"
#include "rpc_pbcheck.h"
#include "rpc_tls.h"
#include "rpc_wire.h"
#include "base/strmap.h"

typedef struct srv_conn srv_conn;

/* Its fields of 4 bytes and less are packed together at the end (the
 * flags as bits): a Session stream lives as long as its rank, and
 * scattered, they padded the struct from 400 bytes to 448. */
struct sp_rpc_call {
  srv_conn *conn;
  const sp_rpc_method *method;
  char *unknown_path; /* owned; NULL unless the path is unknown (route) */
  int64_t timeout_ms;
  sp_rpc_mdlist req_md;
  sp_rpc_deframer df;
  uint8_t *unary_req;
  size_t unary_len, unary_charged; /* charged: to srv->buffered */
  size_t unary_cap; /* the deframer's buffer of this size; 0: srv->mem's */
  /* response */
  sp_rpc_mdlist resp_md;
  char *status_msg;
  sp_rpc_outq q; /* q.bytes: what the call has queued */
  void (*on_writable)(sp_rpc_call *);
  uv_timer_t *timer;
  uint64_t deadline; /* uv_now() ms */
  /* On its connection's list of calls whose request timer is armed only
   * if the request is still incomplete once the read is parsed. */
  sp_rpc_call *arm_next;
  /* Requests waiting for the handler (see dispatch below), in order;
   * queued while on the ready list. */
  struct rq_item *rq_head, *rq_tail;
  sp_rpc_call *ready_next, *ready_prev;
  void *user;
  const sp_rpc_principal *principal; /* borrowed from the authorize hook */
  sp_rpc_call *next, *prev, *notify_next;
  int32_t stream_id;
  /* Request headers. The path is looked up as it arrives, so the call keeps
   * the method's index rather than a copy: a call lives as long as its
   * stream, and a 256-byte path buffer was nearly half of every open
   * stream's sp_rpc_call. Only a path no method has is copied, for the
   * error that names it. */
  int32_t route; /* index in srv->methods; -1: unknown, none, or counted */
  uint32_t n_requests;
  int status;
  /* When its request headers began, in microseconds since the server was
   * made (srv_us), 48 bits of them (8.9 years): split in two, they fill
   * the padding after the flags, where a uint64_t made the struct 8 bytes
   * longer. */
  uint32_t t0_lo;
  uint16_t t0_hi;
  bool is_post : 1, grpc_content_type : 1, bad_encoding : 1, md_overflow : 1;
  bool headers_sent : 1, finished : 1, released : 1, deferred : 1;
  bool remote_closed : 1;
  bool want_writable : 1, conn_blocked : 1, notify_queued : 1;
  /* The timer runs for the server's request timeout (the request must
   * complete first), not for the client's deadline. */
  bool timer_is_request : 1;
  bool arm_listed : 1; /* see arm_next */
  /* whether the half-close follows the queued requests (rq_head) */
  bool rq_half_close : 1;
  bool ready : 1;
};

struct srv_conn {
  sp_h2conn io;
  sp_rpc_server *srv;
  uint64_t id;
  char peer[64];
  sp_rpc_call *calls;
  sp_rpc_call *notify; /* calls whose on_writable must run */
  sp_rpc_call *arm;    /* see arm_listed */
  int32_t last_route;  /* the method of its last known :path; -1: none */
  /* The call of the stream nghttp2 last called back for, so the callbacks
   * of one frame (a request's HEADERS: one per field, then the frame's
   * end) do not each look the stream up in nghttp2's map: 10 lookups per
   * unary call, 2% of the server's instructions (callgrind, bench/rpc).
   * Cleared when that call is freed. */
  int32_t cur_id;
  sp_rpc_call *cur_call;
  size_t pending;   /* bytes queued by all its calls */
  bool any_blocked; /* a call waits for `pending` to drain */
  /* For the limits (uv_now() ms): accepted, and last seen with no open
   * call; whether complete request headers ever came; when an evicted or
   * timed-out connection, told by GOAWAY, is closed if still there. */
  uint64_t accepted_ms, idle_since_ms, kill_at_ms;
  bool had_request, evicting;
  srv_conn *next, *prev;
  /* on srv->flush_head: written out by the flush idle handle */
  bool flush_queued;
  srv_conn *flush_next, *flush_prev;
  /* in-memory connections only (sp_rpc_server_feed_bytes) */
  int (*feed_sink)(void *arg, const uint8_t *data, size_t len);
  void *feed_arg;
  bool *gone; /* set when the connection is freed */
};

typedef struct listener {
  union { /* stream fields at the same offsets, as in sp_h2conn */
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  };
  bool is_pipe;
  sp_rpc_server *srv;
  struct listener *next;
} listener;

/* What the server counted of one method's calls (rpc.h,
 * sp_rpc_method_stats). */
typedef struct method_rec {
  uint64_t calls[SP_RPC_CODES];
  uint64_t bucket[SP_RPC_DURATION_BUCKETS + 1];
  uint64_t sum_us;
} method_rec;

struct sp_rpc_server {
  uv_loop_t *loop;
  sp_rpc_server_opts opts;
  sp_strmap *paths;
  const sp_rpc_method **methods;
  method_rec *recs; /* beside methods, cap_methods of them */
  size_t n_methods, cap_methods;
  uint64_t t0_ns; /* uv_hrtime when made: the calls' clock starts there */
  listener *listeners;
  srv_conn *conns;
  uint64_t next_conn_id;
  sp_rpc_server_stats stats;
  bool shutting_down, grace_started, grace_closing, grace_closed, done_called;
  uv_timer_t grace_timer;
  size_t open_handles; /* listeners + connections not yet closed */
  void (*shutdown_done)(sp_rpc_server *, void *);
  void *shutdown_arg;
  sp_rpc_health_state health;
  sp_h2shared shared; /* the I/O buffers all connections share */
  /* nghttp2's blocks and the calls, for all connections (rpc_mem.h) */
  sp_rpc_mem mem;
  sp_rpc_mem_trimmer trim;   /* opts.trim_heap_bytes, on the sweep */
  uint64_t trim_ended;       /* calls ended when the sweep last looked */
  ProtobufCAllocator pb_mem; /* srv->mem for the decoded requests */
  SSL_CTX *tls;              /* NULL: cleartext; built by the first listen */
  /* Request and response bytes buffered across all connections, against
   * opts.max_buffered. */
  size_t buffered;
  /* Calls with requests waiting for their handler, oldest first. */
  sp_rpc_call *ready_head, *ready_tail;
  /* Bytes handed to handlers in this loop iteration, and when the first
   * went (uv_hrtime ns). */
  size_t iter_bytes;
  uint64_t iter_start_ns;
  struct srv_handles *h; /* created with the first connection */
  uint32_t live_conns;   /* open and not being closed for a limit */
  /* Connections with sends to write out (conn_flush_soon). */
  srv_conn *flush_head;
};

static void conn_flush(srv_conn *c);
static void conn_flush_soon(srv_conn *c);
static void call_free(sp_rpc_call *call);
static void rq_clear(sp_rpc_call *call);

/* uv_now after bringing the loop's clock up to date: the stamps and
 * deadlines of the limits must not be as old as the iteration. */
static uint64_t loop_now(sp_rpc_server *srv) {
  uv_update_time(srv->loop);
  return uv_now(srv->loop);
}

static void buffered_add(sp_rpc_server *srv, size_t n) {
  srv->buffered += n;
  if (srv->buffered > srv->stats.buffered_peak)
    srv->stats.buffered_peak = srv->buffered;
}

const double sp_rpc_duration_bounds[SP_RPC_DURATION_BUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25,   0.5,     1,      2.5,   5,      10,    30,   60,    300,  3600};
/* The same in microseconds, for the call's end: integers compared. */
static const uint64_t k_bounds_us[SP_RPC_DURATION_BUCKETS] = {
    100,     250,      500,      1000,     2500,      5000,       10000,
    25000,   50000,    100000,   250000,   500000,    1000000,    2500000,
    5000000, 10000000, 30000000, 60000000, 300000000, 3600000000u};

#define T0_MASK ((UINT64_C(1) << 48) - 1)

/* Microseconds since the server was made, 48 bits of them. */
static uint64_t srv_us(const sp_rpc_server *srv) {
  return ((uv_hrtime() - srv->t0_ns) / 1000u) & T0_MASK;
}

/* A call of a known method ended with code: counted once (the route
 * cleared), with its time since its headers began. */
static void call_count(sp_rpc_call *call, int code) {
  sp_rpc_server *srv = call->conn->srv;
  if (call->route < 0 || (size_t)call->route >= srv->n_methods) return;
  method_rec *m = &srv->recs[call->route];
  call->route = -1;
  uint64_t t0 = (uint64_t)call->t0_hi << 32 | call->t0_lo;
  uint64_t us = (srv_us(srv) - t0) & T0_MASK;
  m->calls[code >= 0 && code < SP_RPC_CODES ? code : SP_RPC_UNKNOWN]++;
  size_t b = 0;
  while (b < SP_RPC_DURATION_BUCKETS && us > k_bounds_us[b]) b++;
  m->bucket[b]++;
  m->sum_us += us;
}

/* A unary request's bytes: a copy from srv->mem (cap 0), or the buffer
 * the deframer reassembled it in (cap bytes). */
static void unary_buf_free(sp_rpc_server *srv, uint8_t *buf, size_t cap) {
  if (cap == 0)
    sp_rpc_mem_free(&srv->mem, buf);
  else
    sp_rpc_deframer_buf_free(buf, cap);
}

/* A unary request copy (call->unary_req) goes back to the budget. */
static void unary_req_free(sp_rpc_call *call) {
  if (call->unary_req == NULL) return;
  unary_buf_free(call->conn->srv, call->unary_req, call->unary_cap);
  call->unary_req = NULL;
  call->conn->srv->buffered -= call->unary_charged;
  call->unary_len = call->unary_charged = call->unary_cap = 0;
}

/* ---------------- call lifetime ---------------- */

static void timer_closed(uv_handle_t *h) { free(h); }

static void call_stop_timer(sp_rpc_call *call) {
  if (call->timer != NULL) {
    uv_timer_stop(call->timer);
    uv_close((uv_handle_t *)call->timer, timer_closed);
    call->timer = NULL;
  }
}

/* Tells the handler the call is over without its finish, exactly once. */
static void call_release(sp_rpc_call *call, int code) {
  if (call->released) return;
  call->released = true;
  call_count(call, code);
  if (call->method != NULL && call->method->on_cancel != NULL)
    call->method->on_cancel(call, code);
}

static void call_free(sp_rpc_call *call) {
  srv_conn *c = call->conn;
  if (c->cur_call == call) c->cur_call = NULL;
  if (call->prev)
    call->prev->next = call->next;
  else
    c->calls = call->next;
  if (call->next) call->next->prev = call->prev;
  if (call->arm_listed)
    for (sp_rpc_call **pp = &c->arm; *pp; pp = &(*pp)->arm_next)
      if (*pp == call) {
        *pp = call->arm_next;
        break;
      }
  /* drop from the writable-notification list */
  for (sp_rpc_call **pp = &c->notify; *pp; pp = &(*pp)->notify_next)
    if (*pp == call) {
      *pp = call->notify_next;
      break;
    }
  c->pending -= call->q.bytes;
  c->srv->buffered -= call->q.bytes;
  call_stop_timer(call);
  rq_clear(call);
  sp_rpc_mdlist_clear(&call->req_md);
  sp_rpc_mdlist_clear(&call->resp_md);
  sp_rpc_deframer_free(&call->df);
  sp_rpc_outq_clear(&call->q);
  unary_req_free(call);
  free(call->status_msg);
  free(call->unknown_path);
  c->srv->stats.calls_open--;
  sp_rpc_mem_free(&c->srv->mem, call);
  /* the connection's idle time counts from its last call; the loop's
   * clock, updated when its poll returned, is as good for an idle limit
   * and spares a clock read per call */
  if (c->calls == NULL) c->idle_since_ms = uv_now(c->srv->loop);
}

/* ---------------- sending ---------------- */

/* Response metadata as header fields; -bin values in base64. */
static size_t md_to_nv(const sp_rpc_mdlist *l, nghttp2_nv *nv, char **b64) {
  size_t n = 0;
  for (size_t i = 0; i < l->n; i++) {
    const struct sp_rpc_mdent *e = &l->e[i];
    size_t klen = strlen(e->key);
    uint8_t *v = e->value;
    size_t vlen = e->len;
    if (sp_rpc_md_key_is_bin(e->key, klen)) {
      b64[i] = malloc(4 * (e->len / 3 + 1) + 1);
      if (b64[i] == NULL) continue;
      vlen = sp_rpc_b64_encode(e->value, e->len, b64[i]);
      v = (uint8_t *)b64[i];
    }
    nv[n++] =
        (nghttp2_nv){(uint8_t *)e->key, v, klen, vlen, NGHTTP2_NV_FLAG_NONE};
  }
  return n;
}

static ssize_t read_response(nghttp2_session *s, int32_t id, uint8_t *buf,
                             size_t length, uint32_t *flags,
                             nghttp2_data_source *src, void *ud);

/* Status headers/trailers: grpc-status, grpc-message. */
typedef struct status_nv {
  char code[12];
  char msg[1024];
} status_nv;

static size_t status_fields(sp_rpc_call *call, status_nv *s, nghttp2_nv *nv) {
  /* a table, as an snprintf per call was 0.8% of the CPU in bench/rpc */
  static const char *const k_code[17] = {"0",  "1",  "2",  "3",  "4",  "5",
                                         "6",  "7",  "8",  "9",  "10", "11",
                                         "12", "13", "14", "15", "16"};
  size_t n = 0;
  const char *code = s->code;
  if (call->status >= 0 && call->status <= 16)
    code = k_code[call->status];
  else
    snprintf(s->code, sizeof s->code, "%d", call->status);
  if (code == s->code) /* on the stack */
    nv[n++] = (nghttp2_nv)SP_NV("grpc-status", code, strlen(code));
  else
    nv[n++] = (nghttp2_nv)SP_NV_STATIC("grpc-status", code, strlen(code));
  if (call->status_msg != NULL && call->status_msg[0] != '\0') {
    size_t l = sp_rpc_pct_encode(call->status_msg, s->msg, sizeof s->msg);
    nv[n++] = (nghttp2_nv)SP_NV("grpc-message", s->msg, l);
  }
  return n;
}

/* Response headers, with the data provider; or, when finished with nothing
 * queued, a Trailers-Only response. */
static int submit_headers(sp_rpc_call *call) {
  if (call->headers_sent) return 0;
  nghttp2_session *h2 = call->conn->io.h2;
  size_t cap = 6 + call->resp_md.n;
  /* the usual few headers fit on the stack; more go to the heap */
  nghttp2_nv nv_st[16];
  char *b64_st[8] = {NULL};
  nghttp2_nv *nv = cap <= 16 ? nv_st : calloc(cap, sizeof *nv);
  char **b64 = call->resp_md.n + 1 <= 8
                   ? b64_st
                   : calloc(call->resp_md.n + 1, sizeof *b64);
  if (nv == NULL || b64 == NULL) {
    if (nv != nv_st) free(nv);
    if (b64 != b64_st) free(b64);
    return SP_ENOMEM;
  }
  size_t n = 0;
  nv[n++] = (nghttp2_nv)SP_NV_STATIC(":status", "200", 3);
  nv[n++] = (nghttp2_nv)SP_NV_STATIC("content-type", "application/grpc", 16);
  n += md_to_nv(&call->resp_md, nv + n, b64);
  status_nv st;
  int rv;
  if (call->finished && sp_rpc_outq_empty(&call->q)) {
    /* The codecs we take, on errors only (where an unsupported
     * grpc-encoding is answered): a client that sent none assumes
     * identity, and on every OK answer the field cost both ends 7% of
     * their instructions per unary call (callgrind over bench/rpc). */
    nv[n++] = (nghttp2_nv)SP_NV_STATIC("grpc-accept-encoding", "identity", 8);
    n += status_fields(call, &st, nv + n);
    rv = nghttp2_submit_response(h2, call->stream_id, nv, n, NULL);
  } else {
    nghttp2_data_provider prd = {.source.ptr = call,
                                 .read_callback = read_response};
    rv = nghttp2_submit_response(h2, call->stream_id, nv, n, &prd);
  }
  for (size_t i = 0; i < call->resp_md.n; i++) free(b64[i]);
  if (b64 != b64_st) free(b64);
  if (nv != nv_st) free(nv);
  if (rv != 0) return SP_EIO;
  call->headers_sent = true;
  return 0;
}

/* Queues on_writable (run after nghttp2 returns, never inside it). */
static void queue_notify(sp_rpc_call *call) {
  if (call->notify_queued) return;
  call->want_writable = false;
  call->notify_queued = true;
  call->notify_next = call->conn->notify;
  call->conn->notify = call;
}

/* After bytes left the queues: wake the calls whose sends were refused,
 * once both their own queue and the connection's have drained to half. */
static void notify_drained(sp_rpc_call *call) {
  srv_conn *c = call->conn;
  const sp_rpc_server_opts *o = &c->srv->opts;
  if (call->want_writable && !call->conn_blocked &&
      call->q.bytes <= o->max_pending / 2)
    queue_notify(call);
  if (c->any_blocked && c->pending <= o->max_conn_pending / 2) {
    c->any_blocked = false;
    for (sp_rpc_call *x = c->calls; x; x = x->next) {
      if (!x->conn_blocked) continue;
      x->conn_blocked = false;
      if (x->want_writable && x->q.bytes <= o->max_pending / 2) queue_notify(x);
    }
  }
}

static ssize_t read_response(nghttp2_session *s, int32_t id, uint8_t *buf,
                             size_t length, uint32_t *flags,
                             nghttp2_data_source *src, void *ud) {
  (void)ud;
  sp_rpc_call *call = src->ptr;
  size_t before = call->q.bytes;
  size_t out = sp_rpc_outq_pull(&call->q, buf, length);
  call->conn->pending -= before - call->q.bytes;
  call->conn->srv->buffered -= before - call->q.bytes;
  notify_drained(call);
  if (out > 0) return (ssize_t)out;
  if (!call->finished) {
    call->deferred = true;
    return NGHTTP2_ERR_DEFERRED;
  }
  /* Trailers are submitted from inside the data read callback, as nghttpd
   * and nghttpx do, so they follow the last DATA frame; only when that
   * submission worked may the DATA stream stay open (NO_END_STREAM). */
  nghttp2_nv nv[2];
  status_nv st;
  size_t n = status_fields(call, &st, nv);
  *flags |= NGHTTP2_DATA_FLAG_EOF;
  if (nghttp2_submit_trailer(s, id, nv, n) == 0)
    *flags |= NGHTTP2_DATA_FLAG_NO_END_STREAM;
  return 0;
}

static void call_kick(sp_rpc_call *call) {
  if (call->deferred) {
    call->deferred = false;
    nghttp2_session_resume_data(call->conn->io.h2, call->stream_id);
  }
}

/* Ends the call (engine or handler). */
static int call_end(sp_rpc_call *call, int code, const char *msg) {
  if (call->finished) return SP_ESTATE;
  call->finished = true;
  call->status = code;
  call_count(call, code);
  if (msg != NULL) call->status_msg = sp_strdup(msg);
  call_stop_timer(call);
  /* what the request still holds goes back to the budget now (a partial
   * message stays in the deframer, which may be in use up the stack,
   * until the stream closes, right after the trailers) */
  rq_clear(call);
  unary_req_free(call);
  if (call->conn->io.h2 == NULL) return 0; /* closing: nothing to send */
  int rc = call->headers_sent ? 0 : submit_headers(call);
  call_kick(call);
  if (rc != 0)
    nghttp2_submit_rst_stream(call->conn->io.h2, NGHTTP2_FLAG_NONE,
                              call->stream_id, NGHTTP2_INTERNAL_ERROR);
  conn_flush_soon(call->conn);
  return 0;
}

/* An engine-side failure: release the handler, then end with the status. */
static void call_fail(sp_rpc_call *call, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void call_fail(sp_rpc_call *call, int code, const char *fmt, ...) {
  char msg[SP_RPC_STATUS_MESSAGE_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  call_release(call, code);
  call_end(call, code, msg);
}

static int queue_bytes(sp_rpc_call *call, const uint8_t *data, size_t len,
                       const ProtobufCMessage *msg) {
  if (call->finished || call->released) return SP_ESTATE;
  /* its connection is closing: a handler told of another call's end on
   * it (conn_closed releases them one by one) may send on this one, whose
   * HTTP/2 session is already gone */
  if (call->conn->io.h2 == NULL) return SP_ESTATE;
  sp_rpc_server *srv = call->conn->srv;
  if (len > srv->opts.max_message) return SP_ETOOBIG;
  if ((call->method->kind == SP_RPC_UNARY ||
       call->method->kind == SP_RPC_CLIENT_STREAMING) &&
      (call->headers_sent || !sp_rpc_outq_empty(&call->q)))
    return SP_ESTATE; /* one response only */
  /* Two budgets: the call's, and the connection's, so a client that does
   * not read cannot pin more than max_conn_pending however many streams it
   * opens. An empty queue always takes one message. */
  srv_conn *c = call->conn;
  bool call_full =
      call->q.bytes > 0 && call->q.bytes + len + 5 > srv->opts.max_pending;
  bool conn_full =
      c->pending > 0 && c->pending + len + 5 > srv->opts.max_conn_pending;
  if (call_full || conn_full) {
    call->want_writable = call->on_writable != NULL;
    if (conn_full) {
      call->conn_blocked = true;
      c->any_blocked = true;
    }
    return SP_EAGAIN;
  }
  if (srv->buffered + len + 5 > srv->opts.max_buffered) {
    srv->stats.calls_over_budget++;
    return SP_ENOMEM; /* the server's budget, across all connections */
  }
  if (sp_rpc_outq_push(&call->q, msg, data, len) != 0) return SP_ENOMEM;
  c->pending += len + 5;
  buffered_add(srv, len + 5);
  int rc = submit_headers(call);
  if (rc != 0) return rc;
  call_kick(call);
  conn_flush_soon(call->conn);
  return 0;
}

int sp_rpc_call_send(sp_rpc_call *call, const ProtobufCMessage *msg) {
  if (call == NULL || msg == NULL) return SP_EINVAL;
  return queue_bytes(call, NULL, protobuf_c_message_get_packed_size(msg), msg);
}

int sp_rpc_call_send_raw(sp_rpc_call *call, const uint8_t *data, size_t len) {
  if (call == NULL || (data == NULL && len > 0)) return SP_EINVAL;
  return queue_bytes(call, data, len, NULL);
}

int sp_rpc_call_start(sp_rpc_call *call) {
  if (call == NULL) return SP_EINVAL;
  if (call->finished || call->released) return SP_ESTATE;
  int rc = submit_headers(call);
  if (rc == 0) conn_flush_soon(call->conn);
  return rc;
}

int sp_rpc_call_reply(sp_rpc_call *call, const ProtobufCMessage *msg) {
  int rc = sp_rpc_call_send(call, msg);
  if (rc == SP_ETOOBIG)
    sp_rpc_call_finishf(call, SP_RPC_RESOURCE_EXHAUSTED,
                        "answer of %zu bytes is over the message limit",
                        protobuf_c_message_get_packed_size(msg));
  else if (rc == SP_ENOMEM)
    sp_rpc_call_finishf(call, SP_RPC_RESOURCE_EXHAUSTED,
                        "no room for an answer of %zu bytes: the server's "
                        "buffers are full (limit %zu bytes)",
                        protobuf_c_message_get_packed_size(msg),
                        call->conn->srv->opts.max_buffered);
  else if (rc != 0)
    sp_rpc_call_finishf(call, SP_RPC_INTERNAL, "send failed: %s",
                        sp_strerror(rc));
  else
    sp_rpc_call_finish(call, SP_RPC_OK, NULL);
  return rc;
}

int sp_rpc_call_finish(sp_rpc_call *call, int code, const char *message) {
  if (call == NULL || code < 0 || code > 16) return SP_EINVAL;
  if (call->released || call->finished) return SP_ESTATE;
  call->released = true; /* the handler gives the call back */
  return call_end(call, code, message);
}

int sp_rpc_call_finishf(sp_rpc_call *call, int code, const char *fmt, ...) {
  char msg[SP_RPC_STATUS_MESSAGE_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return sp_rpc_call_finish(call, code, msg);
}

int sp_rpc_call_add_metadata(sp_rpc_call *call, const char *key,
                             const uint8_t *value, size_t len) {
  if (call == NULL || key == NULL) return SP_EINVAL;
  size_t kl = strlen(key);
  if (call->headers_sent) return SP_ESTATE;
  if (!sp_rpc_md_key_valid(key, kl) || strncmp(key, "grpc-", 5) == 0)
    return SP_EINVAL;
  if (!sp_rpc_md_key_is_bin(key, kl) && !sp_rpc_md_value_valid(value, len))
    return SP_EINVAL;
  return sp_rpc_mdlist_add(&call->resp_md, key, kl, value, len,
                           call->conn->srv->opts.max_metadata);
}

const uint8_t *sp_rpc_call_metadata(const sp_rpc_call *call, const char *key,
                                    size_t *len) {
  return sp_rpc_mdlist_get(&call->req_md, key, len);
}

size_t sp_rpc_call_pending(const sp_rpc_call *call) { return call->q.bytes; }

void sp_rpc_call_on_writable(sp_rpc_call *call, void (*cb)(sp_rpc_call *)) {
  call->on_writable = cb;
}

int64_t sp_rpc_call_remaining_ms(const sp_rpc_call *call) {
  if (call->timeout_ms < 0) return -1;
  /* a handler may ask after working for a while in its callback */
  uv_update_time(call->conn->srv->loop);
  uint64_t now = uv_now(call->conn->srv->loop);
  return call->deadline > now ? (int64_t)(call->deadline - now) : 0;
}

const char *sp_rpc_call_path(const sp_rpc_call *call) {
  if (call->method != NULL) return call->method->path;
  return call->unknown_path != NULL ? call->unknown_path : "";
}
void *sp_rpc_call_method_user(const sp_rpc_call *call) {
  return call->method ? call->method->user : NULL;
}
void sp_rpc_call_set_user(sp_rpc_call *call, void *user) { call->user = user; }
void sp_rpc_call_set_principal(sp_rpc_call *call, const sp_rpc_principal *p) {
  call->principal = p;
}
const sp_rpc_principal *sp_rpc_call_principal(const sp_rpc_call *call) {
  return call->principal;
}
void *sp_rpc_call_user(const sp_rpc_call *call) { return call->user; }
uint64_t sp_rpc_call_connection_id(const sp_rpc_call *call) {
  return call->conn->id;
}
const char *sp_rpc_call_peer(const sp_rpc_call *call) {
  return call->conn->peer;
}
uv_loop_t *sp_rpc_call_loop(const sp_rpc_call *call) {
  return call->conn->srv->loop;
}

/* ---------------- receiving ---------------- */

static void on_deadline(uv_timer_t *t) {
  sp_rpc_call *call = t->data;
  if (call->timer_is_request) {
    sp_rpc_server *srv = call->conn->srv;
    srv->stats.calls_request_timeout++;
    call_fail(call, SP_RPC_DEADLINE_EXCEEDED,
              "the request was not complete (half-closed) within %llu ms, "
              "the server's request timeout",
              (unsigned long long)srv->opts.request_timeout_ms);
    return;
  }
  call_fail(call, SP_RPC_DEADLINE_EXCEEDED, "deadline exceeded");
}

static void http_error(sp_rpc_call *call, const char *status, int code,
                       const char *msg) {
  nghttp2_nv nv[4];
  char c[12];
  snprintf(c, sizeof c, "%d", code);
  nv[0] = (nghttp2_nv)SP_NV(":status", status, strlen(status));
  nv[1] = (nghttp2_nv)SP_NV_STATIC("content-type", "application/grpc", 16);
  nv[2] = (nghttp2_nv)SP_NV("grpc-status", c, strlen(c));
  nv[3] = (nghttp2_nv)SP_NV("grpc-message", msg, strlen(msg));
  nghttp2_submit_response(call->conn->io.h2, call->stream_id, nv, 4, NULL);
  call->headers_sent = call->finished = call->released = true;
  call->status = code;
  call_count(call, code);
}

static bool unary_request(const sp_rpc_method *m) {
  return m->kind == SP_RPC_UNARY || m->kind == SP_RPC_SERVER_STREAMING;
}

/* Arms the call's timer for ms from now. */
static void call_arm_timer(sp_rpc_call *call, uint64_t ms) {
  sp_rpc_server *srv = call->conn->srv;
  if (call->timer == NULL) {
    call->timer = malloc(sizeof *call->timer);
    if (call->timer == NULL) return;
    uv_timer_init(srv->loop, call->timer);
    call->timer->data = call;
  }
  uv_timer_start(call->timer, on_deadline, ms, 0);
}

static bool is_health(const char *path) {
  static const char k[] = "/grpc.health.v1.Health/";
  return strncmp(path, k, sizeof k - 1) == 0;
}

/* End of request headers: route, validate, authorize. */
static void request_headers_done(sp_rpc_call *call) {
  sp_rpc_server *srv = call->conn->srv;
  call->conn->had_request = true;
  if (srv->shutting_down) {
    call_end(call, SP_RPC_UNAVAILABLE, "server is shutting down");
    return;
  }
  if (!call->is_post) {
    http_error(call, "405", SP_RPC_UNIMPLEMENTED, "gRPC requires POST");
    return;
  }
  if (!call->grpc_content_type) {
    http_error(call, "415", SP_RPC_INTERNAL,
               "content-type must be application/grpc");
    return;
  }
  if (call->md_overflow) {
    call_end(call, SP_RPC_RESOURCE_EXHAUSTED, "request metadata too large");
    return;
  }
  int32_t idx = call->route;
  if (idx < 0) {
    char msg[300];
    snprintf(msg, sizeof msg, "unknown method %.256s",
             call->unknown_path != NULL ? call->unknown_path : "");
    call_end(call, SP_RPC_UNIMPLEMENTED, msg);
    return;
  }
  if (call->bad_encoding) {
    call_end(call, SP_RPC_UNIMPLEMENTED,
             "unsupported grpc-encoding (accepted: identity)");
    return;
  }
  call->method = srv->methods[idx];
  if (srv->opts.authorize != NULL && !is_health(call->method->path)) {
    char msg[SP_RPC_STATUS_MESSAGE_MAX] = "";
    int code =
        srv->opts.authorize(call, srv->opts.authorize_arg, msg, sizeof msg);
    if (code != SP_RPC_OK) {
      /* The handler never saw the call, so it must not hear of its end;
       * finished makes cb_data_chunk drop the body unread, and the
       * Trailers-Only answer is followed by RST_STREAM (cb_frame_send). */
      call->method = NULL;
      call->principal = NULL;
      srv->stats.calls_refused++;
      call_end(call, code > 0 && code <= 16 ? code : SP_RPC_INTERNAL, msg);
      return;
    }
  }
  if (srv->opts.metadata_to_authorize) sp_rpc_mdlist_clear(&call->req_md);
  /* from now: the loop's clock is as old as this iteration */
  if (call->timeout_ms >= 0)
    call->deadline = loop_now(srv) + (uint64_t)call->timeout_ms;
  /* A unary request is buffered until the client half-closes, so it must
   * do so in bounded time even without a deadline of its own. */
  uint64_t req_ms = srv->opts.request_timeout_ms;
  if (unary_request(call->method) &&
      (call->timeout_ms < 0 || (uint64_t)call->timeout_ms > req_ms)) {
    call->timer_is_request = true;
    /* A unary request nearly always completes in the read that brought
     * its headers, and a timer armed here would be stopped and closed
     * before that read is done: a malloc, two timer-heap updates, a close
     * callback and a free per call for nothing (bench/rpc). So it is armed
     * after the read (arm_request_timers) and only if still needed. */
    if (!call->arm_listed) {
      call->arm_listed = true;
      call->arm_next = call->conn->arm;
      call->conn->arm = call;
    }
  } else if (call->timeout_ms >= 0) {
    call_arm_timer(call, (uint64_t)call->timeout_ms);
  }
}

static int deliver(sp_rpc_call *call, const uint8_t *data, size_t len) {
  const sp_rpc_method *m = call->method;
  ProtobufCMessage *msg = NULL;
  uint8_t *compact = NULL;
  if (m->input != NULL) {
    /* protobuf-c keeps each unknown field as an allocation and takes any
     * string: the pre-scan drops the one and refuses the other */
    char err[SP_RPC_STATUS_MESSAGE_MAX];
    size_t clen = 0;
    /* Decode memory within twice the message limit: a bytes field as
     * large as the limit decodes into about its own size, two-byte empty
     * messages into 24 times theirs. */
    size_t max_decoded = 2 * call->conn->srv->opts.max_message + (64u << 10);
    int rc = sp_rpc_pbcheck(m->input, data, len, max_decoded, &compact, &clen,
                            err, sizeof err);
    if (rc == SP_EFORMAT) {
      call_fail(call, SP_RPC_INVALID_ARGUMENT, "%s", err);
      return 0;
    }
    if (rc == SP_ETOOBIG) {
      call_fail(call, SP_RPC_RESOURCE_EXHAUSTED, "%s", err);
      return 0;
    }
    if (rc != 0) {
      call_fail(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return 0;
    }
    if (compact != NULL) {
      data = compact;
      len = clen;
    }
    /* the message lives only until the handler returns: its blocks come
     * from the server's cache */
    msg = protobuf_c_message_unpack(m->input, &call->conn->srv->pb_mem, len,
                                    data);
    if (msg == NULL) {
      free(compact);
      call_fail(call, SP_RPC_INTERNAL, "cannot decode %s request (%zu bytes)",
                m->input->name, len);
      return 0;
    }
  }
  m->on_message(call, msg, data, len);
  if (msg != NULL)
    protobuf_c_message_free_unpacked(msg, &call->conn->srv->pb_mem);
  free(compact);
  return 0;
}

/* ---------------- handing requests over under a budget ---------------- */

/* What one loop iteration hands to handlers: 16 requests of 8 MiB that
 * completed in one read were once all decoded and handled inside that read
 * callback (5.4 s), and the coordinator's heartbeat timer could not run
 * meanwhile. Past this many bytes or this long, requests wait on the ready
 * list for the next iteration, which runs timers first; the first request
 * of an iteration always goes. */
#define SP_DISPATCH_BYTES (4u << 20)
#define SP_DISPATCH_NS 5000000u
/* A message this small goes to its handler at once even when large ones
 * wait (unless its own call has some queued, which keeps the call's
 * order): a heartbeat must not wait its turn behind sixteen 8 MiB decodes
 * in the round robin, each up to a budget long (under AddressSanitizer on
 * a loaded machine that lost a rank). One read callback holds at most a
 * read buffer of them, so they cannot stall the loop either. */
#define SP_DISPATCH_SMALL (16u << 10)

typedef struct rq_item {
  struct rq_item *next;
  size_t len; /* charged to srv->buffered */
  uint8_t *data;
} rq_item;

/* The loop handles the server keeps once it has connections. */
struct srv_handles {
  uv_idle_t idle; /* runs the ready list; active only while it has calls */
  /* writes the queued flushes; while active, the loop does not block */
  uv_idle_t flush;
  uv_check_t check; /* ends an iteration's budget */
  uv_timer_t sweep; /* connection limits */
  sp_rpc_server *srv;
  sp_rpc_server *notify; /* told when all three are closed (shutdown) */
  int open;
};

static bool budget_allows(sp_rpc_server *srv, size_t len) {
  if (srv->iter_bytes == 0) return true;
  return srv->iter_bytes + len <= SP_DISPATCH_BYTES &&
         uv_hrtime() - srv->iter_start_ns < SP_DISPATCH_NS;
}

static void budget_spend(sp_rpc_server *srv, size_t len) {
  if (srv->iter_bytes == 0) srv->iter_start_ns = uv_hrtime();
  srv->iter_bytes += len + 1; /* an empty message counts too */
}

static void on_dispatch(uv_idle_t *h);

static void ready_push(sp_rpc_server *srv, sp_rpc_call *call) {
  if (call->ready) return;
  call->ready = true;
  call->ready_next = NULL;
  call->ready_prev = srv->ready_tail;
  if (srv->ready_tail)
    srv->ready_tail->ready_next = call;
  else
    srv->ready_head = call;
  srv->ready_tail = call;
  if (srv->h != NULL && !uv_is_active((uv_handle_t *)&srv->h->idle))
    uv_idle_start(&srv->h->idle, on_dispatch);
}

static void ready_remove(sp_rpc_server *srv, sp_rpc_call *call) {
  if (!call->ready) return;
  call->ready = false;
  if (call->ready_prev)
    call->ready_prev->ready_next = call->ready_next;
  else
    srv->ready_head = call->ready_next;
  if (call->ready_next)
    call->ready_next->ready_prev = call->ready_prev;
  else
    srv->ready_tail = call->ready_prev;
  call->ready_next = call->ready_prev = NULL;
}

static void rq_item_free(sp_rpc_server *srv, rq_item *it) {
  srv->buffered -= it->len;
  free(it->data);
  free(it);
}

static void rq_clear(sp_rpc_call *call) {
  sp_rpc_server *srv = call->conn->srv;
  while (call->rq_head != NULL) {
    rq_item *it = call->rq_head;
    call->rq_head = it->next;
    rq_item_free(srv, it);
  }
  call->rq_tail = NULL;
  call->rq_half_close = false;
  ready_remove(srv, call);
}

/* The half-close, once every request before it went to the handler. */
static void half_close_now(sp_rpc_call *call) {
  const sp_rpc_method *m = call->method;
  if (call->finished) return;
  if (unary_request(m)) {
    /* the call owns the bytes no longer: a handler that finishes the call
     * inside on_message must not free what it is reading */
    uint8_t *req = call->unary_req;
    size_t len = call->unary_len, charged = call->unary_charged;
    size_t cap = call->unary_cap;
    call->unary_req = NULL;
    call->unary_len = call->unary_charged = call->unary_cap = 0;
    sp_rpc_server *srv = call->conn->srv;
    deliver(call, req, len);
    unary_buf_free(srv, req, cap);
    srv->buffered -= charged;
    return;
  }
  if (m->on_half_close != NULL && !call->released) m->on_half_close(call);
}

/* Queues a copy of a streaming call's request message for the ready
 * list, charged to the budget; a failure ends the call. */
static int rq_push(sp_rpc_call *call, const uint8_t *data, size_t len) {
  sp_rpc_server *srv = call->conn->srv;
  if (srv->buffered + len > srv->opts.max_buffered) {
    srv->stats.calls_over_budget++;
    call_fail(call, SP_RPC_RESOURCE_EXHAUSTED,
              "request of %zu bytes: the server's buffers are full (limit "
              "%zu bytes)",
              len, srv->opts.max_buffered);
    return SP_ENOMEM;
  }
  rq_item *it = malloc(sizeof *it);
  uint8_t *copy = malloc(len ? len : 1);
  if (it == NULL || copy == NULL) {
    free(it);
    free(copy);
    call_fail(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return SP_ENOMEM;
  }
  memcpy(copy, data, len);
  it->next = NULL;
  it->len = len;
  it->data = copy;
  buffered_add(srv, len);
  if (call->rq_tail)
    call->rq_tail->next = it;
  else
    call->rq_head = it;
  call->rq_tail = it;
  srv->stats.deliveries_deferred++;
  ready_push(srv, call);
  return 0;
}

/* Handler work from the ready list runs as it would inside nghttp2's
 * callbacks: what it sends is flushed once it returns. */
static void dispatch_one(sp_rpc_server *srv, sp_rpc_call *call) {
  srv_conn *c = call->conn;
  ready_remove(srv, call);
  rq_item *it = call->rq_head;
  bool half = false;
  if (it != NULL) {
    call->rq_head = it->next;
    if (call->rq_head == NULL) call->rq_tail = NULL;
  } else {
    half = call->rq_half_close;
    call->rq_half_close = false;
  }
  /* round robin: a call with more waits behind the others */
  if (call->rq_head != NULL || call->rq_half_close) ready_push(srv, call);
  bool was_in_h2 = c->io.in_h2;
  c->io.in_h2 = true;
  if (it != NULL && !call->finished)
    deliver(call, it->data, it->len);
  else if (half)
    half_close_now(call);
  c->io.in_h2 = was_in_h2;
  if (it != NULL) rq_item_free(srv, it);
  if (!was_in_h2 && c->io.want_flush) {
    c->io.want_flush = false;
    sp_h2conn_flush(&c->io);
  }
}

static void on_dispatch(uv_idle_t *h) {
  struct srv_handles *hs = h->data;
  sp_rpc_server *srv = hs->srv;
  srv->iter_bytes = 0; /* a new iteration: its timers have run */
  while (srv->ready_head != NULL) {
    sp_rpc_call *call = srv->ready_head;
    /* a unary call's half-close delivers its request */
    size_t len = call->rq_head != NULL         ? call->rq_head->len
                 : unary_request(call->method) ? call->unary_len
                                               : 0;
    if (!budget_allows(srv, len)) break;
    budget_spend(srv, len);
    dispatch_one(srv, call);
  }
  if (srv->ready_head == NULL) uv_idle_stop(h);
}

static void on_iteration_end(uv_check_t *h) {
  struct srv_handles *hs = h->data;
  hs->srv->iter_bytes = 0;
}

/* A complete request message of a streaming-request call: to the handler
 * now when the budget allows and nothing waits, else queued. */
static int submit_message(sp_rpc_call *call, const uint8_t *data, size_t len) {
  sp_rpc_server *srv = call->conn->srv;
  if (call->rq_head == NULL &&
      ((srv->ready_head == NULL && budget_allows(srv, len)) ||
       len <= SP_DISPATCH_SMALL)) {
    budget_spend(srv, len);
    return deliver(call, data, len);
  }
  rq_push(call, data, len);
  return 0;
}

static void submit_half_close(sp_rpc_call *call) {
  sp_rpc_server *srv = call->conn->srv;
  size_t len = unary_request(call->method) ? call->unary_len : 0;
  if (call->rq_head == NULL &&
      ((srv->ready_head == NULL && budget_allows(srv, len)) ||
       len <= SP_DISPATCH_SMALL)) {
    budget_spend(srv, len);
    half_close_now(call);
    return;
  }
  if (len > 0) srv->stats.deliveries_deferred++;
  call->rq_half_close = true;
  ready_push(srv, call);
}

static int on_request_message(void *ud, const uint8_t *data, size_t len) {
  sp_rpc_call *call = ud;
  if (call->finished) return 0;
  const sp_rpc_method *m = call->method;
  if (unary_request(m)) {
    if (++call->n_requests > 1) {
      call_end(call, SP_RPC_UNIMPLEMENTED,
               "more than one request message for a unary-request method");
      return 0;
    }
    sp_rpc_server *srv = call->conn->srv;
    /* A reassembled message is kept as it is: copying 16 requests of
     * 8 MiB that complete in one read cost 64 ms of page faults there. */
    size_t charged = 0, cap = 0;
    uint8_t *own = sp_rpc_deframer_take(&call->df, &charged, &cap);
    if (own != NULL) {
      call->unary_req = own;
      call->unary_len = len;
      call->unary_charged = charged;
      call->unary_cap = cap;
      return 0;
    }
    if (srv->buffered + len > srv->opts.max_buffered) {
      srv->stats.calls_over_budget++;
      call_fail(call, SP_RPC_RESOURCE_EXHAUSTED,
                "request of %zu bytes: the server's buffers are full (limit "
                "%zu bytes)",
                len, srv->opts.max_buffered);
      return 0;
    }
    call->unary_req = sp_rpc_mem_alloc(&srv->mem, len ? len : 1);
    if (call->unary_req == NULL) {
      call_end(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return 0;
    }
    memcpy(call->unary_req, data, len);
    call->unary_len = call->unary_charged = len;
    buffered_add(srv, len);
    return 0;
  }
  return submit_message(call, data, len);
}

static void request_half_closed(sp_rpc_call *call) {
  call->remote_closed = true;
  if (call->finished || call->method == NULL) return;
  if (sp_rpc_deframer_partial(&call->df)) {
    call_fail(call, SP_RPC_INTERNAL, "request ended inside a message");
    return;
  }
  const sp_rpc_method *m = call->method;
  if (unary_request(m)) {
    if (call->n_requests != 1) {
      call_end(call, SP_RPC_UNIMPLEMENTED,
               "no request message for a unary-request method");
      return;
    }
    if (call->timer_is_request) {
      /* complete in time: from here only the client's deadline counts */
      call->timer_is_request = false;
      if (call->timeout_ms >= 0) {
        uint64_t now = loop_now(call->conn->srv);
        call_arm_timer(call, call->deadline > now ? call->deadline - now : 0);
      } else {
        call_stop_timer(call);
      }
    }
  }
  submit_half_close(call);
}

/* The call of stream id (see cur_call); NULL: none, or it is gone. */
static sp_rpc_call *stream_call(srv_conn *c, nghttp2_session *s, int32_t id) {
  if (c->cur_call != NULL && c->cur_id == id) return c->cur_call;
  sp_rpc_call *call = nghttp2_session_get_stream_user_data(s, id);
  if (call != NULL) {
    c->cur_id = id;
    c->cur_call = call;
  }
  return call;
}

static int cb_begin_headers(nghttp2_session *s, const nghttp2_frame *f,
                            void *ud) {
  srv_conn *c = ud;
  if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0;
  sp_rpc_call *call = sp_rpc_mem_calloc(&c->srv->mem, 1, sizeof *call);
  if (call == NULL) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  call->conn = c;
  call->req_md.mem = call->resp_md.mem = call->q.mem = &c->srv->mem;
  call->stream_id = f->hd.stream_id;
  call->timeout_ms = -1;
  call->route = -1;
  uint64_t t0 = srv_us(c->srv);
  call->t0_lo = (uint32_t)t0;
  call->t0_hi = (uint16_t)(t0 >> 32);
  sp_rpc_deframer_init(&call->df, c->srv->opts.max_message);
  call->df.used = &c->srv->buffered;
  call->df.used_max = c->srv->opts.max_buffered;
  call->next = c->calls;
  if (c->calls) c->calls->prev = call;
  c->calls = call;
  c->srv->stats.calls_open++;
  c->srv->stats.calls_total++;
  nghttp2_session_set_stream_user_data(s, f->hd.stream_id, call);
  c->cur_id = f->hd.stream_id;
  c->cur_call = call;
  return 0;
}

static bool starts_with(const uint8_t *v, size_t len, const char *p) {
  size_t n = strlen(p);
  return len >= n && memcmp(v, p, n) == 0;
}

static int cb_header(nghttp2_session *s, const nghttp2_frame *f,
                     const uint8_t *name, size_t nlen, const uint8_t *value,
                     size_t vlen, uint8_t flags, void *ud) {
  (void)flags;
  if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0; /* request trailers are ignored */
  sp_rpc_call *call = stream_call(ud, s, f->hd.stream_id);
  if (call == NULL) return 0;
  if (nlen > 0 && name[0] == ':') {
    if (nlen == 5 && memcmp(name, ":path", 5) == 0) {
      free(call->unknown_path);
      call->unknown_path = NULL;
      call->route = -1;
      srv_conn *c = call->conn;
      const sp_rpc_server *srv = c->srv;
      char path[256];
      if (c->last_route >= 0 && (size_t)c->last_route < srv->n_methods &&
          strlen(srv->methods[c->last_route]->path) == vlen &&
          memcmp(srv->methods[c->last_route]->path, value, vlen) == 0) {
        /* a connection mostly calls one method again and again: checking
         * the last one spares hashing the path (bench/rpc: 1% of the
         * server's instructions per call) */
        call->route = c->last_route;
      } else if (vlen < sizeof path) {
        memcpy(path, value, vlen);
        path[vlen] = '\0';
        call->route = sp_strmap_get(srv->paths, path);
        if (call->route >= 0) c->last_route = call->route;
      }
      if (call->route < 0) {
        /* a name too long for any method is unknown as well */
        size_t n = vlen < sizeof path ? vlen : sizeof path - 1;
        call->unknown_path = malloc(n + 1);
        if (call->unknown_path == NULL)
          return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
        memcpy(call->unknown_path, value, n);
        call->unknown_path[n] = '\0';
      }
    } else if (nlen == 7 && memcmp(name, ":method", 7) == 0) {
      call->is_post = vlen == 4 && memcmp(value, "POST", 4) == 0;
    }
    return 0;
  }
  if (nlen == 12 && memcmp(name, "content-type", 12) == 0) {
    call->grpc_content_type =
        starts_with(value, vlen, "application/grpc") &&
        (vlen == 16 || value[16] == '+' || value[16] == ';');
    return 0;
  }
  if (nlen == 12 && memcmp(name, "grpc-timeout", 12) == 0) {
    call->timeout_ms = sp_rpc_timeout_parse((const char *)value, vlen);
    return 0;
  }
  if (nlen == 13 && memcmp(name, "grpc-encoding", 13) == 0) {
    call->bad_encoding = !(vlen == 8 && memcmp(value, "identity", 8) == 0);
    return 0;
  }
  if (nlen == 2 && memcmp(name, "te", 2) == 0) return 0;
  if (nlen >= 5 && memcmp(name, "grpc-", 5) == 0) return 0; /* reserved */
  size_t budget = call->conn->srv->opts.max_metadata;
  int rc;
  if (sp_rpc_md_key_is_bin((const char *)name, nlen)) {
    uint8_t *raw = malloc(vlen + 1);
    if (raw == NULL) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    long n = sp_rpc_b64_decode((const char *)value, vlen, raw);
    rc = n < 0 ? 0 /* undecodable: drop the entry */
               : sp_rpc_mdlist_add(&call->req_md, (const char *)name, nlen, raw,
                                   (size_t)n, budget);
    free(raw);
  } else {
    rc = sp_rpc_mdlist_add(&call->req_md, (const char *)name, nlen, value, vlen,
                           budget);
  }
  if (rc == SP_ETOOBIG)
    call->md_overflow = true;
  else if (rc != 0)
    return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  return 0;
}

static int cb_data_chunk(nghttp2_session *s, uint8_t flags, int32_t id,
                         const uint8_t *data, size_t len, void *ud) {
  (void)flags;
  srv_conn *c = ud;
  c->srv->stats.bytes_in += len;
  sp_rpc_call *call = stream_call(c, s, id);
  if (call == NULL || call->finished || call->method == NULL) return 0;
  c->srv->stats.body_bytes += len;
  uint64_t announced = 0;
  int rc = sp_rpc_deframer_feed(&call->df, data, len, on_request_message, call,
                                &announced);
  if (rc == SP_ETOOBIG)
    call_fail(call, SP_RPC_RESOURCE_EXHAUSTED,
              "request message of %llu bytes is over the limit of %zu",
              (unsigned long long)announced, c->srv->opts.max_message);
  else if (rc == SP_EUNSUPPORTED)
    call_fail(call, SP_RPC_INTERNAL,
              "compressed message but no grpc-encoding was negotiated");
  else if (rc == SP_EAGAIN) {
    c->srv->stats.calls_over_budget++;
    call_fail(call, SP_RPC_RESOURCE_EXHAUSTED,
              "request message of %llu bytes: the server's buffers are full "
              "(limit %zu bytes)",
              (unsigned long long)call->df.need, c->srv->opts.max_buffered);
  } else if (rc != 0)
    call_fail(call, SP_RPC_INTERNAL, "malformed message framing");
  if (c->srv->buffered > c->srv->stats.buffered_peak)
    c->srv->stats.buffered_peak = c->srv->buffered;
  return 0;
}

static int cb_frame_recv(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
  if (f->hd.type != NGHTTP2_HEADERS && f->hd.type != NGHTTP2_DATA) return 0;
  /* the stream may already be closed: fetch and check again */
  sp_rpc_call *call = stream_call(ud, s, f->hd.stream_id);
  if (call == NULL) return 0;
  if (f->hd.type == NGHTTP2_HEADERS && f->headers.cat == NGHTTP2_HCAT_REQUEST)
    request_headers_done(call);
  if (f->hd.flags & NGHTTP2_FLAG_END_STREAM) request_half_closed(call);
  return 0;
}

static int cb_frame_send(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
  (void)ud;
  /* Trailers went out before the client finished sending: follow them with
   * RST_STREAM(NO_ERROR), as gRPC's Java and Go servers do, so the client
   * stops sending without treating the call as failed. Submitting it earlier would drop
   * the queued trailers. */
  if (f->hd.type == NGHTTP2_HEADERS &&
      (f->hd.flags & NGHTTP2_FLAG_END_STREAM) &&
      nghttp2_session_get_stream_remote_close(s, f->hd.stream_id) == 0)
    nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, f->hd.stream_id,
                              NGHTTP2_NO_ERROR);
  return 0;
}

static int cb_stream_close(nghttp2_session *s, int32_t id, uint32_t err,
                           void *ud) {
  sp_rpc_call *call = stream_call(ud, s, id);
  if (call == NULL) return 0;
  nghttp2_session_set_stream_user_data(s, id, NULL);
  /* the only place stream state is freed: nghttp2 may still call back for
   * a stream until on_stream_close, so freeing it anywhere else leaves a
   * dangling stream user-data pointer */
  (void)err; /* whatever ended the stream, an unfinished handler is cancelled */
  call_release(call, SP_RPC_CANCELLED);
  call_free(call);
  return 0;
}

/* ---------------- connections ---------------- */

/* After a read: the request timers of the unary calls whose request is
 * still incomplete (see request_headers_done). */
static void arm_request_timers(srv_conn *c) {
  while (c->arm != NULL) {
    sp_rpc_call *call = c->arm;
    c->arm = call->arm_next;
    call->arm_next = NULL;
    call->arm_listed = false;
    if (call->timer_is_request && !call->finished)
      call_arm_timer(call, c->srv->opts.request_timeout_ms);
  }
}

static void conn_after_send(sp_h2conn *io) {
  srv_conn *c = io->owner;
  arm_request_timers(c);
  while (c->notify != NULL) {
    sp_rpc_call *call = c->notify;
    c->notify = call->notify_next;
    call->notify_next = NULL;
    call->notify_queued = false;
    if (call->on_writable != NULL && !call->released) call->on_writable(call);
  }
}

static void conn_flush(srv_conn *c) { sp_h2conn_flush(&c->io); }

static void flush_unlist(srv_conn *c) {
  if (!c->flush_queued) return;
  c->flush_queued = false;
  if (c->flush_prev)
    c->flush_prev->flush_next = c->flush_next;
  else
    c->srv->flush_head = c->flush_next;
  if (c->flush_next) c->flush_next->flush_prev = c->flush_prev;
  c->flush_next = c->flush_prev = NULL;
}

/* Writes out every connection on the list, also those that sends made
 * meanwhile put there (flushing runs on_writable handlers). */
static void flush_all_queued(sp_rpc_server *srv) {
  while (srv->flush_head != NULL) {
    srv_conn *c = srv->flush_head;
    flush_unlist(c);
    conn_flush(c);
  }
}

static void on_flush(uv_idle_t *h) {
  struct srv_handles *hs = h->data;
  flush_all_queued(hs->srv);
  uv_idle_stop(h);
}

/* A send outside the connection's own callbacks (inside them, the flush
 * after nghttp2 returns writes it anyway) is written from an idle handle,
 * with whatever else that connection gets meanwhile: one write per
 * connection and loop iteration. An active idle handle keeps the loop
 * from blocking in poll, so a send made after the idle handles ran (a
 * prepare handle's, as the state dir's commit answers) still goes out
 * without waiting for I/O: the next iteration writes it. A rendezvous
 * wakes all its waiters from one StoreSet; with a write each, 100,000
 * ranks on 12,500 agent connections took 100,000 writes where 12,500 do
 * (bench/coordinator: the wake-up took 0.82x and 0.84x as long, in two
 * interleaved runs on a loaded machine). In-memory connections (no loop
 * to wait for) write at once. */
static void conn_flush_soon(srv_conn *c) {
  sp_rpc_server *srv = c->srv;
  if (c->io.in_h2 || c->io.sink != NULL || srv->h == NULL || c->io.closing) {
    conn_flush(c);
    return;
  }
  if (c->flush_queued) return;
  c->flush_queued = true;
  c->flush_prev = NULL;
  c->flush_next = srv->flush_head;
  if (srv->flush_head) srv->flush_head->flush_prev = c;
  srv->flush_head = c;
  if (!uv_is_active((uv_handle_t *)&srv->h->flush))
    uv_idle_start(&srv->h->flush, on_flush);
}

/* ---------------- connection limits ---------------- */

/* An evicted or timed-out connection is told with GOAWAY and closes by
 * itself once that is written; one whose peer does not read is closed
 * this long after anyway. */
#define SP_RPC_GOAWAY_CLOSE_MS 2000u

static void handles_closed(uv_handle_t *h) {
  struct srv_handles *hs = h->data;
  if (--hs->open > 0) return;
  sp_rpc_server *notify = hs->notify;
  free(hs);
  if (notify != NULL) sp_rpc_server_handle_closed(notify);
}

/* Closes the loop handles; with count, shutdown waits for them. */
static void handles_close(sp_rpc_server *srv, bool count) {
  struct srv_handles *hs = srv->h;
  if (hs == NULL) return;
  flush_all_queued(srv); /* nothing may wait for a handle that is gone */
  srv->h = NULL;
  if (count) {
    srv->open_handles++;
    hs->notify = srv;
  }
  uv_close((uv_handle_t *)&hs->flush, handles_closed);
  uv_close((uv_handle_t *)&hs->idle, handles_closed);
  uv_close((uv_handle_t *)&hs->check, handles_closed);
  uv_close((uv_handle_t *)&hs->sweep, handles_closed);
}

static int handles_get(sp_rpc_server *srv) {
  if (srv->h != NULL) return 0;
  struct srv_handles *hs = calloc(1, sizeof *hs);
  if (hs == NULL) return SP_ENOMEM;
  hs->srv = srv;
  hs->open = 4;
  uv_idle_init(srv->loop, &hs->idle);
  uv_idle_init(srv->loop, &hs->flush);
  uv_check_init(srv->loop, &hs->check);
  uv_timer_init(srv->loop, &hs->sweep);
  hs->idle.data = hs->flush.data = hs->check.data = hs->sweep.data = hs;
  uv_check_start(&hs->check, on_iteration_end);
  /* neither keeps the loop alive: they only serve connections, which do */
  uv_unref((uv_handle_t *)&hs->check);
  uv_unref((uv_handle_t *)&hs->sweep);
  uv_unref((uv_handle_t *)&hs->flush);
  srv->h = hs;
  return 0;
}

/* Says why in a GOAWAY and lets the connection close; it no longer counts
 * against max_connections. */
static void conn_goaway(srv_conn *c, const char *why) {
  if (c->evicting || c->io.closing) return;
  sp_rpc_server *srv = c->srv;
  c->evicting = true;
  srv->live_conns--;
  c->kill_at_ms = loop_now(srv) + SP_RPC_GOAWAY_CLOSE_MS;
  nghttp2_session *h2 = c->io.h2;
  if (h2 == NULL) {
    sp_h2conn_close(&c->io);
    return;
  }
  nghttp2_submit_goaway(h2, NGHTTP2_FLAG_NONE,
                        nghttp2_session_get_last_proc_stream_id(h2),
                        NGHTTP2_NO_ERROR, (const uint8_t *)why, strlen(why));
  conn_flush(c);
}

/* Walks the connections for the preface and idle timeouts, and closes
 * those told by GOAWAY that are still there. One timer for all: a
 * coordinator holds thousands of connections, and a timer each would cost
 * every one of them. */
static void on_sweep(uv_timer_t *t) {
  struct srv_handles *hs = t->data;
  sp_rpc_server *srv = hs->srv;
  const sp_rpc_server_opts *o = &srv->opts;
  uint64_t now = loop_now(srv);
  char why[96];
  /* the free blocks go back to malloc between bursts (rpc_mem.h) */
  sp_rpc_mem_release(&srv->mem);
  /* mallinfo2 walks every free chunk (0.4 us each: 120 ms for 300,000),
   * too dear for every sweep of a fragmented heap: it looks only once
   * enough calls ended to have freed the threshold, at about 1 KiB a call
   * (its sp_rpc_call, nghttp2's stream, the request). A Session stream's
   * messages end no call, so streaming never pays for it. */
  uint64_t ended = srv->stats.calls_total - srv->stats.calls_open;
  if (srv->trim.threshold != 0 &&
      ended - srv->trim_ended >= srv->trim.threshold / 1024) {
    srv->trim_ended = ended;
    if (sp_rpc_mem_trim(&srv->trim)) srv->stats.heap_trims++;
  }
  for (srv_conn *c = srv->conns, *next; c != NULL; c = next) {
    next = c->next;
    if (c->io.closing || c->io.sink != NULL) continue;
    if (c->evicting) {
      if (now >= c->kill_at_ms) sp_h2conn_close(&c->io);
      continue;
    }
    if (!c->had_request && now - c->accepted_ms >= o->preface_timeout_ms) {
      srv->stats.connections_preface_closed++;
      snprintf(why, sizeof why, "no request within %llu ms of connecting",
               (unsigned long long)o->preface_timeout_ms);
      conn_goaway(c, why);
    } else if (c->calls == NULL && o->idle_timeout_ms != UINT64_MAX &&
               now - c->idle_since_ms >= o->idle_timeout_ms) {
      srv->stats.connections_idle_closed++;
      snprintf(why, sizeof why, "idle for %llu ms",
               (unsigned long long)o->idle_timeout_ms);
      conn_goaway(c, why);
    }
  }
}

static void sweep_start(sp_rpc_server *srv) {
  if (srv->h == NULL || uv_is_active((uv_handle_t *)&srv->h->sweep)) return;
  const sp_rpc_server_opts *o = &srv->opts;
  uint64_t every = o->preface_timeout_ms;
  if (o->idle_timeout_ms < every) every = o->idle_timeout_ms;
  if (SP_RPC_GOAWAY_CLOSE_MS < every) every = SP_RPC_GOAWAY_CLOSE_MS;
  every /= 4; /* a connection overstays a limit by at most a quarter */
  if (every < 5) every = 5;
  if (every > 1000) every = 1000;
  uv_update_time(srv->loop);
  uv_timer_start(&srv->h->sweep, on_sweep, every, every);
}

/* All connection slots taken: make room by closing the connection with no
 * open call that has been idle longest, so a worker that attaches is not
 * refused because idle clients hold every slot. False when none is idle. */
static bool evict_idle(sp_rpc_server *srv, const srv_conn *keep) {
  srv_conn *victim = NULL;
  for (srv_conn *x = srv->conns; x != NULL; x = x->next) {
    if (x == keep || x->evicting || x->io.closing || x->calls != NULL ||
        x->io.sink != NULL)
      continue;
    if (victim == NULL || x->idle_since_ms < victim->idle_since_ms) victim = x;
  }
  if (victim == NULL) return false;
  srv->stats.connections_idle_closed++;
  conn_goaway(victim, "too many connections: the longest idle one is closed");
  return true;
}

/* The default connection limit: below the fd limit with room for the
 * process's other files, so accept never fails for want of a descriptor. */
static uint32_t default_max_connections(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
      rl.rlim_cur > 65536 + SP_RPC_FD_HEADROOM)
    return 65536;
  uint64_t n = rl.rlim_cur;
  uint64_t room = n >= 4 * SP_RPC_FD_HEADROOM ? SP_RPC_FD_HEADROOM : n / 4;
  return n > room ? (uint32_t)(n - room) : 1;
}

static void conn_closed(sp_h2conn *io) {
  srv_conn *c = io->owner;
  sp_rpc_server *srv = c->srv;
  /* nghttp2_session_del does not report stream closes: end them here */
  while (c->calls != NULL) {
    sp_rpc_call *call = c->calls;
    call_release(call,
                 srv->shutting_down ? SP_RPC_UNAVAILABLE : SP_RPC_CANCELLED);
    call_free(call);
  }
  flush_unlist(c);
  if (c->prev)
    c->prev->next = c->next;
  else
    srv->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  srv->stats.connections_open--;
  if (!c->evicting) srv->live_conns--;
  srv->stats.bytes_out += io->bytes_out;
  if (c->gone != NULL) *c->gone = true;
  free(c);
  sp_rpc_server_handle_closed(srv);
}

static int session_new(srv_conn *c) {
  nghttp2_session_callbacks *cb;
  if (nghttp2_session_callbacks_new(&cb) != 0) return SP_ENOMEM;
  nghttp2_session_callbacks_set_on_begin_headers_callback(cb, cb_begin_headers);
  nghttp2_session_callbacks_set_on_header_callback(cb, cb_header);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, cb_data_chunk);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cb, cb_frame_recv);
  nghttp2_session_callbacks_set_on_frame_send_callback(cb, cb_frame_send);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, cb_stream_close);
  nghttp2_option *opt;
  if (nghttp2_option_new(&opt) != 0) {
    nghttp2_session_callbacks_del(cb);
    return SP_ENOMEM;
  }
  nghttp2_option_set_max_send_header_block_length(opt, 64u << 10);
  /* nghttp2 otherwise keeps up to max_streams closed streams per
   * connection for the priority tree (RFC 9113 deprecated priorities;
   * gRPC sends none): ~220 bytes each, on every long-lived connection.
   * Frames for a stream closed on both sides are then ignored rather than
   * answered with a connection error. */
  nghttp2_option_set_no_closed_streams(opt, 1);
  bool no_tables = c->srv->opts.no_header_tables;
  /* what we send: literals only, never indexed (no table to keep) */
  if (no_tables) nghttp2_option_set_max_deflate_dynamic_table_size(opt, 0);
  int rv = nghttp2_session_server_new3(&c->io.h2, cb, c, opt, &c->srv->mem.nv);
  nghttp2_option_del(opt);
  nghttp2_session_callbacks_del(cb);
  if (rv != 0) return SP_ENOMEM;
  /* NO_RFC7540_PRIORITIES: gRPC sends no priorities, and without the
   * RFC 7540 dependency tree nghttp2 schedules streams from a plain queue
   * (2% fewer instructions per unary call, client and server, callgrind
   * over bench/rpc); a peer's PRIORITY frames are then ignored. */
  nghttp2_settings_entry iv[5] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, c->srv->opts.max_streams},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1u << 20},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE,
       (uint32_t)c->srv->opts.max_metadata + 1024},
      {NGHTTP2_SETTINGS_NO_RFC7540_PRIORITIES, 1},
  };
  size_t niv = 4;
  /* What clients send: once they ACK this, RFC 7541 §4.2 has their encoder
   * open the next header block with a table size update, and nghttp2
   * refuses a block without one (COMPRESSION_ERROR). Blocks encoded before
   * the ACK may still index; nghttp2 drops those entries when it comes. */
  if (no_tables)
    iv[niv++] = (nghttp2_settings_entry){NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 0};
  nghttp2_submit_settings(c->io.h2, NGHTTP2_FLAG_NONE, iv, niv);
  nghttp2_session_set_local_window_size(c->io.h2, NGHTTP2_FLAG_NONE, 0,
                                        16u << 20);
  return 0;
}

/* A linked, counted connection with an initialised (unconnected) handle;
 * from here on it goes away only through sp_h2conn_close. */
static srv_conn *conn_new(sp_rpc_server *srv, bool pipe) {
  if (handles_get(srv) != 0) return NULL;
  srv_conn *c = calloc(1, sizeof *c);
  if (c == NULL) return NULL;
  if ((pipe ? sp_h2conn_init_pipe(&c->io, srv->loop, c)
            : sp_h2conn_init(&c->io, srv->loop, c)) != 0) {
    free(c);
    return NULL;
  }
  c->srv = srv;
  c->last_route = -1;
  c->io.shared = &srv->shared;
  c->id = ++srv->next_conn_id;
  c->io.on_closed = conn_closed;
  c->io.on_after_send = conn_after_send;
  c->next = srv->conns;
  if (srv->conns) srv->conns->prev = c;
  srv->conns = c;
  srv->open_handles++;
  srv->live_conns++;
  srv->stats.connections_open++;
  srv->stats.connections_total++;
  c->accepted_ms = c->idle_since_ms = loop_now(srv);
  return c;
}

/* A Unix-socket peer must run under this process's uid: the socket's
 * directory keeps others out, and this check holds if it is opened up.
 * Writes "unix:pid=N" to peer. */
static bool pipe_peer_ok(srv_conn *c) {
  uv_os_fd_t fd;
  struct ucred cr;
  socklen_t len = sizeof cr;
  if (uv_fileno((uv_handle_t *)&c->io.pipe, &fd) != 0 ||
      getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0)
    return false;
  snprintf(c->peer, sizeof c->peer, "unix:pid=%ld", (long)cr.pid);
  return cr.uid == geteuid();
}

static void on_connection(uv_stream_t *server, int status) {
  listener *l = server->data;
  sp_rpc_server *srv = l->srv;
  if (status < 0) return;
  srv_conn *c = conn_new(srv, l->is_pipe);
  if (c == NULL) return;
  if (uv_accept(server, (uv_stream_t *)&c->io.tcp) != 0 || srv->shutting_down ||
      (l->is_pipe && !pipe_peer_ok(c)) || session_new(c) != 0) {
    sp_h2conn_close(&c->io);
    return;
  }
  if (srv->tls != NULL) {
    sp_tls_conn *t;
    if (sp_tls_conn_new(srv->tls, true, NULL, &t) != 0) {
      sp_h2conn_close(&c->io);
      return;
    }
    sp_h2conn_tls(&c->io, t);
  }
  bool refuse =
      srv->live_conns > srv->opts.max_connections && !evict_idle(srv, c);
  sweep_start(srv);
  struct sockaddr_storage ss;
  int len = sizeof ss;
  if (!l->is_pipe) {
    uv_tcp_nodelay(&c->io.tcp, 1);
    if (uv_tcp_getpeername(&c->io.tcp, (struct sockaddr *)&ss, &len) == 0)
      sp_rpc_format_sockaddr((struct sockaddr *)&ss, c->peer, sizeof c->peer);
  }
  if (sp_h2conn_start(&c->io) != 0) {
    sp_h2conn_close(&c->io);
    return;
  }
  if (refuse) {
    /* every slot busy with calls: this one is told why and goes */
    srv->stats.connections_refused++;
    conn_goaway(c, "too many connections");
    return;
  }
  conn_flush(c);
}

/* ---------------- in-memory connections (tests, fuzzing) ---------------- */

static int feed_sink(sp_h2conn *io, const uint8_t *data, size_t len) {
  srv_conn *c = io->owner;
  return c->feed_sink != NULL ? c->feed_sink(c->feed_arg, data, len) : 0;
}

int sp_rpc_server_feed_bytes(
    sp_rpc_server *srv, const uint8_t *data, size_t len, size_t chunk,
    int (*sink)(void *arg, const uint8_t *out, size_t n), void *arg) {
  if (srv == NULL || (data == NULL && len > 0)) return SP_EINVAL;
  if (srv->shutting_down) return SP_ESTATE;
  srv_conn *c = conn_new(srv, false);
  if (c == NULL) return SP_ENOMEM;
  bool gone = false;
  c->gone = &gone;
  c->feed_sink = sink;
  c->feed_arg = arg;
  c->io.sink = feed_sink;
  snprintf(c->peer, sizeof c->peer, "memory");
  int rc = session_new(c);
  if (rc == 0) {
    conn_flush(c);
    size_t step = chunk > 0 ? chunk : len;
    /* `gone` is checked first: a close inside uv_run frees c */
    for (size_t off = 0; off < len && !gone && !c->io.closing; off += step) {
      size_t n = len - off < step ? len - off : step;
      sp_h2conn_recv(&c->io, data + off, n);
      /* work handlers put on the loop (zero-delay timers, on_writable)
       * runs between chunks, as it would between reads */
      uv_run(srv->loop, UV_RUN_NOWAIT);
    }
    for (int i = 0; i < 4 && !gone && !c->io.closing; i++)
      uv_run(srv->loop, UV_RUN_NOWAIT);
    /* requests left on the ready list get their iterations */
    for (int i = 0;
         i < 100000 && !gone && !c->io.closing && srv->ready_head != NULL; i++)
      uv_run(srv->loop, UV_RUN_NOWAIT);
  }
  if (!gone) sp_h2conn_close(&c->io);
  /* close callbacks never block the loop, so this ends after an iteration;
   * conn_closed cancels the calls left and frees c */
  while (!gone) uv_run(srv->loop, UV_RUN_NOWAIT);
  return rc;
}

/* ---------------- server ---------------- */

static void *pb_alloc(void *mem, size_t size) {
  return sp_rpc_mem_alloc(mem, size);
}
static void pb_free(void *mem, void *p) { sp_rpc_mem_free(mem, p); }

int sp_rpc_server_new(uv_loop_t *loop, const sp_rpc_server_opts *opts,
                      sp_rpc_server **out) {
  if (loop == NULL || out == NULL) return SP_EINVAL;
  sp_rpc_server *srv = calloc(1, sizeof *srv);
  if (srv == NULL) return SP_ENOMEM;
  srv->loop = loop;
  srv->t0_ns = uv_hrtime();
  sp_rpc_mem_init(&srv->mem);
  srv->pb_mem = (ProtobufCAllocator){pb_alloc, pb_free, &srv->mem};
  if (opts) srv->opts = *opts;
  if (!srv->opts.max_message)
    srv->opts.max_message = SP_RPC_DEFAULT_MAX_MESSAGE;
  if (!srv->opts.max_metadata)
    srv->opts.max_metadata = SP_RPC_DEFAULT_MAX_METADATA;
  if (!srv->opts.max_streams)
    srv->opts.max_streams = SP_RPC_DEFAULT_MAX_STREAMS;
  if (!srv->opts.max_pending)
    srv->opts.max_pending = SP_RPC_DEFAULT_MAX_PENDING;
  if (!srv->opts.max_conn_pending)
    srv->opts.max_conn_pending = SP_RPC_DEFAULT_MAX_CONN_PENDING;
  if (!srv->opts.max_connections)
    srv->opts.max_connections = default_max_connections();
  if (!srv->opts.preface_timeout_ms)
    srv->opts.preface_timeout_ms = SP_RPC_DEFAULT_PREFACE_TIMEOUT_MS;
  if (!srv->opts.idle_timeout_ms)
    srv->opts.idle_timeout_ms = SP_RPC_DEFAULT_IDLE_TIMEOUT_MS;
  if (!srv->opts.request_timeout_ms)
    srv->opts.request_timeout_ms = SP_RPC_DEFAULT_REQUEST_TIMEOUT_MS;
  if (!srv->opts.max_buffered)
    srv->opts.max_buffered = SP_RPC_DEFAULT_MAX_BUFFERED;
  srv->trim.threshold = srv->opts.trim_heap_bytes;
  srv->paths = sp_strmap_new(32);
  if (srv->paths == NULL) {
    free(srv);
    return SP_ENOMEM;
  }
  int rc = sp_rpc_health_init(srv, &srv->health);
  if (rc != 0) {
    sp_rpc_server_free(srv);
    return rc;
  }
  *out = srv;
  return 0;
}

int sp_rpc_server_add_methods(sp_rpc_server *srv, const sp_rpc_method *m,
                              size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (m[i].path == NULL || m[i].on_message == NULL) return SP_EINVAL;
    if (sp_strmap_get(srv->paths, m[i].path) >= 0) return SP_EEXIST;
    if (srv->n_methods == srv->cap_methods) {
      size_t cap = srv->cap_methods ? srv->cap_methods * 2 : 16;
      const sp_rpc_method **a = realloc(srv->methods, cap * sizeof *a);
      if (a == NULL) return SP_ENOMEM;
      srv->methods = a;
      method_rec *r = realloc(srv->recs, cap * sizeof *r);
      if (r == NULL) return SP_ENOMEM;
      memset(r + srv->cap_methods, 0, (cap - srv->cap_methods) * sizeof *r);
      srv->recs = r;
      srv->cap_methods = cap;
    }
    int rc = sp_strmap_put(srv->paths, m[i].path, (int32_t)srv->n_methods);
    if (rc != 0) return rc;
    srv->methods[srv->n_methods++] = &m[i];
  }
  return 0;
}

static void listener_closed(uv_handle_t *h) {
  listener *l = h->data;
  sp_rpc_server *srv = l->srv;
  free(l);
  sp_rpc_server_handle_closed(srv);
}

int sp_rpc_server_listen(sp_rpc_server *srv, const char *addr, int *port_out,
                         sp_diag *diag) {
  struct sockaddr_storage ss;
  int rc = sp_rpc_resolve(addr, &ss, diag);
  if (rc != 0) return rc;
  if (srv->opts.tls != NULL && srv->tls == NULL) {
    rc = sp_tls_server_ctx_new(srv->opts.tls, &srv->tls, diag);
    if (rc != 0) return rc;
  }
  srv->opts.tls = NULL; /* its strings need not outlive this call */
  listener *l = calloc(1, sizeof *l);
  if (l == NULL) return SP_ENOMEM;
  l->srv = srv;
  l->is_pipe = ss.ss_family == AF_UNIX;
  if (l->is_pipe)
    uv_pipe_init(srv->loop, &l->pipe, 0);
  else
    uv_tcp_init(srv->loop, &l->tcp);
  l->tcp.data = l;
  srv->open_handles++;
  int uvrc = l->is_pipe
                 ? uv_pipe_bind(&l->pipe, ((struct sockaddr_un *)&ss)->sun_path)
                 : uv_tcp_bind(&l->tcp, (struct sockaddr *)&ss, 0);
  if (uvrc == 0 && l->is_pipe &&
      chmod(((struct sockaddr_un *)&ss)->sun_path, 0600) != 0)
    uvrc = uv_translate_sys_error(errno);
  /* the kernel caps the backlog at somaxconn; ask for plenty so thousands
   * of ranks attaching at once are not reset */
  if (uvrc == 0) uvrc = uv_listen((uv_stream_t *)&l->tcp, 65535, on_connection);
  if (uvrc != 0) {
    uv_close((uv_handle_t *)&l->tcp, listener_closed);
    return sp_diag_set(diag, SP_EIO, "cannot listen on %s: %s", addr,
                       uv_strerror(uvrc));
  }
  if (port_out != NULL && l->is_pipe) {
    *port_out = 0;
  } else if (port_out != NULL) {
    struct sockaddr_storage b;
    int len = sizeof b;
    uv_tcp_getsockname(&l->tcp, (struct sockaddr *)&b, &len);
    *port_out =
        ntohs(b.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&b)->sin6_port
                                      : ((struct sockaddr_in *)&b)->sin_port);
  }
  l->next = srv->listeners;
  srv->listeners = l;
  return 0;
}

static void grace_closed(uv_handle_t *h);

/* Shutdown completes once every listener and connection is closed and the
 * grace timer is released. */
static void maybe_finish_shutdown(sp_rpc_server *srv) {
  if (!srv->shutting_down || srv->open_handles > 0 || srv->done_called) return;
  if (srv->h != NULL) { /* last, as handlers may run until here */
    handles_close(srv, true);
    return;
  }
  if (srv->grace_started && !srv->grace_closed) {
    if (!srv->grace_closing) {
      srv->grace_closing = true;
      uv_timer_stop(&srv->grace_timer);
      uv_close((uv_handle_t *)&srv->grace_timer, grace_closed);
    }
    return;
  }
  srv->done_called = true;
  if (srv->shutdown_done) srv->shutdown_done(srv, srv->shutdown_arg);
}

static void grace_closed(uv_handle_t *h) {
  sp_rpc_server *srv = h->data;
  srv->grace_closed = true;
  maybe_finish_shutdown(srv);
}

void sp_rpc_server_handle_closed(sp_rpc_server *srv) {
  srv->open_handles--;
  maybe_finish_shutdown(srv);
}

static void grace_expired(uv_timer_t *t) {
  sp_rpc_server *srv = t->data;
  /* calls still running: drop the connections, which cancels the handlers
   * with UNAVAILABLE */
  for (srv_conn *c = srv->conns; c; c = c->next) {
    sp_h2conn_close_notify(&c->io);
    sp_h2conn_close(&c->io);
  }
}

void sp_rpc_server_shutdown(sp_rpc_server *srv, uint64_t grace_ms,
                            void (*done)(sp_rpc_server *, void *), void *arg) {
  if (srv->shutting_down) return;
  srv->shutting_down = true;
  srv->shutdown_done = done;
  srv->shutdown_arg = arg;
  for (listener *l = srv->listeners; l;) {
    listener *n = l->next;
    uv_close((uv_handle_t *)&l->tcp, listener_closed);
    l = n;
  }
  srv->listeners = NULL;
  sp_rpc_health_shutdown(&srv->health);
  for (srv_conn *c = srv->conns; c; c = c->next) {
    nghttp2_session *h2 = c->io.h2;
    if (h2 == NULL) continue;
    /* streams after the last one we processed are refused; the connection
     * closes by itself when its open streams end (RFC 9113 §6.8) */
    nghttp2_submit_goaway(h2, NGHTTP2_FLAG_NONE,
                          nghttp2_session_get_last_proc_stream_id(h2),
                          NGHTTP2_NO_ERROR, NULL, 0);
    conn_flush(c);
  }
  uv_timer_init(srv->loop, &srv->grace_timer);
  srv->grace_timer.data = srv;
  srv->grace_started = true;
  uv_update_time(srv->loop); /* shutdown may be called outside the loop */
  uv_timer_start(&srv->grace_timer, grace_expired, grace_ms, 0);
  maybe_finish_shutdown(srv);
}

void sp_rpc_server_free(sp_rpc_server *srv) {
  if (srv == NULL) return;
  handles_close(srv, false); /* freed without a shutdown */
  sp_rpc_health_free(&srv->health);
  sp_strmap_free(srv->paths);
  free(srv->methods);
  free(srv->recs);
  free(srv->shared.rbuf);
  free(srv->shared.wbuf);
  SSL_CTX_free(srv->tls);
  sp_rpc_mem_release(&srv->mem);
  free(srv);
}

int sp_rpc_server_set_health(sp_rpc_server *srv, const char *service,
                             sp_rpc_health status) {
  return sp_rpc_health_set(&srv->health, service, status);
}

void sp_rpc_server_get_stats(const sp_rpc_server *srv, sp_rpc_server_stats *s) {
  *s = srv->stats;
  s->buffered_bytes = srv->buffered;
  for (const srv_conn *c = srv->conns; c; c = c->next)
    s->bytes_out += c->io.bytes_out;
}

int sp_rpc_server_method_stats(const sp_rpc_server *srv, size_t i,
                               sp_rpc_method_stats *out) {
  if (srv == NULL || out == NULL) return SP_EINVAL;
  if (i >= srv->n_methods) return SP_ENOENT;
  const method_rec *m = &srv->recs[i];
  out->path = srv->methods[i]->path;
  memcpy(out->calls, m->calls, sizeof out->calls);
  memcpy(out->bucket, m->bucket, sizeof out->bucket);
  out->count = 0;
  for (size_t k = 0; k < SP_RPC_CODES; k++) out->count += m->calls[k];
  out->sum_s = (double)m->sum_us / 1e6;
  return 0;
}
