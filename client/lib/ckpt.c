/* Checkpoints in safetensors, as FSDP's three state-dict types
 * (docs/fsdp.md, "Checkpoints"):
 *   FULL     rank 0 writes model.safetensors: every parameter FQN in full,
 *            persistent buffers restored to their original dtype;
 *   SHARDED  every rank writes rank-R-of-W.safetensors with its dim-0 chunk
 *            of every parameter (torch.chunk(W, dim=0), independent of the
 *            flat layout), rank 0 also the buffers (original dtype), and
 *            rank 0 writes index.json naming each chunk's file and rows;
 *   LOCAL    every rank writes local-R-of-W.safetensors with its flat shard
 *            per unit ("<unit fqn>._flat_param", unpadded) and the buffers
 *            in their compute dtype (no restore).
 * FULL and SHARDED load into any world size: each rank copies the elements
 * of its own shard out of the files. LOCAL needs the same plan. */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "cast/cast.h"
#include "fsdp_internal.h"
#include "base/json.h"
#include "safetensors/safetensors.h"

#define SP_CKPT_INDEX "index.json"
#define SP_CKPT_FULL_FILE "model.safetensors"
#define SP_CKPT_MAX_INDEX (64u << 20)

int sp_ckpt_kind_parse(const char *s, sp_ckpt_kind *out) {
  static const char *names[] = {"", "full", "sharded", "local"};
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++)
    if (s && strcasecmp(s, names[k]) == 0) {
      *out = (sp_ckpt_kind)k;
      return 0;
    }
  return SP_EINVAL;
}

const char *sp_ckpt_kind_name(sp_ckpt_kind k) {
  switch (k) {
    case SP_CKPT_FULL: return "FULL";
    case SP_CKPT_SHARDED: return "SHARDED";
    case SP_CKPT_LOCAL: return "LOCAL";
  }
  return "INVALID";
}

const char *sp_ckpt_kind_dir(sp_ckpt_kind k) {
  switch (k) {
    case SP_CKPT_FULL: return "full";
    case SP_CKPT_SHARDED: return "sharded";
    case SP_CKPT_LOCAL: return "local";
  }
  return "invalid";
}

/* ---- what a directory holds ---- */

/* A safetensors file's shardplane.plan_version, from its header alone
 * (the tensors after it may be large); "" when there is none. */
static void header_plan_version(const char *path, char *out, size_t cap) {
  out[0] = '\0';
  FILE *fp = fopen(path, "rb");
  if (!fp) return;
  uint8_t len8[8];
  uint64_t n = 0;
  if (fread(len8, 1, 8, fp) == 8)
    for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
  char *hdr = n > 0 && n <= SP_CKPT_MAX_INDEX ? malloc((size_t)n) : NULL;
  json_t *root = NULL;
  if (hdr && fread(hdr, 1, (size_t)n, fp) == n)
    root = json_loadb(hdr, (size_t)n, 0, NULL);
  const char *v = json_string_value(json_object_get(
      json_object_get(root, "__metadata__"), "shardplane.plan_version"));
  if (v) snprintf(out, cap, "%s", v);
  json_decref(root);
  free(hdr);
  fclose(fp);
}

static bool is_file(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Which kinds folder itself holds, into out (kinds found earlier stay). */
static void find_in(const char *folder, sp_ckpt_found *out) {
  char path[PATH_MAX];
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    if (out->present[k]) continue;
    char *ver = out->plan_version[k];
    size_t vcap = sizeof out->plan_version[k];
    if (k == SP_CKPT_FULL) {
      snprintf(path, sizeof path, "%s/%s", folder, SP_CKPT_FULL_FILE);
      if (!is_file(path)) continue;
      header_plan_version(path, ver, vcap);
    } else if (k == SP_CKPT_SHARDED) {
      snprintf(path, sizeof path, "%s/%s", folder, SP_CKPT_INDEX);
      if (!is_file(path)) continue;
      json_t *index = json_load_file(path, 0, NULL);
      const char *v = json_string_value(json_object_get(index,
                                                        "plan_version"));
      snprintf(ver, vcap, "%s", v ? v : "");
      json_decref(index);
    } else {
      DIR *dd = opendir(folder);
      struct dirent *e;
      unsigned w = 0;
      bool found = false;
      while (dd && !found && (e = readdir(dd)) != NULL) {
        int end = 0;
        found = sscanf(e->d_name, "local-0-of-%u.safetensors%n", &w,
                       &end) == 1 && end > 0 && e->d_name[end] == '\0';
      }
      if (dd) closedir(dd);
      if (!found) continue;
      snprintf(path, sizeof path, "%s/local-0-of-%u.safetensors", folder, w);
      header_plan_version(path, ver, vcap);
    }
    out->present[k] = true;
    snprintf(out->dir[k], sizeof out->dir[k], "%s", folder);
  }
}

