#include "echo_service.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "echo.pb-c.h"

typedef Shardplane__Testing__EchoRequest EchoRequest;
typedef Shardplane__Testing__EchoReply EchoReply;

static unsigned g_cancelled, g_active;

/* State of a call that has work left (a delay, or replies still to send). */
typedef struct pending {
  sp_rpc_call *call;
  uv_timer_t timer;
  EchoRequest *req; /* a copy: the engine frees its message on return */
  uint32_t next;    /* ServerStream: next index to send */
  bool stream;
} pending;

static void copy_metadata(sp_rpc_call *call) {
  static const char *const keys[] = {"x-echo", "x-echo-bin"};
  for (int i = 0; i < 2; i++) {
    size_t len;
    const uint8_t *v = sp_rpc_call_metadata(call, keys[i], &len);
    if (v != NULL) sp_rpc_call_add_metadata(call, keys[i], v, len);
  }
}

static int reply(sp_rpc_call *call, const EchoRequest *req, uint32_t index) {
  EchoReply r = SHARDPLANE__TESTING__ECHO_REPLY__INIT;
  r.text = req->text;
  r.payload = req->payload;
  r.index = index;
  return sp_rpc_call_send(call, &r.base);
}

static void pending_closed(uv_handle_t *h) {
  pending *p = h->data;
  shardplane__testing__echo_request__free_unpacked(p->req, NULL);
  free(p);
}

static void pending_done(pending *p) {
  g_active--;
  sp_rpc_call_set_user(p->call, NULL);
  uv_timer_stop(&p->timer);
  uv_close((uv_handle_t *)&p->timer, pending_closed);
}

/* Sends what is left of a ServerStream; stops when the queue is full and
 * resumes from on_writable. */
static void stream_more(pending *p) {
  const EchoRequest *req = p->req;
  while (p->next < req->repeat) {
    int rc = reply(p->call, req, p->next);
    if (rc == SP_EAGAIN) return;
    if (rc != 0) {
      sp_rpc_call *call = p->call;
      pending_done(p);
      sp_rpc_call_finishf(call, SP_RPC_INTERNAL, "send failed: %s",
                          sp_strerror(rc));
      return;
    }
    p->next++;
  }
  sp_rpc_call *call = p->call;
  pending_done(p);
  sp_rpc_call_finish(call, SP_RPC_OK, NULL);
}

static void on_writable(sp_rpc_call *call) {
  pending *p = sp_rpc_call_user(call);
  if (p != NULL) stream_more(p);
}

static void finish_unary(sp_rpc_call *call, const EchoRequest *req) {
  if (req->fail_code != 0) {
    sp_rpc_call_finish(call, req->fail_code, req->fail_message);
    return;
  }
  copy_metadata(call);
  if (strcmp(req->text, "__stats__") == 0) {
    char text[64];
    snprintf(text, sizeof text, "cancelled=%u active=%u", g_cancelled,
             g_active);
    EchoReply r = SHARDPLANE__TESTING__ECHO_REPLY__INIT;
    r.text = text;
    sp_rpc_call_send(call, &r.base);
  } else if (strcmp(req->text, "__authorization__") == 0) {
    size_t len = 0;
    const uint8_t *v = sp_rpc_call_metadata(call, "authorization", &len);
    EchoReply r = SHARDPLANE__TESTING__ECHO_REPLY__INIT;
    r.text = v != NULL ? (char *)v : "";
    sp_rpc_call_send(call, &r.base);
  } else {
    reply(call, req, 0);
  }
  sp_rpc_call_finish(call, SP_RPC_OK, NULL);
}

static void on_delay(uv_timer_t *t) {
  pending *p = t->data;
  if (p->stream) {
    stream_more(p);
    return;
  }
  sp_rpc_call *call = p->call;
  EchoRequest *req = p->req;
  p->req = NULL;
  pending_done(p);
  finish_unary(call, req);
  shardplane__testing__echo_request__free_unpacked(req, NULL);
}

static void on_cancel(sp_rpc_call *call, int code) {
  (void)code;
  g_cancelled++;
  pending *p = sp_rpc_call_user(call);
  if (p != NULL) pending_done(p);
}

static pending *make_pending(sp_rpc_call *call, const ProtobufCMessage *msg,
                             const uint8_t *raw, size_t len) {
  (void)msg;
  pending *p = calloc(1, sizeof *p);
  if (p == NULL) return NULL;
  p->req = shardplane__testing__echo_request__unpack(NULL, len, raw);
  if (p->req == NULL) {
    free(p);
    return NULL;
  }
  p->call = call;
  uv_timer_init(sp_rpc_call_loop(call), &p->timer);
  p->timer.data = p;
  g_active++;
  sp_rpc_call_set_user(call, p);
  return p;
}

