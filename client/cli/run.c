/* `shardplane run`: a whole job on this machine. Starts a coordinator on a
 * free loopback port and N workers, passes rank 0's progress through, and
 * stops everything cleanly when the job ends, when a worker dies (naming
 * the rank) or on Ctrl-C. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
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
#include "fsdp/plan.h"
#include "base/proc.h"
#include "lib/shardplane.h"

extern char **environ;

#define RUN "run"
#define MAX_NPROC 256

static volatile sig_atomic_t g_signal;

static void on_signal(int sig) { g_signal = sig; }

static void usage(FILE *f) {
  fputs("usage: shardplane run --nproc N --model M.json [--job J.json] "
        "[options]\n"
        "\n"
        "Runs a whole job on this machine: a coordinator on a free loopback\n"
        "port and N CPU workers (shardplane-worker) training the model with\n"
        "sharded parameters over Gloo. Rank 0 prints progress; at the end a\n"
        "checkpoint is written and its place printed.\n"
        "\n"
        "  --nproc N                  ranks (the job's world size)\n"
        "  --model PATH               model spec (examples/mlp.json trains the\n"
        "                             reference MLP; other specs run the\n"
        "                             synthetic-gradient cycle)\n"
        "  --job PATH                 job config; the flags below override it\n"
        "                             (without a wrap policy every Linear "
        "module\n"
        "                             becomes a unit)\n",
        f);
  sp_job_flags_print_help(f);
  fputs("  --steps N                  training steps (default 20)\n"
        "  --global-batch N           samples per step (default 24)\n"
        "  --lr X                     learning rate (default 0.05)\n"
        "  --checkpoint-dir DIR       where to write (default\n"
        "                             shardplane-run/<model>-w<N>)\n"
        "  --checkpoint KIND          full, sharded, local or none; "
        "repeatable\n"
        "                             (default full)\n"
        "  --log-every N              progress every N steps (default 1)\n"
        "  --device cpu|cuda          where ranks train (default cpu); cuda:\n"
        "                             rank r on GPU r % (GPUs present), over\n"
        "                             NCCL; one GPU per rank\n"
        "  --heartbeat-timeout-ms N   a silent rank is lost after N ms "
        "(default 5000)\n"
        "  --help                     this text\n"
        "\n"
        "exit codes: 0 done, 1 the job failed (a worker died or failed: the\n"
        "message names the rank), 2 bad usage, 130 interrupted\n",
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

static pid_t spawn_worker(char *const argv[]) {
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  /* own process group: Ctrl-C reaches `run`, which stops the workers in
   * order instead of every process dying at once */
  posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&at, 0);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], NULL, &at, argv, environ);
  posix_spawnattr_destroy(&at);
  return rc == 0 ? pid : -1;
}

static void describe(int st, char *out, size_t cap) {
  if (WIFSIGNALED(st))
    snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(st),
             strsignal(WTERMSIG(st)));
  else
    snprintf(out, cap, "exited with status %d", WEXITSTATUS(st));
}

/* SIGTERM to every live worker, then SIGKILL after wait_ms. */
static void stop_workers(pid_t *pids, uint32_t n, int wait_ms) {
  for (uint32_t r = 0; r < n; r++)
    if (pids[r] > 0) kill(pids[r], SIGTERM);
  double end = sp_clock_s() + wait_ms / 1000.0;
  for (;;) {
    bool live = false;
    for (uint32_t r = 0; r < n; r++) {
      if (pids[r] <= 0) continue;
      if (waitpid(pids[r], NULL, WNOHANG) == pids[r])
        pids[r] = 0;
      else
        live = true;
    }
    if (!live) return;
    if (sp_clock_s() > end) break;
    usleep(10000);
  }
  for (uint32_t r = 0; r < n; r++)
    if (pids[r] > 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], NULL, 0);
      pids[r] = 0;
    }
}