int sp_ckpt_find(const char *dir, sp_ckpt_found *out) {
  memset(out, 0, sizeof *out);
  if (!dir) return 0;
  find_in(dir, out);
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    char sub[PATH_MAX];
    snprintf(sub, sizeof sub, "%s/%s", dir, sp_ckpt_kind_dir(k));
    sp_ckpt_found in_sub;
    memset(&in_sub, 0, sizeof in_sub);
    find_in(sub, &in_sub);
    if (out->present[k] || !in_sub.present[k]) continue;
    out->present[k] = true;
    memcpy(out->dir[k], in_sub.dir[k], sizeof out->dir[k]);
    memcpy(out->plan_version[k], in_sub.plan_version[k],
           sizeof out->plan_version[k]);
  }
  int n = 0;
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) n += out->present[k];
  return n;
}

/* "FULL (d/full) and SHARDED (d/sharded)" */
static void list_found(const sp_ckpt_found *f, char *out, size_t cap) {
  size_t len = 0, n = 0, total = 0;
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) total += f->present[k];
  out[0] = '\0';
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL && len < cap; k++) {
    if (!f->present[k]) continue;
    n++;
    int w = snprintf(out + len, cap - len, "%s%s (%s)",
                     n == 1 ? "" : n == total ? " and " : ", ",
                     sp_ckpt_kind_name((sp_ckpt_kind)k), f->dir[k]);
    if (w < 0) return;
    len += (size_t)w;
  }
}

int sp_ckpt_resolve(const char *dir, sp_ckpt_kind kind, char *out,
                    size_t cap, sp_ckpt_kind *out_kind, sp_diag *d) {
  sp_ckpt_found f;
  int n = sp_ckpt_find(dir, &f);
  char list[3 * 4200];
  list_found(&f, list, sizeof list);
  if (n == 0)
    return sp_diag_set(d, SP_ENOENT, "--load \"%s\": expected a checkpoint "
                       "directory: model.safetensors (FULL), index.json "
                       "(SHARDED) or local-R-of-W.safetensors (LOCAL), there "
                       "or in its full/, sharded/ or local/ folder; found "
                       "none", dir ? dir : "");
  if (kind == 0 && n > 1) {
    char choices[64] = "";
    for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++)
      if (f.present[k])
        snprintf(choices + strlen(choices), sizeof choices - strlen(choices),
                 "%s%s", choices[0] ? " or " : "",
                 sp_ckpt_kind_dir((sp_ckpt_kind)k));
    return sp_diag_set(d, SP_EINVAL, "--load \"%s\" holds %s checkpoints: "
                       "choose one with --load-kind %s", dir, list, choices);
  }
  if (kind != 0 && (kind < SP_CKPT_FULL || kind > SP_CKPT_LOCAL ||
                    !f.present[kind]))
    return sp_diag_set(d, SP_ENOENT, "--load \"%s\" --load-kind %s: no %s "
                       "checkpoint there; it holds %s", dir,
                       sp_ckpt_kind_dir(kind), sp_ckpt_kind_name(kind), list);
  for (int k = SP_CKPT_FULL; kind == 0 && k <= SP_CKPT_LOCAL; k++)
    if (f.present[k]) kind = (sp_ckpt_kind)k;
  if (snprintf(out, cap, "%s", f.dir[kind]) >= (int)cap)
    return sp_diag_set(d, SP_ETOOBIG, "%s: path too long", f.dir[kind]);
  *out_kind = kind;
  return 0;
}

int sp_ckpt_check_dir(const char *dir, const char *plan_version, sp_diag *d) {
  sp_ckpt_found f;
  sp_ckpt_find(dir, &f);
  for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++) {
    if (!f.present[k] || strcmp(f.plan_version[k], plan_version) == 0)
      continue;
    return sp_diag_set(d, SP_EEXIST, "%s holds a %s checkpoint of another "
                       "configuration (plan %s; this job's plan is %s), "
                       "which is kept: choose another directory with "
                       "--checkpoint-dir", dir,
                       sp_ckpt_kind_name((sp_ckpt_kind)k),
                       f.plan_version[k][0] ? f.plan_version[k] : "unknown",
                       plan_version);
  }
  return 0;
}

