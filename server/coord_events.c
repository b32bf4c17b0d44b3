/* Watch: a server stream of events (attached, lost, detached, alerts and,
 * when asked for, transitions), filtered by rank and kind. A watcher that
 * cannot keep up is ended rather than buffered without bound. */
#include "coord_events.h"

#include <stdlib.h>
#include <string.h>

#include "coord_base.h"

#define MAX_FILTER 4096

struct sp_coord_watch {
  sp_rpc_call *call;
  uint32_t *ranks; /* sorted; empty: all */
  size_t n_ranks;
  uint32_t kinds; /* bit per EventKind */
  sp_coord_watch *next;
};

static int cmp_u32(const void *a, const void *b) {
  uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return x < y ? -1 : x > y;
}

static bool wants(const sp_coord_watch *w, Shardplane__V1__EventKind kind,
                  uint32_t rank) {
  if (!(w->kinds & (1u << kind))) return false;
  return w->n_ranks == 0 ||
         bsearch(&rank, w->ranks, w->n_ranks, sizeof rank, cmp_u32) != NULL;
}

static void drop(sp_coord *c, sp_coord_watch *w) {
  for (sp_coord_watch **pp = &c->watchers; *pp; pp = &(*pp)->next)
    if (*pp == w) {
      *pp = w->next;
      break;
    }
  free(w->ranks);
  free(w);
}

static void publish(sp_coord *c, Shardplane__V1__EventKind kind, uint32_t rank,
                    const char *message, const Shardplane__V1__Transition *t,
                    const Shardplane__V1__Alert *a) {
  if (c->watchers == NULL) return;
  Shardplane__V1__Event ev = SHARDPLANE__V1__EVENT__INIT;
  ev.kind = kind;
  ev.rank = rank;
  ev.time_ms = sp_coord_base_now_ms(c);
  ev.message = (char *)(message ? message : "");
  ev.transition = (Shardplane__V1__Transition *)t;
  ev.alert = (Shardplane__V1__Alert *)a;
  for (sp_coord_watch *w = c->watchers, *next; w; w = next) {
    next = w->next;
    if (!wants(w, kind, rank)) continue;
    int rc = sp_rpc_call_send(w->call, &ev.base);
    if (rc != 0) {
      sp_rpc_call *call = w->call;
      sp_rpc_call_set_user(call, NULL);
      drop(c, w);
      sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED,
                         "watcher fell behind; events would be lost");
    }
  }
}

void sp_coord_events_publish(sp_coord *c, Shardplane__V1__EventKind kind,
                             uint32_t rank, const char *message,
                             const Shardplane__V1__Transition *t) {
  publish(c, kind, rank, message, t, NULL);
}

void sp_coord_events_publish_alert(sp_coord *c,
                                   const Shardplane__V1__Alert *a) {
  publish(c, SHARDPLANE__V1__EVENT_KIND__ALERT, a->rank, a->message, NULL, a);
}

static void on_watch(sp_rpc_call *call, const ProtobufCMessage *msg,
                     const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = sp_rpc_call_method_user(call);
  const Shardplane__V1__WatchRequest *q =
      (const Shardplane__V1__WatchRequest *)msg;
  if (q->n_ranks > MAX_FILTER) {
    sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                        "at most %d ranks in a filter", MAX_FILTER);
    return;
  }
  sp_coord_watch *w = calloc(1, sizeof *w);
  uint32_t *ranks = malloc((q->n_ranks ? q->n_ranks : 1) * sizeof *ranks);
  if (w == NULL || ranks == NULL) {
    free(w);
    free(ranks);
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
    return;
  }
  for (size_t i = 0; i < q->n_ranks; i++) {
    if (q->ranks[i] >= c->plan->world_size) {
      free(w);
      free(ranks);
      sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                          "rank %u is out of range: the world has ranks 0-%u",
                          q->ranks[i], c->plan->world_size - 1);
      return;
    }
    ranks[i] = q->ranks[i];
  }
  qsort(ranks, q->n_ranks, sizeof *ranks, cmp_u32);
  w->ranks = ranks;
  w->n_ranks = q->n_ranks;
  for (size_t i = 0; i < q->n_kinds; i++) {
    if (q->kinds[i] <= SHARDPLANE__V1__EVENT_KIND__EVENT_UNKNOWN ||
        q->kinds[i] > SHARDPLANE__V1__EVENT_KIND__ALERT) {
      free(w->ranks);
      free(w);
      sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                          "unknown event kind %d", (int)q->kinds[i]);
      return;
    }
    w->kinds |= 1u << q->kinds[i];
  }
  if (w->kinds == 0) /* everything but the (many) transitions */
    w->kinds = (1u << SHARDPLANE__V1__EVENT_KIND__RANK_ATTACHED) |
               (1u << SHARDPLANE__V1__EVENT_KIND__RANK_LOST) |
               (1u << SHARDPLANE__V1__EVENT_KIND__RANK_DETACHED) |
               (1u << SHARDPLANE__V1__EVENT_KIND__ALERT);
  w->call = call;
  w->next = c->watchers;
  c->watchers = w;
  sp_rpc_call_set_user(call, w);
  /* the response headers tell the client it is subscribed */
  sp_rpc_call_start(call);
}

static void on_watch_cancel(sp_rpc_call *call, int code) {
  (void)code;
  sp_coord_watch *w = sp_rpc_call_user(call);
  if (w != NULL) drop(sp_rpc_call_method_user(call), w);
}

static const sp_rpc_method k_methods[] = {
    {SP_COORD_PATH("Watch"), SP_RPC_SERVER_STREAMING,
     &shardplane__v1__watch_request__descriptor, on_watch, NULL,
     on_watch_cancel, NULL},
};

int sp_coord_events_register(sp_coord *c) {
  return sp_coord_base_add_methods(c, k_methods, 1);
}

void sp_coord_events_shutdown(sp_coord *c) {
  while (c->watchers != NULL) {
    sp_coord_watch *w = c->watchers;
    sp_rpc_call *call = w->call;
    sp_rpc_call_set_user(call, NULL);
    drop(c, w);
    sp_rpc_call_finish(call, SP_RPC_UNAVAILABLE, "coordinator shutting down");
  }
}
