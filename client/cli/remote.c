/* The subcommands that ask a running coordinator (service
 * shardplane.v1.Coordinator): status, ranks, plan (without --model), where,
 * buffers, watch and store. Each is one or two blocking gRPC calls; the
 * tables and JSON shared with the offline plan live in render.c.
 *
 * Exit codes follow the gRPC status: INVALID_ARGUMENT is bad usage (2),
 * NOT_FOUND is 3, UNAVAILABLE is 4; everything else is a failure (1). A
 * health check precedes the first call, so "no coordinator answered" (4)
 * is never confused with a call that timed out on a live coordinator. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "grpc/health/v1/health.pb-c.h"
#include "lib/plan_wire.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"
#include "fsdp/state.h"


/* parse_args(): go on with the subcommand (any other value is an exit code). */
#define PROCEED (-1)

/* see remote_connect */
#define PROBE_GRACE_MS 250

/* ------------------------------------------------------------------ */
/* Session                                                             */
/* ------------------------------------------------------------------ */

void sp_remote_init(sp_remote *r, const char *cmd) {
  const char *env = getenv(SP_COORDINATOR_ENV);
  bool from_env = env != NULL && env[0] != '\0';
  *r = (sp_remote){.cmd = cmd,
                   .addr = from_env ? env : SP_DEFAULT_COORDINATOR,
                   .addr_from_env = from_env,
                   .timeout_ms = SP_DEFAULT_TIMEOUT_MS};
}

int sp_remote_option(sp_remote *r, int c, const char *arg) {
  long long v;
  switch (c) {
  case SP_OPT_COORDINATOR:
    r->addr = arg;
    r->addr_from_env = false;
    return 1;
  case SP_OPT_TIMEOUT:
    if (sp_cli_parse_uint(arg, 86400000, &v) != 0 || v == 0) {
      sp_cli_error(r->cmd, "--timeout-ms: expected 1..86400000, got \"%s\"",
                   arg);
      return -1;
    }
    r->timeout_ms = (uint64_t)v;
    return 1;
  default:
    return 0;
  }
}

/* The proto name of an enum value ("RANK_ATTACHED"), "UNKNOWN" if none. */
static const char *enum_name(const ProtobufCEnumDescriptor *d, int v) {
  const ProtobufCEnumValue *ev = protobuf_c_enum_descriptor_get_value(d, v);
  return ev != NULL ? ev->name : "UNKNOWN";
}

static void remote_close(sp_remote *r) {
  sp_rpc_sync_close(r->rpc);
  r->rpc = NULL;
}

static int exit_code_of(int code) {
  switch (code) {
  case SP_RPC_OK: return SP_EXIT_OK;
  case SP_RPC_INVALID_ARGUMENT: return SP_EXIT_USAGE;
  case SP_RPC_NOT_FOUND: return SP_EXIT_NOT_FOUND;
  case SP_RPC_UNAVAILABLE: return SP_EXIT_UNREACHABLE;
  default: return SP_EXIT_FAILURE;
  }
}

/* Prints the server's message and its status name; returns the exit code. */
static int fail_status(const sp_remote *r, const sp_rpc_status *st) {
  sp_cli_error(r->cmd, "%s (%s)", st->message[0] ? st->message : "call failed",
               sp_rpc_code_name(st->code));
  return exit_code_of(st->code);
}

/* Opens the connection and asks the standard health service whether the
 * coordinator serves. Connection failures surface here, with a deadline
 * that the probe alone uses, which is what lets a later DEADLINE_EXCEEDED
 * (a store wait, a slow answer) mean "the coordinator took too long" and
 * not "there is no coordinator". */
static int remote_connect(sp_remote *r) {
  char host[256];
  int port;
  if (sp_rpc_split_addr(r->addr, host, sizeof host, &port) != 0) {
    sp_cli_error(r->cmd, "%s: expected HOST:PORT, got \"%s\"",
                 r->addr_from_env ? "$" SP_COORDINATOR_ENV : "--coordinator",
                 r->addr);
    return SP_EXIT_USAGE;
  }
  int rc = sp_rpc_sync_open(r->addr, r->timeout_ms, &r->rpc);
  if (rc != 0) {
    /* the address parsed, so SP_EINVAL is a host name that does not
     * resolve */
    sp_cli_error(r->cmd, "cannot reach the coordinator at %s: %s", r->addr,
                 rc == SP_EINVAL ? "the host name does not resolve"
                                 : sp_strerror(rc));
    return SP_EXIT_UNREACHABLE;
  }
  Grpc__Health__V1__HealthCheckRequest q =
      GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  q.service = (char *)SP_COORD_SERVICE;
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  /* The grace lets the connect loop (bounded by timeout_ms) end first and
   * report its last error, "connection refused", rather than a bare
   * deadline; an address that never answers still ends at the deadline. */
  rc = sp_rpc_sync_unary(r->rpc, "/grpc.health.v1.Health/Check", &q.base,
                         &grpc__health__v1__health_check_response__descriptor,
                         r->timeout_ms + PROBE_GRACE_MS, &m, &st);
  if (rc != 0) {
    sp_cli_error(r->cmd, "cannot call the coordinator: %s", sp_strerror(rc));
    return SP_EXIT_FAILURE;
  }
  int serving = -1;
  if (st.code == SP_RPC_OK) {
    serving = ((Grpc__Health__V1__HealthCheckResponse *)m)->status;
    protobuf_c_message_free_unpacked(m, NULL);
  }
  switch (st.code) {
  case SP_RPC_OK:
    if (serving ==
        GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING)
      return SP_EXIT_OK;
    sp_cli_error(
        r->cmd, "the coordinator at %s is not serving (%s)", r->addr,
        enum_name(
            &grpc__health__v1__health_check_response__serving_status__descriptor,
            serving));
    return SP_EXIT_UNREACHABLE;
  case SP_RPC_UNIMPLEMENTED:
    /* a gRPC server without health checking: the real call will tell */
    return SP_EXIT_OK;
  case SP_RPC_NOT_FOUND:
    sp_cli_error(r->cmd, "%s answers, but does not serve %s (NOT_FOUND)",
                 r->addr, SP_COORD_SERVICE);
    return SP_EXIT_UNREACHABLE;
  case SP_RPC_UNAVAILABLE:
  case SP_RPC_DEADLINE_EXCEEDED:
    sp_cli_error(r->cmd, "no coordinator answered at %s: %s (%s)", r->addr,
                 st.message, sp_rpc_code_name(st.code));
    return SP_EXIT_UNREACHABLE;
  default:
    return fail_status(r, &st);
  }
}

/* Connects if needed, then makes one unary call. Returns PROCEED with
 * *status set (the caller judges it; on OK *resp is the answer, which the
 * caller frees), or the exit code of a failure already printed. */
static int call_status(sp_remote *r, const char *method,
                       const ProtobufCMessage *req,
                       const ProtobufCMessageDescriptor *desc,
                       uint64_t timeout_ms, ProtobufCMessage **resp,
                       sp_rpc_status *status) {
  *resp = NULL;
  if (r->rpc == NULL) {
    int ec = remote_connect(r);
    if (ec != SP_EXIT_OK) return ec;
  }
  int rc = sp_rpc_sync_unary(r->rpc, method, req, desc, timeout_ms, resp,
                             status);
  if (rc != 0) {
    sp_cli_error(r->cmd, "cannot call %s: %s", method, sp_strerror(rc));
    return SP_EXIT_FAILURE;
  }
  return PROCEED;
}