/* mkdir -p: every rank may race to create the same directories. */
static int make_dir(const char *dir, sp_diag *d) {
  char path[PATH_MAX];
  if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path)
    return sp_diag_set(d, SP_ETOOBIG, "%s: path too long", dir);
  for (char *p = path + 1;; p++) {
    bool end = *p == '\0';
    if (*p != '/' && !end) continue;
    *p = '\0';
    if (mkdir(path, 0777) != 0 && errno != EEXIST)
      return sp_diag_set(d, SP_EIO, "%s: cannot create: %s", path,
                         strerror(errno));
    if (end) return 0;
    *p = '/';
  }
}

static void file_name(char *out, size_t cap, const char *stem, uint32_t r,
                      uint32_t w) {
  snprintf(out, cap, "%s-%u-of-%u.safetensors", stem, r, w);
}

static void tensor_shape(const sp_tensor_spec *t, sp_st_entry *e) {
  e->ndim = (size_t)t->ndim;
  for (int i = 0; i < t->ndim; i++) e->shape[i] = (uint64_t)t->shape[i];
}

/* Every unit's full master parameter, gathered (a collective). Only the
 * ranks that keep them (keep true) hold the result; others free as they
 * go. */
static int gather_all(sp_fsdp *f, bool keep, uint8_t ***out, sp_diag *d) {
  uint8_t **full = calloc(f->n_units, sizeof *full);
  if (!full) return sp_diag_set(d, SP_ENOMEM, "no memory");
  int rc = sp_session_transition(f->s, SP_MACHINE_ROOT, 0,
                                 SP_ROOT_SUMMON_FULL_PARAMS, d);
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    full[u] = malloc((size_t)fu->u->numel * fu->esize);
    if (!full[u]) {
      rc = sp_diag_set(d, SP_ENOMEM, "no memory for unit %u", u);
      break;
    }
    rc = sp_fsdp_gather_unit(f, u, full[u], d);
    if (!keep) {
      free(full[u]);
      full[u] = NULL;
    }
  }
  if (rc == 0)
    rc = sp_session_transition(f->s, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, d);
  if (rc < 0) {
    for (size_t u = 0; u < f->n_units; u++) free(full[u]);
    free(full);
    return rc;
  }
  *out = full;
  return 0;
}

static void free_all(sp_fsdp *f, uint8_t **full) {
  for (size_t u = 0; full && u < f->n_units; u++) free(full[u]);
  free(full);
}

/* Pointer to parameter p's first element inside its unit's full buffer. */
static const uint8_t *param_in_full(sp_fsdp *f, uint8_t **full, int32_t p) {
  int32_t u = f->plan->param_unit[p];
  const sp_flat_entry *e = &f->plan->entries[f->plan->param_entry[p]];
  return full[u] + (size_t)e->offset * f->units[u].esize;
}

/* Persistent buffers restored to their original dtype (FULL, SHARDED) or
 * as they are (LOCAL). Appends entries; the copies go into *owned. A
 * runtime on a GPU hands out host copies (sp_fsdp_buffer_host), so the
 * restore casts on the host. */
static int add_buffers(sp_fsdp *f, bool restore, sp_st_entry *es, size_t *n,
                       uint8_t **owned, sp_diag *d) {
  const sp_model *m = f->model;
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    if (!t->flag) continue; /* non-persistent: not in a state dict */
    sp_dtype cur = f->buffer_dtype[b];
    sp_dtype to = restore ? t->dtype : cur;
    sp_st_entry *e = &es[(*n)++];
    memset(e, 0, sizeof *e);
    e->name = t->fqn;
    e->dtype = to;
    tensor_shape(t, e);
    const uint8_t *src;
    uint8_t *staged;
    int rc = sp_fsdp_buffer_host(f, (int32_t)b, &src, &staged, d);
    if (rc < 0) return sp_diag_prefix(d, rc, "reading buffer %s", t->fqn);
    if (to == cur) {
      owned[b] = staged;
      e->data = src;
      continue;
    }
    uint8_t *copy = malloc((size_t)t->numel * sp_dtype_size(to) + 1);
    if (!copy) {
      free(staged);
      return sp_diag_set(d, SP_ENOMEM, "no memory for %s", t->fqn);
    }
    owned[b] = copy;
    rc = sp_cast(copy, to, src, cur, (size_t)t->numel);
    free(staged);
    if (rc < 0)
      return sp_diag_set(d, rc, "restoring buffer %s to %s", t->fqn,
                         sp_dtype_name(to));
    e->data = copy;
  }
  return 0;
}

