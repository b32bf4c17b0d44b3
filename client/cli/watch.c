/* `shardplane watch`: the coordinator's event stream (attached, lost,
 * transitions, alerts), printed as it arrives. */
#include <ctype.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/flag.h"
#include "cli.h"
#include "flight_fmt.h"
#include "plan/state.h"
#include "remote.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* ------------------------------------------------------------------ */
/* watch                                                               */
/* ------------------------------------------------------------------ */

static const subcmd k_watch = {
    "watch [--rank R]... [--kind K]... [--transitions] [--count N] "
    "[options]",
    "Prints the coordinator's events as they happen, one line each (JSON\n"
    "Lines with --json), until Ctrl-C, the end of the stream, or --count\n"
    "events. By default: ranks attached, lost and detached, and alerts\n"
    "(with their kind: DESYNC, STALL, STRAGGLER, LOST, ILLEGAL_TRANSITION,\n"
    "culprits and victims). As text it first says where the job is and\n"
    "what it waits for: a healthy job may have no event for a long time.\n"
    "The first column is the time of the event (UTC): the worker's own\n"
    "clock for a transition, which it stamps when it happens (a step's\n"
    "events reach the coordinator in batches), else the coordinator's.\n\n"
    "  --rank R                     only rank R's events (repeatable)\n"
    "  --kind K                     only events of kind K: attached, lost,\n"
    "                               detached, transition, alert "
    "(repeatable)\n"
    "  --transitions                training-state transitions as well\n"
    "  --count N                    stop after N events\n"
    "(--timeout-ms bounds connecting; the stream itself has no deadline)\n"
    "\n",
    0, 0, NULL};

/* The coordinator refuses longer rank filters. */
#define WATCH_MAX_RANKS 4096

enum { OPT_W_RANK = 256, OPT_W_KIND, OPT_W_TRANSITIONS, OPT_W_COUNT };

typedef struct watch_args {
  const char *cmd;
  uint32_t ranks[WATCH_MAX_RANKS];
  size_t n_ranks;
  uint32_t kinds; /* bit per EventKind */
  bool transitions;
  long long count; /* 0: no limit */
} watch_args;

/* "attached", "RANK_ATTACHED", "alert", ... (any case). */
static int parse_kind(const char *s, int *out) {
  char up[40] = "RANK_";
  size_t n = strlen(s);
  if (n == 0 || n > 20) return -1;
  for (size_t i = 0; i <= n; i++)
    up[5 + i] = (char)toupper((unsigned char)s[i]);
  const ProtobufCEnumDescriptor *d = &shardplane__v1__event_kind__descriptor;
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value_by_name(d, up + 5);
  if (v == NULL) v = protobuf_c_enum_descriptor_get_value_by_name(d, up);
  if (v == NULL || v->value == SHARDPLANE__V1__EVENT_KIND__EVENT_UNKNOWN)
    return -1;
  *out = v->value;
  return 0;
}

static int watch_opt(void *ctx, int c, const char *arg) {
  watch_args *w = ctx;
  long long v;
  int kind;
  sp_diag d = {{0}};
  switch (c) {
    case OPT_W_RANK:
      if (sp_flag_int("--rank", arg, 0, UINT32_MAX, &v, &d) != 0) break;
      if (w->n_ranks == WATCH_MAX_RANKS) {
        sp_cli_error(w->cmd, "at most %d --rank filters", WATCH_MAX_RANKS);
        return -1;
      }
      w->ranks[w->n_ranks++] = (uint32_t)v;
      return 0;
    case OPT_W_KIND:
      if (parse_kind(arg, &kind) != 0) {
        sp_flag_fail(&d, "--kind", arg,
                     "one of attached, lost, detached, "
                     "transition, alert");
        break;
      }
      w->kinds |= 1u << kind;
      return 0;
    case OPT_W_TRANSITIONS: w->transitions = true; return 0;
    case OPT_W_COUNT:
      if (sp_cli_parse_uint(arg, INT64_MAX, &v) != 0 || v == 0) {
        sp_flag_fail(&d, "--count", arg, "a positive integer");
        break;
      }
      w->count = v;
      return 0;
    default: return -1;
  }
  /* the flag, the value and what is allowed, as every flag error */
  sp_cli_error(w->cmd, "%s", d.msg);
  return -1;
}

static volatile sig_atomic_t g_watch_stop;

static void on_stop_signal(int sig) {
  (void)sig;
  g_watch_stop = 1;
}

static json_t *transition_json(const Shardplane__V1__Transition *t) {
  if (t == NULL) return json_null();
  sp_machine m = t->machine == SHARDPLANE__V1__MACHINE__MACHINE_HANDLE
                     ? SP_MACHINE_HANDLE
                     : SP_MACHINE_ROOT;
  json_t *o =
      json_pack("{s:s,s:s,s:I}", "machine", sp_state_machine_name(m), "state",
                sp_state_name(m, t->state), "step", (json_int_t)t->step);
  if (o != NULL && m == SP_MACHINE_HANDLE)
    json_object_set_new(o, "unit", json_integer(t->unit));
  return o;
}