int sp_cmd_run(int argc, char **argv) {
  enum { O_NPROC = 1, O_MODEL, O_JOB, O_STEPS, O_BATCH, O_LR, O_CKDIR, O_CK,
         O_LOG, O_HB, O_DEVICE, O_HELP };
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
      {"heartbeat-timeout-ms", required_argument, NULL, O_HB},
      {"device", required_argument, NULL, O_DEVICE},
      {"help", no_argument, NULL, O_HELP}};
  struct option *opts = sp_job_cli_options(own, sizeof own / sizeof own[0]);
  if (!opts) return SP_EXIT_FAILURE;
  sp_job_cli jcli = {0};
  const char *model_path = NULL, *job_path = NULL, *ckdir = NULL;
  const char *steps = "20", *batch = "24", *lr = "0.05", *log_every = "1";
  const char *hb = "5000";
  bool cuda = false;
  const char *kinds[8];
  size_t n_kinds = 0;
  long long nproc = 0, tmp;
  bool wrap_given = false;
  int ret = SP_EXIT_USAGE, c;
  sp_model *model = NULL;
  sp_plan *plan = NULL;
  sp_job job;
  sp_job_init(&job);
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
      case O_NPROC:
        if (sp_cli_parse_uint(optarg, MAX_NPROC, &nproc) < 0 || nproc < 1) {
          sp_cli_error(RUN, "--nproc: expected 1..%d, got \"%s\"", MAX_NPROC,
                       optarg);
          goto out;
        }
        break;
      case O_MODEL: model_path = optarg; break;
      case O_JOB: job_path = optarg; break;
      case O_STEPS:
      case O_BATCH:
      case O_LOG:
      case O_HB:
        if (sp_cli_parse_uint(optarg, 1ll << 31, &tmp) < 0) {
          sp_cli_error(RUN, "%s: expected a count, got \"%s\"",
                       argv[optind - 1], optarg);
          goto out;
        }
        if (c == O_STEPS) steps = optarg;
        if (c == O_BATCH) batch = optarg;
        if (c == O_LOG) log_every = optarg;
        if (c == O_HB) hb = optarg;
        break;
      case O_LR: lr = optarg; break;
      case O_DEVICE:
        if (strcmp(optarg, "cpu") != 0 && strcmp(optarg, "cuda") != 0) {
          sp_cli_error(RUN, "--device: expected cpu or cuda, got \"%s\"",
                       optarg);
          goto out;
        }
        cuda = strcmp(optarg, "cuda") == 0;
        break;
      case O_CKDIR: ckdir = optarg; break;
      case O_CK:
        if (n_kinds < sizeof kinds / sizeof kinds[0]) kinds[n_kinds++] = optarg;
        break;
      case O_HELP:
        usage(stdout);
        ret = SP_EXIT_OK;
        goto out;
      default:
        if (c >= SP_JOB_OPT_BASE) {
          const char *name = sp_job_flags[c - SP_JOB_OPT_BASE].name;
          if (strcmp(name, "world-size") == 0) {
            sp_cli_error(RUN, "--world-size: use --nproc");
            goto out;
          }
          if (strncmp(name, "wrap-", 5) == 0) wrap_given = true;
          if (sp_job_cli_record(&jcli, c, optarg) < 0) goto out;
          break;
        }
        usage(stderr);
        goto out;
    }
  }
  if (optind < argc || !model_path || nproc < 1) {
    sp_cli_error(RUN, "%s", optind < argc ? "unexpected argument"
                            : !model_path ? "--model is required"
                                          : "--nproc is required");
    usage(stderr);
    goto out;
  }

  /* Check everything here first: a bad spec or job is a message, not N
   * workers failing at once. */
  sp_diag d = {{0}};
  ret = SP_EXIT_FAILURE;
  if (sp_model_load_file(model_path, &model, &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    goto out;
  }
  int rc = sp_job_cli_apply(&jcli, job_path, &job, &d);
  if (rc < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    ret = rc == SP_EINVAL ? SP_EXIT_USAGE : SP_EXIT_FAILURE;
    goto out;
  }
  job.world_size = (uint32_t)nproc;
  bool default_wrap = !wrap_given && job.wrap_modules.n == 0 &&
                      job.wrap_types.n == 0;
  if (default_wrap) {
    bool has_linear = false;
    for (size_t i = 0; i < model->n_modules; i++)
      if (strcmp(model->modules[i].type, "Linear") == 0) has_linear = true;
    default_wrap = has_linear;
    if (has_linear) sp_strlist_add(&job.wrap_types, "Linear");
  }
  if (sp_plan_build(model, &job, &plan, &d) < 0) {
    sp_cli_error(RUN, "%s", d.msg);
    ret = SP_EXIT_USAGE;
    goto out;
  }
  /* One GPU per rank, rank r on GPU r % count: NCCL refuses two ranks of
   * one communicator on the same GPU, so more ranks than GPUs is refused
   * here rather than by every worker after the rendezvous. */
  int n_gpus = 0;
  if (cuda) {
    if (sp_cuda_device_count(&n_gpus) < 0) {
      sp_cli_error(RUN, "--device cuda: cannot count CUDA devices (the "
                        "driver's error is logged above)");
      goto out;
    }
    if (n_gpus == 0) {
      sp_cli_error(RUN, "--device cuda: no CUDA device (or this build has "
                        "no CUDA)");
      goto out;
    }
    if (nproc > n_gpus) {
      sp_cli_error(RUN, "--device cuda: %lld ranks but %d GPU%s; NCCL needs "
                        "one GPU per rank", nproc, n_gpus,
                   n_gpus == 1 ? "" : "s");
      ret = SP_EXIT_USAGE;
      goto out;
    }
  }
  char coord_bin[PATH_MAX], worker_bin[PATH_MAX];
  if (bin_path("shardplane-coordinator", coord_bin, sizeof coord_bin) < 0 ||
      bin_path("shardplane-worker", worker_bin, sizeof worker_bin) < 0) {
    sp_cli_error(RUN, "shardplane-coordinator and shardplane-worker must be "
                      "installed beside this program");
    goto out;
  }
  char default_dir[PATH_MAX];
  if (!ckdir) {
    snprintf(default_dir, sizeof default_dir, "shardplane-run/%s-w%lld",
             model->name && *model->name ? model->name : "model", nproc);
    ckdir = default_dir;
  }

  /* the coordinator */
  char nproc_s[16];
  snprintf(nproc_s, sizeof nproc_s, "%lld", nproc);
  argvec ca = {0};
  push(&ca, coord_bin);
  push(&ca, "--listen");
  push(&ca, "127.0.0.1:0");
  push(&ca, "--model");
  push(&ca, model_path);
  if (job_path) {
    push(&ca, "--job");
    push(&ca, job_path);
  }
  char flagbuf[64][64];
  for (size_t i = 0; i < jcli.n && i < 64; i++) {
    const sp_job_flag_def *def = &sp_job_flags[jcli.items[i].flag];
    snprintf(flagbuf[i], sizeof flagbuf[i], "--%s", def->name);
    push(&ca, flagbuf[i]);
    if (def->has_arg) push(&ca, jcli.items[i].value);
  }
  push(&ca, "--world-size");
  push(&ca, nproc_s);
  if (default_wrap) {
    push(&ca, "--wrap-type");
    push(&ca, "Linear");
  }
  if (cuda) {
    /* what the ranks use (the worker forces NCCL on a GPU); flags given
     * earlier are overridden by this last one */
    push(&ca, "--backend");
    push(&ca, "nccl");
  }
  push(&ca, "--heartbeat-timeout-ms");
  push(&ca, hb);
  push(&ca, "--quiet");

  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);

  sp_proc coord;
  if (sp_proc_spawn(&coord, ca.v, false, true, "listening on 127.0.0.1:%d",
                    &d) < 0) {
    sp_cli_error(RUN, "cannot start the coordinator: %s", d.msg);
    goto out;
  }
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", coord.port);
  printf("shardplane run: %s, %lld ranks, %s, plan %s; coordinator on %s\n",
         model->name, nproc, sp_strategy_name(plan->strategy),
         plan->version_hex, addr);
  fflush(stdout);

  pid_t pids[MAX_NPROC] = {0};
  char rank_s[MAX_NPROC][24];
  char device_s[MAX_NPROC][24];
  double t0 = sp_clock_s();
  ret = SP_EXIT_OK;
  for (long long r = 0; r < nproc; r++) {
    argvec wa = {0};
    snprintf(rank_s[r], sizeof rank_s[r], "%lld", r);
    push(&wa, worker_bin);
    push(&wa, "--coordinator");
    push(&wa, addr);
    push(&wa, "--rank");
    push(&wa, rank_s[r]);
    push(&wa, "--steps");
    push(&wa, steps);
    push(&wa, "--global-batch");
    push(&wa, batch);
    push(&wa, "--lr");
    push(&wa, lr);
    push(&wa, "--log-every");
    push(&wa, log_every);
    push(&wa, "--checkpoint-dir");
    push(&wa, ckdir);
    if (cuda) {
      snprintf(device_s[r], sizeof device_s[r], "cuda:%lld", r % n_gpus);
      push(&wa, "--device");
      push(&wa, device_s[r]);
    }
    for (size_t k = 0; k < n_kinds; k++) {
      push(&wa, "--checkpoint");
      push(&wa, kinds[k]);
    }
    pids[r] = spawn_worker(wa.v);
    if (pids[r] < 0) {
      pids[r] = 0;
      sp_cli_error(RUN, "cannot start rank %lld: %s", r, strerror(errno));
      ret = SP_EXIT_FAILURE;
      break;
    }
  }
  uint32_t live = 0;
  for (long long r = 0; r < nproc; r++) live += pids[r] > 0;
  while (ret == SP_EXIT_OK && live > 0) {
    int st;
    pid_t p = waitpid(-1, &st, 0);
    if (p < 0) {
      if (errno == EINTR && g_signal) {
        fprintf(stderr, "shardplane run: interrupted; stopping %u worker%s "
                        "and the coordinator\n", live, live == 1 ? "" : "s");
        ret = 128 + SIGINT;
      } else if (errno != EINTR) {
        ret = SP_EXIT_FAILURE;
      }
      continue;
    }
    if (p == coord.pid) {
      char how[96];
      describe(st, how, sizeof how);
      sp_cli_error(RUN, "the coordinator %s; stopping the workers", how);
      coord.pid = 0;
      ret = SP_EXIT_FAILURE;
      break;
    }
    for (long long r = 0; r < nproc; r++) {
      if (pids[r] != p) continue;
      pids[r] = 0;
      live--;
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        char how[96];
        describe(st, how, sizeof how);
        sp_cli_error(RUN, "rank %lld %s; stopping the job", r, how);
        ret = SP_EXIT_FAILURE;
      }
    }
  }
  stop_workers(pids, (uint32_t)nproc, 3000);
  if (coord.pid > 0) sp_proc_stop(&coord, 5000);
  if (ret == SP_EXIT_OK)
    printf("shardplane run: done in %.1f s; checkpoint in %s\n", sp_clock_s() - t0,
           ckdir);
out:
  sp_plan_free(plan);
  sp_model_free(model);
  sp_job_clear(&job);
  sp_job_cli_free(&jcli);
  free(opts);
  return ret;
}
