/* `shardplane agent`: the launcher and supervisor of one host's workers,
 * as torchrun. Starts N local processes of any trainer with the variables
 * launchers set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
 * GROUP_RANK / NODE_RANK, SHARDPLANE_COORDINATOR), passes their output on
 * with a rank prefix, and ends with their exit codes: 0 when every worker
 * finished, 1 naming the first rank that failed and how. The workers'
 * control traffic goes through the agent's proxy (agent_proxy.h): they
 * connect to a Unix socket of the agent's, and the agent holds the one
 * connection to the coordinator. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_proxy.h"
#include "base/clock.h"
#include "base/flag.h"
#include "cli.h"
#include "remote.h"
#include "supervise.h"
#include "workers.h"

#define AGENT "agent"

extern char **environ;

static void usage(FILE *f) {
  fputs(
      "usage: shardplane agent --coordinator HOST:PORT --nproc-per-node N "
      "[options] -- TRAINER [ARGS...]\n"
      "\n"
      "Starts N workers of TRAINER on this host (one agent per host, as\n"
      "torchrun) and supervises them. Worker i of node R gets RANK=R*N+i,\n"
      "LOCAL_RANK=i, WORLD_SIZE, LOCAL_WORLD_SIZE=N, GROUP_RANK=NODE_RANK=R\n"
      "and SHARDPLANE_COORDINATOR in its environment, which\n"
      "shardplane-worker and every program linking libshardplane read.\n"
      "Their gRPC calls reach the coordinator over the agent's one\n"
      "connection: the workers talk to the agent over a Unix socket in a\n"
      "private directory under $TMPDIR (SHARDPLANE_COORDINATOR=unix:PATH);\n"
      "it removes those that this user's agents killed by SIGKILL left.\n"
      "Every line a worker writes is shown prefixed with the time and its\n"
      "rank.\n"
      "\n"
      "  --nproc-per-node N           workers on this host\n"
      "  --node-rank R                this host's place among the hosts\n"
      "                               (default $NODE_RANK, $GROUP_RANK or\n"
      "                               $SLURM_NODEID; 0 with one host)\n"
      "  --nnodes M                   hosts in the job (default: the job's\n"
      "                               world size / N, asked of the\n"
      "                               coordinator; given, it must agree)\n"
      "  --nnodes MIN:MAX             elastic hosts, as torchrun: the job\n"
      "                               starts once MIN agents are there (and\n"
      "                               the coordinator's --join-wait-ms for\n"
      "                               more has passed, unless MAX came), on\n"
      "                               as many as came, up to MAX; the\n"
      "                               coordinator numbers the hosts (no\n"
      "                               --node-rank) and the world is N x\n"
      "                               hosts. A host lost, or one that joins\n"
      "                               while fewer than MAX run, ends the\n"
      "                               incarnation; the next one runs on the\n"
      "                               hosts there (a join uses up no\n"
      "                               restart; a loss needs --max-restarts)\n"
      "                               and loads the last SHARDED or FULL\n"
      "                               checkpoint (--load-on-restart)\n"
      "                               resharded to the new world. MAX x N\n"
      "                               must be the job's world size; hosts\n"
      "                               beyond MAX wait for room\n"
      "  --no-proxy                   the workers connect to the\n"
      "                               coordinator themselves\n"
      "                               (SHARDPLANE_COORDINATOR is its\n"
      "                               address; they need their own\n"
      "                               credentials)\n"
      "  --max-restarts K             when a worker dies, restart the job\n"
      "                               (every host's workers) up to K times\n"
      "                               as a new incarnation (default 0: the\n"
      "                               job ends naming the rank); every\n"
      "                               agent of the job must give the same K\n"
      "  --load-on-restart DIR        on a restart, TRAINER gets --load of\n"
      "                               the last checkpoint the job wrote in\n"
      "                               DIR (the trainer's --checkpoint-dir,\n"
      "                               written with --checkpoint-every N;\n"
      "                               not one an earlier job left there)\n"
      "  --coordinator-grace S        ride out a coordinator outage of up\n"
      "                               to S seconds (default 60; passed on\n"
      "                               to the workers as\n"
      "                               SHARDPLANE_COORDINATOR_GRACE): a\n"
      "                               coordinator with --state-dir that is\n"
      "                               restarted on its address finds the\n"
      "                               agent registered again as the same\n"
      "                               node, its workers still training;\n"
      "                               after S the agent stops them and\n"
      "                               exits 4\n"
      "  --stop-grace S               after Ctrl-C or SIGTERM, the workers\n"
      "                               have S seconds to stop by themselves\n"
      "                               (shardplane-worker checkpoints at the\n"
      "                               next step boundary; default 10); then\n"
      "                               they get more time only while the\n"
      "                               coordinator sees every rank moving\n"
      "                               (a long step), else they get SIGTERM,\n"
      "                               and SIGKILL 3 s later\n",
      f);
  fputs(SP_REMOTE_OPTIONS_HELP, f);
  fputs(
      "                               (the agent's --timeout-ms defaults\n"
      "                               to 30000: agents may start before\n"
      "                               their coordinator)\n"
      "  --help                       this text\n"
      "\n"
      "The agent's credentials (TLS and token) are its connection's; a\n"
      "worker's call that carries no token of its own gets the agent's.\n"
      "Gloo binds the address of this host that reaches the coordinator\n"
      "(SHARDPLANE_GLOO_HOST, unless set already).\n"
      "\n"
      "Workers also get SHARDPLANE_INCARNATION (0, then one more per\n"
      "restart) and SHARDPLANE_RESTART (0, then one more each time this\n"
      "host starts them again). The coordinator records each incarnation\n"
      "and what ended it (ListIncarnations); the store is emptied between\n"
      "them. With a coordinator run with --on-group-failure continue, a\n"
      "worker's death drops its replica group: its hosts' agents restart\n"
      "their workers in the same incarnation and they rejoin the others,\n"
      "which train on; --max-restarts is then not needed.\n"
      "\n"
      "Ctrl-C (SIGINT) or SIGTERM is forwarded to every worker; those\n"
      "still running after --stop-grace are stopped (and named), and a\n"
      "second signal stops them at once.\n"
      "\n"
      "exit codes: 0 every worker exited 0, 1 a worker failed or died (the\n"
      "message names its rank, and the signal or status), 2 bad usage,\n"
      "4 no coordinator answered, or it went away for longer than\n"
      "--coordinator-grace (or keeping no state dir) while the workers\n"
      "ran (no rank is blamed), 130 / 143 stopped by SIGINT / SIGTERM\n",
      f);
}

typedef struct agent {
  sp_remote r; /* the coordinator, its address and credentials */
  long long nproc, node_rank, nnodes;
  long long min_nodes;       /* --nnodes MIN:MAX; -1: a fixed set of hosts */
  const char *node_rank_var; /* where node_rank came from, for messages */
  bool no_proxy;
  long long max_restarts;              /* --max-restarts */
  const char *restart_load;            /* --load-on-restart DIR, or NULL */
  sp_supervise_ckpt_seen restart_seen; /* what restart_load held at the start */
  uint64_t grace_ms;                   /* --coordinator-grace */
  double stop_grace_s;                 /* --stop-grace; 0: the default */
  char **trainer; /* argv of the trainer, NULL-terminated */
  size_t n_trainer;
  /* the workers, their incarnations and the agent's stream to the
   * coordinator (AgentSession), over its own proxy: the one connection
   * carries it too */
  sp_supervise sup;
  uint32_t world;                  /* the job's world size */
  char worker_coord[PATH_MAX + 8]; /* what the workers connect to */
  char gloo_host[64];              /* "" when the environment sets it */
  sp_agent_proxy *proxy;
} agent;