/* One unary call with the session's deadline; a failure's message is
 * printed and its exit code returned. */
static int call(sp_remote *r, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *desc,
                ProtobufCMessage **resp) {
  sp_rpc_status st;
  int ec = call_status(r, method, req, desc, r->timeout_ms, resp, &st);
  if (ec != PROCEED) return ec;
  return st.code == SP_RPC_OK ? SP_EXIT_OK : fail_status(r, &st);
}

static void free_msg(void *m) {
  if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
}

/* Ends a subcommand: stdout must have reached its reader. */
static int finish(sp_remote *r, int exit_code) {
  remote_close(r);
  if (fflush(stdout) != 0 && exit_code == SP_EXIT_OK) {
    /* a reader that stopped early (`| head`) needs no message */
    if (errno != EPIPE)
      sp_cli_error(r->cmd, "cannot write the output: %s", strerror(errno));
    return SP_EXIT_FAILURE;
  }
  return exit_code;
}

/* ------------------------------------------------------------------ */
/* Command lines                                                       */
/* ------------------------------------------------------------------ */

typedef struct subcmd {
  const char *synopsis; /* after "usage: shardplane " */
  const char *help;     /* what it does, then its own options */
  size_t min_args, max_args;
} subcmd;

enum { OPT_JSON = 950, OPT_HELP };

static void subcmd_help(FILE *f, const subcmd *sc) {
  fprintf(f, "usage: shardplane %s\n\n%s", sc->synopsis, sc->help);
  fputs(SP_REMOTE_OPTIONS_HELP
        "  --json                       machine-readable output\n"
        "  --help                       this text\n"
        "\nexit codes: 0 ok, 1 failure, 2 bad usage, 3 not found, "
        "4 coordinator unreachable\n",
        f);
}

/* One option of parse_args. */
static int parse_one(sp_remote *r, const subcmd *sc, int c,
                     int (*on_opt)(void *ctx, int c, const char *arg),
                     void *ctx) {
  int mine = sp_remote_option(r, c, optarg);
  if (mine != 0) return mine < 0 ? SP_EXIT_USAGE : PROCEED;
  if (c == OPT_JSON) {
    r->json = true;
    return PROCEED;
  }
  if (c == OPT_HELP) {
    subcmd_help(stdout, sc);
    return SP_EXIT_OK;
  }
  if (c != '?' && on_opt != NULL && on_opt(ctx, c, optarg) == 0)
    return PROCEED;
  if (c == '?') /* getopt said what */
    fprintf(stderr, "usage: shardplane %s (--help for more)\n", sc->synopsis);
  return SP_EXIT_USAGE;
}

/* Parses argv (argv[0] is the subcommand) with the subcommand's own
 * options (handed to on_opt, which returns 0 or -1 after printing why) and
 * the common ones. The positional arguments are left in argv[optind..]
 * (*first) and counted in *n. Returns PROCEED, or the exit code to stop
 * with (--help, bad usage). */
static int parse_args(sp_remote *r, const subcmd *sc, int argc, char **argv,
                      const struct option *own, size_t n_own,
                      int (*on_opt)(void *ctx, int c, const char *arg),
                      void *ctx, int *first, size_t *n) {
  struct option opts[24];
  const struct option common[] = {
      SP_REMOTE_OPTIONS,
      {"json", no_argument, NULL, OPT_JSON},
      {"help", no_argument, NULL, OPT_HELP},
  };
  size_t n_common = sizeof common / sizeof common[0];
  if (n_own + n_common + 1 > sizeof opts / sizeof opts[0])
    return SP_EXIT_FAILURE;
  for (size_t i = 0; i < n_own; i++) opts[i] = own[i];
  for (size_t i = 0; i < n_common; i++) opts[n_own + i] = common[i];
  opts[n_own + n_common] = (struct option){NULL, 0, NULL, 0};
  /* getopt names argv[0] in its messages: make it "shardplane <cmd>" */
  char prog[64];
  snprintf(prog, sizeof prog, "shardplane %s", r->cmd);
  char *argv0 = argv[0];
  argv[0] = prog;
  int c, rc = PROCEED;
  optind = 1;
  while (rc == PROCEED && (c = getopt_long(argc, argv, "", opts, NULL)) != -1)
    rc = parse_one(r, sc, c, on_opt, ctx);
  argv[0] = argv0;
  if (rc != PROCEED) return rc;
  *first = optind;
  *n = (size_t)(argc - optind);
  if (*n < sc->min_args || *n > sc->max_args) {
    if (*n < sc->min_args)
      sp_cli_error(r->cmd, "missing argument");
    else
      sp_cli_error(r->cmd, "unexpected argument \"%s\"",
                   argv[optind + (int)sc->max_args]);
    fprintf(stderr, "usage: shardplane %s (--help for more)\n", sc->synopsis);
    return SP_EXIT_USAGE;
  }
  return PROCEED;
}

/* ------------------------------------------------------------------ */
/* Formatting helpers                                                  */
/* ------------------------------------------------------------------ */

/* "12.3s", "4m 05s", "2h 07m" */
static void format_duration(uint64_t ms, char *buf, size_t len) {
  if (ms < 60000)
    snprintf(buf, len, "%.1fs", (double)ms / 1000.0);
  else if (ms < 3600000)
    snprintf(buf, len, "%um %02us", (unsigned)(ms / 60000),
             (unsigned)(ms / 1000 % 60));
  else
    snprintf(buf, len, "%" PRIu64 "h %02um", ms / 3600000,
             (unsigned)(ms / 60000 % 60));
}

/* Ascending indices as "0-2,5,7-9". */
static void print_ranges(FILE *f, const uint32_t *idx, size_t n) {
  for (size_t i = 0; i < n;) {
    size_t j = i;
    while (j + 1 < n && idx[j + 1] == idx[j] + 1) j++;
    fprintf(f, "%s%u", i ? "," : "", idx[i]);
    if (j > i) fprintf(f, "-%u", idx[j]);
    i = j + 1;
  }
}

static json_t *collective_json(const Shardplane__V1__Collective *c) {
  if (c == NULL) return json_null();
  return json_pack("{s:I,s:s,s:i,s:o,s:I}", "seq", (json_int_t)c->seq, "op",
                   enum_name(&shardplane__v1__collective_op__descriptor, c->op),
                   "unit", (int)c->unit, "dtype",
                   sp_render_dtype_json(sp_wire_dtype(c->dtype)), "count",
                   (json_int_t)c->count);
}

/* ------------------------------------------------------------------ */
/* status                                                              */
/* ------------------------------------------------------------------ */

static const subcmd k_status = {
    "status [options]",
    "The job at a glance: model, job, plan version, how many ranks are in\n"
    "each state, and the alerts raised so far.\n\n",
    0, 0};

