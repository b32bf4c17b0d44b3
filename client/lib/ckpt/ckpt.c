/* Checkpoints in safetensors, as FSDP's three state-dict types
 * (docs/fsdp.md, "Checkpoints"):
 *   FULL     rank 0 writes model.safetensors: every parameter FQN in full,
 *            persistent buffers restored to their original dtype, every
 *            registered optimizer state as "optim.<state>.<fqn>";
 *   SHARDED  every rank writes rank-R-of-W.safetensors with its dim-0 chunk
 *            of every parameter and state (torch.chunk(W, dim=0),
 *            independent of the flat layout), rank 0 also the buffers
 *            (original dtype), and rank 0 writes index.json naming each
 *            chunk's file and rows;
 *   LOCAL    every rank writes local-R-of-W.safetensors with its flat shard
 *            per unit ("<unit fqn>._flat_param", unpadded), its states
 *            ("<unit fqn>.optim.<state>") and the buffers in their compute
 *            dtype (no restore).
 * Every file's metadata carries the optimizer step count and the state
 * names, so a resumed run continues where the saved one stopped.
 *
 * This file is the format without a runtime (ckpt_format.h): what a folder
 * holds, its staging and publish, names, and range readers. The runtime's
 * save and load are lib/fsdp/fsdp_ckpt.c.
 *
 * Publishing: every rank writes into "<dir>.tmp"; when all have finished,
 * rank 0 swaps it with dir (one atomic rename exchange) and removes the
 * previous checkpoint, so dir always holds a complete checkpoint, the old
 * one until the new one is done. */
#include "ckpt_format.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "cast/cast.h"
#include "lib/shardplane.h"

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

/* A step count as the metadata writes it (decimal digits): whether s is
 * one, the count in *out. */
static bool step_count(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v =
      s && *s >= '0' && *s <= '9' ? strtoull(s, &end, 10) : 0;
  if (!s || *s < '0' || *s > '9' || *end || errno == ERANGE) return false;
  *out = v;
  return true;
}

/* A safetensors file's shardplane.plan_version ("" when there is none) and
 * step count (0), from its header alone (the tensors after it may be
 * large). */
static void header_meta(const char *path, char *out, size_t cap,
                        uint64_t *steps) {
  out[0] = '\0';
  *steps = 0;
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
  json_t *meta = json_object_get(root, "__metadata__");
  const char *v =
      json_string_value(json_object_get(meta, "shardplane.plan_version"));
  if (v) snprintf(out, cap, "%s", v);
  /* only to describe the checkpoint: sp_ckpt_load checks it */
  if (!step_count(json_string_value(json_object_get(meta, SP_CKPT_META_STEPS)),
                  steps))
    *steps = 0;
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
    uint64_t *steps = &out->steps[k];
    if (k == SP_CKPT_FULL) {
      snprintf(path, sizeof path, "%s/%s", folder, SP_CKPT_FULL_FILE);
      if (!is_file(path)) continue;
      header_meta(path, ver, vcap, steps);
    } else if (k == SP_CKPT_SHARDED) {
      snprintf(path, sizeof path, "%s/%s", folder, SP_CKPT_INDEX);
      if (!is_file(path)) continue;
      json_t *index = json_load_file(path, 0, NULL);
      const char *v = json_string_value(json_object_get(index, "plan_version"));
      snprintf(ver, vcap, "%s", v ? v : "");
      json_t *st = json_object_get(index, "optim_steps");
      *steps = json_is_integer(st) && json_integer_value(st) > 0
                   ? (uint64_t)json_integer_value(st)
                   : 0;
      json_decref(index);
    } else {
      DIR *dd = opendir(folder);
      struct dirent *e;
      unsigned w = 0;
      bool found = false;
      while (dd && !found && (e = readdir(dd)) != NULL) {
        int end = 0;
        found =
            sscanf(e->d_name, "local-0-of-%u.safetensors%n", &w, &end) == 1 &&
            end > 0 && e->d_name[end] == '\0';
      }
      if (dd) closedir(dd);
      if (!found) continue;
      snprintf(path, sizeof path, "%s/local-0-of-%u.safetensors", folder, w);
      header_meta(path, ver, vcap, steps);
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
    out->steps[k] = in_sub.steps[k];
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
                     n == 1       ? ""
                     : n == total ? " and "
                                  : ", ",
                     sp_ckpt_kind_name((sp_ckpt_kind)k), f->dir[k]);
    if (w < 0) return;
    len += (size_t)w;
  }
}

