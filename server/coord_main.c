/* shardplane-coordinator: serve one job's plan, ranks and store. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator.h"
#include "plan/job_cli.h"
#include "base/flag.h"

static void usage(FILE *f) {
  fputs(
      "usage: shardplane-coordinator --model M.json [--job J.json] "
      "[--listen HOST:PORT] [options]\n"
      "\n"
      "Serves shardplane.v1.Coordinator and grpc.health.v1.Health for one\n"
      "job: the sharding plan, the ranks' training state, and the store\n"
      "workers bootstrap their collectives through.\n"
      "\n"
      "  --listen HOST:PORT           address (default 127.0.0.1:7700; port\n"
      "                               0 picks a free one and prints it)\n"
      "  --model PATH                 model spec (shardplane.model/v1)\n"
      "  --job PATH                   job config; the flags below override "
      "it\n"
      "                               (without a wrap policy every module\n"
      "                               of a type in the spec's\n"
      "                               no_split_modules becomes a unit, else\n"
      "                               every Linear, as in shardplane run)\n",
      f);
  sp_job_flags_print_help(f);
  fputs(
      "  --heartbeat-timeout-ms N     mark a silent rank lost (default "
      "5000)\n"
      "  --heartbeat-interval-ms N    interval asked of workers (default "
      "1000,\n"
      "                               or a third of a shorter timeout)\n"
      "  --state-dir DIR              keep the store, the ranks and the "
      "alerts in\n"
      "                               DIR (SQLite, created if absent): a "
      "coordinator\n"
      "                               restarted on DIR continues the job. "
      "One\n"
      "                               coordinator per DIR; a DIR of another "
      "job is\n"
      "                               refused\n"
      "  --reattach-grace-ms N        after such a restart, how long a rank "
      "may take\n"
      "                               to reattach before it is lost "
      "(default 60000);\n"
      "                               a host's agent not back by then no "
      "longer holds\n"
      "                               up the job's next restart\n"
      "  --join-wait-ms N             elastic hosts (shardplane agent "
      "--nnodes MIN:MAX):\n"
      "                               once MIN are there, wait N ms for more "
      "before\n"
      "                               an incarnation begins (default 5000: "
      "the agents\n"
      "                               of one job start together; each "
      "restart waits\n"
      "                               again)\n"
      "  --loss-grace-ms N            a rank silent past the heartbeat "
      "timeout is\n"
      "                               waited for up to N ms more while its "
      "agent\n"
      "                               says its process is alive and its "
      "host is\n"
      "                               under pressure (or the rank reported "
      "being\n"
      "                               descheduled); then it is lost as "
      "hung. 0: no\n"
      "                               grace (default 60000: for a long job "
      "a\n"
      "                               restart from the last checkpoint "
      "costs more\n"
      "                               than a minute's wait; a process the "
      "agent\n"
      "                               reports gone is lost at once)\n"
      "Hang diagnosis (docs/architecture.md):\n"
      "  --on-group-failure continue|restart\n"
      "                               HYBRID_SHARD: when a rank fails, drop "
      "its\n"
      "                               replica group and train on with the "
      "others\n"
      "                               (it rejoins with their live state), "
      "or restart\n"
      "                               the whole job as --max-restarts says "
      "(default)\n"
      "  --stall-timeout-ms N         a rank with no event for N ms while "
      "it\n"
      "                               heartbeats is stalled (default: "
      "adaptive,\n"
      "                               max(10000, 5 x the job's p99 step "
      "time))\n"
      "  --on-stall alert|abort       what a stall verdict does (default "
      "alert;\n"
      "                               abort sends it to every rank as the "
      "abort\n"
      "                               reason)\n"
      "  --straggler-ratio X          a rank whose compute per step is X "
      "times the\n"
      "                               job's median is a straggler (default "
      "1.3)\n"
      "  --dump-dir DIR               on abort or stall, write every "
      "rank's flight\n"
      "                               recorder and the coordinator's view "
      "to DIR\n"
      "                               (shardplane.dump/v1; default: none)\n"
      "\n"
      "Limits against clients that hold resources (over one: the call ends\n"
      "with RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED, or the connection gets\n"
      "GOAWAY with the reason):\n"
      "  --max-connections N          open connections; when all are taken\n"
      "                               the longest idle one (no open call)\n"
      "                               is closed to admit a new one (default:\n"
      "                               the fd limit less 64, at most 65536)\n"
      "  --preface-timeout-ms N       from connecting to the first request's\n"
      "                               headers (default 10000)\n"
      "  --idle-timeout-ms N          close a connection with no open call\n"
      "                               after this long (default 300000)\n"
      "  --request-timeout-ms N       a unary request must be complete (the\n"
      "                               client half-closed) within this, even\n"
      "                               without a deadline (default 30000)\n"
      "  --max-buffered-mib N         request and response bytes buffered,\n"
      "                               all connections (default 256)\n"
      "\n"
      "Security (docs/security.md): one of --tls-cert/--tls-key or\n"
      "--insecure, and one of --token-file or --no-auth, are required.\n"
      "  --tls-cert FILE              serve TLS with this certificate "
      "chain (PEM)\n"
      "  --tls-key FILE               ... and its private key (PEM)\n"
      "  --tls-client-ca FILE         mutual TLS: clients must present a\n"
      "                               certificate from this CA bundle\n"
      "  --insecure                   cleartext HTTP/2 (a warning when the\n"
      "                               address is not loopback)\n"
      "  --token-file FILE            bearer tokens and their roles, as\n"
      "                               SHA-256 hashes (shardplane token "
      "create)\n"
      "  --no-auth                    serve every call to anyone (warns)\n"
      "  --store-quota-bytes N        store bytes (keys and values) one "
      "token's\n"
      "                               keys may hold (default 268435456)\n"
      "  --store-quota-keys N         store keys one token may hold "
      "(default\n"
      "                               65536)\n"
      "\n"
      "Metrics and the dashboard (docs/observability.md), with the TLS and\n"
      "tokens above (a reader or admin token; /healthz is open):\n"
      "  --http-listen HOST:PORT      serve /metrics (Prometheus), the live\n"
      "                               dashboard at / and its JSON API at\n"
      "                               /api/v1/ (default: none; port 0 picks\n"
      "                               a free one). Its connections time out\n"
      "                               after --request-timeout-ms (or a\n"
      "                               shorter --idle-timeout-ms); bodies\n"
      "                               count against --max-buffered-mib\n"
      "  --http-max-connections N     open HTTP connections (default 256;\n"
      "                               one client address at most 64 of\n"
      "                               them)\n"
      "  --metrics-rank-limit N       per-rank series on /metrics up to N\n"
      "                               ranks, aggregates only above (default\n"
      "                               1024)\n"
      "  --quiet                      no log lines\n"
      "  --help                       this text\n"
      "\n"
      "Prints \"listening on HOST:PORT\" (and \", http on HOST:PORT\")\n"
      "once serving; SIGINT or SIGTERM "
      "shut it down gracefully.\n"
      "exit codes: 0 clean shutdown, 1 cannot start (bad spec or job, "
      "address in use,\n"
      "state dir in use or of another job), 2 bad usage\n",
      f);
}

enum {
  OPT_LISTEN = 256,
  OPT_MODEL,
  OPT_JOB,
  OPT_HB_TIMEOUT,
  OPT_HB_INTERVAL,
  OPT_QUIET,
  OPT_HELP,
  OPT_TLS_CERT,
  OPT_TLS_KEY,
  OPT_TLS_CLIENT_CA,
  OPT_INSECURE,
  OPT_TOKEN_FILE,
  OPT_NO_AUTH,
  OPT_QUOTA_BYTES,
  OPT_QUOTA_KEYS,
  OPT_MAX_CONNS,
  OPT_PREFACE_MS,
  OPT_IDLE_MS,
  OPT_REQUEST_MS,
  OPT_MAX_BUFFERED,
  OPT_STATE_DIR,
  OPT_REATTACH,
  OPT_JOIN_WAIT,
  OPT_LOSS_GRACE,
  OPT_ON_GROUP_FAILURE,
  OPT_STALL_MS,
  OPT_ON_STALL,
  OPT_STRAGGLER,
  OPT_DUMP_DIR,
  OPT_HTTP_LISTEN,
  OPT_HTTP_MAX_CONNS,
  OPT_METRICS_RANK_LIMIT
};

static const struct option k_opts[] = {
    {"listen", required_argument, NULL, OPT_LISTEN},
    {"model", required_argument, NULL, OPT_MODEL},
    {"job", required_argument, NULL, OPT_JOB},
    {"heartbeat-timeout-ms", required_argument, NULL, OPT_HB_TIMEOUT},
    {"heartbeat-interval-ms", required_argument, NULL, OPT_HB_INTERVAL},
    {"max-connections", required_argument, NULL, OPT_MAX_CONNS},
    {"preface-timeout-ms", required_argument, NULL, OPT_PREFACE_MS},
    {"idle-timeout-ms", required_argument, NULL, OPT_IDLE_MS},
    {"request-timeout-ms", required_argument, NULL, OPT_REQUEST_MS},
    {"max-buffered-mib", required_argument, NULL, OPT_MAX_BUFFERED},
    {"quiet", no_argument, NULL, OPT_QUIET},
    {"state-dir", required_argument, NULL, OPT_STATE_DIR},
    {"reattach-grace-ms", required_argument, NULL, OPT_REATTACH},
    {"join-wait-ms", required_argument, NULL, OPT_JOIN_WAIT},
    {"loss-grace-ms", required_argument, NULL, OPT_LOSS_GRACE},
    {"on-group-failure", required_argument, NULL, OPT_ON_GROUP_FAILURE},
    {"stall-timeout-ms", required_argument, NULL, OPT_STALL_MS},
    {"on-stall", required_argument, NULL, OPT_ON_STALL},
    {"straggler-ratio", required_argument, NULL, OPT_STRAGGLER},
    {"dump-dir", required_argument, NULL, OPT_DUMP_DIR},
    {"http-listen", required_argument, NULL, OPT_HTTP_LISTEN},
    {"http-max-connections", required_argument, NULL, OPT_HTTP_MAX_CONNS},
    {"metrics-rank-limit", required_argument, NULL, OPT_METRICS_RANK_LIMIT},
    {"help", no_argument, NULL, OPT_HELP},
    {"tls-cert", required_argument, NULL, OPT_TLS_CERT},
    {"tls-key", required_argument, NULL, OPT_TLS_KEY},
    {"tls-client-ca", required_argument, NULL, OPT_TLS_CLIENT_CA},
    {"insecure", no_argument, NULL, OPT_INSECURE},
    {"token-file", required_argument, NULL, OPT_TOKEN_FILE},
    {"no-auth", no_argument, NULL, OPT_NO_AUTH},
    {"store-quota-bytes", required_argument, NULL, OPT_QUOTA_BYTES},
    {"store-quota-keys", required_argument, NULL, OPT_QUOTA_KEYS},
};

static uv_signal_t g_sig[2];

static void on_stopped(sp_coord *c, void *arg) {
  (void)c;
  (void)arg;
  uv_close((uv_handle_t *)&g_sig[0], NULL);
  uv_close((uv_handle_t *)&g_sig[1], NULL);
}

static void on_signal(uv_signal_t *s, int signum) {
  (void)signum;
  sp_coord_shutdown(s->data, on_stopped, NULL);
}

static int parse_ms(const char *flag, const char *v, uint32_t *out) {
  long long x;
  sp_diag d = {{0}};
  if (sp_flag_int(flag, v, 1, 3600000, &x, &d) != 0) {
    fprintf(stderr, "shardplane-coordinator: %s (milliseconds)\n", d.msg);
    return -1;
  }
  *out = (uint32_t)x;
  return 0;
}

/* The server's limits, one flag each: 0 when c is one of them and its
 * value is good, -1 with the message printed, 1 when c is another flag. */