enum {
  A_NPROC = 1,
  A_NODE_RANK,
  A_NNODES,
  A_NO_PROXY,
  A_MAX_RESTARTS,
  A_RESTART_LOAD,
  A_GRACE,
  A_STOP_GRACE,
  A_HELP
};

/* --node-rank from the environment when the flag did not give it. */
static int node_rank_from_env(agent *a) {
  static const char *const vars[] = {"NODE_RANK", "GROUP_RANK", "SLURM_NODEID"};
  for (size_t i = 0; i < 3 && a->node_rank < 0; i++) {
    const char *v = getenv(vars[i]);
    if (v == NULL || v[0] == '\0') continue;
    char flag[32];
    snprintf(flag, sizeof flag, "$%s", vars[i]);
    sp_diag d = {{0}};
    if (sp_flag_int(flag, v, 0, SP_WORKERS_MAX * 4096LL, &a->node_rank, &d) !=
        0) {
      sp_cli_error(AGENT, "%s", d.msg);
      return SP_EXIT_USAGE;
    }
    a->node_rank_var = vars[i];
  }
  return PROCEED;
}

/* --nnodes M, or MIN:MAX (elastic when MIN < MAX). */
static int parse_nnodes(agent *a, const char *v, sp_diag *d) {
  const char *colon = strchr(v, ':');
  if (colon == NULL) {
    a->min_nodes = -1;
    return sp_flag_int("--nnodes", v, 1, SP_WORKERS_MAX * 4096LL, &a->nnodes,
                       d);
  }
  char lo[32];
  size_t n = (size_t)(colon - v);
  if (n >= sizeof lo)
    return sp_diag_set(d, SP_EINVAL, "--nnodes %s: expected M or MIN:MAX", v);
  memcpy(lo, v, n);
  lo[n] = '\0';
  int rc = sp_flag_int("--nnodes (MIN)", lo, 1, SP_WORKERS_MAX * 4096LL,
                       &a->min_nodes, d);
  if (rc == 0)
    rc = sp_flag_int("--nnodes (MAX)", colon + 1, 1, SP_WORKERS_MAX * 4096LL,
                     &a->nnodes, d);
  if (rc == 0 && a->min_nodes > a->nnodes)
    return sp_diag_set(d, SP_EINVAL, "--nnodes %s: MIN is above MAX", v);
  if (rc == 0 && a->min_nodes == a->nnodes) a->min_nodes = -1;
  return rc;
}

