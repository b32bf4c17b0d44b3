/* shardplane-worker: one rank of a job (worker_run.h), or text from a
 * GPT-2 checkpoint (--generate, gpt2_generate.h). This file is the
 * program: its command line, and what is checked before attaching. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/flag.h"
#include "blas_kernels.h"
#include "gpt2_generate.h"
#include "inject.h"
#include "lib/shardplane.h"
#include "plan/job_cli.h"
#include "rpc/rpc.h"
#include "rpc/rpc_cred.h"
#include "train_flags.h"
#include "worker_flags.h"
#include "worker_run.h"
#if SHARDPLANE_HAVE_CUDA
#include "worker_cuda.h"
#endif

static void usage(FILE *f) {
  fputs(
      "usage: shardplane-worker --coordinator HOST:PORT --rank R [options]\n"
      "\n"
      "One rank of a shardplane job: takes the job and model from the\n"
      "coordinator, trains a GPT-2-family transformer (blocks wrapped as\n"
      "units: the spec's no_split_modules or --wrap-type GPT2Block) or the\n"
      "reference MLP (a sequential MLP) with sharded parameters, and\n"
      "reports every training-state transition. Any other spec is refused\n"
      "(exit 1) before the rendezvous, as is a job its trainer cannot\n"
      "take; --synthetic runs the synthetic-gradient cycle on it instead.\n"
      "The spec's \"training\" sets the defaults of the training flags.\n"
      "\n"
      "  --coordinator HOST:PORT  coordinator (default $SHARDPLANE_COORDINATOR"
      ",\n"
      "                           then 127.0.0.1:7700)\n"
      "  --rank R                 this rank (default $RANK, then\n"
      "                           $SLURM_PROCID; one of them is required)\n" SP_CRED_OPTIONS_HELP
      "  --device DEV             cpu (default) or cuda:N: shards, parameters,\n"
      "                           gradients and buffers on GPU N, GPT-2 and\n"
      "                           the MLP on cuBLAS, collectives over NCCL\n"
      "                           (GPU build: the GPU models load then from\n"
      "                           libshardplane-worker-cuda.so, in\n"
      "                           lib/shardplane/ beside this bin/, or from\n"
      "                           the file $SHARDPLANE_WORKER_CUDA_MODULE\n"
      "                           names)\n"
      "  --steps N                train up to step N in all (default 20): a\n"
      "                           run resumed from a checkpoint of step K\n"
      "                           trains steps K+1..N\n"
      "  --global-batch N         samples per step over all ranks and micro-\n"
      "                           batches (default 24)\n"
      "  --lr X                   learning rate, the peak of a schedule\n"
      "                           (default: the spec's training.lr, else\n"
      "                           0.05)\n"
      "  --checkpoint-dir DIR     write checkpoints there after training\n"
      "  --checkpoint KIND        full, sharded or local; repeatable "
      "(default full)\n"
      "  --checkpoint-every N     also after every N-th step (needs\n"
      "                           --checkpoint-dir); each replaces the last\n"
      "                           only once it is complete\n"
      "  --load DIR               start from the checkpoint in DIR (or in its\n"
      "                           full/, sharded/ or local/ folder): its\n"
      "                           parameters, buffers, optimizer state and\n"
      "                           step, from which training continues\n"
      "  --load-kind KIND         full, sharded or local: which one, when DIR\n"
      "                           holds several\n"
      "  --load-params-only       take only the parameters and buffers: the\n"
      "                           optimizer's state and schedule start afresh\n"
      "                           (another optimizer than the checkpoint's);\n"
      "                           training still continues after its step\n"
      "  --losses FILE            rank 0 writes the loss of every step it\n"
      "                           trains (JSON)\n"
      "  --stats FILE             rank 0 writes every step's duration in s,\n"
      "                           whether it was reported, the runtime's\n"
      "                           counted memory, a GPT-2's activation\n"
      "                           bytes and the process's RSS in training\n"
      "                           and in the checkpoints (JSON)\n"
      "  --log-every N            rank 0 prints progress every N steps "
      "(default 1)\n"
      "  --comm-timeout-ms N      rendezvous and collective timeout "
      "(default 60000)\n"
      "  --call-timeout-ms N      deadline of each call to the coordinator\n"
      "                           (attach, store, detach; default 30000)\n"
      "  --coordinator-grace S    ride out a coordinator outage of up to S\n"
      "                           seconds (default 60): training goes on,\n"
      "                           the session reattaches when it is back\n"
      "                           (a coordinator with --state-dir); after S\n"
      "                           the rank fails naming the coordinator\n"
      "  --flight-events N        events the flight recorder keeps for\n"
      "                           `shardplane trace` (default 2000, at most\n"
      "                           100000)\n"
      "  --inject FAULT           (tests, drills) make a fault on purpose,\n"
      "                           repeatable, off by default; steps count\n"
      "                           from 1, only faults naming this rank act:\n"
      "      stall:rank=R,step=S[,unit=U,phase=forward|backward]\n"
      "                           block before that collective, heartbeats\n"
      "                           going on, until killed or aborted\n"
      "      skip-collective:rank=R,step=S[,unit=U]\n"
      "                           skip one all-gather (peers hang)\n"
      "      wrong-count:rank=R,step=S\n"
      "                           one reduction with one element fewer\n"
      "      slow:rank=R,factor=F every step F times slower (a straggler)\n"
      "      exit:rank=R,step=S   die (_exit(1)) as step S begins\n"
      "  --synthetic              run the synthetic-gradient cycle whatever\n"
      "                           the spec, instead of training (the\n"
      "                           runtime's memory and collectives without a\n"
      "                           model: bench/memory); the only way to run\n"
      "                           a spec that is neither a GPT-2 nor a\n"
      "                           sequential MLP\n"
      "  --no-report              check transitions locally, send none\n"
      "  --report-toggle K        switch reporting off and on every K steps\n"
      "                           (starting on; for bench/step)\n"
      "  --test-state NAME        (tests) register a float32 state NAME\n"
      "                           sharded like the parameters, s = 0.5 s + p\n"
      "                           after each step, which checkpoints carry\n"
      "                           as an optimizer's (host storage only)\n",
      f);
  sp_train_flags_help(f, 27);
  fputs(
      "  --help                   this text\n"
      "\n"
      "shardplane-worker --generate --load DIR --model SPEC [--prompt TEXT]\n"
      "    [--tokens N] [--temperature X] [--seed N]\n"
      "  text from a GPT-2 checkpoint, without a job: DIR's FULL checkpoint\n"
      "  and the spec it was trained from continue TEXT (default a newline)\n"
      "  by N bytes (default 400), sampled at temperature X (default 0.8;\n"
      "  0: greedy, the likeliest byte every time) with seed N (default 0)\n"
      "\n"
      "Environment, as launchers set it (flags win): RANK or SLURM_PROCID\n"
      "(the rank), WORLD_SIZE or SLURM_NTASKS (must equal the job's world\n"
      "size), SHARDPLANE_COORDINATOR (the address),\n"
      "SHARDPLANE_COORDINATOR_GRACE (as --coordinator-grace; `shardplane\n"
      "agent` sets it). Gloo binds and\n"
      "advertises the address of the interface that reaches the\n"
      "coordinator; SHARDPLANE_GLOO_HOST=ADDR overrides it.\n"
      "\n"
      "SIGINT or SIGTERM: every rank stops after the same step (they agree\n"
      "at each step boundary), writes the checkpoints and exits 128 + the\n"
      "signal (143 on a rank stopped by another's); a second signal ends\n"
      "the process at once.\n"
      "\n"
      "exit codes: 0 done, 1 failed (message names the rank; also a spec\n"
      "it cannot train without --synthetic, or a job its trainer refuses,\n"
      "before the rendezvous), 2 bad usage, 130 / 143 stopped by SIGINT /\n"
      "SIGTERM after the checkpoint\n",
      f);
}

enum {
  O_COORD = 256,
  O_RANK,
  O_DEVICE,
  O_LOSSES,
  O_STATS,
  O_CTO,
  O_CALLTO,
  O_GRACE,
  O_NOREP,
  O_TOGGLE,
  O_TSTATE,
  O_FLIGHT,
  O_INJECT,
  O_GEN,
  O_GMODEL,
  O_PROMPT,
  O_TOKENS,
  O_TEMP,
  O_SEED,
  O_SYNTH,
  O_HELP
};

/* One option with its value: 0, or SP_EINVAL with the flag, the value and
 * what is allowed in d. */
