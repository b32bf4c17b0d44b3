/* What the subcommands that ask a running coordinator share: the
 * connection (with its health probe), unary calls with their exit codes,
 * the command-line parser and a few formatting helpers. The subcommands
 * themselves: status.c (status, ranks), plan_cmd.c (plan without --model,
 * where, buffers), watch.c, store.c. Each is one or two blocking gRPC
 * calls; the tables and JSON shared with the offline plan live in
 * render.c.
 *
 * Exit codes follow the gRPC status: INVALID_ARGUMENT is bad usage (2),
 * NOT_FOUND is 3, UNAVAILABLE is 4; everything else is a failure (1). A
 * health check precedes the first call, so "no coordinator answered" (4)
 * is never confused with a call that timed out on a live coordinator. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "flight_fmt.h"
#include "plan/job_cli.h"
#include "base/flag.h"
#include "grpc/health/v1/health.pb-c.h"
#include "lib/session/plan_wire.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"

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
  sp_diag d = {{0}};
  switch (c) {
    case SP_OPT_COORDINATOR:
      r->addr = arg;
      r->addr_from_env = false;
      return 1;
    case SP_OPT_TIMEOUT:
      if (sp_flag_int("--timeout-ms", arg, 1, 86400000, &v, &d) != 0) {
        sp_cli_error(r->cmd, "%s", d.msg);
        return -1;
      }
      r->timeout_ms = (uint64_t)v;
      return 1;
    default: {
      int rc = sp_cred_option(&r->cred, c, arg, &d);
      if (rc < 0) sp_cli_error(r->cmd, "%s", d.msg);
      return rc < 0 ? -1 : rc;
    }
  }
}

/* The proto name of an enum value ("RANK_ATTACHED"), "UNKNOWN" if none. */
const char *sp_remote_enum_name(const ProtobufCEnumDescriptor *d, int v) {
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
int sp_remote_fail_status(const sp_remote *r, const sp_rpc_status *st) {
  /* a refused token: say which one was sent, or that none was */
  char whose[1200] = "";
  if (st->code == SP_RPC_UNAUTHENTICATED) {
    if (r->cred.token_file != NULL)
      snprintf(whose, sizeof whose, ": the token of --token-file %s",
               r->cred.token_file);
    else if (r->cred.has_token)
      snprintf(whose, sizeof whose, ": the token in $" SP_TOKEN_ENV);
    else
      snprintf(whose, sizeof whose,
               ": no token sent (--token-file FILE, "
               "or $" SP_TOKEN_ENV ")");
  }
  sp_cli_error(r->cmd, "%s (%s)%s",
               st->message[0] ? st->message : "call failed",
               sp_rpc_code_name(st->code), whose);
  return exit_code_of(st->code);
}

/* Opens the connection and asks the standard health service whether the
 * coordinator serves. Connection failures surface here, with a deadline
 * that the probe alone uses, which is what lets a later DEADLINE_EXCEEDED
 * (a store wait, a slow answer) mean "the coordinator took too long" and
 * not "there is no coordinator". */
int sp_remote_connect(sp_remote *r) {
  char host[256];
  int port;
  if (sp_rpc_split_addr(r->addr, host, sizeof host, &port) != 0) {
    sp_diag d = {{0}};
    sp_flag_fail(&d,
                 r->addr_from_env ? "$" SP_COORDINATOR_ENV : "--coordinator",
                 r->addr, "HOST:PORT or [v6]:PORT, port in [0, 65535]");
    sp_cli_error(r->cmd, "%s", d.msg);
    return SP_EXIT_USAGE;
  }
  sp_diag cd = {{0}};
  int rc = sp_cred_finish(&r->cred, &cd);
  if (rc != 0) {
    sp_cli_error(r->cmd, "%s", cd.msg);
    return SP_EXIT_USAGE;
  }
  sp_rpc_client_opts co = {.connect_timeout_ms = r->timeout_ms};
  sp_cred_client_opts(&r->cred, &co);
  rc = sp_rpc_sync_open_opts(r->addr, &co, &r->rpc);
  if (rc != 0) {
    /* the address parsed, so SP_EINVAL is a host name that does not
     * resolve */
    sp_cli_error(
        r->cmd, "cannot reach the coordinator at %s: %s", r->addr,
        rc == SP_EINVAL ? "the host name does not resolve" : sp_strerror(rc));
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
          sp_remote_enum_name(
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
    default: return sp_remote_fail_status(r, &st);
  }
}

/* Connects if needed, then makes one unary call. Returns PROCEED with
 * *status set (the caller judges it; on OK *resp is the answer, which the
 * caller frees), or the exit code of a failure already printed. */
int sp_remote_call_status(sp_remote *r, const char *method,
                          const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *desc,
                          uint64_t timeout_ms, ProtobufCMessage **resp,
                          sp_rpc_status *status) {
  *resp = NULL;
  if (r->rpc == NULL) {
    int ec = sp_remote_connect(r);
    if (ec != SP_EXIT_OK) return ec;
  }
  int rc =
      sp_rpc_sync_unary(r->rpc, method, req, desc, timeout_ms, resp, status);
  if (rc != 0) {
    sp_cli_error(r->cmd, "cannot call %s: %s", method, sp_strerror(rc));
    return SP_EXIT_FAILURE;
  }
  return PROCEED;
}

/* One unary call with the session's deadline; a failure's message is
 * printed and its exit code returned. */
int sp_remote_call(sp_remote *r, const char *method,
                   const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *desc,
                   ProtobufCMessage **resp) {
  sp_rpc_status st;
  int ec =
      sp_remote_call_status(r, method, req, desc, r->timeout_ms, resp, &st);
  if (ec != PROCEED) return ec;
  return st.code == SP_RPC_OK ? SP_EXIT_OK : sp_remote_fail_status(r, &st);
}

void sp_remote_free_msg(void *m) {
  if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
}

/* Ends a subcommand: stdout must have reached its reader. */
int sp_remote_finish(sp_remote *r, int exit_code) {
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

void sp_remote_subcmd_help(FILE *f, const subcmd *sc) {
  fprintf(f, "usage: shardplane %s\n\n%s", sc->synopsis, sc->help);
  fputs(SP_REMOTE_OPTIONS_HELP
        "  --json                       machine-readable output\n"
        "  --help                       this text\n"
        "\nexit codes: 0 ok, 1 failure, 2 bad usage, 3 not found, "
        "4 coordinator unreachable",
        f);
  if (sc->exit5) fprintf(f, ",\n            5 %s", sc->exit5);
  fputc('\n', f);
}

/* One option of parse_args. */
static int parse_one(sp_remote *r, const subcmd *sc, int c,
                     int (*on_opt)(void *ctx, int c, const char *arg),
                     void *ctx) {
  int mine = sp_remote_option(r, c, optarg);
  if (mine != 0) return mine < 0 ? SP_EXIT_USAGE : PROCEED;
  if (c == SP_ROPT_JSON) {
    r->json = true;
    return PROCEED;
  }
  if (c == SP_ROPT_HELP) {
    sp_remote_subcmd_help(stdout, sc);
    return SP_EXIT_OK;
  }
  if (c != '?' && on_opt != NULL && on_opt(ctx, c, optarg) == 0) return PROCEED;
  if (c == '?') /* getopt said what */
    sp_cli_try_help(r->cmd);
  return SP_EXIT_USAGE;
}

/* Parses argv (argv[0] is the subcommand) with the subcommand's own
 * options (handed to on_opt, which returns 0 or -1 after printing why) and
 * the common ones. The positional arguments are left in argv[optind..]
 * (*first) and counted in *n. Returns PROCEED, or the exit code to stop
 * with (--help, bad usage). */
int sp_remote_parse_args(sp_remote *r, const subcmd *sc, int argc, char **argv,
                         const struct option *own, size_t n_own,
                         int (*on_opt)(void *ctx, int c, const char *arg),
                         void *ctx, int *first, size_t *n) {
  struct option opts[32];
  const struct option common[] = {
      SP_REMOTE_OPTIONS,
      {"json", no_argument, NULL, SP_ROPT_JSON},
      {"help", no_argument, NULL, SP_ROPT_HELP},
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
      sp_cli_error(r->cmd, "missing argument: shardplane %s", sc->synopsis);
    else
      sp_cli_error(r->cmd, "unexpected argument \"%s\"",
                   argv[optind + (int)sc->max_args]);
    sp_cli_try_help(r->cmd);
    return SP_EXIT_USAGE;
  }
  return PROCEED;
}

/* ------------------------------------------------------------------ */
/* Formatting helpers                                                  */
/* ------------------------------------------------------------------ */

/* "12.3s", "4m 05s", "2h 07m" */
void sp_remote_format_duration(uint64_t ms, char *buf, size_t len) {
  if (ms < 60000)
    snprintf(buf, len, "%.1fs", (double)ms / 1000.0);
  else if (ms < 3600000)
    snprintf(buf, len, "%um %02us", (unsigned)(ms / 60000),
             (unsigned)(ms / 1000 % 60));
  else
    snprintf(buf, len, "%" PRIu64 "h %02um", ms / 3600000,
             (unsigned)(ms / 60000 % 60));
}

uint64_t sp_remote_coord_start_us(uint64_t uptime_ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t now_us = (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
  return now_us - uptime_ms * 1000;
}

uint64_t sp_remote_coord_wall_us(uint64_t start_us, uint64_t time_ms) {
  return start_us + time_ms * 1000;
}

json_t *sp_remote_collective_json(const Shardplane__V1__Collective *c) {
  if (c == NULL) return json_null();
  return json_pack(
      "{s:I,s:s,s:i,s:o,s:I}", "seq", (json_int_t)c->seq, "op",
      sp_remote_enum_name(&shardplane__v1__collective_op__descriptor, c->op),
      "unit", (int)c->unit, "dtype",
      sp_render_dtype_json(sp_wire_dtype(c->dtype)), "count",
      (json_int_t)c->count);
}

/* ------------------------------------------------------------------ */
/* Hang diagnosis: the words status, why and watch share               */
/* ------------------------------------------------------------------ */

/* "RUNNING", without the enum's prefix. */
const char *sp_remote_job_state_name(int v) {
  const char *s =
      sp_remote_enum_name(&shardplane__v1__job_state__descriptor, v);
  return strncmp(s, "JOB_", 4) == 0 ? s + 4 : s;
}

/* "STALL", "LOST" (the proto's ALERT_LOST), "ALERT" when unknown. */
const char *sp_remote_alert_kind_name(int v) {
  if (v == SHARDPLANE__V1__ALERT_KIND__ALERT_KIND_UNKNOWN) return "ALERT";
  const char *s =
      sp_remote_enum_name(&shardplane__v1__alert_kind__descriptor, v);
  return strncmp(s, "ALERT_", 6) == 0 ? s + 6 : s;
}

void sp_remote_progress_words(const Shardplane__V1__Progress *p, char *buf,
                              size_t len) {
  if (p == NULL) {
    snprintf(buf, len, "no progress reported yet");
    return;
  }
  size_t n = 0;
#define PUT(...)                                                       \
  do {                                                                 \
    if (n < len) n += (size_t)snprintf(buf + n, len - n, __VA_ARGS__); \
  } while (0)
  PUT("step %" PRIu64, p->step);
  if (p->total_steps > 0) PUT(" of %" PRIu64, p->total_steps);
  if (p->steps_per_s > 0) PUT(", %.1f steps/s", p->steps_per_s);
  if (p->has_loss) PUT(", loss %.4g", p->loss);
  if (p->eta_s >= 0 && p->total_steps > 0) {
    char eta[32];
    sp_remote_format_duration((uint64_t)(p->eta_s * 1000.0), eta, sizeof eta);
    PUT(", about %s left", eta);
  }
#undef PUT
}

json_t *sp_remote_progress_json(const Shardplane__V1__Progress *p) {
  if (p == NULL) return json_null();
  json_t *o =
      json_pack("{s:I,s:I,s:f}", "step", (json_int_t)p->step, "total_steps",
                (json_int_t)p->total_steps, "steps_per_s", p->steps_per_s);
  if (o == NULL) return NULL;
  json_object_set_new(o, "loss",
                      p->has_loss ? json_real(p->loss) : json_null());
  json_object_set_new(
      o, "eta_s",
      p->eta_s >= 0 && p->total_steps > 0 ? json_real(p->eta_s) : json_null());
  return o;
}

/* "STALL: <message> (culprit rank 3; victims 0-2)" */
void sp_remote_print_alert(FILE *f, const Shardplane__V1__Alert *a) {
  fprintf(f, "%s: %s", sp_remote_alert_kind_name(a->kind), a->message);
  if (a->n_culprits > 0 || a->n_victims > 0) {
    fputs(" (", f);
    if (a->n_culprits > 0) {
      fputs(a->n_culprits == 1 ? "culprit rank " : "culprit ranks ", f);
      sp_fmt_ranges(f, a->culprits, a->n_culprits);
    }
    if (a->n_victims > 0) {
      fputs(a->n_culprits > 0 ? "; victims " : "victims ", f);
      sp_fmt_ranges(f, a->victims, a->n_victims);
    }
    fputc(')', f);
  }
}

json_t *sp_remote_alert_json(const Shardplane__V1__Alert *a) {
  json_t *cul = json_array(), *vic = json_array();
  for (size_t i = 0; i < a->n_culprits; i++)
    json_array_append_new(cul, json_integer(a->culprits[i]));
  for (size_t i = 0; i < a->n_victims; i++)
    json_array_append_new(vic, json_integer(a->victims[i]));
  return json_pack("{s:s,s:i,s:s,s:I,s:o,s:o,s:o}", "kind",
                   sp_remote_alert_kind_name(a->kind), "rank", (int)a->rank,
                   "message", a->message, "time_ms", (json_int_t)a->time_ms,
                   "culprits", cul, "victims", vic, "collective",
                   sp_remote_collective_json(a->collective));
}

void sp_remote_print_quorum(FILE *f, const char *label, int width,
                            const Shardplane__V1__ReplicaQuorum *q) {
  if (q == NULL) return;
  fprintf(f, "%-*s%u of %u training (epoch %" PRIu64 ")\n", width, label,
          q->in_quorum, q->groups, q->epoch);
  for (size_t i = 0; i < q->n_dropped; i++)
    fprintf(f, "  %s\n", q->dropped[i]->summary);
}

json_t *sp_remote_quorum_json(const Shardplane__V1__ReplicaQuorum *q) {
  if (q == NULL) return json_null();
  json_t *arr = json_array();
  for (size_t i = 0; i < q->n_dropped; i++) {
    const Shardplane__V1__ReplicaGroup *g = q->dropped[i];
    json_array_append_new(
        arr, json_pack("{s:i,s:i,s:i,s:b,s:i,s:I,s:I,s:s,s:I,s:I,s:s}", "group",
                       (int)g->group, "first_rank", (int)g->first_rank, "ranks",
                       (int)g->ranks, "in_quorum", g->in_quorum, "drops",
                       (int)g->drops, "dropped_unix_ms",
                       (json_int_t)g->dropped_unix_ms, "dropped_at_step",
                       (json_int_t)g->dropped_at_step, "why", g->why,
                       "rejoined_unix_ms", (json_int_t)g->rejoined_unix_ms,
                       "rejoined_at_step", (json_int_t)g->rejoined_at_step,
                       "summary", g->summary));
  }
  return json_pack("{s:I,s:i,s:i,s:o}", "epoch", (json_int_t)q->epoch, "groups",
                   (int)q->groups, "in_quorum", (int)q->in_quorum, "dropped",
                   arr);
}
