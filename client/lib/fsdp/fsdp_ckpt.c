/* The FSDP runtime's checkpoints (sp_ckpt_save, sp_ckpt_load): each
 * unit's master and registered states written in, and read back from, the
 * layout of each kind (lib/ckpt/ckpt.c), with every rank agreeing on the
 * outcome before a checkpoint is published or a load is trusted.
 *
 * Memory: saving gathers one unit at a time over the shard group (one
 * tensor of it: the master, then each state) into one host buffer of the
 * largest unit's c * W_s elements, writes this rank's pieces of it straight
 * into the file (sp_safetensors_writer) and reuses the buffer for the next;
 * nothing else of the model is held. Loading reads, per unit, only the byte
 * ranges of this rank's shard out of the files (sp_safetensors_open_header and
 * pread). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "cast/cast.h"
#include "fsdp_internal.h"
#include "lib/ckpt/ckpt_format.h"
#include "safetensors/safetensors.h"

/* ---- agreement between ranks ---- */

/* host[0..n) summed over the world, in place, through the runtime's
 * storage (device memory on a GPU: NCCL takes no host pointers). */
static int sum_floats(sp_fsdp *f, float *host, size_t n, sp_diag *d) {
  if (f->world == 1) return 0;
  void *buf = host;
  int rc = 0;
  if (f->mem->device) {
    rc = f->mem->alloc(f, n, sizeof(float), &buf, d);
    if (rc == 0) rc = f->mem->from_host(f, buf, host, n * sizeof(float), d);
  }
  if (rc == 0) rc = sp_fsdp_all_reduce(f, buf, n, SP_FLOAT32, d);
  if (rc == 0 && buf != host)
    rc = f->mem->to_host(f, host, buf, n * sizeof(float), d);
  if (buf != host) f->mem->release(f, buf);
  return rc;
}

/* One float per rank, 1 where that rank says yes: every rank learns which
 * ranks did (for messages naming them). *first: the lowest, or -1. Only
 * at checkpoints: it moves W floats. */
static int agree(sp_fsdp *f, bool mine, int64_t *first, sp_diag *d) {
  *first = mine ? (int64_t)f->rank : -1;
  if (f->world == 1) return 0;
  float *host = calloc(f->world, sizeof *host);
  if (!host) return sp_diag_set(d, SP_ENOMEM, "no memory");
  host[f->rank] = mine ? 1.0f : 0.0f;
  int rc = sum_floats(f, host, f->world, d);
  for (uint32_t r = 0; rc == 0 && r < f->world; r++)
    if (host[r] != 0.0f) {
      *first = r;
      break;
    }
  free(host);
  return rc;
}

/* Every step: one float, the number of ranks that say yes (exact in
 * float32 up to 2^24 ranks). */
int sp_fsdp_any(sp_fsdp *f, bool mine, bool *any, sp_diag *d) {
  if (!f || !any) return sp_diag_set(d, SP_EINVAL, "sp_fsdp_any: NULL");
  float n = mine ? 1.0f : 0.0f;
  int rc = sum_floats(f, &n, 1, d);
  if (rc < 0) return sp_diag_prefix(d, rc, "rank %u: agreeing", f->rank);
  *any = n != 0.0f;
  return 0;
}

/* After a phase in which each rank may have failed on its own (a full
 * disk): every rank returns an error if any did, so all of them take the
 * same path and none waits in a collective the others left. Own errors keep
 * their message; a peer's names the peer. */
static int settle(sp_fsdp *f, int rc, const char *phase, sp_diag *d) {
  int64_t first;
  sp_diag ad = {{0}};
  int arc = agree(f, rc < 0, &first, &ad);
  if (rc < 0) return rc;
  if (arc < 0) {
    *d = ad;
    return arc;
  }
  if (first >= 0)
    return sp_diag_set(d, SP_ECANCELED,
                       "rank %lld failed %s (its own "
                       "message says why)",
                       (long long)first, phase);
  return 0;
}

/* The tensors a parameter contributes: k = 0 the parameter itself, k >= 1
 * registered state k - 1. */
static size_t n_kinds(const sp_fsdp *f) { return 1 + f->n_states; }

static sp_dtype kind_dtype(const sp_fsdp *f, uint32_t u, size_t k) {
  return k == 0 ? f->units[u].u->dtype : f->states[k - 1].dtype;
}

/* The checkpoint name of parameter p's tensor k: its FQN, or
 * "optim.<state>.<fqn>". malloc'd. */
static char *kind_name(const sp_fsdp *f, int32_t p, size_t k) {
  const char *fqn = f->model->params[p].fqn;
  char *s = NULL;
  if (k == 0) return strdup(fqn);
  if (asprintf(&s, "optim.%s.%s", f->states[k - 1].name, fqn) < 0) s = NULL;
  return s;
}

/* LOCAL: unit u's flat tensor k, "<unit>._flat_param" or
 * "<unit>.optim.<state>" ("_flat_param" / "optim.<state>" for the root). */
static void local_name(const sp_fsdp *f, uint32_t u, size_t k, char *out,
                       size_t cap) {
  const char *ufqn = sp_plan_unit_fqn(f->plan, u);
  if (k == 0)
    snprintf(out, cap, "%s%s_flat_param", ufqn, *ufqn ? "." : "");
  else
    snprintf(out, cap, "%s%soptim.%s", ufqn, *ufqn ? "." : "",
             f->states[k - 1].name);
}

