/* gRPC client: one HTTP/2 connection at a time, calls multiplexed on it,
 * connection with jittered exponential backoff, deadlines, cancellation. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "rpc.h"
#include "h2conn.h"
#include "rpc_internal.h"
#include "rpc_mem.h"
#include "rpc_tls.h"
#include "rpc_wire.h"
#include "base/strmap.h"

typedef struct cconn {
  sp_h2conn io;
  sp_rpc_client *cl;
  sp_rpc_ccall *calls; /* submitted on this connection */
  /* The call of the stream nghttp2 last called back for, as the server's
   * cur_call (rpc_server.c); cleared when that call completes. */
  int32_t cur_id;
  sp_rpc_ccall *cur_call;
  bool ready, goaway;
  bool handshaking; /* TLS: connected, the handshake not done yet */
} cconn;

struct sp_rpc_ccall {
  sp_rpc_client *cl;
  cconn *conn; /* NULL while waiting for a connection */
  int32_t stream_id;
  char *path; /* from cl->mem */
  sp_rpc_mdlist md;
  uint64_t timeout_ms;
  sp_rpc_ccall_cbs cbs;
  void *user;
  sp_rpc_outq q;
  bool half_close, eof_sent, deferred, closed;
  sp_rpc_deframer df;
  sp_rpc_mdlist resp_md;
  int http_status;
  bool has_grpc_status;
  int local_code; /* -1, or a status decided on this side */
  sp_rpc_status status;
  uv_timer_t *timer;
  sp_rpc_ccall *next, *prev;
};

struct sp_rpc_client {
  uv_loop_t *loop;
  char addr[300];
  struct sockaddr_storage sa;
  sp_rpc_client_opts opts;
  char *authorization; /* "Bearer <token>", owned; NULL: none */
  cconn *conn;         /* current connection, if any */
  bool connecting, closing;
  uv_connect_t creq;
  uv_timer_t retry;
  uint64_t connect_started, backoff_ms;
  uint64_t rng;
  /* What the waiting calls fail with when connecting gives up. */
  char last_error[SP_RPC_STATUS_MESSAGE_MAX];
  /* TLS: the context and the name the server's certificate must carry;
   * a context that could not be built fails every call with why. */
  bool use_tls, tls_setup_failed;
  SSL_CTX *tls;
  char *tls_name;
  sp_rpc_ccall *waiting; /* calls with no connection yet */
  size_t open_handles;
  /* nghttp2's blocks and the calls (rpc_mem.h) */
  sp_rpc_mem mem;
  void (*close_done)(void *);
  void *close_arg;
};

static void client_connect(sp_rpc_client *cl);
static void submit_call(sp_rpc_ccall *call);

/* ---------------- call completion ---------------- */

static void list_remove(sp_rpc_ccall **head, sp_rpc_ccall *call) {
  if (call->prev)
    call->prev->next = call->next;
  else if (*head == call)
    *head = call->next;
  if (call->next) call->next->prev = call->prev;
  call->next = call->prev = NULL;
}

static void list_push(sp_rpc_ccall **head, sp_rpc_ccall *call) {
  call->prev = NULL;
  call->next = *head;
  if (*head) (*head)->prev = call;
  *head = call;
}

static void timer_free(uv_handle_t *h) { free(h); }

/* Delivers on_close exactly once and frees the call. */
static void call_complete(sp_rpc_ccall *call, int code, const char *msg) {
  if (call->closed) return;
  call->closed = true;
  if (call->conn && call->conn->cur_call == call) call->conn->cur_call = NULL;
  if (call->conn)
    list_remove(&call->conn->calls, call);
  else
    list_remove(&call->cl->waiting, call);
  if (call->timer) {
    uv_timer_stop(call->timer);
    uv_close((uv_handle_t *)call->timer, timer_free);
  }
  call->status.code = code;
  /* callers may pass call->status.message itself: an overlapping snprintf
   * is undefined (glibc leaves it empty) */
  if (msg != NULL && msg != call->status.message)
    snprintf(call->status.message, sizeof call->status.message, "%s", msg);
  if (call->cbs.on_close) call->cbs.on_close(call, &call->status, call->user);
  sp_rpc_outq_clear(&call->q);
  sp_rpc_deframer_free(&call->df);
  sp_rpc_mdlist_clear(&call->md);
  sp_rpc_mdlist_clear(&call->resp_md);
  sp_rpc_mem_free(&call->cl->mem, call->path);
  sp_rpc_mem_free(&call->cl->mem, call);
}

