/* Tables and JSON shared by the offline plan and the remote subcommands. */
#include "render.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* ---- small pieces ---- */

static const char *dtype_or(sp_dtype t, const char *none) {
  return t == SP_DTYPE_INVALID ? none : sp_dtype_name(t);
}

json_t *sp_render_dtype_json(sp_dtype t) {
  return t == SP_DTYPE_INVALID ? json_null() : json_string(sp_dtype_name(t));
}

void sp_render_shape(size_t ndim, const int64_t *shape, char *buf, size_t len) {
  size_t off = (size_t)snprintf(buf, len, "[");
  for (size_t d = 0; d < ndim && off < len; d++)
    off += (size_t)snprintf(buf + off, len - off, "%s%lld", d ? ", " : "",
                            (long long)shape[d]);
  if (off < len) snprintf(buf + off, len - off, "]");
}

json_t *sp_render_shape_json(size_t ndim, const int64_t *shape) {
  json_t *a = json_array();
  for (size_t d = 0; d < ndim; d++)
    json_array_append_new(a, json_integer(shape[d]));
  return a;
}

int sp_render_json_out(json_t *root) {
  if (root == NULL) return -1;
  int rc = json_dumpf(root, stdout, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
  json_decref(root);
  if (putchar('\n') == EOF) rc = -1;
  return rc;
}

static const char *unit_name(const sp_plan *pl, uint32_t u) {
  const char *f = sp_plan_unit_fqn(pl, u);
  return f[0] ? f : "(root)";
}

long sp_plan_find_unit(const sp_plan *pl, const char *s) {
  long long idx;
  if (pl->n_units > 0 &&
      sp_cli_parse_uint(s, (long long)pl->n_units - 1, &idx) == 0)
    return (long)idx;
  for (uint32_t u = 0; u < pl->n_units; u++)
    if (strcmp(sp_plan_unit_fqn(pl, u), s) == 0) return (long)u;
  return -1;
}

/* ---- job ---- */

void sp_render_job_line(const sp_job *job, sp_strategy effective) {
  printf("world %u, %s", job->world_size, sp_strategy_name(effective));
  if (effective == SP_HYBRID_SHARD)
    printf(" (shard groups of %u)", job->shard_group_size);
  if (effective != job->strategy)
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
  if (job->use_orig_params) printf(", use_orig_params");
}

json_t *sp_render_job_json(const sp_job *job, sp_strategy effective,
                           uint32_t shard_world) {
  json_t *j = json_pack(
      "{s:i,s:s,s:s,s:b,s:s,s:{s:b,s:o,s:o,s:o,s:b}}", "world_size",
      (int)job->world_size, "strategy", sp_strategy_name(effective),
      "requested_strategy", sp_strategy_name(job->strategy), "use_orig_params",
      job->use_orig_params, "backend", sp_backend_name(job->backend),
      "mixed_precision", "enabled", job->mp.enabled, "param_dtype",
      sp_render_dtype_json(job->mp.param_dtype), "reduce_dtype",
      sp_render_dtype_json(job->mp.reduce_dtype), "buffer_dtype",
      sp_render_dtype_json(job->mp.buffer_dtype), "keep_low_precision_grads",
      job->mp.keep_low_precision_grads);
  if (j != NULL && shard_world > 0)
    json_object_set_new(j, "shard_world", json_integer(shard_world));
  return j;
}

/* ---- buffers ---- */

void sp_render_buffer_header(void) {
  printf("%-56s %-18s %-9s %-9s %4s %s\n", "BUFFER", "SHAPE", "ORIGINAL",
         "COMPUTE", "UNIT", "PERSISTENT");
}

void sp_render_buffer_row(const sp_buffer_row *b) {
  char shape[96];
  sp_render_shape(b->ndim, b->shape, shape, sizeof shape);
  printf("%-56s %-18s %-9s %-9s %4lld %s\n", b->fqn, shape,
         sp_dtype_name(b->orig_dtype), sp_dtype_name(b->compute_dtype),
         (long long)b->unit, b->persistent ? "yes" : "no");
}

json_t *sp_render_buffer_json(const sp_buffer_row *b) {
  return json_pack("{s:s,s:o,s:s,s:s,s:I,s:b}", "fqn", b->fqn, "shape",
                   sp_render_shape_json(b->ndim, b->shape), "original_dtype",
                   sp_dtype_name(b->orig_dtype), "compute_dtype",
                   sp_dtype_name(b->compute_dtype), "unit", (json_int_t)b->unit,
                   "persistent", b->persistent);
}

static sp_buffer_row plan_buffer_row(const sp_plan *pl, size_t i) {
  const sp_plan_buffer *b = &pl->buffers[i];
  const sp_tensor_spec *t = &pl->model->buffers[b->buffer];
  return (sp_buffer_row){t->fqn,        (size_t)t->ndim,  t->shape,
                         b->orig_dtype, b->compute_dtype, b->unit,
                         b->persistent};
}

/* ---- numbers shared by both renderings ---- */

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
    row->bytes +=
        pl->units[u].shard_numel * (int64_t)sp_dtype_size(pl->units[u].dtype);
  }
}