static int parse_option(sp_worker_opts *o, int c, const char *flag,
                        const char *v, sp_diag *d) {
  long long n = 0;
  int rc;
  if (c >= SP_WORKER_OPT_BASE && c < SP_WORKER_OPT_END)
    return sp_worker_flag(&o->wf, c, flag, v, d);
  if (c >= SP_TRAIN_OPT_BASE) return sp_train_flag(&o->train, c, v, d);
  switch (c) {
    case O_COORD:
      o->coordinator = v;
      o->coordinator_flag = true;
      return 0; /* checked with the environment's value, in parse_args */
    case O_RANK:
      rc = sp_flag_int(flag, v, 0, SP_JOB_MAX_WORLD - 1, &n, d);
      o->rank = rc == 0 ? (long)n : o->rank;
      return rc;
    case O_DEVICE:
      o->device = v;
      return sp_flag_text(flag, v, "cpu or cuda:N", d);
    case O_LOSSES:
      o->losses_path = v;
      return sp_flag_text(flag, v, "a file name", d);
    case O_STATS:
      o->stats_path = v;
      return sp_flag_text(flag, v, "a file name", d);
    case O_CTO:
      rc = sp_flag_int(flag, v, 1, 86400000, &n, d);
      o->comm_timeout_ms = (uint64_t)n;
      return rc;
    case O_CALLTO:
      rc = sp_flag_int(flag, v, 1, 86400000, &n, d);
      o->call_timeout_ms = (uint64_t)n;
      return rc;
    case O_GRACE:
      return sp_coordinator_grace_parse(flag, v, &o->coordinator_grace_ms, d);
    case O_TOGGLE:
      rc = sp_flag_int(flag, v, 1, 1000000000, &n, d);
      o->report_toggle = (uint32_t)n;
      return rc;
    case O_NOREP: o->no_report = true; return 0;
    case O_TSTATE:
      o->test_state = v;
      return sp_flag_text(flag, v, "a state name", d);
    case O_FLIGHT:
      rc = sp_flag_int(flag, v, 1, 100000, &n, d);
      o->flight_events = (uint32_t)n;
      return rc;
    case O_INJECT: return sp_inject_parse(&o->inject, v, d);
    case O_GEN: o->generate = true; return 0;
    case O_SYNTH: o->synthetic = true; return 0;
    case O_GMODEL:
      o->gen.model_path = v;
      return sp_flag_text(flag, v, "a model spec (JSON file)", d);
    case O_PROMPT: o->gen.prompt = v; return 0;
    case O_TOKENS:
      rc = sp_flag_int(flag, v, 1, 1000000, &n, d);
      o->gen.tokens = (uint32_t)n;
      return rc;
    case O_TEMP:
      if (sp_flag_number(flag, v, 0, &o->gen.temperature, d) != 0)
        return sp_flag_fail(d, flag, v, SP_GPT2_TEMPERATURE_RULE);
      return 0;
    case O_SEED:
      rc = sp_flag_int(flag, v, 0, INT64_MAX, &n, d);
      o->gen.seed = (uint64_t)n;
      return rc;
  }
  return SP_ENOENT;
}

