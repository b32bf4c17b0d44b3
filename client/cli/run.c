/* `shardplane run`: a whole job on this machine. Starts a coordinator on a
 * free loopback port and N workers, passes every rank's output through
 * (each line prefixed with the time and the rank), and stops everything
 * cleanly when the job ends, when a worker dies (naming the rank) or on
 * Ctrl-C / SIGTERM, which it forwards to every worker: they agree on a
 * step, checkpoint there and stop (a second signal stops them at once).
 * The coordinator keeps its state in the run directory (--state-dir); if
 * it dies, run starts it again on the same port and state dir, and the
 * workers, riding out the outage, carry on. */
#include <sys/file.h>
#include <sys/stat.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "cast/cast_cuda.h"
#include "cli.h"
#include "fsdp/job_cli.h"
#include "base/flag.h"
#include "worker/mlp.h"
#include "worker/train_flags.h"
#include "fsdp/plan.h"
#include "base/proc.h"
#include "lib/shardplane.h"
#include "run_auth.h"
#include "agent_proxy.h"
#include "run_verdict.h"
#include "workers.h"

extern char **environ;

#define RUN "run"
#define MAX_NPROC SP_WORKERS_MAX

static volatile sig_atomic_t g_signal;

static void on_signal(int sig) { g_signal = sig; }

static void usage(FILE *f) {
  fputs("usage: shardplane run --nproc N --model M.json [--job J.json] "
        "[options]\n"
        "\n"
        "Runs a whole job on this machine: a coordinator on a free loopback\n"
        "port and N CPU workers (shardplane-worker) training the model with\n"
        "sharded parameters over Gloo. Every line a worker writes is shown\n"
        "prefixed with the time and its rank (\"[rank1]: \"); rank 0 prints\n"
        "progress. At the end a checkpoint is written, and its place and\n"
        "the flags that load it are printed.\n"
        "\n"
        "  --nproc N                  ranks (the job's world size)\n"
        "  --model PATH               model spec (examples/models/gpt2-*.json\n"
        "                             train a GPT-2, with --wrap-type\n"
        "                             GPT2Block; examples/mlp.json the\n"
        "                             reference MLP; other specs run the\n"
        "                             synthetic-gradient cycle)\n"
        "  --job PATH                 job config; the flags below override it\n"
        "                             (without a wrap policy every Linear "
        "module\n"
        "                             becomes a unit)\n",
        f);
  sp_job_flags_print_help_except(f, "world-size");
  fputs("  --steps N                  train up to step N in all (default 20);\n"
        "                             resumed with --load from step K, the\n"
        "                             job trains steps K+1..N\n"
        "  --global-batch N           samples per step over all ranks and\n"
        "                             micro-batches (default 24)\n"
        "  --lr X                     learning rate, the peak of a schedule\n"
        "                             (default 0.05)\n"
        "  --checkpoint-dir DIR       where to write (default\n"
        "                             shardplane-run/<model>-w<N>-<plan>, one\n"
        "                             per configuration); a directory holding\n"
        "                             a checkpoint of another plan is refused\n"
        "  --checkpoint KIND          full, sharded, local or none; "
        "repeatable\n"
        "                             (default full)\n"
        "  --checkpoint-every N       also after every N-th step; the last\n"
        "                             one is kept until the new one is\n"
        "                             complete\n"
        "  --load DIR                 start from a checkpoint: DIR as printed\n"
        "                             at the end of a run, or its folder; the\n"
        "                             job continues after its step\n"
        "  --load-kind KIND           full, sharded or local, when DIR holds\n"
        "                             several\n"
        "  --load-params-only         only its parameters and buffers: the\n"
        "                             optimizer's state and schedule start\n"
        "                             afresh (another optimizer than the\n"
        "                             checkpoint's)\n"
        "  --log-every N              progress every N steps (default 1)\n"
        "  --ranks-every S            every S seconds a line saying where the\n"
        "                             ranks are, from the coordinator (\"step\n"
        "                             311: 3 in FORWARD, 1 in BACKWARD_PRE\");\n"
        "                             0: never (default 10)\n"
        "  --device cpu|cuda          where ranks train (default cpu); cuda:\n"
        "                             rank r on GPU r % (GPUs present), over\n"
        "                             NCCL; one GPU per rank\n"
        "  --heartbeat-timeout-ms N   a silent rank is lost after N ms "
        "(default 5000)\n"
        "  --coordinator-grace S      workers ride out a coordinator outage "
        "of up\n"
        "                             to S seconds (default 60); a "
        "coordinator\n"
        "                             that dies is restarted on the same port "
        "and\n"
        "                             its state dir (DIR/coordinator-state of "
        "the\n"
        "                             checkpoint directory), and the job goes "
        "on\n"
        "training flags, checked here and passed to every worker:\n",
        f);
  sp_train_flags_help(f, 29);
  fputs("hang diagnosis:\n"
        "  --inject SPEC              passed to every worker (repeatable): a\n"
        "                             fault to inject, e.g. "
        "stall:rank=2,step=3\n"
        "                             (shardplane-worker --help)\n"
        "  --stall-timeout-ms N       the coordinator calls a job stalled "
        "when\n"
        "                             no rank moves for N ms (default: "
        "adaptive)\n"
        "  --on-stall alert|abort     and then alerts, or aborts the job\n"
        "  --straggler-ratio X        a rank whose steps take X times the\n"
        "                             job's median is a straggler\n"
        "The coordinator writes its dumps (on a stall or an abort) to\n"
        "DIR/dumps of the checkpoint directory: shardplane analyze FILE\n"
        "reads them. When the job fails, run asks the coordinator for its\n"
        "verdict before stopping it and names the culprit it gives.\n",
        f);
  fputs("  --help                     this text\n"
        "\n"
        "Credentials: the coordinator listens on 127.0.0.1 in cleartext\n"
        "(--insecure) and requires tokens: run makes a worker token for its\n"
        "ranks and an admin token, under shardplane-run/auth-XXXXXX/ (mode\n"
        "0700; the coordinator's token file holds only their hashes), and\n"
        "prints where the admin token is, for shardplane status --insecure\n"
        "--token-file FILE and the other commands. They are removed when the\n"
        "job ends.\n"
        "\n"
        "Ctrl-C (SIGINT) or SIGTERM: forwarded to every worker; the ranks stop\n"
        "after the same step, write the checkpoints and exit; a second signal\n"
        "stops them at once, without a checkpoint.\n"
        "\n"
        "exit codes: 0 done, 1 the job failed (a worker died or failed: the\n"
        "message names the culprit the coordinator's verdict gives, else the\n"
        "rank), 2 bad usage, 130 / 143 stopped by SIGINT /\n"
        "SIGTERM (after the checkpoint)\n",
        f);
}