static int parse_args(agent *a, int argc, char **argv) {
  static const struct option opts[] = {
      {"nproc-per-node", required_argument, NULL, A_NPROC},
      {"node-rank", required_argument, NULL, A_NODE_RANK},
      {"nnodes", required_argument, NULL, A_NNODES},
      {"no-proxy", no_argument, NULL, A_NO_PROXY},
      {"max-restarts", required_argument, NULL, A_MAX_RESTARTS},
      {"load-on-restart", required_argument, NULL, A_RESTART_LOAD},
      {"coordinator-grace", required_argument, NULL, A_GRACE},
      {"stop-grace", required_argument, NULL, A_STOP_GRACE},
      {"help", no_argument, NULL, A_HELP},
      SP_REMOTE_OPTIONS,
      {NULL, 0, NULL, 0}};
  a->nproc = a->node_rank = a->nnodes = a->min_nodes = -1;
  a->r.timeout_ms = 30000; /* agents may start before their coordinator */
  /* as its workers: the flag, else the variable, else the default */
  a->grace_ms = SP_COORDINATOR_GRACE_DEFAULT_MS;
  const char *grace = getenv(SP_COORDINATOR_GRACE_ENV);
  sp_diag ed = {{0}};
  if (grace != NULL && grace[0] != '\0' &&
      sp_coordinator_grace_parse("$" SP_COORDINATOR_GRACE_ENV, grace,
                                 &a->grace_ms, &ed) != 0) {
    sp_cli_error(AGENT, "%s", ed.msg);
    return SP_EXIT_USAGE;
  }
  int c;
  optind = 1;
  /* "+": the trainer's arguments after "--" (or its name) are its own */
  while ((c = getopt_long(argc, argv, "+", opts, NULL)) != -1) {
    sp_diag d = {{0}};
    int rc = 0;
    switch (c) {
      case A_HELP: usage(stdout); return SP_EXIT_OK;
      case A_NPROC:
        rc = sp_flag_int("--nproc-per-node", optarg, 1, SP_WORKERS_MAX,
                         &a->nproc, &d);
        break;
      case A_NODE_RANK:
        rc = sp_flag_int("--node-rank", optarg, 0, SP_WORKERS_MAX * 4096LL,
                         &a->node_rank, &d);
        a->node_rank_var = NULL;
        break;
      case A_NNODES: rc = parse_nnodes(a, optarg, &d); break;
      case A_NO_PROXY: a->no_proxy = true; break;
      case A_MAX_RESTARTS:
        rc = sp_flag_int("--max-restarts", optarg, 0, 1000, &a->max_restarts,
                         &d);
        break;
      case A_RESTART_LOAD:
        a->restart_load = optarg;
        rc = sp_flag_text("--load-on-restart", optarg,
                          "a checkpoint "
                          "directory",
                          &d);
        break;
      case A_GRACE:
        rc = sp_coordinator_grace_parse("--coordinator-grace", optarg,
                                        &a->grace_ms, &d);
        break;
      case A_STOP_GRACE:
        rc = sp_supervise_stop_grace_parse("--stop-grace", optarg,
                                           &a->stop_grace_s, &d);
        break;
      case '?': sp_cli_try_help(AGENT); return SP_EXIT_USAGE;
      default: {
        int k = sp_remote_option(&a->r, c, optarg);
        if (k < 0) return SP_EXIT_USAGE;
        if (k == 0) {
          sp_cli_try_help(AGENT);
          return SP_EXIT_USAGE;
        }
      }
    }
    if (rc != 0) {
      sp_cli_error(AGENT, "%s", d.msg);
      return SP_EXIT_USAGE;
    }
  }
  if (a->nproc < 0) {
    sp_cli_error(AGENT, "--nproc-per-node is required");
    sp_cli_try_help(AGENT);
    return SP_EXIT_USAGE;
  }
  if (optind >= argc) {
    sp_cli_error(AGENT,
                 "no trainer: give it after \"--\" (shardplane "
                 "agent ... -- shardplane-worker --steps 20)");
    return SP_EXIT_USAGE;
  }
  a->trainer = argv + optind;
  a->n_trainer = (size_t)(argc - optind);
  if (a->restart_load && a->max_restarts == 0 && a->min_nodes < 0) {
    sp_cli_error(AGENT,
                 "--load-on-restart %s needs --max-restarts K (or "
                 "--nnodes MIN:MAX)",
                 a->restart_load);
    return SP_EXIT_USAGE;
  }
  if (a->min_nodes > 0 && a->node_rank >= 0) {
    sp_cli_error(AGENT,
                 "--node-rank %lld with --nnodes %lld:%lld: the coordinator "
                 "numbers elastic hosts",
                 a->node_rank, a->min_nodes, a->nnodes);
    return SP_EXIT_USAGE;
  }
  /* an elastic host is numbered by the coordinator, whatever Slurm says */
  return a->node_rank < 0 && a->min_nodes < 0 ? node_rank_from_env(a) : PROCEED;
}

