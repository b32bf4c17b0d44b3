/* `shardplane plan`: the sharding plan, computed offline from a model spec
 * and a job (file and/or flags), or asked of a running coordinator, as
 * tables or JSON (render.c prints both). */
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "cli.h"
#include "fsdp/job.h"
#include "fsdp/job_cli.h"
#include "fsdp/memory.h"
#include "fsdp/model.h"
#include "fsdp/plan.h"
#include "render.h"

static void plan_help(FILE *f) {
  fputs("usage: shardplane plan --model M.json [job options] [options]\n"
        "       shardplane plan [--coordinator HOST:PORT] [options]\n"
        "\n"
        "Prints the sharding plan: its units, per-rank shard sizes and the\n"
        "buffer table (FQN, original and compute dtype), or with --memory\n"
        "the bytes each rank holds. With --model it is computed here from\n"
        "the spec and job; without, it is the running coordinator's plan.\n"
        "\n"
        "  --model PATH                 model spec (shardplane.model/v1)\n"
        "  --job PATH                   job config (shardplane.job/v1); the\n"
        "                               flags below override it\n",
        f);
  sp_job_flags_print_help(f);
  fputs(SP_REMOTE_OPTIONS_HELP
        "  --rank R                     also list rank R's shard, param by "
        "param\n"
        "  --unit U                     also list unit U (index or module "
        "FQN)\n"
        "  --json                       machine-readable output\n"
        "  --memory                     instead of the tables: the bytes "
        "every rank\n"
        "                               holds, by category, at its peak "
        "(the memory\n"
        "                               model: exact for shardplane's "
        "runtime)\n"
        "  --optimizer O                with --memory: none, sgd (default), "
        "sgd-momentum\n"
        "                               or adamw (its state: 0, 0, 1, 2 "
        "float32 copies\n"
        "                               of each shard)\n"
        "  --max-inflight-gathers N     with --memory: the limiter "
        "(default 2)\n"
        "  --no-backward-prefetch       with --memory: no BACKWARD_PRE "
        "prefetch\n"
        "  --no-sync                    with --memory: gradient "
        "accumulation under\n"
        "                               no_sync (every unit's gradient "
        "kept until the\n"
        "                               last micro-batch)\n"
        "  --help                       this text\n"
        "\n"
        "exit codes: 0 ok, 1 bad spec or job, 2 bad usage, 3 rank/unit not "
        "found,\n"
        "            4 coordinator unreachable\n",
        f);
}

enum {
  OPT_MODEL = 256,
  OPT_JOB,
  OPT_RANK,
  OPT_UNIT,
  OPT_JSON,
  OPT_HELP,
  OPT_MEMORY,
  OPT_OPTIMIZER,
  OPT_INFLIGHT,
  OPT_NO_PREFETCH,
  OPT_NO_SYNC,
};

static const struct option k_opts[] = {
    {"model", required_argument, NULL, OPT_MODEL},
    {"job", required_argument, NULL, OPT_JOB},
    {"rank", required_argument, NULL, OPT_RANK},
    {"unit", required_argument, NULL, OPT_UNIT},
    {"json", no_argument, NULL, OPT_JSON},
    {"help", no_argument, NULL, OPT_HELP},
    {"memory", no_argument, NULL, OPT_MEMORY},
    {"optimizer", required_argument, NULL, OPT_OPTIMIZER},
    {"max-inflight-gathers", required_argument, NULL, OPT_INFLIGHT},
    {"no-backward-prefetch", no_argument, NULL, OPT_NO_PREFETCH},
    {"no-sync", no_argument, NULL, OPT_NO_SYNC},
    SP_REMOTE_OPTIONS,
};

typedef struct plan_args {
  const char *model, *job, *unit;
  long long rank;
  bool json;
  bool memory;
  sp_mem_opts mem;
  const char *mem_flag; /* a memory option given (for the error without
                           --memory) */
  bool remote_opts; /* --coordinator or --timeout-ms given */
  sp_job_cli flags; /* job flags, applied after --job */
} plan_args;