/* The directory of this executable: the other programs live beside it. */
static int bin_path(const char *name, char *out, size_t cap) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return -1;
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  if (!slash) return -1;
  *slash = '\0';
  int w = snprintf(out, cap, "%s/%s", self, name);
  return w > 0 && (size_t)w < cap && access(out, X_OK) == 0 ? 0 : -1;
}

typedef struct argvec {
  char *v[256];
  size_t n;
} argvec;

static void push(argvec *a, const char *s) {
  if (a->n + 1 < sizeof a->v / sizeof a->v[0]) a->v[a->n++] = (char *)s;
  a->v[a->n] = NULL;
}

/* What the command line asked for. */
typedef struct run_opts {
  long long nproc;
  const char *model_path, *job_path, *ckdir;
  const char *steps, *batch, *lr, *log_every, *hb;
  double ranks_every_s; /* --ranks-every; 0: no ranks lines */
  const char *grace; /* --coordinator-grace, or NULL */
  const char *ckpt_every; /* --checkpoint-every, or NULL */
  bool cuda;
  bool kinds[4]; /* by sp_ckpt_kind: the checkpoints written */
  bool no_checkpoint; /* --checkpoint none given */
  bool any_kind;      /* after parse_args: kinds[] holds one at least */
  const char *load_dir; /* --load */
  sp_ckpt_kind load_kind; /* --load-kind; 0: the only kind there */
  bool load_params_only;  /* --load-params-only */
  sp_job_cli jcli; /* job flags, applied after --job */
  /* the training flags, checked here and passed to every worker as
   * given, in order */
  sp_train_flags train;
  struct {
    char flag[64]; /* "--name" */
    const char *value; /* into argv; NULL for a flag without one */
  } tflags[64];
  size_t n_tflags;
  /* hang diagnosis: --inject for the workers, the detectors' settings for
   * the coordinator (NULL: its defaults) */
  const char *inject[32];
  size_t n_inject;
  const char *stall_ms, *on_stall, *straggler;
} run_opts;

/* What was checked before anything starts. */
typedef struct run_job {
  sp_model *model;
  sp_plan *plan;
  sp_job job;
  int n_gpus;
  char coord_bin[PATH_MAX], worker_bin[PATH_MAX];
  char default_dir[PATH_MAX];
  const char *ckdir;
  char load_from[4096]; /* the folder --load names */
  char dump_dir[PATH_MAX]; /* the coordinator's --dump-dir */
  sp_ckpt_kind load_kind; /* and the kind of its checkpoint */
  sp_run_creds creds; /* the job's tokens (run_auth.c) */
} run_job;

/* The running processes. */
typedef struct run_procs {
  sp_proc coord;
  /* what a restart of the coordinator needs */
  const run_opts *o;
  const run_job *j;
  char state_dir[PATH_MAX];
  int restarts;
  char addr[64];
  /* the workers' calls go through it, as under an agent (agent_proxy.h) */
  sp_agent_proxy *proxy;
  pid_t pids[MAX_NPROC];
  uint32_t live;
  sp_out_stream *streams; /* rank r's stdout at 2r, its stderr at 2r + 1 */
  size_t n_streams;
  bool verdict_told; /* the coordinator's verdict on a failure was printed */
} run_procs;

#define PROCEED (-1)

/* A job flag (getopt's c >= SP_JOB_OPT_BASE), recorded for the
 * coordinator. 0, or -1 (message printed). */
static int job_flag(run_opts *o, int c, const char *value) {
  const char *name = sp_job_flags[c - SP_JOB_OPT_BASE].name;
  if (strcmp(name, "world-size") == 0) {
    sp_cli_error(RUN, "--world-size \"%s\": not a flag of run, whose world "
                 "size is --nproc N", value);
    return -1;
  }
  return sp_job_cli_record(&o->jcli, c, value) < 0 ? -1 : 0;
}

enum { O_NPROC = 1, O_MODEL, O_JOB, O_STEPS, O_BATCH, O_LR, O_CKDIR, O_CK,
       O_LOG, O_RANKS, O_HB, O_DEVICE, O_LOAD, O_LOADK, O_LOADP, O_CKEVERY, O_GRACE,
       O_INJECT, O_STALL, O_ONSTALL, O_STRAGGLER, O_HELP };

/* One of run's own options with its value: 0, or SP_EINVAL with the
 * flag, the value and what is allowed in d. */