static int write_file(sp_fsdp *f, const char *dir, const char *name,
                      const sp_st_entry *es, size_t n, sp_ckpt_kind kind,
                      sp_diag *d) {
  char path[PATH_MAX], world[16], rank[16];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(world, sizeof world, "%u", f->world);
  snprintf(rank, sizeof rank, "%u", f->rank);
  sp_st_kv meta[] = {{"shardplane.kind", sp_ckpt_kind_name(kind)},
                     {"shardplane.plan_version", f->plan->version_hex},
                     {"shardplane.world_size", world},
                     {"shardplane.rank", rank}};
  return sp_st_write(path, es, n, meta, 4, d);
}

static int save_full_or_sharded(sp_fsdp *f, sp_ckpt_kind kind,
                                const char *dir, sp_diag *d) {
  const sp_model *m = f->model;
  bool full_kind = kind == SP_CKPT_FULL;
  bool writer = !full_kind || f->rank == 0;
  uint8_t **full = NULL;
  int rc = gather_all(f, writer, &full, d);
  if (rc < 0) return rc;
  if (!writer) {
    free_all(f, full);
    return 0;
  }
  size_t cap = m->n_params + m->n_buffers;
  sp_st_entry *es = calloc(cap ? cap : 1, sizeof *es);
  uint8_t **owned = calloc(m->n_buffers ? m->n_buffers : 1, sizeof *owned);
  json_t *index = full_kind ? NULL : json_object();
  json_t *tensors = full_kind ? NULL : json_object();
  size_t n = 0;
  char name[128];
  if (full_kind)
    snprintf(name, sizeof name, "%s", SP_CKPT_FULL_FILE);
  else
    file_name(name, sizeof name, "rank", f->rank, f->world);
  if (!es || !owned || (!full_kind && (!index || !tensors)))
    rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t p = 0; rc == 0 && p < m->n_params; p++) {
    const sp_tensor_spec *t = &m->params[p];
    if (f->plan->param_unit[p] < 0) continue;
    const uint8_t *src = param_in_full(f, full, (int32_t)p);
    sp_st_entry e = {.name = t->fqn, .dtype = f->units[f->plan->param_unit[p]]
                                                 .u->dtype};
    tensor_shape(t, &e);
    e.data = src;
    if (!full_kind) {
      /* torch.chunk(W, dim=0): chunk rows ceil(d0/W), fewer chunks when
       * d0 is small; scalars go whole to rank 0 */
      int64_t d0 = t->ndim ? t->shape[0] : 1;
      int64_t rows = (d0 + f->world - 1) / f->world;
      int64_t first = rows * f->rank, last = first + rows;
      if (last > d0) last = d0;
      json_t *info = json_pack("{s:s, s:[], s:[]}", "dtype",
                               sp_dtype_name(e.dtype), "shape", "chunks");
      for (int i = 0; info && i < t->ndim; i++)
        json_array_append_new(json_object_get(info, "shape"),
                              json_integer(t->shape[i]));
      for (uint32_t r = 0; info && r < f->world; r++) {
        int64_t a = rows * r, b = a + rows > d0 ? d0 : a + rows;
        if (a >= b) break;
        char fn[128];
        file_name(fn, sizeof fn, "rank", r, f->world);
        json_array_append_new(json_object_get(info, "chunks"),
                              json_pack("{s:s, s:I, s:I}", "file", fn, "row",
                                        (json_int_t)a, "rows",
                                        (json_int_t)(b - a)));
      }
      if (!info) {
        rc = sp_diag_set(d, SP_ENOMEM, "no memory");
        break;
      }
      json_object_set_new(tensors, t->fqn, info);
      if (first >= last) continue;
      int64_t row_numel = d0 ? t->numel / d0 : 0;
      if (t->ndim) e.shape[0] = (uint64_t)(last - first);
      e.data = src + (size_t)(first * row_numel) * sp_dtype_size(e.dtype);
    }
    es[n++] = e;
  }
  if (rc == 0 && f->rank == 0) rc = add_buffers(f, true, es, &n, owned, d);
  if (rc == 0) rc = write_file(f, dir, name, es, n, kind, d);
  if (rc == 0 && !full_kind && f->rank == 0) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", dir, SP_CKPT_INDEX);
    char bufs[128];
    file_name(bufs, sizeof bufs, "rank", 0, f->world);
    json_object_set_new(index, "format",
                        json_string("shardplane.sharded/v1"));
    json_object_set_new(index, "plan_version",
                        json_string(f->plan->version_hex));
    json_object_set_new(index, "world_size", json_integer(f->world));
    json_object_set_new(index, "buffers_file", json_string(bufs));
    json_object_set(index, "tensors", tensors);
    char tmp[PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (json_dump_file(index, tmp, JSON_INDENT(1) | JSON_SORT_KEYS) != 0 ||
        rename(tmp, path) != 0)
      rc = sp_diag_set(d, SP_EIO, "%s: cannot write", path);
  }
  json_decref(tensors);
  json_decref(index);
  for (size_t b = 0; owned && b < m->n_buffers; b++) free(owned[b]);
  free(owned);
  free(es);
  free_all(f, full);
  return rc;
}