/* 0 to run, 1 after --help, 2 for bad usage (message printed). */
static int parse_args(int argc, char **argv, sp_worker_opts *o) {
  static const struct option own[] = {
      {"coordinator", required_argument, NULL, O_COORD},
      {"rank", required_argument, NULL, O_RANK},
      {"device", required_argument, NULL, O_DEVICE},
      SP_WORKER_OPTIONS_RUN_AND_SAVE,
      SP_WORKER_OPTIONS_LOAD,
      {"losses", required_argument, NULL, O_LOSSES},
      {"stats", required_argument, NULL, O_STATS},
      SP_WORKER_OPTION_LOG_EVERY,
      {"comm-timeout-ms", required_argument, NULL, O_CTO},
      {"call-timeout-ms", required_argument, NULL, O_CALLTO},
      {"coordinator-grace", required_argument, NULL, O_GRACE},
      {"no-report", no_argument, NULL, O_NOREP},
      {"report-toggle", required_argument, NULL, O_TOGGLE},
      SP_WORKER_OPTION_CKPT_EVERY,
      {"test-state", required_argument, NULL, O_TSTATE},
      {"flight-events", required_argument, NULL, O_FLIGHT},
      {"inject", required_argument, NULL, O_INJECT},
      {"generate", no_argument, NULL, O_GEN},
      {"synthetic", no_argument, NULL, O_SYNTH},
      {"model", required_argument, NULL, O_GMODEL},
      {"prompt", required_argument, NULL, O_PROMPT},
      {"tokens", required_argument, NULL, O_TOKENS},
      {"temperature", required_argument, NULL, O_TEMP},
      {"seed", required_argument, NULL, O_SEED},
      {"help", no_argument, NULL, O_HELP},
      SP_CRED_OPTIONS};
  /* the worker's own options, then the training flags */
  struct option opts[64];
  size_t n_own = sizeof own / sizeof own[0];
  memcpy(opts, own, sizeof own);
  size_t n_train = sp_train_options(opts + n_own, 63 - n_own);
  opts[n_own + n_train] = (struct option){NULL, 0, NULL, 0};
  memset(o, 0, sizeof *o);
  sp_train_flags_init(&o->train);
  /* what a launcher said (torchrun's or Slurm's variables); flags win */
  sp_diag ed = {{0}};
  if (sp_launch_env_read(&o->env, &ed) != 0) {
    fprintf(stderr, "shardplane-worker: %s\n", ed.msg);
    return 2;
  }
  o->coordinator = o->env.coordinator ? o->env.coordinator : "127.0.0.1:7700";
  o->coordinator_grace_ms = o->env.coordinator_grace_ms;
  o->rank = o->env.rank;
  o->device = "cpu";
  sp_worker_flags_init(&o->wf, 0);
  o->gen.tokens = 400;
  o->gen.temperature = 0.8;
  int c, index = -1;
  while ((c = getopt_long(argc, argv, "", opts, &index)) != -1) {
    if (c == O_HELP) {
      usage(stdout);
      return 1;
    }
    if (c == '?' || index < 0) { /* getopt said what */
      sp_flag_try_help("shardplane-worker");
      return 2;
    }
    char flag[64];
    snprintf(flag, sizeof flag, "--%s", opts[index].name);
    sp_diag d = {{0}};
    int cred = sp_cred_option(&o->cred, c, optarg, &d);
    if (cred < 0) {
      fprintf(stderr, "shardplane-worker: %s\n", d.msg);
      return 2;
    }
    if (cred == 0 && parse_option(o, c, flag, optarg, &d) < 0) {
      fprintf(stderr, "shardplane-worker: %s\n", d.msg);
      return 2;
    }
    index = -1;
  }
  if (o->generate) { /* no job: the checkpoint and its spec */
    if (optind < argc || !o->wf.load_dir || !o->gen.model_path) {
      fprintf(stderr,
              "shardplane-worker: --generate needs --load DIR (a "
              "FULL checkpoint) and --model SPEC (the spec it was trained "
              "from)\n");
      return 2;
    }
    return 0;
  }
  if (optind < argc || o->rank < 0) {
    if (optind < argc)
      fprintf(stderr, "shardplane-worker: unexpected argument \"%s\"\n",
              argv[optind]);
    else
      fprintf(stderr,
              "shardplane-worker: --rank is required (or $RANK or "
              "$SLURM_PROCID, as launchers set them)\n");
    sp_flag_try_help("shardplane-worker");
    return 2;
  }
  char host[256];
  int port;
  /* unix:PATH is a host agent's socket (shardplane agent) */
  bool via_agent = strncmp(o->coordinator, SP_RPC_UNIX_PREFIX,
                           strlen(SP_RPC_UNIX_PREFIX)) == 0;
  if (!via_agent &&
      (sp_rpc_split_addr(o->coordinator, host, sizeof host, &port) != 0 ||
       port == 0)) {
    sp_diag d = {{0}};
    sp_flag_fail(
        &d, o->coordinator_flag ? "--coordinator" : "$SHARDPLANE_COORDINATOR",
        o->coordinator,
        "HOST:PORT or [v6]:PORT, port in [1, "
        "65535], or unix:PATH");
    fprintf(stderr, "shardplane-worker: %s\n", d.msg);
    return 2;
  }
  sp_diag cd = {{0}};
  if (sp_cred_finish(&o->cred, &cd) != 0) {
    fprintf(stderr, "shardplane-worker: %s\n", cd.msg);
    return 2;
  }
  sp_diag fd = {{0}};
  if (sp_worker_flags_finish(&o->wf, &fd) < 0) {
    fprintf(stderr, "shardplane-worker: %s\n", fd.msg);
    return 2;
  }
  if (o->wf.ckpt_every && (!o->wf.ckpt_dir || !o->wf.any_kind)) {
    fprintf(stderr,
            "shardplane-worker: --checkpoint-every %u needs "
            "--checkpoint-dir DIR and a --checkpoint kind other than none\n",
            o->wf.ckpt_every);
    return 2;
  }
  /* the flags that combine, as far as the flags alone say (the spec's
   * training defaults and the world size's share of the batch are
   * checked once the coordinator gives them) */
  sp_diag d = {{0}};
  if (sp_train_flags_precheck(&o->train, o->wf.steps, o->wf.lr, o->wf.lr_given,
                              o->wf.global_batch, &d) < 0) {
    fprintf(stderr, "shardplane-worker: %s\n", d.msg);
    return 2;
  }
  return 0;
}