static int own_option(run_opts *o, int c, const char *flag, const char *v,
                      sp_diag *d) {
  static const char *const kinds[] = {"none", "full", "sharded", "local"};
  static const char *const devices[] = {"cpu", "cuda"};
  static const char *const on_stall[] = {"alert", "abort"};
  long long n;
  double x;
  size_t k;
  int rc = 0;
  if (c >= SP_TRAIN_OPT_BASE) {
    rc = sp_train_flag(&o->train, c, v, d);
    if (rc == 0 && o->n_tflags < sizeof o->tflags / sizeof o->tflags[0]) {
      snprintf(o->tflags[o->n_tflags].flag, sizeof o->tflags[0].flag, "%s",
               flag);
      o->tflags[o->n_tflags++].value = sp_train_flag_has_arg(c) ? v : NULL;
    } else if (rc == 0) {
      rc = sp_flag_fail(d, flag, v, "at most 64 training flags");
    }
    return rc;
  }
  switch (c) {
    case O_NPROC: return sp_flag_int(flag, v, 1, MAX_NPROC, &o->nproc, d);
    case O_MODEL:
      o->model_path = v;
      return sp_flag_text(flag, v, "a model spec (JSON file)", d);
    case O_JOB:
      o->job_path = v;
      return sp_flag_text(flag, v, "a job config (JSON file)", d);
    case O_STEPS:
      o->steps = v;
      return sp_flag_int(flag, v, 1, 1000000000, &n, d);
    case O_BATCH:
      o->batch = v;
      return sp_flag_int(flag, v, 1, 1 << 20, &n, d);
    case O_LOG:
      o->log_every = v;
      return sp_flag_int(flag, v, 0, 1000000000, &n, d);
    case O_RANKS:
      rc = sp_flag_number(flag, v, 0, &o->ranks_every_s, d);
      if (rc == 0 && o->ranks_every_s > 86400.0)
        rc = sp_flag_fail(d, flag, v, "seconds in [0, 86400]");
      return rc;
    case O_HB:
      o->hb = v;
      return sp_flag_int(flag, v, 1, 3600000, &n, d);
    case O_GRACE: {
      uint64_t ms;
      o->grace = v;
      return sp_coordinator_grace_parse(flag, v, &ms, d);
    }
    case O_LR:
      o->lr = v;
      return sp_flag_number(flag, v, 0, &x, d);
    case O_DEVICE:
      rc = sp_flag_choice(flag, v, devices, 2, &k, d);
      o->cuda = rc == 0 && k == 1;
      return rc;
    case O_CKDIR:
      o->ckdir = v;
      return sp_flag_text(flag, v, "a directory", d);
    case O_CK:
      rc = sp_flag_choice(flag, v, kinds, 4, &k, d);
      if (rc == 0 && k == 0) o->no_checkpoint = true;
      if (rc == 0 && k > 0) o->kinds[k] = true;
      return rc;
    case O_LOAD:
      o->load_dir = v;
      return sp_flag_text(flag, v, "a checkpoint directory", d);
    case O_LOADK:
      rc = sp_flag_choice(flag, v, kinds + 1, 3, &k, d);
      if (rc == 0) o->load_kind = (sp_ckpt_kind)(k + 1);
      return rc;
    case O_LOADP: o->load_params_only = true; return 0;
    case O_CKEVERY:
      o->ckpt_every = v;
      return sp_flag_int(flag, v, 1, 1000000000, &n, d);
    case O_INJECT:
      /* the worker checks the spec itself: run passes it as given */
      if (o->n_inject == sizeof o->inject / sizeof o->inject[0])
        return sp_flag_fail(d, flag, v, "at most 32 --inject flags");
      o->inject[o->n_inject++] = v;
      return sp_flag_text(flag, v, "a fault to inject (KIND:KEY=VALUE,...)",
                          d);
    case O_STALL:
      o->stall_ms = v;
      return sp_flag_int(flag, v, 0, 86400000, &n, d);
    case O_ONSTALL:
      o->on_stall = v;
      return sp_flag_choice(flag, v, on_stall, 2, &k, d);
    case O_STRAGGLER:
      o->straggler = v;
      rc = sp_flag_number(flag, v, 1.0, &x, d);
      return rc;
  }
  return SP_ENOENT;
}

/* Fills o from argv. Returns PROCEED, or the exit code. */
static int parse_args(int argc, char **argv, run_opts *o) {
  static const struct option own[] = {
      {"nproc", required_argument, NULL, O_NPROC},
      {"model", required_argument, NULL, O_MODEL},
      {"job", required_argument, NULL, O_JOB},
      {"steps", required_argument, NULL, O_STEPS},
      {"global-batch", required_argument, NULL, O_BATCH},
      {"lr", required_argument, NULL, O_LR},
      {"checkpoint-dir", required_argument, NULL, O_CKDIR},
      {"checkpoint", required_argument, NULL, O_CK},
      {"log-every", required_argument, NULL, O_LOG},
      {"ranks-every", required_argument, NULL, O_RANKS},
      {"heartbeat-timeout-ms", required_argument, NULL, O_HB},
      {"device", required_argument, NULL, O_DEVICE},
      {"load", required_argument, NULL, O_LOAD},
      {"load-kind", required_argument, NULL, O_LOADK},
      {"load-params-only", no_argument, NULL, O_LOADP},
      {"checkpoint-every", required_argument, NULL, O_CKEVERY},
      {"coordinator-grace", required_argument, NULL, O_GRACE},
      {"inject", required_argument, NULL, O_INJECT},
      {"stall-timeout-ms", required_argument, NULL, O_STALL},
      {"on-stall", required_argument, NULL, O_ONSTALL},
      {"straggler-ratio", required_argument, NULL, O_STRAGGLER},
      {"help", no_argument, NULL, O_HELP}};
  /* run's own options, the training flags, then the job flags */
  struct option mine[64];
  size_t n_own = sizeof own / sizeof own[0];
  memcpy(mine, own, sizeof own);
  size_t n_train = sp_train_options(mine + n_own, 64 - n_own);
  struct option *opts = sp_job_cli_options(mine, n_own + n_train);
  if (!opts) return SP_EXIT_FAILURE;
  sp_train_flags_init(&o->train);
  o->steps = "20";
  o->batch = "24";
  o->lr = "0.05";
  o->log_every = "1";
  o->ranks_every_s = 10;
  o->hb = "5000";
  int ret = SP_EXIT_USAGE, c, index = -1;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, &index)) != -1) {
    if (c == O_HELP) {
      usage(stdout);
      ret = SP_EXIT_OK;
      goto out;
    }
    if (c >= SP_JOB_OPT_BASE && c < SP_TRAIN_OPT_BASE) {
      if (job_flag(o, c, optarg) < 0) goto out;
      continue;
    }
    if (c == '?' || index < 0) { /* getopt said what */
      usage(stderr);
      goto out;
    }
    char flag[64];
    snprintf(flag, sizeof flag, "--%s", opts[index].name);
    sp_diag d = {{0}};
    if (own_option(o, c, flag, optarg, &d) < 0) {
      sp_cli_error(RUN, "%s", d.msg);
      goto out;
    }
    index = -1;
  }
  if (optind < argc) {
    sp_cli_error(RUN, "unexpected argument \"%s\"", argv[optind]);
    usage(stderr);
    goto out;
  }
  if (!o->model_path || o->nproc < 1) {
    sp_cli_error(RUN, "%s", !o->model_path ? "--model is required"
                                           : "--nproc is required");
    usage(stderr);
    goto out;
  }
  if ((o->load_kind || o->load_params_only) && !o->load_dir) {
    sp_cli_error(RUN, "%s needs --load DIR",
                 o->load_kind ? "--load-kind" : "--load-params-only");
    goto out;
  }
  /* as the worker: FULL unless --checkpoint says otherwise */
  if (!o->no_checkpoint && !o->kinds[SP_CKPT_SHARDED] &&
      !o->kinds[SP_CKPT_LOCAL])
    o->kinds[SP_CKPT_FULL] = true;
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++)
    o->any_kind |= o->kinds[k];
  if (o->ckpt_every && !o->any_kind) {
    sp_cli_error(RUN, "--checkpoint-every %s: nothing to write with "
                 "--checkpoint none", o->ckpt_every);
    goto out;
  }
  ret = PROCEED;