/* GetJob, with the job converted for the shared job renderer. */
static int get_job(sp_remote *r, Shardplane__V1__GetJobResponse **out,
                   sp_job *job) {
  Shardplane__V1__GetJobRequest q = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  ProtobufCMessage *m;
  int ec = call(r, SP_COORD_PATH("GetJob"), &q.base,
                &shardplane__v1__get_job_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  Shardplane__V1__GetJobResponse *j = (Shardplane__V1__GetJobResponse *)m;
  if (j->job == NULL || sp_wire_job(j->job, job) != 0) {
    free_msg(j);
    sp_cli_error(r->cmd, "the coordinator's answer has no job");
    return SP_EXIT_FAILURE;
  }
  *out = j;
  return SP_EXIT_OK;
}

/* proto3 leaves an all-zero summary out of the message */
static const Shardplane__V1__RankSummary *rank_summary(
    const Shardplane__V1__GetJobResponse *j) {
  static const Shardplane__V1__RankSummary empty =
      SHARDPLANE__V1__RANK_SUMMARY__INIT;
  return j->ranks != NULL ? j->ranks : &empty;
}

static json_t *rank_summary_json(const Shardplane__V1__RankSummary *s) {
  json_t *by_state = json_object();
  for (size_t i = 1; i < s->n_by_root_state; i++)
    json_object_set_new(by_state, sp_state_name(SP_MACHINE_ROOT, (int)i),
                        json_integer(s->by_root_state[i]));
  return json_pack("{s:i,s:i,s:i,s:i,s:o}", "attached", (int)s->attached,
                   "lost", (int)s->lost, "detached", (int)s->detached,
                   "never_attached", (int)s->never_attached, "by_root_state",
                   by_state);
}

static void print_status(const sp_remote *r,
                         const Shardplane__V1__GetJobResponse *j,
                         const sp_job *job) {
  char up[32];
  format_duration(j->uptime_ms, up, sizeof up);
  printf("coordinator %s, up %s\n", r->addr, up);
  printf("model       %s: %u modules, %u parameters, %" PRId64
         " elements, %u buffers\n",
         j->model_name, j->n_modules, j->n_params, j->total_numel,
         j->n_buffers);
  printf("job         ");
  sp_render_job_line(job, (sp_strategy)j->effective_strategy);
  printf("\nplan        version %s, %u units\n", j->plan_version, j->n_units);
  const Shardplane__V1__RankSummary *s = rank_summary(j);
  printf("ranks       %u attached", s->attached);
  bool any = false;
  for (size_t i = 1; i < s->n_by_root_state; i++)
    if (s->by_root_state[i] > 0) {
      printf("%s%u %s", any ? ", " : " (", s->by_root_state[i],
             sp_state_name(SP_MACHINE_ROOT, (int)i));
      any = true;
    }
  printf("%s, %u lost, %u detached, %u never attached\n", any ? ")" : "",
         s->lost, s->detached, s->never_attached);
  printf("alerts      %u", j->alerts);
  if (j->n_recent_alerts > 0)
    printf(" (the last %zu below)", j->n_recent_alerts);
  printf("\n");
  for (size_t i = 0; i < j->n_recent_alerts; i++) {
    const Shardplane__V1__Alert *a = j->recent_alerts[i];
    printf("  %10.3fs  rank %u: %s\n", (double)a->time_ms / 1000.0, a->rank,
           a->message);
  }
}

static int status_json(const sp_remote *r,
                       const Shardplane__V1__GetJobResponse *j,
                       const sp_job *job) {
  json_t *alerts = json_array();
  for (size_t i = 0; i < j->n_recent_alerts; i++)
    json_array_append_new(alerts,
                          json_pack("{s:i,s:s,s:I}", "rank",
                                    (int)j->recent_alerts[i]->rank, "message",
                                    j->recent_alerts[i]->message, "time_ms",
                                    (json_int_t)j->recent_alerts[i]->time_ms));
  json_t *root =
      json_pack("{s:s,s:I,s:{s:s,s:i,s:i,s:i,s:I},s:s,s:i,s:o,s:o,s:i,s:o}",
                "coordinator", r->addr, "uptime_ms", (json_int_t)j->uptime_ms,
                "model", "name", j->model_name, "modules", (int)j->n_modules,
                "params", (int)j->n_params, "buffers", (int)j->n_buffers,
                "elements", (json_int_t)j->total_numel, "plan_version",
                j->plan_version, "units", (int)j->n_units, "job",
                sp_render_job_json(job, (sp_strategy)j->effective_strategy, 0),
                "ranks", rank_summary_json(rank_summary(j)), "alerts",
                (int)j->alerts, "recent_alerts", alerts);
  return sp_render_json_out(root) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
}

int sp_cmd_status(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "status");
  int first;
  size_t n;
  int ec = parse_args(&r, &k_status, argc, argv, NULL, 0, NULL, NULL, &first,
                      &n);
  if (ec != PROCEED) return ec;
  Shardplane__V1__GetJobResponse *j = NULL;
  sp_job job;
  sp_job_init(&job);
  ec = get_job(&r, &j, &job);
  if (ec == SP_EXIT_OK) {
    if (r.json)
      ec = status_json(&r, j, &job);
    else
      print_status(&r, j, &job);
  }
  free_msg(j);
  sp_job_clear(&job);
  return finish(&r, ec);
}

/* ------------------------------------------------------------------ */
/* ranks                                                               */
/* ------------------------------------------------------------------ */

static const subcmd k_ranks = {
    "ranks [--unit-states] [options]",
    "Every rank: attach status, host, pid, device, step, root training\n"
    "state, last collective, when it was last heard from, alerts.\n\n"
    "  --unit-states                also each unit's training state\n",
    0, 0};

enum { OPT_UNIT_STATES = 256 };

static int ranks_opt(void *ctx, int c, const char *arg) {
  (void)arg;
  if (c != OPT_UNIT_STATES) return -1;
  *(bool *)ctx = true;
  return 0;
}

static const char *rank_status_name(int v) {
  return enum_name(&shardplane__v1__rank_status__descriptor, v);
}

/* "IDLE 0-2,4-13; FORWARD 3": the units in each handle state. */
static void print_unit_states(const Shardplane__V1__RankInfo *k,
                              uint32_t *scratch) {
  printf("      units:");
  const char *sep = " ";
  for (int s = 1; s <= sp_state_max(SP_MACHINE_HANDLE); s++) {
    size_t n = 0;
    for (size_t u = 0; u < k->n_unit_states; u++)
      if (k->unit_states[u] == s) scratch[n++] = (uint32_t)u;
    if (n == 0) continue;
    printf("%s%s ", sep, sp_state_name(SP_MACHINE_HANDLE, s));
    print_ranges(stdout, scratch, n);
    sep = "; ";
  }
  printf("\n");
}

