#include "json.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "suggest.h"

int sp_json_fail(const sp_json_reader *r, int err, const char *fmt, ...) {
  if (r->diag == NULL) return err;
  char what[SP_DIAG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return sp_diag_set(r->diag, err, "%s: %s", r->origin, what);
}

int sp_json_parse(const sp_json_reader *r, const char *buf, size_t len,
                  size_t max_len, json_t **out) {
  if (len > max_len)
    return sp_json_fail(r, SP_ETOOBIG, "%zu bytes, over the limit of %zu", len,
                        max_len);
  json_error_t e;
  json_t *root = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &e);
  if (root == NULL) {
    if (r->diag != NULL)
      sp_diag_set(r->diag, SP_EFORMAT, "%s:%d:%d: invalid JSON: %s", r->origin,
                  e.line, e.column, e.text);
    return SP_EFORMAT;
  }
  *out = root;
  return 0;
}

int sp_json_read_file(const char *path, size_t max_len, char **buf, size_t *len,
                      sp_diag *diag) {
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    return sp_diag_set(diag, SP_EIO, "%s: cannot open: %s", path,
                       strerror(errno));
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
    fclose(f);
    return sp_diag_set(diag, SP_EIO, "%s: not a regular file", path);
  }
  if ((unsigned long long)st.st_size > max_len) {
    fclose(f);
    return sp_diag_set(diag, SP_ETOOBIG,
                       "%s: %lld bytes, over the limit of %zu", path,
                       (long long)st.st_size, max_len);
  }
  size_t n = (size_t)st.st_size;
  char *p = malloc(n ? n : 1);
  if (p == NULL) {
    fclose(f);
    return sp_diag_set(diag, SP_ENOMEM, "%s: out of memory", path);
  }
  size_t got = fread(p, 1, n, f);
  int rerr = ferror(f);
  fclose(f);
  if (got != n || rerr) {
    free(p);
    return sp_diag_set(diag, SP_EIO, "%s: read error", path);
  }
  *buf = p;
  *len = n;
  return 0;
}

/* "path.key", or just "key" at the top level (empty path) */
typedef struct jpath {
  char s[256];
} jpath;

static jpath join(const char *path, const char *key) {
  jpath p;
  snprintf(p.s, sizeof p.s, "%s%s%s", path, path[0] ? "." : "", key);
  return p;
}

static json_t *field(const sp_json_reader *r, json_t *obj, const char *key,
                     const char *path, bool required, int *rc) {
  json_t *v = json_object_get(obj, key);
  *rc = 0;
  if (v == NULL && required)
    *rc = sp_json_fail(r, SP_EFORMAT, "%s: missing field", join(path, key).s);
  return v;
}

int sp_json_string(const sp_json_reader *r, json_t *obj, const char *key,
                   const char *path, bool required, const char **out) {
  int rc;
  json_t *v = field(r, obj, key, path, required, &rc);
  if (v == NULL) {
    if (rc == 0) *out = NULL;
    return rc;
  }
  if (!json_is_string(v))
    return sp_json_fail(r, SP_EFORMAT, "%s: expected a string",
                        join(path, key).s);
  if (json_string_length(v) > SP_JSON_MAX_STRING)
    return sp_json_fail(r, SP_ETOOBIG, "%s: longer than %d bytes",
                        join(path, key).s, SP_JSON_MAX_STRING);
  if (strlen(json_string_value(v)) != json_string_length(v))
    return sp_json_fail(r, SP_EFORMAT, "%s: contains a NUL character",
                        join(path, key).s);
  *out = json_string_value(v);
  return 0;
}

int sp_json_bool(const sp_json_reader *r, json_t *obj, const char *key,
                 const char *path, bool required, bool *out) {
  int rc;
  json_t *v = field(r, obj, key, path, required, &rc);
  if (v == NULL) return rc;
  if (!json_is_boolean(v))
    return sp_json_fail(r, SP_EFORMAT, "%s: expected true or false",
                        join(path, key).s);
  *out = json_is_true(v);
  return 0;
}

int sp_json_int(const sp_json_reader *r, json_t *obj, const char *key,
                const char *path, bool required, long long min, long long max,
                long long *out) {
  int rc;
  json_t *v = field(r, obj, key, path, required, &rc);
  if (v == NULL) return rc;
  if (!json_is_integer(v))
    return sp_json_fail(r, SP_EFORMAT, "%s: expected an integer",
                        join(path, key).s);
  long long x = json_integer_value(v);
  if (x < min || x > max)
    return sp_json_fail(r, SP_EFORMAT, "%s: %lld is outside [%lld, %lld]",
                        join(path, key).s, x, min, max);
  *out = x;
  return 0;
}

int sp_json_array(const sp_json_reader *r, json_t *obj, const char *key,
                  const char *path, bool required, size_t max_n, json_t **out) {
  int rc;
  json_t *v = field(r, obj, key, path, required, &rc);
  *out = NULL;
  if (v == NULL) return rc;
  if (!json_is_array(v))
    return sp_json_fail(r, SP_EFORMAT, "%s: expected an array",
                        join(path, key).s);
  if (json_array_size(v) > max_n)
    return sp_json_fail(r, SP_ETOOBIG, "%s: %zu entries, over the limit of %zu",
                        join(path, key).s, json_array_size(v), max_n);
  *out = v;
  return 0;
}

int sp_json_known_keys(const sp_json_reader *r, json_t *obj, const char *path,
                       const char *const *known, size_t n) {
  const char *key;
  json_t *v;
  json_object_foreach(obj, key, v) {
    bool found = false;
    for (size_t i = 0; i < n && !found; i++) found = strcmp(key, known[i]) == 0;
    if (found) continue;
    char where[300] = "";
    if (path[0] != '\0') snprintf(where, sizeof where, " in %.256s", path);
    const char *near = sp_suggest(key, known, n);
    if (near != NULL)
      return sp_json_fail(r, SP_EFORMAT,
                          "unknown key \"%.200s\"%s (did you mean \"%s\"?)",
                          key, where, near);
    char list[512];
    size_t len = 0;
    list[0] = '\0';
    for (size_t i = 0; i < n && len < sizeof list; i++) {
      int w = snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "",
                       known[i]);
      if (w < 0) break;
      len += (size_t)w;
    }
    return sp_json_fail(r, SP_EFORMAT, "unknown key \"%.200s\"%s (expected %s)",
                        key, where, list);
  }
  return 0;
}