/* Asks the coordinator for the job's world size and checks the hosts
 * add up to it. Returns PROCEED or the exit code. */
static int check_world(agent *a) {
  int ec = sp_remote_connect(&a->r);
  if (ec != SP_EXIT_OK) return ec;
  Shardplane__V1__GetJobRequest req = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  Shardplane__V1__GetJobResponse *resp = NULL;
  ec = sp_remote_call(&a->r, "/shardplane.v1.Coordinator/GetJob", &req.base,
                      &shardplane__v1__get_job_response__descriptor,
                      (ProtobufCMessage **)&resp);
  if (ec != SP_EXIT_OK) return ec;
  a->world = resp->job ? resp->job->world_size : 0;
  sp_remote_free_msg(resp);
  long long n = a->nproc;
  /* elastic: the world is the incarnation's, numbered by the coordinator
   * (which checks MAX x N against the job's largest) */
  if (a->min_nodes > 0) return PROCEED;
  if (a->world == 0 || a->world % n != 0) {
    sp_cli_error(AGENT,
                 "--nproc-per-node %lld: the job's world size %u is "
                 "not a multiple of it",
                 n, a->world);
    return SP_EXIT_USAGE;
  }
  if (a->nnodes < 0) a->nnodes = a->world / n;
  if (a->nnodes * n != a->world) {
    sp_cli_error(AGENT,
                 "--nnodes %s%lld x --nproc-per-node %lld is %lld "
                 "ranks; the job has %u",
                 a->min_nodes > 0 ? "MAX " : "", a->nnodes, n, a->nnodes * n,
                 a->world);
    return SP_EXIT_USAGE;
  }
  if (a->node_rank < 0) {
    if (a->nnodes > 1) {
      sp_cli_error(AGENT,
                   "--node-rank is required with %lld hosts (or "
                   "$NODE_RANK, $GROUP_RANK, $SLURM_NODEID)",
                   a->nnodes);
      return SP_EXIT_USAGE;
    }
    a->node_rank = 0;
  }
  if (a->node_rank >= a->nnodes) {
    sp_cli_error(AGENT, "%s%s %lld: the job has %lld hosts (0 to %lld)",
                 a->node_rank_var ? "$" : "--",
                 a->node_rank_var ? a->node_rank_var : "node-rank",
                 a->node_rank, a->nnodes, a->nnodes - 1);
    return SP_EXIT_USAGE;
  }
  return PROCEED;
}