/* rank's shard of unit u, parameter by parameter; NULL (and *n 0) when the
 * shard holds none or memory runs out. The caller frees. */
static sp_shard_param *shard_params(const sp_plan *pl, uint32_t u,
                                    uint32_t rank, size_t *n) {
  sp_plan_shard_params(pl, u, rank, NULL, 0, n);
  sp_shard_param *sp = *n ? calloc(*n, sizeof *sp) : NULL;
  if (sp == NULL)
    *n = 0;
  else
    sp_plan_shard_params(pl, u, rank, sp, *n, n);
  return sp;
}

/* ---- human-readable ---- */

static void plan_header(const sp_plan *pl, const sp_job *job,
                        const sp_plan_source *src) {
  const sp_model *m = pl->model;
  printf("model   %s  (", m->name);
  if (src->model_path != NULL)
    printf("%s)\n", src->model_path);
  else
    printf("coordinator %s)\n", src->coordinator ? src->coordinator : "?");
  printf("        %zu modules, %zu parameters, %lld elements, %zu buffers\n",
         src->n_modules, src->n_params, (long long)src->elements,
         src->n_buffers);
  printf("job     ");
  sp_render_job_line(job, pl->strategy);
  printf("\nplan    version %s, %zu units", pl->version_hex, pl->n_units);
  if (src->build_ms >= 0) printf(", computed in %.2f ms", src->build_ms);
  printf("\n");
}

void sp_render_plan_text(const sp_plan *pl, const sp_job *job,
                         const sp_plan_source *src, long rank, long unit) {
  const sp_model *m = pl->model;
  plan_header(pl, job, src);
  printf("\n");

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

  printf("\n");
  sp_render_buffer_header();
  for (size_t i = 0; i < pl->n_buffers; i++) {
    sp_buffer_row row = plan_buffer_row(pl, i);
    sp_render_buffer_row(&row);
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
      if (fe->param >= 0) {
        const sp_tensor_spec *t = &m->params[fe->param];
        sp_render_shape((size_t)t->ndim, t->shape, shape, sizeof shape);
      }
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
      sp_shard_param *sp = shard_params(pl, u, (uint32_t)rank, &n);
      for (size_t i = 0; i < n; i++)
        printf("%-4u %-56s %12lld %12lld %12lld %12lld\n", u,
               pl->entries[sp[i].entry].fqn, (long long)sp[i].offset_in_shard,
               (long long)sp[i].numel_in_shard, (long long)sp[i].intra_start,
               (long long)sp[i].intra_end);
      free(sp);
    }
  }
}

/* ---- memory ---- */

/* "59.3 MiB" */
static void human_bytes(uint64_t b, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%llu B", (unsigned long long)b);
  else
    snprintf(buf, len, "%.1f %s", v, units[u]);
}

static void memory_row(const char *label, uint64_t peak, uint64_t current) {
  char hp[32], hc[32];
  human_bytes(peak, hp, sizeof hp);
  human_bytes(current, hc, sizeof hc);
  printf("%-28s %16llu %12s %16llu %12s\n", label, (unsigned long long)peak, hp,
         (unsigned long long)current, hc);
}

