/* `shardplane trace`: one rank's flight recorder, pulled live from the
 * worker through the coordinator (GetTrace), one line per event with the
 * worker's own time. */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/flag.h"
#include "cli.h"
#include "flight_fmt.h"
#include "plan/state.h"
#include "lib/session/plan_wire.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "shardplane/v1/coordinator.pb-c.h"

static const subcmd k_trace = {
    "trace --rank R [--last N] [options]",
    "Rank R's recent events from its flight recorder, oldest first, one\n"
    "line each with the worker's clock (UTC): its training-state\n"
    "transitions and every collective it issued and completed, e.g.\n"
    "  12:03:41.123456 step 120 FORWARD unit 6\n"
    "  12:03:41.123501 step 120 all-gather #413 world unit 7 "
    "(transformer.h.6)\n"
    "                  bfloat16 x 1048576 issued\n"
    "  12:03:41.125602 step 120 all-gather #413 world unit 7 ... completed "
    "after 2.1 ms\n"
    "An issued collective with no completion after it is where the rank\n"
    "waits.\n\n"
    "  --rank R                     the rank (required)\n"
    "  --last N                     only its last N events (default: all\n"
    "                               the recorder keeps)\n",
    0, 0, NULL};

enum { OPT_T_RANK = 256, OPT_T_LAST };

typedef struct trace_args {
  const char *cmd;
  long long rank, last;
} trace_args;

static int trace_opt(void *ctx, int c, const char *arg) {
  trace_args *t = ctx;
  sp_diag d = {{0}};
  int rc;
  if (c == OPT_T_RANK)
    rc = sp_flag_int("--rank", arg, 0, UINT32_MAX, &t->rank, &d);
  else if (c == OPT_T_LAST)
    /* 0 would be the coordinator's "all": not what --last 0 says */
    rc = sp_flag_int("--last", arg, 1, UINT32_MAX, &t->last, &d);
  else
    return -1;
  if (rc != 0) sp_cli_error(t->cmd, "%s", d.msg);
  return rc == 0 ? 0 : -1;
}

static const char *comm_name(int k) {
  switch (k) {
    case SHARDPLANE__V1__COMM_KIND__COMM_SHARD: return "shard";
    case SHARDPLANE__V1__COMM_KIND__COMM_REPLICA: return "replica";
    default: return "world";
  }
}

/* The units' module FQNs, from the plan; NULL (no names) when the plan
 * cannot be had: a trace is still worth printing without them. *ec is
 * PROCEED, or the exit code of a connection that failed (printed). */
static Shardplane__V1__Plan *fetch_plan(sp_remote *r, int *ec) {
  Shardplane__V1__GetPlanRequest q = SHARDPLANE__V1__GET_PLAN_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  *ec = sp_remote_call_status(r, SP_COORD_PATH("GetPlan"), &q.base,
                              &shardplane__v1__plan__descriptor, r->timeout_ms,
                              &m, &st);
  if (*ec != PROCEED) return NULL;
  if (st.code != SP_RPC_OK) {
    sp_remote_free_msg(m);
    return NULL;
  }
  return (Shardplane__V1__Plan *)m;
}

static const char *unit_fqn(const Shardplane__V1__Plan *pl, uint32_t unit) {
  if (pl == NULL) return NULL;
  for (size_t i = 0; i < pl->n_units; i++)
    if (pl->units[i]->index == unit) return pl->units[i]->module_fqn;
  return NULL;
}

typedef struct merged {
  uint64_t t_us;
  const Shardplane__V1__Transition *t;
  const Shardplane__V1__Collective *c;
} merged;

static int merged_cmp(const void *pa, const void *pb) {
  const merged *a = pa, *b = pb;
  if (a->t_us != b->t_us) return a->t_us < b->t_us ? -1 : 1;
  /* one clock, so a tie is the same microsecond: keep the recorder's order
   * of each list, transitions (the cause) before collectives */
  if ((a->t != NULL) != (b->t != NULL)) return a->t != NULL ? -1 : 1;
  return a < b ? -1 : a > b;
}

static void to_event(const merged *e, const merged *all, size_t i,
                     const Shardplane__V1__Plan *pl, sp_flight_event *out) {
  memset(out, 0, sizeof *out);
  out->t_us = e->t_us;
  out->after_us = -1;
  if (e->t != NULL) {
    sp_machine m = e->t->machine == SHARDPLANE__V1__MACHINE__MACHINE_HANDLE
                       ? SP_MACHINE_HANDLE
                       : SP_MACHINE_ROOT;
    out->machine = m == SP_MACHINE_HANDLE ? "handle" : "root";
    out->state = sp_state_name(m, e->t->state);
    out->unit = e->t->unit;
    out->step = e->t->step;
    if (m == SP_MACHINE_HANDLE) out->fqn = unit_fqn(pl, e->t->unit);
    return;
  }
  const Shardplane__V1__Collective *c = e->c;
  out->collective = true;
  out->comm = comm_name(c->comm);
  out->comm_index = c->comm_index;
  out->seq = c->seq;
  out->op =
      sp_remote_enum_name(&shardplane__v1__collective_op__descriptor, c->op);
  out->dtype = sp_dtype_name(sp_wire_dtype(c->dtype));
  out->count = c->count;
  out->unit = c->unit;
  out->step = c->step;
  out->completed = c->completed;
  out->fqn = unit_fqn(pl, c->unit);
  if (!c->completed) return;
  for (size_t j = i; j-- > 0;) {
    const Shardplane__V1__Collective *p = all[j].c;
    if (p != NULL && !p->completed && p->seq == c->seq && p->comm == c->comm &&
        p->comm_index == c->comm_index) {
      if (c->time_us >= p->time_us)
        out->after_us = (int64_t)(c->time_us - p->time_us);
      break;
    }
  }
}