static int save_local(sp_fsdp *f, const char *dir, sp_diag *d) {
  const sp_model *m = f->model;
  size_t cap = f->n_units + m->n_buffers;
  sp_st_entry *es = calloc(cap, sizeof *es);
  char (*names)[SP_ST_MAX_NAME] = calloc(f->n_units, sizeof *names);
  uint8_t **owned = calloc(m->n_buffers ? m->n_buffers : 1, sizeof *owned);
  /* host copies of device shards, kept until the file is written */
  uint8_t **shards = calloc(f->n_units, sizeof *shards);
  int rc = es && names && owned && shards
               ? 0
               : sp_diag_set(d, SP_ENOMEM, "no memory");
  size_t n = 0;
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    int64_t s, e, pad;
    rc = sp_plan_rank_range(f->plan, u, f->rank, &s, &e, &pad);
    if (rc < 0) break;
    const char *ufqn = sp_plan_unit_fqn(f->plan, u);
    snprintf(names[u], SP_ST_MAX_NAME, "%s%s_flat_param", ufqn,
             *ufqn ? "." : "");
    const uint8_t *data;
    rc = sp_fsdp_shard_host(f, u, &data, &shards[u], d);
    if (rc < 0) break;
    es[n++] = (sp_st_entry){.name = names[u], .dtype = fu->u->dtype,
                            .ndim = 1, .shape = {(uint64_t)(e - s)},
                            .data = data};
  }
  if (rc == 0) rc = sp_fsdp_lazy_init(f, d);
  if (rc == 0) rc = add_buffers(f, false, es, &n, owned, d);
  char name[128];
  file_name(name, sizeof name, "local", f->rank, f->world);
  if (rc == 0) rc = write_file(f, dir, name, es, n, SP_CKPT_LOCAL, d);
  for (size_t b = 0; owned && b < m->n_buffers; b++) free(owned[b]);
  for (size_t u = 0; shards && u < f->n_units; u++) free(shards[u]);
  free(shards);
  free(owned);
  free(names);
  free(es);
  return rc;
}

int sp_ckpt_save(sp_fsdp *f, sp_ckpt_kind kind, const char *dir, sp_diag *d) {
  if (!f || !dir) return sp_diag_set(d, SP_EINVAL, "sp_ckpt_save: no dir");
  int rc = make_dir(dir, d);
  if (rc < 0) return rc;
  switch (kind) {
    case SP_CKPT_FULL:
    case SP_CKPT_SHARDED:
      rc = save_full_or_sharded(f, kind, dir, d);
      break;
    case SP_CKPT_LOCAL:
      rc = save_local(f, dir, d);
      break;
    default:
      return sp_diag_set(d, SP_EINVAL, "unknown checkpoint kind %d",
                         (int)kind);
  }
  if (rc < 0)
    sp_diag_prefix(d, rc, "writing %s checkpoint", sp_ckpt_kind_name(kind));
  /* the checkpoint is complete only when every rank's file is */
  if (rc == 0) rc = sp_comm_barrier(f->world_comm, d);
  return rc;
}

/* ---- loading ---- */

/* Copies n elements of a tensor (dtype src_t) into dst (dtype dst_t),
 * casting between floating dtypes, bytes for equal dtypes. */
static int copy_elems(void *dst, sp_dtype dst_t, const uint8_t *src,
                      sp_dtype src_t, size_t n, const char *what,
                      sp_diag *d) {
  if (dst_t == src_t) {
    memcpy(dst, src, n * sp_dtype_size(dst_t));
    return 0;
  }
  if (!sp_dtype_is_floating(dst_t) || !sp_dtype_is_floating(src_t))
    return sp_diag_set(d, SP_EFORMAT, "%s: dtype %s, expected %s", what,
                       sp_dtype_name(src_t), sp_dtype_name(dst_t));
  /* tensor data is only byte-aligned in general: cast from an aligned copy */
  void *tmp = malloc(n * sp_dtype_size(src_t) + 1);
  if (!tmp) return sp_diag_set(d, SP_ENOMEM, "no memory");
  memcpy(tmp, src, n * sp_dtype_size(src_t));
  int rc = sp_cast(dst, dst_t, tmp, src_t, n);
  free(tmp);
  return rc < 0 ? sp_diag_set(d, rc, "%s: cast", what) : 0;
}

