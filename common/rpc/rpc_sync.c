/* Blocking calls on a private loop, for simple programs and tests. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc.h"

struct sp_rpc_sync {
  uv_loop_t loop;
  sp_rpc_client *cl;
};

typedef struct rmsg {
  struct rmsg *next;
  size_t len;
  uint8_t data[];
} rmsg;

struct sp_rpc_sync_stream {
  sp_rpc_sync *s;
  sp_rpc_ccall *call; /* NULL once closed */
  rmsg *head, *tail;
  size_t count;
  bool done;
  sp_rpc_status status;
};

int sp_rpc_sync_open(const char *addr, uint64_t connect_timeout_ms,
                     sp_rpc_sync **out) {
  sp_rpc_client_opts o = {.connect_timeout_ms = connect_timeout_ms};
  return sp_rpc_sync_open_opts(addr, &o, out);
}

int sp_rpc_sync_open_opts(const char *addr, const sp_rpc_client_opts *opts,
                          sp_rpc_sync **out) {
  if (out == NULL) return SP_EINVAL;
  sp_rpc_sync *s = calloc(1, sizeof *s);
  if (s == NULL) return SP_ENOMEM;
  if (uv_loop_init(&s->loop) != 0) {
    free(s);
    return SP_EIO;
  }
  int rc = sp_rpc_client_open(&s->loop, addr, opts, &s->cl);
  if (rc != 0) {
    uv_loop_close(&s->loop);
    free(s);
    return rc;
  }
  *out = s;
  return 0;
}

void sp_rpc_sync_close(sp_rpc_sync *s) {
  if (s == NULL) return;
  sp_rpc_client_close(s->cl, NULL, NULL);
  /* a wake-up (uv_stop) left by a callback that ran outside uv_run (a
   * stream that its own cancel closed at once) ends one uv_run early */
  while (uv_run(&s->loop, UV_RUN_DEFAULT) != 0) {
  }
  uv_loop_close(&s->loop);
  free(s);
}

/* The waits below run the loop one iteration at a time until their
 * condition holds. A callback that makes it hold early in an iteration
 * (a timer that was already due) would otherwise leave that iteration
 * blocked in poll until unrelated I/O arrives; uv_stop makes the poll
 * return at once. */
static void wake_waiter(uv_loop_t *loop) { uv_stop(loop); }

static void st_on_message(sp_rpc_ccall *call, const uint8_t *data, size_t len,
                          void *user) {
  (void)call;
  sp_rpc_sync_stream *st = user;
  rmsg *m = malloc(sizeof *m + len);
  if (m == NULL) {
    sp_rpc_ccall_cancel(st->call);
    return;
  }
  m->next = NULL;
  m->len = len;
  memcpy(m->data, data, len);
  if (st->tail)
    st->tail->next = m;
  else
    st->head = m;
  st->tail = m;
  st->count++;
  wake_waiter(&st->s->loop);
}

static void st_on_close(sp_rpc_ccall *call, const sp_rpc_status *status,
                        void *user) {
  (void)call;
  sp_rpc_sync_stream *st = user;
  st->status = *status;
  st->done = true;
  st->call = NULL;
  wake_waiter(&st->s->loop);
}

static const sp_rpc_ccall_cbs k_stream_cbs = {st_on_message, st_on_close};

int sp_rpc_sync_stream_open(sp_rpc_sync *s, const char *path,
                            uint64_t timeout_ms, const sp_rpc_md *md,
                            size_t n_md, sp_rpc_sync_stream **out) {
  if (s == NULL || out == NULL) return SP_EINVAL;
  sp_rpc_sync_stream *st = calloc(1, sizeof *st);
  if (st == NULL) return SP_ENOMEM;
  st->s = s;
  int rc = sp_rpc_client_start(s->cl, path, md, n_md, timeout_ms, &k_stream_cbs,
                               st, &st->call);
  if (rc != 0) {
    free(st);
    return rc;
  }
  *out = st;
  return 0;
}

int sp_rpc_sync_stream_send(sp_rpc_sync_stream *st, const ProtobufCMessage *m) {
  if (st->call == NULL) return SP_ESTATE;
  return sp_rpc_ccall_send_msg(st->call, m);
}

int sp_rpc_sync_stream_send_raw(sp_rpc_sync_stream *st, const uint8_t *data,
                                size_t len) {
  if (st->call == NULL) return SP_ESTATE;
  return sp_rpc_ccall_send(st->call, data, len);
}

