/* GetTrace and GetDump, and the dump written on a fault or an abort. */
#include "coord_dump.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "cast/dtype.h"
#include "coord_alerts.h"
#include "coord_base.h"
#include "coord_diag.h"
#include "coord_ranks.h"
#include "coord_verdict.h"

/* One gathering of recorders: a GetTrace (one rank), a GetDump or a dump
 * to the dump dir (every attached rank). */
typedef struct trace_req {
  struct trace_req *next;
  sp_coord *c;
  uint64_t id;
  sp_rpc_call *call; /* NULL: to the dump dir, or the caller went away */
  bool to_file, single, started;
  uint32_t last_n;
  uint32_t waiting;
  uint32_t *ranks;
  size_t n_ranks;
  Shardplane__V1__FlightRecord **recs; /* per entry of ranks */
  char **errs;
  char *reason;
  uv_timer_t timer;
} trace_req;

static uint64_t unix_ms(void) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return (uint64_t)tv.tv_sec * 1000u + (uint64_t)tv.tv_usec / 1000u;
}

static const char *enum_name(const ProtobufCEnumDescriptor *d, int v) {
  const ProtobufCEnumValue *x = protobuf_c_enum_descriptor_get_value(d, v);
  return x ? x->name : "?";
}

/* ---- bookkeeping ---- */

static void req_free(trace_req *q) {
  for (size_t i = 0; i < q->n_ranks; i++) {
    if (q->recs[i])
      shardplane__v1__flight_record__free_unpacked(q->recs[i], NULL);
    free(q->errs[i]);
  }
  free(q->recs);
  free(q->errs);
  free(q->ranks);
  free(q->reason);
  free(q);
}

static void timer_closed(uv_handle_t *h) { req_free(h->data); }

static void req_unlink(trace_req *q) {
  for (trace_req **p = &q->c->traces; *p; p = &(*p)->next)
    if (*p == q) {
      *p = q->next;
      break;
    }
  if (q->call) sp_rpc_call_set_user(q->call, NULL);
  q->call = NULL;
  if (q->started) {
    uv_timer_stop(&q->timer);
    q->timer.data = q;
    uv_close((uv_handle_t *)&q->timer, timer_closed);
  } else {
    req_free(q);
  }
}

/* ---- the document ---- */

static json_t *flight_json(const Shardplane__V1__FlightRecord *f) {
  json_t *ev = json_array();
  size_t i = 0, j = 0;
  /* both lists are oldest first: merge them by the worker's clock */
  while (i < f->n_transitions || j < f->n_collectives) {
    const Shardplane__V1__Transition *t =
        i < f->n_transitions ? f->transitions[i] : NULL;
    const Shardplane__V1__Collective *k =
        j < f->n_collectives ? f->collectives[j] : NULL;
    if (t && (!k || t->time_us <= k->time_us)) {
      bool h = t->machine == SHARDPLANE__V1__MACHINE__MACHINE_HANDLE;
      json_array_append_new(
          ev, json_pack("{sI ss ss sI ss sI}", "t_us", (json_int_t)t->time_us,
                        "type", "transition", "machine", h ? "handle" : "root",
                        "unit", (json_int_t)t->unit, "state",
                        sp_state_name(h ? SP_MACHINE_HANDLE : SP_MACHINE_ROOT,
                                      t->state),
                        "step", (json_int_t)t->step));
      i++;
    } else {
      const char *comm =
          k->comm == SHARDPLANE__V1__COMM_KIND__COMM_SHARD     ? "shard"
          : k->comm == SHARDPLANE__V1__COMM_KIND__COMM_REPLICA ? "replica"
                                                               : "world";
      json_array_append_new(
          ev,
          json_pack(
              "{sI ss ss sI sI ss sI ss sI sb sI}", "t_us",
              (json_int_t)k->time_us, "type", "collective", "comm", comm,
              "comm_index", (json_int_t)k->comm_index, "seq",
              (json_int_t)k->seq, "op",
              enum_name(&shardplane__v1__collective_op__descriptor, k->op),
              "unit", (json_int_t)k->unit, "dtype",
              sp_dtype_name((sp_dtype)k->dtype), "count", (json_int_t)k->count,
              "completed", (int)k->completed, "step", (json_int_t)k->step));
      j++;
    }
  }
  return json_pack("{sI sI sI so}", "recorded", (json_int_t)f->recorded,
                   "capacity", (json_int_t)f->capacity, "time_us",
                   (json_int_t)f->time_us, "events", ev);
}