static int check_shape(const sp_st_tensor *t, const sp_tensor_spec *spec,
                       int64_t rows, const char *file, sp_diag *d) {
  bool ok = (int)t->ndim == spec->ndim;
  for (int i = 0; ok && i < spec->ndim; i++)
    ok = (int64_t)t->shape[i] == (i == 0 && rows >= 0 ? rows : spec->shape[i]);
  if (!ok)
    return sp_diag_set(d, SP_EFORMAT, "%s: tensor %s: shape does not match "
                       "the model", file, spec->fqn);
  return 0;
}

/* Loads every persistent buffer from st (its original or compute dtype)
 * into the runtime's buffers. */
static int load_buffers(sp_fsdp *f, const sp_st_file *st, const char *file,
                        sp_diag *d) {
  const sp_model *m = f->model;
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *spec = &m->buffers[b];
    if (!spec->flag) continue;
    const sp_st_tensor *t;
    int rc = sp_st_get(st, spec->fqn, &t, d);
    if (rc == 0) rc = check_shape(t, spec, -1, file, d);
    if (rc < 0) return rc;
    /* the buffer itself on the CPU, a host image uploaded on a GPU */
    uint8_t *dst = sp_fsdp_buffer_stage(f, (int32_t)b, d);
    if (!dst) return SP_ENOMEM;
    rc = copy_elems(dst, f->buffer_dtype[b], t->data, t->dtype,
                    (size_t)spec->numel, spec->fqn, d);
    int crc = sp_fsdp_buffer_commit(f, (int32_t)b, dst, rc == 0, d);
    if (rc == 0) rc = crc;
    if (rc < 0) return rc;
  }
  return 0;
}

/* The elements of param p this rank holds, from a source that can copy
 * any [a, a+n) range of the flattened tensor. */
typedef int (*range_fn)(void *ctx, int32_t p, int64_t a, int64_t n,
                        void *dst, sp_dtype dt, sp_diag *d);

static int fill_shards(sp_fsdp *f, range_fn fn, void *ctx, sp_diag *d) {
  for (uint32_t u = 0; u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    size_t n = 0;
    int rc = sp_plan_shard_params(f->plan, u, f->rank, NULL, 0, &n);
    sp_shard_param *sp = calloc(n ? n : 1, sizeof *sp);
    if (!sp) return sp_diag_set(d, SP_ENOMEM, "no memory");
    if (rc == 0) rc = sp_plan_shard_params(f->plan, u, f->rank, sp, n, &n);
    /* the shard itself on the CPU, a host image uploaded on a GPU */
    uint8_t *shard = rc == 0 ? sp_fsdp_shard_stage(f, u, d) : NULL;
    if (rc == 0 && !shard) rc = SP_ENOMEM;
    if (rc == 0) memset(shard, 0, (size_t)fu->c * fu->esize);
    for (size_t i = 0; rc == 0 && i < n; i++) {
      const sp_flat_entry *e = &f->plan->entries[sp[i].entry];
      rc = fn(ctx, e->param, sp[i].intra_start, sp[i].numel_in_shard,
              shard + (size_t)sp[i].offset_in_shard * fu->esize,
              fu->u->dtype, d);
    }
    free(sp);
    if (shard) {
      int crc = sp_fsdp_shard_commit(f, u, shard, rc == 0, d);
      if (rc == 0) rc = crc;
    }
    if (rc < 0) return rc;
  }
  return 0;
}

typedef struct full_ctx {
  sp_fsdp *f;
  const sp_st_file *st;
  const char *file;
} full_ctx;

static int full_range(void *vctx, int32_t p, int64_t a, int64_t n, void *dst,
                      sp_dtype dt, sp_diag *d) {
  full_ctx *c = vctx;
  const sp_tensor_spec *spec = &c->f->model->params[p];
  const sp_st_tensor *t;
  int rc = sp_st_get(c->st, spec->fqn, &t, d);
  if (rc == 0) rc = check_shape(t, spec, -1, c->file, d);
  if (rc < 0) return rc;
  return copy_elems(dst, dt, t->data + (size_t)a * sp_dtype_size(t->dtype),
                    t->dtype, (size_t)n, spec->fqn, d);
}

static int load_full(sp_fsdp *f, const char *dir, sp_diag *d) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", dir, SP_CKPT_FULL_FILE);
  sp_st_file *st;
  int rc = sp_st_open(path, &st, d);
  if (rc < 0) return rc;
  full_ctx c = {f, st, path};
  rc = fill_shards(f, full_range, &c, d);
  if (rc == 0) rc = load_buffers(f, st, path, d);
  sp_st_free(st);
  return rc;
}

