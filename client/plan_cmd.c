/* `shardplane plan`: the sharding plan, computed offline from a model spec
 * and a job (file and/or flags), as tables or JSON. */
#include <getopt.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "job.h"
#include "model.h"
#include "plan.h"

static const char k_plan_help[] =
    "usage: shardplane plan --model M.json [options]\n"
    "\n"
    "Computes the sharding plan offline and prints its units, per-rank\n"
    "shard sizes and the buffer table (FQN, original and compute dtype).\n"
    "\n"
    "  --model PATH               model spec (shardplane.model/v1)\n"
    "  --job PATH                 job config (shardplane.job/v1); flags "
    "override it\n"
    "  --world-size W             number of ranks (default 1)\n"
    "  --strategy S               FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | "
    "HYBRID_SHARD\n"
    "  --shard-group-size G       ranks per shard group (HYBRID_SHARD)\n"
    "  --wrap-type T              module type that becomes a unit "
    "(repeatable)\n"
    "  --wrap-module FQN          module that becomes a unit (repeatable)\n"
    "  --param-dtype D            mixed precision: unsharded param dtype\n"
    "  --reduce-dtype D           mixed precision: gradient reduce dtype\n"
    "  --buffer-dtype D           mixed precision: buffer compute dtype\n"
    "  --keep-low-precision-grads do not cast reduced grads back\n"
    "  --full-precision-type T    module type kept in full precision\n"
    "                             (repeatable; default BatchNorm*)\n"
    "  --use-orig-params          FSDP's aligned flat-parameter layout\n"
    "  --rank R                   also list rank R's shard, param by param\n"
    "  --unit U                   also list unit U (index or module FQN)\n"
    "  --json                     machine-readable output\n"
    "  --help                     this text\n"
    "\n"
    "exit codes: 0 ok, 1 bad spec or job, 2 bad usage, 3 rank/unit not "
    "found\n";

enum {
  OPT_MODEL = 256,
  OPT_JOB,
  OPT_WORLD,
  OPT_STRATEGY,
  OPT_GROUP,
  OPT_WRAP_TYPE,
  OPT_WRAP_MODULE,
  OPT_PARAM_DTYPE,
  OPT_REDUCE_DTYPE,
  OPT_BUFFER_DTYPE,
  OPT_KEEP_LOW,
  OPT_FP_TYPE,
  OPT_ORIG,
  OPT_RANK,
  OPT_UNIT,
  OPT_JSON,
  OPT_HELP,
};