/* ---- storage of a unit's tensor k, as host memory ---- */

static uint8_t *kind_storage(sp_fsdp *f, uint32_t u, size_t k) {
  return k == 0 ? f->units[u].shard : f->states[k - 1].per_unit[u];
}

/* A host image of the storage: the storage itself on host memory, a copy
 * (freed by the caller through *owned) on a device. */
static int kind_host(sp_fsdp *f, uint32_t u, size_t k, const uint8_t **data,
                     uint8_t **owned, sp_diag *d) {
  if (k == 0) return sp_fsdp_shard_host(f, u, data, owned, d);
  size_t bytes = (size_t)f->units[u].c * sp_dtype_size(kind_dtype(f, u, k));
  const uint8_t *st = kind_storage(f, u, k);
  *owned = NULL;
  if (!f->mem->device) {
    *data = st;
    return 0;
  }
  uint8_t *h = malloc(bytes ? bytes : 1);
  if (!h)
    return sp_diag_set(d, SP_ENOMEM, "no host memory for %zu bytes", bytes);
  int rc = f->mem->to_host(f, h, st, bytes, d);
  if (rc < 0) {
    free(h);
    return rc;
  }
  *data = *owned = h;
  return 0;
}

/* A writable host image to load into, uploaded by kind_commit. */
static uint8_t *kind_stage(sp_fsdp *f, uint32_t u, size_t k, sp_diag *d) {
  if (k == 0) return sp_fsdp_shard_stage(f, u, d);
  if (!f->mem->device) return kind_storage(f, u, k);
  size_t bytes = (size_t)f->units[u].c * sp_dtype_size(kind_dtype(f, u, k));
  uint8_t *h = malloc(bytes ? bytes : 1);
  if (!h) sp_diag_set(d, SP_ENOMEM, "no host memory for %zu bytes", bytes);
  return h;
}

static int kind_commit(sp_fsdp *f, uint32_t u, size_t k, uint8_t *h, bool keep,
                       sp_diag *d) {
  if (k == 0) return sp_fsdp_shard_commit(f, u, h, keep, d);
  if (!f->mem->device || !h) return 0;
  size_t bytes = (size_t)f->units[u].c * sp_dtype_size(kind_dtype(f, u, k));
  int rc = keep ? f->mem->from_host(f, kind_storage(f, u, k), h, bytes, d) : 0;
  free(h);
  return rc;
}

/* Every registered state has storage for every unit with parameters
 * (sp_fsdp_register_shard_state borrows the caller's table). */
static int check_registered(const sp_fsdp *f, sp_diag *d) {
  for (size_t i = 0; i < f->n_states; i++)
    for (uint32_t u = 0; u < f->n_units; u++)
      if (f->units[u].has_data && !f->states[i].per_unit[u])
        return sp_diag_set(d, SP_EINVAL,
                           "optimizer state \"%s\" has no "
                           "storage for unit %u (%s)",
                           f->states[i].name, u, sp_fsdp_unit_name(f, u));
  return 0;
}

/* ---- saving ---- */

/* One rank's file being written: its entries and where each parameter's
 * tensors went. */
typedef struct save_file {
  sp_safetensors_entry *es;
  char **names; /* owned names of es (NULL where borrowed) */
  size_t n, cap;
  /* per (k, p), k * n_params + p: index into es, or -1 (not in this
   * file) */
  int64_t *slot;
  /* buffers: index into es of each, -1 when not here */
  int64_t *buf_slot;
  sp_safetensors_writer *w;
  char steps[24];
  char states[SP_CKPT_MAX_STATES * 33];
} save_file;

static void save_file_free(save_file *sf) {
  for (size_t i = 0; sf->names && i < sf->n; i++) free(sf->names[i]);
  free(sf->names);
  free(sf->es);
  free(sf->slot);
  free(sf->buf_slot);
  sp_safetensors_writer_abort(sf->w);
}

static int add_entry(save_file *sf, char *owned_name, const char *name,
                     sp_dtype dt, const sp_tensor_spec *t, sp_diag *d) {
  if (!owned_name && !name) return sp_diag_set(d, SP_ENOMEM, "no memory");
  if (sf->n == sf->cap) {
    size_t cap = sf->cap ? 2 * sf->cap : 64;
    sp_safetensors_entry *es = realloc(sf->es, cap * sizeof *es);
    if (es) sf->es = es;
    char **ns = realloc(sf->names, cap * sizeof *ns);
    if (ns) sf->names = ns;
    if (!es || !ns) {
      free(owned_name);
      return sp_diag_set(d, SP_ENOMEM, "no memory");
    }
    sf->cap = cap;
  }
  sp_safetensors_entry *e = &sf->es[sf->n];
  memset(e, 0, sizeof *e);
  e->name = owned_name ? owned_name : name;
  e->dtype = dt;
  if (t) sp_ckpt_tensor_shape(t, e);
  sf->names[sf->n++] = owned_name;
  return 0;
}

static void format_meta(sp_fsdp *f, save_file *sf) {
  snprintf(sf->steps, sizeof sf->steps, "%llu",
           (unsigned long long)f->optim_steps);
  size_t o = 0;
  sf->states[0] = '\0';
  for (size_t i = 0; i < f->n_states; i++)
    o += (size_t)snprintf(sf->states + o, sizeof sf->states - o, "%s%s",
                          i ? "," : "", f->states[i].name);
}