static void bytes_row(const char *label, uint64_t b) {
  char h[32];
  human_bytes(b, h, sizeof h);
  printf("%-28s %16llu %12s\n", label, (unsigned long long)b, h);
}

/* The trainer's part of plan --memory. */
static void trainer_text(const sp_train_mem *tm, const sp_train_shape *sh) {
  if (tm->family == NULL) {
    printf(
        "\nactivations: not counted (%s);\nwhole peak per rank without "
        "them: runtime reserved plus the process, ",
        tm->not_counted ? tm->not_counted : "no family the trainer runs");
    char h[32];
    human_bytes(tm->peak, h, sizeof h);
    printf("%s\n", h);
    return;
  }
  if (tm->seq_len)
    printf(
        "\ntrainer  %s, micro-batch of %llu x %u tokens a rank (global "
        "batch %u, %u micro-batch%s a step), checkpointing %s, %s\n\n",
        tm->family, (unsigned long long)tm->micro_batch, tm->seq_len,
        sh->global_batch, sh->grad_accum, sh->grad_accum == 1 ? "" : "es",
        sh->checkpointing ? "on" : "off", sh->device ? "cuda" : "cpu");
  else
    printf(
        "\ntrainer  %s, micro-batch of %llu samples a rank (global batch "
        "%u, %u micro-batch%s a step), %s\n\n",
        tm->family, (unsigned long long)tm->micro_batch, sh->global_batch,
        sh->grad_accum, sh->grad_accum == 1 ? "" : "es",
        sh->device ? "cuda" : "cpu");
  printf("%-28s %16s\n", "CATEGORY", "BYTES");
  for (int k = 0; k < SP_ACT_N_CATS; k++)
    bytes_row(sp_act_cat_label((sp_act_cat)k), tm->act.cat[k]);
  bytes_row("activations in all", tm->act.total);
  bytes_row("process footprint", tm->footprint);
  bytes_row("whole peak per rank", tm->peak);
  printf(
      "\nThe trainer holds its activations for the whole run; the whole "
      "peak adds them\nand the worker process's own footprint to the "
      "runtime's reserved peak.\n%s",
      sh->device ? "On a GPU the device holds the runtime and the "
                   "activations, the host the process.\n"
                 : "");
}

void sp_render_memory_text(const sp_plan *pl, const sp_job *job,
                           const sp_plan_source *src, const sp_train_mem *tm,
                           const sp_train_shape *shape) {
  const sp_mem_estimate *e = &tm->runtime;
  plan_header(pl, job, src);
  printf(
      "memory  per rank (every rank holds c elements of every unit); "
      "optimizer %s, limiter %u, backward prefetch %s, no_sync %s\n\n",
      sp_mem_optimizer_name(e->opts.optimizer), e->opts.max_inflight,
      e->opts.backward_prefetch ? "on" : "off", e->opts.no_sync ? "on" : "off");
  printf("%-28s %16s %12s %16s %12s\n", "CATEGORY", "PEAK BYTES", "PEAK",
         "AFTER STEP 2", "");
  for (int k = 0; k < SP_MEM_N_CATS; k++)
    memory_row(sp_mem_cat_label((sp_mem_cat)k), e->acct.cat[k].peak,
               e->acct.cat[k].current);
  memory_row("total in use", e->acct.total.peak, e->acct.total.current);
  memory_row("reserved (pool included)", e->acct.reserved.peak,
             e->acct.reserved.current);
  char h[32];
  human_bytes(e->sharded_state, h, sizeof h);
  printf("\nsharded state (falls as 1/W)  %16llu %12s\n",
         (unsigned long long)e->sharded_state, h);
  human_bytes(e->in_flight_floor, h, sizeof h);
  printf("in-flight floor               %16llu %12s\n",
         (unsigned long long)e->in_flight_floor, h);
  printf(
      "\nEach category's peak is its own maximum; total is the peak of "
      "the sum.\nreserved adds the blocks the pool keeps cached: what "
      "the process holds.\nThe floor: buffers, the root unit's "
      "parameters and gradient, and %u times\nthe largest other unit's "
      "parameters, gradient and reduce buffers.\n",
      e->opts.max_inflight);
  if (pl->shard_world == 1)
    printf(
        "Nothing is sharded (one rank per shard group, run as NO_SHARD): the\n"
        "unsharded parameters and gradients are the shards themselves, except\n"
        "where mixed precision keeps them in another dtype.\n");
  trainer_text(tm, shape);
}

