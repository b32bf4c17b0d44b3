/* `shardplane plan`: the sharding plan, computed offline from a model spec
 * and a job (file and/or flags), or asked of a running coordinator, as
 * tables or JSON (render.c prints both). */
#include <getopt.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "cli.h"
#include "plan/job.h"
#include "plan/job_cli.h"
#include "base/flag.h"
#include "plan/memory.h"
#include "plan/model.h"
#include "plan/plan.h"
#include "lib/session/plan_wire.h"
#include "remote.h"
#include "render.h"
#include "rpc/coord_service.h"

static void plan_help(FILE *f) {
  fputs(
      "usage: shardplane plan --model M.json [job options] [options]\n"
      "       shardplane plan [--coordinator HOST:PORT] [options]\n"
      "\n"
      "Prints the sharding plan: its units, per-rank shard sizes and the\n"
      "buffer table (FQN, original and compute dtype), or with --memory\n"
      "the bytes each rank holds. With --model it is computed here from\n"
      "the spec and job; without, it is the running coordinator's plan.\n"
      "\n"
      "  --model PATH                 model spec (shardplane.model/v1)\n"
      "  --job PATH                   job config (shardplane.job/v1); the\n"
      "                               flags below override it (without a\n"
      "                               wrap policy every module of a type\n"
      "                               in the spec's no_split_modules\n"
      "                               becomes a unit, else every Linear,\n"
      "                               as in shardplane run)\n",
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
        "  --optimizer O                with --memory: none, sgd, "
        "sgd-momentum\n"
        "                               or adamw (its state: 0, 0, 1, 2 "
        "float32 copies\n"
        "                               of each shard; default: the "
        "spec's training\n"
        "                               optimizer, else sgd)\n"
        "  --max-inflight-gathers N     with --memory: the limiter "
        "(default 2)\n"
        "  --no-backward-prefetch       with --memory: no BACKWARD_PRE "
        "prefetch\n"
        "  --no-sync                    with --memory: gradient "
        "accumulation under\n"
        "                               no_sync (every unit's gradient "
        "kept until the\n"
        "                               last micro-batch)\n"
        "  --global-batch N             with --memory: sequences (samples) "
        "a step over\n"
        "                               every rank (default 24, as "
        "shardplane run)\n"
        "  --micro-batch N              with --memory: instead, "
        "sequences a rank takes\n"
        "                               a micro-batch\n"
        "  --grad-accum K               with --memory: micro-batches a "
        "step (default 1)\n"
        "  --seq-len T                  with --memory: GPT-2 tokens a "
        "sequence (default:\n"
        "                               the context)\n"
        "  --activation-checkpointing   with --memory: GPT-2 keeps only "
        "each block's input\n"
        "  --device cpu|cuda            with --memory: where the "
        "activations live\n"
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
  OPT_GLOBAL_BATCH,
  OPT_MICRO_BATCH,
  OPT_GRAD_ACCUM,
  OPT_SEQ_LEN,
  OPT_CKPT,
  OPT_DEVICE,
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
    {"global-batch", required_argument, NULL, OPT_GLOBAL_BATCH},
    {"micro-batch", required_argument, NULL, OPT_MICRO_BATCH},
    {"grad-accum", required_argument, NULL, OPT_GRAD_ACCUM},
    {"seq-len", required_argument, NULL, OPT_SEQ_LEN},
    {"activation-checkpointing", no_argument, NULL, OPT_CKPT},
    {"device", required_argument, NULL, OPT_DEVICE},
    SP_REMOTE_OPTIONS,
};

typedef struct plan_args {
  const char *model, *job, *unit;
  long long rank;
  bool json;
  bool memory;
  sp_mem_opts mem;
  sp_train_shape shape;  /* global_batch 0: from micro_batch */
  long long micro_batch; /* --micro-batch; 0: not given */
  bool global_given;
  bool optimizer_given;   /* else the spec's training optimizer, if any */
  const char *mem_flag;   /* a memory option given (for the error without
                             --memory) */
  const char *shape_flag; /* a batch-shape option given (needs --model) */
  bool remote_opts;       /* --coordinator or --timeout-ms given */
  sp_job_cli flags;       /* job flags, applied after --job */
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
  if (rc == 0) rc = sp_job_cli_check_model(&a->flags, model, &diag);
  if (rc != 0) {
    sp_cli_error("plan", "%s", diag.msg);
    if (rc == SP_EINVAL) exit_code = SP_EXIT_USAGE;
    goto out;
  }
  /* the plan shardplane run and the coordinator make of this job */
  if (sp_job_default_wrap(&job, model, NULL) != 0) {
    sp_cli_error("plan", "out of memory");
    goto out;
  }
  /* a job the flags alone make is bad usage; one from a file, a bad job */
  if (sp_job_validate(&job, model, &diag) != 0) {
    sp_cli_error("plan", "%s", diag.msg);
    exit_code = a->job != NULL ? SP_EXIT_FAILURE : SP_EXIT_USAGE;
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
  if (sp_cli_check_rank("plan", a->rank, plan->world_size) != SP_EXIT_OK) {
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
    sp_train_mem tm;
    sp_train_shape sh = a->shape;
    /* the optimizer run would train with: the spec's, unless asked */
    sp_mem_opts mo = a->mem;
    const sp_model_training *tr = &model->training;
    if (!a->optimizer_given && (tr->set & SP_MODEL_TRAIN_OPTIMIZER))
      mo.optimizer = tr->adamw ? SP_MEM_OPT_ADAMW
                     : (tr->set & SP_MODEL_TRAIN_MOMENTUM) && tr->momentum > 0
                         ? SP_MEM_OPT_SGD_MOMENTUM
                         : SP_MEM_OPT_SGD;
    if (a->micro_batch > 0)
      sh.global_batch =
          (uint32_t)(a->micro_batch * sh.grad_accum * plan->world_size);
    rc = sp_train_mem_predict(plan, &mo, &sh, &tm, &diag);
    if (rc != 0) {
      sp_cli_error("plan", "memory model: %s", diag.msg);
      if (rc == SP_EINVAL) exit_code = SP_EXIT_USAGE;
      goto out;
    }
    if (a->json) {
      if (sp_render_memory_json(plan, &job, &src, &tm, &sh) != 0) goto out;
    } else {
      sp_render_memory_text(plan, &job, &src, &tm, &sh);
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
  a.shape = (sp_train_shape){.global_batch = 24, .grad_accum = 1};
  sp_remote remote;
  sp_remote_init(&remote, "plan");
  int exit_code = SP_EXIT_USAGE;
  struct option *opts =
      sp_job_cli_options(k_opts, sizeof k_opts / sizeof k_opts[0]);
  if (opts == NULL) return SP_EXIT_FAILURE;
  int c;
  sp_diag d = {{0}};
  optind = 1;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    int r = sp_remote_option(&remote, c, optarg);
    if (r < 0) goto out;
    if (r > 0) {
      a.remote_opts = true;
      continue;
    }
    switch (c) {
      case OPT_MODEL:
        a.model = optarg;
        if (sp_flag_text("--model", optarg, "a model spec (JSON file)", &d))
          goto bad;
        break;
      case OPT_JOB:
        a.job = optarg;
        if (sp_flag_text("--job", optarg, "a job config (JSON file)", &d))
          goto bad;
        break;
      case OPT_UNIT:
        a.unit = optarg;
        if (sp_flag_text("--unit", optarg, "a unit index or module FQN", &d))
          goto bad;
        break;
      case OPT_JSON: a.json = true; break;
      case OPT_RANK:
        if (sp_flag_int("--rank", optarg, 0, SP_JOB_MAX_WORLD - 1, &a.rank,
                        &d) != 0)
          goto bad;
        break;
      case OPT_HELP:
        plan_help(stdout);
        exit_code = SP_EXIT_OK;
        goto out;
      case OPT_MEMORY: a.memory = true; break;
      case OPT_OPTIMIZER:
        a.mem_flag = "--optimizer";
        a.optimizer_given = true;
        if (sp_mem_optimizer_parse(optarg, &a.mem.optimizer) != 0) {
          sp_cli_error("plan",
                       "--optimizer \"%s\": expected none, sgd, "
                       "sgd-momentum or adamw",
                       optarg);
          goto out;
        }
        break;
      case OPT_INFLIGHT: {
        long long n;
        a.mem_flag = "--max-inflight-gathers";
        if (sp_cli_parse_uint(optarg, SP_MEM_MAX_INFLIGHT, &n) != 0 || n < 1) {
          sp_cli_error("plan",
                       "--max-inflight-gathers \"%s\": expected a "
                       "whole number from 1 to %u",
                       optarg, SP_MEM_MAX_INFLIGHT);
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
      case OPT_GLOBAL_BATCH:
      case OPT_MICRO_BATCH:
      case OPT_GRAD_ACCUM:
      case OPT_SEQ_LEN: {
        static const char *const names[] = {"--global-batch", "--micro-batch",
                                            "--grad-accum", "--seq-len"};
        const char *flag = names[c - OPT_GLOBAL_BATCH];
        long long n;
        a.mem_flag = flag;
        a.shape_flag = flag;
        if (sp_flag_int(flag, optarg, 1, UINT32_MAX, &n, &d) != 0) goto bad;
        if (c == OPT_GLOBAL_BATCH) a.shape.global_batch = (uint32_t)n;
        if (c == OPT_GLOBAL_BATCH) a.global_given = true;
        if (c == OPT_MICRO_BATCH) a.micro_batch = n;
        if (c == OPT_GRAD_ACCUM) a.shape.grad_accum = (uint32_t)n;
        if (c == OPT_SEQ_LEN) a.shape.seq_len = (uint32_t)n;
        break;
      }
      case OPT_CKPT:
        a.mem_flag = "--activation-checkpointing";
        a.shape_flag = "--activation-checkpointing";
        a.shape.checkpointing = true;
        break;
      case OPT_DEVICE: {
        static const char *const devices[] = {"cpu", "cuda"};
        size_t k = 0;
        a.mem_flag = "--device";
        a.shape_flag = "--device";
        if (sp_flag_choice("--device", optarg, devices, 2, &k, &d) != 0)
          goto bad;
        a.shape.device = k == 1;
        break;
      }
      default:
        if (c >= SP_JOB_OPT_BASE) {
          if (sp_job_cli_record(&a.flags, c, optarg) != 0) goto out;
          break;
        }
        sp_cli_try_help("plan"); /* getopt said what */
        goto out;
    }
    continue;
  bad:
    sp_cli_error("plan", "%s", d.msg);
    goto out;
  }
  if (optind < argc) {
    sp_cli_error("plan", "unexpected argument \"%s\"", argv[optind]);
    sp_cli_try_help("plan");
    goto out;
  }
  if (a.mem_flag != NULL && !a.memory) {
    sp_cli_error("plan",
                 "%s is an option of the memory model: it needs "
                 "--memory",
                 a.mem_flag);
    goto out;
  }
  if (a.micro_batch > 0 && a.global_given) {
    sp_cli_error("plan",
                 "--micro-batch and --global-batch both give the batch: "
                 "one of them");
    goto out;
  }
  if (a.memory && (a.rank >= 0 || a.unit != NULL)) {
    sp_cli_error("plan",
                 "--memory prints what every rank holds (the same "
                 "on all); --rank and --unit are for the plan tables");
    goto out;
  }
  if (a.model != NULL) {
    if (a.remote_opts) {
      sp_cli_error("plan",
                   "--model computes the plan here; --coordinator and "
                   "--timeout-ms are for asking a coordinator");
      goto out;
    }
    exit_code = run_plan(&a);
  } else if (a.shape_flag != NULL) {
    sp_cli_error("plan",
                 "%s sizes the trainer's activations, which need the spec: "
                 "give --model M.json (the coordinator's plan carries units, "
                 "not the spec's modules)",
                 a.shape_flag);
  } else if (a.job != NULL || a.flags.n > 0) {
    /* a running job's plan is fixed: job options only make sense offline */
    sp_cli_error("plan",
                 "--job and job flags need --model (the "
                 "coordinator's plan has its own job)");
  } else {
    remote.json = a.json;
    exit_code =
        sp_remote_plan(&remote, a.rank, a.unit, a.memory ? &a.mem : NULL);
  }
out:
  sp_job_cli_free(&a.flags);
  free(opts);
  return exit_code;
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
  int ec = sp_remote_get_job(r, &j, &job);
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
  if ((ec = sp_remote_call(r, SP_COORD_PATH("GetPlan"), &q.base,
                           &shardplane__v1__plan__descriptor, &m)) !=
      SP_EXIT_OK)
    goto out;
  sp_diag diag = {""};
  if (sp_wire_plan_new((Shardplane__V1__Plan *)m, &wp, &diag) != 0) {
    sp_cli_error(r->cmd, "the coordinator's plan is malformed: %s", diag.msg);
    ec = SP_EXIT_FAILURE;
    goto out;
  }
  const sp_plan *pl = &wp->plan;
  if ((ec = sp_cli_check_rank(r->cmd, rank, pl->world_size)) != SP_EXIT_OK)
    goto out;
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
    /* the runtime's part is the coordinator's; the plan it sends holds
     * units, not the spec's modules, so the trainer's part cannot be
     * counted here */
    sp_mem_estimate e;
    sp_train_mem tm = {0};
    sp_train_shape sh = {.grad_accum = 1};
    if (sp_wire_memory(wp->msg->memory, &e, &diag) != 0) {
      sp_cli_error(r->cmd, "the coordinator's memory model is malformed: %s",
                   diag.msg);
      ec = SP_EXIT_FAILURE;
    } else {
      tm.runtime = e;
      tm.not_counted =
          "the coordinator's plan carries units, not the spec: give "
          "--model M.json to count them";
      tm.footprint = SP_TRAIN_PROCESS_FOOTPRINT;
      tm.peak = e.acct.reserved.peak + tm.footprint;
      if (r->json) {
        if (sp_render_memory_json(pl, &wp->job, &src, &tm, &sh) != 0)
          ec = SP_EXIT_FAILURE;
      } else {
        sp_render_memory_text(pl, &wp->job, &src, &tm, &sh);
      }
    }
  } else if (r->json) {
    if (sp_render_plan_json(pl, &wp->job, &src, (long)rank, u) != 0)
      ec = SP_EXIT_FAILURE;
  } else {
    sp_render_plan_text(pl, &wp->job, &src, (long)rank, u);
  }
out:
  sp_wire_plan_free(wp);
  sp_remote_free_msg(j);
  sp_job_clear(&job);
  return sp_remote_finish(r, ec);
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
    1, 1, NULL};

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
        slices,
        json_pack("{s:i,s:o,s:I,s:I,s:I,s:I}", "shard", (int)sl->shard, "ranks",
                  ranks, "offset_in_shard", (json_int_t)sl->offset_in_shard,
                  "numel", (json_int_t)sl->numel, "intra_start",
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
  int ec = sp_remote_parse_args(&r, &k_where, argc, argv, NULL, 0, NULL, NULL,
                                &first, &n);
  if (ec != PROCEED) return ec;
  Shardplane__V1__LocateParamRequest q =
      SHARDPLANE__V1__LOCATE_PARAM_REQUEST__INIT;
  q.fqn = argv[first];
  ProtobufCMessage *m;
  ec = sp_remote_call(&r, SP_COORD_PATH("LocateParam"), &q.base,
                      &shardplane__v1__param_location__descriptor, &m);
  if (ec == SP_EXIT_OK) {
    const Shardplane__V1__ParamLocation *p =
        (const Shardplane__V1__ParamLocation *)m;
    if (r.json)
      ec = where_json(p);
    else
      print_where(p);
    sp_remote_free_msg(m);
  }
  return sp_remote_finish(&r, ec);
}

/* ------------------------------------------------------------------ */
/* buffers                                                             */
/* ------------------------------------------------------------------ */

static const subcmd k_buffers = {
    "buffers [--prefix P] [options]",
    "Every buffer by FQN: shape, original dtype, the dtype it is computed\n"
    "in, owner unit, persistent. Exit 3 when --prefix matches none.\n\n"
    "  --prefix P                   only FQNs that start with P\n",
    0, 0, NULL};

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
  int ec = sp_remote_parse_args(&r, &k_buffers, argc, argv, own, 1, buffers_opt,
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
    if ((ec = sp_remote_call(&r, SP_COORD_PATH("ListBuffers"), &q.base,
                             &shardplane__v1__list_buffers_response__descriptor,
                             &m)) != SP_EXIT_OK)
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
    sp_remote_free_msg(m);
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
        sp_render_json_out(
            json_pack("{s:i,s:O}", "total", (int)seen, "buffers", rows)) != 0)
      ec = SP_EXIT_FAILURE;
    json_decref(rows);
  }
  return sp_remote_finish(&r, ec);
}