static const struct option k_opts[] = {
    {"model", required_argument, NULL, OPT_MODEL},
    {"job", required_argument, NULL, OPT_JOB},
    {"world-size", required_argument, NULL, OPT_WORLD},
    {"strategy", required_argument, NULL, OPT_STRATEGY},
    {"shard-group-size", required_argument, NULL, OPT_GROUP},
    {"wrap-type", required_argument, NULL, OPT_WRAP_TYPE},
    {"wrap-module", required_argument, NULL, OPT_WRAP_MODULE},
    {"param-dtype", required_argument, NULL, OPT_PARAM_DTYPE},
    {"reduce-dtype", required_argument, NULL, OPT_REDUCE_DTYPE},
    {"buffer-dtype", required_argument, NULL, OPT_BUFFER_DTYPE},
    {"keep-low-precision-grads", no_argument, NULL, OPT_KEEP_LOW},
    {"full-precision-type", required_argument, NULL, OPT_FP_TYPE},
    {"use-orig-params", no_argument, NULL, OPT_ORIG},
    {"rank", required_argument, NULL, OPT_RANK},
    {"unit", required_argument, NULL, OPT_UNIT},
    {"json", no_argument, NULL, OPT_JSON},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

/* Flags are collected first and applied after --job is loaded, so flags
 * override the file whatever their order on the command line. */
typedef struct plan_args {
  const char *model, *job, *unit;
  long long world, group, rank;
  const char *strategy, *param, *reduce, *buffer;
  bool keep_low, orig, json;
  sp_strlist wrap_types, wrap_modules, fp_types;
} plan_args;

static int parse_uint(const char *s, long long max, long long *out) {
  char *end;
  long long v = strtoll(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < 0 || v > max) return -1;
  *out = v;
  return 0;
}

static int parse_dtype_flag(const char *flag, const char *s, sp_dtype *out) {
  if (s == NULL) return 0;
  if (sp_dtype_parse(s, out) != 0 || !sp_dtype_is_floating(*out)) {
    sp_cli_error("plan", "%s: \"%s\" is not a floating dtype (float32, "
                         "bfloat16, float16, float64)",
                 flag, s);
    return -1;
  }
  return 0;
}

static int apply_flags(const plan_args *a, sp_job *job) {
  if (a->world >= 0) job->world_size = (uint32_t)a->world;
  if (a->group >= 0) job->shard_group_size = (uint32_t)a->group;
  if (a->strategy != NULL && sp_strategy_parse(a->strategy, &job->strategy)) {
    sp_cli_error("plan", "--strategy: unknown strategy \"%s\"", a->strategy);
    return -1;
  }
  if (parse_dtype_flag("--param-dtype", a->param, &job->mp.param_dtype) ||
      parse_dtype_flag("--reduce-dtype", a->reduce, &job->mp.reduce_dtype) ||
      parse_dtype_flag("--buffer-dtype", a->buffer, &job->mp.buffer_dtype))
    return -1;
  if (a->param || a->reduce || a->buffer || a->keep_low) job->mp.enabled = true;
  if (a->keep_low) job->mp.keep_low_precision_grads = true;
  if (a->orig) job->use_orig_params = true;
  const struct {
    const sp_strlist *from;
    sp_strlist *to;
  } lists[] = {{&a->wrap_types, &job->wrap_types},
               {&a->wrap_modules, &job->wrap_modules},
               {&a->fp_types, &job->mp.full_precision_types}};
  for (size_t i = 0; i < 3; i++)
    for (size_t k = 0; k < lists[i].from->n; k++)
      if (sp_strlist_add(lists[i].to, lists[i].from->items[k]) != 0) {
        sp_cli_error("plan", "too many names");
        return -1;
      }
  if (a->fp_types.n > 0) job->mp.full_precision_types_set = true;
  return 0;
}

/* ---- shared numbers for both renderings ---- */

typedef struct rank_row {
  int64_t real, padding, bytes;
} rank_row;

static void rank_totals(const sp_plan *pl, uint32_t r, rank_row *row) {
  row->real = row->padding = row->bytes = 0;
  for (uint32_t u = 0; u < pl->n_units; u++) {
    int64_t s, e, pad;
    sp_plan_rank_range(pl, u, r, &s, &e, &pad);
    row->real += e - s;
    row->padding += pad;
    row->bytes += pl->units[u].shard_numel *
                  (int64_t)sp_dtype_size(pl->units[u].dtype);
  }
}

static int64_t model_elements(const sp_model *m) {
  int64_t n = 0;
  for (size_t i = 0; i < m->n_params; i++) n += m->params[i].numel;
  return n;
}

static const char *dtype_or(sp_dtype t, const char *none) {
  return t == SP_DTYPE_INVALID ? none : sp_dtype_name(t);
}

static void format_shape(const sp_tensor_spec *t, char *buf, size_t len) {
  size_t off = (size_t)snprintf(buf, len, "[");
  for (int d = 0; d < t->ndim && off < len; d++)
    off += (size_t)snprintf(buf + off, len - off, "%s%lld", d ? ", " : "",
                            (long long)t->shape[d]);
  if (off < len) snprintf(buf + off, len - off, "]");
}

static const char *unit_name(const sp_plan *pl, uint32_t u) {
  const char *f = sp_plan_unit_fqn(pl, u);
  return f[0] ? f : "(root)";
}

/* Finds a unit by index or module FQN; -1 when absent. */
static long find_unit(const sp_plan *pl, const char *s) {
  long long idx;
  if (parse_uint(s, (long long)pl->n_units - 1, &idx) == 0) return (long)idx;
  for (uint32_t u = 0; u < pl->n_units; u++)
    if (strcmp(sp_plan_unit_fqn(pl, u), s) == 0 ||
        (s[0] == '\0' && u == 0))
      return (long)u;
  return -1;
}

/* ---- human-readable ---- */

static void print_human(const sp_plan *pl, const sp_job *job, double ms,
                        long rank, long unit) {
  const sp_model *m = pl->model;
  printf("model   %s  (%s)\n", m->name, m->path);
  printf("        %zu modules, %zu parameters, %lld elements, %zu buffers\n",
         m->n_modules, m->n_params, (long long)model_elements(m), m->n_buffers);
  printf("job     world %u, %s", pl->world_size, sp_strategy_name(pl->strategy));
  if (pl->strategy == SP_HYBRID_SHARD)
    printf(" (shard groups of %u)", pl->shard_world);
  if (pl->strategy != job->strategy)
    printf(" (asked %s; FSDP uses NO_SHARD on one rank)",
           sp_strategy_name(job->strategy));
  if (job->mp.enabled)
    printf(", mixed precision param %s reduce %s buffer %s%s",
           dtype_or(job->mp.param_dtype, "-"),
           dtype_or(job->mp.reduce_dtype, "-"),
           dtype_or(job->mp.buffer_dtype, "-"),
           job->mp.keep_low_precision_grads ? " keep-low-precision-grads" : "");
  else
    printf(", no mixed precision");
  printf("%s\n", pl->use_orig_params ? ", use_orig_params" : "");
  printf("plan    version %s, %zu units, computed in %.2f ms\n\n",
         pl->version_hex, pl->n_units, ms);

  printf("%-4s %-40s %-20s %6s %14s %12s %-9s %-9s %-9s %-9s\n", "UNIT",
         "MODULE", "TYPE", "PARAMS", "ELEMENTS", "SHARD(c)", "DTYPE", "PARAM",
         "REDUCE", "BUFFER");
  for (uint32_t u = 0; u < pl->n_units; u++) {
    const sp_unit *x = &pl->units[u];
    printf("%-4u %-40s %-20s %6zu %14lld %12lld %-9s %-9s %-9s %-9s%s\n", u,
           unit_name(pl, u), m->modules[x->module].type, x->n_params,
           (long long)x->numel, (long long)x->shard_numel,
           dtype_or(x->dtype, "-"), dtype_or(x->param_dtype, "-"),
           dtype_or(x->reduce_dtype, "-"), dtype_or(x->buffer_dtype, "keep"),
           x->full_precision && job->mp.enabled ? "  (full precision)" : "");
  }

  /* Every rank holds the same padded size; only the real/padding split
   * differs, so runs of identical ranks are printed as one row. */
  printf("\n%-14s %16s %12s %16s\n", "RANKS", "REAL ELEMENTS", "PADDING",
         "SHARD BYTES");
  uint32_t start = 0;
  rank_row prev;
  rank_totals(pl, 0, &prev);
  for (uint32_t r = 1; r <= pl->world_size; r++) {
    rank_row cur = {0, 0, 0};
    if (r < pl->world_size) rank_totals(pl, r, &cur);
    if (r < pl->world_size && memcmp(&cur, &prev, sizeof cur) == 0) continue;
    char range[32];
    if (r - 1 == start)
      snprintf(range, sizeof range, "%u", start);
    else
      snprintf(range, sizeof range, "%u-%u", start, r - 1);
    printf("%-14s %16lld %12lld %16lld\n", range, (long long)prev.real,
           (long long)prev.padding, (long long)prev.bytes);
    start = r;
    prev = cur;
  }

  printf("\n%-56s %-18s %-9s %-9s %4s %s\n", "BUFFER", "SHAPE", "ORIGINAL",
         "COMPUTE", "UNIT", "PERSISTENT");
  for (size_t i = 0; i < pl->n_buffers; i++) {
    const sp_plan_buffer *b = &pl->buffers[i];
    const sp_tensor_spec *t = &m->buffers[b->buffer];
    char shape[96];
    format_shape(t, shape, sizeof shape);
    printf("%-56s %-18s %-9s %-9s %4d %s\n", t->fqn, shape,
           sp_dtype_name(b->orig_dtype), sp_dtype_name(b->compute_dtype),
           b->unit, b->persistent ? "yes" : "no");
  }
  if (pl->n_aliases > 0) {
    printf("\n%-56s %s\n", "SHARED PARAMETER", "FLATTENED AS");
    for (size_t a = 0; a < pl->n_aliases; a++)
      printf("%-56s %s\n", pl->aliases[a].fqn,
             pl->entries[pl->param_entry[pl->aliases[a].param]].fqn);
  }

  if (unit >= 0) {
    const sp_unit *x = &pl->units[unit];
    printf("\nunit %ld (%s): N=%lld, c=%lld\n%-56s %-18s %12s %12s\n", unit,
           unit_name(pl, (uint32_t)unit), (long long)x->numel,
           (long long)x->shard_numel, "PARAMETER", "SHAPE", "OFFSET", "NUMEL");
    for (size_t e = x->first_entry; e < x->first_entry + x->n_entries; e++) {
      const sp_flat_entry *fe = &pl->entries[e];
      char shape[96] = "-";
      if (fe->param >= 0) format_shape(&m->params[fe->param], shape, sizeof shape);
      printf("%-56s %-18s %12lld %12lld\n",
             fe->param >= 0 ? fe->fqn : "(alignment padding)", shape,
             (long long)fe->offset, (long long)fe->numel);
    }
    printf("%-8s %14s %14s %10s\n", "RANK", "START", "END", "PADDING");
    for (uint32_t r = 0; r < pl->world_size; r++) {
      int64_t s, e, pad;
      sp_plan_rank_range(pl, (uint32_t)unit, r, &s, &e, &pad);
      printf("%-8u %14lld %14lld %10lld\n", r, (long long)s, (long long)e,
             (long long)pad);
    }
  }

  if (rank >= 0) {
    printf("\nrank %ld shard\n%-4s %-56s %12s %12s %12s %12s\n", rank, "UNIT",
           "PARAMETER", "SHARD OFF", "NUMEL", "INTRA START", "INTRA END");
    for (uint32_t u = 0; u < pl->n_units; u++) {
      size_t n;
      sp_plan_shard_params(pl, u, (uint32_t)rank, NULL, 0, &n);
      sp_shard_param *sp = calloc(n ? n : 1, sizeof *sp);
      if (sp == NULL) return;
      sp_plan_shard_params(pl, u, (uint32_t)rank, sp, n, &n);
      for (size_t i = 0; i < n; i++)
        printf("%-4u %-56s %12lld %12lld %12lld %12lld\n", u,
               pl->entries[sp[i].entry].fqn, (long long)sp[i].offset_in_shard,
               (long long)sp[i].numel_in_shard, (long long)sp[i].intra_start,
               (long long)sp[i].intra_end);
      free(sp);
    }
  }
}

/* ---- JSON ---- */

static json_t *shape_json(const sp_tensor_spec *t) {
  json_t *a = json_array();
  for (int d = 0; d < t->ndim; d++)
    json_array_append_new(a, json_integer(t->shape[d]));
  return a;
}

static json_t *dtype_json(sp_dtype t) {
  return t == SP_DTYPE_INVALID ? json_null() : json_string(sp_dtype_name(t));
}

static json_t *unit_json(const sp_plan *pl, uint32_t u) {
  const sp_unit *x = &pl->units[u];
  const sp_model *m = pl->model;
  json_t *params = json_array();
  for (size_t e = x->first_entry; e < x->first_entry + x->n_entries; e++) {
    const sp_flat_entry *fe = &pl->entries[e];
    json_t *o = fe->param >= 0
                    ? json_pack("{s:s,s:o,s:I,s:I}", "fqn", fe->fqn, "shape",
                                shape_json(&m->params[fe->param]), "offset",
                                (json_int_t)fe->offset, "numel",
                                (json_int_t)fe->numel)
                    : json_pack("{s:b,s:I,s:I}", "padding", 1, "offset",
                                (json_int_t)fe->offset, "numel",
                                (json_int_t)fe->numel);
    json_array_append_new(params, o);
  }
  return json_pack(
      "{s:i,s:s,s:s,s:i,s:o,s:b,s:I,s:I,s:o,s:{s:b,s:b,s:o,s:o,s:o,s:b}}",
      "index", (int)u, "module", sp_plan_unit_fqn(pl, u), "type",
      m->modules[x->module].type, "parent", (int)x->parent, "dtype",
      dtype_json(x->dtype), "requires_grad", x->requires_grad, "numel",
      (json_int_t)x->numel, "shard_numel", (json_int_t)x->shard_numel,
      "params", params, "mixed_precision", "enabled", x->mixed_precision,
      "full_precision", x->full_precision, "param_dtype",
      dtype_json(x->param_dtype), "reduce_dtype", dtype_json(x->reduce_dtype),
      "buffer_dtype", dtype_json(x->buffer_dtype), "keep_low_precision_grads",
      x->keep_low_precision_grads);
}

static json_t *shard_json(const sp_plan *pl, uint32_t r) {
  json_t *out = json_array();
  for (uint32_t u = 0; u < pl->n_units; u++) {
    size_t n;
    sp_plan_shard_params(pl, u, r, NULL, 0, &n);
    sp_shard_param *sp = calloc(n ? n : 1, sizeof *sp);
    if (sp == NULL) break;
    sp_plan_shard_params(pl, u, r, sp, n, &n);
    int64_t s, e, pad;
    sp_plan_rank_range(pl, u, r, &s, &e, &pad);
    json_t *ps = json_array();
    for (size_t i = 0; i < n; i++)
      json_array_append_new(
          ps, json_pack("{s:s,s:I,s:I,s:I,s:I}", "fqn",
                        pl->entries[sp[i].entry].fqn, "offset_in_shard",
                        (json_int_t)sp[i].offset_in_shard, "numel_in_shard",
                        (json_int_t)sp[i].numel_in_shard, "intra_start",
                        (json_int_t)sp[i].intra_start, "intra_end",
                        (json_int_t)sp[i].intra_end));
    free(sp);
    json_array_append_new(
        out, json_pack("{s:i,s:I,s:I,s:I,s:o}", "unit", (int)u, "start",
                       (json_int_t)s, "end", (json_int_t)e, "padding",
                       (json_int_t)pad, "params", ps));
  }
  return out;
}

static int print_json(const sp_plan *pl, const sp_job *job, long rank,
                      long unit) {
  const sp_model *m = pl->model;
  json_t *units = json_array(), *ranks = json_array(), *bufs = json_array(),
         *aliases = json_array();
  for (uint32_t u = 0; u < pl->n_units; u++)
    if (unit < 0 || (long)u == unit) json_array_append_new(units, unit_json(pl, u));
  for (uint32_t r = 0; r < pl->world_size; r++) {
    rank_row row;
    rank_totals(pl, r, &row);
    json_array_append_new(
        ranks, json_pack("{s:i,s:I,s:I,s:I}", "rank", (int)r, "real",
                         (json_int_t)row.real, "padding",
                         (json_int_t)row.padding, "bytes",
                         (json_int_t)row.bytes));
  }
  for (size_t i = 0; i < pl->n_buffers; i++) {
    const sp_plan_buffer *b = &pl->buffers[i];
    const sp_tensor_spec *t = &m->buffers[b->buffer];
    json_array_append_new(
        bufs, json_pack("{s:s,s:o,s:s,s:s,s:i,s:b}", "fqn", t->fqn, "shape",
                        shape_json(t), "original_dtype",
                        sp_dtype_name(b->orig_dtype), "compute_dtype",
                        sp_dtype_name(b->compute_dtype), "unit", (int)b->unit,
                        "persistent", b->persistent));
  }
  for (size_t a = 0; a < pl->n_aliases; a++)
    json_array_append_new(
        aliases,
        json_pack("{s:s,s:s}", "fqn", pl->aliases[a].fqn, "flattened_as",
                  pl->entries[pl->param_entry[pl->aliases[a].param]].fqn));
  json_t *root = json_pack(
      "{s:s,s:{s:s,s:s},s:{s:i,s:s,s:s,s:i,s:b},s:o,s:o,s:o,s:o}", "version",
      pl->version_hex, "model", "name", m->name, "path", m->path, "job",
      "world_size", (int)pl->world_size, "strategy",
      sp_strategy_name(pl->strategy), "requested_strategy",
      sp_strategy_name(job->strategy), "shard_world", (int)pl->shard_world,
      "use_orig_params", pl->use_orig_params, "units", units, "ranks", ranks,
      "buffers", bufs, "aliases", aliases);
  if (root == NULL) return -1;
  if (rank >= 0) json_object_set_new(root, "shard", shard_json(pl, (uint32_t)rank));
  int rc = json_dumpf(root, stdout, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
  putchar('\n');
  json_decref(root);
  return rc;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

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
  if (a->job != NULL && sp_job_load_file(a->job, &job, &diag) != 0) {
    sp_cli_error("plan", "%s", diag.msg);
    goto out;
  }
  if (apply_flags(a, &job) != 0) {
    exit_code = SP_EXIT_USAGE;
    goto out;
  }
  double t0 = now_ms();
  if (sp_plan_build(model, &job, &plan, &diag) != 0) {
    sp_cli_error("plan", "%s", diag.msg);
    goto out;
  }
  double ms = now_ms() - t0;
  if (a->rank >= (long long)plan->world_size) {
    sp_cli_error("plan", "--rank %lld: the world has ranks 0-%u", a->rank,
                 plan->world_size - 1);
    exit_code = SP_EXIT_NOT_FOUND;
    goto out;
  }
  long unit = -1;
  if (a->unit != NULL && (unit = find_unit(plan, a->unit)) < 0) {
    sp_cli_error("plan", "--unit %s: no such unit (%zu units)", a->unit,
                 plan->n_units);
    exit_code = SP_EXIT_NOT_FOUND;
    goto out;
  }
  if (a->json) {
    if (print_json(plan, &job, (long)a->rank, unit) != 0) goto out;
  } else {
    print_human(plan, &job, ms, (long)a->rank, unit);
  }
  exit_code = fflush(stdout) == 0 ? SP_EXIT_OK : SP_EXIT_FAILURE;
out:
  sp_plan_free(plan);
  sp_model_free(model);
  sp_job_clear(&job);
  return exit_code;
}

int sp_cmd_plan(int argc, char **argv) {
  plan_args a = {.world = -1, .group = -1, .rank = -1};
  int exit_code = SP_EXIT_USAGE;
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", k_opts, NULL)) != -1) {
    sp_strlist *list = NULL;
    switch (c) {
    case OPT_MODEL: a.model = optarg; break;
    case OPT_JOB: a.job = optarg; break;
    case OPT_STRATEGY: a.strategy = optarg; break;
    case OPT_PARAM_DTYPE: a.param = optarg; break;
    case OPT_REDUCE_DTYPE: a.reduce = optarg; break;
    case OPT_BUFFER_DTYPE: a.buffer = optarg; break;
    case OPT_KEEP_LOW: a.keep_low = true; break;
    case OPT_ORIG: a.orig = true; break;
    case OPT_JSON: a.json = true; break;
    case OPT_UNIT: a.unit = optarg; break;
    case OPT_WRAP_TYPE: list = &a.wrap_types; break;
    case OPT_WRAP_MODULE: list = &a.wrap_modules; break;
    case OPT_FP_TYPE: list = &a.fp_types; break;
    case OPT_WORLD:
      if (parse_uint(optarg, SP_JOB_MAX_WORLD, &a.world) != 0 || a.world == 0) {
        sp_cli_error("plan", "--world-size: expected 1..%u, got \"%s\"",
                     SP_JOB_MAX_WORLD, optarg);
        goto out;
      }
      break;
    case OPT_GROUP:
      if (parse_uint(optarg, SP_JOB_MAX_WORLD, &a.group) != 0 || a.group == 0) {
        sp_cli_error("plan", "--shard-group-size: expected 1..%u, got \"%s\"",
                     SP_JOB_MAX_WORLD, optarg);
        goto out;
      }
      break;
    case OPT_RANK:
      if (parse_uint(optarg, SP_JOB_MAX_WORLD, &a.rank) != 0) {
        sp_cli_error("plan", "--rank: expected a rank number, got \"%s\"",
                     optarg);
        goto out;
      }
      break;
    case OPT_HELP:
      fputs(k_plan_help, stdout);
      exit_code = SP_EXIT_OK;
      goto out;
    default:
      fputs(k_plan_help, stderr);
      goto out;
    }
    if (list != NULL && sp_strlist_add(list, optarg) != 0) {
      sp_cli_error("plan", "too many names");
      goto out;
    }
  }
  if (optind < argc) {
    sp_cli_error("plan", "unexpected argument \"%s\"", argv[optind]);
    goto out;
  }
  if (a.model == NULL) {
    sp_cli_error("plan", "--model is required (asking a running coordinator "
                         "for its plan needs the coordinator service)");
    goto out;
  }
  exit_code = run_plan(&a);
out:
  sp_strlist_clear(&a.wrap_types);
  sp_strlist_clear(&a.wrap_modules);
  sp_strlist_clear(&a.fp_types);
  return exit_code;
}