/* The outcome once the stream is gone: the status from the trailers (or
 * a Trailers-Only answer), else one derived from how the stream ended
 * (docs/wire-protocol.md, "Status codes"). */
static void call_finish_from_stream(sp_rpc_ccall *call, uint32_t h2err) {
  if (call->local_code >= 0) {
    call_complete(call, call->local_code, call->status.message);
  } else if (call->has_grpc_status) {
    call_complete(call, call->status.code, NULL);
  } else if (h2err != 0) {
    char m[64];
    snprintf(m, sizeof m, "stream reset by the server (HTTP/2 error %u)",
             h2err);
    call_complete(call, sp_rpc_code_from_rst(h2err), m);
  } else if (call->http_status != 200) {
    char m[64];
    snprintf(m, sizeof m, "HTTP status %d", call->http_status);
    call_complete(call, sp_rpc_code_from_http(call->http_status), m);
  } else {
    call_complete(call, SP_RPC_UNKNOWN, "response ended without grpc-status");
  }
}

/* Ends a call from this side: cancel, deadline, local limits. */
static void call_abort(sp_rpc_ccall *call, int code, const char *msg) {
  if (call->closed || call->local_code >= 0) return;
  call->local_code = code;
  snprintf(call->status.message, sizeof call->status.message, "%s", msg);
  if (call->conn == NULL || call->stream_id <= 0) {
    call_complete(call, code, msg);
    return;
  }
  nghttp2_submit_rst_stream(call->conn->io.h2, NGHTTP2_FLAG_NONE,
                            call->stream_id, NGHTTP2_CANCEL);
  sp_h2conn_flush(&call->conn->io);
}

static void on_call_deadline(uv_timer_t *t) {
  call_abort(t->data, SP_RPC_DEADLINE_EXCEEDED, "deadline exceeded");
}

/* ---------------- nghttp2 callbacks ---------------- */

static ssize_t read_request(nghttp2_session *s, int32_t id, uint8_t *buf,
                            size_t length, uint32_t *flags,
                            nghttp2_data_source *src, void *ud) {
  (void)s;
  (void)id;
  (void)ud;
  sp_rpc_ccall *call = src->ptr;
  size_t out = sp_rpc_outq_pull(&call->q, buf, length);
  if (sp_rpc_outq_empty(&call->q) && call->half_close) {
    *flags |= NGHTTP2_DATA_FLAG_EOF;
    call->eof_sent = true;
    return (ssize_t)out;
  }
  if (out > 0) return (ssize_t)out;
  call->deferred = true;
  return NGHTTP2_ERR_DEFERRED;
}

/* The call of stream id (see cur_call); NULL: none, or it is gone. */
static sp_rpc_ccall *stream_call(cconn *cc, nghttp2_session *s, int32_t id) {
  if (cc->cur_call != NULL && cc->cur_id == id) return cc->cur_call;
  sp_rpc_ccall *call = nghttp2_session_get_stream_user_data(s, id);
  if (call != NULL) {
    cc->cur_id = id;
    cc->cur_call = call;
  }
  return call;
}

static int cb_header(nghttp2_session *s, const nghttp2_frame *f,
                     const uint8_t *name, size_t nlen, const uint8_t *value,
                     size_t vlen, uint8_t flags, void *ud) {
  (void)flags;
  if (f->hd.type != NGHTTP2_HEADERS) return 0;
  sp_rpc_ccall *call = stream_call(ud, s, f->hd.stream_id);
  if (call == NULL) return 0;
  if (nlen == 7 && memcmp(name, ":status", 7) == 0) {
    int st = 0;
    for (size_t i = 0; i < vlen && i < 4; i++)
      st = st * 10 + (value[i] >= '0' && value[i] <= '9' ? value[i] - '0' : 0);
    call->http_status = st;
  } else if (nlen == 11 && memcmp(name, "grpc-status", 11) == 0) {
    int code = 0;
    for (size_t i = 0; i < vlen && i < 3; i++)
      code =
          code * 10 + (value[i] >= '0' && value[i] <= '9' ? value[i] - '0' : 0);
    call->status.code = code > 16 ? SP_RPC_UNKNOWN : code;
    call->has_grpc_status = true;
  } else if (nlen == 12 && memcmp(name, "grpc-message", 12) == 0) {
    sp_rpc_pct_decode((const char *)value, vlen, call->status.message,
                      sizeof call->status.message);
  } else if (nlen == 12 && memcmp(name, "content-type", 12) == 0) {
    /* the protocol's, not metadata, as on the server (rpc_server.c,
     * cb_header): kept as an entry, it cost a client 250 of its 12,300
     * instructions per unary call (callgrind, 8 callers) */
  } else if (name[0] != ':' && !(nlen >= 5 && memcmp(name, "grpc-", 5) == 0)) {
    if (sp_rpc_md_key_is_bin((const char *)name, nlen)) {
      uint8_t *raw = malloc(vlen + 1);
      long n = raw ? sp_rpc_b64_decode((const char *)value, vlen, raw) : -1;
      if (n >= 0)
        sp_rpc_mdlist_add(&call->resp_md, (const char *)name, nlen, raw,
                          (size_t)n, 2 * SP_RPC_DEFAULT_MAX_METADATA);
      free(raw);
    } else {
      sp_rpc_mdlist_add(&call->resp_md, (const char *)name, nlen, value, vlen,
                        2 * SP_RPC_DEFAULT_MAX_METADATA);
    }
  }
  return 0;
}