/* SHARDED: the index names, per FQN, the files holding row ranges. */
typedef struct sharded_ctx {
  sp_fsdp *f;
  const char *dir;
  json_t *tensors;
  char **names; /* opened files, by name */
  sp_st_file **files;
  size_t n_files, cap_files;
} sharded_ctx;

static int sharded_file(sharded_ctx *c, const char *name,
                        const sp_st_file **out, sp_diag *d) {
  for (size_t i = 0; i < c->n_files; i++)
    if (strcmp(c->names[i], name) == 0) {
      *out = c->files[i];
      return 0;
    }
  /* names come from an untrusted index: plain file names only */
  if (!*name || strchr(name, '/') || strcmp(name, "..") == 0 ||
      strcmp(name, ".") == 0)
    return sp_diag_set(d, SP_EFORMAT, "%s/%s: bad file name \"%s\"", c->dir,
                       SP_CKPT_INDEX, name);
  if (c->n_files == c->cap_files) {
    size_t cap = c->cap_files ? 2 * c->cap_files : 8;
    char **nn = realloc(c->names, cap * sizeof *nn);
    if (nn) c->names = nn;
    sp_st_file **nf = realloc(c->files, cap * sizeof *nf);
    if (nf) c->files = nf;
    if (!nn || !nf) return sp_diag_set(d, SP_ENOMEM, "no memory");
    c->cap_files = cap;
  }
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", c->dir, name);
  sp_st_file *st;
  int rc = sp_st_open(path, &st, d);
  if (rc < 0) return rc;
  c->names[c->n_files] = strdup(name);
  c->files[c->n_files++] = st;
  *out = st;
  return c->names[c->n_files - 1] ? 0 : sp_diag_set(d, SP_ENOMEM, "no memory");
}

static int sharded_range(void *vctx, int32_t p, int64_t a, int64_t n,
                         void *dst, sp_dtype dt, sp_diag *d) {
  sharded_ctx *c = vctx;
  const sp_tensor_spec *spec = &c->f->model->params[p];
  json_t *info = json_object_get(c->tensors, spec->fqn);
  json_t *chunks = info ? json_object_get(info, "chunks") : NULL;
  if (!json_is_array(chunks))
    return sp_diag_set(d, SP_ENOENT, "%s/%s: no entry for %s", c->dir,
                       SP_CKPT_INDEX, spec->fqn);
  int64_t d0 = spec->ndim ? spec->shape[0] : 1;
  int64_t row_numel = d0 ? spec->numel / d0 : 0;
  size_t esz = sp_dtype_size(dt);
  int64_t covered = 0;
  size_t i;
  json_t *ch;
  json_array_foreach(chunks, i, ch) {
    json_t *jf = json_object_get(ch, "file"), *jr = json_object_get(ch, "row"),
           *jn = json_object_get(ch, "rows");
    if (!json_is_string(jf) || !json_is_integer(jr) || !json_is_integer(jn))
      return sp_diag_set(d, SP_EFORMAT, "%s/%s: %s: bad chunk %zu", c->dir,
                         SP_CKPT_INDEX, spec->fqn, i);
    int64_t row = json_integer_value(jr), rows = json_integer_value(jn);
    if (row < 0 || rows <= 0 || row > d0 || rows > d0 - row)
      return sp_diag_set(d, SP_EFORMAT, "%s/%s: %s: chunk %zu rows out of "
                         "range", c->dir, SP_CKPT_INDEX, spec->fqn, i);
    int64_t ca = row * row_numel, cb = (row + rows) * row_numel;
    int64_t lo = a > ca ? a : ca, hi = a + n < cb ? a + n : cb;
    if (lo >= hi) continue;
    const sp_st_file *st;
    int rc = sharded_file(c, json_string_value(jf), &st, d);
    const sp_st_tensor *t;
    if (rc == 0) rc = sp_st_get(st, spec->fqn, &t, d);
    if (rc == 0)
      rc = check_shape(t, spec, spec->ndim ? rows : -1, json_string_value(jf),
                       d);
    if (rc == 0)
      rc = copy_elems((uint8_t *)dst + (size_t)(lo - a) * esz, dt,
                      t->data + (size_t)(lo - ca) * sp_dtype_size(t->dtype),
                      t->dtype, (size_t)(hi - lo), spec->fqn, d);
    if (rc < 0) return rc;
    covered += hi - lo;
  }
  if (covered != n)
    return sp_diag_set(d, SP_EFORMAT, "%s/%s: chunks of %s do not cover "
                       "elements [%lld, %lld)", c->dir, SP_CKPT_INDEX,
                       spec->fqn, (long long)a, (long long)(a + n));
  return 0;
}