/* The proxy, and what the workers are told. Returns PROCEED or the exit
 * code. */
static int start_proxy(agent *a) {
  sp_diag d = {{0}};
  if (sp_local_addr_toward(a->r.addr, a->gloo_host, sizeof a->gloo_host, &d) !=
      0) {
    sp_cli_error(AGENT, "the coordinator %s: %s", a->r.addr, d.msg);
    return SP_EXIT_FAILURE;
  }
  const char *g = getenv(SP_GLOO_HOST_ENV);
  if (g != NULL && g[0] != '\0') a->gloo_host[0] = '\0';
  if (a->no_proxy) {
    snprintf(a->worker_coord, sizeof a->worker_coord, "%s", a->r.addr);
    return PROCEED;
  }
  sp_rpc_client_opts co = {.connect_timeout_ms = 20000};
  sp_cred_client_opts(&a->r.cred, &co);
  if (sp_agent_proxy_start(a->r.addr, &co, &a->proxy, &d) != 0) {
    sp_cli_error(AGENT, "cannot start the proxy: %s", d.msg);
    return SP_EXIT_FAILURE;
  }
  snprintf(a->worker_coord, sizeof a->worker_coord, "%s",
           sp_agent_proxy_address(a->proxy));
  return PROCEED;
}

/* The environment of local rank i: this process's, less the variables the
 * agent sets, plus them. envp (cap entries) points into vars. */
static int worker_env(const agent *a, long long i, char **envp, size_t cap,
                      char vars[][PATH_MAX + 40], size_t nvars) {
  static const char *const set[] = {"RANK=",
                                    "LOCAL_RANK=",
                                    "WORLD_SIZE=",
                                    "LOCAL_WORLD_SIZE=",
                                    "GROUP_RANK=",
                                    "NODE_RANK=",
                                    SP_COORDINATOR_ENV "=",
                                    SP_GLOO_HOST_ENV "=",
                                    "SHARDPLANE_INCARNATION=",
                                    SP_RESTART_ENV "=",
                                    SP_COORDINATOR_GRACE_ENV "="};
  size_t n = 0, k = 0;
  snprintf(vars[k++], sizeof vars[0], "RANK=%lld", a->node_rank * a->nproc + i);
  snprintf(vars[k++], sizeof vars[0], "LOCAL_RANK=%lld", i);
  snprintf(vars[k++], sizeof vars[0], "WORLD_SIZE=%u", a->world);
  snprintf(vars[k++], sizeof vars[0], "LOCAL_WORLD_SIZE=%lld", a->nproc);
  snprintf(vars[k++], sizeof vars[0], "GROUP_RANK=%lld", a->node_rank);
  snprintf(vars[k++], sizeof vars[0], "NODE_RANK=%lld", a->node_rank);
  snprintf(vars[k++], sizeof vars[0], SP_COORDINATOR_ENV "=%s",
           a->worker_coord);
  snprintf(vars[k++], sizeof vars[0], "SHARDPLANE_INCARNATION=%llu",
           (unsigned long long)a->sup.incarnation);
  snprintf(vars[k++], sizeof vars[0], SP_RESTART_ENV "=%u",
           a->sup.restarts_done);
  /* the workers ride out what the agent does */
  snprintf(vars[k++], sizeof vars[0], SP_COORDINATOR_GRACE_ENV "=%llu.%03llu",
           (unsigned long long)(a->grace_ms / 1000),
           (unsigned long long)(a->grace_ms % 1000));
  if (a->gloo_host[0])
    snprintf(vars[k++], sizeof vars[0], SP_GLOO_HOST_ENV "=%s", a->gloo_host);
  if (k > nvars) return -1;
  for (char **e = environ; *e; e++) {
    bool ours = false;
    for (size_t j = 0; j < sizeof set / sizeof set[0] && !ours; j++)
      ours = strncmp(*e, set[j], strlen(set[j])) == 0;
    if (ours) continue;
    if (n + k + 1 >= cap) return -1;
    envp[n++] = *e;
  }
  for (size_t j = 0; j < k; j++) envp[n++] = vars[j];
  envp[n] = NULL;
  return 0;
}