static int run_plan(const plan_args *a) {
  sp_diag diag = {""};
  sp_model *model = NULL;
  sp_plan *plan = NULL;
  sp_job job;
  sp_job_init(&job);
  int exit_code = SP_EXIT_FAILURE;
  if (sp_model_load_file(a->model, &model, &diag) != 0) {
    sp_cli_error("plan", "%s", diag.msg);
    goto out;
  }
  int rc = sp_job_cli_apply((sp_job_cli *)&a->flags, a->job, &job, &diag);
  if (rc != 0) {
    sp_cli_error("plan", "%s", diag.msg);
    if (rc == SP_EINVAL) exit_code = SP_EXIT_USAGE;
    goto out;
  }
  double t0 = (sp_clock_s() * 1e3);
  if (sp_plan_build(model, &job, &plan, &diag) != 0) {
    sp_cli_error("plan", "%s", diag.msg);
    goto out;
  }
  sp_plan_source src = {.model_path = model->path,
                        .n_modules = model->n_modules,
                        .n_params = model->n_params,
                        .n_buffers = model->n_buffers,
                        .build_ms = (sp_clock_s() * 1e3) - t0};
  for (size_t i = 0; i < model->n_params; i++)
    src.elements += model->params[i].numel;
  if (a->rank >= (long long)plan->world_size) {
    sp_cli_error("plan", "--rank %lld: the world has ranks 0-%u", a->rank,
                 plan->world_size - 1);
    exit_code = SP_EXIT_NOT_FOUND;
    goto out;
  }
  long unit = -1;
  if (a->unit != NULL && (unit = sp_plan_find_unit(plan, a->unit)) < 0) {
    sp_cli_error("plan", "--unit %s: no such unit (%zu units)", a->unit,
                 plan->n_units);
    exit_code = SP_EXIT_NOT_FOUND;
    goto out;
  }
  if (a->memory) {
    sp_mem_estimate e;
    if (sp_mem_estimate_plan(plan, &a->mem, &e, &diag) != 0) {
      sp_cli_error("plan", "memory model: %s", diag.msg);
      goto out;
    }
    if (a->json) {
      if (sp_render_memory_json(plan, &job, &src, &e) != 0) goto out;
    } else {
      sp_render_memory_text(plan, &job, &src, &e);
    }
  } else if (a->json) {
    if (sp_render_plan_json(plan, &job, &src, (long)a->rank, unit) != 0)
      goto out;
  } else {
    sp_render_plan_text(plan, &job, &src, (long)a->rank, unit);
  }
  exit_code = fflush(stdout) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
out:
  sp_plan_free(plan);
  sp_model_free(model);
  sp_job_clear(&job);
  return exit_code;
}

int sp_cmd_plan(int argc, char **argv) {
  plan_args a = {.rank = -1};
  sp_mem_opts_default(&a.mem);
  sp_remote remote;
  sp_remote_init(&remote, "plan");
  int exit_code = SP_EXIT_USAGE;
  struct option *opts =
      sp_job_cli_options(k_opts, sizeof k_opts / sizeof k_opts[0]);
  if (opts == NULL) return SP_EXIT_FAILURE;
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    int r = sp_remote_option(&remote, c, optarg);
    if (r < 0) goto out;
    if (r > 0) {
      a.remote_opts = true;
      continue;
    }
    switch (c) {
    case OPT_MODEL: a.model = optarg; break;
    case OPT_JOB: a.job = optarg; break;
    case OPT_JSON: a.json = true; break;
    case OPT_UNIT: a.unit = optarg; break;
    case OPT_RANK:
      if (sp_cli_parse_uint(optarg, SP_JOB_MAX_WORLD, &a.rank) != 0) {
        sp_cli_error("plan", "--rank: expected a rank number, got \"%s\"",
                     optarg);
        goto out;
      }
      break;
    case OPT_HELP:
      plan_help(stdout);
      exit_code = SP_EXIT_OK;
      goto out;
    case OPT_MEMORY: a.memory = true; break;
    case OPT_OPTIMIZER:
      a.mem_flag = "--optimizer";
      if (sp_mem_optimizer_parse(optarg, &a.mem.optimizer) != 0) {
        sp_cli_error("plan", "--optimizer \"%s\": expected none, sgd, "
                     "sgd-momentum or adamw", optarg);
        goto out;
      }
      break;
    case OPT_INFLIGHT: {
      long long n;
      a.mem_flag = "--max-inflight-gathers";
      if (sp_cli_parse_uint(optarg, SP_MEM_MAX_INFLIGHT, &n) != 0 || n < 1) {
        sp_cli_error("plan", "--max-inflight-gathers \"%s\": expected a "
                     "whole number from 1 to %u", optarg,
                     SP_MEM_MAX_INFLIGHT);
        goto out;
      }
      a.mem.max_inflight = (uint32_t)n;
      break;
    }
    case OPT_NO_PREFETCH:
      a.mem_flag = "--no-backward-prefetch";
      a.mem.backward_prefetch = false;
      break;
    case OPT_NO_SYNC:
      a.mem_flag = "--no-sync";
      a.mem.no_sync = true;
      break;
    default:
      if (c >= SP_JOB_OPT_BASE) {
        if (sp_job_cli_record(&a.flags, c, optarg) != 0) goto out;
        break;
      }
      plan_help(stderr);
      goto out;
    }
  }
  if (optind < argc) {
    sp_cli_error("plan", "unexpected argument \"%s\"", argv[optind]);
    goto out;
  }
  if (a.mem_flag != NULL && !a.memory) {
    sp_cli_error("plan", "%s is an option of the memory model: it needs "
                 "--memory", a.mem_flag);
    goto out;
  }
  if (a.memory && (a.rank >= 0 || a.unit != NULL)) {
    sp_cli_error("plan", "--memory prints what every rank holds (the same "
                 "on all); --rank and --unit are for the plan tables");
    goto out;
  }
  if (a.model != NULL) {
    if (a.remote_opts) {
      sp_cli_error("plan", "--model computes the plan here; --coordinator and "
                           "--timeout-ms are for asking a coordinator");
      goto out;
    }
    exit_code = run_plan(&a);
  } else if (a.job != NULL || a.flags.n > 0) {
    /* a running job's plan is fixed: job options only make sense offline */
    sp_cli_error("plan", "--job and job flags need --model (the "
                         "coordinator's plan has its own job)");
  } else {
    remote.json = a.json;
    exit_code = sp_remote_plan(&remote, a.rank, a.unit,
                               a.memory ? &a.mem : NULL);
  }
out:
  sp_job_cli_free(&a.flags);
  free(opts);
  return exit_code;
}
