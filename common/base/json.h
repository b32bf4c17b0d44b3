/* Helpers for reading untrusted JSON (jansson) with errors that name the
 * source and the JSON path, shared by the model, job and safetensors readers.
 */
#ifndef SP_JSON_H
#define SP_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "sp_error.h"

/* Longest string field accepted (FQNs, type names, dtype names). */
#define SP_JSON_MAX_STRING 4096

typedef struct sp_json_reader {
  const char *origin; /* file name or other source, first in every message */
  sp_diag *diag;      /* may be NULL */
} sp_json_reader;

/* Writes "<origin>: <message>" into the diag and returns err. */
int sp_json_fail(const sp_json_reader *r, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Parses a whole document. The caller owns *out (json_decref).
 * SP_ETOOBIG above max_len bytes, SP_EFORMAT with line:column otherwise. */
int sp_json_parse(const sp_json_reader *r, const char *buf, size_t len,
                  size_t max_len, json_t **out);
/* Reads a regular file of at most max_len bytes into a malloc'd buffer. */
int sp_json_read_file(const char *path, size_t max_len, char **buf, size_t *len,
                      sp_diag *diag);

/* Field readers: `path` is the JSON path of `obj` for messages. A missing
 * field is an error when `required`, else leaves *out unchanged (strings:
 * sets NULL) and returns 0. Strings are borrowed from obj, have no NUL
 * inside and are at most SP_JSON_MAX_STRING bytes. */
int sp_json_string(const sp_json_reader *r, json_t *obj, const char *key,
                   const char *path, bool required, const char **out);
int sp_json_bool(const sp_json_reader *r, json_t *obj, const char *key,
                 const char *path, bool required, bool *out);
/* Integer in [min, max]. */
int sp_json_int(const sp_json_reader *r, json_t *obj, const char *key,
                const char *path, bool required, long long min, long long max,
                long long *out);
/* Array of at most max_n entries; *out is NULL when absent and optional. */
int sp_json_array(const sp_json_reader *r, json_t *obj, const char *key,
                  const char *path, bool required, size_t max_n, json_t **out);

/* Every key of obj one of known[0..n): a misspelt key must be an error,
 * not a setting silently left at its default. Otherwise SP_EFORMAT with
 * `<origin>: unknown key "K" (did you mean "N"?)` (` in PATH` after the
 * key below the top level), or the keys allowed when none is near. */
int sp_json_known_keys(const sp_json_reader *r, json_t *obj, const char *path,
                       const char *const *known, size_t n);

#endif