static json_t *dump_json(sp_coord *c, const trace_req *q) {
  Shardplane__V1__GetJobResponse jr = SHARDPLANE__V1__GET_JOB_RESPONSE__INIT;
  Shardplane__V1__Progress prog;
  sp_coord_verdict_job(c, &jr, &prog);
  json_t *job = json_pack(
      "{ss ss sI ss ss ss}", "model", c->model->name, "plan_version",
      c->plan->version_hex, "world_size", (json_int_t)c->plan->world_size,
      "strategy", sp_strategy_name(c->plan->strategy), "state",
      enum_name(&shardplane__v1__job_state__descriptor, jr.state) + 4,
      "verdict", jr.verdict);
  json_t *alerts = json_array();
  Shardplane__V1__Alert *recent[SP_COORD_ALERTS_RECENT];
  size_t n = sp_coord_alerts_recent(c, recent, SP_COORD_ALERTS_RECENT);
  for (size_t i = 0; i < n; i++) {
    const Shardplane__V1__Alert *a = recent[i];
    json_t *cu = json_array(), *vi = json_array();
    for (size_t k = 0; k < a->n_culprits; k++)
      json_array_append_new(cu, json_integer(a->culprits[k]));
    for (size_t k = 0; k < a->n_victims; k++)
      json_array_append_new(vi, json_integer(a->victims[k]));
    const char *kind =
        a->kind == SHARDPLANE__V1__ALERT_KIND__ALERT_LOST
            ? "LOST"
            : enum_name(&shardplane__v1__alert_kind__descriptor, a->kind);
    json_array_append_new(
        alerts, json_pack("{ss sI so so ss}", "kind", kind, "time_ms",
                          (json_int_t)a->time_ms, "culprits", cu, "victims", vi,
                          "message", a->message ? a->message : ""));
  }
  json_t *ranks = json_array();
  uint64_t now = sp_coord_base_now_ms(c);
  for (size_t i = 0; i < q->n_ranks; i++) {
    sp_coord_rank_view v;
    sp_coord_ranks_get(c, q->ranks[i], &v);
    json_t *r = json_pack(
        "{sI ss ss sI sI ss sI}", "rank", (json_int_t)q->ranks[i], "status",
        enum_name(&shardplane__v1__rank_status__descriptor, v.status), "host",
        v.host ? v.host : "", "pid", (json_int_t)v.pid, "step",
        (json_int_t)v.step, "root_state",
        sp_state_name(SP_MACHINE_ROOT, v.root), "last_heard_ms_ago",
        (json_int_t)(now > v.last_heard_ms ? now - v.last_heard_ms : 0));
    if (q->recs[i]) {
      json_object_set_new(r, "flight", flight_json(q->recs[i]));
    } else {
      json_object_set_new(r, "flight", json_null());
      json_object_set_new(r, "flight_error",
                          json_string(q->errs[i] ? q->errs[i] : "no answer"));
    }
    json_array_append_new(ranks, r);
  }
  return json_pack("{ss sI ss so so so}", "format", "shardplane.dump/v1",
                   "taken_unix_ms", (json_int_t)unix_ms(), "reason",
                   q->reason ? q->reason : "", "job", job, "alerts", alerts,
                   "ranks", ranks);
}

static void write_file(sp_coord *c, const char *text) {
  const char *dir = c->cfg.diag.dump_dir;
  char path[4096], tmp[4112];
  snprintf(path, sizeof path, "%s/dump-%" PRIu64 ".json", dir, unix_ms());
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) {
    sp_coord_base_log(c, "cannot write the dump %s: %s", tmp, strerror(errno));
    return;
  }
  bool ok = fputs(text, f) >= 0;
  ok = fclose(f) == 0 && ok;
  if (!ok || rename(tmp, path) != 0) {
    sp_coord_base_log(c, "cannot write the dump %s: %s", path, strerror(errno));
    remove(tmp);
    return;
  }
  sp_coord_base_log(c, "dump written to %s", path);
}