static int deliver_message(void *ud, const uint8_t *msg, size_t len) {
  sp_rpc_ccall *call = ud;
  if (call->local_code < 0 && call->cbs.on_message)
    call->cbs.on_message(call, msg, len, call->user);
  return 0;
}

static int cb_data_chunk(nghttp2_session *s, uint8_t flags, int32_t id,
                         const uint8_t *data, size_t len, void *ud) {
  (void)flags;
  sp_rpc_ccall *call = stream_call(ud, s, id);
  if (call == NULL || call->local_code >= 0) return 0;
  uint64_t announced = 0;
  int rc = sp_rpc_deframer_feed(&call->df, data, len, deliver_message, call,
                                &announced);
  if (rc == SP_ETOOBIG) {
    char m[128];
    snprintf(m, sizeof m, "response message of %llu bytes is over the limit",
             (unsigned long long)announced);
    call_abort(call, SP_RPC_RESOURCE_EXHAUSTED, m);
  } else if (rc != 0) {
    call_abort(call, SP_RPC_INTERNAL, "malformed response framing");
  }
  return 0;
}

static int cb_frame_recv(nghttp2_session *s, const nghttp2_frame *f, void *ud) {
  (void)s;
  cconn *cc = ud;
  if (f->hd.type == NGHTTP2_GOAWAY) {
    /* new calls go to a fresh connection; this one drains */
    cc->goaway = true;
    if (cc->cl->conn == cc) cc->cl->conn = NULL;
  }
  return 0;
}

static int cb_stream_close(nghttp2_session *s, int32_t id, uint32_t err,
                           void *ud) {
  sp_rpc_ccall *call = stream_call(ud, s, id);
  if (call == NULL) return 0;
  nghttp2_session_set_stream_user_data(s, id, NULL);
  call_finish_from_stream(call, err);
  return 0;
}

/* ---------------- connection ---------------- */

/* Messages that name the address: a long one truncates them, which is
 * acceptable (checking the result tells the compiler so). */
#define MSGF(buf, cap, ...)                                       \
  do {                                                            \
    if (snprintf((buf), (cap), __VA_ARGS__) < 0) (buf)[0] = '\0'; \
  } while (0)

static void client_free(sp_rpc_client *cl) {
  if (cl->close_done) cl->close_done(cl->close_arg);
  SSL_CTX_free(cl->tls);
  free(cl->tls_name);
  free(cl->authorization);
  sp_rpc_mem_release(&cl->mem);
  free(cl);
}

static void connect_failed(sp_rpc_client *cl, bool final);

/* Why the calls of a connection that broke failed: its TLS error, or a
 * cleartext client that got TLS from the server. */
static void lost_message(cconn *cc, char *msg, size_t cap) {
  const sp_tls_conn *t = cc->io.tls;
  if (t != NULL && t->err[0] != '\0')
    MSGF(msg, cap, "TLS connection to %s failed: %s", cc->cl->addr, t->err);
  else if (cc->io.peer_tls)
    MSGF(msg, cap,
         "connection to the server lost: %s answered with TLS, and this "
         "client speaks cleartext HTTP/2",
         cc->cl->addr);
  else if (cc->io.tls == NULL && cc->io.bytes_in == 0)
    /* what a TLS server does with a cleartext client's preface */
    MSGF(msg, cap,
         "connection to the server lost: %s closed it without a word "
         "(does it require TLS?)",
         cc->cl->addr);
  else
    snprintf(msg, cap, "connection to the server lost");
}