static int parse_limit(int c, const char *v, sp_coord_config *cfg) {
  static const struct {
    int opt;
    const char *flag, *unit;
    long long max;
  } k_limits[] = {
      {OPT_MAX_CONNS, "--max-connections", "connections", 1 << 20},
      {OPT_PREFACE_MS, "--preface-timeout-ms", "milliseconds", 3600000},
      {OPT_IDLE_MS, "--idle-timeout-ms", "milliseconds", 86400000},
      {OPT_REQUEST_MS, "--request-timeout-ms", "milliseconds", 3600000},
      {OPT_MAX_BUFFERED, "--max-buffered-mib", "MiB", 1 << 20},
      {OPT_HTTP_MAX_CONNS, "--http-max-connections", "connections", 1 << 16},
      {OPT_METRICS_RANK_LIMIT, "--metrics-rank-limit", "ranks", 1 << 20},
  };
  for (size_t i = 0; i < sizeof k_limits / sizeof k_limits[0]; i++) {
    if (k_limits[i].opt != c) continue;
    long long x;
    sp_diag d = {{0}};
    if (sp_flag_int(k_limits[i].flag, v, 1, k_limits[i].max, &x, &d) != 0) {
      fprintf(stderr, "shardplane-coordinator: %s (%s)\n", d.msg,
              k_limits[i].unit);
      return -1;
    }
    switch (c) {
      case OPT_MAX_CONNS: cfg->max_connections = (uint32_t)x; break;
      case OPT_PREFACE_MS: cfg->preface_timeout_ms = (uint64_t)x; break;
      case OPT_IDLE_MS: cfg->idle_timeout_ms = (uint64_t)x; break;
      case OPT_REQUEST_MS: cfg->request_timeout_ms = (uint64_t)x; break;
      case OPT_HTTP_MAX_CONNS: cfg->http_max_connections = (uint32_t)x; break;
      case OPT_METRICS_RANK_LIMIT: cfg->metrics_rank_limit = (uint32_t)x; break;
      default: cfg->max_buffered = (size_t)x << 20; break;
    }
    return 0;
  }
  return 1;
}