static int load_sharded(sp_fsdp *f, const char *dir, sp_diag *d) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s", dir, SP_CKPT_INDEX);
  char *buf;
  size_t len;
  int rc = sp_json_read_file(path, SP_CKPT_MAX_INDEX, &buf, &len, d);
  if (rc < 0) return rc;
  sp_json_reader r = {path, d};
  json_t *root = NULL;
  rc = sp_json_parse(&r, buf, len, SP_CKPT_MAX_INDEX, &root);
  free(buf);
  if (rc < 0) return rc;
  sharded_ctx c = {.f = f, .dir = dir,
                   .tensors = json_object_get(root, "tensors")};
  const char *bufs = json_string_value(json_object_get(root, "buffers_file"));
  if (!json_is_object(c.tensors) || !bufs)
    rc = sp_json_fail(&r, SP_EFORMAT, "not a shardplane.sharded/v1 index");
  if (rc == 0) rc = fill_shards(f, sharded_range, &c, d);
  const sp_st_file *st;
  if (rc == 0) rc = sharded_file(&c, bufs, &st, d);
  if (rc == 0) rc = load_buffers(f, st, bufs, d);
  for (size_t i = 0; i < c.n_files; i++) {
    sp_st_free(c.files[i]);
    free(c.names[i]);
  }
  free(c.files);
  free(c.names);
  json_decref(root);
  return rc;
}

static int load_local(sp_fsdp *f, const char *dir, sp_diag *d) {
  char name[128], path[PATH_MAX];
  file_name(name, sizeof name, "local", f->rank, f->world);
  snprintf(path, sizeof path, "%s/%s", dir, name);
  sp_st_file *st;
  int rc = sp_st_open(path, &st, d);
  if (rc == SP_ENOENT)
    return sp_diag_prefix(d, rc, "a LOCAL checkpoint loads only into the "
                          "world size and plan it was written with (this "
                          "rank is %u of %u)", f->rank, f->world);
  if (rc < 0) return rc;
  const char *ver = sp_st_metadata_get(st, "shardplane.plan_version");
  if (!ver || strcmp(ver, f->plan->version_hex) != 0)
    rc = sp_diag_set(d, SP_ESTATE, "%s: plan %s, this job's plan is %s: a "
                     "LOCAL checkpoint loads only into the same plan",
                     path, ver ? ver : "(none)", f->plan->version_hex);
  for (uint32_t u = 0; rc == 0 && u < f->n_units; u++) {
    sp_fsdp_unit *fu = &f->units[u];
    if (!fu->has_data) continue;
    char tn[SP_ST_MAX_NAME];
    const char *ufqn = sp_plan_unit_fqn(f->plan, u);
    snprintf(tn, sizeof tn, "%s%s_flat_param", ufqn, *ufqn ? "." : "");
    const sp_st_tensor *t;
    rc = sp_st_get(st, tn, &t, d);
    if (rc < 0) break;
    if (t->ndim != 1 || (int64_t)t->numel > fu->c || t->dtype != fu->u->dtype) {
      rc = sp_diag_set(d, SP_EFORMAT, "%s: %s: shape or dtype does not match",
                       path, tn);
      break;
    }
    uint8_t *shard = sp_fsdp_shard_stage(f, u, d);
    if (!shard) {
      rc = SP_ENOMEM;
      break;
    }
    memset(shard, 0, (size_t)fu->c * fu->esize);
    memcpy(shard, t->data, t->nbytes);
    rc = sp_fsdp_shard_commit(f, u, shard, true, d);
  }
  /* LOCAL buffers are in their compute dtype: cast first so they land */
  if (rc == 0) rc = sp_fsdp_lazy_init(f, d);
  if (rc == 0) rc = load_buffers(f, st, path, d);
  sp_st_free(st);
  return rc;
}

int sp_ckpt_load(sp_fsdp *f, sp_ckpt_kind kind, const char *dir, sp_diag *d) {
  if (!f || !dir) return sp_diag_set(d, SP_EINVAL, "sp_ckpt_load: no dir");
  int rc;
  switch (kind) {
    case SP_CKPT_FULL: rc = load_full(f, dir, d); break;
    case SP_CKPT_SHARDED: rc = load_sharded(f, dir, d); break;
    case SP_CKPT_LOCAL: rc = load_local(f, dir, d); break;
    default:
      return sp_diag_set(d, SP_EINVAL, "unknown checkpoint kind %d",
                         (int)kind);
  }
  if (rc < 0)
    sp_diag_prefix(d, rc, "loading %s checkpoint", sp_ckpt_kind_name(kind));
  return rc;
}
