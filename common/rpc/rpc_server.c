/* gRPC server: connections, streams, method dispatch, deadlines,
 * backpressure, graceful shutdown. The wire rules it follows, and the
 * nghttp2 1.52 (old API) details it works around: docs/wire-protocol.md. */
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc.h"
#include "rpc_conn.h"
#include "rpc_internal.h"
#include "rpc_tls.h"
#include "rpc_wire.h"
#include "base/strmap.h"

typedef struct srv_conn srv_conn;

struct sp_rpc_call {
  srv_conn *conn;
  int32_t stream_id;
  const sp_rpc_method *method;
  /* Request headers. The path is looked up as it arrives, so the call keeps
   * the method's index rather than a copy: a call lives as long as its
   * stream, and a 256-byte path buffer was nearly half of every open
   * stream's sp_rpc_call. Only a path no method has is copied, for the
   * error that names it. */
  int32_t route;      /* index in srv->methods; -1: unknown or none */
  char *unknown_path; /* owned; NULL unless the path is unknown */
  bool is_post, grpc_content_type, bad_encoding, md_overflow;
  int64_t timeout_ms;
  sp_rpc_mdlist req_md;
  sp_rpc_deframer df;
  uint32_t n_requests;
  uint8_t *unary_req;
  size_t unary_len;
  /* response */
  sp_rpc_mdlist resp_md;
  bool headers_sent, finished, released, deferred, remote_closed;
  int status;
  char *status_msg;
  sp_rpc_outq q; /* q.bytes: what the call has queued */
  void (*on_writable)(sp_rpc_call *);
  bool want_writable, conn_blocked, notify_queued;
  uv_timer_t *timer;
  uint64_t deadline; /* uv_now() ms */
  void *user;
  const sp_rpc_principal *principal; /* borrowed from the authorize hook */
  sp_rpc_call *next, *prev, *notify_next;
};

struct srv_conn {
  sp_h2conn io;
  sp_rpc_server *srv;
  uint64_t id;
  char peer[64];
  sp_rpc_call *calls;
  sp_rpc_call *notify; /* calls whose on_writable must run */
  size_t pending;      /* bytes queued by all its calls */
  bool any_blocked;    /* a call waits for `pending` to drain */
  srv_conn *next, *prev;
  /* in-memory connections only (sp_rpc_server_feed_bytes) */
  int (*feed_sink)(void *arg, const uint8_t *data, size_t len);
  void *feed_arg;
  bool *gone; /* set when the connection is freed */
};

typedef struct listener {
  uv_tcp_t tcp;
  sp_rpc_server *srv;
  struct listener *next;
} listener;

struct sp_rpc_server {
  uv_loop_t *loop;
  sp_rpc_server_opts opts;
  sp_strmap *paths;
  const sp_rpc_method **methods;
  size_t n_methods, cap_methods;
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
  SSL_CTX *tls; /* NULL: cleartext; built by the first listen */
};

static void conn_flush(srv_conn *c);
static void call_free(sp_rpc_call *call);

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
  if (call->method != NULL && call->method->on_cancel != NULL)
    call->method->on_cancel(call, code);
}

static void call_free(sp_rpc_call *call) {
  srv_conn *c = call->conn;
  if (call->prev) call->prev->next = call->next;
  else c->calls = call->next;
  if (call->next) call->next->prev = call->prev;
  /* drop from the writable-notification list */
  for (sp_rpc_call **pp = &c->notify; *pp; pp = &(*pp)->notify_next)
    if (*pp == call) {
      *pp = call->notify_next;
      break;
    }
  c->pending -= call->q.bytes;
  call_stop_timer(call);
  sp_rpc_mdlist_clear(&call->req_md);
  sp_rpc_mdlist_clear(&call->resp_md);
  sp_rpc_deframer_free(&call->df);
  sp_rpc_outq_clear(&call->q);
  free(call->unary_req);
  free(call->status_msg);
  free(call->unknown_path);
  c->srv->stats.calls_open--;
  free(call);
}

/* ---------------- sending ---------------- */