int sp_ckpt_resolve(const char *dir, sp_ckpt_kind kind, char *out, size_t cap,
                    sp_ckpt_kind *out_kind, sp_diag *d) {
  sp_ckpt_found f;
  int n = sp_ckpt_find(dir, &f);
  char list[3 * 4200];
  list_found(&f, list, sizeof list);
  if (n == 0)
    return sp_diag_set(d, SP_ENOENT,
                       "--load \"%s\": expected a checkpoint "
                       "directory: model.safetensors (FULL), index.json "
                       "(SHARDED) or local-R-of-W.safetensors (LOCAL), there "
                       "or in its full/, sharded/ or local/ folder; found "
                       "none",
                       dir ? dir : "");
  if (kind == 0 && n > 1) {
    char choices[64] = "";
    for (int k = SP_CKPT_FULL; k <= SP_CKPT_LOCAL; k++)
      if (f.present[k])
        snprintf(choices + strlen(choices), sizeof choices - strlen(choices),
                 "%s%s", choices[0] ? " or " : "",
                 sp_ckpt_kind_dir((sp_ckpt_kind)k));
    return sp_diag_set(d, SP_EINVAL,
                       "--load \"%s\" holds %s checkpoints: "
                       "choose one with --load-kind %s",
                       dir, list, choices);
  }
  if (kind != 0 &&
      (kind < SP_CKPT_FULL || kind > SP_CKPT_LOCAL || !f.present[kind]))
    return sp_diag_set(d, SP_ENOENT,
                       "--load \"%s\" --load-kind %s: no %s "
                       "checkpoint there; it holds %s",
                       dir, sp_ckpt_kind_dir(kind), sp_ckpt_kind_name(kind),
                       list);
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
    if (!f.present[k] || strcmp(f.plan_version[k], plan_version) == 0) continue;
    return sp_diag_set(d, SP_EEXIST,
                       "%s holds a %s checkpoint of another "
                       "configuration (plan %s; this job's plan is %s), "
                       "which is kept: choose another directory with "
                       "--checkpoint-dir",
                       dir, sp_ckpt_kind_name((sp_ckpt_kind)k),
                       f.plan_version[k][0] ? f.plan_version[k] : "unknown",
                       plan_version);
  }
  return 0;
}
/* ---- directories ---- */

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

/* Calls fn for every entry of dir but "." and "..", until
 * one fails; an absent dir has no entries. */
static int each_entry(const char *dir,
                      int (*fn)(const char *dir, int dfd, const char *name,
                                sp_diag *d),
                      sp_diag *d) {
  DIR *dp = opendir(dir);
  if (!dp)
    return errno == ENOENT ? 0
                           : sp_diag_set(d, SP_EIO, "%s: cannot open: %s", dir,
                                         strerror(errno));
  int rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(dp)) != NULL)
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
      rc = fn(dir, dirfd(dp), e->d_name, d);
  closedir(dp);
  return rc;
}

static int remove_file(const char *dir, int dfd, const char *name, sp_diag *d) {
  if (unlinkat(dfd, name, 0) == 0) return 0;
  return sp_diag_set(d, SP_EIO,
                     "%s/%s: cannot remove: %s (a checkpoint "
                     "directory holds only files)",
                     dir, name, strerror(errno));
}

/* Removes a checkpoint directory: its files, then itself. A checkpoint
 * holds only files, so a subdirectory means the path is not one of ours:
 * it is left alone and reported. Absent: nothing to do. */
static int remove_ckpt_dir(const char *path, sp_diag *d) {
  int rc = each_entry(path, remove_file, d);
  if (rc == 0 && rmdir(path) != 0 && errno != ENOENT)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot remove: %s", path, strerror(errno));
  return rc;
}