int sp_rpc_sync_stream_close_send(sp_rpc_sync_stream *st) {
  if (st->call == NULL) return SP_ESTATE;
  return sp_rpc_ccall_close_send(st->call);
}

static void on_wait_timer(uv_timer_t *t) {
  *(bool *)t->data = true;
  wake_waiter(t->loop);
}
static void wait_timer_closed(uv_handle_t *h) { (void)h; }

int sp_rpc_sync_stream_recv(sp_rpc_sync_stream *st,
                            const ProtobufCMessageDescriptor *desc,
                            uint64_t wait_ms, ProtobufCMessage **msg,
                            sp_rpc_status *status) {
  bool expired = false;
  uv_timer_t timer;
  if (wait_ms > 0) {
    /* the loop's clock may be stale after a while without running */
    uv_update_time(&st->s->loop);
    uv_timer_init(&st->s->loop, &timer);
    timer.data = &expired;
    uv_timer_start(&timer, on_wait_timer, wait_ms, 0);
  }
  while (st->head == NULL && !st->done && !expired)
    uv_run(&st->s->loop, UV_RUN_ONCE);
  if (wait_ms > 0) {
    uv_close((uv_handle_t *)&timer, wait_timer_closed);
    /* let libuv release the handle before it goes out of scope */
    uv_run(&st->s->loop, UV_RUN_NOWAIT);
  }
  if (st->head != NULL) {
    rmsg *m = st->head;
    st->head = m->next;
    if (!st->head) st->tail = NULL;
    st->count--;
    int rc = 0;
    *msg = NULL;
    if (desc != NULL) {
      *msg = protobuf_c_message_unpack(desc, NULL, m->len, m->data);
      if (*msg == NULL) rc = SP_EFORMAT;
    }
    free(m);
    return rc;
  }
  if (st->done) {
    if (status) *status = st->status;
    return SP_ENOENT;
  }
  return SP_ETIMEDOUT;
}

void sp_rpc_sync_stream_close(sp_rpc_sync_stream *st) {
  if (st == NULL) return;
  if (st->call != NULL) {
    sp_rpc_ccall_cancel(st->call);
    while (!st->done) uv_run(&st->s->loop, UV_RUN_ONCE);
  }
  for (rmsg *m = st->head; m;) {
    rmsg *n = m->next;
    free(m);
    m = n;
  }
  free(st);
}

int sp_rpc_sync_unary(sp_rpc_sync *s, const char *path,
                      const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *resp_desc,
                      uint64_t timeout_ms, ProtobufCMessage **resp,
                      sp_rpc_status *status) {
  if (s == NULL || path == NULL || req == NULL || status == NULL)
    return SP_EINVAL;
  if (resp) *resp = NULL;
  sp_rpc_sync_stream *st;
  int rc = sp_rpc_sync_stream_open(s, path, timeout_ms, NULL, 0, &st);
  if (rc != 0) return rc;
  /* a send that fails locally (over the send limit) cancels the call and
   * reports why; SP_ESTATE means the call already ended with its status */
  int send_rc = sp_rpc_sync_stream_send(st, req);
  if (send_rc == 0)
    sp_rpc_sync_stream_close_send(st);
  else if (send_rc != SP_ESTATE && st->call != NULL)
    sp_rpc_ccall_cancel(st->call);
  while (!st->done) uv_run(&s->loop, UV_RUN_ONCE);
  *status = st->status;
  if (send_rc != 0 && send_rc != SP_ESTATE) {
    status->code =
        send_rc == SP_ETOOBIG ? SP_RPC_RESOURCE_EXHAUSTED : SP_RPC_INTERNAL;
    snprintf(status->message, sizeof status->message,
             "cannot send the request: %s", sp_strerror(send_rc));
  }
  if (status->code == SP_RPC_OK) {
    if (st->count != 1) {
      status->code = SP_RPC_UNIMPLEMENTED;
      snprintf(status->message, sizeof status->message,
               "expected one response message, got %zu", st->count);
    } else if (resp_desc != NULL && resp != NULL) {
      *resp = protobuf_c_message_unpack(resp_desc, NULL, st->head->len,
                                        st->head->data);
      if (*resp == NULL) {
        status->code = SP_RPC_INTERNAL;
        snprintf(status->message, sizeof status->message,
                 "cannot decode %s response", resp_desc->name);
      }
    }
  }
  sp_rpc_sync_stream_close(st);
  return 0;
}
