/* grpc.health.v1.Health on every server (docs/wire-protocol.md): Check answers
 * from a table of service names, Watch streams the current status and then
 * every change. */
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "rpc_internal.h"
#include "base/strmap.h"

#define SERVICE_UNKNOWN 3
#define MAX_SERVICES 1024

typedef struct sp_rpc_health_watch {
  sp_rpc_call *call;
  char *name;
  struct sp_rpc_health_watch *next;
} health_watch;

static int find(const sp_rpc_health_state *h, const char *name) {
  for (size_t i = 0; i < h->n; i++)
    if (strcmp(h->e[i].name, name) == 0) return (int)i;
  return -1;
}

static int status_of(const sp_rpc_health_state *h, const char *name) {
  int i = find(h, name);
  return i < 0 ? SERVICE_UNKNOWN : h->e[i].status;
}

static int send_status(sp_rpc_call *call, int status) {
  Grpc__Health__V1__HealthCheckResponse r =
      GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
  return sp_rpc_call_send(call, &r.base);
}

static void on_check(sp_rpc_call *call, const ProtobufCMessage *msg,
                     const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_rpc_health_state *h = sp_rpc_call_method_user(call);
  const Grpc__Health__V1__HealthCheckRequest *req =
      (const Grpc__Health__V1__HealthCheckRequest *)msg;
  int i = find(h, req->service);
  if (i < 0) {
    sp_rpc_call_finishf(call, SP_RPC_NOT_FOUND, "unknown service \"%.200s\"",
                        req->service);
    return;
  }
  send_status(call, h->e[i].status);
  sp_rpc_call_finish(call, SP_RPC_OK, NULL);
}

static void on_watch(sp_rpc_call *call, const ProtobufCMessage *msg,
                     const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_rpc_health_state *h = sp_rpc_call_method_user(call);
  const Grpc__Health__V1__HealthCheckRequest *req =
      (const Grpc__Health__V1__HealthCheckRequest *)msg;
  health_watch *w = calloc(1, sizeof *w);
  char *name = sp_strdup(req->service);
  if (w == NULL || name == NULL) {
    free(w);
    free(name);
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  w->call = call;
  w->name = name;
  w->next = h->watchers;
  h->watchers = w;
  sp_rpc_call_set_user(call, w);
  send_status(call, status_of(h, name));
}

static void drop_watch(sp_rpc_health_state *h, health_watch *w) {
  for (health_watch **pp = &h->watchers; *pp; pp = &(*pp)->next)
    if (*pp == w) {
      *pp = w->next;
      break;
    }
  free(w->name);
  free(w);
}

static void on_watch_cancel(sp_rpc_call *call, int code) {
  (void)code;
  health_watch *w = sp_rpc_call_user(call);
  if (w != NULL) drop_watch(sp_rpc_call_method_user(call), w);
}

int sp_rpc_health_init(sp_rpc_server *srv, sp_rpc_health_state *h) {
  memset(h, 0, sizeof *h);
  h->methods[0] =
      (sp_rpc_method){"/grpc.health.v1.Health/Check",
                      SP_RPC_UNARY,
                      &grpc__health__v1__health_check_request__descriptor,
                      on_check,
                      NULL,
                      NULL,
                      h};
  h->methods[1] =
      (sp_rpc_method){"/grpc.health.v1.Health/Watch",
                      SP_RPC_SERVER_STREAMING,
                      &grpc__health__v1__health_check_request__descriptor,
                      on_watch,
                      NULL,
                      on_watch_cancel,
                      h};
  int rc = sp_rpc_server_add_methods(srv, h->methods, 2);
  if (rc == 0) rc = sp_rpc_health_set(h, "", SP_HEALTH_SERVING);
  return rc;
}

int sp_rpc_health_set(sp_rpc_health_state *h, const char *service,
                      sp_rpc_health status) {
  if (service == NULL || status < SP_HEALTH_UNKNOWN ||
      status > SP_HEALTH_NOT_SERVING)
    return SP_EINVAL;
  int i = find(h, service);
  if (i < 0) {
    if (h->n >= MAX_SERVICES) return SP_ETOOBIG;
    if (h->n == h->cap) {
      size_t cap = h->cap ? h->cap * 2 : 8;
      struct sp_rpc_health_ent *e = realloc(h->e, cap * sizeof *e);
      if (e == NULL) return SP_ENOMEM;
      h->e = e;
      h->cap = cap;
    }
    char *name = sp_strdup(service);
    if (name == NULL) return SP_ENOMEM;
    i = (int)h->n++;
    h->e[i].name = name;
  } else if (h->e[i].status == (int)status) {
    return 0;
  }
  h->e[i].status = (int)status;
  for (health_watch *w = h->watchers; w; w = w->next)
    if (strcmp(w->name, service) == 0)
      send_status(w->call, (int)status); /* a full queue drops the update */
  return 0;
}

void sp_rpc_health_shutdown(sp_rpc_health_state *h) {
  for (size_t i = 0; i < h->n; i++)
    sp_rpc_health_set(h, h->e[i].name, SP_HEALTH_NOT_SERVING);
  while (h->watchers != NULL) {
    health_watch *w = h->watchers;
    sp_rpc_call *call = w->call;
    sp_rpc_call_set_user(call, NULL);
    drop_watch(h, w);
    sp_rpc_call_finish(call, SP_RPC_UNAVAILABLE, "server is shutting down");
  }
}

void sp_rpc_health_free(sp_rpc_health_state *h) {
  for (size_t i = 0; i < h->n; i++) free(h->e[i].name);
  free(h->e);
  while (h->watchers != NULL) {
    health_watch *w = h->watchers;
    h->watchers = w->next;
    free(w->name);
    free(w);
  }
}