/* as_rank: the rank whose file it is (this one, or under a replica quorum
 * one of a group out of it, whose shards this rank holds too). */
static int open_writer(sp_fsdp *f, save_file *sf, const char *dir,
                       const char *name, sp_ckpt_kind kind, uint32_t as_rank,
                       sp_diag *d) {
  char path[PATH_MAX], world[16], rank[16];
  int rc = sp_ckpt_join(path, sizeof path, dir, name, d);
  if (rc < 0) return rc;
  snprintf(world, sizeof world, "%u", f->world);
  snprintf(rank, sizeof rank, "%u", as_rank);
  format_meta(f, sf);
  sp_safetensors_kv meta[] = {{"shardplane.kind", sp_ckpt_kind_name(kind)},
                              {"shardplane.plan_version", f->plan->version_hex},
                              {"shardplane.world_size", world},
                              {"shardplane.rank", rank},
                              {SP_CKPT_META_STEPS, sf->steps},
                              {SP_CKPT_META_STATES, sf->states}};
  return sp_safetensors_writer_open(path, sf->es, sf->n, meta, 6, &sf->w, d);
}

/* The entries of rank as_rank's FULL or SHARDED file (FULL: rank 0's
 * only). */
static int plan_file(sp_fsdp *f, sp_ckpt_kind kind, save_file *sf,
                     uint32_t as_rank, sp_diag *d) {
  const sp_model *m = f->model;
  size_t nk = n_kinds(f);
  sf->slot = malloc((nk * m->n_params + 1) * sizeof *sf->slot);
  sf->buf_slot = malloc((m->n_buffers + 1) * sizeof *sf->buf_slot);
  if (!sf->slot || !sf->buf_slot) return sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t i = 0; i < nk * m->n_params; i++) sf->slot[i] = -1;
  for (size_t b = 0; b < m->n_buffers; b++) sf->buf_slot[b] = -1;
  for (size_t k = 0; k < nk; k++)
    for (size_t p = 0; p < m->n_params; p++) {
      const sp_tensor_spec *t = &m->params[p];
      int32_t u = f->plan->param_unit[p];
      if (u < 0) continue;
      int64_t first = 0, last = 1;
      if (kind == SP_CKPT_SHARDED) {
        sp_ckpt_chunk_rows(t, f->world, as_rank, &first, &last);
        if (first >= last) continue;
      }
      sf->slot[k * m->n_params + p] = (int64_t)sf->n;
      int rc = add_entry(sf, kind_name(f, (int32_t)p, k), NULL,
                         kind_dtype(f, (uint32_t)u, k), t, d);
      if (rc < 0) return rc;
      if (kind == SP_CKPT_SHARDED && t->ndim)
        sf->es[sf->n - 1].shape[0] = (uint64_t)(last - first);
    }
  if (as_rank != 0) return 0;
  /* persistent buffers, restored to their original dtype (rank 0) */
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    if (!t->flag) continue; /* non-persistent: not in a state dict */
    sf->buf_slot[b] = (int64_t)sf->n;
    int rc = add_entry(sf, NULL, t->fqn, t->dtype, t, d);
    if (rc < 0) return rc;
  }
  return 0;
}

/* Writes one buffer, in `to` (its original dtype, or its current one). */
static int put_buffer(sp_fsdp *f, save_file *sf, size_t b, sp_dtype to,
                      sp_diag *d) {
  const sp_tensor_spec *t = &f->model->buffers[b];
  sp_dtype cur = f->buffer_dtype[b];
  const uint8_t *src;
  uint8_t *staged;
  int rc = sp_fsdp_buffer_host(f, (int32_t)b, &src, &staged, d);
  if (rc < 0) return sp_diag_prefix(d, rc, "reading buffer %s", t->fqn);
  size_t n = (size_t)t->numel;
  uint8_t *copy = NULL;
  if (to != cur) {
    /* a runtime on a GPU hands out host copies, so the restore casts on
     * the host */
    copy = malloc(n * sp_dtype_size(to) + 1);
    rc = copy ? sp_cast(copy, to, src, cur, n)
              : sp_diag_set(d, SP_ENOMEM, "no memory for %s", t->fqn);
    if (rc < 0 && copy)
      rc = sp_diag_set(d, rc, "restoring buffer %s to %s", t->fqn,
                       sp_dtype_name(to));
    src = copy;
  }
  if (rc == 0)
    rc = sp_safetensors_writer_put(sf->w, (size_t)sf->buf_slot[b], 0, src,
                                   n * sp_dtype_size(to), d);
  free(copy);
  free(staged);
  return rc;
}

/* Rank as_rank's pieces of unit u's gathered tensor k (full: c * W_s
 * elements): whole parameters (FULL) or their dim-0 chunks (SHARDED). */