static int sync_path(const char *path, sp_diag *d) {
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return sp_diag_set(d, SP_EIO, "%s: cannot open: %s", path, strerror(errno));
  /* some file systems cannot sync a directory; the files are synced */
  int rc = 0;
  if (fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot sync: %s", path, strerror(errno));
  close(fd);
  return rc;
}

int sp_ckpt_paths_of(const char *dir, sp_ckpt_paths *p, sp_diag *d) {
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/') n--;
  if (n + sizeof SP_CKPT_STAGING >= sizeof p->dir)
    return sp_diag_set(d, SP_ETOOBIG, "%s: path too long", dir);
  memcpy(p->dir, dir, n);
  p->dir[n] = '\0';
  const char *base = strrchr(p->dir, '/');
  base = base ? base + 1 : p->dir;
  /* the swap renames dir itself, which needs a name of its own */
  if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
    return sp_diag_set(d, SP_EINVAL,
                       "%s: a checkpoint directory needs a "
                       "name of its own (not /, . or ..)",
                       dir);
  int sn =
      snprintf(p->staging, sizeof p->staging, "%s%s", p->dir, SP_CKPT_STAGING);
  if (sn < 0 || (size_t)sn >= sizeof p->staging)
    return sp_diag_set(d, SP_ETOOBIG, "%s: path too long", dir);
  if (base == p->dir) {
    snprintf(p->parent, sizeof p->parent, ".");
  } else {
    size_t pl = (size_t)(base - p->dir - 1);
    memcpy(p->parent, p->dir, pl ? pl : 1);
    p->parent[pl ? pl : 1] = '\0';
  }
  return 0;
}

static int regular_file(const char *dir, int dfd, const char *name,
                        sp_diag *d) {
  struct stat sb;
  if (fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(sb.st_mode))
    return 0;
  return sp_diag_set(d, SP_EEXIST,
                     "%s holds %s, which is not a checkpoint "
                     "file: a save replaces the whole folder, so choose "
                     "another",
                     dir, name);
}

/* The folder a save will replace holds only files (an earlier
 * checkpoint), or does not exist: anything else is not ours to remove. */
static int check_replaceable(const char *dir, sp_diag *d) {
  return each_entry(dir, regular_file, d);
}

/* Rank 0, before anyone writes: an empty staging directory (what a crashed
 * save left there goes). */
int sp_ckpt_prepare_staging(const sp_ckpt_paths *p, sp_diag *d) {
  int rc = make_dir(p->parent, d);
  if (rc == 0) rc = check_replaceable(p->dir, d);
  if (rc == 0) rc = remove_ckpt_dir(p->staging, d);
  if (rc == 0 && mkdir(p->staging, 0777) != 0)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot create: %s", p->staging,
                     strerror(errno));
  return rc;
}

/* Rank 0, after every rank's files are complete: staging becomes dir in
 * one step. With an old checkpoint there the two are exchanged
 * atomically (renameat2 RENAME_EXCHANGE), so dir is never missing or
 * half-written, then the old one, now under the staging name, is removed.
 * A file system without the exchange gets two renames, with a moment in
 * which only "<dir>.tmp.old" holds the previous checkpoint. */
int sp_ckpt_publish(const sp_ckpt_paths *p, sp_diag *d) {
  int rc = sync_path(p->staging, d);
  if (rc < 0) return rc;
  if (renameat2(AT_FDCWD, p->staging, AT_FDCWD, p->dir, RENAME_EXCHANGE) == 0) {
    rc = sync_path(p->parent, d);
    return rc < 0 ? rc : remove_ckpt_dir(p->staging, d);
  }
  int e = errno;
  if (e == ENOENT) {
    if (rename(p->staging, p->dir) != 0)
      return sp_diag_set(d, SP_EIO, "%s: cannot rename to %s: %s", p->staging,
                         p->dir, strerror(errno));
    return sync_path(p->parent, d);
  }
  if (e != EINVAL && e != ENOSYS && e != ENOTSUP)
    return sp_diag_set(d, SP_EIO, "%s: cannot exchange with %s: %s", p->staging,
                       p->dir, strerror(e));
  char old[PATH_MAX + 8];
  snprintf(old, sizeof old, "%s.old", p->staging);
  rc = remove_ckpt_dir(old, d);
  if (rc == 0 && rename(p->dir, old) != 0)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot rename to %s: %s", p->dir, old,
                     strerror(errno));
  if (rc == 0 && rename(p->staging, p->dir) != 0)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot rename to %s: %s", p->staging,
                     p->dir, strerror(errno));
  if (rc == 0) rc = sync_path(p->parent, d);
  return rc == 0 ? remove_ckpt_dir(old, d) : rc;
}

/* ---- names and shapes ---- */

void sp_ckpt_file_name(char *out, size_t cap, const char *stem, uint32_t r,
                       uint32_t w) {
  snprintf(out, cap, "%s-%u-of-%u.safetensors", stem, r, w);
}

/* dir/name into out; a path that does not fit is an error, never a
 * shorter path. */
