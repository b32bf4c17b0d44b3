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

#include "agent_ctl.h"
#include "agent_proxy.h"
#include "base/clock.h"
#include "base/flag.h"
#include "cli.h"
#include "remote.h"
#include "workers.h"

#define AGENT "agent"

extern char **environ;

static volatile sig_atomic_t g_signal;
static void on_signal(int sig) { g_signal = sig; }

static void usage(FILE *f) {
  fputs("usage: shardplane agent --coordinator HOST:PORT --nproc-per-node N "
        "[options] -- TRAINER [ARGS...]\n"
        "\n"
        "Starts N workers of TRAINER on this host (one agent per host, as\n"
        "torchrun) and supervises them. Worker i of node R gets RANK=R*N+i,\n"
        "LOCAL_RANK=i, WORLD_SIZE, LOCAL_WORLD_SIZE=N, GROUP_RANK=NODE_RANK=R\n"
        "and SHARDPLANE_COORDINATOR in its environment, which\n"
        "shardplane-worker and every program linking libshardplane read.\n"
        "Their gRPC calls reach the coordinator over the agent's one\n"
        "connection: the workers talk to the agent over a Unix socket in a\n"
        "private directory (SHARDPLANE_COORDINATOR=unix:PATH). Every line a\n"
        "worker writes is shown prefixed with the time and its rank.\n"
        "\n"
        "  --nproc-per-node N           workers on this host\n"
        "  --node-rank R                this host's place among the hosts\n"
        "                               (default $NODE_RANK, $GROUP_RANK or\n"
        "                               $SLURM_NODEID; 0 with one host)\n"
        "  --nnodes M                   hosts in the job (default: the job's\n"
        "                               world size / N, asked of the\n"
        "                               coordinator; given, it must agree)\n"
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
        "  --load-on-restart DIR        on a restart, TRAINER gets --load DIR\n"
        "                               when DIR holds a checkpoint (the\n"
        "                               trainer's --checkpoint-dir, written\n"
        "                               with --checkpoint-every N)\n"
        "  --coordinator-grace S        ride out a coordinator outage of up\n"
        "                               to S seconds (default 60; passed on\n"
        "                               to the workers as\n"
        "                               SHARDPLANE_COORDINATOR_GRACE): a\n"
        "                               coordinator with --state-dir that is\n"
        "                               restarted on its address finds the\n"
        "                               agent registered again as the same\n"
        "                               node, its workers still training;\n"
        "                               after S the agent stops them and\n"
        "                               exits 4\n",
        f);
  fputs(SP_REMOTE_OPTIONS_HELP, f);
  fputs("                               (the agent's --timeout-ms defaults\n"
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
        "restart). The coordinator records each incarnation and what ended\n"
        "it (ListIncarnations); the store is emptied between them.\n"
        "\n"
        "Ctrl-C (SIGINT) or SIGTERM is forwarded to every worker; a second\n"
        "one stops them at once.\n"
        "\n"
        "exit codes: 0 every worker exited 0, 1 a worker failed or died (the\n"
        "message names its rank, and the signal or status), 2 bad usage,\n"
        "4 no coordinator answered, or it went away for longer than\n"
        "--coordinator-grace (or keeping no state dir) while the workers\n"
        "ran (no rank is blamed), 130 / 143 stopped by SIGINT / SIGTERM\n",
        f);
}