static int put_unit(sp_fsdp *f, sp_ckpt_kind kind, save_file *sf, uint32_t u,
                    size_t k, const uint8_t *full, uint32_t as_rank,
                    sp_diag *d) {
  const sp_model *m = f->model;
  size_t es = sp_dtype_size(kind_dtype(f, u, k));
  for (size_t p = 0; p < m->n_params; p++) {
    if (f->plan->param_unit[p] != (int32_t)u) continue;
    int64_t slot = sf->slot[k * m->n_params + p];
    if (slot < 0) continue;
    const sp_tensor_spec *t = &m->params[p];
    const sp_flat_entry *e = &f->plan->entries[f->plan->param_entry[p]];
    int64_t first = 0, last = t->ndim ? t->shape[0] : 1;
    if (kind == SP_CKPT_SHARDED)
      sp_ckpt_chunk_rows(t, f->world, as_rank, &first, &last);
    int64_t rn = sp_ckpt_row_numel(t);
    const uint8_t *src = full + (size_t)(e->offset + first * rn) * es;
    int rc = sp_safetensors_writer_put(sf->w, (size_t)slot, 0, src,
                                       (size_t)((last - first) * rn) * es, d);
    if (rc < 0) return rc;
  }
  return 0;
}

/* The index of a SHARDED checkpoint (rank 0): per tensor its dtype, full
 * shape and chunks; the step count and the state names. */
static json_t *sharded_index(sp_fsdp *f) {
  const sp_model *m = f->model;
  json_t *index = json_object(), *tensors = json_object(),
         *states = json_array();
  char bufs[128];
  sp_ckpt_file_name(bufs, sizeof bufs, "rank", 0, f->world);
  bool ok = index && tensors && states;
  for (size_t k = 0; ok && k < n_kinds(f); k++)
    for (size_t p = 0; ok && p < m->n_params; p++) {
      const sp_tensor_spec *t = &m->params[p];
      int32_t u = f->plan->param_unit[p];
      if (u < 0) continue;
      char *name = kind_name(f, (int32_t)p, k);
      json_t *info = json_pack("{s:s, s:[], s:[]}", "dtype",
                               sp_dtype_name(kind_dtype(f, (uint32_t)u, k)),
                               "shape", "chunks");
      ok = name && info;
      for (int i = 0; ok && i < t->ndim; i++)
        ok = json_array_append_new(json_object_get(info, "shape"),
                                   json_integer(t->shape[i])) == 0;
      for (uint32_t r = 0; ok && r < f->world; r++) {
        int64_t a, b;
        sp_ckpt_chunk_rows(t, f->world, r, &a, &b);
        if (a >= b) break;
        char fn[128];
        sp_ckpt_file_name(fn, sizeof fn, "rank", r, f->world);
        ok = json_array_append_new(
                 json_object_get(info, "chunks"),
                 json_pack("{s:s, s:I, s:I}", "file", fn, "row", (json_int_t)a,
                           "rows", (json_int_t)(b - a))) == 0;
      }
      if (ok)
        ok = json_object_set_new(tensors, name, info) == 0;
      else
        json_decref(info);
      free(name);
    }
  for (size_t i = 0; ok && i < f->n_states; i++)
    ok = json_array_append_new(states, json_string(f->states[i].name)) == 0;
  if (ok)
    ok =
        json_object_set_new(index, "format",
                            json_string("shardplane.sharded/v1")) == 0 &&
        json_object_set_new(index, "plan_version",
                            json_string(f->plan->version_hex)) == 0 &&
        json_object_set_new(index, "world_size", json_integer(f->world)) == 0 &&
        json_object_set_new(index, "buffers_file", json_string(bufs)) == 0 &&
        json_object_set_new(index, "optim_steps",
                            json_integer((json_int_t)f->optim_steps)) == 0 &&
        json_object_set(index, "optim_states", states) == 0 &&
        json_object_set(index, "tensors", tensors) == 0;
  json_decref(states);
  json_decref(tensors);
  if (!ok) {
    json_decref(index);
    return NULL;
  }
  return index;
}

static int write_index(sp_fsdp *f, const char *dir, sp_diag *d) {
  json_t *index = sharded_index(f);
  char *text =
      index ? json_dumps(index, JSON_INDENT(1) | JSON_SORT_KEYS) : NULL;
  json_decref(index);
  if (!text)
    return sp_diag_set(d, SP_ENOMEM, "no memory for %s", SP_CKPT_INDEX);
  char path[PATH_MAX];
  int rc = sp_ckpt_join(path, sizeof path, dir, SP_CKPT_INDEX, d);
  if (rc == 0) rc = sp_ckpt_write_synced(path, text, d);
  free(text);
  return rc;
}

/* FULL and SHARDED: unit by unit, each tensor of the unit gathered over the
 * shard group into one reused host buffer and this rank's pieces written
 * from it. Every rank runs every gather whatever happened to its own file,
 * so a local failure (recorded in *local) never strands the others in a
 * collective; a failing collective returns at once (the peers see it
 * fail too). */