static void conn_closed(sp_h2conn *io) {
  cconn *cc = io->owner;
  sp_rpc_client *cl = cc->cl;
  char lost[SP_RPC_STATUS_MESSAGE_MAX];
  if (cc->calls != NULL) lost_message(cc, lost, sizeof lost);
  while (cc->calls != NULL) {
    sp_rpc_ccall *call = cc->calls;
    if (call->local_code >= 0)
      call_complete(call, call->local_code, call->status.message);
    else
      call_complete(call, SP_RPC_UNAVAILABLE, lost);
  }
  bool handshaking = cc->handshaking;
  bool final = false;
  if (handshaking) {
    const sp_tls_conn *t = io->tls;
    final = t != NULL && t->final;
    MSGF(cl->last_error, sizeof cl->last_error,
         "TLS handshake with %s failed: %s", cl->addr,
         t != NULL && t->err[0] ? t->err : "the connection closed");
  }
  if (cl->conn == cc) cl->conn = NULL;
  free(cc);
  cl->open_handles--;
  if (cl->closing && cl->open_handles == 0) {
    client_free(cl);
    return;
  }
  if (handshaking) { /* a failed attempt to connect */
    connect_failed(cl, final);
    return;
  }
  /* calls that arrived while this connection was closing need a new one */
  if (!cl->closing && cl->waiting != NULL && !cl->connecting)
    client_connect(cl);
}

static int session_new(cconn *cc) {
  nghttp2_session_callbacks *cb;
  if (nghttp2_session_callbacks_new(&cb) != 0) return SP_ENOMEM;
  nghttp2_session_callbacks_set_on_header_callback(cb, cb_header);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, cb_data_chunk);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cb, cb_frame_recv);
  nghttp2_session_callbacks_set_on_stream_close_callback(cb, cb_stream_close);
  int rv =
      nghttp2_session_client_new3(&cc->io.h2, cb, cc, NULL, &cc->cl->mem.nv);
  nghttp2_session_callbacks_del(cb);
  if (rv != 0) return SP_ENOMEM;
  /* nghttp2 writes the preface; the SETTINGS are ours to send */
  nghttp2_settings_entry iv[] = {
      {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
      {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1u << 20},
      {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, 2 * SP_RPC_DEFAULT_MAX_METADATA},
      /* as the server's (rpc_server.c, session_new) */
      {NGHTTP2_SETTINGS_NO_RFC7540_PRIORITIES, 1},
  };
  nghttp2_submit_settings(cc->io.h2, NGHTTP2_FLAG_NONE, iv, 4);
  nghttp2_session_set_local_window_size(cc->io.h2, NGHTTP2_FLAG_NONE, 0,
                                        16u << 20);
  return 0;
}