static void on_unary(sp_rpc_call *call, const ProtobufCMessage *msg,
                     const uint8_t *raw, size_t len) {
  const EchoRequest *req = (const EchoRequest *)msg;
  if (req->delay_ms == 0) {
    finish_unary(call, req);
    return;
  }
  pending *p = make_pending(call, msg, raw, len);
  if (p == NULL) {
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  /* The loop's clock was read when this iteration began, maybe
   * milliseconds ago under load: without a fresh reading the delay would
   * end early by that much, against the call's measured duration. */
  uv_update_time(p->timer.loop);
  uv_timer_start(&p->timer, on_delay, req->delay_ms, 0);
}

static void on_server_stream(sp_rpc_call *call, const ProtobufCMessage *msg,
                             const uint8_t *raw, size_t len) {
  const EchoRequest *req = (const EchoRequest *)msg;
  if (req->fail_code != 0) {
    sp_rpc_call_finish(call, req->fail_code, req->fail_message);
    return;
  }
  pending *p = make_pending(call, msg, raw, len);
  if (p == NULL) {
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  p->stream = true;
  copy_metadata(call);
  sp_rpc_call_on_writable(call, on_writable);
  uv_timer_start(&p->timer, on_delay, req->delay_ms, 0);
}

/* ClientStream keeps the concatenated texts in a malloc'd string. */
static void on_client_msg(sp_rpc_call *call, const ProtobufCMessage *msg,
                          const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const EchoRequest *req = (const EchoRequest *)msg;
  char *acc = sp_rpc_call_user(call);
  size_t have = acc ? strlen(acc) : 0, add = strlen(req->text);
  if (have + add > (1u << 20)) {
    free(acc);
    sp_rpc_call_set_user(call, NULL);
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "too much text");
    return;
  }
  char *n = realloc(acc, have + add + 1);
  if (n == NULL) return;
  memcpy(n + have, req->text, add + 1);
  sp_rpc_call_set_user(call, n);
}

static void on_client_done(sp_rpc_call *call) {
  char *acc = sp_rpc_call_user(call);
  EchoReply r = SHARDPLANE__TESTING__ECHO_REPLY__INIT;
  r.text = acc ? acc : (char *)"";
  sp_rpc_call_send(call, &r.base);
  free(acc);
  sp_rpc_call_set_user(call, NULL);
  sp_rpc_call_finish(call, SP_RPC_OK, NULL);
}

static void on_client_cancel(sp_rpc_call *call, int code) {
  (void)code;
  g_cancelled++;
  free(sp_rpc_call_user(call));
}

static void on_bidi_msg(sp_rpc_call *call, const ProtobufCMessage *msg,
                        const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  const EchoRequest *req = (const EchoRequest *)msg;
  uintptr_t n = (uintptr_t)sp_rpc_call_user(call);
  if (req->fail_code != 0) {
    sp_rpc_call_finish(call, req->fail_code, req->fail_message);
    return;
  }
  reply(call, req, (uint32_t)n);
  sp_rpc_call_set_user(call, (void *)(n + 1));
}

static void on_bidi_done(sp_rpc_call *call) {
  sp_rpc_call_finish(call, SP_RPC_OK, NULL);
}

static void on_plain_cancel(sp_rpc_call *call, int code) {
  (void)call;
  (void)code;
  g_cancelled++;
}

static const ProtobufCMessageDescriptor *const k_req =
    &shardplane__testing__echo_request__descriptor;

static sp_rpc_method k_methods[] = {
    {"/shardplane.testing.Echo/Unary", SP_RPC_UNARY, NULL, on_unary, NULL,
     on_cancel, NULL},
    {"/shardplane.testing.Echo/ServerStream", SP_RPC_SERVER_STREAMING, NULL,
     on_server_stream, NULL, on_cancel, NULL},
    {"/shardplane.testing.Echo/ClientStream", SP_RPC_CLIENT_STREAMING, NULL,
     on_client_msg, on_client_done, on_client_cancel, NULL},
    {"/shardplane.testing.Echo/Bidi", SP_RPC_BIDI_STREAMING, NULL, on_bidi_msg,
     on_bidi_done, on_plain_cancel, NULL},
};

int sp_echo_register(sp_rpc_server *srv) {
  for (size_t i = 0; i < sizeof k_methods / sizeof k_methods[0]; i++)
    k_methods[i].input = k_req;
  return sp_rpc_server_add_methods(srv, k_methods,
                                   sizeof k_methods / sizeof k_methods[0]);
}