/* A path-like value: 0, or -1 with the message printed. */
static int parse_text(const char *flag, const char *v, const char *what) {
  sp_diag d = {{0}};
  if (sp_flag_text(flag, v, what, &d) == 0) return 0;
  fprintf(stderr, "shardplane-coordinator: %s\n", d.msg);
  return -1;
}

/* The address to listen on: 0, or -1 with the message printed. */
static int parse_listen(const char *flag, const char *v) {
  char host[256];
  int port;
  if (sp_rpc_split_addr(v, host, sizeof host, &port) == 0) return 0;
  sp_diag d = {{0}};
  sp_flag_fail(&d, flag, v,
               "HOST:PORT or [v6]:PORT, port in [0, "
               "65535] (0: a free one)");
  fprintf(stderr, "shardplane-coordinator: %s\n", d.msg);
  return -1;
}

static int parse_quota(const char *flag, const char *v, uint64_t *out) {
  long long x;
  sp_diag d = {{0}};
  if (sp_flag_int(flag, v, 1, (long long)1 << 50, &x, &d) != 0) {
    fprintf(stderr, "shardplane-coordinator: %s\n", d.msg);
    return -1;
  }
  *out = (uint64_t)x;
  return 0;
}

typedef struct security {
  sp_rpc_tls_server_opts tls;
  bool insecure, no_auth;
} security;