/* Runs this program again with OPENBLAS_CORETYPE set when OpenBLAS took
 * the slow fallback kernels (blas_kernels.h). */
static void blas_kernels(char **argv) {
  const char *want = sp_blas_coretype_wanted();
  if (!want) return;
  /* by its own path, not /proc/self/exe: the process's name (ps, pgrep,
   * the thread names tests check) is the file's */
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  setenv("OPENBLAS_CORETYPE", want, 1);
  execv(self, argv); /* on failure: on with the slow kernels */
}

int main(int argc, char **argv) {
  blas_kernels(argv);
  /* The training thread is the main thread, and keeps the program's name:
   * renaming it would rename the process for ps, pgrep and killall. */
  sp_worker_opts o;
  int prc = parse_args(argc, argv, &o);
  if (prc) return prc == 1 ? 0 : prc;
  sp_diag d = {{0}};
  /* generation reads a FULL checkpoint, whatever else DIR holds */
  if (o.generate && !o.wf.load_kind) o.wf.load_kind = SP_CKPT_FULL;
  /* --load DIR may also be the folder shardplane run wrote (its full/,
   * sharded/ or local/ subfolder is found) */
  if (o.wf.load_dir &&
      sp_ckpt_resolve(o.wf.load_dir, o.wf.load_kind, o.load_from,
                      sizeof o.load_from, &o.wf.load_kind, &d) < 0) {
    fprintf(stderr, "shardplane-worker: %s\n", d.msg);
    return 2;
  }
  if (o.generate) {
    if (o.wf.load_kind != SP_CKPT_FULL) {
      fprintf(stderr,
              "shardplane-worker: --generate: %s holds no FULL "
              "checkpoint\n",
              o.wf.load_dir);
      return 2;
    }
    char file[4200];
    snprintf(file, sizeof file, "%s/model.safetensors", o.load_from);
    o.gen.ckpt_file = file;
    if (sp_gpt2_generate(&o.gen, stdout, &d) < 0) {
      fprintf(stderr, "shardplane-worker: --generate: %s\n", d.msg);
      return 1;
    }
    return 0;
  }
  /* before attaching: a rank that cannot run on its device says so at once
   * instead of after the rendezvous */
  int ordinal;
  int drc = sp_device_parse(o.device, &ordinal, &d);
  if (drc == SP_EINVAL) {
    fprintf(stderr,
            "shardplane-worker: --device \"%s\": expected cpu or "
            "cuda:N\n",
            o.device);
    return 2;
  }
  if (drc < 0) {
    fprintf(stderr, "shardplane-worker: rank %ld: --device %s\n", o.rank,
            d.msg);
    return 1;
  }
#if SHARDPLANE_HAVE_CUDA
  /* the GPU models are a module loaded only for a GPU (worker_cuda.h): a
   * missing or mismatched one is said here too, not after the rendezvous */
  if (ordinal >= 0 && sp_worker_cuda_load(&d) < 0) {
    fprintf(stderr, "shardplane-worker: rank %ld: --device %s: %s\n", o.rank,
            o.device, d.msg);
    return 1;
  }
#endif
  sp_worker_catch_stop_signals();
  int stopped = 0;
  int rc = sp_worker_run(&o, &stopped, &d);
  if (rc < 0) {
    fprintf(stderr, "shardplane-worker: rank %ld: %s\n", o.rank,
            d.msg[0] ? d.msg : sp_strerror(rc));
    return 1;
  }
  return stopped ? 128 + (stopped > 0 ? stopped : SIGTERM) : 0;
}