int sp_ckpt_join(char *out, size_t cap, const char *dir, const char *name,
                 sp_diag *d) {
  int n = snprintf(out, cap, "%s/%s", dir, name);
  if (n < 0 || (size_t)n >= cap)
    return sp_diag_set(d, SP_ETOOBIG, "%s/%s: path too long", dir, name);
  return 0;
}

void sp_ckpt_tensor_shape(const sp_tensor_spec *t, sp_safetensors_entry *e) {
  e->ndim = (size_t)t->ndim;
  for (int i = 0; i < t->ndim; i++) e->shape[i] = (uint64_t)t->shape[i];
}

/* torch.chunk(W, dim=0): chunks of ceil(d0 / W) rows, fewer chunks when d0
 * is small; a scalar is one row, rank 0's. Rows [*first, *last) are rank
 * r's, empty when *first == *last. */
void sp_ckpt_chunk_rows(const sp_tensor_spec *t, uint32_t w, uint32_t r,
                        int64_t *first, int64_t *last) {
  int64_t d0 = t->ndim ? t->shape[0] : 1;
  int64_t rows = (d0 + w - 1) / w;
  int64_t a = rows * r, b = a + rows;
  if (a > d0) a = d0;
  if (b > d0) b = d0;
  *first = a;
  *last = b;
}

int64_t sp_ckpt_row_numel(const sp_tensor_spec *t) {
  int64_t d0 = t->ndim ? t->shape[0] : 1;
  return d0 ? t->numel / d0 : 0;
}

/* A small text file, synced: it is part of a checkpoint. */
int sp_ckpt_write_synced(const char *path, const char *text, sp_diag *d) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0)
    return sp_diag_set(d, SP_EIO, "%s: cannot create: %s", path,
                       strerror(errno));
  size_t len = strlen(text), done = 0;
  int rc = 0;
  while (rc == 0 && done < len) {
    ssize_t w = write(fd, text + done, len - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0)
      rc =
          sp_diag_set(d, SP_EIO, "%s: write failed: %s", path, strerror(errno));
    else
      done += (size_t)w;
  }
  if (rc == 0 && fsync(fd) != 0)
    rc = sp_diag_set(d, SP_EIO, "%s: fsync failed: %s", path, strerror(errno));
  if (close(fd) != 0 && rc == 0)
    rc = sp_diag_set(d, SP_EIO, "%s: close failed: %s", path, strerror(errno));
  return rc;
}
/* ---- loading ---- */

/* Reads elements [a, a + n) of tensor t (of file st) into dst in dtype
 * dt: the bytes themselves for equal dtypes, cast for floating ones. */
int sp_ckpt_read_elems(const sp_safetensors_file *st,
                       const sp_safetensors_tensor *t, int64_t a, int64_t n,
                       void *dst, sp_dtype dt, const char *file, sp_diag *d) {
  size_t ses = sp_dtype_size(t->dtype);
  if (a < 0 || n < 0 || (uint64_t)(a + n) > t->numel)
    return sp_diag_set(d, SP_EFORMAT,
                       "%s: tensor %s: elements [%lld, %lld) "
                       "beyond its %llu",
                       file, t->name, (long long)a, (long long)(a + n),
                       (unsigned long long)t->numel);
  int rc;
  if (t->dtype == dt) {
    rc = sp_safetensors_read_range(st, t, (uint64_t)a * ses, dst,
                                   (size_t)n * ses, d);
    return rc < 0 ? sp_diag_prefix(d, rc, "%s", file) : 0;
  }
  if (!sp_dtype_is_floating(dt) || !sp_dtype_is_floating(t->dtype))
    return sp_diag_set(d, SP_EFORMAT, "%s: tensor %s: dtype %s, expected %s",
                       file, t->name, sp_dtype_name(t->dtype),
                       sp_dtype_name(dt));
  void *tmp = malloc((size_t)n * ses + 1);
  if (!tmp) return sp_diag_set(d, SP_ENOMEM, "no memory");
  rc = sp_safetensors_read_range(st, t, (uint64_t)a * ses, tmp, (size_t)n * ses,
                                 d);
  if (rc < 0) sp_diag_prefix(d, rc, "%s", file);
  if (rc == 0) {
    rc = sp_cast(dst, dt, tmp, t->dtype, (size_t)n);
    if (rc < 0) sp_diag_set(d, rc, "%s: tensor %s: cast", file, t->name);
  }
  free(tmp);
  return rc;
}

