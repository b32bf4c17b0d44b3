/* The checkpoint folder format, apart from any runtime: file names, the
 * staging folder and its atomic publish, synced small files, the optimizer
 * metadata every file carries, and readers that fetch any element range of
 * a named tensor from a FULL file or from a SHARDED folder's chunks. The
 * FSDP runtime's save and load (lib/fsdp/fsdp_ckpt.c) walk their units
 * through these; ckpt.c has the layout of each kind.
 *
 * Every function returning int returns 0 or a negative SP_E* code with a
 * message in d that names the file. Nothing here keeps state between
 * calls or starts threads; callers serialize their own use. Paths are at
 * most PATH_MAX; a longer one is SP_ETOOBIG, never truncated. */
#ifndef SP_CKPT_FORMAT_H
#define SP_CKPT_FORMAT_H

#include <jansson.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "cast/dtype.h"
#include "plan/model.h"
#include "safetensors/safetensors.h"

#define SP_CKPT_INDEX "index.json"
#define SP_CKPT_FULL_FILE "model.safetensors"
#define SP_CKPT_MAX_INDEX (64u << 20)
#define SP_CKPT_STAGING ".tmp"
#define SP_CKPT_META_STEPS "shardplane.optim_steps"
#define SP_CKPT_META_STATES "shardplane.optim_states"
/* registered states are at most 8 (sp_fsdp_register_shard_state); a
 * checkpoint naming more is not one of ours */
#define SP_CKPT_MAX_STATES 8

/* ---- the folder and its publish ---- */

/* dir without trailing slashes, its staging sibling and its parent. */
typedef struct sp_ckpt_paths {
  char dir[PATH_MAX];
  char staging[PATH_MAX];
  char parent[PATH_MAX];
} sp_ckpt_paths;

/* Fills p from dir; SP_EINVAL when dir has no name of its own (/, ., ..),
 * since the publish renames dir itself. */
int sp_ckpt_paths_of(const char *dir, sp_ckpt_paths *p, sp_diag *d);
/* Rank 0, before anyone writes: an empty staging folder. SP_EEXIST when
 * dir holds anything but regular files (not ours to replace). */
int sp_ckpt_prepare_staging(const sp_ckpt_paths *p, sp_diag *d);
/* Rank 0, after every rank's files are complete: staging becomes dir in
 * one step, and the previous checkpoint is removed. */
int sp_ckpt_publish(const sp_ckpt_paths *p, sp_diag *d);
/* A small text file at path, synced: it is part of a checkpoint. */
int sp_ckpt_write_synced(const char *path, const char *text, sp_diag *d);

/* ---- names and shapes ---- */

/* "<stem>-<r>-of-<w>.safetensors" into out (cap bytes). */
void sp_ckpt_file_name(char *out, size_t cap, const char *stem, uint32_t r,
                       uint32_t w);
/* dir/name into out; SP_ETOOBIG when it does not fit. */
int sp_ckpt_join(char *out, size_t cap, const char *dir, const char *name,
                 sp_diag *d);
/* t's shape into a writer entry. */
void sp_ckpt_tensor_shape(const sp_tensor_spec *t, sp_safetensors_entry *e);
/* torch.chunk(w, dim=0): rank r's rows [*first, *last) of t. */
void sp_ckpt_chunk_rows(const sp_tensor_spec *t, uint32_t w, uint32_t r,
                        int64_t *first, int64_t *last);
/* Elements per dim-0 row of t (a scalar is one row). */
int64_t sp_ckpt_row_numel(const sp_tensor_spec *t);

/* ---- reading ---- */

/* Elements [a, a + n) of tensor t of st into dst in dtype dt: the bytes
 * for equal dtypes, a cast between floating ones, SP_EFORMAT otherwise. */
int sp_ckpt_read_elems(const sp_safetensors_file *st,
                       const sp_safetensors_tensor *t, int64_t a, int64_t n,
                       void *dst, sp_dtype dt, const char *file, sp_diag *d);
/* SP_EFORMAT unless t has spec's shape (rows >= 0: with rows in dim 0). */
int sp_ckpt_check_shape(const sp_safetensors_tensor *t,
                        const sp_tensor_spec *spec, int64_t rows,
                        const char *file, sp_diag *d);

/* What a checkpoint says about the optimizer: its step count and the
 * names of its states, from the metadata or the index. */
typedef struct sp_ckpt_optim {
  uint64_t steps;
  size_t n_states;
  char states[SP_CKPT_MAX_STATES][32];
} sp_ckpt_optim;

/* From a file's metadata; a file written before checkpoints carried the
 * optimizer has neither key: no states, step 0. */
int sp_ckpt_optim_from_meta(const sp_safetensors_file *st, const char *where,
                            sp_ckpt_optim *o, sp_diag *d);
/* From a SHARDED index (root borrowed). */
int sp_ckpt_optim_from_index(json_t *root, const char *where, sp_ckpt_optim *o,
                             sp_diag *d);
/* The world size a file was written by, 0 when it does not say. */
uint32_t sp_ckpt_meta_world(const sp_safetensors_file *st);

/* The elements [a, a + n) of tensor `name` (model shape spec) this rank
 * holds, from a source that can read any range of the flattened tensor. */
typedef int (*sp_ckpt_range_fn)(void *ctx, const char *name,
                                const sp_tensor_spec *spec, int64_t a,
                                int64_t n, void *dst, sp_dtype dt, sp_diag *d);

/* A FULL file as a range source (sp_ckpt_full_range); both borrowed. */
typedef struct sp_ckpt_full_ctx {
  const sp_safetensors_file *st;
  const char *file;
} sp_ckpt_full_ctx;
int sp_ckpt_full_range(void *vctx, const char *name, const sp_tensor_spec *spec,
                       int64_t a, int64_t n, void *dst, sp_dtype dt,
                       sp_diag *d);

/* SHARDED: the index names, per tensor, the files holding row ranges.
 * dir and tensors are borrowed; the files opened on the way are the
 * context's, each opened once, until the caller closes them (names[i] and
 * files[i], then the two arrays). */
typedef struct sp_ckpt_sharded_ctx {
  const char *dir;
  json_t *tensors;
  char **names; /* opened files, by name */
  sp_safetensors_file **files;
  size_t n_files, cap_files;
} sp_ckpt_sharded_ctx;
/* The file `name` of the folder (a plain file name: the index is
 * untrusted), opened once and kept in c. */
int sp_ckpt_sharded_file(sp_ckpt_sharded_ctx *c, const char *name,
                         const sp_safetensors_file **out, sp_diag *d);
int sp_ckpt_sharded_range(void *vctx, const char *name,
                          const sp_tensor_spec *spec, int64_t a, int64_t n,
                          void *dst, sp_dtype dt, sp_diag *d);

#endif