static void req_done(trace_req *q) {
  sp_coord *c = q->c;
  if (q->single) {
    if (q->call) {
      if (q->recs[0]) {
        sp_rpc_call_reply(q->call, &q->recs[0]->base);
      } else {
        bool gone = q->errs[0] && strstr(q->errs[0], "no open session");
        sp_rpc_call_finish(q->call,
                           gone ? SP_RPC_UNAVAILABLE : SP_RPC_DEADLINE_EXCEEDED,
                           q->errs[0] ? q->errs[0] : "no answer");
      }
    }
  } else {
    json_t *doc = dump_json(c, q);
    char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    if (q->to_file && text) write_file(c, text);
    if (q->call) {
      if (text == NULL) {
        sp_rpc_call_finish(q->call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
      } else {
        Shardplane__V1__GetDumpResponse r =
            SHARDPLANE__V1__GET_DUMP_RESPONSE__INIT;
        r.json.data = (uint8_t *)text;
        r.json.len = strlen(text);
        sp_rpc_call_reply(q->call, &r.base);
      }
    }
    free(text);
  }
  q->call = NULL;
  req_unlink(q);
}

static void on_timeout(uv_timer_t *t) {
  trace_req *q = t->data;
  for (size_t i = 0; i < q->n_ranks; i++)
    if (q->recs[i] == NULL && q->errs[i] == NULL) {
      char msg[160];
      snprintf(msg, sizeof msg,
               "rank %u did not answer FLIGHT_DUMP within %u ms", q->ranks[i],
               SP_DIAG_TRACE_WAIT_MS);
      q->errs[i] = sp_strdup(msg);
    }
  req_done(q);
}

/* Sends FLIGHT_DUMP to each rank and waits for the answers (or the
 * deadline). Takes ranks. Returns 0 or SP_ENOMEM. */
static int gather(sp_coord *c, sp_rpc_call *call, bool single, bool to_file,
                  uint32_t *ranks, size_t n, uint32_t last_n,
                  const char *reason) {
  trace_req *q = calloc(1, sizeof *q);
  if (q == NULL) {
    free(ranks);
    return SP_ENOMEM;
  }
  q->c = c;
  q->ranks = ranks;
  q->n_ranks = n;
  q->recs = calloc(n + 1, sizeof *q->recs);
  q->errs = calloc(n + 1, sizeof *q->errs);
  q->reason = sp_strdup(reason ? reason : "");
  if (q->recs == NULL || q->errs == NULL || q->reason == NULL) {
    req_free(q);
    return SP_ENOMEM;
  }
  q->id = ++c->trace_counter;
  q->call = call;
  q->single = single;
  q->to_file = to_file;
  q->last_n = last_n;
  q->next = c->traces;
  c->traces = q;
  if (call) sp_rpc_call_set_user(call, q);
  Shardplane__V1__SessionDown d = SHARDPLANE__V1__SESSION_DOWN__INIT;
  d.command = SHARDPLANE__V1__COMMAND__FLIGHT_DUMP;
  d.request_id = q->id;
  d.last_n = last_n;
  for (size_t i = 0; i < n; i++) {
    sp_coord_rank_view v;
    sp_coord_ranks_get(c, ranks[i], &v);
    if (v.session == NULL || sp_rpc_call_send(v.session, &d.base) != 0) {
      char msg[160];
      snprintf(msg, sizeof msg, "rank %u has no open session stream (%s)",
               ranks[i],
               enum_name(&shardplane__v1__rank_status__descriptor, v.status));
      q->errs[i] = sp_strdup(msg);
    } else {
      q->waiting++;
    }
  }
  if (q->waiting == 0) {
    req_done(q);
    return 0;
  }
  uv_timer_init(c->loop, &q->timer);
  q->timer.data = q;
  q->started = true;
  uv_update_time(c->loop);
  uv_timer_start(&q->timer, on_timeout, SP_DIAG_TRACE_WAIT_MS, 0);
  return 0;
}

static uint32_t *attached_ranks(sp_coord *c, size_t *n) {
  uint32_t *v = malloc(((size_t)c->plan->world_size + 1) * sizeof *v);
  *n = 0;
  if (v == NULL) return NULL;
  for (uint32_t r = 0; r < c->plan->world_size; r++) v[(*n)++] = r;
  return v;
}

/* Keeps at most the newest SP_DIAG_MAX_FLIGHT_EVENTS of each list, as a
 * copy the coordinator owns (the decoded message goes with its handler). */
static Shardplane__V1__FlightRecord *copy_capped(
    const Shardplane__V1__FlightRecord *f) {
  Shardplane__V1__FlightRecord x = *f;
  if (x.n_transitions > SP_DIAG_MAX_FLIGHT_EVENTS) {
    x.transitions += x.n_transitions - SP_DIAG_MAX_FLIGHT_EVENTS;
    x.n_transitions = SP_DIAG_MAX_FLIGHT_EVENTS;
  }
  if (x.n_collectives > SP_DIAG_MAX_FLIGHT_EVENTS) {
    x.collectives += x.n_collectives - SP_DIAG_MAX_FLIGHT_EVENTS;
    x.n_collectives = SP_DIAG_MAX_FLIGHT_EVENTS;
  }
  size_t len = protobuf_c_message_get_packed_size(&x.base);
  uint8_t *buf = malloc(len + 1);
  if (buf == NULL) return NULL;
  protobuf_c_message_pack(&x.base, buf);
  Shardplane__V1__FlightRecord *out =
      shardplane__v1__flight_record__unpack(NULL, len, buf);
  free(buf);
  return out;
}

int sp_coord_dump_flight(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  const Shardplane__V1__FlightRecord *f = e->up->flight;
  uint32_t rank = e->rank;
  if (f == NULL) return 0;
  for (trace_req *q = c->traces; q; q = q->next) {
    if (q->id != f->request_id) continue;
    for (size_t i = 0; i < q->n_ranks; i++) {
      if (q->ranks[i] != rank || q->recs[i] || q->errs[i]) continue;
      q->recs[i] = copy_capped(f);
      if (q->recs[i])
        q->recs[i]->rank = rank; /* the rank is the stream's */
      else
        q->errs[i] = sp_strdup("out of memory");
      if (--q->waiting == 0) req_done(q);
      return 0;
    }
    return 0;
  }
  return 0;
}

int sp_coord_dump_write(sp_coord *c, void *user, const sp_coord_event *e) {
  (void)user;
  if (c->cfg.diag.dump_dir == NULL || c->shutting_down) return 0;
  size_t n;
  uint32_t *v = attached_ranks(c, &n);
  if (v != NULL) gather(c, NULL, false, true, v, n, 0, e->text);
  return 0;
}

void sp_coord_dump_shutdown(sp_coord *c) {
  while (c->traces) {
    trace_req *q = c->traces;
    /* a dump still gathering is written with what came: a job that
     * failed is often stopped (shardplane run stops its coordinator)
     * before its ranks, aborted, could all answer */
    if (q->to_file && !q->single) {
      for (size_t i = 0; i < q->n_ranks; i++)
        if (q->recs[i] == NULL && q->errs[i] == NULL)
          q->errs[i] = sp_strdup(
              "the coordinator shut down before it answered FLIGHT_DUMP");
      req_done(q);
      continue;
    }
    if (q->call)
      sp_rpc_call_finish(q->call, SP_RPC_UNAVAILABLE,
                         "coordinator shutting down");
    q->call = NULL;
    req_unlink(q);
  }
}

/* ---- the RPCs ---- */

static sp_coord *coord_of(sp_rpc_call *call) {
  return sp_rpc_call_method_user(call);
}

static void on_cancel(sp_rpc_call *call, int code) {
  (void)code;
  trace_req *q = sp_rpc_call_user(call);
  if (q) q->call = NULL;
  sp_rpc_call_set_user(call, NULL);
}

static void on_get_trace(sp_rpc_call *call, const ProtobufCMessage *msg,
                         const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__GetTraceRequest *q = (const void *)msg;
  if (q->rank >= c->plan->world_size) {
    sp_rpc_call_finishf(call, SP_RPC_INVALID_ARGUMENT,
                        "rank %u is out of range: the world has ranks 0-%u",
                        q->rank, c->plan->world_size - 1);
    return;
  }
  uint32_t *v = malloc(sizeof *v);
  if (v) *v = q->rank;
  if (v == NULL || gather(c, call, true, false, v, 1, q->last_n, NULL) != 0)
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
}

static void on_get_dump(sp_rpc_call *call, const ProtobufCMessage *msg,
                        const uint8_t *raw, size_t len) {
  (void)raw;
  (void)len;
  sp_coord *c = coord_of(call);
  const Shardplane__V1__GetDumpRequest *q = (const void *)msg;
  size_t n;
  uint32_t *v = attached_ranks(c, &n);
  if (v == NULL || gather(c, call, false, false, v, n, q->last_n,
                          "asked for by GetDump") != 0)
    sp_rpc_call_finish(call, SP_RPC_RESOURCE_EXHAUSTED, "out of memory");
}

#define M(name, req, fn, cancel)                                             \
  {                                                                          \
    SP_COORD_PATH(name), SP_RPC_UNARY, &shardplane__v1__##req##__descriptor, \
        fn, NULL, cancel, NULL                                               \
  }

static const sp_rpc_method k_methods[] = {
    M("GetTrace", get_trace_request, on_get_trace, on_cancel),
    M("GetDump", get_dump_request, on_get_dump, on_cancel),
};

int sp_coord_dump_register(sp_coord *c) {
  return sp_coord_base_add_methods(c, k_methods,
                                   sizeof k_methods / sizeof k_methods[0]);
}