out:
  free(opts);
  return ret;
}

/* CPU ranks talk over Gloo (--device cuda makes the job NCCL's). Returns
 * PROCEED or the exit code. */
static int check_backend(const run_opts *o, const run_job *j) {
  if (o->cuda || j->job.backend == SP_BACKEND_GLOO) return PROCEED;
  const char *flag = NULL;
  for (size_t i = 0; i < o->jcli.n; i++)
    if (strcmp(sp_job_flags[o->jcli.items[i].flag].name, "backend") == 0)
      flag = o->jcli.items[i].value;
  sp_diag d = {{0}};
  if (flag)
    sp_flag_fail(&d, "--backend", flag, "gloo: CPU ranks use gloo "
                 "(--device cuda trains over NCCL)");
  else
    sp_diag_set(&d, SP_EINVAL, "%s: backend %s: CPU ranks use gloo "
                "(--device cuda trains over NCCL)", o->job_path,
                sp_backend_name(j->job.backend));
  sp_cli_error(RUN, "%s", d.msg);
  return SP_EXIT_USAGE;
}

/* The training flags together, as every worker will check them: the
 * reference MLP splits each micro-batch evenly over the ranks (the
 * synthetic cycle has no batch). Returns PROCEED or the exit code. */
static int check_training(const run_opts *o, const run_job *j) {
  sp_mlp *mlp = NULL;
  sp_diag d = {{0}};
  bool is_mlp = sp_mlp_new(j->model, &mlp, &d) == 0;
  sp_mlp_free(mlp);
  sp_mlp_train_cfg cfg;
  if (sp_train_flags_finish(&o->train, (uint32_t)atoll(o->steps),
                            strtod(o->lr, NULL),
                            is_mlp ? (uint32_t)atoll(o->batch) : 0,
                            (uint32_t)o->nproc, "--nproc", &cfg, &d) == 0)
    return PROCEED;
  sp_cli_error(RUN, "%s", d.msg);
  return SP_EXIT_USAGE;
}