typedef struct agent {
  sp_remote r;          /* the coordinator, its address and credentials */
  long long nproc, node_rank, nnodes;
  const char *node_rank_var; /* where node_rank came from, for messages */
  bool no_proxy;
  long long max_restarts;     /* --max-restarts */
  const char *restart_load;   /* --load-on-restart DIR, or NULL */
  char **trainer;       /* argv of the trainer, NULL-terminated */
  size_t n_trainer;
  /* the agent's stream to the coordinator (AgentSession), over its own
   * proxy: the one connection carries it too; it outlives the
   * coordinator's outages of up to grace_ms (agent_ctl.h) */
  sp_agent_ctl *ctl;
  uint64_t grace_ms;    /* --coordinator-grace */
  uint64_t incarnation;
  uint32_t failed; /* workers of this incarnation that failed */
  /* told AGENT_STOP: its workers stopped, it waits for AGENT_START or
   * AGENT_END (its own workers may not have failed: a slow host's are
   * still running when the stop comes) */
  bool stopped;
  uint32_t world;       /* the job's world size */
  char worker_coord[PATH_MAX + 8]; /* what the workers connect to */
  char gloo_host[64];   /* "" when the environment sets it */
  sp_agent_proxy *proxy;
  pid_t pids[SP_WORKERS_MAX];
  uint32_t live;
  sp_out_stream *streams; /* local rank i's stdout at 2i, stderr 2i + 1 */
  /* workers that ended unasked while the coordinator was away: judged
   * once it is back (reported, or the job stopped naming the rank), never
   * if it does not come back (a worker that could not reach it either is
   * not to blame) */
  struct worker_end {
    long long local;
    int status;
    uint64_t incarnation;
  } held[SP_WORKERS_MAX];
  uint32_t n_held;
  /* the deaths of this incarnation reported: sent again after an outage,
   * since a coordinator that died within its decision window lost them
   * (it ignores those of an incarnation that has ended) */
  struct worker_end reported[SP_WORKERS_MAX];
  uint32_t n_reported;
} agent;

enum { A_NPROC = 1, A_NODE_RANK, A_NNODES, A_NO_PROXY, A_MAX_RESTARTS,
       A_RESTART_LOAD, A_GRACE, A_HELP };

#define PROCEED (-1)

/* --node-rank from the environment when the flag did not give it. */
static int node_rank_from_env(agent *a) {
  static const char *const vars[] = {"NODE_RANK", "GROUP_RANK",
                                     "SLURM_NODEID"};
  for (size_t i = 0; i < 3 && a->node_rank < 0; i++) {
    const char *v = getenv(vars[i]);
    if (v == NULL || v[0] == '\0') continue;
    char flag[32];
    snprintf(flag, sizeof flag, "$%s", vars[i]);
    sp_diag d = {{0}};
    if (sp_flag_int(flag, v, 0, SP_WORKERS_MAX * 4096LL, &a->node_rank,
                    &d) != 0) {
      sp_cli_error(AGENT, "%s", d.msg);
      return SP_EXIT_USAGE;
    }
    a->node_rank_var = vars[i];
  }
  return PROCEED;
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
      {"help", no_argument, NULL, A_HELP},
      SP_REMOTE_OPTIONS,
      {NULL, 0, NULL, 0}};
  a->nproc = a->node_rank = a->nnodes = -1;
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
      case A_NNODES:
        rc = sp_flag_int("--nnodes", optarg, 1, SP_WORKERS_MAX * 4096LL,
                         &a->nnodes, &d);
        break;
      case A_NO_PROXY: a->no_proxy = true; break;
      case A_MAX_RESTARTS:
        rc = sp_flag_int("--max-restarts", optarg, 0, 1000, &a->max_restarts,
                         &d);
        break;
      case A_RESTART_LOAD:
        a->restart_load = optarg;
        rc = sp_flag_text("--load-on-restart", optarg, "a checkpoint "
                          "directory", &d);
        break;
      case A_GRACE:
        rc = sp_coordinator_grace_parse("--coordinator-grace", optarg,
                                        &a->grace_ms, &d);
        break;
      case '?': usage(stderr); return SP_EXIT_USAGE;
      default: {
        int k = sp_remote_option(&a->r, c, optarg);
        if (k < 0) return SP_EXIT_USAGE;
        if (k == 0) {
          usage(stderr);
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
    usage(stderr);
    return SP_EXIT_USAGE;
  }
  if (optind >= argc) {
    sp_cli_error(AGENT, "no trainer: give it after \"--\" (shardplane "
                        "agent ... -- shardplane-worker --steps 20)");
    return SP_EXIT_USAGE;
  }
  a->trainer = argv + optind;
  a->n_trainer = (size_t)(argc - optind);
  if (a->restart_load && a->max_restarts == 0) {
    sp_cli_error(AGENT, "--load-on-restart %s needs --max-restarts K",
                 a->restart_load);
    return SP_EXIT_USAGE;
  }
  return a->node_rank < 0 ? node_rank_from_env(a) : PROCEED;
}