#define N_VARS 12 /* the variables worker_env sets, at most */

/* The trainer's argv for this incarnation: after a restart, with --load
 * of the last checkpoint (when --load-on-restart names a directory that
 * holds one this job wrote). argv has n_trainer + 3 entries. */
static void trainer_argv(agent *a, char **argv, char *load, size_t cap) {
  size_t k = 0;
  for (size_t i = 0; i < a->n_trainer; i++) argv[k++] = a->trainer[i];
  sp_ckpt_kind kind;
  if (a->sup.incarnation > 0 && a->restart_load &&
      sp_supervise_restart_ckpt(&a->sup, a->restart_load, &a->restart_seen,
                                NULL, load, cap, &kind)) {
    argv[k++] = "--load";
    argv[k++] = load;
  }
  argv[k] = NULL;
}

/* Every worker of the current incarnation (sp_supervise_ops.start). */
static int start_workers(sp_supervise *s) {
  agent *a = s->user;
  size_t cap = N_VARS;
  for (char **e = environ; *e; e++) cap++;
  char **envp = calloc(cap + 1, sizeof *envp);
  char(*vars)[PATH_MAX + 40] = calloc(N_VARS, sizeof *vars);
  char **argv = calloc(a->n_trainer + 3, sizeof *argv);
  char *load = malloc(4096);
  int ec = PROCEED;
  if (envp == NULL || vars == NULL || argv == NULL || load == NULL) {
    sp_cli_error(AGENT, "out of memory");
    ec = SP_EXIT_FAILURE;
  }
  if (ec == PROCEED) trainer_argv(a, argv, load, 4096);
  for (long long i = 0; ec == PROCEED && i < a->nproc; i++) {
    if (worker_env(a, i, envp, cap + 1, vars, N_VARS) != 0) {
      sp_cli_error(AGENT, "out of memory");
      ec = SP_EXIT_FAILURE;
      break;
    }
    s->pids[i] = sp_workers_spawn(argv, envp, &s->streams[2 * i],
                                  &s->streams[2 * i + 1]);
    if (s->pids[i] < 0) {
      s->pids[i] = 0;
      sp_cli_error(AGENT, "cannot start %s for rank %lld: %s", a->trainer[0],
                   a->node_rank * a->nproc + i, strerror(errno));
      ec = SP_EXIT_FAILURE;
      break;
    }
    s->live++;
  }
  free(envp);
  free(vars);
  free(argv);
  free(load);
  return ec;
}

/* "rank 3 (local rank 1 on node 1)" (sp_supervise_ops.name). */
static void name_worker(const sp_supervise *s, uint32_t i, char *out,
                        size_t cap) {
  const agent *a = s->user;
  snprintf(out, cap, "rank %lld (local rank %u on node %lld)",
           a->node_rank * a->nproc + i, i, a->node_rank);
}

/* Elastic nodes: the host's place in this incarnation's world
 * (sp_supervise_ops.place). */