static int save_gathered(sp_fsdp *f, sp_ckpt_kind kind, const char *dir,
                         int *local, sp_diag *ld, sp_diag *d) {
  /* the files this rank writes: SHARDED its own (and under a replica
   * quorum those of the groups out of it at its shard index), FULL the
   * one file, by the lead rank */
  size_t n_as = 0;
  uint32_t *as = sp_fsdp_ckpt_ranks(f, &n_as);
  if (as && kind == SP_CKPT_FULL) {
    n_as = f->rank == sp_fsdp_ckpt_lead(f);
    as[0] = 0;
  }
  save_file *sf = calloc(n_as + 1, sizeof *sf);
  /* the largest unit's c * W_s elements of the widest dtype */
  size_t cap = 1;
  for (uint32_t u = 0; u < f->n_units; u++)
    for (size_t k = 0; f->units[u].has_data && k < n_kinds(f); k++) {
      size_t b =
          (size_t)f->units[u].padded * sp_dtype_size(kind_dtype(f, u, k));
      if (b > cap) cap = b;
    }
  uint8_t *full = malloc(cap);
  int rc = full && as && sf ? 0
                            : sp_diag_set(d, SP_ENOMEM,
                                          "no memory for the %zu-byte "
                                          "gather buffer",
                                          cap);
  for (size_t i = 0; rc == 0 && i < n_as; i++) {
    char name[128];
    if (kind == SP_CKPT_FULL)
      snprintf(name, sizeof name, "%s", SP_CKPT_FULL_FILE);
    else
      sp_ckpt_file_name(name, sizeof name, "rank", as[i], f->world);
    rc = plan_file(f, kind, &sf[i], as[i], d);
    if (rc == 0) rc = open_writer(f, &sf[i], dir, name, kind, as[i], d);
  }
  /* nobody gathers unless everybody can take part */
  rc = settle(f, rc, "preparing its checkpoint file", d);
  if (rc == 0)
    rc = sp_session_transition(f->s, SP_MACHINE_ROOT, 0,
                               SP_ROOT_SUMMON_FULL_PARAMS, d);
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    if (!f->units[u].has_data) continue;
    rc = sp_session_transition(f->s, SP_MACHINE_HANDLE, u,
                               SP_HANDLE_SUMMON_FULL_PARAMS, d);
    for (size_t k = 0; rc == 0 && k < n_kinds(f); k++) {
      const void *src = k == 0 ? NULL : kind_storage(f, u, k);
      rc = sp_fsdp_gather_tensor(f, u, src, kind_dtype(f, u, k), full, d);
      for (size_t i = 0; rc == 0 && i < n_as && *local == 0; i++)
        *local = put_unit(f, kind, &sf[i], u, k, full, as[i], ld);
    }
    if (rc == 0)
      rc = sp_session_transition(f->s, SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE, d);
    if (rc < 0)
      sp_diag_prefix(d, rc, "unit %u (%s)", u, sp_fsdp_unit_name(f, u));
  }
  if (rc == 0)
    rc = sp_session_transition(f->s, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  free(full);
  for (size_t i = 0; rc == 0 && *local == 0 && i < n_as; i++) {
    for (size_t b = 0; *local == 0 && b < f->model->n_buffers; b++)
      if (sf[i].buf_slot[b] >= 0)
        *local = put_buffer(f, &sf[i], b, f->model->buffers[b].dtype, ld);
    if (*local == 0) {
      sp_safetensors_writer *w = sf[i].w;
      sf[i].w = NULL;
      *local = sp_safetensors_writer_commit(w, ld);
    }
  }
  if (rc == 0 && *local == 0 && kind == SP_CKPT_SHARDED &&
      f->rank == sp_fsdp_ckpt_lead(f))
    *local = write_index(f, dir, ld);
  for (size_t i = 0; sf && i < n_as; i++) save_file_free(&sf[i]);
  free(sf);
  free(as);
  return rc;
}

/* LOCAL: no collective; one unit's shard at a time (a host copy of it on a
 * GPU), into rank as_rank's file (this rank's, or one of a group out of a
 * replica quorum at the same shard index: the same shards). */
static int save_local_as(sp_fsdp *f, const char *dir, uint32_t as_rank,
                         sp_diag *d) {
  const sp_model *m = f->model;
  size_t nk = n_kinds(f);
  save_file sf = {0};
  int64_t *unit_slot = calloc(f->n_units * nk + 1, sizeof *unit_slot);
  sf.buf_slot = malloc((m->n_buffers + 1) * sizeof *sf.buf_slot);
  int rc =
      unit_slot && sf.buf_slot ? 0 : sp_diag_set(d, SP_ENOMEM, "no memory");
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    int64_t s, e, pad;
    rc = sp_plan_rank_range(f->plan, u, as_rank, &s, &e, &pad);
    for (size_t k = 0; rc == 0 && k < nk; k++) {
      char tn[SP_SAFETENSORS_MAX_NAME];
      local_name(f, u, k, tn, sizeof tn);
      unit_slot[u * nk + k] = (int64_t)sf.n;
      rc = add_entry(&sf, strdup(tn), NULL, kind_dtype(f, u, k), NULL, d);
      if (rc == 0) {
        sf.es[sf.n - 1].ndim = 1;
        sf.es[sf.n - 1].shape[0] = (uint64_t)(e - s);
      }
    }
  }
  /* buffers in their compute dtype: cast them first */
  if (rc == 0) rc = sp_fsdp_lazy_init(f, d);
  for (size_t b = 0; rc == 0 && b < m->n_buffers; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    sf.buf_slot[b] = -1;
    if (!t->flag) continue;
    sf.buf_slot[b] = (int64_t)sf.n;
    rc = add_entry(&sf, NULL, t->fqn, f->buffer_dtype[b], t, d);
  }
  char name[128];
  sp_ckpt_file_name(name, sizeof name, "local", as_rank, f->world);
  if (rc == 0) rc = open_writer(f, &sf, dir, name, SP_CKPT_LOCAL, as_rank, d);
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    if (!f->units[u].has_data) continue;
    for (size_t k = 0; rc == 0 && k < nk; k++) {
      const sp_safetensors_entry *e = &sf.es[unit_slot[u * nk + k]];
      const uint8_t *data;
      uint8_t *owned;
      rc = kind_host(f, u, k, &data, &owned, d);
      if (rc == 0)
        rc = sp_safetensors_writer_put(
            sf.w, (size_t)unit_slot[u * nk + k], 0, data,
            (size_t)e->shape[0] * sp_dtype_size(e->dtype), d);
      free(owned);
    }
  }
  for (size_t b = 0; rc == 0 && b < m->n_buffers; b++)
    if (sf.buf_slot[b] >= 0) rc = put_buffer(f, &sf, b, f->buffer_dtype[b], d);
  if (rc == 0) {
    sp_safetensors_writer *w = sf.w;
    sf.w = NULL;
    rc = sp_safetensors_writer_commit(w, d);
  }
  free(unit_slot);
  save_file_free(&sf);
  return rc;
}