int sp_ckpt_check_shape(const sp_safetensors_tensor *t,
                        const sp_tensor_spec *spec, int64_t rows,
                        const char *file, sp_diag *d) {
  bool ok = (int)t->ndim == spec->ndim;
  for (int i = 0; ok && i < spec->ndim; i++)
    ok = (int64_t)t->shape[i] == (i == 0 && rows >= 0 ? rows : spec->shape[i]);
  if (!ok)
    return sp_diag_set(d, SP_EFORMAT,
                       "%s: tensor %s: shape does not match "
                       "the model",
                       file, t->name);
  return 0;
}

static int parse_steps(const char *s, uint64_t *out, const char *where,
                       sp_diag *d) {
  if (!step_count(s, out))
    return sp_diag_set(d, SP_EFORMAT,
                       "%s: %s is \"%.32s\", not a step "
                       "count",
                       where, SP_CKPT_META_STEPS, s ? s : "");
  return 0;
}

static int add_state_name(sp_ckpt_optim *o, const char *s, size_t len,
                          const char *where, sp_diag *d) {
  if (o->n_states == SP_CKPT_MAX_STATES || len == 0 ||
      len >= sizeof o->states[0])
    return sp_diag_set(d, SP_EFORMAT, "%s: bad optimizer state list", where);
  memcpy(o->states[o->n_states], s, len);
  o->states[o->n_states++][len] = '\0';
  return 0;
}

int sp_ckpt_optim_from_meta(const sp_safetensors_file *st, const char *where,
                            sp_ckpt_optim *o, sp_diag *d) {
  memset(o, 0, sizeof *o);
  const char *steps = sp_safetensors_metadata_get(st, SP_CKPT_META_STEPS);
  const char *states = sp_safetensors_metadata_get(st, SP_CKPT_META_STATES);
  int rc = steps ? parse_steps(steps, &o->steps, where, d) : 0;
  for (const char *s = states; rc == 0 && s && *s;) {
    const char *c = strchr(s, ',');
    size_t len = c ? (size_t)(c - s) : strlen(s);
    rc = add_state_name(o, s, len, where, d);
    s = c ? c + 1 : s + len;
  }
  return rc;
}

int sp_ckpt_optim_from_index(json_t *root, const char *where, sp_ckpt_optim *o,
                             sp_diag *d) {
  memset(o, 0, sizeof *o);
  json_t *steps = json_object_get(root, "optim_steps");
  json_t *states = json_object_get(root, "optim_states");
  if (steps && (!json_is_integer(steps) || json_integer_value(steps) < 0))
    return sp_diag_set(d, SP_EFORMAT, "%s: optim_steps is not a step count",
                       where);
  if (steps) o->steps = (uint64_t)json_integer_value(steps);
  if (states && !json_is_array(states))
    return sp_diag_set(d, SP_EFORMAT, "%s: optim_states is not a list", where);
  size_t i;
  json_t *v;
  json_array_foreach(states, i, v) {
    if (!json_is_string(v))
      return sp_diag_set(d, SP_EFORMAT,
                         "%s: optim_states[%zu] is not a "
                         "name",
                         where, i);
    int rc = add_state_name(o, json_string_value(v), json_string_length(v),
                            where, d);
    if (rc < 0) return rc;
  }
  return 0;
}

uint32_t sp_ckpt_meta_world(const sp_safetensors_file *st) {
  const char *w = sp_safetensors_metadata_get(st, "shardplane.world_size");
  return w ? (uint32_t)strtoul(w, NULL, 10) : 0;
}

