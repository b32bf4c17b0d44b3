/* Tables and JSON of the `shardplane` command. The offline plan and the
 * remote subcommands print through these functions, so each table and each
 * JSON object is written once: a plan fetched from a coordinator is rebuilt
 * into the structs of common/plan/plan.h (plan_wire.c) and printed exactly
 * as a plan computed here. Everything prints to stdout. */
#ifndef SP_RENDER_H
#define SP_RENDER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "plan/job.h"
#include "plan/memory.h"
#include "plan/plan.h"
#include "worker/train_memory.h"

/* What the plan header says beyond the plan itself. */
typedef struct sp_plan_source {
  const char *model_path;  /* the spec file, or NULL for a remote plan */
  const char *coordinator; /* "host:port" a remote plan came from, or NULL */
  size_t n_modules, n_params, n_buffers;
  int64_t elements;
  double build_ms; /* < 0: not computed here */
} sp_plan_source;

/* The whole plan (units, rank totals, buffers, shared parameters), plus
 * unit `unit`'s flat parameter and rank `rank`'s shard when >= 0 (both must
 * be in range). */
void sp_render_plan_text(const sp_plan *pl, const sp_job *job,
                         const sp_plan_source *src, long rank, long unit);
/* The same as one JSON document; -1 when it cannot be built or written. */
int sp_render_plan_json(const sp_plan *pl, const sp_job *job,
                        const sp_plan_source *src, long rank, long unit);

/* `plan --memory`: the plan's header lines, then the memory model's
 * prediction per rank by category (peak and after the steps), the total in
 * use and reserved, the sharded state and the in-flight floor (tm->runtime);
 * then the trainer's activations for the batch shape by category, the
 * process footprint and the whole peak per rank, or that activations are
 * not counted for a spec the trainer does not run. */
void sp_render_memory_text(const sp_plan *pl, const sp_job *job,
                           const sp_plan_source *src, const sp_train_mem *tm,
                           const sp_train_shape *shape);
/* The same as JSON: {"version", "model", "job", "memory": {...,
 * "trainer": {...} or null}}; -1 when it cannot be built or written. */
int sp_render_memory_json(const sp_plan *pl, const sp_job *job,
                          const sp_plan_source *src, const sp_train_mem *tm,
                          const sp_train_shape *shape);

/* A unit by index or wrapped-module FQN ("" is the root); -1 when absent. */
long sp_plan_find_unit(const sp_plan *pl, const char *s);

/* "world 4, FULL_SHARD, mixed precision param bfloat16 ..." (no newline):
 * the job as the plan header and `shardplane status` describe it. */
void sp_render_job_line(const sp_job *job, sp_strategy effective);
/* The job as JSON; shard_world 0 leaves that key out. */
json_t *sp_render_job_json(const sp_job *job, sp_strategy effective,
                           uint32_t shard_world);

/* One row of the buffer table (FQN, shape, original and compute dtype). */
typedef struct sp_buffer_row {
  const char *fqn;
  size_t ndim;
  const int64_t *shape;
  sp_dtype orig_dtype, compute_dtype;
  int64_t unit;
  bool persistent;
} sp_buffer_row;

void sp_render_buffer_header(void);
void sp_render_buffer_row(const sp_buffer_row *b);
json_t *sp_render_buffer_json(const sp_buffer_row *b);

/* "[50257, 768]" into buf (truncated to len). */
void sp_render_shape(size_t ndim, const int64_t *shape, char *buf, size_t len);
json_t *sp_render_shape_json(size_t ndim, const int64_t *shape);
/* The dtype's name, or JSON null for SP_DTYPE_INVALID (unset). */
json_t *sp_render_dtype_json(sp_dtype t);

/* Writes root (indented, keys in insertion order) and a newline to stdout
 * and releases it; -1 when root is NULL or the write fails. */
int sp_render_json_out(json_t *root);

#endif