static int save_local(sp_fsdp *f, const char *dir, sp_diag *d) {
  size_t n = 0;
  uint32_t *as = sp_fsdp_ckpt_ranks(f, &n);
  int rc = as ? 0 : sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t i = 0; rc == 0 && i < n; i++)
    rc = save_local_as(f, dir, as[i], d);
  free(as);
  return rc;
}

int sp_ckpt_save(sp_fsdp *f, sp_ckpt_kind kind, const char *dir, sp_diag *d) {
  if (!f || !dir) return sp_diag_set(d, SP_EINVAL, "sp_ckpt_save: no dir");
  if (kind != SP_CKPT_FULL && kind != SP_CKPT_SHARDED && kind != SP_CKPT_LOCAL)
    return sp_diag_set(d, SP_EINVAL, "unknown checkpoint kind %d", (int)kind);
  const char *kn = sp_ckpt_kind_name(kind);
  /* the same answer on every rank: no collective is needed to refuse */
  sp_ckpt_paths *p = malloc(sizeof *p);
  if (!p) return sp_diag_set(d, SP_ENOMEM, "no memory");
  int rc = sp_ckpt_paths_of(dir, p, d);
  if (rc < 0) {
    free(p);
    return sp_diag_prefix(d, rc, "writing %s checkpoint", kn);
  }
  /* 1. rank 0 (under a replica quorum the first rank of the first group
   * in it) empties the staging directory */
  rc = check_registered(f, d);
  uint32_t lead = sp_fsdp_ckpt_lead(f);
  if (rc == 0 && f->rank == lead) rc = sp_ckpt_prepare_staging(p, d);
  rc = settle(f, rc, "preparing the checkpoint directory", d);
  /* 2. every rank writes its files there */
  if (rc == 0) {
    int local = 0;
    sp_diag ld = {{0}};
    if (kind == SP_CKPT_LOCAL) {
      local = save_local(f, p->staging, &ld);
    } else {
      rc = save_gathered(f, kind, p->staging, &local, &ld, d);
    }
    if (rc == 0) {
      if (local < 0) *d = ld;
      rc = settle(f, local, "writing its checkpoint file", d);
    }
  }
  /* 3. the same rank publishes; every rank returns once it is done */
  if (rc == 0) {
    int prc = f->rank == lead ? sp_ckpt_publish(p, d) : 0;
    rc = settle(f, prc, "publishing the checkpoint", d);
  }
  free(p);
  if (rc < 0) sp_diag_prefix(d, rc, "writing %s checkpoint %s", kn, dir);
  return rc;
}

/* Loads every persistent buffer from st (its original or compute dtype)
 * into the runtime's buffers. */
static int load_buffers(sp_fsdp *f, const sp_safetensors_file *st,
                        const char *file, sp_diag *d) {
  const sp_model *m = f->model;
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *spec = &m->buffers[b];
    if (!spec->flag) continue;
    const sp_safetensors_tensor *t;
    int rc = sp_safetensors_get(st, spec->fqn, &t, d);
    if (rc < 0) return sp_diag_prefix(d, rc, "%s", file);
    rc = sp_ckpt_check_shape(t, spec, -1, file, d);
    if (rc < 0) return rc;
    /* the buffer itself on the CPU, a host image uploaded on a GPU */
    uint8_t *dst = sp_fsdp_buffer_stage(f, (int32_t)b, d);
    if (!dst) return SP_ENOMEM;
    rc = sp_ckpt_read_elems(st, t, 0, spec->numel, dst, f->buffer_dtype[b],
                            file, d);
    int crc = sp_fsdp_buffer_commit(f, (int32_t)b, dst, rc == 0, d);
    if (rc == 0) rc = crc;
    if (rc < 0) return rc;
  }
  return 0;
}

/* Fills unit u's tensor k (master or state) with this rank's elements,
 * zero in the padding. */