static json_t *mem_bytes_json(const sp_mem_bytes *b) {
  return json_pack("{s:I,s:I}", "peak", (json_int_t)b->peak, "current",
                   (json_int_t)b->current);
}

static json_t *trainer_json(const sp_train_mem *tm, const sp_train_shape *sh) {
  if (tm->family == NULL) return json_null();
  json_t *cats = json_object();
  for (int k = 0; k < SP_ACT_N_CATS; k++)
    json_object_set_new(cats, sp_act_cat_name((sp_act_cat)k),
                        json_integer((json_int_t)tm->act.cat[k]));
  return json_pack(
      "{s:s,s:I,s:I,s:I,s:I,s:b,s:s,s:o,s:I,s:I,s:I}", "family", tm->family,
      "micro_batch", (json_int_t)tm->micro_batch, "seq_len",
      (json_int_t)tm->seq_len, "global_batch", (json_int_t)sh->global_batch,
      "grad_accum", (json_int_t)sh->grad_accum, "checkpointing",
      sh->checkpointing, "device", sh->device ? "cuda" : "cpu", "categories",
      cats, "activations", (json_int_t)tm->act.total, "footprint",
      (json_int_t)tm->footprint, "peak", (json_int_t)tm->peak);
}

int sp_render_memory_json(const sp_plan *pl, const sp_job *job,
                          const sp_plan_source *src, const sp_train_mem *tm,
                          const sp_train_shape *shape) {
  const sp_mem_estimate *e = &tm->runtime;
  json_t *cats = json_object();
  for (int k = 0; k < SP_MEM_N_CATS; k++)
    json_object_set_new(cats, sp_mem_cat_name((sp_mem_cat)k),
                        mem_bytes_json(&e->acct.cat[k]));
  json_t *mem = json_pack(
      "{s:s,s:I,s:b,s:b,s:o,s:o,s:o,s:I,s:I,s:I}", "optimizer",
      sp_mem_optimizer_name(e->opts.optimizer), "max_inflight",
      (json_int_t)e->opts.max_inflight, "backward_prefetch",
      e->opts.backward_prefetch, "no_sync", e->opts.no_sync, "categories", cats,
      "total", mem_bytes_json(&e->acct.total), "reserved",
      mem_bytes_json(&e->acct.reserved), "allocs", (json_int_t)e->acct.allocs,
      "sharded_state", (json_int_t)e->sharded_state, "in_flight_floor",
      (json_int_t)e->in_flight_floor);
  if (mem != NULL) {
    json_object_set_new(mem, "trainer", trainer_json(tm, shape));
    if (tm->family == NULL && tm->not_counted)
      json_object_set_new(mem, "trainer_not_counted",
                          json_string(tm->not_counted));
    json_object_set_new(mem, "peak", json_integer((json_int_t)tm->peak));
  }
  json_t *model =
      json_pack("{s:s,s:o,s:I}", "name", pl->model->name, "path",
                src->model_path ? json_string(src->model_path) : json_null(),
                "elements", (json_int_t)src->elements);
  if (model != NULL && src->coordinator != NULL)
    json_object_set_new(model, "coordinator", json_string(src->coordinator));
  json_t *root = json_pack(
      "{s:s,s:o,s:o,s:o}", "version", pl->version_hex, "model", model, "job",
      sp_render_job_json(job, pl->strategy, pl->shard_world), "memory", mem);
  return sp_render_json_out(root);
}

/* ---- JSON ---- */