int sp_ckpt_full_range(void *vctx, const char *name, const sp_tensor_spec *spec,
                       int64_t a, int64_t n, void *dst, sp_dtype dt,
                       sp_diag *d) {
  sp_ckpt_full_ctx *c = vctx;
  const sp_safetensors_tensor *t;
  int rc = sp_safetensors_get(c->st, name, &t, d);
  if (rc < 0) return sp_diag_prefix(d, rc, "%s", c->file);
  rc = sp_ckpt_check_shape(t, spec, -1, c->file, d);
  return rc < 0 ? rc : sp_ckpt_read_elems(c->st, t, a, n, dst, dt, c->file, d);
}
int sp_ckpt_sharded_file(sp_ckpt_sharded_ctx *c, const char *name,
                         const sp_safetensors_file **out, sp_diag *d) {
  for (size_t i = 0; i < c->n_files; i++)
    if (strcmp(c->names[i], name) == 0) {
      *out = c->files[i];
      return 0;
    }
  /* names come from an untrusted index: plain file names only */
  if (!*name || strchr(name, '/') || strcmp(name, "..") == 0 ||
      strcmp(name, ".") == 0)
    return sp_diag_set(d, SP_EFORMAT, "%s/%s: bad file name \"%.64s\"", c->dir,
                       SP_CKPT_INDEX, name);
  if (c->n_files == c->cap_files) {
    size_t cap = c->cap_files ? 2 * c->cap_files : 8;
    char **nn = realloc(c->names, cap * sizeof *nn);
    if (nn) c->names = nn;
    sp_safetensors_file **nf = realloc(c->files, cap * sizeof *nf);
    if (nf) c->files = nf;
    if (!nn || !nf) return sp_diag_set(d, SP_ENOMEM, "no memory");
    c->cap_files = cap;
  }
  char *copy = strdup(name);
  if (!copy) return sp_diag_set(d, SP_ENOMEM, "no memory");
  char path[PATH_MAX];
  /* only the header: the bytes are read range by range */
  sp_safetensors_file *st;
  int rc = sp_ckpt_join(path, sizeof path, c->dir, name, d);
  if (rc == 0) rc = sp_safetensors_open_header(path, &st, d);
  if (rc < 0) {
    free(copy);
    return rc;
  }
  c->names[c->n_files] = copy;
  c->files[c->n_files++] = st;
  *out = st;
  return 0;
}

int sp_ckpt_sharded_range(void *vctx, const char *name,
                          const sp_tensor_spec *spec, int64_t a, int64_t n,
                          void *dst, sp_dtype dt, sp_diag *d) {
  sp_ckpt_sharded_ctx *c = vctx;
  json_t *info = json_object_get(c->tensors, name);
  json_t *chunks = info ? json_object_get(info, "chunks") : NULL;
  if (!json_is_array(chunks))
    return sp_diag_set(d, SP_ENOENT, "%s/%s: no entry for %s", c->dir,
                       SP_CKPT_INDEX, name);
  int64_t d0 = spec->ndim ? spec->shape[0] : 1;
  int64_t rn = sp_ckpt_row_numel(spec);
  size_t esz = sp_dtype_size(dt);
  int64_t covered = 0;
  size_t i;
  json_t *ch;
  json_array_foreach(chunks, i, ch) {
    json_t *jf = json_object_get(ch, "file"), *jr = json_object_get(ch, "row"),
           *jn = json_object_get(ch, "rows");
    if (!json_is_string(jf) || !json_is_integer(jr) || !json_is_integer(jn))
      return sp_diag_set(d, SP_EFORMAT, "%s/%s: %s: bad chunk %zu", c->dir,
                         SP_CKPT_INDEX, name, i);
    int64_t row = json_integer_value(jr), rows = json_integer_value(jn);
    if (row < 0 || rows <= 0 || row > d0 || rows > d0 - row)
      return sp_diag_set(d, SP_EFORMAT,
                         "%s/%s: %s: chunk %zu rows out of "
                         "range",
                         c->dir, SP_CKPT_INDEX, name, i);
    int64_t ca = row * rn, cb = (row + rows) * rn;
    int64_t lo = a > ca ? a : ca, hi = a + n < cb ? a + n : cb;
    if (lo >= hi) continue;
    const char *fn = json_string_value(jf);
    const sp_safetensors_file *st;
    int rc = sp_ckpt_sharded_file(c, fn, &st, d);
    const sp_safetensors_tensor *t = NULL;
    if (rc == 0) {
      rc = sp_safetensors_get(st, name, &t, d);
      if (rc < 0) sp_diag_prefix(d, rc, "%s", fn);
    }
    if (rc == 0)
      rc = sp_ckpt_check_shape(t, spec, spec->ndim ? rows : -1, fn, d);
    if (rc == 0)
      rc = sp_ckpt_read_elems(st, t, lo - ca, hi - lo,
                              (uint8_t *)dst + (size_t)(lo - a) * esz, dt, fn,
                              d);
    if (rc < 0) return rc;
    covered += hi - lo;
  }
  if (covered != n)
    return sp_diag_set(d, SP_EFORMAT,
                       "%s/%s: chunks of %s do not cover "
                       "elements [%lld, %lld)",
                       c->dir, SP_CKPT_INDEX, name, (long long)a,
                       (long long)(a + n));
  return 0;
}
