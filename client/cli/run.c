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
#include "plan/job_cli.h"
#include "base/flag.h"
#include "worker/inject.h"
#include "worker/train_flags.h"
#include "worker/worker_flags.h"
#include "worker/train_memory.h"
#include "worker/train_model.h"
#include "plan/plan.h"
#include "base/proc.h"
#include "lib/shardplane.h"
#include "run_auth.h"
#include "agent_proxy.h"
#include "run_verdict.h"
#include "supervise.h"
#include "workers.h"

extern char **environ;

#define RUN "run"
#define MAX_NPROC SP_WORKERS_MAX

static void usage(FILE *f) {
  fputs(
      "usage: shardplane run --nproc N --model M.json [--job J.json] "
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
      "  --model PATH               model spec (examples/models/gpt2*.json\n"
      "                             train a GPT-2, with the defaults they\n"
      "                             carry: blocks as units, AdamW;\n"
      "                             examples/mlp.json the reference MLP;\n"
      "                             any other spec is refused, exit 1,\n"
      "                             unless --synthetic)\n"
      "  --synthetic                run the synthetic-gradient cycle on the\n"
      "                             spec instead of training (the runtime's\n"
      "                             schedule and memory on any spec, for\n"
      "                             benchmarks)\n"
      "  --job PATH                 job config; the flags below override it\n"
      "                             (without a wrap policy every module of\n"
      "                             a type in the spec's no_split_modules\n"
      "                             becomes a unit, else every Linear)\n",
      f);
  sp_job_flags_print_help_except(f, "world-size");
  fputs(
      "  --steps N                  train up to step N in all (default 20);\n"
      "                             resumed with --load from step K, the\n"
      "                             job trains steps K+1..N\n"
      "  --global-batch N           samples per step over all ranks and\n"
      "                             micro-batches (default 24)\n"
      "  --lr X                     learning rate, the peak of a schedule\n"
      "                             (default: the spec's training.lr, else\n"
      "                             0.05)\n"
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
      "  --coordinator-grace S      workers (and run's own stream to it)\n"
      "                             ride out a\n"
      "                             coordinator outage of up to S seconds\n"
      "                             (default 60); a coordinator\n"
      "                             that dies is restarted on the same port "
      "and\n"
      "                             its state dir (DIR/coordinator-state of "
      "the\n"
      "                             checkpoint directory), and the job goes "
      "on\n"
      "  --max-restarts K           when a worker dies, restart the job up "
      "to K\n"
      "                             times as a new incarnation: every rank\n"
      "                             stopped, the store emptied, the ranks\n"
      "                             started again from the last checkpoint "
      "the\n"
      "                             job wrote in its checkpoint directory\n"
      "                             (--checkpoint-every N: at most N steps\n"
      "                             lost), else from --load or step 0\n"
      "                             (default 0: the job ends naming the "
      "rank)\n"
      "  --stop-grace S             after Ctrl-C or SIGTERM, the ranks have\n"
      "                             S seconds to reach a step boundary,\n"
      "                             checkpoint and stop (default 10); then\n"
      "                             they get more time only while the\n"
      "                             coordinator sees every one moving (a\n"
      "                             long step: none silent for longer\n"
      "                             than it is in its steps), else they\n"
      "                             are stopped without a checkpoint\n"
      "training flags, checked here and passed to every worker:\n",
      f);
  sp_train_flags_help(f, 29);
  fputs(
      "hang diagnosis:\n"
      "  --inject SPEC              passed to every worker (repeatable): a\n"
      "                             fault to inject, e.g. "
      "stall:rank=2,step=3\n"
      "                             (shardplane-worker --help)\n"
      "  --loss-grace-ms N          a rank silent past the heartbeat "
      "timeout\n"
      "                             while its process lives under a "
      "loaded host\n"
      "                             is waited for N ms more (default "
      "60000; 0:\n"
      "                             lost at the timeout)\n"
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
  fputs(
      "  --help                     this text\n"
      "\n"
      "Credentials: the coordinator listens on 127.0.0.1 in cleartext\n"
      "(--insecure) and requires tokens: run makes a worker token for its\n"
      "ranks and an admin token, under shardplane-run/auth-XXXXXX/ (mode\n"
      "0700; the coordinator's token file holds only their hashes), and\n"
      "prints where the admin token is, for shardplane status --insecure\n"
      "--token-file FILE and the other commands, and a reader token for\n"
      "the coordinator's HTTP listener on 127.0.0.1 (its address is\n"
      "printed too): the live dashboard at / and Prometheus metrics at\n"
      "/metrics (docs/observability.md). They are removed when the job\n"
      "ends.\n"
      "\n"
      "Ctrl-C (SIGINT) or SIGTERM: forwarded to every worker; the ranks stop\n"
      "after the same step, write the checkpoints and exit. Ranks that have\n"
      "not done so within --stop-grace, and that the coordinator no longer\n"
      "sees moving (a stalled rank, and those waiting on it in a\n"
      "collective), are stopped then, without a checkpoint, and the last\n"
      "line says which; a second signal stops them at once.\n"
      "\n"
      "Restarts: run says which rank died and how, and from which step\n"
      "each incarnation starts; the workers get SHARDPLANE_INCARNATION (0,\n"
      "then one more per restart), and the coordinator records each\n"
      "incarnation and what ended it (ListIncarnations).\n"
      "\n"
      "Before anything starts, run checks the job as the workers will: a\n"
      "spec they cannot train (exit 1, naming why and --synthetic), a plan\n"
      "or flags their trainer refuses (exit 2, naming the flag: a GPT-2\n"
      "needs its blocks as units, --wrap-type GPT2Block).\n"
      "\n"
      "exit codes: 0 done, 1 a bad spec or job file, or the job failed (a\n"
      "worker died or failed, with no restart left: the message names the\n"
      "culprit the coordinator's verdict gives, else the rank), 2 bad\n"
      "usage, 130 / 143 stopped by SIGINT / SIGTERM (the last line says\n"
      "whether a checkpoint was written)\n",
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
  const char *model_path, *job_path, *hb;
  double ranks_every_s; /* --ranks-every; 0: no ranks lines */
  const char *grace;    /* --coordinator-grace, or NULL */
  double stop_grace_s;  /* --stop-grace; 0: the default */
  uint64_t grace_ms;    /* the same in ms; 0: not given */
  bool cuda;
  bool synthetic; /* --synthetic: the workers' synthetic-gradient cycle */
  /* --steps, --global-batch, --lr, --log-every and the checkpoints
   * written and loaded, as every worker reads them; passed on as given */
  sp_worker_flags wf;
  sp_job_cli jcli; /* job flags, applied after --job */
  /* the training flags, checked here and passed to every worker as
   * given, in order */
  sp_train_flags train;
  struct {
    char flag[64];     /* "--name" */
    const char *value; /* into argv; NULL for a flag without one */
  } tflags[64];
  size_t n_tflags;
  /* hang diagnosis: --inject for the workers, the detectors' settings for
   * the coordinator (NULL: its defaults) */
  const char *inject[32];
  size_t n_inject;
  sp_inject faults; /* the same, parsed as every worker will */
  const char *stall_ms, *on_stall, *straggler;
  const char *loss_grace; /* --loss-grace-ms, passed on; NULL: default */
  long long max_restarts; /* --max-restarts; 0: none */
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
  char load_from[4096];    /* the folder --load names */
  char dump_dir[PATH_MAX]; /* the coordinator's --dump-dir */
  sp_ckpt_kind load_kind;  /* and the kind of its checkpoint */
  sp_run_creds creds;      /* the job's tokens (run_auth.c) */
  bool gpt2; /* the workers train a GPT-2: its FULL checkpoint samples text */
  sp_mlp_train_cfg cfg; /* the training in effect (flags over the spec's) */
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
  int http_port; /* the coordinator's metrics and dashboard */
  /* the workers' calls go through it, as under an agent (agent_proxy.h) */
  sp_agent_proxy *proxy;
  /* the workers, supervised as an agent's (and with --max-restarts
   * restarted as the coordinator decides) */
  sp_supervise sup;
  sp_supervise_ckpt_seen ckpt_seen; /* the checkpoint dir when the job began */
  double ranks_at;                  /* when the next line on the ranks is due */
  bool verdict_told; /* the coordinator's verdict on a failure was printed */
} run_procs;

#define PROCEED SP_SUPERVISE_PROCEED

/* A job flag (getopt's c >= SP_JOB_OPT_BASE), recorded for the
 * coordinator. 0, or -1 (message printed). */
static int job_flag(run_opts *o, int c, const char *value) {
  const char *name = sp_job_flags[c - SP_JOB_OPT_BASE].name;
  if (strcmp(name, "world-size") == 0) {
    sp_cli_error(RUN,
                 "--world-size \"%s\": not a flag of run, whose world "
                 "size is --nproc N",
                 value);
    return -1;
  }
  return sp_job_cli_record(&o->jcli, c, value) < 0 ? -1 : 0;
}

enum {
  O_NPROC = 1,
  O_MODEL,
  O_JOB,
  O_RANKS,
  O_HB,
  O_DEVICE,
  O_GRACE,
  O_INJECT,
  O_STALL,
  O_LOSS_GRACE,
  O_ONSTALL,
  O_STRAGGLER,
  O_RESTARTS,
  O_STOP_GRACE,
  O_SYNTH,
  O_HELP
};

/* One of run's own options with its value: 0, or SP_EINVAL with the
 * flag, the value and what is allowed in d. */
static int own_option(run_opts *o, int c, const char *flag, const char *v,
                      sp_diag *d) {
  static const char *const devices[] = {"cpu", "cuda"};
  static const char *const on_stall[] = {"alert", "abort"};
  long long n;
  double x;
  size_t k;
  int rc = 0;
  if (c >= SP_WORKER_OPT_BASE && c < SP_WORKER_OPT_END)
    return sp_worker_flag(&o->wf, c, flag, v, d);
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
    case O_RANKS:
      rc = sp_flag_number(flag, v, 0, &o->ranks_every_s, d);
      if (rc == 0 && o->ranks_every_s > 86400.0)
        rc = sp_flag_fail(d, flag, v, "seconds in [0, 86400]");
      return rc;
    case O_HB: o->hb = v; return sp_flag_int(flag, v, 1, 3600000, &n, d);
    case O_GRACE:
      o->grace = v;
      return sp_coordinator_grace_parse(flag, v, &o->grace_ms, d);
    case O_DEVICE:
      rc = sp_flag_choice(flag, v, devices, 2, &k, d);
      o->cuda = rc == 0 && k == 1;
      return rc;
    case O_SYNTH: o->synthetic = true; return 0;
    case O_INJECT:
      /* checked as the workers will, before any starts; passed as given */
      if (o->n_inject == sizeof o->inject / sizeof o->inject[0])
        return sp_flag_fail(d, flag, v, "at most 32 --inject flags");
      o->inject[o->n_inject++] = v;
      return sp_inject_parse(&o->faults, v, d);
    case O_STALL:
      o->stall_ms = v;
      return sp_flag_int(flag, v, 0, 86400000, &n, d);
    case O_LOSS_GRACE:
      o->loss_grace = v;
      return sp_flag_int(flag, v, 0, 3600000, &n, d);
    case O_ONSTALL:
      o->on_stall = v;
      return sp_flag_choice(flag, v, on_stall, 2, &k, d);
    case O_STRAGGLER:
      o->straggler = v;
      rc = sp_flag_number(flag, v, 1.0, &x, d);
      return rc;
    case O_RESTARTS: return sp_flag_int(flag, v, 0, 1000, &o->max_restarts, d);
    case O_STOP_GRACE:
      return sp_supervise_stop_grace_parse(flag, v, &o->stop_grace_s, d);
  }
  return SP_ENOENT;
}

/* Fills o from argv. Returns PROCEED, or the exit code. */
static int parse_args(int argc, char **argv, run_opts *o) {
  static const struct option own[] = {
      {"nproc", required_argument, NULL, O_NPROC},
      {"model", required_argument, NULL, O_MODEL},
      {"job", required_argument, NULL, O_JOB},
      SP_WORKER_OPTIONS_RUN_AND_SAVE,
      SP_WORKER_OPTION_LOG_EVERY,
      {"ranks-every", required_argument, NULL, O_RANKS},
      {"heartbeat-timeout-ms", required_argument, NULL, O_HB},
      {"device", required_argument, NULL, O_DEVICE},
      SP_WORKER_OPTIONS_LOAD,
      SP_WORKER_OPTION_CKPT_EVERY,
      {"coordinator-grace", required_argument, NULL, O_GRACE},
      {"inject", required_argument, NULL, O_INJECT},
      {"stall-timeout-ms", required_argument, NULL, O_STALL},
      {"loss-grace-ms", required_argument, NULL, O_LOSS_GRACE},
      {"on-stall", required_argument, NULL, O_ONSTALL},
      {"straggler-ratio", required_argument, NULL, O_STRAGGLER},
      {"max-restarts", required_argument, NULL, O_RESTARTS},
      {"stop-grace", required_argument, NULL, O_STOP_GRACE},
      {"synthetic", no_argument, NULL, O_SYNTH},
      {"help", no_argument, NULL, O_HELP}};
  /* run's own options, the training flags, then the job flags */
  struct option mine[64];
  size_t n_own = sizeof own / sizeof own[0];
  memcpy(mine, own, sizeof own);
  size_t n_train = sp_train_options(mine + n_own, 64 - n_own);
  struct option *opts = sp_job_cli_options(mine, n_own + n_train);
  if (!opts) return SP_EXIT_FAILURE;
  sp_train_flags_init(&o->train);
  sp_worker_flags_init(&o->wf, 1);
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
      sp_cli_try_help(RUN);
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
    sp_cli_try_help(RUN);
    goto out;
  }
  if (!o->model_path || o->nproc < 1) {
    sp_cli_error(
        RUN, "%s",
        !o->model_path ? "--model is required" : "--nproc is required");
    sp_cli_try_help(RUN);
    goto out;
  }
  for (size_t i = 0; i < o->faults.n; i++)
    if (o->faults.faults[i].rank >= o->nproc) {
      sp_cli_error(RUN,
                   "--inject \"%s\": rank %u is not one of the job's "
                   "%lld ranks (0 to %lld)",
                   o->inject[i], o->faults.faults[i].rank, o->nproc,
                   o->nproc - 1);
      goto out;
    }
  sp_diag fd = {{0}};
  if (sp_worker_flags_finish(&o->wf, &fd) < 0) {
    sp_cli_error(RUN, "%s", fd.msg);
    goto out;
  }
  if (o->wf.ckpt_every_arg && !o->wf.any_kind) {
    sp_cli_error(RUN,
                 "--checkpoint-every %s: nothing to write with "
                 "--checkpoint none",
                 o->wf.ckpt_every_arg);
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
    sp_flag_fail(&d, "--backend", flag,
                 "gloo: CPU ranks use gloo "
                 "(--device cuda trains over NCCL)");
  else
    sp_diag_set(&d, SP_EINVAL,
                "%s: backend %s: CPU ranks use gloo "
                "(--device cuda trains over NCCL)",
                o->job_path, sp_backend_name(j->job.backend));
  sp_cli_error(RUN, "%s", d.msg);
  return SP_EXIT_USAGE;
}

/* What the workers will train, and the job as its trainer will take it,
 * by the workers' own checks (train_model.h): a spec they cannot train
 * is a bad spec (1), a plan or flags the trainer refuses bad usage (2).
 * Returns PROCEED or the exit code. */
static int check_training(const run_opts *o, run_job *j) {
  sp_train_model tm;
  sp_diag d = {{0}};
  if (sp_train_model_pick(j->model, o->synthetic, &tm, &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_FAILURE;
  }
  j->gpt2 = tm.gpt != NULL;
  int rc = sp_train_model_check(&tm, j->plan, &o->train, o->wf.steps, o->wf.lr,
                                o->wf.lr_given, o->wf.global_batch,
                                (uint32_t)o->nproc, "--nproc", &j->cfg, &d);
  sp_train_model_clear(&tm);
  if (rc == 0) return PROCEED;
  sp_cli_error(RUN, "%s", d.msg);
  return rc == SP_ENOMEM ? SP_EXIT_FAILURE : SP_EXIT_USAGE;
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
    sp_cli_error(RUN,
                 "--device cuda: cannot count CUDA devices (the "
                 "driver's error is logged above)");
    return SP_EXIT_FAILURE;
  }
  if (j->n_gpus == 0) {
    sp_cli_error(RUN,
                 "--device cuda: no CUDA device (or this build has "
                 "no CUDA)");
    return SP_EXIT_FAILURE;
  }
  if (o->nproc > j->n_gpus) {
    sp_cli_error(RUN,
                 "--device cuda: %lld ranks but %d GPU%s; NCCL needs "
                 "one GPU per rank",
                 o->nproc, j->n_gpus, j->n_gpus == 1 ? "" : "s");
    return SP_EXIT_USAGE;
  }
  return PROCEED;
}

/* The memory model's peak of the ranks this run places here against what
 * the host has available (and, on GPUs, each rank's GPU free): a job that
 * cannot fit is refused now, with the figures and the flags that lower
 * them, not killed by the kernel minutes in. The workers check their own
 * rank again (an agent's job has no run to check it). Returns PROCEED or
 * the exit code. */
static int check_memory(const run_opts *o, run_job *j) {
  if (o->train.no_memory_check || o->synthetic) return PROCEED;
  sp_diag d = {{0}};
  /* rank r trains on GPU r (check_gpus: no more ranks than GPUs) */
  int rc = sp_train_mem_check(j->plan, &j->cfg, &o->train, (uint32_t)o->nproc,
                              "this host", 0, o->cuda ? (uint32_t)o->nproc : 0,
                              NULL, &d);
  if (rc == 0) return PROCEED;
  sp_cli_error(RUN, "%s", d.msg);
  return rc == SP_ENOMEM || rc == SP_EINVAL ? SP_EXIT_USAGE : SP_EXIT_FAILURE;
}

/* Where checkpoints go and come from. The default directory is one per
 * configuration (model, world size, plan), and no directory holding a
 * checkpoint of another plan is written to: a second run with another
 * configuration loses nothing. Returns PROCEED or the exit code. */
static int check_checkpoints(const run_opts *o, run_job *j) {
  sp_diag d = {{0}};
  /* a file there is told now, naming the flag, rather than as a state
   * dir that cannot be made once the job starts */
  struct stat sb;
  int src = o->wf.ckpt_dir ? stat(o->wf.ckpt_dir, &sb) : -1;
  if (o->wf.ckpt_dir &&
      ((src == 0 && !S_ISDIR(sb.st_mode)) || (src != 0 && errno == ENOTDIR))) {
    sp_flag_fail(&d, "--checkpoint-dir", o->wf.ckpt_dir, "a directory: %s",
                 src == 0 ? "it is a file" : "a part of its path is a file");
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_USAGE;
  }
  if (o->wf.load_dir &&
      sp_ckpt_resolve(o->wf.load_dir, o->wf.load_kind, j->load_from,
                      sizeof j->load_from, &j->load_kind, &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_USAGE;
  }
  j->ckdir = o->wf.ckpt_dir;
  if (!j->ckdir) {
    snprintf(j->default_dir, sizeof j->default_dir,
             "shardplane-run/%s-w%lld-%.8s",
             j->model->name && *j->model->name ? j->model->name : "model",
             o->nproc, j->plan->version_hex);
    j->ckdir = j->default_dir;
  }
  if (o->wf.any_kind &&
      sp_ckpt_check_dir(j->ckdir, j->plan->version_hex, &d) < 0) {
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
  if (ec == PROCEED) ec = check_memory(o, j);
  if (ec != PROCEED) return ec;
  if (bin_path("shardplane-coordinator", j->coord_bin, sizeof j->coord_bin) <
          0 ||
      bin_path("shardplane-worker", j->worker_bin, sizeof j->worker_bin) < 0) {
    sp_cli_error(RUN,
                 "shardplane-coordinator and shardplane-worker must be "
                 "installed beside this program");
    return SP_EXIT_FAILURE;
  }
  return check_checkpoints(o, j);
}

/* Starts the coordinator on a free loopback port; p->addr is its
 * address. Returns PROCEED or the exit code. */
static int start_coordinator(const run_opts *o, const run_job *j,
                             run_procs *p) {
  char nproc_s[16], listen[32], http[32];
  snprintf(nproc_s, sizeof nproc_s, "%lld", o->nproc);
  /* a restart takes the port the workers know */
  snprintf(listen, sizeof listen, "127.0.0.1:%d",
           p->restarts ? p->coord.port : 0);
  snprintf(http, sizeof http, "127.0.0.1:%d", p->restarts ? p->http_port : 0);
  argvec ca = {0};
  push(&ca, j->coord_bin);
  push(&ca, "--listen");
  push(&ca, listen);
  push(&ca, "--http-listen");
  push(&ca, http);
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
  if (o->loss_grace) {
    push(&ca, "--loss-grace-ms");
    push(&ca, o->loss_grace);
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
  const char *h = strstr(p->coord.line, ", http on 127.0.0.1:");
  if (h == NULL || sscanf(h, ", http on 127.0.0.1:%d", &p->http_port) != 1) {
    sp_cli_error(RUN, "the coordinator did not report its HTTP port: %s",
                 p->coord.line);
    return SP_EXIT_FAILURE;
  }
  return PROCEED;
}

/* What the workers of an incarnation load: --load, or after a restart
 * the last checkpoint the job wrote. */
typedef struct run_load {
  const char *dir; /* NULL: nothing */
  sp_ckpt_kind kind;
  bool params_only;
  char buf[4096];
} run_load;

/* The command line of rank r's worker into wa; rank_s and device_s (24
 * bytes each) hold strings it points to, and so does ld. */
static void worker_args(const run_opts *o, const run_job *j, const run_procs *p,
                        const run_load *ld, long long r, argvec *wa,
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
  push(wa, o->wf.steps_arg);
  push(wa, "--global-batch");
  push(wa, o->wf.batch_arg);
  /* only as given: without it each worker takes the spec's training.lr,
   * else the default, as the check above did */
  if (o->wf.lr_given) {
    push(wa, "--lr");
    push(wa, o->wf.lr_arg);
  }
  push(wa, "--log-every");
  push(wa, o->wf.log_every_arg);
  for (size_t i = 0; i < o->n_inject; i++) {
    push(wa, "--inject");
    push(wa, o->inject[i]);
  }
  if (o->grace) {
    push(wa, "--coordinator-grace");
    push(wa, o->grace);
  }
  if (o->synthetic) push(wa, "--synthetic");
  for (size_t i = 0; i < o->n_tflags; i++) {
    push(wa, o->tflags[i].flag);
    if (o->tflags[i].value) push(wa, o->tflags[i].value);
  }
  if (o->cuda) {
    snprintf(device_s, 24, "cuda:%lld", r % j->n_gpus);
    push(wa, "--device");
    push(wa, device_s);
  }
  if (!o->wf.any_kind) {
    push(wa, "--checkpoint");
    push(wa, "none");
  } else {
    push(wa, "--checkpoint-dir");
    push(wa, j->ckdir);
  }
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++)
    if (o->wf.kinds[k]) {
      push(wa, "--checkpoint");
      push(wa, sp_ckpt_kind_dir((sp_ckpt_kind)k));
    }
  if (o->wf.ckpt_every_arg) {
    push(wa, "--checkpoint-every");
    push(wa, o->wf.ckpt_every_arg);
  }
  if (ld->dir) {
    push(wa, "--load");
    push(wa, ld->dir);
    push(wa, "--load-kind");
    push(wa, sp_ckpt_kind_dir(ld->kind));
    if (ld->params_only) push(wa, "--load-params-only");
  }
}

/* Incarnation 0 loads --load; a restart the last checkpoint the job wrote
 * in its checkpoint directory, else what incarnation 0 loaded (--load, or
 * nothing: step 0). */
static void what_to_load(const run_opts *o, const run_job *j, run_procs *p,
                         run_load *ld) {
  *ld = (run_load){0};
  if (p->sup.incarnation > 0 && o->wf.any_kind &&
      sp_supervise_restart_ckpt(&p->sup, j->ckdir, &p->ckpt_seen,
                                o->wf.load_dir ? j->load_from : NULL, ld->buf,
                                sizeof ld->buf, &ld->kind)) {
    ld->dir = ld->buf;
    return;
  }
  if (p->sup.incarnation > 0 && !o->wf.any_kind)
    sp_cli_error(RUN,
                 "incarnation %llu starts from %s: no checkpoints "
                 "(--checkpoint none)",
                 (unsigned long long)p->sup.incarnation,
                 o->wf.load_dir ? j->load_from : "step 0");
  if (o->wf.load_dir) {
    ld->dir = j->load_from;
    ld->kind = j->load_kind;
    ld->params_only = o->wf.load_params_only;
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

/* Starts the N workers of the current incarnation (sp_supervise_ops.start).
 * Returns PROCEED or the exit code (s->pids holds the ones started). */
static int start_workers(sp_supervise *s) {
  run_procs *p = s->user;
  const run_opts *o = p->o;
  run_load ld;
  what_to_load(o, p->j, p, &ld);
  /* as an agent's workers: which start of the job they are */
  char inc[24];
  snprintf(inc, sizeof inc, "%llu", (unsigned long long)s->incarnation);
  setenv("SHARDPLANE_INCARNATION", inc, 1);
  snprintf(inc, sizeof inc, "%u", s->restarts_done);
  setenv(SP_RESTART_ENV, inc, 1);
  for (long long r = 0; r < o->nproc; r++) {
    char rank_s[24], device_s[24];
    argvec wa = {0};
    worker_args(o, p->j, p, &ld, r, &wa, rank_s, device_s);
    s->pids[r] = sp_workers_spawn(wa.v, NULL, &s->streams[2 * r],
                                  &s->streams[2 * r + 1]);
    if (s->pids[r] < 0) {
      s->pids[r] = 0;
      sp_cli_error(RUN, "cannot start rank %lld: %s", r, strerror(errno));
      return SP_EXIT_FAILURE;
    }
    s->live++;
  }
  return PROCEED;
}

/* How long a failing run waits for the coordinator's verdict. */
#define VERDICT_MS 2000

/* A failure that stops the job (sp_supervise_ops.failure): the first one
 * names the culprit the coordinator gives, which saw every rank (a victim
 * of a stall exits like its culprit); later ones (other ranks failing
 * before they are stopped) are named too. */
static void tell_failure(sp_supervise *s, const char *msg, bool first) {
  run_procs *p = s->user;
  char verdict[512];
  if (first && p->coord.pid > 0 &&
      sp_run_verdict(p->addr, p->j->creds.admin_token, VERDICT_MS, verdict,
                     sizeof verdict)) {
    p->verdict_told = true;
    sp_cli_error(RUN, "%s (%s); stopping the job", verdict, msg);
  } else {
    sp_cli_error(RUN, "%s%s", msg, first ? "; stopping the job" : "");
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

/* "--checkpoint-dir DIR", or how the default one is chosen: what a
 * failure in the checkpoint directory names, so that the user knows which
 * path to change. */
static void ckdir_words(const run_procs *p, char *buf, size_t cap) {
  if (p->o->wf.ckpt_dir)
    snprintf(buf, cap, "--checkpoint-dir %s", p->j->ckdir);
  else
    snprintf(buf, cap,
             "the checkpoint directory %s (--checkpoint-dir "
             "chooses another)",
             p->j->ckdir);
}

/* DIR/coordinator-state of the checkpoint directory, emptied: each run is
 * a new job, whose store must not hold the last one's rendezvous keys.
 * Left alone while another coordinator holds it (that one then refuses
 * to start, naming it). Returns PROCEED or the exit code. */
static int prepare_state_dir(const run_job *j, run_procs *p) {
  int n = snprintf(p->state_dir, sizeof p->state_dir, "%s/coordinator-state",
                   j->ckdir);
  char in[PATH_MAX + 64];
  ckdir_words(p, in, sizeof in);
  if (n <= 0 || (size_t)n >= sizeof p->state_dir || make_dirs(p->state_dir)) {
    sp_cli_error(RUN,
                 "cannot create the coordinator's state dir %s in "
                 "%s: %s",
                 p->state_dir, in, strerror(errno));
    return SP_EXIT_FAILURE;
  }
  char path[PATH_MAX + 32];
  snprintf(path, sizeof path, "%s/coordinator.lock", p->state_dir);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    sp_cli_error(RUN, "cannot open %s in %s: %s", path, in, strerror(errno));
    return SP_EXIT_FAILURE;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
    static const char *const files[] = {"coordinator.db", "coordinator.db-wal",
                                        "coordinator.db-shm"};
    for (size_t i = 0; i < 3; i++) {
      snprintf(path, sizeof path, "%s/%s", p->state_dir, files[i]);
      if (unlink(path) != 0 && errno != ENOENT) {
        sp_cli_error(RUN, "cannot remove %s in %s: %s", path, in,
                     strerror(errno));
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
static int prepare_dump_dir(run_job *j, const run_procs *p) {
  int n = snprintf(j->dump_dir, sizeof j->dump_dir, "%s/dumps", j->ckdir);
  if (n <= 0 || (size_t)n >= sizeof j->dump_dir || make_dirs(j->dump_dir)) {
    int e = errno;
    char in[PATH_MAX + 64];
    ckdir_words(p, in, sizeof in);
    sp_cli_error(RUN, "cannot create the dump dir %s in %s: %s", j->dump_dir,
                 in, strerror(e));
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
  fprintf(stderr,
          "shardplane run: the coordinator %s; restarted it on %s "
          "with state dir %s (restart %d); the job goes on\n",
          how, p->addr, p->state_dir, p->restarts);
  return true;
}

/* run's stream to the coordinator (AgentSession), as an agent's for a
 * host of N ranks, through the proxy with the workers' token: the
 * coordinator's alerts come over it the moment they open, and with
 * --max-restarts its decisions on a death. Returns PROCEED or the exit
 * code. */
static int open_session(run_procs *p) {
  sp_cred cred = {.insecure = true, .token_file = p->j->creds.worker_token};
  sp_diag d = {{0}};
  if (sp_cred_finish(&cred, &d) != 0) {
    sp_cli_error(RUN, "%s", d.msg);
    return SP_EXIT_FAILURE;
  }
  sp_rpc_client_opts co = {.connect_timeout_ms = 20000};
  sp_cred_client_opts(&cred, &co);
  return sp_supervise_open_session(&p->sup, sp_agent_proxy_address(p->proxy),
                                   &co, p->addr, 0, 20000);
}

/* A child that is not a worker ended: the coordinator
 * (sp_supervise_ops.reaped). */
static void reaped(sp_supervise *s, pid_t pid, int st) {
  run_procs *p = s->user;
  if (pid != p->coord.pid) return;
  char how[96];
  sp_workers_describe(st, how, sizeof how);
  p->coord.pid = 0;
  /* the stream rides the outage out as an agent's
   * does and registers again: the new coordinator knows the job's
   * incarnations from the state dir */
  if (s->ret == SP_EXIT_OK && !s->interrupted && s->live > 0 &&
      restart_coordinator(p, how))
    return;
  sp_supervise_fail(s, "the coordinator %s", how);
}

/* rank r as messages name it (sp_supervise_ops.name). */
static void name_rank(const sp_supervise *s, uint32_t i, char *out,
                      size_t cap) {
  snprintf(out, cap, "rank %u", s->first_rank + i);
}

/* Where the ranks are, in a line like the workers' ("[ranks]: ..."), every
 * --ranks-every seconds while they train (sp_supervise_ops.tick). The call
 * blocks the output passing for its length, a millisecond or so on
 * loopback; a coordinator that does not answer within 500 ms is skipped
 * (its own restart, or a failure, is reported elsewhere). */
static void tell_ranks(sp_supervise *s) {
  run_procs *p = s->user;
  if (p->o->ranks_every_s <= 0 || sp_clock_s() < p->ranks_at || s->live == 0 ||
      s->terminated || s->failing)
    return;
  char line[512];
  if (sp_run_ranks_line(p->addr, p->j->creds.admin_token, 500, line,
                        sizeof line))
    sp_workers_print_line(stdout, "ranks", line, strlen(line));
  p->ranks_at = sp_clock_s() + p->o->ranks_every_s;
}

static const sp_supervise_ops k_ops = {.start = start_workers,
                                       .name = name_rank,
                                       .failure = tell_failure,
                                       .reaped = reaped,
                                       .tick = tell_ranks};

/* The last lines: where the checkpoints are, and the flags that start a
 * job from each (shardplane run or shardplane-worker). After a stop by a
 * signal the same when the ranks wrote them; when they did not (a rank
 * stopped past --stop-grace, or before its first step), one line says so,
 * and why. Only checkpoints this run wrote count: the directory may hold
 * an earlier run's. Returns the exit code. */
static int report_done(const run_opts *o, const run_job *j, const run_procs *p,
                       double took_s, int ret) {
  int sig = ret > 128 ? ret - 128 : 0;
  char how[96];
  if (sig)
    snprintf(how, sizeof how, "stopped by %s after %.1f s",
             sig == SIGINT ? "SIGINT" : "SIGTERM", took_s);
  else
    snprintf(how, sizeof how, "done after %.1f s", took_s);
  if (!o->wf.any_kind) {
    printf("shardplane run: %s; no checkpoint (--checkpoint none)\n", how);
    return ret;
  }
  sp_ckpt_found f;
  sp_ckpt_find(j->ckdir, &f);
  int n = 0, written = 0, last = SP_CKPT_FULL;
  bool fresh[4] = {false};
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    if (!o->wf.kinds[k]) continue;
    n++;
    fresh[k] = sp_supervise_ckpt_new(&p->ckpt_seen, &f, (sp_ckpt_kind)k);
    if (fresh[k]) {
      written++;
      last = k;
    }
  }
  if (sig && written == 0) {
    if (p->sup.overdue[0])
      printf(
          "shardplane run: %s without a checkpoint: %s had not reached a "
          "step boundary within --stop-grace\n",
          how, p->sup.overdue);
    else
      printf(
          "shardplane run: %s without a checkpoint: the ranks stopped "
          "before their first step ended\n",
          how);
    return ret;
  }
  printf("shardplane run: %s at step %llu; checkpoint in %s\n", how,
         (unsigned long long)f.steps[last], j->ckdir);
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    if (!o->wf.kinds[k]) continue;
    const char *name = sp_ckpt_kind_name((sp_ckpt_kind)k);
    if (!fresh[k]) {
      sp_cli_error(RUN, "no %s checkpoint written in %s", name, j->ckdir);
      return sig ? ret : SP_EXIT_FAILURE;
    }
    char which[32] = "it";
    if (n > 1) snprintf(which, sizeof which, "the %s one", name);
    printf("shardplane run: %s from %s with --load %s --load-kind %s\n",
           sig ? "continue" : "start", which, f.dir[k],
           sp_ckpt_kind_dir((sp_ckpt_kind)k));
  }
  /* as ./dev run samples its checkpoint */
  if (j->gpt2 && o->wf.kinds[SP_CKPT_FULL])
    printf(
        "shardplane run: sample text from it with shardplane-worker "
        "--generate --load %s --model %s --prompt \"The \" --tokens 300\n",
        f.dir[SP_CKPT_FULL], o->model_path);
  return ret;
}

int sp_cmd_run(int argc, char **argv) {
  run_opts o = {0};
  run_job j = {0};
  run_procs p = {0};
  sp_job_init(&j.job);
  int ret = parse_args(argc, argv, &o);
  if (ret == PROCEED) ret = check_job(&o, &j);
  if (ret != PROCEED) goto out;

  sp_supervise_catch_signals();
  signal(SIGPIPE, SIG_IGN); /* the proxy's sockets say EPIPE instead */

  if (sp_run_creds_make("shardplane-run", &j.creds) != 0) {
    ret = SP_EXIT_FAILURE;
    goto out;
  }
  p.o = &o;
  p.j = &j;
  p.sup = (sp_supervise){
      .who = RUN,
      .on_signal =
          ", which checkpoint after the current step "
          "and stop",
      .ops = &k_ops,
      .user = &p,
      .n = (uint32_t)o.nproc,
      .max_restarts = (uint32_t)o.max_restarts,
      .stop_grace_s = o.stop_grace_s,
      .grace_ms = o.grace_ms ? o.grace_ms : SP_COORDINATOR_GRACE_DEFAULT_MS};
  /* a restart loads only a checkpoint this job wrote */
  sp_supervise_ckpt_note(j.ckdir, &p.ckpt_seen);
  ret = prepare_state_dir(&j, &p);
  if (ret == PROCEED) ret = prepare_dump_dir(&j, &p);
  if (ret == PROCEED) ret = start_coordinator(&o, &j, &p);
  if (ret != PROCEED) goto out;
  printf(
      "shardplane run: %s, %lld ranks, %s, plan %s (%zu units); "
      "coordinator on %s\n",
      j.model->name, o.nproc, sp_strategy_name(j.plan->strategy),
      j.plan->version_hex, j.plan->n_units, p.addr);
  printf(
      "shardplane run: admin token in %s (shardplane status "
      "--coordinator %s --insecure --token-file %s)\n",
      j.creds.admin_token, p.addr, j.creds.admin_token);
  printf(
      "shardplane run: dashboard http://127.0.0.1:%d/ and Prometheus "
      "metrics http://127.0.0.1:%d/metrics (reader token in %s)\n",
      p.http_port, p.http_port, j.creds.reader_token);
  fflush(stdout);
  double t0 = sp_clock_s();
  p.ranks_at = t0 + o.ranks_every_s;
  ret = start_proxy(&p);
  if (ret == PROCEED) ret = open_session(&p);
  if (ret == PROCEED) ret = sp_supervise_alloc_streams(&p.sup);
  if (ret == PROCEED) ret = start_workers(&p.sup);
  if (ret == PROCEED) ret = sp_supervise_run(&p.sup);
  sp_supervise_stop(&p.sup);
  sp_supervise_close_session(&p.sup);
  sp_agent_proxy_free(p.proxy);
  sp_workers_close_streams(p.sup.streams, 2 * (size_t)o.nproc);
  free(p.sup.streams);
  char verdict[512];
  /* the verdict may have come after the first failure was reported (a
   * lost rank is noticed when its stream breaks) */
  if (ret == SP_EXIT_FAILURE && !p.verdict_told && p.coord.pid > 0 &&
      sp_run_verdict(p.addr, j.creds.admin_token, VERDICT_MS, verdict,
                     sizeof verdict))
    sp_cli_error(RUN, "the coordinator's verdict: %s", verdict);
  if (p.coord.pid > 0) sp_proc_stop(&p.coord, 5000);
  if (ret == SP_EXIT_OK || ret == 128 + SIGINT || ret == 128 + SIGTERM)
    ret = report_done(&o, &j, &p, sp_clock_s() - t0, ret);
out:
  sp_run_creds_remove(&j.creds);
  sp_plan_free(j.plan);
  sp_model_free(j.model);
  sp_job_clear(&j.job);
  sp_job_cli_free(&o.jcli);
  return ret;
}