/* When the event happened, in microseconds since the epoch: the worker's
 * stamp where it has one, else the coordinator's time_ms from its start
 * (coord_start_us, learned from its uptime when the watch began). */
static uint64_t event_time_us(const Shardplane__V1__Event *ev,
                              uint64_t coord_start_us, bool *worker) {
  *worker = false;
  if (ev->transition != NULL && ev->transition->time_us > 0) {
    *worker = true;
    return ev->transition->time_us;
  }
  return sp_remote_coord_wall_us(coord_start_us, ev->time_ms);
}

/* One line per event; -1 when stdout is gone. */
static int print_event(const Shardplane__V1__Event *ev, bool json,
                       uint64_t coord_start_us) {
  bool worker;
  uint64_t t_us = event_time_us(ev, coord_start_us, &worker);
  const char *kind =
      sp_remote_enum_name(&shardplane__v1__event_kind__descriptor, ev->kind);
  if (json) {
    json_t *o =
        json_pack("{s:s,s:i,s:I,s:s,s:o}", "kind", kind, "rank", (int)ev->rank,
                  "time_ms", (json_int_t)ev->time_ms, "message", ev->message,
                  "transition", transition_json(ev->transition));
    if (o != NULL) {
      json_object_set_new(o, "time_us", json_integer((json_int_t)t_us));
      json_object_set_new(o, "worker_time", json_boolean(worker));
      json_object_set_new(
          o, "alert",
          ev->alert ? sp_remote_alert_json(ev->alert) : json_null());
    }
    int rc = o ? json_dumpf(o, stdout, JSON_COMPACT | JSON_PRESERVE_ORDER) : -1;
    json_decref(o);
    if (rc != 0 || putchar('\n') == EOF) return -1;
  } else {
    if (strncmp(kind, "RANK_", 5) == 0) kind += 5;
    char when[32];
    sp_flight_time(t_us, when, sizeof when);
    printf("%s  rank %-6u %-10s", when, ev->rank, kind);
    const Shardplane__V1__Transition *t = ev->transition;
    if (t != NULL) {
      if (t->machine == SHARDPLANE__V1__MACHINE__MACHINE_HANDLE)
        printf(" unit %u -> %s", t->unit,
               sp_state_name(SP_MACHINE_HANDLE, t->state));
      else
        printf(" root -> %s", sp_state_name(SP_MACHINE_ROOT, t->state));
      printf(", step %" PRIu64, t->step);
    }
    if (ev->alert != NULL) {
      putchar(' ');
      sp_remote_print_alert(stdout, ev->alert);
    } else if (ev->message[0] != '\0') {
      printf(" %s", ev->message);
    }
    putchar('\n');
  }
  /* a pipe reader sees each event as it happens */
  return fflush(stdout) == 0 ? 0 : -1;
}

/* The first lines of a text watch: the job as it is now, and what is
 * watched. A healthy job has no events for as long as it runs, and a
 * watch that printed nothing looked like one that does not work. */
static void print_header(const sp_remote *r,
                         const Shardplane__V1__GetJobResponse *j,
                         uint32_t world, const watch_args *w, uint32_t kinds) {
  char prog[256];
  sp_remote_progress_words(j->progress, prog, sizeof prog);
  printf("coordinator %s, job %s: %s, %u of %u ranks attached\n", r->addr,
         sp_remote_job_state_name(j->state), prog,
         j->ranks != NULL ? j->ranks->attached : 0, world);
  printf("waiting for events (");
  const char *sep = "";
  for (int k = 1; k <= SHARDPLANE__V1__EVENT_KIND__ALERT; k++)
    if (kinds & (1u << k)) {
      const char *name =
          sp_remote_enum_name(&shardplane__v1__event_kind__descriptor, k);
      if (strncmp(name, "RANK_", 5) == 0) name += 5;
      printf("%s", sep);
      for (const char *c = name; *c; c++) putchar(tolower((unsigned char)*c));
      sep = ", ";
    }
  if (w->n_ranks > 0) {
    printf(" of rank%s ", w->n_ranks > 1 ? "s" : "");
    for (size_t i = 0; i < w->n_ranks; i++)
      printf("%s%u", i ? "," : "", w->ranks[i]);
  } else {
    printf(" of every rank");
  }
  printf("); times UTC; Ctrl-C stops\n");
}