static int fill_unit(sp_fsdp *f, uint32_t u, size_t k, sp_ckpt_range_fn fn,
                     void *ctx, sp_diag *d) {
  sp_fsdp_unit *fu = &f->units[u];
  sp_dtype dt = kind_dtype(f, u, k);
  size_t es = sp_dtype_size(dt);
  size_t n = 0;
  int rc = sp_plan_shard_params(f->plan, u, f->rank, NULL, 0, &n);
  sp_shard_param *sp = calloc(n ? n : 1, sizeof *sp);
  if (!sp) return sp_diag_set(d, SP_ENOMEM, "no memory");
  if (rc == 0) rc = sp_plan_shard_params(f->plan, u, f->rank, sp, n, &n);
  /* the storage itself on the CPU, a host image uploaded on a GPU */
  uint8_t *dst = rc == 0 ? kind_stage(f, u, k, d) : NULL;
  if (rc == 0 && !dst) rc = SP_ENOMEM;
  if (rc == 0) memset(dst, 0, (size_t)fu->c * es);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const sp_flat_entry *e = &f->plan->entries[sp[i].entry];
    char *name = kind_name(f, e->param, k);
    rc = name ? fn(ctx, name, &f->model->params[e->param], sp[i].intra_start,
                   sp[i].numel_in_shard,
                   dst + (size_t)sp[i].offset_in_shard * es, dt, d)
              : sp_diag_set(d, SP_ENOMEM, "no memory");
    free(name);
  }
  free(sp);
  if (dst) {
    int crc = kind_commit(f, u, k, dst, rc == 0, d);
    if (rc == 0) rc = crc;
  }
  return rc;
}

static int fill_shards(sp_fsdp *f, bool states, sp_ckpt_range_fn fn, void *ctx,
                       sp_diag *d) {
  for (uint32_t u = 0; u < f->n_units; u++) {
    if (!f->units[u].has_data) continue;
    for (size_t k = 0; k < (states ? n_kinds(f) : 1); k++) {
      int rc = fill_unit(f, u, k, fn, ctx, d);
      if (rc < 0) return rc;
    }
  }
  return 0;
}

/* The checkpoint's states must be exactly the registered ones. */
static int check_states(const sp_fsdp *f, const sp_ckpt_optim *o,
                        const char *where, sp_diag *d) {
  for (size_t i = 0; i < o->n_states; i++) {
    bool found = false;
    for (size_t j = 0; j < f->n_states; j++)
      found = found || strcmp(o->states[i], f->states[j].name) == 0;
    if (!found)
      return sp_diag_set(d, SP_ESTATE,
                         "%s: the checkpoint holds optimizer "
                         "state \"%s\", which this runtime has not "
                         "registered (a parameters-only load, "
                         "sp_ckpt_load_opts.params_only, leaves the "
                         "optimizer out)",
                         where, o->states[i]);
  }
  for (size_t j = 0; j < f->n_states; j++) {
    bool found = false;
    for (size_t i = 0; i < o->n_states; i++)
      found = found || strcmp(o->states[i], f->states[j].name) == 0;
    if (!found)
      return sp_diag_set(d, SP_ESTATE,
                         "%s: optimizer state \"%s\" of this "
                         "runtime is not in the checkpoint (a "
                         "parameters-only load, sp_ckpt_load_opts."
                         "params_only, starts it afresh)",
                         where, f->states[j].name);
  }
  return 0;
}

static int load_full(sp_fsdp *f, const char *dir, bool params_only,
                     sp_ckpt_info *info, sp_diag *d) {
  char path[PATH_MAX];
  int rc = sp_ckpt_join(path, sizeof path, dir, SP_CKPT_FULL_FILE, d);
  if (rc < 0) return rc;
  sp_safetensors_file *st;
  rc = sp_safetensors_open_header(path, &st, d);
  if (rc < 0) return rc;
  sp_ckpt_optim o;
  rc = sp_ckpt_optim_from_meta(st, path, &o, d);
  if (rc == 0 && !params_only) rc = check_states(f, &o, path, d);
  sp_ckpt_full_ctx c = {st, path};
  if (rc == 0) rc = fill_shards(f, !params_only, sp_ckpt_full_range, &c, d);
  if (rc == 0) rc = load_buffers(f, st, path, d);
  if (rc == 0) {
    info->optim_steps = o.steps;
    info->n_states = (uint32_t)o.n_states;
    info->world_size = sp_ckpt_meta_world(st);
  }
  sp_safetensors_close(st);
  return rc;
}

static int load_sharded(sp_fsdp *f, const char *dir, bool params_only,
                        sp_ckpt_info *info, sp_diag *d) {
  char path[PATH_MAX];
  char *buf;
  size_t len;
  int rc = sp_ckpt_join(path, sizeof path, dir, SP_CKPT_INDEX, d);
  if (rc == 0) rc = sp_json_read_file(path, SP_CKPT_MAX_INDEX, &buf, &len, d);
  if (rc < 0) return rc;
  sp_json_reader r = {path, d};
  json_t *root = NULL;
  rc = sp_json_parse(&r, buf, len, SP_CKPT_MAX_INDEX, &root);
  free(buf);
  if (rc < 0) return rc;
  sp_ckpt_sharded_ctx c = {.dir = dir,
                           .tensors = json_object_get(root, "tensors")};
  const char *bufs = json_string_value(json_object_get(root, "buffers_file"));
  if (!json_is_object(c.tensors) || !bufs)
    rc = sp_json_fail(&r, SP_EFORMAT, "not a shardplane.sharded/v1 index");
  sp_ckpt_optim o;
  if (rc == 0) rc = sp_ckpt_optim_from_index(root, path, &o, d);
  if (rc == 0 && !params_only) rc = check_states(f, &o, path, d);
  if (rc == 0) rc = fill_shards(f, !params_only, sp_ckpt_sharded_range, &c, d);
  const sp_safetensors_file *st;
  if (rc == 0) rc = sp_ckpt_sharded_file(&c, bufs, &st, d);
  if (rc == 0) rc = load_buffers(f, st, bufs, d);
  if (rc == 0) {
    json_t *w = json_object_get(root, "world_size");
    info->optim_steps = o.steps;
    info->n_states = (uint32_t)o.n_states;
    info->world_size = json_is_integer(w) && json_integer_value(w) > 0 &&
                               json_integer_value(w) <= UINT32_MAX
                           ? (uint32_t)json_integer_value(w)
                           : 0;
  }
  for (size_t i = 0; i < c.n_files; i++) {
    sp_safetensors_close(c.files[i]);
    free(c.names[i]);
  }
  free(c.files);
  free(c.names);
  json_decref(root);
  return rc;
}