/* Transport and authentication must each be chosen, never defaulted to
 * the open one. 0, or -1 with the message printed (bad usage). */
static int check_security(const security *s, const sp_coord_config *cfg) {
  const char *err = NULL;
  bool any_tls = s->tls.cert_file || s->tls.key_file || s->tls.client_ca_file;
  if (s->insecure && any_tls)
    err = "--insecure and --tls-* exclude each other";
  else if (!s->insecure && !any_tls)
    err =
        "choose the transport: --tls-cert FILE --tls-key FILE, or "
        "--insecure for cleartext";
  else if (any_tls && (s->tls.cert_file == NULL || s->tls.key_file == NULL))
    err = "--tls-cert and --tls-key go together";
  else if (s->no_auth && cfg->token_file != NULL)
    err = "--no-auth and --token-file exclude each other";
  else if (!s->no_auth && cfg->token_file == NULL)
    err = "--token-file FILE is required (or --no-auth to serve anyone)";
  if (err == NULL) return 0;
  fprintf(stderr, "shardplane-coordinator: %s\n", err);
  return -1;
}

static bool loopback(const char *host) {
  return strncmp(host, "127.", 4) == 0 || strcmp(host, "::1") == 0 ||
         strcmp(host, "localhost") == 0;
}

static void warn_open(const security *s, const char *listen) {
  char host[256];
  int port;
  if (s->insecure &&
      (sp_rpc_split_addr(listen, host, sizeof host, &port) != 0 ||
       !loopback(host)))
    fprintf(stderr,
            "shardplane-coordinator: warning: listening in cleartext "
            "on %s: tokens and store values cross the network unencrypted "
            "(use --tls-cert/--tls-key)\n",
            listen);
  if (s->no_auth)
    fprintf(stderr,
            "shardplane-coordinator: warning: --no-auth: anyone who "
            "reaches %s may call every method, abort the job and write the "
            "store\n",
            listen);
}