static void place_host(sp_supervise *s, uint32_t world, uint32_t node) {
  agent *a = s->user;
  s->world_changed = a->world != world;
  a->world = world;
  a->node_rank = node;
  a->nnodes = world / a->nproc;
  s->first_rank = node * (uint32_t)a->nproc;
}

static const sp_supervise_ops k_ops = {
    .start = start_workers, .name = name_worker, .place = place_host};

/* Opens AgentSession through the proxy when there is one (which adds the
 * agent's token), else straight to the coordinator with the agent's
 * credentials. Returns PROCEED or the exit code. */
static int ctl_open(agent *a) {
  sp_rpc_client_opts co = {.connect_timeout_ms = a->r.timeout_ms};
  if (a->proxy == NULL) sp_cred_client_opts(&a->r.cred, &co);
  return sp_supervise_open_session(
      &a->sup, a->worker_coord, &co, a->r.addr,
      a->node_rank < 0 ? 0 : (uint32_t)a->node_rank, a->r.timeout_ms);
}

/* The supervision's settings, once the node is known. */
static void setup_sup(agent *a) {
  a->sup.who = AGENT;
  a->sup.ops = &k_ops;
  a->sup.user = a;
  a->sup.n = (uint32_t)a->nproc;
  a->sup.first_rank =
      a->node_rank < 0 ? 0 : (uint32_t)(a->node_rank * a->nproc);
  a->sup.max_restarts = (uint32_t)a->max_restarts;
  if (a->min_nodes > 0) {
    a->sup.min_nodes = (uint32_t)a->min_nodes;
    a->sup.max_nodes = (uint32_t)a->nnodes;
  }
  a->sup.grace_ms = a->grace_ms;
  a->sup.stop_grace_s = a->stop_grace_s;
  /* a restart loads only a checkpoint this job wrote */
  sp_supervise_ckpt_note(a->restart_load, &a->restart_seen);
}

int sp_cmd_agent(int argc, char **argv) {
  agent a = {0};
  sp_remote_init(&a.r, AGENT);
  int ret = parse_args(&a, argc, argv);
  /* a worker gone from its socket is an EPIPE for the proxy, not the end
   * of the agent */
  signal(SIGPIPE, SIG_IGN);
  if (ret == PROCEED) ret = check_world(&a);
  /* its connection goes: the proxy's is the one the agent keeps */
  if (a.r.rpc) sp_remote_finish(&a.r, SP_EXIT_OK);
  a.r.rpc = NULL;
  if (ret == PROCEED) setup_sup(&a);
  if (ret == PROCEED) ret = start_proxy(&a);
  if (ret == PROCEED) ret = ctl_open(&a);
  if (ret == PROCEED) ret = sp_supervise_alloc_streams(&a.sup);
  if (ret != PROCEED) goto out;
  sp_supervise_catch_signals();
  fprintf(stderr,
          "shardplane agent: node %lld of %lld, ranks %lld-%lld of "
          "%u, incarnation %llu; coordinator %s%s%s\n",
          a.node_rank, a.nnodes, a.node_rank * a.nproc,
          a.node_rank * a.nproc + a.nproc - 1, a.world,
          (unsigned long long)a.sup.incarnation, a.r.addr,
          a.proxy ? ", proxied from " : "", a.proxy ? a.worker_coord : "");
  ret = start_workers(&a.sup);
  if (ret == PROCEED) ret = sp_supervise_run(&a.sup);
  sp_supervise_stop(&a.sup);
out:
  sp_supervise_close_session(&a.sup);
  if (a.sup.streams)
    sp_workers_close_streams(a.sup.streams, 2 * (size_t)a.nproc);
  free(a.sup.streams);
  if (a.proxy) {
    sp_agent_proxy_stop(a.proxy);
    sp_agent_proxy_stats st;
    sp_agent_proxy_stats_get(a.proxy, &st);
    fprintf(stderr,
            "shardplane agent: proxied %llu calls from %llu worker "
            "connections over its connection to %s\n",
            (unsigned long long)st.calls, (unsigned long long)st.local_conns,
            a.r.addr);
    sp_agent_proxy_free(a.proxy);
  }
  return ret;
}