#define NV(n, v, vl)                                                           \
  {(uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vl), NGHTTP2_NV_FLAG_NONE}

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
    nv[n++] = (nghttp2_nv){(uint8_t *)e->key, v, klen, vlen,
                           NGHTTP2_NV_FLAG_NONE};
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
  size_t n = 0;
  snprintf(s->code, sizeof s->code, "%d", call->status);
  nv[n++] = (nghttp2_nv)NV("grpc-status", s->code, strlen(s->code));
  if (call->status_msg != NULL && call->status_msg[0] != '\0') {
    size_t l = sp_rpc_pct_encode(call->status_msg, s->msg, sizeof s->msg);
    nv[n++] = (nghttp2_nv)NV("grpc-message", s->msg, l);
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
  nv[n++] = (nghttp2_nv)NV(":status", "200", 3);
  nv[n++] = (nghttp2_nv)NV("content-type", "application/grpc", 16);
  nv[n++] = (nghttp2_nv)NV("grpc-accept-encoding", "identity", 8);
  n += md_to_nv(&call->resp_md, nv + n, b64);
  status_nv st;
  int rv;
  if (call->finished && sp_rpc_outq_empty(&call->q)) {
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
      if (x->want_writable && x->q.bytes <= o->max_pending / 2)
        queue_notify(x);
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
  if (msg != NULL) call->status_msg = sp_strdup(msg);
  call_stop_timer(call);
  int rc = call->headers_sent ? 0 : submit_headers(call);
  call_kick(call);
  if (rc != 0) nghttp2_submit_rst_stream(call->conn->io.h2, NGHTTP2_FLAG_NONE,
                                         call->stream_id, NGHTTP2_INTERNAL_ERROR);
  conn_flush(call->conn);
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
  bool call_full = call->q.bytes > 0 &&
                   call->q.bytes + len + 5 > srv->opts.max_pending;
  bool conn_full = c->pending > 0 &&
                   c->pending + len + 5 > srv->opts.max_conn_pending;
  if (call_full || conn_full) {
    call->want_writable = call->on_writable != NULL;
    if (conn_full) {
      call->conn_blocked = true;
      c->any_blocked = true;
    }
    return SP_EAGAIN;
  }
  if (sp_rpc_outq_push(&call->q, msg, data, len) != 0) return SP_ENOMEM;
  c->pending += len + 5;
  int rc = submit_headers(call);
  if (rc != 0) return rc;
  call_kick(call);
  conn_flush(call->conn);
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
  if (rc == 0) conn_flush(call->conn);
  return rc;
}

int sp_rpc_call_reply(sp_rpc_call *call, const ProtobufCMessage *msg) {
  int rc = sp_rpc_call_send(call, msg);
  if (rc == SP_ETOOBIG)
    sp_rpc_call_finishf(call, SP_RPC_RESOURCE_EXHAUSTED,
                        "answer of %zu bytes is over the message limit",
                        protobuf_c_message_get_packed_size(msg));
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
  call_fail(call, SP_RPC_DEADLINE_EXCEEDED, "deadline exceeded");
}

static void http_error(sp_rpc_call *call, const char *status, int code,
                       const char *msg) {
  nghttp2_nv nv[4];
  char c[12];
  snprintf(c, sizeof c, "%d", code);
  nv[0] = (nghttp2_nv)NV(":status", status, strlen(status));
  nv[1] = (nghttp2_nv)NV("content-type", "application/grpc", 16);
  nv[2] = (nghttp2_nv)NV("grpc-status", c, strlen(c));
  nv[3] = (nghttp2_nv)NV("grpc-message", msg, strlen(msg));
  nghttp2_submit_response(call->conn->io.h2, call->stream_id, nv, 4, NULL);
  call->headers_sent = call->finished = call->released = true;
}

static bool is_health(const char *path) {
  static const char k[] = "/grpc.health.v1.Health/";
  return strncmp(path, k, sizeof k - 1) == 0;
}

/* End of request headers: route, validate, authorize. */
static void request_headers_done(sp_rpc_call *call) {
  sp_rpc_server *srv = call->conn->srv;
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
    int code = srv->opts.authorize(call, srv->opts.authorize_arg, msg,
                                   sizeof msg);
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
  if (call->timeout_ms >= 0) {
    call->timer = malloc(sizeof *call->timer);
    if (call->timer != NULL) {
      uv_timer_init(srv->loop, call->timer);
      call->timer->data = call;
      /* from now: the loop's clock is as old as this iteration */
      uv_update_time(srv->loop);
      call->deadline = uv_now(srv->loop) + (uint64_t)call->timeout_ms;
      uv_timer_start(call->timer, on_deadline, (uint64_t)call->timeout_ms, 0);
    }
  }
}

static int deliver(sp_rpc_call *call, const uint8_t *data, size_t len) {
  const sp_rpc_method *m = call->method;
  ProtobufCMessage *msg = NULL;
  if (m->input != NULL) {
    msg = protobuf_c_message_unpack(m->input, NULL, len, data);
    if (msg == NULL) {
      call_fail(call, SP_RPC_INTERNAL, "cannot decode %s request (%zu bytes)",
                m->input->name, len);
      return 0;
    }
  }
  m->on_message(call, msg, data, len);
  if (msg != NULL) protobuf_c_message_free_unpacked(msg, NULL);
  return 0;
}

static int on_request_message(void *ud, const uint8_t *data, size_t len) {
  sp_rpc_call *call = ud;
  if (call->finished) return 0;
  const sp_rpc_method *m = call->method;
  if (m->kind == SP_RPC_UNARY || m->kind == SP_RPC_SERVER_STREAMING) {
    if (++call->n_requests > 1) {
      call_end(call, SP_RPC_UNIMPLEMENTED,
               "more than one request message for a unary-request method");
      return 0;
    }
    call->unary_req = malloc(len ? len : 1);
    if (call->unary_req == NULL) {
      call_end(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      return 0;
    }
    memcpy(call->unary_req, data, len);
    call->unary_len = len;
    return 0;
  }
  return deliver(call, data, len);
}

static void request_half_closed(sp_rpc_call *call) {
  call->remote_closed = true;
  if (call->finished || call->method == NULL) return;
  if (sp_rpc_deframer_partial(&call->df)) {
    call_fail(call, SP_RPC_INTERNAL, "request ended inside a message");
    return;
  }
  const sp_rpc_method *m = call->method;
  if (m->kind == SP_RPC_UNARY || m->kind == SP_RPC_SERVER_STREAMING) {
    if (call->n_requests != 1) {
      call_end(call, SP_RPC_UNIMPLEMENTED,
               "no request message for a unary-request method");
      return;
    }
    deliver(call, call->unary_req, call->unary_len);
    return;
  }
  if (m->on_half_close != NULL && !call->released) m->on_half_close(call);
}

static int cb_begin_headers(nghttp2_session *s, const nghttp2_frame *f,
                            void *ud) {
  srv_conn *c = ud;
  if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0;
  sp_rpc_call *call = calloc(1, sizeof *call);
  if (call == NULL) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  call->conn = c;
  call->stream_id = f->hd.stream_id;
  call->timeout_ms = -1;
  call->route = -1;
  sp_rpc_deframer_init(&call->df, c->srv->opts.max_message);
  call->next = c->calls;
  if (c->calls) c->calls->prev = call;
  c->calls = call;
  c->srv->stats.calls_open++;
  c->srv->stats.calls_total++;
  nghttp2_session_set_stream_user_data(s, f->hd.stream_id, call);
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
  (void)ud;
  if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
    return 0; /* request trailers are ignored */
  sp_rpc_call *call = nghttp2_session_get_stream_user_data(s, f->hd.stream_id);
  if (call == NULL) return 0;
  if (nlen > 0 && name[0] == ':') {
    if (nlen == 5 && memcmp(name, ":path", 5) == 0) {
      free(call->unknown_path);
      call->unknown_path = NULL;
      call->route = -1;
      char path[256];
      if (vlen < sizeof path) {
        memcpy(path, value, vlen);
        path[vlen] = '\0';
        call->route = sp_strmap_get(call->conn->srv->paths, path);
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
               : sp_rpc_mdlist_add(&call->req_md, (const char *)name, nlen,
                                   raw, (size_t)n, budget);
    free(raw);
  } else {
    rc = sp_rpc_mdlist_add(&call->req_md, (const char *)name, nlen, value,
                           vlen, budget);
  }
  if (rc == SP_ETOOBIG) call->md_overflow = true;
  else if (rc != 0) return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
  return 0;
}

static int cb_data_chunk(nghttp2_session *s, uint8_t flags, int32_t id,
                         const uint8_t *data, size_t len, void *ud) {
  (void)flags;
  srv_conn *c = ud;
  c->srv->stats.bytes_in += len;
  sp_rpc_call *call = nghttp2_session_get_stream_user_data(s, id);
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
  else if (rc != 0)
    call_fail(call, SP_RPC_INTERNAL, "malformed message framing");
  return 0;
}

static int cb_frame_recv(nghttp2_session *s, const nghttp2_frame *f,
                         void *ud) {
  (void)ud;
  if (f->hd.type != NGHTTP2_HEADERS && f->hd.type != NGHTTP2_DATA) return 0;
  /* the stream may already be closed: fetch and check again */
  sp_rpc_call *call = nghttp2_session_get_stream_user_data(s, f->hd.stream_id);
  if (call == NULL) return 0;
  if (f->hd.type == NGHTTP2_HEADERS &&
      f->headers.cat == NGHTTP2_HCAT_REQUEST)
    request_headers_done(call);
  if (f->hd.flags & NGHTTP2_FLAG_END_STREAM) request_half_closed(call);
  return 0;
}

static int cb_frame_send(nghttp2_session *s, const nghttp2_frame *f,
                         void *ud) {
  (void)ud;
  /* Trailers went out before the client finished sending: follow them with
   * RST_STREAM(NO_ERROR), as gRPC's Java and Go servers do, so the client
   * stops sending without treating the call as failed. Submitting it earlier would drop
   * the queued trailers. */
  if (f->hd.type == NGHTTP2_HEADERS && (f->hd.flags & NGHTTP2_FLAG_END_STREAM) &&
      nghttp2_session_get_stream_remote_close(s, f->hd.stream_id) == 0)
    nghttp2_submit_rst_stream(s, NGHTTP2_FLAG_NONE, f->hd.stream_id,
                              NGHTTP2_NO_ERROR);
  return 0;
}

static int cb_stream_close(nghttp2_session *s, int32_t id, uint32_t err,
                           void *ud) {
  (void)ud;
  sp_rpc_call *call = nghttp2_session_get_stream_user_data(s, id);
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

static void conn_after_send(sp_h2conn *io) {
  srv_conn *c = io->owner;
  while (c->notify != NULL) {
    sp_rpc_call *call = c->notify;
    c->notify = call->notify_next;
    call->notify_next = NULL;
    call->notify_queued = false;
    if (call->on_writable != NULL && !call->released) call->on_writable(call);
  }
}

static void conn_flush(srv_conn *c) { sp_h2conn_flush(&c->io); }

static void conn_closed(sp_h2conn *io) {
  srv_conn *c = io->owner;
  sp_rpc_server *srv = c->srv;
  /* nghttp2_session_del does not report stream closes: end them here */
  while (c->calls != NULL) {
    sp_rpc_call *call = c->calls;
    call_release(call, srv->shutting_down ? SP_RPC_UNAVAILABLE
                                          : SP_RPC_CANCELLED);
    call_free(call);
  }
  if (c->prev) c->prev->next = c->next;
  else srv->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  srv->stats.connections_open--;
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
  int rv = nghttp2_session_server_new2(&c->io.h2, cb, c, opt);
  nghttp2_option_del(opt);
  nghttp2_session_callbacks_del(cb);
  if (rv != 0) return SP_ENOMEM;
  nghttp2_settings_entry iv[4] = {
      {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, c->srv->opts.max_streams},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1u << 20},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE,
       (uint32_t)c->srv->opts.max_metadata + 1024},
  };
  size_t niv = 3;
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
static srv_conn *conn_new(sp_rpc_server *srv) {
  srv_conn *c = calloc(1, sizeof *c);
  if (c == NULL) return NULL;
  if (sp_h2conn_init(&c->io, srv->loop, c) != 0) {
    free(c);
    return NULL;
  }
  c->srv = srv;
  c->io.shared = &srv->shared;
  c->id = ++srv->next_conn_id;
  c->io.on_closed = conn_closed;
  c->io.on_after_send = conn_after_send;
  c->next = srv->conns;
  if (srv->conns) srv->conns->prev = c;
  srv->conns = c;
  srv->open_handles++;
  srv->stats.connections_open++;
  srv->stats.connections_total++;
  return c;
}

static void on_connection(uv_stream_t *server, int status) {
  listener *l = server->data;
  sp_rpc_server *srv = l->srv;
  if (status < 0) return;
  srv_conn *c = conn_new(srv);
  if (c == NULL) return;
  if (uv_accept(server, (uv_stream_t *)&c->io.tcp) != 0 ||
      srv->shutting_down ||
      srv->stats.connections_open > srv->opts.max_connections ||
      session_new(c) != 0) {
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
  uv_tcp_nodelay(&c->io.tcp, 1);
  struct sockaddr_storage ss;
  int len = sizeof ss;
  if (uv_tcp_getpeername(&c->io.tcp, (struct sockaddr *)&ss, &len) == 0)
    sp_rpc_format_sockaddr((struct sockaddr *)&ss, c->peer, sizeof c->peer);
  if (sp_h2conn_start(&c->io) != 0) {
    sp_h2conn_close(&c->io);
    return;
  }
  conn_flush(c);
}

/* ---------------- in-memory connections (tests, fuzzing) ---------------- */

static int feed_sink(sp_h2conn *io, const uint8_t *data, size_t len) {
  srv_conn *c = io->owner;
  return c->feed_sink != NULL ? c->feed_sink(c->feed_arg, data, len) : 0;
}

int sp_rpc_server_feed_bytes(sp_rpc_server *srv, const uint8_t *data,
                             size_t len, size_t chunk,
                             int (*sink)(void *arg, const uint8_t *out,
                                         size_t n),
                             void *arg) {
  if (srv == NULL || (data == NULL && len > 0)) return SP_EINVAL;
  if (srv->shutting_down) return SP_ESTATE;
  srv_conn *c = conn_new(srv);
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
  }
  if (!gone) sp_h2conn_close(&c->io);
  /* close callbacks never block the loop, so this ends after an iteration;
   * conn_closed cancels the calls left and frees c */
  while (!gone) uv_run(srv->loop, UV_RUN_NOWAIT);
  return rc;
}

/* ---------------- server ---------------- */

int sp_rpc_server_new(uv_loop_t *loop, const sp_rpc_server_opts *opts,
                      sp_rpc_server **out) {
  if (loop == NULL || out == NULL) return SP_EINVAL;
  sp_rpc_server *srv = calloc(1, sizeof *srv);
  if (srv == NULL) return SP_ENOMEM;
  srv->loop = loop;
  if (opts) srv->opts = *opts;
  if (!srv->opts.max_message) srv->opts.max_message = SP_RPC_DEFAULT_MAX_MESSAGE;
  if (!srv->opts.max_metadata)
    srv->opts.max_metadata = SP_RPC_DEFAULT_MAX_METADATA;
  if (!srv->opts.max_streams) srv->opts.max_streams = SP_RPC_DEFAULT_MAX_STREAMS;
  if (!srv->opts.max_pending) srv->opts.max_pending = SP_RPC_DEFAULT_MAX_PENDING;
  if (!srv->opts.max_conn_pending)
    srv->opts.max_conn_pending = SP_RPC_DEFAULT_MAX_CONN_PENDING;
  if (!srv->opts.max_connections) srv->opts.max_connections = 65536;
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
  uv_tcp_init(srv->loop, &l->tcp);
  l->tcp.data = l;
  srv->open_handles++;
  int uvrc = uv_tcp_bind(&l->tcp, (struct sockaddr *)&ss, 0);
  /* the kernel caps the backlog at somaxconn; ask for plenty so thousands
   * of ranks attaching at once are not reset */
  if (uvrc == 0) uvrc = uv_listen((uv_stream_t *)&l->tcp, 65535, on_connection);
  if (uvrc != 0) {
    uv_close((uv_handle_t *)&l->tcp, listener_closed);
    return sp_diag_set(diag, SP_EIO, "cannot listen on %s: %s", addr,
                       uv_strerror(uvrc));
  }
  if (port_out != NULL) {
    struct sockaddr_storage b;
    int len = sizeof b;
    uv_tcp_getsockname(&l->tcp, (struct sockaddr *)&b, &len);
    *port_out = ntohs(b.ss_family == AF_INET6
                          ? ((struct sockaddr_in6 *)&b)->sin6_port
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
  sp_rpc_health_free(&srv->health);
  sp_strmap_free(srv->paths);
  free(srv->methods);
  free(srv->shared.rbuf);
  free(srv->shared.wbuf);
  SSL_CTX_free(srv->tls);
  free(srv);
}

int sp_rpc_server_set_health(sp_rpc_server *srv, const char *service,
                             sp_rpc_health status) {
  return sp_rpc_health_set(&srv->health, service, status);
}

void sp_rpc_server_get_stats(const sp_rpc_server *srv, sp_rpc_server_stats *s) {
  *s = srv->stats;
  for (const srv_conn *c = srv->conns; c; c = c->next)
    s->bytes_out += c->io.bytes_out;
}