/* The job against the model: a wrap target it does not have is a flag
 * error (exit 2), named as such, and so is a job the flags alone make
 * that does not hold together; one from a job file is a bad job (1).
 * Without a wrap policy the job gets the tools' default (the spec's
 * no_split_modules, else every Linear, as units), as in shardplane run
 * and shardplane plan. Returns 0 or the exit
 * code. */
static int check_job(const sp_job_cli *flags, sp_job *job, bool from_file,
                     const char *model_path) {
  sp_model *m = NULL;
  sp_diag d = {{0}};
  int ec = 1;
  if (sp_model_load_file(model_path, &m, &d) == 0) {
    ec = sp_job_cli_check_model(flags, m, &d) != 0 ? 2
         : sp_job_validate(job, m, &d) != 0        ? (from_file ? 1 : 2)
                                                   : 0;
    if (ec == 0 && sp_job_default_wrap(job, m, NULL) != 0) {
      sp_diag_set(&d, SP_ENOMEM, "out of memory");
      ec = 1;
    }
  }
  sp_model_free(m);
  if (ec != 0) fprintf(stderr, "shardplane-coordinator: %s\n", d.msg);
  return ec;
}

int main(int argc, char **argv) {
  const char *listen = "127.0.0.1:7700";
  sp_coord_config cfg = {0};
  sp_job_cli flags = {0};
  security sec;
  memset(&sec, 0, sizeof sec);
  sp_job_init(&cfg.job);
  int exit_code = 2;
  struct option *opts =
      sp_job_cli_options(k_opts, sizeof k_opts / sizeof k_opts[0]);
  if (opts == NULL) return 1;
  int c;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
      case OPT_LISTEN:
        listen = optarg;
        if (parse_listen("--listen", optarg) != 0) goto out;
        break;
      case OPT_MODEL:
        cfg.model_path = optarg;
        if (parse_text("--model", optarg, "a model spec (JSON file)") != 0)
          goto out;
        break;
      case OPT_JOB:
        cfg.job_path = optarg;
        if (parse_text("--job", optarg, "a job config (JSON file)") != 0)
          goto out;
        break;
      case OPT_HTTP_LISTEN:
        cfg.http_listen = optarg;
        if (parse_listen("--http-listen", optarg) != 0) goto out;
        break;
      case OPT_QUIET: cfg.quiet = true; break;
      case OPT_STATE_DIR:
        cfg.state_dir = optarg;
        if (parse_text("--state-dir", optarg, "a directory") != 0) goto out;
        break;
      case OPT_JOIN_WAIT:
        if (parse_ms("--join-wait-ms", optarg, &cfg.join_wait_ms) != 0)
          goto out;
        break;
      case OPT_REATTACH:
        if (parse_ms("--reattach-grace-ms", optarg, &cfg.reattach_grace_ms) !=
            0)
          goto out;
        break;
      case OPT_LOSS_GRACE: {
        long long x;
        sp_diag d = {{0}};
        if (sp_flag_int("--loss-grace-ms", optarg, 0, 3600000, &x, &d) != 0) {
          fprintf(stderr, "shardplane-coordinator: %s (milliseconds)\n", d.msg);
          goto out;
        }
        cfg.loss_grace_ms = x == 0 ? SP_COORD_LOSS_GRACE_OFF : (uint32_t)x;
        break;
      }
      case OPT_ON_GROUP_FAILURE:
        if (strcmp(optarg, "continue") == 0 || strcmp(optarg, "restart") == 0) {
          cfg.groups_continue = optarg[0] == 'c';
          break;
        }
        fprintf(stderr,
                "shardplane-coordinator: --on-group-failure %s: expected "
                "continue or restart\n",
                optarg);
        goto out;
      case OPT_STALL_MS:
        if (parse_ms("--stall-timeout-ms", optarg, &cfg.diag.stall_timeout_ms))
          goto out;
        break;
      case OPT_ON_STALL: {
        static const char *const names[] = {"alert", "abort"};
        size_t i;
        sp_diag d = {{0}};
        if (sp_flag_choice("--on-stall", optarg, names, 2, &i, &d) != 0) {
          fprintf(stderr, "shardplane-coordinator: %s\n", d.msg);
          goto out;
        }
        cfg.diag.abort_on_stall = i == 1;
        break;
      }
      case OPT_STRAGGLER: {
        sp_diag d = {{0}};
        if (sp_flag_number("--straggler-ratio", optarg, 1.01,
                           &cfg.diag.straggler_ratio, &d) != 0) {
          fprintf(stderr, "shardplane-coordinator: %s\n", d.msg);
          goto out;
        }
        break;
      }
      case OPT_DUMP_DIR:
        cfg.diag.dump_dir = optarg;
        if (parse_text("--dump-dir", optarg, "a directory") != 0) goto out;
        break;
      case OPT_HB_TIMEOUT:
        if (parse_ms("--heartbeat-timeout-ms", optarg,
                     &cfg.heartbeat_timeout_ms) != 0)
          goto out;
        break;
      case OPT_HB_INTERVAL:
        if (parse_ms("--heartbeat-interval-ms", optarg,
                     &cfg.heartbeat_interval_ms) != 0)
          goto out;
        break;
      case OPT_TLS_CERT:
      case OPT_TLS_KEY:
      case OPT_TLS_CLIENT_CA:
      case OPT_TOKEN_FILE: {
        static const char *const names[] = {
            "--tls-cert", "--tls-key", "--tls-client-ca", NULL, "--token-file"};
        if (parse_text(names[c - OPT_TLS_CERT], optarg, "a file") != 0)
          goto out;
        if (c == OPT_TLS_CERT)
          sec.tls.cert_file = optarg;
        else if (c == OPT_TLS_KEY)
          sec.tls.key_file = optarg;
        else if (c == OPT_TLS_CLIENT_CA)
          sec.tls.client_ca_file = optarg;
        else
          cfg.token_file = optarg;
        break;
      }
      case OPT_INSECURE: sec.insecure = true; break;
      case OPT_NO_AUTH: sec.no_auth = true; break;
      case OPT_QUOTA_BYTES:
        if (parse_quota("--store-quota-bytes", optarg, &cfg.store_quota.bytes))
          goto out;
        break;
      case OPT_QUOTA_KEYS:
        if (parse_quota("--store-quota-keys", optarg, &cfg.store_quota.keys))
          goto out;
        break;
      case OPT_HELP:
        usage(stdout);
        exit_code = 0;
        goto out;
      case OPT_MAX_CONNS:
      case OPT_PREFACE_MS:
      case OPT_IDLE_MS:
      case OPT_REQUEST_MS:
      case OPT_MAX_BUFFERED:
      case OPT_HTTP_MAX_CONNS:
      case OPT_METRICS_RANK_LIMIT:
        if (parse_limit(c, optarg, &cfg) != 0) goto out;
        break;
      default:
        if (c >= SP_JOB_OPT_BASE) {
          if (sp_job_cli_record(&flags, c, optarg) == 0) break;
          fprintf(stderr, "shardplane-coordinator: out of memory\n");
          exit_code = 1;
          goto out;
        }
        sp_flag_try_help("shardplane-coordinator"); /* getopt said what */
        goto out;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "shardplane-coordinator: unexpected argument \"%s\"\n",
            argv[optind]);
    sp_flag_try_help("shardplane-coordinator");
    goto out;
  }
  if (cfg.model_path == NULL) {
    fprintf(stderr, "shardplane-coordinator: --model is required\n");
    sp_flag_try_help("shardplane-coordinator");
    goto out;
  }
  sp_diag diag = {""};
  /* the job file and the flags meet in cfg.job; the coordinator takes it
   * as is (no job path left to reload) */
  int rc = sp_job_cli_apply(&flags, cfg.job_path, &cfg.job, &diag);
  if (rc != 0) {
    fprintf(stderr, "shardplane-coordinator: %s\n", diag.msg);
    exit_code = rc == SP_EINVAL ? 2 : 1;
    goto out;
  }
  exit_code = check_job(&flags, &cfg.job, cfg.job_path != NULL, cfg.model_path);
  if (exit_code != 0) goto out;
  if (check_security(&sec, &cfg) != 0) {
    sp_flag_try_help("shardplane-coordinator");
    exit_code = 2;
    goto out;
  }
  if (!sec.insecure) cfg.tls = &sec.tls;
  cfg.job_path = NULL;
  signal(SIGPIPE, SIG_IGN);
  uv_loop_t *loop = uv_default_loop();
  sp_coord *coord;
  exit_code = 1;
  if (sp_coord_new(loop, &cfg, &coord, &diag) != 0) {
    fprintf(stderr, "shardplane-coordinator: %s\n", diag.msg);
    goto out;
  }
  int port;
  if (sp_coord_listen(coord, listen, &port, &diag) != 0) {
    fprintf(stderr, "shardplane-coordinator: %s\n", diag.msg);
    sp_coord_free(coord);
    goto out;
  }
  warn_open(&sec, listen);
  char host[256];
  int ignored;
  sp_rpc_split_addr(listen, host, sizeof host, &ignored);
  printf("listening on %s%s%s:%d", strchr(host, ':') ? "[" : "", host,
         strchr(host, ':') ? "]" : "", port);
  if (cfg.http_listen != NULL) {
    sp_rpc_split_addr(cfg.http_listen, host, sizeof host, &ignored);
    printf(", http on %s%s%s:%d", strchr(host, ':') ? "[" : "", host,
           strchr(host, ':') ? "]" : "", coord->http_port);
  }
  putchar('\n');
  fflush(stdout);
  for (int i = 0; i < 2; i++) {
    uv_signal_init(loop, &g_sig[i]);
    g_sig[i].data = coord;
    uv_signal_start(&g_sig[i], on_signal, i == 0 ? SIGINT : SIGTERM);
  }
  uv_run(loop, UV_RUN_DEFAULT);
  sp_coord_free(coord);
  uv_loop_close(loop);
  exit_code = 0;
out:
  sp_job_cli_free(&flags);
  sp_job_clear(&cfg.job);
  free(opts);
  return exit_code;
}