/* Reads events until the stream ends, a signal, or the count is reached. */
static int watch_loop(sp_remote *r, sp_rpc_sync_stream *st, long long count,
                      uint64_t coord_start_us) {
  int ec = SP_EXIT_OK;
  long long seen = 0;
  while (!g_watch_stop && (count == 0 || seen < count)) {
    ProtobufCMessage *m = NULL;
    sp_rpc_status status;
    /* wake up now and then to notice Ctrl-C */
    int rc = sp_rpc_sync_stream_recv(st, &shardplane__v1__event__descriptor,
                                     200, &m, &status);
    if (rc == SP_ETIMEDOUT) continue;
    if (rc == SP_ENOENT) {
      if (status.code != SP_RPC_OK) ec = sp_remote_fail_status(r, &status);
      break;
    }
    if (rc != 0) {
      sp_cli_error(r->cmd, "cannot decode an event: %s", sp_strerror(rc));
      ec = SP_EXIT_FAILURE;
      break;
    }
    int wrc =
        print_event((const Shardplane__V1__Event *)m, r->json, coord_start_us);
    sp_remote_free_msg(m);
    if (wrc != 0) {
      ec = SP_EXIT_FAILURE; /* the reader went away (e.g. `| head`) */
      break;
    }
    seen++;
  }
  return ec;
}

int sp_cmd_watch(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "watch");
  watch_args *w = calloc(1, sizeof *w);
  if (w == NULL) return SP_EXIT_FAILURE;
  w->cmd = r.cmd;
  const struct option own[] = {
      {"rank", required_argument, NULL, OPT_W_RANK},
      {"kind", required_argument, NULL, OPT_W_KIND},
      {"transitions", no_argument, NULL, OPT_W_TRANSITIONS},
      {"count", required_argument, NULL, OPT_W_COUNT},
  };
  int first;
  size_t n;
  int ec = sp_remote_parse_args(&r, &k_watch, argc, argv, own, 4, watch_opt, w,
                                &first, &n);
  if (ec != PROCEED) {
    free(w);
    return ec;
  }
  sp_rpc_sync_stream *st = NULL;
  uint64_t coord_start_us = 0;
  Shardplane__V1__GetJobResponse *j = NULL;
  uint32_t world = 0;
  {
    /* an unknown rank is "not found" here, as in `plan --rank`; the
     * uptime places the coordinator's event times on the wall clock */
    sp_job job;
    sp_job_init(&job);
    ec = sp_remote_get_job(&r, &j, &job);
    if (ec == SP_EXIT_OK)
      coord_start_us = sp_remote_coord_start_us(j->uptime_ms);
    for (size_t i = 0; ec == SP_EXIT_OK && i < w->n_ranks; i++)
      ec = sp_cli_check_rank(r.cmd, w->ranks[i], job.world_size);
    world = job.world_size;
    sp_job_clear(&job);
  }
  if (ec != SP_EXIT_OK) goto out;
  const uint32_t all_but_transitions =
      (1u << SHARDPLANE__V1__EVENT_KIND__RANK_ATTACHED) |
      (1u << SHARDPLANE__V1__EVENT_KIND__RANK_LOST) |
      (1u << SHARDPLANE__V1__EVENT_KIND__RANK_DETACHED) |
      (1u << SHARDPLANE__V1__EVENT_KIND__ALERT);
  /* no --kind: the server's default set; --transitions adds to whichever */
  uint32_t kinds = w->kinds;
  if (w->transitions)
    kinds = (kinds ? kinds : all_but_transitions) |
            (1u << SHARDPLANE__V1__EVENT_KIND__TRANSITION);
  uint32_t shown = kinds ? kinds : all_but_transitions;
  Shardplane__V1__EventKind kind_list[8];
  Shardplane__V1__WatchRequest q = SHARDPLANE__V1__WATCH_REQUEST__INIT;
  for (int k = 1; k <= SHARDPLANE__V1__EVENT_KIND__ALERT; k++)
    if (kinds & (1u << k))
      kind_list[q.n_kinds++] = (Shardplane__V1__EventKind)k;
  q.kinds = kind_list;
  q.n_ranks = w->n_ranks;
  q.ranks = w->ranks;
  /* no deadline: a watch lasts until it is stopped */
  int rc =
      sp_rpc_sync_stream_open(r.rpc, SP_COORD_PATH("Watch"), 0, NULL, 0, &st);
  if (rc == 0) rc = sp_rpc_sync_stream_send(st, &q.base);
  if (rc == 0) rc = sp_rpc_sync_stream_close_send(st);
  if (rc != 0 && rc != SP_ESTATE) {
    sp_cli_error(r.cmd, "cannot start watching: %s", sp_strerror(rc));
    ec = SP_EXIT_FAILURE;
    goto out;
  }
  /* Ctrl-C stops the watch cleanly from here on: a user who sees the
   * header may press it at once */
  struct sigaction sa = {.sa_handler = on_stop_signal}, old_int, old_term;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  if (!r.json) {
    print_header(&r, j, world, w, shown);
    if (fflush(stdout) != 0) ec = SP_EXIT_FAILURE; /* the reader went away */
  }
  /* SP_ESTATE: the call already ended; the loop reads its status */
  if (ec == SP_EXIT_OK) ec = watch_loop(&r, st, w->count, coord_start_us);
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
out:
  sp_rpc_sync_stream_close(st);
  sp_remote_free_msg(j);
  free(w);
  return sp_remote_finish(&r, ec);
}