static json_t *event_json(const sp_flight_event *e) {
  if (!e->collective)
    return json_pack("{s:I,s:s,s:s,s:i,s:s,s:I}", "t_us", (json_int_t)e->t_us,
                     "type", "transition", "machine", e->machine, "unit",
                     (int)e->unit, "state", e->state, "step",
                     (json_int_t)e->step);
  json_t *o = json_pack("{s:I,s:s,s:s,s:i,s:I,s:s,s:i,s:s,s:I,s:b,s:I}", "t_us",
                        (json_int_t)e->t_us, "type", "collective", "comm",
                        e->comm, "comm_index", (int)e->comm_index, "seq",
                        (json_int_t)e->seq, "op", e->op, "unit", (int)e->unit,
                        "dtype", e->dtype, "count", (json_int_t)e->count,
                        "completed", e->completed, "step", (json_int_t)e->step);
  if (o != NULL && e->fqn != NULL)
    json_object_set_new(o, "fqn", json_string(e->fqn));
  if (o != NULL && e->after_us >= 0)
    json_object_set_new(o, "after_us", json_integer(e->after_us));
  return o;
}

static int print_trace(const sp_remote *r,
                       const Shardplane__V1__FlightRecord *f,
                       const Shardplane__V1__Plan *pl) {
  size_t n = f->n_transitions + f->n_collectives;
  merged *all = calloc(n + 1, sizeof *all);
  if (all == NULL) return SP_EXIT_FAILURE;
  for (size_t i = 0; i < f->n_transitions; i++)
    all[i] = (merged){f->transitions[i]->time_us, f->transitions[i], NULL};
  for (size_t i = 0; i < f->n_collectives; i++)
    all[f->n_transitions + i] =
        (merged){f->collectives[i]->time_us, NULL, f->collectives[i]};
  qsort(all, n, sizeof *all, merged_cmp);
  int ec = SP_EXIT_OK;
  json_t *events = r->json ? json_array() : NULL;
  if (!r->json) {
    char t[32];
    sp_flight_time(f->time_us, t, sizeof t);
    printf("rank %u: %zu events of %" PRIu64
           " recorded (the recorder keeps "
           "%u), taken %s\n",
           f->rank, n, f->recorded, f->capacity, t);
  }
  for (size_t i = 0; i < n; i++) {
    sp_flight_event e;
    to_event(&all[i], all, i, pl, &e);
    if (r->json) {
      json_array_append_new(events, event_json(&e));
    } else {
      char line[700];
      sp_flight_line(&e, line, sizeof line);
      printf("%s\n", line);
    }
  }
  if (r->json && sp_render_json_out(json_pack(
                     "{s:i,s:I,s:i,s:I,s:o}", "rank", (int)f->rank, "recorded",
                     (json_int_t)f->recorded, "capacity", (int)f->capacity,
                     "time_us", (json_int_t)f->time_us, "events", events)) != 0)
    ec = SP_EXIT_FAILURE;
  free(all);
  return ec;
}

int sp_cmd_trace(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "trace");
  trace_args t = {.cmd = r.cmd, .rank = -1};
  const struct option own[] = {
      {"rank", required_argument, NULL, OPT_T_RANK},
      {"last", required_argument, NULL, OPT_T_LAST},
  };
  int first;
  size_t n;
  int ec = sp_remote_parse_args(&r, &k_trace, argc, argv, own, 2, trace_opt, &t,
                                &first, &n);
  if (ec != PROCEED) return ec;
  if (t.rank < 0) {
    sp_cli_error(r.cmd, "missing --rank R (which rank's recorder?)");
    sp_cli_try_help(r.cmd);
    return SP_EXIT_USAGE;
  }
  Shardplane__V1__Plan *pl = fetch_plan(&r, &ec);
  /* no coordinator, or a bad token file: said once, not again by the
   * GetTrace call */
  if (ec != PROCEED) return sp_remote_finish(&r, ec);
  /* not found, as with plan --rank, before the coordinator's
   * INVALID_ARGUMENT */
  if (pl != NULL && pl->job != NULL &&
      (ec = sp_cli_check_rank(r.cmd, t.rank, pl->job->world_size)) !=
          SP_EXIT_OK) {
    sp_remote_free_msg(pl);
    return sp_remote_finish(&r, ec);
  }
  Shardplane__V1__GetTraceRequest q = SHARDPLANE__V1__GET_TRACE_REQUEST__INIT;
  q.rank = (uint32_t)t.rank;
  q.last_n = (uint32_t)t.last;
  ProtobufCMessage *m;
  sp_rpc_status st;
  ec = sp_remote_call_status(&r, SP_COORD_PATH("GetTrace"), &q.base,
                             &shardplane__v1__flight_record__descriptor,
                             r.timeout_ms, &m, &st);
  if (ec == PROCEED) {
    ec = st.code == SP_RPC_OK ? SP_EXIT_OK : sp_remote_fail_status(&r, &st);
    /* the coordinator answered (its probe did): UNAVAILABLE is the rank's
     * ("rank 3 has no open session stream (LOST)"), a failure, not 4, "no
     * coordinator answered"; its own shutdown stays 4 */
    if (st.code == SP_RPC_UNAVAILABLE && strncmp(st.message, "rank ", 5) == 0)
      ec = SP_EXIT_FAILURE;
  }
  if (ec == SP_EXIT_OK) {
    ec = print_trace(&r, (const Shardplane__V1__FlightRecord *)m, pl);
    sp_remote_free_msg(m);
  }
  sp_remote_free_msg(pl);
  return sp_remote_finish(&r, ec);
}