static int load_local(sp_fsdp *f, const char *dir, bool params_only,
                      sp_ckpt_info *info, sp_diag *d) {
  char name[128], path[PATH_MAX];
  sp_ckpt_file_name(name, sizeof name, "local", f->rank, f->world);
  sp_safetensors_file *st;
  int rc = sp_ckpt_join(path, sizeof path, dir, name, d);
  if (rc < 0) return rc;
  rc = sp_safetensors_open_header(path, &st, d);
  if (rc == SP_ENOENT)
    return sp_diag_prefix(d, rc,
                          "a LOCAL checkpoint loads only into the "
                          "world size and plan it was written with (this "
                          "rank is %u of %u)",
                          f->rank, f->world);
  if (rc < 0) return rc;
  const char *ver = sp_safetensors_metadata_get(st, "shardplane.plan_version");
  if (!ver || strcmp(ver, f->plan->version_hex) != 0)
    rc = sp_diag_set(d, SP_ESTATE,
                     "%s: plan %s, this job's plan is %s: a "
                     "LOCAL checkpoint loads only into the same plan",
                     path, ver ? ver : "(none)", f->plan->version_hex);
  sp_ckpt_optim o;
  if (rc == 0) rc = sp_ckpt_optim_from_meta(st, path, &o, d);
  if (rc == 0 && !params_only) rc = check_states(f, &o, path, d);
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    for (size_t k = 0; rc == 0 && k < (params_only ? 1 : n_kinds(f)); k++) {
      char tn[SP_SAFETENSORS_MAX_NAME];
      local_name(f, u, k, tn, sizeof tn);
      sp_dtype dt = kind_dtype(f, u, k);
      const sp_safetensors_tensor *t;
      rc = sp_safetensors_get(st, tn, &t, d);
      if (rc < 0) {
        sp_diag_prefix(d, rc, "%s", path);
        break;
      }
      /* the same plan: the same dtype (states: any floating one) */
      if (t->ndim != 1 || (int64_t)t->numel > fu->c ||
          (k == 0 && t->dtype != dt)) {
        rc = sp_diag_set(d, SP_EFORMAT,
                         "%s: %s: shape or dtype does not "
                         "match",
                         path, tn);
        break;
      }
      uint8_t *dst = kind_stage(f, u, k, d);
      if (!dst) {
        rc = SP_ENOMEM;
        break;
      }
      memset(dst, 0, (size_t)fu->c * sp_dtype_size(dt));
      rc = sp_ckpt_read_elems(st, t, 0, (int64_t)t->numel, dst, dt, path, d);
      int crc = kind_commit(f, u, k, dst, rc == 0, d);
      if (rc == 0) rc = crc;
    }
  }
  /* LOCAL buffers are in their compute dtype: cast first so they land */
  if (rc == 0) rc = sp_fsdp_lazy_init(f, d);
  if (rc == 0) rc = load_buffers(f, st, path, d);
  if (rc == 0) {
    info->optim_steps = o.steps;
    info->n_states = (uint32_t)o.n_states;
    info->world_size = sp_ckpt_meta_world(st);
  }
  sp_safetensors_close(st);
  return rc;
}

int sp_ckpt_load_with(sp_fsdp *f, sp_ckpt_kind kind, const char *dir,
                      const sp_ckpt_load_opts *opts, sp_ckpt_info *info,
                      sp_diag *d) {
  if (!f || !dir) return sp_diag_set(d, SP_EINVAL, "sp_ckpt_load: no dir");
  bool params_only = opts && opts->params_only;
  sp_ckpt_info got = {0};
  int rc = params_only ? 0 : check_registered(f, d);
  if (rc < 0) return rc;
  switch (kind) {
    case SP_CKPT_FULL: rc = load_full(f, dir, params_only, &got, d); break;
    case SP_CKPT_SHARDED:
      rc = load_sharded(f, dir, params_only, &got, d);
      break;
    case SP_CKPT_LOCAL: rc = load_local(f, dir, params_only, &got, d); break;
    default:
      return sp_diag_set(d, SP_EINVAL, "unknown checkpoint kind %d", (int)kind);
  }
  if (rc < 0)
    return sp_diag_prefix(d, rc, "loading %s checkpoint",
                          sp_ckpt_kind_name(kind));
  if (!params_only) f->optim_steps = got.optim_steps;
  if (info) *info = got;
  return 0;
}

int sp_ckpt_load(sp_fsdp *f, sp_ckpt_kind kind, const char *dir, sp_diag *d) {
  return sp_ckpt_load_with(f, kind, dir, NULL, NULL, d);
}