/* The spec, the job and its plan. Returns PROCEED or the exit code. */
static int build_plan(run_opts *o, run_job *j) {
  sp_diag d = {{0}};
  if (sp_model_load_file(o->model_path, &j->model, &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_FAILURE;
  }
  int rc = sp_job_cli_apply(&o->jcli, o->job_path, &j->job, &d);
  if (rc == 0) rc = sp_job_cli_check_model(&o->jcli, j->model, &d);
  if (rc < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return rc == SP_EINVAL ? SP_EXIT_USAGE : SP_EXIT_FAILURE;
  }
  j->job.world_size = (uint32_t)o->nproc;
  if ((rc = check_backend(o, j)) != PROCEED) return rc;
  /* the coordinator applies the same default to the same job */
  if (sp_job_default_wrap(&j->job, j->model, NULL) < 0) {
    sp_cli_error(RUN, "out of memory");
    return SP_EXIT_FAILURE;
  }
  if (sp_plan_build(j->model, &j->job, &j->plan, &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_USAGE;
  }
  return check_training(o, j);
}

/* One GPU per rank, rank r on GPU r % count: NCCL refuses two ranks of
 * one communicator on the same GPU, so more ranks than GPUs is refused
 * here rather than by every worker after the rendezvous. Returns PROCEED
 * or the exit code. */
static int check_gpus(const run_opts *o, run_job *j) {
  if (sp_cuda_device_count(&j->n_gpus) < 0) {
    sp_cli_error(RUN, "--device cuda: cannot count CUDA devices (the "
                      "driver's error is logged above)");
    return SP_EXIT_FAILURE;
  }
  if (j->n_gpus == 0) {
    sp_cli_error(RUN, "--device cuda: no CUDA device (or this build has "
                      "no CUDA)");
    return SP_EXIT_FAILURE;
  }
  if (o->nproc > j->n_gpus) {
    sp_cli_error(RUN, "--device cuda: %lld ranks but %d GPU%s; NCCL needs "
                      "one GPU per rank", o->nproc, j->n_gpus,
                 j->n_gpus == 1 ? "" : "s");
    return SP_EXIT_USAGE;
  }
  return PROCEED;
}

/* Where checkpoints go and come from. The default directory is one per
 * configuration (model, world size, plan), and no directory holding a
 * checkpoint of another plan is written to: a second run with another
 * configuration loses nothing. Returns PROCEED or the exit code. */
static int check_checkpoints(const run_opts *o, run_job *j) {
  sp_diag d = {{0}};
  if (o->load_dir &&
      sp_ckpt_resolve(o->load_dir, o->load_kind, j->load_from,
                      sizeof j->load_from, &j->load_kind, &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_USAGE;
  }
  j->ckdir = o->ckdir;
  if (!j->ckdir) {
    snprintf(j->default_dir, sizeof j->default_dir,
             "shardplane-run/%s-w%lld-%.8s",
             j->model->name && *j->model->name ? j->model->name : "model",
             o->nproc, j->plan->version_hex);
    j->ckdir = j->default_dir;
  }
  if (o->any_kind && sp_ckpt_check_dir(j->ckdir, j->plan->version_hex,
                                       &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_USAGE;
  }
  return PROCEED;
}

/* Everything checked before a process starts: a bad spec or job is a
 * message, not N workers failing at once. Returns PROCEED or the exit
 * code. */
static int check_job(run_opts *o, run_job *j) {
  int ec = build_plan(o, j);
  if (ec == PROCEED && o->cuda) ec = check_gpus(o, j);
  if (ec != PROCEED) return ec;
  if (bin_path("shardplane-coordinator", j->coord_bin,
               sizeof j->coord_bin) < 0 ||
      bin_path("shardplane-worker", j->worker_bin, sizeof j->worker_bin) < 0) {
    sp_cli_error(RUN, "shardplane-coordinator and shardplane-worker must be "
                      "installed beside this program");
    return SP_EXIT_FAILURE;
  }
  return check_checkpoints(o, j);
}

/* Starts the coordinator on a free loopback port; p->addr is its
 * address. Returns PROCEED or the exit code. */
static int start_coordinator(const run_opts *o, const run_job *j,
                             run_procs *p) {
  char nproc_s[16], listen[32];
  snprintf(nproc_s, sizeof nproc_s, "%lld", o->nproc);
  /* a restart takes the port the workers know */
  snprintf(listen, sizeof listen, "127.0.0.1:%d", p->restarts ? p->coord.port : 0);
  argvec ca = {0};
  push(&ca, j->coord_bin);
  push(&ca, "--listen");
  push(&ca, listen);
  push(&ca, "--state-dir");
  push(&ca, p->state_dir);
  push(&ca, "--model");
  push(&ca, o->model_path);
  if (o->job_path) {
    push(&ca, "--job");
    push(&ca, o->job_path);
  }
  char flagbuf[64][64];
  for (size_t i = 0; i < o->jcli.n && i < 64; i++) {
    const sp_job_flag_def *def = &sp_job_flags[o->jcli.items[i].flag];
    snprintf(flagbuf[i], sizeof flagbuf[i], "--%s", def->name);
    push(&ca, flagbuf[i]);
    if (def->has_arg) push(&ca, o->jcli.items[i].value);
  }
  push(&ca, "--world-size");
  push(&ca, nproc_s);
  if (o->cuda) {
    /* what the ranks use (the worker forces NCCL on a GPU); flags given
     * earlier are overridden by this last one */
    push(&ca, "--backend");
    push(&ca, "nccl");
  }
  push(&ca, "--heartbeat-timeout-ms");
  push(&ca, o->hb);
  push(&ca, "--dump-dir");
  push(&ca, j->dump_dir);
  if (o->stall_ms) {
    push(&ca, "--stall-timeout-ms");
    push(&ca, o->stall_ms);
  }
  if (o->on_stall) {
    push(&ca, "--on-stall");
    push(&ca, o->on_stall);
  }
  if (o->straggler) {
    push(&ca, "--straggler-ratio");
    push(&ca, o->straggler);
  }
  /* loopback only, so cleartext; tokens still keep other users of this
   * machine out of the job */
  push(&ca, "--insecure");
  push(&ca, "--token-file");
  push(&ca, j->creds.token_file);
  push(&ca, "--quiet");
  sp_diag d = {{0}};
  if (sp_proc_spawn(&p->coord, ca.v, false, true, "listening on 127.0.0.1:%d",
                    &d) < 0) {
    sp_cli_error(RUN, "cannot start the coordinator: %s", d.msg);
    return SP_EXIT_FAILURE;
  }
  snprintf(p->addr, sizeof p->addr, "127.0.0.1:%d", p->coord.port);
  return PROCEED;
}

/* The command line of rank r's worker into wa; rank_s and device_s (24
 * bytes each) hold strings it points to. */
static void worker_args(const run_opts *o, const run_job *j,
                        const run_procs *p, long long r, argvec *wa,
                        char *rank_s, char *device_s) {
  snprintf(rank_s, 24, "%lld", r);
  push(wa, j->worker_bin);
  push(wa, "--coordinator");
  push(wa, sp_agent_proxy_address(p->proxy));
  push(wa, "--insecure");
  push(wa, "--token-file");
  push(wa, j->creds.worker_token);
  push(wa, "--rank");
  push(wa, rank_s);
  push(wa, "--steps");
  push(wa, o->steps);
  push(wa, "--global-batch");
  push(wa, o->batch);
  push(wa, "--lr");
  push(wa, o->lr);
  push(wa, "--log-every");
  push(wa, o->log_every);
  for (size_t i = 0; i < o->n_inject; i++) {
    push(wa, "--inject");
    push(wa, o->inject[i]);
  }
  if (o->grace) {
    push(wa, "--coordinator-grace");
    push(wa, o->grace);
  }
  for (size_t i = 0; i < o->n_tflags; i++) {
    push(wa, o->tflags[i].flag);
    if (o->tflags[i].value) push(wa, o->tflags[i].value);
  }
  if (o->cuda) {
    snprintf(device_s, 24, "cuda:%lld", r % j->n_gpus);
    push(wa, "--device");
    push(wa, device_s);
  }
  if (!o->any_kind) {
    push(wa, "--checkpoint");
    push(wa, "none");
  } else {
    push(wa, "--checkpoint-dir");
    push(wa, j->ckdir);
  }
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++)
    if (o->kinds[k]) {
      push(wa, "--checkpoint");
      push(wa, sp_ckpt_kind_dir((sp_ckpt_kind)k));
    }
  if (o->ckpt_every) {
    push(wa, "--checkpoint-every");
    push(wa, o->ckpt_every);
  }
  if (o->load_dir) {
    push(wa, "--load");
    push(wa, j->load_from);
    push(wa, "--load-kind");
    push(wa, sp_ckpt_kind_dir(j->load_kind));
    if (o->load_params_only) push(wa, "--load-params-only");
  }
}

/* This host's agent, in-process: the workers reach the coordinator over
 * its one connection. Returns PROCEED or the exit code. */
static int start_proxy(run_procs *p) {
  sp_diag d = {{0}};
  /* each call carries its worker's token; the connection is loopback */
  sp_rpc_client_opts co = {.connect_timeout_ms = 20000};
  if (sp_agent_proxy_start(p->addr, &co, &p->proxy, &d) != 0) {
    sp_cli_error(RUN, "cannot start the workers' proxy: %s", d.msg);
    return SP_EXIT_FAILURE;
  }
  /* the workers' coordinator is a socket now, so it no longer shows the
   * interface Gloo binds: on one host, loopback (a value set stays) */
  setenv(SP_GLOO_HOST_ENV, "127.0.0.1", 0);
  return PROCEED;
}

/* Starts the N workers. Returns PROCEED or the exit code (p->pids holds
 * the ones started). */
static int start_workers(const run_opts *o, const run_job *j,
                         run_procs *p) {
  p->streams = calloc(2 * (size_t)o->nproc, sizeof *p->streams);
  if (!p->streams) {
    sp_cli_error(RUN, "out of memory");
    return SP_EXIT_FAILURE;
  }
  p->n_streams = 2 * (size_t)o->nproc;
  for (size_t i = 0; i < p->n_streams; i++)
    p->streams[i] = (sp_out_stream){.fd = -1, .rank = (int)(i / 2),
                                 .to = i % 2 ? stderr : stdout};
  for (long long r = 0; r < o->nproc; r++) {
    char rank_s[24], device_s[24];
    argvec wa = {0};
    worker_args(o, j, p, r, &wa, rank_s, device_s);
    p->pids[r] = sp_workers_spawn(wa.v, NULL, &p->streams[2 * r],
                              &p->streams[2 * r + 1]);
    if (p->pids[r] < 0) {
      p->pids[r] = 0;
      sp_cli_error(RUN, "cannot start rank %lld: %s", r, strerror(errno));
      return SP_EXIT_FAILURE;
    }
    p->live++;
  }
  return PROCEED;
}

/* After a failure, the other ranks get this long to stop by themselves
 * (the coordinator aborts them at once) and to say why, before SIGTERM;
 * SIGKILL follows SIGTERM after TERM_S. */
#define GRACE_S 0.5
#define TERM_S 3.0
/* How long a failing run waits for the coordinator's verdict. */
#define VERDICT_MS 2000

/* Where supervise stands. */
typedef struct run_watch {
  int ret;          /* the exit code so far */
  double term_at;   /* when to SIGTERM the workers left; < 0: not yet due */
  double kill_at;   /* when to SIGKILL them; < 0: not yet due */
  bool terminated;  /* SIGTERM sent: the ends that follow are ours */
  int interrupted;  /* the signal that arrived and was forwarded, or 0 */
  run_procs *p;     /* whose coordinator to ask for the verdict */
} run_watch;

/* A failure: the first one names what happened and stops the job; later
 * ones (other ranks failing before they are stopped) are named too. */
static void failed(run_watch *w, double grace_s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void failed(run_watch *w, double grace_s, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  bool first = w->ret == SP_EXIT_OK;
  char verdict[512];
  /* a victim of a stall exits like its culprit: the coordinator, which
   * saw every rank, names the one at fault */
  if (first && w->p != NULL && w->p->coord.pid > 0 &&
      sp_run_verdict(w->p->addr, w->p->j->creds.admin_token, VERDICT_MS,
                     verdict, sizeof verdict)) {
    w->p->verdict_told = true;
    sp_cli_error(RUN, "%s (%s); stopping the job", verdict, msg);
  } else {
    sp_cli_error(RUN, "%s%s", msg, first ? "; stopping the job" : "");
  }
  if (first) {
    w->ret = SP_EXIT_FAILURE;
    w->term_at = sp_clock_s() + grace_s;
  }
}

/* ---- the coordinator's state dir and its restarts ---- */

/* Restarts in one run at most: a coordinator that keeps dying has a
 * cause a restart will not cure. */
#define MAX_COORD_RESTARTS 10

/* mkdir -p; 0 or -1 (errno set). */
static int make_dirs(const char *dir) {
  char path[PATH_MAX];
  int n = snprintf(path, sizeof path, "%s", dir);
  if (n <= 0 || (size_t)n >= sizeof path) {
    errno = ENAMETOOLONG;
    return -1;
  }
  for (char *q = path + 1; *q; q++) {
    if (*q != '/') continue;
    *q = '\0';
    if (mkdir(path, 0777) != 0 && errno != EEXIST) return -1;
    *q = '/';
  }
  return mkdir(path, 0777) != 0 && errno != EEXIST ? -1 : 0;
}

/* DIR/coordinator-state of the checkpoint directory, emptied: each run is
 * a new job, whose store must not hold the last one's rendezvous keys.
 * Left alone while another coordinator holds it (that one then refuses
 * to start, naming it). Returns PROCEED or the exit code. */
static int prepare_state_dir(const run_job *j, run_procs *p) {
  int n = snprintf(p->state_dir, sizeof p->state_dir, "%s/coordinator-state",
                   j->ckdir);
  if (n <= 0 || (size_t)n >= sizeof p->state_dir || make_dirs(p->state_dir)) {
    sp_cli_error(RUN, "cannot create the coordinator's state dir %s: %s",
                 p->state_dir, strerror(errno));
    return SP_EXIT_FAILURE;
  }
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/coordinator.lock", p->state_dir);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    sp_cli_error(RUN, "cannot open %s: %s", path, strerror(errno));
    return SP_EXIT_FAILURE;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
    static const char *const files[] = {"coordinator.db", "coordinator.db-wal",
                                        "coordinator.db-shm"};
    for (size_t i = 0; i < 3; i++) {
      snprintf(path, sizeof path, "%s/%s", p->state_dir, files[i]);
      if (unlink(path) != 0 && errno != ENOENT) {
        sp_cli_error(RUN, "cannot remove %s: %s", path, strerror(errno));
        close(fd);
        return SP_EXIT_FAILURE;
      }
    }
  }
  close(fd); /* and the lock with it */
  return PROCEED;
}

/* DIR/dumps of the checkpoint directory, for the coordinator's dumps
 * (kept across runs: each file is named by its time). Returns PROCEED or
 * the exit code. */
static int prepare_dump_dir(run_job *j) {
  int n = snprintf(j->dump_dir, sizeof j->dump_dir, "%s/dumps", j->ckdir);
  if (n <= 0 || (size_t)n >= sizeof j->dump_dir || make_dirs(j->dump_dir)) {
    sp_cli_error(RUN, "cannot create the dump dir %s: %s", j->dump_dir,
                 strerror(errno));
    return SP_EXIT_FAILURE;
  }
  return PROCEED;
}

/* The coordinator died mid-job: start it again on its port and state dir.
 * Returns whether it runs again (the job goes on). */
static bool restart_coordinator(run_procs *p, const char *how) {
  if (p->restarts >= MAX_COORD_RESTARTS) {
    sp_cli_error(RUN, "the coordinator %s, after %d restarts", how,
                 p->restarts);
    return false;
  }
  p->restarts++;
  int port = p->coord.port;
  if (start_coordinator(p->o, p->j, p) != PROCEED) return false;
  if (p->coord.port != port) { /* cannot happen: it listens on port */
    sp_cli_error(RUN, "the restarted coordinator listens on %d, not %d",
                 p->coord.port, port);
    return false;
  }
  fprintf(stderr, "shardplane run: the coordinator %s; restarted it on %s "
                  "with state dir %s (restart %d); the job goes on\n",
          how, p->addr, p->state_dir, p->restarts);
  return true;
}

/* Reaps every child that ended: the coordinator or a worker. */
static void reap(const run_opts *o, run_procs *p, run_watch *w) {
  int st;
  pid_t pid;
  while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
    char how[96];
    sp_workers_describe(st, how, sizeof how);
    if (pid == p->coord.pid) {
      p->coord.pid = 0;
      if (w->ret == SP_EXIT_OK && !w->interrupted && p->live > 0 &&
          restart_coordinator(p, how))
        continue;
      failed(w, GRACE_S, "the coordinator %s", how);
      continue;
    }
    for (long long r = 0; r < o->nproc; r++) {
      if (p->pids[r] != pid) continue;
      p->pids[r] = 0;
      p->live--;
      /* after a forwarded signal a rank ends 128 + it, or 143 when it
       * stopped for another rank's */
      bool asked = w->interrupted && WIFEXITED(st) &&
                   (WEXITSTATUS(st) == 128 + w->interrupted ||
                    WEXITSTATUS(st) == 128 + SIGTERM);
      if ((!WIFEXITED(st) || WEXITSTATUS(st) != 0) && !w->terminated &&
          !asked)
        failed(w, GRACE_S, "rank %lld %s", r, how);
    }
  }
}

/* Signals to the workers left, when due. */
static void stop_when_due(run_procs *p, run_watch *w, long long n) {
  double now = sp_clock_s();
  int sig = 0;
  if (w->term_at >= 0 && now >= w->term_at) {
    sig = SIGTERM;
    w->term_at = -1;
    w->kill_at = now + TERM_S;
    w->terminated = true;
  } else if (w->kill_at >= 0 && now >= w->kill_at) {
    sig = SIGKILL;
    w->kill_at = -1;
  }
  for (long long r = 0; sig && r < n; r++)
    if (p->pids[r] > 0) kill(p->pids[r], sig);
}

/* Passes the workers' output on until every worker is done, one fails or
 * dies (naming the rank; the others are given GRACE_S to stop and say
 * why), the coordinator dies, or a signal arrives. Returns the exit
 * code. */
/* Where the ranks are, in a line like the workers' ("[ranks]: ..."). The
 * call blocks the output passing for its length, a millisecond or so on
 * loopback; a coordinator that does not answer within 500 ms is skipped
 * (its own restart, or a failure, is reported elsewhere). */
static void tell_ranks(const run_procs *p) {
  char line[512];
  if (!sp_run_ranks_line(p->addr, p->j->creds.admin_token, 500, line,
                         sizeof line))
    return;
  sp_workers_print_line(stdout, "ranks", line, strlen(line));
}

static int supervise(const run_opts *o, run_procs *p) {
  run_watch w = {.ret = SP_EXIT_OK, .term_at = -1, .kill_at = -1, .p = p};
  double drained_by = -1; /* every worker gone: the pipes' last words */
  double ranks_at = sp_clock_s() + o->ranks_every_s;
  for (;;) {
    size_t open = sp_workers_pass_output(p->streams, p->n_streams, 20);
    reap(o, p, &w);
    if (o->ranks_every_s > 0 && sp_clock_s() >= ranks_at && p->live > 0 &&
        !w.terminated && w.ret == SP_EXIT_OK) {
      tell_ranks(p);
      ranks_at = sp_clock_s() + o->ranks_every_s;
    }
    int sig = g_signal;
    g_signal = 0;
    if (sig && !w.interrupted && w.ret == SP_EXIT_OK) {
      /* the workers agree on a step, checkpoint there and stop */
      w.interrupted = sig;
      w.ret = 128 + sig;
      fprintf(stderr, "shardplane run: interrupted (%s); the %u worker%s "
                      "checkpoint after the current step and stop (a "
                      "second signal stops them at once)\n", strsignal(sig),
              p->live, p->live == 1 ? "" : "s");
      for (long long r = 0; r < o->nproc; r++)
        if (p->pids[r] > 0) kill(p->pids[r], sig);
    } else if (sig) {
      /* again, or while stopping after a failure: at once */
      fprintf(stderr, "shardplane run: interrupted; stopping %u worker%s "
                      "and the coordinator now\n", p->live,
              p->live == 1 ? "" : "s");
      if (w.ret == SP_EXIT_OK || w.interrupted) w.ret = 128 + sig;
      w.terminated = true;
      w.term_at = -1;
      w.kill_at = sp_clock_s();
    }
    if (p->live == 0) {
      if (drained_by < 0) drained_by = sp_clock_s() + 1.0;
      if (open == 0 || sp_clock_s() > drained_by) break;
      continue;
    }
    stop_when_due(p, &w, o->nproc);
  }
  sp_workers_close_streams(p->streams, p->n_streams);
  return w.ret;
}

/* The last lines: where the checkpoints are, and the flags that start a
 * job from each (shardplane run or shardplane-worker). After a stop by a
 * signal the same, as far as the checkpoints were written. Returns the
 * exit code. */
static int report_done(const run_opts *o, const run_job *j, double took_s,
                       int stopped) {
  const char *how = stopped ? "stopped" : "done";
  if (!o->any_kind) {
    printf("shardplane run: %s after %.1f s; no checkpoint (--checkpoint "
           "none)\n", how, took_s);
    return stopped;
  }
  printf("shardplane run: %s after %.1f s; checkpoint in %s\n", how, took_s,
         j->ckdir);
  sp_ckpt_found f;
  sp_ckpt_find(j->ckdir, &f);
  int n = 0;
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) n += o->kinds[k];
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    if (!o->kinds[k]) continue;
    const char *name = sp_ckpt_kind_name((sp_ckpt_kind)k);
    if (!f.present[k]) {
      /* a stop before the first step writes none */
      sp_cli_error(RUN, "no %s checkpoint in %s", name, j->ckdir);
      return stopped ? stopped : SP_EXIT_FAILURE;
    }
    char which[32] = "it";
    if (n > 1) snprintf(which, sizeof which, "the %s one", name);
    printf("shardplane run: %s from %s with --load %s --load-kind %s\n",
           stopped ? "continue" : "start", which, f.dir[k],
           sp_ckpt_kind_dir((sp_ckpt_kind)k));
  }
  return stopped;
}