static void print_ranks(const Shardplane__V1__ListRanksResponse *l,
                        bool unit_states) {
  size_t max_units = 0;
  for (size_t i = 0; i < l->n_ranks; i++)
    if (l->ranks[i]->n_unit_states > max_units)
      max_units = l->ranks[i]->n_unit_states;
  uint32_t *scratch = calloc(max_units + 1, sizeof *scratch);
  printf("%-9s %-14s %-20s %8s %-8s %8s %-18s %-34s %9s %6s\n", "RANK",
         "STATUS", "HOST", "PID", "DEVICE", "STEP", "STATE", "LAST COLLECTIVE",
         "HEARD", "ALERTS");
  for (size_t i = 0; i < l->n_ranks;) {
    const Shardplane__V1__RankInfo *k = l->ranks[i];
    if (k->status == SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED) {
      /* a large world is mostly ranks that never came: one row per run */
      size_t j = i;
      while (j + 1 < l->n_ranks &&
             l->ranks[j + 1]->status ==
                 SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED &&
             l->ranks[j + 1]->rank == l->ranks[j]->rank + 1)
        j++;
      char range[32];
      if (j > i)
        snprintf(range, sizeof range, "%u-%u", k->rank, l->ranks[j]->rank);
      else
        snprintf(range, sizeof range, "%u", k->rank);
      printf("%-9s %s\n", range, rank_status_name(k->status));
      i = j + 1;
      continue;
    }
    char coll[64] = "-", heard[32];
    const Shardplane__V1__Collective *c = k->last_collective;
    if (c != NULL)
      snprintf(coll, sizeof coll, "#%" PRIu64 " %s unit %u %s x%" PRIu64,
               c->seq,
               enum_name(&shardplane__v1__collective_op__descriptor, c->op),
               c->unit, sp_dtype_name(sp_wire_dtype(c->dtype)), c->count);
    format_duration(k->last_heard_ms_ago, heard, sizeof heard);
    printf("%-9u %-14s %-20s %8u %-8s %8" PRIu64 " %-18s %-34s %9s %6u\n",
           k->rank, rank_status_name(k->status), k->host[0] ? k->host : "-",
           k->pid, k->device[0] ? k->device : "-", k->step,
           sp_state_name(SP_MACHINE_ROOT, k->root_state), coll, heard,
           k->alerts);
    if (k->last_alert[0] != '\0')
      printf("      last alert: %s\n", k->last_alert);
    if (unit_states && scratch != NULL && k->n_unit_states > 0)
      print_unit_states(k, scratch);
    i++;
  }
  free(scratch);
}

static int ranks_json(const Shardplane__V1__ListRanksResponse *l,
                      bool unit_states) {
  json_t *ranks = json_array();
  for (size_t i = 0; i < l->n_ranks; i++) {
    const Shardplane__V1__RankInfo *k = l->ranks[i];
    json_t *o = json_pack(
        "{s:i,s:s,s:s,s:i,s:s,s:I,s:s,s:o,s:I,s:i,s:s,s:I}", "rank",
        (int)k->rank, "status", rank_status_name(k->status), "host", k->host,
        "pid", (int)k->pid, "device", k->device, "step", (json_int_t)k->step,
        "root_state", sp_state_name(SP_MACHINE_ROOT, k->root_state),
        "last_collective", collective_json(k->last_collective),
        "last_heard_ms_ago", (json_int_t)k->last_heard_ms_ago, "alerts",
        (int)k->alerts, "last_alert", k->last_alert, "transitions",
        (json_int_t)k->transitions);
    if (o != NULL && unit_states) {
      json_t *us = json_array();
      for (size_t u = 0; u < k->n_unit_states; u++)
        json_array_append_new(us, json_string(sp_state_name(
                                      SP_MACHINE_HANDLE, k->unit_states[u])));
      json_object_set_new(o, "unit_states", us);
    }
    json_array_append_new(ranks, o);
  }
  return sp_render_json_out(json_pack("{s:o}", "ranks", ranks)) == 0
             ? SP_EXIT_OK
             : SP_EXIT_FAILURE;
}

int sp_cmd_ranks(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "ranks");
  bool unit_states = false;
  const struct option own[] = {
      {"unit-states", no_argument, NULL, OPT_UNIT_STATES}};
  int first;
  size_t n;
  int ec = parse_args(&r, &k_ranks, argc, argv, own, 1, ranks_opt,
                      &unit_states, &first, &n);
  if (ec != PROCEED) return ec;
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  q.with_unit_states = unit_states;
  ProtobufCMessage *m;
  ec = call(&r, SP_COORD_PATH("ListRanks"), &q.base,
            &shardplane__v1__list_ranks_response__descriptor, &m);
  if (ec == SP_EXIT_OK) {
    const Shardplane__V1__ListRanksResponse *l =
        (const Shardplane__V1__ListRanksResponse *)m;
    if (r.json)
      ec = ranks_json(l, unit_states);
    else
      print_ranks(l, unit_states);
    free_msg(m);
  }
  return finish(&r, ec);
}

/* ------------------------------------------------------------------ */
/* plan (remote)                                                       */
/* ------------------------------------------------------------------ */

int sp_remote_plan(sp_remote *r, long long rank, const char *unit,
                   const sp_mem_opts *memory) {
  Shardplane__V1__GetJobResponse *j = NULL;
  sp_wire_plan *wp = NULL;
  sp_job job;
  sp_job_init(&job);
  /* GetJob for the header's model counts, GetPlan for the rest. The whole
   * plan is asked for even with --rank/--unit: the tables print every unit
   * and buffer, and the rank's shard and the unit's ranges come from the
   * plan math of common/ (the coordinator's own) on the rebuilt plan. */
  int ec = get_job(r, &j, &job);
  if (ec != SP_EXIT_OK) goto out;
  Shardplane__V1__GetPlanRequest q = SHARDPLANE__V1__GET_PLAN_REQUEST__INIT;
  Shardplane__V1__MemoryOptions mo = SHARDPLANE__V1__MEMORY_OPTIONS__INIT;
  if (memory != NULL) {
    mo.optimizer = (Shardplane__V1__Optimizer)memory->optimizer;
    mo.max_inflight_gathers = memory->max_inflight;
    mo.no_backward_prefetch = !memory->backward_prefetch;
    mo.no_sync = memory->no_sync;
    q.with_memory = true;
    q.memory = &mo;
  }
  ProtobufCMessage *m;
  if ((ec = call(r, SP_COORD_PATH("GetPlan"), &q.base,
                 &shardplane__v1__plan__descriptor, &m)) != SP_EXIT_OK)
    goto out;
  sp_diag diag = {""};
  if (sp_wire_plan_new((Shardplane__V1__Plan *)m, &wp, &diag) != 0) {
    sp_cli_error(r->cmd, "the coordinator's plan is malformed: %s", diag.msg);
    ec = SP_EXIT_FAILURE;
    goto out;
  }
  const sp_plan *pl = &wp->plan;
  if (rank >= (long long)pl->world_size) {
    sp_cli_error(r->cmd, "--rank %lld: the world has ranks 0-%u", rank,
                 pl->world_size - 1);
    ec = SP_EXIT_NOT_FOUND;
    goto out;
  }
  long u = -1;
  if (unit != NULL && (u = sp_plan_find_unit(pl, unit)) < 0) {
    sp_cli_error(r->cmd, "--unit %s: no such unit (%zu units)", unit,
                 pl->n_units);
    ec = SP_EXIT_NOT_FOUND;
    goto out;
  }
  sp_plan_source src = {.coordinator = r->addr,
                        .n_modules = j->n_modules,
                        .n_params = j->n_params,
                        .n_buffers = j->n_buffers,
                        .elements = j->total_numel,
                        .build_ms = -1};
  if (memory != NULL) {
    sp_mem_estimate e;
    if (sp_wire_memory(wp->msg->memory, &e, &diag) != 0) {
      sp_cli_error(r->cmd, "the coordinator's memory model is malformed: %s",
                   diag.msg);
      ec = SP_EXIT_FAILURE;
    } else if (r->json) {
      if (sp_render_memory_json(pl, &wp->job, &src, &e) != 0)
        ec = SP_EXIT_FAILURE;
    } else {
      sp_render_memory_text(pl, &wp->job, &src, &e);
    }
  } else if (r->json) {
    if (sp_render_plan_json(pl, &wp->job, &src, (long)rank, u) != 0)
      ec = SP_EXIT_FAILURE;
  } else {
    sp_render_plan_text(pl, &wp->job, &src, (long)rank, u);
  }
out:
  sp_wire_plan_free(wp);
  free_msg(j);
  sp_job_clear(&job);
  return finish(r, ec);
}