static json_t *unit_json(const sp_plan *pl, uint32_t u) {
  const sp_unit *x = &pl->units[u];
  const sp_model *m = pl->model;
  json_t *params = json_array();
  for (size_t e = x->first_entry; e < x->first_entry + x->n_entries; e++) {
    const sp_flat_entry *fe = &pl->entries[e];
    json_t *o;
    if (fe->param >= 0) {
      const sp_tensor_spec *t = &m->params[fe->param];
      o = json_pack("{s:s,s:o,s:I,s:I}", "fqn", fe->fqn, "shape",
                    sp_render_shape_json((size_t)t->ndim, t->shape), "offset",
                    (json_int_t)fe->offset, "numel", (json_int_t)fe->numel);
    } else {
      o = json_pack("{s:b,s:I,s:I}", "padding", 1, "offset",
                    (json_int_t)fe->offset, "numel", (json_int_t)fe->numel);
    }
    json_array_append_new(params, o);
  }
  return json_pack(
      "{s:i,s:s,s:s,s:i,s:o,s:b,s:I,s:I,s:o,s:{s:b,s:b,s:o,s:o,s:o,s:b}}",
      "index", (int)u, "module", sp_plan_unit_fqn(pl, u), "type",
      m->modules[x->module].type, "parent", (int)x->parent, "dtype",
      sp_render_dtype_json(x->dtype), "requires_grad", x->requires_grad,
      "numel", (json_int_t)x->numel, "shard_numel", (json_int_t)x->shard_numel,
      "params", params, "mixed_precision", "enabled", x->mixed_precision,
      "full_precision", x->full_precision, "param_dtype",
      sp_render_dtype_json(x->param_dtype), "reduce_dtype",
      sp_render_dtype_json(x->reduce_dtype), "buffer_dtype",
      sp_render_dtype_json(x->buffer_dtype), "keep_low_precision_grads",
      x->keep_low_precision_grads);
}

static json_t *shard_json(const sp_plan *pl, uint32_t r) {
  json_t *out = json_array();
  for (uint32_t u = 0; u < pl->n_units; u++) {
    size_t n;
    sp_shard_param *sp = shard_params(pl, u, r, &n);
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

int sp_render_plan_json(const sp_plan *pl, const sp_job *job,
                        const sp_plan_source *src, long rank, long unit) {
  json_t *units = json_array(), *ranks = json_array(), *bufs = json_array(),
         *aliases = json_array();
  for (uint32_t u = 0; u < pl->n_units; u++)
    if (unit < 0 || (long)u == unit)
      json_array_append_new(units, unit_json(pl, u));
  for (uint32_t r = 0; r < pl->world_size; r++) {
    rank_row row;
    rank_totals(pl, r, &row);
    json_array_append_new(ranks, json_pack("{s:i,s:I,s:I,s:I}", "rank", (int)r,
                                           "real", (json_int_t)row.real,
                                           "padding", (json_int_t)row.padding,
                                           "bytes", (json_int_t)row.bytes));
  }
  for (size_t i = 0; i < pl->n_buffers; i++) {
    sp_buffer_row row = plan_buffer_row(pl, i);
    json_array_append_new(bufs, sp_render_buffer_json(&row));
  }
  for (size_t a = 0; a < pl->n_aliases; a++)
    json_array_append_new(
        aliases,
        json_pack("{s:s,s:s}", "fqn", pl->aliases[a].fqn, "flattened_as",
                  pl->entries[pl->param_entry[pl->aliases[a].param]].fqn));
  json_t *model = json_pack(
      "{s:s,s:o,s:i,s:i,s:I,s:i}", "name", pl->model->name, "path",
      src->model_path ? json_string(src->model_path) : json_null(), "modules",
      (int)src->n_modules, "params", (int)src->n_params, "elements",
      (json_int_t)src->elements, "buffers", (int)src->n_buffers);
  if (model != NULL && src->coordinator != NULL)
    json_object_set_new(model, "coordinator", json_string(src->coordinator));
  json_t *root = json_pack(
      "{s:s,s:o,s:o,s:o,s:o,s:o,s:o}", "version", pl->version_hex, "model",
      model, "job", sp_render_job_json(job, pl->strategy, pl->shard_world),
      "units", units, "ranks", ranks, "buffers", bufs, "aliases", aliases);
  if (root != NULL && rank >= 0)
    json_object_set_new(root, "shard", shard_json(pl, (uint32_t)rank));
  return sp_render_json_out(root);
}