/* Asks the coordinator for the job's world size and checks the hosts
 * add up to it. Returns PROCEED or the exit code. */
static int check_world(agent *a) {
  int ec = sp_remote_connect(&a->r);
  if (ec != SP_EXIT_OK) return ec;
  Shardplane__V1__GetJobRequest req = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  Shardplane__V1__GetJobResponse *resp = NULL;
  ec = sp_remote_call(&a->r, "/shardplane.v1.Coordinator/GetJob",
                      &req.base, &shardplane__v1__get_job_response__descriptor,
                      (ProtobufCMessage **)&resp);
  if (ec != SP_EXIT_OK) return ec;
  a->world = resp->job ? resp->job->world_size : 0;
  sp_remote_free_msg(resp);
  long long n = a->nproc;
  if (a->world == 0 || a->world % n != 0) {
    sp_cli_error(AGENT, "--nproc-per-node %lld: the job's world size %u is "
                 "not a multiple of it", n, a->world);
    return SP_EXIT_USAGE;
  }
  if (a->nnodes < 0) a->nnodes = a->world / n;
  if (a->nnodes * n != a->world) {
    sp_cli_error(AGENT, "--nnodes %lld x --nproc-per-node %lld is %lld "
                 "ranks; the job has %u", a->nnodes, n, a->nnodes * n,
                 a->world);
    return SP_EXIT_USAGE;
  }
  if (a->node_rank < 0) {
    if (a->nnodes > 1) {
      sp_cli_error(AGENT, "--node-rank is required with %lld hosts (or "
                   "$NODE_RANK, $GROUP_RANK, $SLURM_NODEID)", a->nnodes);
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
  if (sp_local_addr_toward(a->r.addr, a->gloo_host, sizeof a->gloo_host,
                           &d) != 0) {
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
  static const char *const set[] = {
      "RANK=", "LOCAL_RANK=", "WORLD_SIZE=", "LOCAL_WORLD_SIZE=",
      "GROUP_RANK=", "NODE_RANK=", SP_COORDINATOR_ENV "=",
      SP_GLOO_HOST_ENV "=", "SHARDPLANE_INCARNATION=",
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
           (unsigned long long)a->incarnation);
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

#define N_VARS 11 /* the variables worker_env sets, at most */

/* The streams of the workers' output, once for every incarnation. */
static int alloc_streams(agent *a) {
  size_t ns = 2 * (size_t)a->nproc;
  a->streams = calloc(ns, sizeof *a->streams);
  if (a->streams == NULL) {
    sp_cli_error(AGENT, "out of memory");
    return SP_EXIT_FAILURE;
  }
  for (size_t i = 0; i < ns; i++)
    a->streams[i] = (sp_out_stream){
        .fd = -1, .rank = (int)(a->node_rank * a->nproc + (long long)i / 2),
        .to = i % 2 ? stderr : stdout};
  return PROCEED;
}

/* The trainer's argv for this incarnation: after a restart, with --load
 * of the last checkpoint (when --load-on-restart names one that holds
 * one). argv has n_trainer + 3 entries. */
static void trainer_argv(agent *a, char **argv, char *load, size_t cap) {
  size_t k = 0;
  for (size_t i = 0; i < a->n_trainer; i++) argv[k++] = a->trainer[i];
  if (a->incarnation > 0 && a->restart_load) {
    sp_diag d = {{0}};
    sp_ckpt_kind kind;
    int rc = sp_ckpt_resolve(a->restart_load, 0, load, cap, &kind, &d);
    if (rc == SP_EINVAL)
      rc = sp_ckpt_resolve(a->restart_load, SP_CKPT_FULL, load, cap, &kind,
                           &d);
    if (rc == 0) {
      argv[k++] = "--load";
      argv[k++] = load;
      fprintf(stderr, "shardplane agent: incarnation %llu loads %s\n",
              (unsigned long long)a->incarnation, load);
    } else {
      fprintf(stderr, "shardplane agent: incarnation %llu starts afresh: "
              "%s\n", (unsigned long long)a->incarnation, d.msg);
    }
  }
  argv[k] = NULL;
}

static int start_workers(agent *a) {
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
    a->pids[i] = sp_workers_spawn(argv, envp, &a->streams[2 * i],
                                  &a->streams[2 * i + 1]);
    if (a->pids[i] < 0) {
      a->pids[i] = 0;
      sp_cli_error(AGENT, "cannot start %s for rank %lld: %s", a->trainer[0],
                   a->node_rank * a->nproc + i, strerror(errno));
      ec = SP_EXIT_FAILURE;
      break;
    }
    a->live++;
  }
  free(envp);
  free(vars);
  free(argv);
  free(load);
  return ec;
}

/* ---- the agent's stream to the coordinator (agent_ctl.h) ---- */

/* Opens AgentSession (through the proxy when there is one), registers the
 * node and waits for the coordinator's first word: the incarnation to
 * start. Returns PROCEED or the exit code. */
static int ctl_open(agent *a) {
  sp_agent_ctl_opts o = {
      .target = a->worker_coord, .coordinator = a->r.addr,
      .client = {.connect_timeout_ms = a->r.timeout_ms},
      .grace_ms = a->grace_ms, .node_rank = (uint32_t)a->node_rank,
      .nproc = (uint32_t)a->nproc, .max_restarts = (uint32_t)a->max_restarts};
  if (a->proxy == NULL) sp_cred_client_opts(&a->r.cred, &o.client);
  sp_diag d = {{0}};
  if (sp_agent_ctl_open(&o, &a->ctl, &d) != 0) {
    sp_cli_error(AGENT, "%s", d.msg);
    return SP_EXIT_UNREACHABLE;
  }
  Shardplane__V1__AgentDown *cmd = NULL;
  int got = sp_agent_ctl_next(a->ctl, a->r.timeout_ms, 0, false, &cmd, &d);
  if (got <= 0) {
    if (got == 0)
      sp_cli_error(AGENT, "the coordinator did not answer the agent's "
                   "registration within %llu ms",
                   (unsigned long long)a->r.timeout_ms);
    else
      sp_cli_error(AGENT, "%s", d.msg);
    return SP_EXIT_FAILURE;
  }
  int ec = PROCEED;
  if (cmd->command == SHARDPLANE__V1__AGENT_COMMAND__AGENT_START) {
    a->incarnation = cmd->incarnation;
  } else {
    sp_cli_error(AGENT, "the job %s: %s",
                 cmd->command == SHARDPLANE__V1__AGENT_COMMAND__AGENT_END
                     ? "ended"
                     : "is restarting",
                 cmd->reason);
    ec = SP_EXIT_FAILURE;
  }
  protobuf_c_message_free_unpacked(&cmd->base, NULL);
  return ec;
}

static void report_exit(agent *a, long long i, int st, uint64_t incarnation) {
  Shardplane__V1__WorkerExit w = SHARDPLANE__V1__WORKER_EXIT__INIT;
  w.incarnation = incarnation;
  w.rank = (uint32_t)(a->node_rank * a->nproc + i);
  w.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 0;
  w.signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.worker_exit = &w;
  sp_agent_ctl_send(a->ctl, &up);
}

/* After a failure the other workers get this long to stop by themselves
 * (the coordinator aborts them when it notices the lost rank) and say
 * why; then SIGTERM, and SIGKILL TERM_S after it. As `shardplane run`. */
#define GRACE_S 0.5
#define TERM_S 3.0

/* Where supervise stands. */
typedef struct watch {
  int ret, interrupted;
  bool terminated, done;
  bool coord_gone; /* past the grace, or lost without a state dir */
  double term_at, kill_at;
} watch;

/* The workers' output, drained for up to 1 s once they are all gone. */
static void drain_all(agent *a) {
  size_t ns = 2 * (size_t)a->nproc;
  double end = sp_clock_s() + 1.0;
  while (sp_workers_pass_output(a->streams, ns, 20) > 0 && sp_clock_s() < end)
    ;
  sp_workers_close_streams(a->streams, ns);
}

static void send_stopped(agent *a) {
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.stopped = true;
  up.incarnation = a->incarnation;
  sp_agent_ctl_send(a->ctl, &up);
}

/* A command from the coordinator. */
static void on_command(agent *a, watch *w, const Shardplane__V1__AgentDown *d) {
  switch (d->command) {
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_STOP: {
      if (a->stopped && d->incarnation == a->incarnation && a->live == 0) {
        /* the answer to registering again, stopped: say so again */
        send_stopped(a);
        return;
      }
      fprintf(stderr, "shardplane agent: incarnation %llu ended (%s); "
              "stopping the %u worker%s of this host for a restart\n",
              (unsigned long long)d->incarnation, d->reason, a->live,
              a->live == 1 ? "" : "s");
      sp_workers_stop(a->pids, (uint32_t)a->nproc, (int)(TERM_S * 1000));
      a->live = 0;
      a->stopped = true;
      drain_all(a);
      a->incarnation = d->incarnation;
      send_stopped(a);
      return;
    }
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_START:
      if (d->incarnation <= a->incarnation) return;
      if (a->live > 0) {
        /* the coordinator moved on while the agent was away from it,
         * before it could say stop: no worker of the last incarnation
         * may live on beside the next one's */
        fprintf(stderr, "shardplane agent: incarnation %llu began while "
                "the agent was away; stopping the %u worker%s of "
                "incarnation %llu\n", (unsigned long long)d->incarnation,
                a->live, a->live == 1 ? "" : "s",
                (unsigned long long)a->incarnation);
        sp_workers_stop(a->pids, (uint32_t)a->nproc, (int)(TERM_S * 1000));
        a->live = 0;
        drain_all(a);
      }
      a->incarnation = d->incarnation;
      a->failed = 0;
      a->n_reported = 0;
      a->stopped = false;
      fprintf(stderr, "shardplane agent: incarnation %llu: starting the "
              "workers again\n", (unsigned long long)a->incarnation);
      if (start_workers(a) != PROCEED && w->ret == SP_EXIT_OK) {
        w->ret = SP_EXIT_FAILURE;
        w->term_at = sp_clock_s();
      }
      return;
    case SHARDPLANE__V1__AGENT_COMMAND__AGENT_END:
      sp_cli_error(AGENT, "the job ended: %s", d->reason);
      if (w->ret == SP_EXIT_OK) w->ret = SP_EXIT_FAILURE;
      if (w->term_at < 0 && !w->terminated) w->term_at = sp_clock_s();
      w->done = true;
      return;
    default: return;
  }
}

/* A worker that ended unasked, of `incarnation`. With restarts the
 * coordinator decides what follows (it hears of the death); without, the
 * agent stops the others itself. */
static void judge_exit(agent *a, watch *w, long long i, int st,
                       uint64_t incarnation) {
  char how[96];
  sp_workers_describe(st, how, sizeof how);
  report_exit(a, i, st, incarnation);
  if (a->n_reported < SP_WORKERS_MAX)
    a->reported[a->n_reported++] =
        (struct worker_end){.local = i, .status = st,
                           .incarnation = incarnation};
  a->failed++;
  bool supervised = a->max_restarts > 0 && sp_agent_ctl_up(a->ctl);
  bool first = w->ret == SP_EXIT_OK;
  sp_cli_error(AGENT, "rank %lld (local rank %lld on node %lld) %s%s",
               a->node_rank * a->nproc + i, i, a->node_rank, how,
               supervised ? "; the coordinator decides on a restart"
               : first    ? "; stopping the workers"
                          : "");
  if (supervised || !first) return;
  w->ret = SP_EXIT_FAILURE;
  w->term_at = sp_clock_s() + GRACE_S;
}

/* A worker ended: judged now, or held while the coordinator is away. */
static void on_exit_status(agent *a, watch *w, long long i, int st) {
  bool asked = w->interrupted && WIFEXITED(st) &&
               (WEXITSTATUS(st) == 128 + w->interrupted ||
                WEXITSTATUS(st) == 128 + SIGTERM);
  if ((WIFEXITED(st) && WEXITSTATUS(st) == 0) || w->terminated || asked ||
      w->coord_gone)
    return;
  if (sp_agent_ctl_away(a->ctl) && a->n_held < SP_WORKERS_MAX) {
    char how[96];
    sp_workers_describe(st, how, sizeof how);
    fprintf(stderr, "shardplane agent: rank %lld (local rank %lld on node "
            "%lld) %s while the coordinator is away; judged when it is "
            "back\n", a->node_rank * a->nproc + i, i, a->node_rank, how);
    a->held[a->n_held++] =
        (struct worker_end){.local = i, .status = st,
                           .incarnation = a->incarnation};
    return;
  }
  judge_exit(a, w, i, st, a->incarnation);
}

/* The exits held through an outage, once the coordinator is back (or the
 * agent goes on alone): those of an incarnation that has since ended
 * went with it. */
static void judge_held(agent *a, watch *w) {
  for (uint32_t k = 0; k < a->n_held; k++)
    if (a->held[k].incarnation == a->incarnation && !w->terminated &&
        !w->coord_gone)
      judge_exit(a, w, a->held[k].local, a->held[k].status,
                 a->held[k].incarnation);
  a->n_held = 0;
}

/* The stream ended for good (rc from sp_agent_ctl_next, msg its reason).
 * A coordinator gone past the grace, or lost without a state dir, ends
 * the job on this host with SP_EXIT_UNREACHABLE and blames no rank (the
 * workers could not reach it either); one that ended or refused the
 * stream leaves the agent supervising alone. */
static void on_ctl_end(agent *a, watch *w, int rc, const char *msg) {
  if (rc == SP_ENOENT) {
    sp_cli_error(AGENT, "%s", msg);
    judge_held(a, w);
    return;
  }
  bool busy = a->live > 0 || a->n_held > 0 || a->failed > 0 || a->stopped;
  if (!busy || w->ret != SP_EXIT_OK) {
    fprintf(stderr, "shardplane agent: %s\n", msg);
    return;
  }
  char held[96] = "";
  if (a->n_held > 0)
    snprintf(held, sizeof held, " (%u had exited meanwhile)", a->n_held);
  sp_cli_error(AGENT, "%s; stopping the %u worker%s of this host%s", msg,
               a->live, a->live == 1 ? "" : "s", held);
  a->n_held = 0;
  w->coord_gone = true;
  w->ret = SP_EXIT_UNREACHABLE;
  if (w->term_at < 0 && !w->terminated) w->term_at = sp_clock_s();
}

/* The coordinator's commands, the stream's end, and once it is back
 * after an outage the deaths reported before it (again) and those held
 * meanwhile. */
static void poll_ctl(agent *a, watch *w) {
  bool was_away = sp_agent_ctl_away(a->ctl);
  for (;;) {
    Shardplane__V1__AgentDown *d = NULL;
    sp_diag dg = {{0}};
    int got = sp_agent_ctl_next(a->ctl, 1, a->incarnation, a->stopped, &d,
                                &dg);
    if (got == 0 || got == SP_ESTATE) break;
    if (got < 0) {
      on_ctl_end(a, w, got, dg.msg);
      break;
    }
    on_command(a, w, d);
    protobuf_c_message_free_unpacked(&d->base, NULL);
  }
  if (!sp_agent_ctl_up(a->ctl)) return;
  if (was_away)
    for (uint32_t k = 0; k < a->n_reported; k++)
      report_exit(a, a->reported[k].local, a->reported[k].status,
                  a->reported[k].incarnation);
  if (a->n_held > 0) judge_held(a, w);
}

static void on_signal_seen(agent *a, watch *w, int sig) {
  if (!w->interrupted && w->ret == SP_EXIT_OK) {
    w->interrupted = sig;
    w->ret = 128 + sig;
    fprintf(stderr, "shardplane agent: interrupted (%s); passed on to the "
                    "%u worker%s (a second signal stops them at once)\n",
            strsignal(sig), a->live, a->live == 1 ? "" : "s");
    for (long long i = 0; i < a->nproc; i++)
      if (a->pids[i] > 0) kill(a->pids[i], sig);
    return;
  }
  if (w->ret == SP_EXIT_OK || w->interrupted) w->ret = 128 + sig;
  w->terminated = true;
  w->term_at = -1;
  w->kill_at = sp_clock_s();
}

static int supervise(agent *a) {
  watch w = {.ret = SP_EXIT_OK, .term_at = -1, .kill_at = -1};
  double drained_by = -1;
  size_t ns = 2 * (size_t)a->nproc;
  for (;;) {
    size_t open = sp_workers_pass_output(a->streams, ns, 20);
    /* the stream before the exits: when the coordinator goes, the agent's
     * stream ends as its workers' do, and their exits (which follow) are
     * then seen as of a coordinator away or gone */
    poll_ctl(a, &w);
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
      for (long long i = 0; i < a->nproc; i++)
        if (a->pids[i] == pid) {
          a->pids[i] = 0;
          a->live--;
          on_exit_status(a, &w, i, st);
        }
    int sig = g_signal;
    g_signal = 0;
    if (sig) on_signal_seen(a, &w, sig);
    /* with restarts, workers that failed leave the agent waiting for the
     * coordinator's word; without (or once it ended the job) it is done
     * when they are all gone. Exits held through an outage wait for the
     * coordinator too. */
    bool away = sp_agent_ctl_away(a->ctl);
    bool listening = sp_agent_ctl_up(a->ctl) || away;
    bool waiting = !w.done && !w.interrupted && w.ret == SP_EXIT_OK &&
                   a->live == 0 &&
                   ((a->max_restarts > 0 && listening &&
                     (a->failed > 0 || a->stopped)) ||
                    (away && a->n_held > 0));
    if (a->live == 0 && !waiting) {
      if (drained_by < 0) drained_by = sp_clock_s() + 1.0;
      if (open == 0 || sp_clock_s() > drained_by) break;
      continue;
    }
    double now = sp_clock_s();
    int to_send = 0;
    if (w.term_at >= 0 && now >= w.term_at) {
      to_send = SIGTERM;
      w.term_at = -1;
      w.kill_at = now + TERM_S;
      w.terminated = true;
    } else if (w.kill_at >= 0 && now >= w.kill_at) {
      to_send = SIGKILL;
      w.kill_at = -1;
    }
    for (long long i = 0; to_send && i < a->nproc; i++)
      if (a->pids[i] > 0) kill(a->pids[i], to_send);
  }
  return w.ret;
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
  if (ret == PROCEED) ret = start_proxy(&a);
  if (ret == PROCEED) ret = ctl_open(&a);
  if (ret == PROCEED) ret = alloc_streams(&a);
  if (ret != PROCEED) goto out;
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  fprintf(stderr, "shardplane agent: node %lld of %lld, ranks %lld-%lld of "
                  "%u, incarnation %llu; coordinator %s%s%s\n", a.node_rank,
          a.nnodes, a.node_rank * a.nproc,
          a.node_rank * a.nproc + a.nproc - 1, a.world,
          (unsigned long long)a.incarnation, a.r.addr,
          a.proxy ? ", proxied from " : "", a.proxy ? a.worker_coord : "");
  ret = start_workers(&a);
  if (ret == PROCEED) ret = supervise(&a);
  sp_workers_stop(a.pids, (uint32_t)a.nproc, (int)(TERM_S * 1000));
out:
  if (a.ctl) {
    uint32_t n;
    double longest;
    sp_agent_ctl_outages(a.ctl, &n, &longest);
    if (n > 0)
      fprintf(stderr, "shardplane agent: rode out %u outage%s of the "
              "coordinator (the longest %.1f s)\n", n, n == 1 ? "" : "s",
              longest);
  }
  sp_agent_ctl_close(a.ctl);
  if (a.streams) sp_workers_close_streams(a.streams, 2 * (size_t)a.nproc);
  free(a.streams);
  if (a.proxy) {
    sp_agent_proxy_stop(a.proxy);
    sp_agent_proxy_stats st;
    sp_agent_proxy_stats_get(a.proxy, &st);
    fprintf(stderr, "shardplane agent: proxied %llu calls from %llu worker "
                    "connections over its connection to %s\n",
            (unsigned long long)st.calls,
            (unsigned long long)st.local_conns, a.r.addr);
    sp_agent_proxy_free(a.proxy);
  }
  return ret;
}