int sp_cmd_run(int argc, char **argv) {
  run_opts o = {0};
  run_job j = {0};
  run_procs p = {0};
  sp_job_init(&j.job);
  int ret = parse_args(argc, argv, &o);
  if (ret == PROCEED) ret = check_job(&o, &j);
  if (ret != PROCEED) goto out;

  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN); /* the proxy's sockets say EPIPE instead */

  if (sp_run_creds_make("shardplane-run", &j.creds) != 0) {
    ret = SP_EXIT_FAILURE;
    goto out;
  }
  p.o = &o;
  p.j = &j;
  ret = prepare_state_dir(&j, &p);
  if (ret == PROCEED) ret = prepare_dump_dir(&j);
  if (ret == PROCEED) ret = start_coordinator(&o, &j, &p);
  if (ret != PROCEED) goto out;
  printf("shardplane run: %s, %lld ranks, %s, plan %s (%zu units); "
         "coordinator on %s\n", j.model->name, o.nproc,
         sp_strategy_name(j.plan->strategy), j.plan->version_hex,
         j.plan->n_units, p.addr);
  printf("shardplane run: admin token in %s (shardplane status "
         "--coordinator %s --insecure --token-file %s)\n",
         j.creds.admin_token, p.addr, j.creds.admin_token);
  fflush(stdout);
  double t0 = sp_clock_s();
  ret = start_proxy(&p);
  if (ret == PROCEED) ret = start_workers(&o, &j, &p);
  if (ret == PROCEED) ret = supervise(&o, &p);
  sp_workers_stop(p.pids, (uint32_t)o.nproc, 3000);
  sp_agent_proxy_free(p.proxy);
  sp_workers_close_streams(p.streams, p.n_streams);
  free(p.streams);
  char verdict[512];
  /* the verdict may have come after the first failure was reported (a
   * lost rank is noticed when its stream breaks) */
  if (ret == SP_EXIT_FAILURE && !p.verdict_told && p.coord.pid > 0 &&
      sp_run_verdict(p.addr, j.creds.admin_token, VERDICT_MS, verdict,
                     sizeof verdict))
    sp_cli_error(RUN, "the coordinator's verdict: %s", verdict);
  if (p.coord.pid > 0) sp_proc_stop(&p.coord, 5000);
  if (ret == SP_EXIT_OK || ret == 128 + SIGINT || ret == 128 + SIGTERM)
    ret = report_done(&o, &j, sp_clock_s() - t0, ret);
out:
  sp_run_creds_remove(&j.creds);
  sp_plan_free(j.plan);
  sp_model_free(j.model);
  sp_job_clear(&j.job);
  sp_job_cli_free(&o.jcli);
  return ret;
}