/* ------------------------------------------------------------------ */
/* where                                                               */
/* ------------------------------------------------------------------ */

static const subcmd k_where = {
    "where FQN [options]",
    "Where a parameter lives: its unit, its offset in the unit's flat\n"
    "parameter, and per shard the slice of it and the ranks that hold it\n"
    "(with HYBRID_SHARD, shard s is held by ranks s, s+G, s+2G, ... for\n"
    "shard groups of G). A tied name resolves to the tensor it shares.\n\n",
    1, 1};

/* The ranks holding shard index s: s + k*shard_world (FULL_SHARD and
 * SHARD_GRAD_OP: rank s alone; NO_SHARD, shard_world 1: every rank). */
static uint32_t shard_rank_count(const Shardplane__V1__ParamLocation *p,
                                 uint32_t s) {
  if (p->shard_world == 0 || s >= p->world_size) return 0;
  return (p->world_size - s + p->shard_world - 1) / p->shard_world;
}

static void print_shard_ranks(const Shardplane__V1__ParamLocation *p,
                              uint32_t s, char *buf, size_t len) {
  uint32_t n = shard_rank_count(p, s), step = p->shard_world;
  uint32_t last = n ? s + (n - 1) * step : s;
  if (n == 0)
    snprintf(buf, len, "-");
  else if (n == 1)
    snprintf(buf, len, "%u", s);
  else if (step == 1)
    snprintf(buf, len, "%u-%u", s, last);
  else if (n <= 6) {
    size_t off = 0;
    for (uint32_t k = 0; k < n && off < len; k++)
      off += (size_t)snprintf(buf + off, len - off, "%s%u", k ? "," : "",
                              s + k * step);
  } else {
    snprintf(buf, len, "%u,%u,...,%u (%u ranks)", s, s + step, last, n);
  }
}

static int where_json(const Shardplane__V1__ParamLocation *p) {
  json_t *slices = json_array();
  for (size_t i = 0; i < p->n_slices; i++) {
    const Shardplane__V1__ParamSlice *sl = p->slices[i];
    json_t *ranks = json_array();
    for (uint32_t k = 0; k < shard_rank_count(p, sl->shard); k++)
      json_array_append_new(ranks,
                            json_integer(sl->shard + k * p->shard_world));
    json_array_append_new(
        slices, json_pack("{s:i,s:o,s:I,s:I,s:I,s:I}", "shard", (int)sl->shard,
                          "ranks", ranks, "offset_in_shard",
                          (json_int_t)sl->offset_in_shard, "numel",
                          (json_int_t)sl->numel, "intra_start",
                          (json_int_t)sl->intra_start, "intra_end",
                          (json_int_t)sl->intra_end));
  }
  json_t *root = json_pack(
      "{s:s,s:s,s:b,s:i,s:s,s:o,s:o,s:I,s:I,s:s,s:i,s:i,s:o}", "fqn", p->fqn,
      "flattened_as", p->flattened_as, "is_alias", p->is_alias, "unit",
      (int)p->unit, "unit_module", p->unit_fqn, "shape",
      sp_render_shape_json(p->n_shape, p->shape), "dtype",
      sp_render_dtype_json(sp_wire_dtype(p->dtype)), "offset",
      (json_int_t)p->offset, "numel", (json_int_t)p->numel, "strategy",
      sp_strategy_name((sp_strategy)p->strategy), "world_size",
      (int)p->world_size, "shard_world", (int)p->shard_world, "slices", slices);
  return sp_render_json_out(root) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
}

static void print_where(const Shardplane__V1__ParamLocation *p) {
  char shape[96];
  sp_render_shape(p->n_shape, p->shape, shape, sizeof shape);
  printf("parameter %s", p->fqn);
  if (p->is_alias) printf("  (tied: flattened as %s)", p->flattened_as);
  printf("\nshape     %s %s, %" PRId64 " elements\n", shape,
         sp_dtype_name(sp_wire_dtype(p->dtype)), p->numel);
  printf("unit      %u (%s), flat offset %" PRId64 "\n", p->unit,
         p->unit_fqn[0] ? p->unit_fqn : "root", p->offset);
  printf("strategy  %s, world %u, %u shard%s\n\n",
         sp_strategy_name((sp_strategy)p->strategy), p->world_size,
         p->shard_world, p->shard_world == 1 ? "" : "s");
  printf("%-6s %-28s %16s %14s %14s %14s\n", "SHARD", "RANKS",
         "OFFSET IN SHARD", "NUMEL", "PARAM START", "PARAM END");
  for (size_t i = 0; i < p->n_slices; i++) {
    const Shardplane__V1__ParamSlice *sl = p->slices[i];
    char ranks[64];
    print_shard_ranks(p, sl->shard, ranks, sizeof ranks);
    printf("%-6u %-28s %16" PRId64 " %14" PRId64 " %14" PRId64 " %14" PRId64
           "\n",
           sl->shard, ranks, sl->offset_in_shard, sl->numel, sl->intra_start,
           sl->intra_end);
  }
}

int sp_cmd_where(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "where");
  int first;
  size_t n;
  int ec = parse_args(&r, &k_where, argc, argv, NULL, 0, NULL, NULL, &first,
                      &n);
  if (ec != PROCEED) return ec;
  Shardplane__V1__LocateParamRequest q =
      SHARDPLANE__V1__LOCATE_PARAM_REQUEST__INIT;
  q.fqn = argv[first];
  ProtobufCMessage *m;
  ec = call(&r, SP_COORD_PATH("LocateParam"), &q.base,
            &shardplane__v1__param_location__descriptor, &m);
  if (ec == SP_EXIT_OK) {
    const Shardplane__V1__ParamLocation *p =
        (const Shardplane__V1__ParamLocation *)m;
    if (r.json)
      ec = where_json(p);
    else
      print_where(p);
    free_msg(m);
  }
  return finish(&r, ec);
}

/* ------------------------------------------------------------------ */
/* buffers                                                             */
/* ------------------------------------------------------------------ */

static const subcmd k_buffers = {
    "buffers [--prefix P] [options]",
    "Every buffer by FQN: shape, original dtype, the dtype it is computed\n"
    "in, owner unit, persistent. Exit 3 when --prefix matches none.\n\n"
    "  --prefix P                   only FQNs that start with P\n",
    0, 0};

enum { OPT_PREFIX = 256 };

static int buffers_opt(void *ctx, int c, const char *arg) {
  if (c != OPT_PREFIX) return -1;
  *(const char **)ctx = arg;
  return 0;
}

