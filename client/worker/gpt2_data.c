/* The GPT-2 models' byte-level data (gpt2_data.h). */
#include "gpt2_data.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t sp_gpt2_window(uint64_t step, uint64_t sample) {
  return mix64(mix64(step ^ 0x53504750543200ull) ^ sample);
}

/* Appends the file to data->bytes (cap: what is allocated). */
static int append_file(sp_gpt2_data *data, const char *path, size_t *cap,
                       sp_diag *d) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return sp_diag_set(d, SP_EIO, "--data %s: %s", path, strerror(errno));
  int rc = 0;
  for (;;) {
    if (data->n == *cap) {
      if (*cap >= SP_GPT2_DATA_MAX_BYTES) {
        rc = sp_diag_set(d, SP_ETOOBIG, "--data %s: more than %u bytes", path,
                         SP_GPT2_DATA_MAX_BYTES);
        break;
      }
      size_t nc = *cap ? *cap * 2 : 1 << 16;
      if (nc > SP_GPT2_DATA_MAX_BYTES) nc = SP_GPT2_DATA_MAX_BYTES;
      uint8_t *nb = realloc(data->bytes, nc);
      if (nb == NULL) {
        rc = sp_diag_set(d, SP_ENOMEM, "--data %s: no memory", path);
        break;
      }
      data->bytes = nb;
      *cap = nc;
    }
    size_t got = fread(data->bytes + data->n, 1, *cap - data->n, f);
    data->n += got;
    if (got == 0) {
      if (ferror(f)) rc = sp_diag_set(d, SP_EIO, "--data %s: read error", path);
      break;
    }
  }
  fclose(f);
  return rc;
}

static int cmp_names(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The default corpus: its regular files by name. */
static int read_default(sp_gpt2_data *data, size_t *cap, sp_diag *d) {
  const char *dir = SP_GPT2_DEFAULT_CORPUS;
  DIR *dp = opendir(dir);
  if (dp == NULL)
    return sp_diag_set(d, SP_ENOENT,
                       "no default corpus (%s: %s): give a "
                       "text file with --data FILE",
                       dir, strerror(errno));
  char **names = NULL;
  size_t n = 0, cap_n = 0;
  int rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(dp)) != NULL) {
    if (e->d_name[0] == '.') continue;
    if (n == cap_n) {
      /* a folder of licences has dozens; a bound keeps a hostile one out */
      if (cap_n >= 65536) {
        rc = sp_diag_set(d, SP_ETOOBIG, "%s: too many files", dir);
        break;
      }
      size_t nc = cap_n ? 2 * cap_n : 64;
      char **nn = realloc(names, nc * sizeof *nn);
      if (nn == NULL) {
        rc = sp_diag_set(d, SP_ENOMEM, "no memory");
        break;
      }
      names = nn;
      cap_n = nc;
    }
    names[n] = strdup(e->d_name);
    if (names[n] == NULL)
      rc = sp_diag_set(d, SP_ENOMEM, "no memory");
    else
      n++;
  }
  closedir(dp);
  if (rc == 0) qsort(names, n, sizeof *names, cmp_names);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    struct stat st;
    /* symlinks (GPL -> GPL-3) would repeat a text */
    if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    rc = append_file(data, path, cap, d);
  }
  for (size_t i = 0; i < n; i++) free(names[i]);
  free(names);
  return rc;
}

int sp_gpt2_data_open(const char *path, size_t T, sp_gpt2_data **out,
                      sp_diag *d) {
  if (out == NULL || T == 0) return SP_EINVAL;
  *out = NULL;
  sp_gpt2_data *data = calloc(1, sizeof *data);
  if (data == NULL) return sp_diag_set(d, SP_ENOMEM, "no memory");
  size_t cap = 0;
  int rc;
  if (path) {
    struct stat st;
    if (stat(path, &st) != 0)
      rc = sp_diag_set(d, SP_EIO, "--data %s: %s", path, strerror(errno));
    else if (!S_ISREG(st.st_mode))
      rc = sp_diag_set(d, SP_EINVAL, "--data %s: not a regular file", path);
    else if ((uint64_t)st.st_size > SP_GPT2_DATA_MAX_BYTES)
      rc = sp_diag_set(d, SP_ETOOBIG, "--data %s: %lld bytes, at most %u", path,
                       (long long)st.st_size, SP_GPT2_DATA_MAX_BYTES);
    else
      rc = append_file(data, path, &cap, d);
    snprintf(data->source, sizeof data->source, "%s", path);
  } else {
    rc = read_default(data, &cap, d);
    snprintf(data->source, sizeof data->source, "%s/*", SP_GPT2_DEFAULT_CORPUS);
  }
  if (rc == 0) {
    data->n_val = data->n / 10;
    data->n_train = data->n - data->n_val;
    if (data->n_train < T + 1 || data->n_val < T + 1)
      rc = sp_diag_set(d, SP_EINVAL,
                       "--data %s: %zu bytes; windows of %zu "
                       "tokens need at least %zu (a tenth held out)",
                       data->source, data->n, T, 10 * (T + 1));
  }
  if (rc != 0) {
    sp_gpt2_data_free(data);
    return rc;
  }
  *out = data;
  return 0;
}

void sp_gpt2_data_free(sp_gpt2_data *data) {
  if (data == NULL) return;
  free(data->bytes);
  free(data);
}

static void window(const sp_gpt2_data *data, size_t start, size_t T,
                   int32_t *tok, int32_t *tgt) {
  for (size_t t = 0; t < T; t++) {
    tok[t] = data->bytes[start + t];
    tgt[t] = data->bytes[start + t + 1];
  }
}

void sp_gpt2_data_train(const sp_gpt2_data *data, uint64_t step, uint64_t first,
                        size_t n, size_t T, int32_t *tok, int32_t *tgt) {
  for (size_t k = 0; k < n; k++) {
    size_t start =
        (size_t)(sp_gpt2_window(step, first + k) % (data->n_train - T));
    window(data, start, T, tok + k * T, tgt + k * T);
  }
}

size_t sp_gpt2_data_val_count(const sp_gpt2_data *data, size_t T) {
  return (data->n_val - 1) / T;
}

void sp_gpt2_data_val(const sp_gpt2_data *data, uint64_t v, size_t T,
                      int32_t *tok, int32_t *tgt) {
  window(data, data->n_train + (size_t)v * T, T, tok, tgt);
}