static uint64_t next_rand(sp_rpc_client *cl) {
  uint64_t z = (cl->rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void fail_waiting(sp_rpc_client *cl) {
  while (cl->waiting)
    call_complete(cl->waiting, SP_RPC_UNAVAILABLE, cl->last_error);
}

static void on_retry(uv_timer_t *t) { client_connect(t->data); }

/* The connection is ready for calls: connected and, with TLS, through
 * the handshake with ALPN h2. */
static void conn_ready(cconn *cc) {
  sp_rpc_client *cl = cc->cl;
  cl->connecting = false;
  uv_timer_stop(&cl->retry); /* the handshake's deadline */
  cc->handshaking = false;
  cc->ready = true;
  cl->conn = cc;
  cl->backoff_ms = 0;
  while (cl->waiting) submit_call(cl->waiting);
  sp_h2conn_flush(&cc->io);
}

static void on_tls_ready(sp_h2conn *io) { conn_ready(io->owner); }

/* connect_timeout_ms covers the handshake too: a server that accepts and
 * never answers must not hold the calls forever. */
static void on_handshake_timeout(uv_timer_t *t) {
  sp_rpc_client *cl = t->data;
  cconn *cc = cl->conn;
  if (cc == NULL || !cc->handshaking) return;
  snprintf(cc->io.tls->err, sizeof cc->io.tls->err, "timed out");
  sp_h2conn_close(&cc->io); /* conn_closed reports it */
}

static void on_setup_failed(uv_timer_t *t) {
  sp_rpc_client *cl = t->data;
  cl->connecting = false;
  fail_waiting(cl);
}

static int conn_tls(cconn *cc) {
  sp_rpc_client *cl = cc->cl;
  if (!cl->use_tls) return 0;
  sp_tls_conn *t;
  int rc = sp_tls_conn_new(cl->tls, false, cl->tls_name, &t);
  if (rc != 0) return rc;
  t->on_ready = on_tls_ready;
  sp_h2conn_tls(&cc->io, t);
  return 0;
}

/* An attempt failed: retry with backoff, unless it is final (a TLS
 * verification or protocol failure, which would only repeat) or the
 * connect timeout has passed. */
static void connect_failed(sp_rpc_client *cl, bool final) {
  uv_timer_stop(&cl->retry);
  cl->connecting = false;
  if (cl->closing) return;
  /* this may run straight from client_connect, outside the loop */
  uv_update_time(cl->loop);
  uint64_t now = uv_now(cl->loop);
  if (final || now - cl->connect_started >= cl->opts.connect_timeout_ms) {
    fail_waiting(cl);
    return;
  }
  /* jittered exponential backoff: 100 ms, x1.6, +-20 %, capped at 5 s */
  cl->backoff_ms = cl->backoff_ms ? cl->backoff_ms * 8 / 5 : 100;
  if (cl->backoff_ms > 5000) cl->backoff_ms = 5000;
  uint64_t jitter = cl->backoff_ms / 5;
  uint64_t wait = cl->backoff_ms - jitter + next_rand(cl) % (2 * jitter + 1);
  uint64_t left = cl->opts.connect_timeout_ms - (now - cl->connect_started);
  if (wait > left) wait = left;
  cl->connecting = true; /* the retry is part of this attempt */
  uv_timer_start(&cl->retry, on_retry, wait, 0);
}

static void on_connect(uv_connect_t *req, int status) {
  cconn *cc = req->data;
  sp_rpc_client *cl = cc->cl;
  if (status == 0 && !cl->closing && session_new(cc) == 0 &&
      conn_tls(cc) == 0 && sp_h2conn_start(&cc->io) == 0) {
    if (cl->sa.ss_family != AF_UNIX) uv_tcp_nodelay(&cc->io.tcp, 1);
    if (cc->io.tls == NULL) {
      conn_ready(cc);
      return;
    }
    /* still connecting: calls wait for the handshake */
    cc->handshaking = true;
    cl->conn = cc;
    uv_update_time(cl->loop);
    uint64_t spent = uv_now(cl->loop) - cl->connect_started;
    uint64_t left = spent < cl->opts.connect_timeout_ms
                        ? cl->opts.connect_timeout_ms - spent
                        : 1;
    uv_timer_start(&cl->retry, on_handshake_timeout, left, 0);
    sp_h2conn_flush(&cc->io); /* the ClientHello */
    return;
  }
  MSGF(cl->last_error, sizeof cl->last_error, "cannot connect to %s: %s",
       cl->addr, status ? uv_strerror(status) : "setup failed");
  sp_h2conn_close(&cc->io);
  connect_failed(cl, false);
}

static void client_connect(sp_rpc_client *cl) {
  if (cl->closing) return;
  if (!cl->connecting) {
    /* a call may start this long after the loop last ran */
    uv_update_time(cl->loop);
    cl->connect_started = uv_now(cl->loop);
    cl->backoff_ms = 0;
  }
  if (cl->tls_setup_failed) {
    /* from the loop, not inside sp_rpc_client_start */
    cl->connecting = true;
    uv_timer_start(&cl->retry, on_setup_failed, 0, 0);
    return;
  }
  bool unix_sock = cl->sa.ss_family == AF_UNIX;
  cconn *cc = calloc(1, sizeof *cc);
  if (cc == NULL || (unix_sock ? sp_h2conn_init_pipe(&cc->io, cl->loop, cc)
                               : sp_h2conn_init(&cc->io, cl->loop, cc)) != 0) {
    free(cc);
    MSGF(cl->last_error, sizeof cl->last_error,
         "cannot connect to %s: out of memory", cl->addr);
    cl->connecting = false;
    fail_waiting(cl);
    return;
  }
  cc->cl = cl;
  cc->io.on_closed = conn_closed;
  cl->open_handles++;
  cl->connecting = true;
  cl->creq.data = cc;
  if (unix_sock) { /* reports through on_connect, also when it fails */
    uv_pipe_connect(&cl->creq, &cc->io.pipe,
                    ((struct sockaddr_un *)&cl->sa)->sun_path, on_connect);
    return;
  }
  int rc = uv_tcp_connect(&cl->creq, &cc->io.tcp, (struct sockaddr *)&cl->sa,
                          on_connect);
  if (rc != 0) {
    cl->creq.data = cc;
    on_connect(&cl->creq, rc);
  }
}

/* ---------------- calls ---------------- */

static void submit_call(sp_rpc_ccall *call) {
  sp_rpc_client *cl = call->cl;
  cconn *cc = cl->conn;
  list_remove(&cl->waiting, call);
  call->conn = cc;
  list_push(&cc->calls, call);
  size_t cap = 10 + call->md.n;
  /* the usual few headers fit on the stack; more go to the heap */
  nghttp2_nv nv_st[16];
  char *b64_st[8] = {NULL};
  nghttp2_nv *nv = cap <= 16 ? nv_st : calloc(cap, sizeof *nv);
  char **b64 =
      call->md.n + 1 <= 8 ? b64_st : calloc(call->md.n + 1, sizeof *b64);
  if (nv == NULL || b64 == NULL) {
    if (nv != nv_st) free(nv);
    if (b64 != b64_st) free(b64);
    call_complete(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  size_t n = 0;
  char timeout[16];
  nv[n++] = (nghttp2_nv)SP_NV_STATIC(":method", "POST", 4);
  if (cl->use_tls)
    nv[n++] = (nghttp2_nv)SP_NV_STATIC(":scheme", "https", 5);
  else
    nv[n++] = (nghttp2_nv)SP_NV_STATIC(":scheme", "http", 4);
  nv[n++] = (nghttp2_nv)SP_NV(":path", call->path, strlen(call->path));
  /* a path is no authority (nghttp2 refuses its '/'); gRPC names a Unix
   * socket's "localhost" too */
  if (cl->sa.ss_family == AF_UNIX)
    nv[n++] = (nghttp2_nv)SP_NV_STATIC(":authority", "localhost", 9);
  else
    nv[n++] = (nghttp2_nv)SP_NV(":authority", cl->addr, strlen(cl->addr));
  nv[n++] = (nghttp2_nv)SP_NV_STATIC("te", "trailers", 8);
  nv[n++] = (nghttp2_nv)SP_NV_STATIC("content-type", "application/grpc", 16);
  /* no grpc-accept-encoding: without it servers send identity, the only
   * codec we take (see rpc_server.c, submit_headers) */
  nv[n++] = (nghttp2_nv)SP_NV_STATIC("user-agent", "shardplane/0.1", 14);
  if (cl->authorization != NULL)
    nv[n++] =
        (nghttp2_nv){(uint8_t *)"authorization", (uint8_t *)cl->authorization,
                     13, strlen(cl->authorization), NGHTTP2_NV_FLAG_NO_INDEX};
  if (call->timeout_ms > 0) {
    /* what is left of the deadline, since the call may have waited */
    uint64_t left = call->timer ? uv_timer_get_due_in(call->timer) : 0;
    sp_rpc_timeout_format(left ? left : 1, timeout);
    nv[n++] = (nghttp2_nv)SP_NV("grpc-timeout", timeout, strlen(timeout));
  }
  for (size_t i = 0; i < call->md.n; i++) {
    struct sp_rpc_mdent *e = &call->md.e[i];
    size_t kl = strlen(e->key);
    const uint8_t *v = e->value;
    size_t vl = e->len;
    if (sp_rpc_md_key_is_bin(e->key, kl)) {
      b64[i] = malloc(4 * (e->len / 3 + 1) + 1);
      if (b64[i] == NULL) continue;
      vl = sp_rpc_b64_encode(e->value, e->len, b64[i]);
      v = (const uint8_t *)b64[i];
    }
    nv[n++] = (nghttp2_nv){(uint8_t *)e->key, (uint8_t *)v, kl, vl,
                           NGHTTP2_NV_FLAG_NONE};
  }
  nghttp2_data_provider prd = {.source.ptr = call,
                               .read_callback = read_request};
  int32_t id = nghttp2_submit_request(cc->io.h2, NULL, nv, n, &prd, call);
  for (size_t i = 0; i < call->md.n; i++) free(b64[i]);
  if (b64 != b64_st) free(b64);
  if (nv != nv_st) free(nv);
  if (id < 0) {
    call_complete(call, SP_RPC_UNAVAILABLE, nghttp2_strerror(id));
    return;
  }
  call->stream_id = id;
}

#define TOKEN_MAX 1024

/* "Bearer <token>" for the authorization header. A token that is not a
 * plain printable header value is refused here, not sent to be rejected
 * (or to split the header block) on the wire. */
static int bearer_header(const char *token, char **out) {
  size_t n = strnlen(token, TOKEN_MAX + 1);
  if (n == 0 || n > TOKEN_MAX) return SP_EINVAL;
  for (size_t i = 0; i < n; i++)
    if (token[i] <= 0x20 || token[i] >= 0x7f) return SP_EINVAL;
  char *h = malloc(n + 8);
  if (h == NULL) return SP_ENOMEM;
  memcpy(h, "Bearer ", 7);
  memcpy(h + 7, token, n + 1);
  *out = h;
  return 0;
}

/* Builds the TLS context now, so every connection shares it; files that
 * cannot be used leave a message for the calls instead. */
static int client_tls_setup(sp_rpc_client *cl,
                            const sp_rpc_tls_client_opts *o) {
  cl->use_tls = true;
  char host[256];
  int port;
  const char *name = o->server_name;
  if (name == NULL) {
    if (sp_rpc_split_addr(cl->addr, host, sizeof host, &port) != 0)
      return SP_EINVAL;
    name = host;
  }
  cl->tls_name = sp_strdup(name);
  if (cl->tls_name == NULL) return SP_ENOMEM;
  sp_diag d = {""};
  if (sp_tls_client_ctx_new(o, &cl->tls, &d) != 0) {
    cl->tls_setup_failed = true;
    snprintf(cl->last_error, sizeof cl->last_error, "%s", d.msg);
  }
  return 0;
}

int sp_rpc_client_open(uv_loop_t *loop, const char *addr,
                       const sp_rpc_client_opts *opts, sp_rpc_client **out) {
  if (loop == NULL || addr == NULL || out == NULL) return SP_EINVAL;
  if (strlen(addr) >= sizeof((sp_rpc_client *)0)->addr) return SP_EINVAL;
  sp_rpc_client *cl = calloc(1, sizeof *cl);
  if (cl == NULL) return SP_ENOMEM;
  int rc = sp_rpc_resolve(addr, &cl->sa, NULL);
  if (rc != 0) {
    free(cl);
    return rc;
  }
  cl->loop = loop;
  sp_rpc_mem_init(&cl->mem);
  snprintf(cl->addr, sizeof cl->addr, "%s", addr);
  if (opts) cl->opts = *opts;
  if (cl->opts.token != NULL) {
    rc = bearer_header(cl->opts.token, &cl->authorization);
    if (rc != 0) {
      free(cl);
      return rc;
    }
  }
  cl->opts.token = NULL; /* the copy above is what is kept */
  if (!cl->opts.connect_timeout_ms) cl->opts.connect_timeout_ms = 20000;
  if (!cl->opts.max_message) cl->opts.max_message = SP_RPC_DEFAULT_MAX_MESSAGE;
  if (!cl->opts.max_send_message || cl->opts.max_send_message > UINT32_MAX)
    cl->opts.max_send_message = UINT32_MAX;
  cl->rng = (uint64_t)(uintptr_t)cl ^ uv_hrtime();
  /* a Unix socket is the host's own (rpc.h): cleartext */
  if (cl->opts.tls != NULL && cl->sa.ss_family != AF_UNIX) {
    rc = client_tls_setup(cl, cl->opts.tls);
    cl->opts.tls = NULL; /* the caller's struct need not outlive this */
    if (rc != 0) {
      client_free(cl);
      return rc;
    }
  }
  cl->opts.tls = NULL;
  uv_timer_init(loop, &cl->retry);
  cl->retry.data = cl;
  cl->open_handles = 1; /* the retry timer */
  *out = cl;
  return 0;
}

static void retry_closed(uv_handle_t *h) {
  sp_rpc_client *cl = h->data;
  cl->open_handles--;
  if (cl->open_handles == 0) client_free(cl);
}

void sp_rpc_client_close(sp_rpc_client *cl, void (*done)(void *), void *arg) {
  if (cl == NULL || cl->closing) return;
  cl->closing = true;
  cl->close_done = done;
  cl->close_arg = arg;
  while (cl->waiting)
    call_complete(cl->waiting, SP_RPC_CANCELLED, "client closed");
  cconn *cur = cl->conn;
  if (cur != NULL) {
    for (sp_rpc_ccall *c = cur->calls; c; c = c->next)
      if (c->local_code < 0) {
        c->local_code = SP_RPC_CANCELLED;
        snprintf(c->status.message, sizeof c->status.message, "client closed");
      }
    sp_h2conn_close_notify(&cur->io);
    sp_h2conn_close(&cur->io);
  }
  uv_timer_stop(&cl->retry);
  uv_close((uv_handle_t *)&cl->retry, retry_closed);
}

int sp_rpc_client_start(sp_rpc_client *cl, const char *path,
                        const sp_rpc_md *md, size_t n_md, uint64_t timeout_ms,
                        const sp_rpc_ccall_cbs *cbs, void *user,
                        sp_rpc_ccall **out) {
  if (cl == NULL || path == NULL || path[0] != '/' || cbs == NULL)
    return SP_EINVAL;
  if (cl->closing) return SP_ESTATE;
  sp_rpc_ccall *call = sp_rpc_mem_calloc(&cl->mem, 1, sizeof *call);
  if (call == NULL) return SP_ENOMEM;
  call->cl = cl;
  call->md.mem = call->resp_md.mem = call->q.mem = &cl->mem;
  size_t plen = strlen(path);
  call->path = sp_rpc_mem_alloc(&cl->mem, plen + 1);
  if (call->path != NULL) memcpy(call->path, path, plen + 1);
  call->cbs = *cbs;
  call->user = user;
  call->timeout_ms = timeout_ms;
  call->local_code = -1;
  sp_rpc_deframer_init(&call->df, cl->opts.max_message);
  if (call->path == NULL) {
    sp_rpc_mem_free(&cl->mem, call);
    return SP_ENOMEM;
  }
  for (size_t i = 0; i < n_md; i++) {
    size_t kl = strlen(md[i].key);
    bool bin = sp_rpc_md_key_is_bin(md[i].key, kl);
    int rc = !sp_rpc_md_key_valid(md[i].key, kl) ||
                     (!bin && !sp_rpc_md_value_valid(md[i].value, md[i].len))
                 ? SP_EINVAL
                 : sp_rpc_mdlist_add(&call->md, md[i].key, kl, md[i].value,
                                     md[i].len, SP_RPC_DEFAULT_MAX_METADATA);
    if (rc != 0) {
      sp_rpc_mdlist_clear(&call->md);
      sp_rpc_deframer_free(&call->df);
      sp_rpc_mem_free(&cl->mem, call->path);
      sp_rpc_mem_free(&cl->mem, call);
      return rc;
    }
  }
  if (timeout_ms > 0) {
    call->timer = malloc(sizeof *call->timer);
    if (call->timer != NULL) {
      /* the deadline counts from now, not from when the loop last ran:
       * a blocking client's loop may have been idle for longer than the
       * timeout, which would make the call expire at once */
      uv_update_time(cl->loop);
      uv_timer_init(cl->loop, call->timer);
      call->timer->data = call;
      uv_timer_start(call->timer, on_call_deadline, timeout_ms, 0);
    }
  }
  list_push(&cl->waiting, call);
  if (out) *out = call;
  if (cl->conn != NULL && cl->conn->ready && !cl->conn->goaway) {
    submit_call(call);
    if (!call->closed) sp_h2conn_flush(&cl->conn->io);
  } else if (!cl->connecting) {
    client_connect(cl);
  }
  return 0;
}

/* New data or the end for a submitted stream: wake its provider. */
static void ccall_kick(sp_rpc_ccall *call) {
  if (call->conn == NULL || call->stream_id <= 0) return;
  if (call->deferred) {
    call->deferred = false;
    nghttp2_session_resume_data(call->conn->io.h2, call->stream_id);
  }
  sp_h2conn_flush(&call->conn->io);
}

static int ccall_queue(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                       const ProtobufCMessage *msg) {
  if (call->closed || call->half_close || call->local_code >= 0)
    return SP_ESTATE;
  if (len > call->cl->opts.max_send_message) return SP_ETOOBIG;
  if (sp_rpc_outq_push(&call->q, msg, data, len) != 0) return SP_ENOMEM;
  ccall_kick(call);
  return 0;
}

int sp_rpc_ccall_send(sp_rpc_ccall *call, const uint8_t *data, size_t len) {
  if (call == NULL || (data == NULL && len > 0)) return SP_EINVAL;
  return ccall_queue(call, data, len, NULL);
}

int sp_rpc_ccall_send_msg(sp_rpc_ccall *call, const ProtobufCMessage *msg) {
  if (call == NULL || msg == NULL) return SP_EINVAL;
  return ccall_queue(call, NULL, protobuf_c_message_get_packed_size(msg), msg);
}

int sp_rpc_ccall_close_send(sp_rpc_ccall *call) {
  if (call == NULL) return SP_EINVAL;
  if (call->closed || call->half_close) return SP_ESTATE;
  call->half_close = true;
  ccall_kick(call);
  return 0;
}

void sp_rpc_ccall_cancel(sp_rpc_ccall *call) {
  if (call != NULL)
    call_abort(call, SP_RPC_CANCELLED, "cancelled by the client");
}

const uint8_t *sp_rpc_ccall_metadata(const sp_rpc_ccall *call, const char *key,
                                     size_t *len) {
  return sp_rpc_mdlist_get(&call->resp_md, key, len);
}