int sp_cmd_buffers(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "buffers");
  const char *prefix = "";
  const struct option own[] = {{"prefix", required_argument, NULL, OPT_PREFIX}};
  int first;
  size_t n;
  int ec = parse_args(&r, &k_buffers, argc, argv, own, 1, buffers_opt,
                      &prefix, &first, &n);
  if (ec != PROCEED) return ec;
  json_t *rows = r.json ? json_array() : NULL;
  char *token = NULL;
  size_t seen = 0;
  /* the coordinator answers in pages of at most 1000 */
  for (;;) {
    Shardplane__V1__ListBuffersRequest q =
        SHARDPLANE__V1__LIST_BUFFERS_REQUEST__INIT;
    q.prefix = (char *)prefix;
    q.page_token = token != NULL ? token : (char *)"";
    ProtobufCMessage *m;
    if ((ec = call(&r, SP_COORD_PATH("ListBuffers"), &q.base,
                   &shardplane__v1__list_buffers_response__descriptor, &m)) !=
        SP_EXIT_OK)
      break;
    const Shardplane__V1__ListBuffersResponse *l =
        (const Shardplane__V1__ListBuffersResponse *)m;
    for (size_t i = 0; i < l->n_buffers; i++) {
      const Shardplane__V1__BufferInfo *b = l->buffers[i];
      sp_buffer_row row = {b->fqn,
                           b->n_shape,
                           b->shape,
                           sp_wire_dtype(b->original_dtype),
                           sp_wire_dtype(b->compute_dtype),
                           b->owner_unit,
                           b->persistent};
      if (rows != NULL) {
        json_array_append_new(rows, sp_render_buffer_json(&row));
        continue;
      }
      if (seen + i == 0) sp_render_buffer_header();
      sp_render_buffer_row(&row);
    }
    seen += l->n_buffers;
    free(token);
    /* a page that brings nothing cannot be followed by a useful one */
    token = l->next_page_token[0] != '\0' && l->n_buffers > 0
                ? strdup(l->next_page_token)
                : NULL;
    free_msg(m);
    if (token == NULL) break;
  }
  free(token);
  if (ec == SP_EXIT_OK && seen == 0 && prefix[0] != '\0') {
    sp_cli_error(r.cmd, "no buffer FQN starts with \"%s\"", prefix);
    ec = SP_EXIT_NOT_FOUND;
  } else if (ec == SP_EXIT_OK && seen == 0 && rows == NULL) {
    sp_render_buffer_header(); /* a model without buffers: an empty table */
  }
  if (rows != NULL) {
    if (ec == SP_EXIT_OK &&
        sp_render_json_out(json_pack("{s:i,s:O}", "total", (int)seen,
                                     "buffers", rows)) != 0)
      ec = SP_EXIT_FAILURE;
    json_decref(rows);
  }
  return finish(&r, ec);
}

/* ------------------------------------------------------------------ */
/* watch                                                               */
/* ------------------------------------------------------------------ */

static const subcmd k_watch = {
    "watch [--rank R]... [--kind K]... [--transitions] [--count N] "
    "[options]",
    "Prints the coordinator's events as they happen, one line each (JSON\n"
    "Lines with --json), until Ctrl-C, the end of the stream, or --count\n"
    "events. By default: ranks attached, lost and detached, and alerts.\n\n"
    "  --rank R                     only rank R's events (repeatable)\n"
    "  --kind K                     only events of kind K: attached, lost,\n"
    "                               detached, transition, alert "
    "(repeatable)\n"
    "  --transitions                training-state transitions as well\n"
    "  --count N                    stop after N events\n"
    "(--timeout-ms bounds connecting; the stream itself has no deadline)\n"
    "\n",
    0, 0};

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
  switch (c) {
  case OPT_W_RANK:
    if (sp_cli_parse_uint(arg, UINT32_MAX, &v) != 0) {
      sp_cli_error(w->cmd, "--rank: expected a rank number, got \"%s\"", arg);
      return -1;
    }
    if (w->n_ranks == WATCH_MAX_RANKS) {
      sp_cli_error(w->cmd, "at most %d --rank filters", WATCH_MAX_RANKS);
      return -1;
    }
    w->ranks[w->n_ranks++] = (uint32_t)v;
    return 0;
  case OPT_W_KIND:
    if (parse_kind(arg, &kind) != 0) {
      sp_cli_error(w->cmd, "--kind: \"%s\" is not attached, lost, detached, "
                           "transition or alert", arg);
      return -1;
    }
    w->kinds |= 1u << kind;
    return 0;
  case OPT_W_TRANSITIONS:
    w->transitions = true;
    return 0;
  case OPT_W_COUNT:
    if (sp_cli_parse_uint(arg, INT64_MAX, &v) != 0 || v == 0) {
      sp_cli_error(w->cmd, "--count: expected a positive number, got \"%s\"",
                   arg);
      return -1;
    }
    w->count = v;
    return 0;
  default:
    return -1;
  }
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
  json_t *o = json_pack("{s:s,s:s,s:I}", "machine", sp_machine_name(m),
                        "state", sp_state_name(m, t->state), "step",
                        (json_int_t)t->step);
  if (o != NULL && m == SP_MACHINE_HANDLE)
    json_object_set_new(o, "unit", json_integer(t->unit));
  return o;
}

/* One line per event; -1 when stdout is gone. */
static int print_event(const Shardplane__V1__Event *ev, bool json) {
  const char *kind =
      enum_name(&shardplane__v1__event_kind__descriptor, ev->kind);
  if (json) {
    json_t *o = json_pack("{s:s,s:i,s:I,s:s,s:o}", "kind", kind, "rank",
                          (int)ev->rank, "time_ms", (json_int_t)ev->time_ms,
                          "message", ev->message, "transition",
                          transition_json(ev->transition));
    int rc = o ? json_dumpf(o, stdout, JSON_COMPACT | JSON_PRESERVE_ORDER) : -1;
    json_decref(o);
    if (rc != 0 || putchar('\n') == EOF) return -1;
  } else {
    if (strncmp(kind, "RANK_", 5) == 0) kind += 5;
    printf("%10.3fs  rank %-6u %-10s", (double)ev->time_ms / 1000.0, ev->rank,
           kind);
    const Shardplane__V1__Transition *t = ev->transition;
    if (t != NULL) {
      if (t->machine == SHARDPLANE__V1__MACHINE__MACHINE_HANDLE)
        printf(" unit %u -> %s", t->unit,
               sp_state_name(SP_MACHINE_HANDLE, t->state));
      else
        printf(" root -> %s", sp_state_name(SP_MACHINE_ROOT, t->state));
      printf(", step %" PRIu64, t->step);
    }
    if (ev->message[0] != '\0') printf(" %s", ev->message);
    putchar('\n');
  }
  /* a pipe reader sees each event as it happens */
  return fflush(stdout) == 0 ? 0 : -1;
}

/* Reads events until the stream ends, a signal, or the count is reached. */
static int watch_loop(sp_remote *r, sp_rpc_sync_stream *st, long long count) {
  struct sigaction sa = {.sa_handler = on_stop_signal}, old_int, old_term;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
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
      if (status.code != SP_RPC_OK) ec = fail_status(r, &status);
      break;
    }
    if (rc != 0) {
      sp_cli_error(r->cmd, "cannot decode an event: %s", sp_strerror(rc));
      ec = SP_EXIT_FAILURE;
      break;
    }
    int wrc = print_event((const Shardplane__V1__Event *)m, r->json);
    free_msg(m);
    if (wrc != 0) {
      ec = SP_EXIT_FAILURE; /* the reader went away (e.g. `| head`) */
      break;
    }
    seen++;
  }
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
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
  int ec = parse_args(&r, &k_watch, argc, argv, own, 4, watch_opt, w, &first,
                      &n);
  if (ec != PROCEED) {
    free(w);
    return ec;
  }
  sp_rpc_sync_stream *st = NULL;
  if (w->n_ranks > 0) {
    /* an unknown rank is "not found" here, as in `plan --rank` */
    Shardplane__V1__GetJobResponse *j = NULL;
    sp_job job;
    sp_job_init(&job);
    ec = get_job(&r, &j, &job);
    for (size_t i = 0; ec == SP_EXIT_OK && i < w->n_ranks; i++)
      if (w->ranks[i] >= job.world_size) {
        sp_cli_error(r.cmd, "--rank %u: the world has ranks 0-%u", w->ranks[i],
                     job.world_size - 1);
        ec = SP_EXIT_NOT_FOUND;
      }
    free_msg(j);
    sp_job_clear(&job);
  } else {
    ec = remote_connect(&r);
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
  Shardplane__V1__EventKind kind_list[8];
  Shardplane__V1__WatchRequest q = SHARDPLANE__V1__WATCH_REQUEST__INIT;
  for (int k = 1; k <= SHARDPLANE__V1__EVENT_KIND__ALERT; k++)
    if (kinds & (1u << k))
      kind_list[q.n_kinds++] = (Shardplane__V1__EventKind)k;
  q.kinds = kind_list;
  q.n_ranks = w->n_ranks;
  q.ranks = w->ranks;
  /* no deadline: a watch lasts until it is stopped */
  int rc = sp_rpc_sync_stream_open(r.rpc, SP_COORD_PATH("Watch"), 0, NULL, 0, &st);
  if (rc == 0) rc = sp_rpc_sync_stream_send(st, &q.base);
  if (rc == 0) rc = sp_rpc_sync_stream_close_send(st);
  if (rc != 0 && rc != SP_ESTATE) {
    sp_cli_error(r.cmd, "cannot start watching: %s", sp_strerror(rc));
    ec = SP_EXIT_FAILURE;
    goto out;
  }
  /* SP_ESTATE: the call already ended; the loop reads its status */
  ec = watch_loop(&r, st, w->count);
out:
  sp_rpc_sync_stream_free(st);
  free(w);
  return finish(&r, ec);
}

/* ------------------------------------------------------------------ */
/* store                                                               */
/* ------------------------------------------------------------------ */

static const subcmd k_store = {
    "store get KEY [--wait] | set KEY VALUE | add KEY DELTA | delete KEY |\n"
    "                  cas KEY EXPECTED DESIRED | cas --absent KEY DESIRED "
    "[options]",
    "The coordinator's key-value store, which workers bootstrap their\n"
    "collectives through.\n\n"
    "  get KEY                      print the value (exit 3 when absent);\n"
    "                               values that are not text print as hex\n"
    "    --wait                     wait for KEY to appear, up to "
    "--timeout-ms\n"
    "                               (exit 3 when it does not in time)\n"
    "  set KEY VALUE                store VALUE\n"
    "  add KEY DELTA                add DELTA to the decimal integer in KEY\n"
    "                               (absent: 0), print the sum; a negative\n"
    "                               DELTA goes after --: add KEY -- -1\n"
    "  delete KEY                   remove KEY (exit 3 when absent)\n"
    "  cas KEY EXPECTED DESIRED     store DESIRED if KEY holds EXPECTED\n"
    "    --absent                   ... if KEY does not exist (then: cas\n"
    "                               --absent KEY DESIRED); exit 1 when the\n"
    "                               value was not swapped\n",
    1, 3};

enum { OPT_S_WAIT = 256, OPT_S_ABSENT };

typedef struct store_args {
  bool wait, absent;
} store_args;

static int store_opt(void *ctx, int c, const char *arg) {
  (void)arg;
  store_args *a = ctx;
  if (c == OPT_S_WAIT) a->wait = true;
  else if (c == OPT_S_ABSENT) a->absent = true;
  else return -1;
  return 0;
}

/* Text prints as it is; anything else (an NCCL unique id) as hex, so that
 * a terminal never receives raw bytes. */
static bool is_text(const ProtobufCBinaryData *v) {
  for (size_t i = 0; i < v->len; i++)
    if ((v->data[i] < 0x20 && v->data[i] != '\t' && v->data[i] != '\n') ||
        v->data[i] == 0x7f)
      return false;
  json_t *s = json_stringn((const char *)v->data, v->len); /* UTF-8? */
  json_decref(s);
  return s != NULL;
}

static void print_value(const ProtobufCBinaryData *v) {
  if (is_text(v)) {
    fwrite(v->data, 1, v->len, stdout);
  } else {
    printf("(%zu bytes, not text) ", v->len);
    for (size_t i = 0; i < v->len; i++) printf("%02x", v->data[i]);
  }
  putchar('\n');
}

/* "value" for text, "value_hex" for anything else. */
static void set_value_json(json_t *o, const ProtobufCBinaryData *v) {
  if (is_text(v)) {
    json_object_set_new(o, "value",
                        json_stringn((const char *)v->data, v->len));
    return;
  }
  char *hex = malloc(2 * v->len + 1);
  if (hex == NULL) return;
  for (size_t i = 0; i < v->len; i++)
    snprintf(hex + 2 * i, 3, "%02x", v->data[i]);
  hex[2 * v->len] = '\0';
  json_object_set_new(o, "value_hex", json_string(hex));
  free(hex);
}

static ProtobufCBinaryData bytes_of(const char *s) {
  return (ProtobufCBinaryData){strlen(s), (uint8_t *)s};
}

static int json_done(json_t *o, int ec) {
  if (sp_render_json_out(o) != 0 && ec == SP_EXIT_OK) return SP_EXIT_FAILURE;
  return ec;
}

static int store_get(sp_remote *r, const char *key, bool wait) {
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)key;
  q.wait = wait;
  ProtobufCMessage *m;
  sp_rpc_status st;
  int ec = call_status(r, SP_COORD_PATH("StoreGet"), &q.base,
                       &shardplane__v1__store_get_response__descriptor,
                       r->timeout_ms, &m, &st);
  if (ec != PROCEED) return ec;
  /* A wait that runs out means the key is not there: "not found", the
   * same answer as a get without --wait, so scripts test one code. */
  if (wait && st.code == SP_RPC_DEADLINE_EXCEEDED) {
    sp_cli_error(r->cmd, "no key \"%s\" within %" PRIu64 " ms (%s)", key,
                 r->timeout_ms, sp_rpc_code_name(st.code));
    return SP_EXIT_NOT_FOUND;
  }
  if (st.code != SP_RPC_OK) return fail_status(r, &st);
  const Shardplane__V1__StoreGetResponse *g =
      (const Shardplane__V1__StoreGetResponse *)m;
  if (!g->found) {
    sp_cli_error(r->cmd, "no key \"%s\"", key);
    ec = SP_EXIT_NOT_FOUND;
  } else if (r->json) {
    json_t *o = json_pack("{s:s,s:I}", "key", key, "version",
                          (json_int_t)g->version);
    if (o != NULL) set_value_json(o, &g->value);
    ec = json_done(o, SP_EXIT_OK);
  } else {
    print_value(&g->value);
    ec = SP_EXIT_OK;
  }
  free_msg(m);
  return ec;
}

static int store_set(sp_remote *r, const char *key, const char *value) {
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = (char *)key;
  q.value = bytes_of(value);
  ProtobufCMessage *m;
  int ec = call(r, SP_COORD_PATH("StoreSet"), &q.base,
                &shardplane__v1__store_set_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  uint64_t version = ((Shardplane__V1__StoreSetResponse *)m)->version;
  free_msg(m);
  if (r->json)
    return json_done(json_pack("{s:s,s:I}", "key", key, "version",
                               (json_int_t)version),
                     SP_EXIT_OK);
  printf("stored \"%s\" (version %" PRIu64 ")\n", key, version);
  return SP_EXIT_OK;
}

static int store_add(sp_remote *r, const char *key, const char *delta_s) {
  char *end;
  errno = 0;
  long long delta = strtoll(delta_s, &end, 10);
  if (delta_s[0] == '\0' || *end != '\0' || errno != 0) {
    sp_cli_error(r->cmd, "add: DELTA must be a 64-bit integer, got \"%s\"",
                 delta_s);
    return SP_EXIT_USAGE;
  }
  Shardplane__V1__StoreAddRequest q = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  q.key = (char *)key;
  q.delta = delta;
  ProtobufCMessage *m;
  int ec = call(r, SP_COORD_PATH("StoreAdd"), &q.base,
                &shardplane__v1__store_add_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  const Shardplane__V1__StoreAddResponse *a =
      (const Shardplane__V1__StoreAddResponse *)m;
  if (r->json)
    ec = json_done(json_pack("{s:s,s:I,s:I}", "key", key, "value",
                             (json_int_t)a->value, "version",
                             (json_int_t)a->version),
                   SP_EXIT_OK);
  else
    printf("%" PRId64 "\n", a->value); /* alone, for n=$(shardplane ...) */
  free_msg(m);
  return ec;
}

static int store_delete(sp_remote *r, const char *key) {
  Shardplane__V1__StoreDeleteRequest q =
      SHARDPLANE__V1__STORE_DELETE_REQUEST__INIT;
  q.key = (char *)key;
  ProtobufCMessage *m;
  int ec = call(r, SP_COORD_PATH("StoreDelete"), &q.base,
                &shardplane__v1__store_delete_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  bool deleted = ((Shardplane__V1__StoreDeleteResponse *)m)->deleted;
  free_msg(m);
  ec = deleted ? SP_EXIT_OK : SP_EXIT_NOT_FOUND;
  if (!deleted) sp_cli_error(r->cmd, "no key \"%s\"", key);
  if (r->json)
    return json_done(json_pack("{s:s,s:b}", "key", key, "deleted", deleted),
                     ec);
  if (deleted) printf("deleted \"%s\"\n", key);
  return ec;
}

static int store_cas(sp_remote *r, const char *key, const char *expected,
                     const char *desired) {
  Shardplane__V1__StoreCompareSetRequest q =
      SHARDPLANE__V1__STORE_COMPARE_SET_REQUEST__INIT;
  q.key = (char *)key;
  q.expect_absent = expected == NULL;
  if (expected != NULL) q.expected = bytes_of(expected);
  q.desired = bytes_of(desired);
  ProtobufCMessage *m;
  int ec = call(r, SP_COORD_PATH("StoreCompareSet"), &q.base,
                &shardplane__v1__store_compare_set_response__descriptor, &m);
  if (ec != SP_EXIT_OK) return ec;
  const Shardplane__V1__StoreCompareSetResponse *c =
      (const Shardplane__V1__StoreCompareSetResponse *)m;
  ec = c->swapped ? SP_EXIT_OK : SP_EXIT_FAILURE;
  if (!c->swapped)
    sp_cli_error(r->cmd, "\"%s\" was not swapped: %s", key,
                 c->found ? "it holds another value" : "it does not exist");
  if (r->json) {
    json_t *o = json_pack("{s:s,s:b,s:b,s:I}", "key", key, "swapped",
                          c->swapped, "found", c->found, "version",
                          (json_int_t)c->version);
    if (o != NULL && c->found) set_value_json(o, &c->value);
    ec = json_done(o, ec);
  } else if (c->swapped) {
    printf("swapped \"%s\" (version %" PRIu64 ")\n", key, c->version);
  } else if (c->found) {
    print_value(&c->value); /* what it holds instead */
  }
  free_msg(m);
  return ec;
}

int sp_cmd_store(int argc, char **argv) {
  sp_remote r;
  sp_remote_init(&r, "store");
  if (argc < 2 || argv[1][0] == '-') {
    bool help = argc >= 2 && (strcmp(argv[1], "--help") == 0 ||
                              strcmp(argv[1], "-h") == 0);
    subcmd_help(help ? stdout : stderr, &k_store);
    return help ? SP_EXIT_OK : SP_EXIT_USAGE;
  }
  static const struct {
    const char *name;
    size_t min, max;
  } ops[] = {{"get", 1, 1}, {"set", 2, 2}, {"add", 2, 2},
             {"delete", 1, 1}, {"cas", 2, 3}};
  const char *op = argv[1];
  size_t i = 0, n_ops = sizeof ops / sizeof ops[0];
  while (i < n_ops && strcmp(ops[i].name, op) != 0) i++;
  if (i == n_ops) {
    sp_cli_error(r.cmd, "unknown operation \"%s\" (get, set, add, delete, cas)",
                 op);
    return SP_EXIT_USAGE;
  }
  store_args a = {false, false};
  const struct option own[] = {{"wait", no_argument, NULL, OPT_S_WAIT},
                               {"absent", no_argument, NULL, OPT_S_ABSENT}};
  int first;
  size_t n;
  /* argv[1] (the operation) is getopt's argv[0] */
  int ec = parse_args(&r, &k_store, argc - 1, argv + 1, own, 2, store_opt, &a,
                      &first, &n);
  if (ec != PROCEED) return ec;
  char **args = argv + 1 + first;
  /* cas takes EXPECTED unless --absent */
  size_t want_min = ops[i].min, want_max = ops[i].max;
  if (strcmp(op, "cas") == 0) want_min = want_max = a.absent ? 2 : 3;
  if (n < want_min || n > want_max || (a.wait && strcmp(op, "get") != 0) ||
      (a.absent && strcmp(op, "cas") != 0)) {
    sp_cli_error(r.cmd, "%s: wrong arguments", op);
    fprintf(stderr, "usage: shardplane %s (--help for more)\n",
            k_store.synopsis);
    return SP_EXIT_USAGE;
  }
  if (strcmp(op, "get") == 0)
    ec = store_get(&r, args[0], a.wait);
  else if (strcmp(op, "set") == 0)
    ec = store_set(&r, args[0], args[1]);
  else if (strcmp(op, "add") == 0)
    ec = store_add(&r, args[0], args[1]);
  else if (strcmp(op, "delete") == 0)
    ec = store_delete(&r, args[0]);
  else
    ec = store_cas(&r, args[0], a.absent ? NULL : args[1], args[n - 1]);
  return finish(&r, ec);
}
