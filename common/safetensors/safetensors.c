#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Tensor bytes go to and from disk untouched, and the format is
 * little-endian; a big-endian host would need a byte swap per element. */
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "safetensors data is little-endian; this host is not");
#else
#error "cannot determine the host byte order"
#endif

_Static_assert(SP_SAFETENSORS_MAX_HEADER <= INT32_MAX,
               "header positions are reported through jansson's int");

#define META_KEY "__metadata__"

struct sp_safetensors_file {
  void *owned; /* sp_safetensors_open's allocation (contains the image), or NULL
                */
  size_t header_len;
  const uint8_t
      *data; /* NULL for sp_safetensors_open_header: the bytes are on disk */
  size_t data_len;
  int fd;     /* sp_safetensors_open_header's file, else -1 */
  char *path; /* its name, for messages */
  size_t n_tensors;
  sp_safetensors_tensor *tensors;        /* data order */
  const sp_safetensors_tensor **by_name; /* strcmp order, for bsearch */
  size_t n_meta;
  sp_safetensors_kv *meta;
  char *strings; /* one arena for every name, key and value */
};

/* ---- diagnostics -------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if there is none.
 * Overlong forms, surrogates and values past U+10FFFF are invalid. */
static size_t utf8_seq_len(const unsigned char *s, size_t n) {
  unsigned char c = s[0];
  if (c < 0x80) return 1;
  size_t len;
  uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (n < len) return 0;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (s[i] & 0x3F);
  }
  if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
      (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    return 0;
  }
  return len;
}

static bool utf8_valid(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  for (size_t i = 0; i < n;) {
    size_t k = utf8_seq_len(p + i, n - i);
    if (k == 0) return false;
    i += k;
  }
  return true;
}

/* Diagnostics quote untrusted bytes (names, jansson's "near '...'"). Keep
 * the line one valid UTF-8 line: control bytes and broken sequences (also
 * ones cut by truncation) become '?'. */
static void sanitize_line(char *msg) {
  unsigned char *p = (unsigned char *)msg;
  size_t n = strlen(msg);
  for (size_t i = 0; i < n;) {
    if (p[i] < 0x20 || p[i] == 0x7F) {
      p[i++] = '?';
      continue;
    }
    size_t k = utf8_seq_len(p + i, n - i);
    if (k == 0) {
      p[i++] = '?';
      continue;
    }
    i += k;
  }
}

static int st_fail(sp_diag *d, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int st_fail(sp_diag *d, int err, const char *fmt, ...) {
  if (d == NULL) return err;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(d->msg, sizeof d->msg, fmt, ap);
  va_end(ap);
  sanitize_line(d->msg);
  return err;
}

/* Names can be SP_SAFETENSORS_MAX_NAME bytes; quote at most this much of one so
 * the rest of the line survives. */
#define NAME_Q 160

/* ---- small helpers ------------------------------------------------------ */

static uint64_t load_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

static void store_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static bool mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
  if (a != 0 && b > UINT64_MAX / a) return false;
  *out = a * b;
  return true;
}

/* Rank in the reference `Dtype` enum (declared in increasing alignment);
 * the writer sorts by it descending so same-size dtypes tie-break exactly as
 * the reference writer does. */
static int dtype_rank(sp_dtype t) {
  switch (t) {
    case SP_BOOL: return 0;
    case SP_UINT8: return 1;
    case SP_INT8: return 2;
    case SP_INT16: return 5;
    case SP_FLOAT16: return 7;
    case SP_BFLOAT16: return 8;
    case SP_INT32: return 9;
    case SP_FLOAT32: return 11;
    case SP_FLOAT64: return 12;
    case SP_INT64: return 13;
    default: return -1;
  }
}

/* Checks the 8-byte prefix against the image length; shared by
 * sp_safetensors_parse and sp_safetensors_open (which checks before reading the
 * rest). */
static int check_prefix(const uint8_t *buf, uint64_t len, const char *src,
                        uint64_t *n_out, sp_diag *d) {
  if (len < 8) {
    return st_fail(d, SP_EFORMAT,
                   "%s: %llu bytes is too short for the 8-byte header length",
                   src, (unsigned long long)len);
  }
  uint64_t n = load_le64(buf);
  if (n > SP_SAFETENSORS_MAX_HEADER) {
    return st_fail(d, SP_ETOOBIG,
                   "%s: header length %llu exceeds the limit of %u bytes", src,
                   (unsigned long long)n, SP_SAFETENSORS_MAX_HEADER);
  }
  if (n > len - 8) {
    return st_fail(d, SP_ETOOBIG,
                   "%s: header length %llu runs past the end of the file "
                   "(%llu bytes)",
                   src, (unsigned long long)n, (unsigned long long)len);
  }
  *n_out = n;
  return 0;
}

/* ---- reader ------------------------------------------------------------- */

static int cmp_offsets(const void *a, const void *b) {
  const sp_safetensors_tensor *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return strcmp(x->name, y->name);
}

static int cmp_name_ptr(const void *a, const void *b) {
  const sp_safetensors_tensor *const *x = a, *const *y = b;
  return strcmp((*x)->name, (*y)->name);
}

/* Reads a non-negative JSON integer. */
static bool get_uint(const json_t *v, uint64_t *out) {
  if (!json_is_integer(v)) return false;
  json_int_t i = json_integer_value(v);
  if (i < 0) return false;
  *out = (uint64_t)i;
  return true;
}

static int parse_entry(const char *src, const char *name, const json_t *v,
                       sp_safetensors_tensor *t, sp_diag *d) {
  if (!json_is_object(v)) {
    return st_fail(d, SP_EFORMAT, "%s: tensor '%.*s': entry is not an object",
                   src, NAME_Q, name);
  }

  const json_t *jdt = json_object_get(v, "dtype");
  if (!json_is_string(jdt)) {
    return st_fail(d, SP_EFORMAT,
                   "%s: tensor '%.*s': \"dtype\" is missing or not a string",
                   src, NAME_Q, name);
  }
  const char *dts = json_string_value(jdt);
  int rc = sp_dtype_parse_st(dts, &t->dtype);
  if (rc == SP_EUNSUPPORTED) {
    return st_fail(d, SP_EUNSUPPORTED,
                   "%s: tensor '%.*s': dtype %s is not supported", src, NAME_Q,
                   name, dts);
  }
  if (rc != 0) {
    return st_fail(d, SP_EFORMAT, "%s: tensor '%.*s': unknown dtype \"%.32s\"",
                   src, NAME_Q, name, dts);
  }

  const json_t *jshape = json_object_get(v, "shape");
  if (!json_is_array(jshape)) {
    return st_fail(d, SP_EFORMAT,
                   "%s: tensor '%.*s': \"shape\" is not a list of non-negative "
                   "integers",
                   src, NAME_Q, name);
  }
  size_t ndim = json_array_size(jshape);
  if (ndim > SP_SAFETENSORS_MAX_NDIM) {
    return st_fail(d, SP_ETOOBIG,
                   "%s: tensor '%.*s': %zu dimensions exceed the limit of %u",
                   src, NAME_Q, name, ndim, SP_SAFETENSORS_MAX_NDIM);
  }
  uint64_t numel = 1;
  bool overflow = false;
  for (size_t i = 0; i < ndim; i++) {
    if (!get_uint(json_array_get(jshape, i), &t->shape[i])) {
      return st_fail(d, SP_EFORMAT,
                     "%s: tensor '%.*s': \"shape\" is not a list of "
                     "non-negative integers (element %zu)",
                     src, NAME_Q, name, i);
    }
    /* Keep checking the remaining elements' types even after an overflow:
     * a type error is the more useful message. */
    if (!overflow && !mul_u64(numel, t->shape[i], &numel)) overflow = true;
  }
  t->ndim = ndim;
  uint64_t nbytes = 0;
  if (overflow || !mul_u64(numel, sp_dtype_size(t->dtype), &nbytes)) {
    return st_fail(d, SP_EFORMAT,
                   "%s: tensor '%.*s': shape overflows 64-bit byte size", src,
                   NAME_Q, name);
  }
  t->numel = numel;

  const json_t *joff = json_object_get(v, "data_offsets");
  if (!json_is_array(joff) || json_array_size(joff) != 2 ||
      !get_uint(json_array_get(joff, 0), &t->begin) ||
      !get_uint(json_array_get(joff, 1), &t->end) || t->end < t->begin) {
    return st_fail(d, SP_EFORMAT,
                   "%s: tensor '%.*s': \"data_offsets\" must be [begin, end] "
                   "with 0 <= begin <= end",
                   src, NAME_Q, name);
  }
  if (t->end - t->begin != nbytes) {
    return st_fail(d, SP_EFORMAT,
                   "%s: tensor '%.*s': data_offsets [%llu, %llu] hold %llu "
                   "bytes but %llu elements of %s need %llu",
                   src, NAME_Q, name, (unsigned long long)t->begin,
                   (unsigned long long)t->end,
                   (unsigned long long)(t->end - t->begin),
                   (unsigned long long)numel, sp_dtype_st_name(t->dtype),
                   (unsigned long long)nbytes);
  }
  return 0;
}

/* Validates "__metadata__" and returns the bytes its strings need. */
static int check_metadata(const char *src, const json_t *m, size_t *bytes,
                          sp_diag *d) {
  if (!json_is_object(m)) {
    return st_fail(d, SP_EFORMAT, "%s: __metadata__ is not an object", src);
  }
  if (json_object_size(m) > SP_SAFETENSORS_MAX_METADATA) {
    return st_fail(d, SP_ETOOBIG,
                   "%s: __metadata__ has %zu entries; the limit is %u", src,
                   json_object_size(m), SP_SAFETENSORS_MAX_METADATA);
  }
  size_t total = 0;
  const char *k;
  json_t *v;
  json_object_foreach((json_t *)m, k, v) {
    if (!json_is_string(v)) {
      return st_fail(d, SP_EFORMAT,
                     "%s: __metadata__ value of \"%.*s\" is not a string", src,
                     NAME_Q, k);
    }
    /* Both lengths are bounded by the header size, so no overflow. */
    total += strlen(k) + 1 + json_string_length(v) + 1;
  }
  *bytes = total;
  return 0;
}

void sp_safetensors_close(sp_safetensors_file *f) {
  if (f == NULL) return;
  if (f->fd >= 0) close(f->fd);
  free(f->path);
  free(f->tensors);
  free(f->by_name);
  free(f->meta);
  free(f->strings);
  free(f->owned);
  free(f);
}

static char *arena_put(char **cursor, const char *s, size_t len) {
  char *dst = *cursor;
  memcpy(dst, s, len);
  dst[len] = '\0';
  *cursor += len + 1;
  return dst;
}

/* Parses the header at buf (the 8-byte prefix and the JSON, at least
 * 8+N bytes) of an image of total_len bytes. With `data` the image is
 * buf[0..total_len) and tensors point into it; without, only the header is
 * in memory and tensors get NULL data (sp_safetensors_open_header). */
static int parse_image(const uint8_t *buf, uint64_t total_len, bool data,
                       const char *src, sp_safetensors_file **out,
                       sp_diag *diag) {
  uint64_t n;
  int rc = check_prefix(buf, total_len, src, &n, diag);
  if (rc != 0) return rc;
  size_t len = (size_t)total_len;
  const char *hdr = (const char *)buf + 8;
  size_t hlen = (size_t)n;
  /* Newer reference readers require this too (InvalidHeaderStart); it also
   * rules out a header that is only padding. */
  if (hlen == 0 || hdr[0] != '{') {
    return st_fail(diag, SP_EFORMAT, "%s: header does not start with '{'", src);
  }

  json_error_t jerr;
  json_t *root = json_loadb(hdr, hlen, JSON_REJECT_DUPLICATES, &jerr);
  if (root == NULL) {
    return st_fail(diag, SP_EFORMAT, "%s: invalid JSON header at byte %d: %s",
                   src, jerr.position, jerr.text);
  }
  if (!json_is_object(root)) {
    json_decref(root);
    return st_fail(diag, SP_EFORMAT, "%s: header is not a JSON object", src);
  }

  sp_safetensors_file *f = NULL;
  const json_t *jmeta = json_object_get(root, META_KEY);
  size_t n_tensors = json_object_size(root) - (jmeta != NULL ? 1 : 0);
  if (n_tensors > SP_SAFETENSORS_MAX_TENSORS) {
    rc = st_fail(diag, SP_ETOOBIG, "%s: %zu tensors exceed the limit of %u",
                 src, n_tensors, SP_SAFETENSORS_MAX_TENSORS);
    goto fail;
  }

  /* Size every string before allocating anything. */
  size_t arena = 1;
  if (jmeta != NULL) {
    rc = check_metadata(src, jmeta, &arena, diag);
    if (rc != 0) goto fail;
    arena += 1;
  }
  const char *key;
  json_t *val;
  json_object_foreach(root, key, val) {
    if (strcmp(key, META_KEY) == 0) continue;
    size_t klen = strlen(key);
    if (klen > SP_SAFETENSORS_MAX_NAME) {
      rc = st_fail(diag, SP_ETOOBIG,
                   "%s: tensor '%.*s...': name of %zu bytes exceeds the limit "
                   "of %u",
                   src, NAME_Q, key, klen, SP_SAFETENSORS_MAX_NAME);
      goto fail;
    }
    arena += klen + 1;
  }

  rc = SP_ENOMEM;
  f = calloc(1, sizeof *f);
  if (f == NULL) goto fail_nomem;
  f->fd = -1;
  f->header_len = hlen;
  f->data = data ? buf + 8 + hlen : NULL;
  f->data_len = len - 8 - hlen;
  f->strings = malloc(arena);
  if (f->strings == NULL) goto fail_nomem;
  if (n_tensors > 0) {
    f->tensors = calloc(n_tensors, sizeof *f->tensors);
    f->by_name = calloc(n_tensors, sizeof *f->by_name);
    if (f->tensors == NULL || f->by_name == NULL) goto fail_nomem;
  }
  char *cursor = f->strings;

  if (jmeta != NULL && json_object_size(jmeta) > 0) {
    f->meta = calloc(json_object_size(jmeta), sizeof *f->meta);
    if (f->meta == NULL) goto fail_nomem;
    const char *mk;
    json_t *mv;
    json_object_foreach((json_t *)jmeta, mk, mv) {
      sp_safetensors_kv *kv = &f->meta[f->n_meta++];
      kv->key = arena_put(&cursor, mk, strlen(mk));
      kv->value =
          arena_put(&cursor, json_string_value(mv), json_string_length(mv));
    }
  }

  json_object_foreach(root, key, val) {
    if (strcmp(key, META_KEY) == 0) continue;
    sp_safetensors_tensor *t = &f->tensors[f->n_tensors];
    rc = parse_entry(src, key, val, t, diag);
    if (rc != 0) goto fail;
    t->name = arena_put(&cursor, key, strlen(key));
    f->n_tensors++;
  }
  json_decref(root);
  root = NULL;

  /* Writers may list tensors in any order; the data must still be tiled
   * exactly, which is easiest to see in offset order. */
  if (f->n_tensors > 1) {
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_offsets);
  }
  uint64_t expect = 0;
  for (size_t i = 0; i < f->n_tensors; i++) {
    sp_safetensors_tensor *t = &f->tensors[i];
    if (t->begin != expect) {
      rc = st_fail(diag, SP_EFORMAT,
                   "%s: tensor '%.*s': data_offsets [%llu, %llu] %s the "
                   "previous tensor, which ends at %llu",
                   src, NAME_Q, t->name, (unsigned long long)t->begin,
                   (unsigned long long)t->end,
                   t->begin > expect ? "leave a gap after" : "overlap",
                   (unsigned long long)expect);
      goto fail;
    }
    expect = t->end;
  }
  if (expect != f->data_len) {
    rc = st_fail(diag, SP_EFORMAT,
                 "%s: tensors cover %llu bytes but the data section has %zu",
                 src, (unsigned long long)expect, f->data_len);
    goto fail;
  }
  for (size_t i = 0; i < f->n_tensors; i++) {
    sp_safetensors_tensor *t = &f->tensors[i];
    /* end <= data_len <= SIZE_MAX from here on, so the casts are exact. */
    t->data = f->data != NULL ? f->data + (size_t)t->begin : NULL;
    t->nbytes = (size_t)(t->end - t->begin);
    f->by_name[i] = t;
  }
  if (f->n_tensors > 1) {
    qsort(f->by_name, f->n_tensors, sizeof *f->by_name, cmp_name_ptr);
  }
  *out = f;
  return 0;

fail_nomem:
  rc = st_fail(diag, SP_ENOMEM, "%s: out of memory parsing the header", src);
fail:
  if (root != NULL) json_decref(root);
  sp_safetensors_close(f);
  return rc;
}

int sp_safetensors_parse(const uint8_t *buf, size_t len, const char *source,
                         sp_safetensors_file **out, sp_diag *diag) {
  const char *src = source != NULL ? source : "<buffer>";
  if (out == NULL) return st_fail(diag, SP_EINVAL, "%s: out is NULL", src);
  *out = NULL;
  if (buf == NULL && len > 0) {
    return st_fail(diag, SP_EINVAL, "%s: buffer is NULL", src);
  }
  return parse_image(buf, len, true, src, out, diag);
}

/* Reads exactly len bytes at offset off. */
static int read_full(int fd, uint8_t *dst, size_t len, off_t off,
                     const char *path, sp_diag *d) {
  size_t done = 0;
  while (done < len) {
    size_t chunk = len - done;
    if (chunk > ((size_t)1 << 30)) chunk = (size_t)1 << 30;
    ssize_t r = pread(fd, dst + done, chunk, off + (off_t)done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return st_fail(d, SP_EIO, "%s: read failed: %s", path, strerror(errno));
    }
    if (r == 0) {
      return st_fail(d, SP_EIO, "%s: file shrank while being read", path);
    }
    done += (size_t)r;
  }
  return 0;
}

/* Opens path for reading and checks what both readers need before they
 * allocate anything: a regular file whose 8-byte header length fits its
 * real size. On success *fd is open (the caller closes it), *size is the
 * file's size and *n the header length; on error nothing stays open. */
static int open_checked(const char *path, int *fd, uint64_t *size, uint64_t *n,
                        sp_diag *diag) {
  *fd = open(path, O_RDONLY | O_CLOEXEC);
  if (*fd < 0) {
    int e = errno;
    return st_fail(diag, e == ENOENT ? SP_ENOENT : SP_EIO,
                   "%s: cannot open: %s", path, strerror(e));
  }
  struct stat st;
  int rc = 0;
  if (fstat(*fd, &st) != 0)
    rc = st_fail(diag, SP_EIO, "%s: cannot stat: %s", path, strerror(errno));
  else if (!S_ISREG(st.st_mode))
    rc = st_fail(diag, SP_EIO, "%s: not a regular file", path);
  uint8_t prefix[8];
  if (rc == 0) {
    *size = (uint64_t)st.st_size;
    rc = read_full(*fd, prefix, *size < 8 ? (size_t)*size : 8, 0, path, diag);
  }
  if (rc == 0) rc = check_prefix(prefix, *size, path, n, diag);
  if (rc != 0) {
    close(*fd);
    *fd = -1;
  }
  return rc;
}

int sp_safetensors_open(const char *path, sp_safetensors_file **out,
                        sp_diag *diag) {
  if (out == NULL || path == NULL) {
    return st_fail(diag, SP_EINVAL, "sp_safetensors_open: NULL argument");
  }
  *out = NULL;
  int fd;
  uint64_t size, n;
  int rc = open_checked(path, &fd, &size, &n, diag);
  if (rc != 0) return rc;
  void *base = NULL;
  if (size > SIZE_MAX - 64) {
    rc = st_fail(diag, SP_ETOOBIG, "%s: %llu bytes do not fit in memory", path,
                 (unsigned long long)size);
    goto done;
  }

  /* Put the data section (file offset 8+N) on a 64-byte boundary so that
   * standard-order files give naturally aligned tensors. */
  size_t pad = (size_t)((64 - (8 + n) % 64) % 64);
  if (posix_memalign(&base, 64, pad + (size_t)size) != 0) {
    base = NULL;
    rc = st_fail(diag, SP_ENOMEM, "%s: cannot allocate %llu bytes", path,
                 (unsigned long long)size);
    goto done;
  }
  uint8_t *img = (uint8_t *)base + pad;
  rc = read_full(fd, img, (size_t)size, 0, path, diag);
  if (rc != 0) goto done;

  sp_safetensors_file *f = NULL;
  rc = sp_safetensors_parse(img, (size_t)size, path, &f, diag);
  if (rc != 0) goto done;
  f->owned = base;
  base = NULL;
  *out = f;

done:
  free(base);
  close(fd);
  return rc;
}

int sp_safetensors_open_header(const char *path, sp_safetensors_file **out,
                               sp_diag *diag) {
  if (out == NULL || path == NULL) {
    return st_fail(diag, SP_EINVAL,
                   "sp_safetensors_open_header: NULL argument");
  }
  *out = NULL;
  int fd;
  uint64_t size, n;
  int rc = open_checked(path, &fd, &size, &n, diag);
  if (rc != 0) return rc;
  uint8_t *hdr = NULL;
  sp_safetensors_file *f = NULL;
  if (size > SIZE_MAX) {
    rc = st_fail(diag, SP_ETOOBIG, "%s: %llu bytes cannot be addressed", path,
                 (unsigned long long)size);
    goto fail;
  }
  hdr = malloc(8 + (size_t)n);
  if (hdr == NULL) {
    rc = st_fail(diag, SP_ENOMEM, "%s: cannot allocate the %llu-byte header",
                 path, (unsigned long long)n);
    goto fail;
  }
  rc = read_full(fd, hdr, 8 + (size_t)n, 0, path, diag);
  if (rc == 0) rc = parse_image(hdr, size, false, path, &f, diag);
  free(hdr);
  hdr = NULL;
  if (rc != 0) goto fail;
  f->path = strdup(path);
  if (f->path == NULL) {
    rc = st_fail(diag, SP_ENOMEM, "%s: out of memory", path);
    goto fail;
  }
  f->fd = fd;
  *out = f;
  return 0;

fail:
  sp_safetensors_close(f);
  free(hdr);
  close(fd);
  return rc;
}

int sp_safetensors_read_range(const sp_safetensors_file *f,
                              const sp_safetensors_tensor *t, uint64_t offset,
                              void *dst, size_t len, sp_diag *diag) {
  if (f == NULL || t == NULL || (dst == NULL && len > 0)) {
    return st_fail(diag, SP_EINVAL, "sp_safetensors_read_range: NULL argument");
  }
  if (offset > t->nbytes || len > t->nbytes - offset) {
    return st_fail(diag, SP_ERANGE,
                   "tensor '%.*s': bytes [%llu, +%zu) are outside its %zu",
                   NAME_Q, t->name, (unsigned long long)offset, len, t->nbytes);
  }
  if (len == 0) return 0;
  if (f->data != NULL) {
    memcpy(dst, t->data + offset, len);
    return 0;
  }
  /* the tensor lies inside the data section, which lies inside the file as
   * it was at open; a file cut short since then reads short (SP_EIO) */
  uint64_t pos = 8 + f->header_len + t->begin + offset;
  if (pos > (uint64_t)INT64_MAX) {
    return st_fail(diag, SP_ERANGE, "%s: offset overflows", f->path);
  }
  int rc = read_full(f->fd, dst, len, (off_t)pos, f->path, diag);
  if (rc != 0) {
    return sp_diag_prefix(diag, rc, "tensor '%.*s'", NAME_Q, t->name);
  }
  return 0;
}

size_t sp_safetensors_tensor_count(const sp_safetensors_file *f) {
  return f != NULL ? f->n_tensors : 0;
}

const sp_safetensors_tensor *sp_safetensors_tensor_at(
    const sp_safetensors_file *f, size_t i) {
  return f != NULL && i < f->n_tensors ? &f->tensors[i] : NULL;
}

static int cmp_key_name(const void *key, const void *elem) {
  const sp_safetensors_tensor *const *t = elem;
  return strcmp((const char *)key, (*t)->name);
}

const sp_safetensors_tensor *sp_safetensors_find(const sp_safetensors_file *f,
                                                 const char *name) {
  if (f == NULL || name == NULL || f->n_tensors == 0) return NULL;
  const sp_safetensors_tensor *const *hit =
      bsearch(name, f->by_name, f->n_tensors, sizeof *f->by_name, cmp_key_name);
  return hit != NULL ? *hit : NULL;
}

int sp_safetensors_get(const sp_safetensors_file *f, const char *name,
                       const sp_safetensors_tensor **out, sp_diag *diag) {
  if (f == NULL || name == NULL || out == NULL) {
    return st_fail(diag, SP_EINVAL, "sp_safetensors_get: NULL argument");
  }
  *out = sp_safetensors_find(f, name);
  if (*out == NULL) {
    return st_fail(diag, SP_ENOENT, "tensor '%.*s' not found (%zu tensors)",
                   NAME_Q, name, f->n_tensors);
  }
  return 0;
}

int sp_safetensors_tensor_read(const sp_safetensors_tensor *t, void *dst,
                               size_t dst_len) {
  if (t == NULL || (dst == NULL && dst_len > 0)) return SP_EINVAL;
  if (dst_len != t->nbytes) return SP_ERANGE;
  if (dst_len > 0) memcpy(dst, t->data, dst_len);
  return 0;
}

size_t sp_safetensors_metadata_count(const sp_safetensors_file *f) {
  return f != NULL ? f->n_meta : 0;
}

const sp_safetensors_kv *sp_safetensors_metadata_at(
    const sp_safetensors_file *f, size_t i) {
  return f != NULL && i < f->n_meta ? &f->meta[i] : NULL;
}

const char *sp_safetensors_metadata_get(const sp_safetensors_file *f,
                                        const char *key) {
  if (f == NULL || key == NULL) return NULL;
  for (size_t i = 0; i < f->n_meta; i++) {
    if (strcmp(f->meta[i].key, key) == 0) return f->meta[i].value;
  }
  return NULL;
}

size_t sp_safetensors_header_len(const sp_safetensors_file *f) {
  return f != NULL ? f->header_len : 0;
}

size_t sp_safetensors_data_len(const sp_safetensors_file *f) {
  return f != NULL ? f->data_len : 0;
}

/* ---- writer ------------------------------------------------------------- */

static int cmp_entry_name(const void *a, const void *b) {
  const sp_safetensors_entry *const *x = a, *const *y = b;
  return strcmp((*x)->name, (*y)->name);
}

static int cmp_entry_layout(const void *a, const void *b) {
  const sp_safetensors_entry *const *x = a, *const *y = b;
  int rx = dtype_rank((*x)->dtype), ry = dtype_rank((*y)->dtype);
  if (rx != ry) return rx > ry ? -1 : 1;
  return strcmp((*x)->name, (*y)->name);
}

static int cmp_kv_key(const void *a, const void *b) {
  const sp_safetensors_kv *const *x = a, *const *y = b;
  return strcmp((*x)->key, (*y)->key);
}

static int entry_nbytes(const sp_safetensors_entry *e, uint64_t *out,
                        sp_diag *d) {
  uint64_t numel = 1;
  for (size_t k = 0; k < e->ndim; k++) {
    /* jansson integers are signed 64-bit */
    if (e->shape[k] > (uint64_t)INT64_MAX ||
        !mul_u64(numel, e->shape[k], &numel)) {
      return st_fail(d, SP_ETOOBIG, "tensor '%.*s': shape overflows", NAME_Q,
                     e->name);
    }
  }
  if (!mul_u64(numel, sp_dtype_size(e->dtype), out) ||
      *out > (uint64_t)INT64_MAX) {
    return st_fail(d, SP_ETOOBIG, "tensor '%.*s': byte size overflows", NAME_Q,
                   e->name);
  }
  return 0;
}

/* Checks every argument, in the order: presence, limits, content. */
static int check_write_args(const sp_safetensors_entry *entries, size_t n,
                            const sp_safetensors_kv *meta, size_t n_meta,
                            bool need_data, sp_diag *d) {
  if (n > 0 && entries == NULL) {
    return st_fail(d, SP_EINVAL, "entries is NULL");
  }
  if (n_meta > 0 && meta == NULL) {
    return st_fail(d, SP_EINVAL, "metadata is NULL");
  }
  if (n > SP_SAFETENSORS_MAX_TENSORS) {
    return st_fail(d, SP_ETOOBIG, "%zu tensors exceed the limit of %u", n,
                   SP_SAFETENSORS_MAX_TENSORS);
  }
  /* One slot is taken by "format". */
  if (n_meta >= SP_SAFETENSORS_MAX_METADATA) {
    return st_fail(d, SP_ETOOBIG, "%zu metadata entries exceed the limit of %u",
                   n_meta, SP_SAFETENSORS_MAX_METADATA - 1);
  }
  for (size_t i = 0; i < n; i++) {
    const sp_safetensors_entry *e = &entries[i];
    if (e->name == NULL)
      return st_fail(d, SP_EINVAL, "tensor %zu: NULL name", i);
    size_t len = strnlen(e->name, SP_SAFETENSORS_MAX_NAME + 1);
    if (len == 0) return st_fail(d, SP_EINVAL, "tensor %zu: empty name", i);
    if (len > SP_SAFETENSORS_MAX_NAME) {
      return st_fail(d, SP_ETOOBIG,
                     "tensor '%.*s...': name exceeds the limit of %u bytes",
                     NAME_Q, e->name, SP_SAFETENSORS_MAX_NAME);
    }
    if (!utf8_valid(e->name)) {
      return st_fail(d, SP_EINVAL, "tensor '%.*s': name is not valid UTF-8",
                     NAME_Q, e->name);
    }
    if (strcmp(e->name, META_KEY) == 0) {
      return st_fail(d, SP_EINVAL, "a tensor cannot be named %s", META_KEY);
    }
    if (!sp_dtype_valid(e->dtype)) {
      return st_fail(d, SP_EINVAL, "tensor '%.*s': invalid dtype %d", NAME_Q,
                     e->name, (int)e->dtype);
    }
    if (e->ndim > SP_SAFETENSORS_MAX_NDIM) {
      return st_fail(d, SP_ETOOBIG,
                     "tensor '%.*s': %zu dimensions exceed the limit of %u",
                     NAME_Q, e->name, e->ndim, SP_SAFETENSORS_MAX_NDIM);
    }
    uint64_t nbytes;
    int rc = entry_nbytes(e, &nbytes, d);
    if (rc != 0) return rc;
    if (need_data && nbytes > 0 && e->data == NULL) {
      return st_fail(d, SP_EINVAL, "tensor '%.*s': data is NULL", NAME_Q,
                     e->name);
    }
  }
  for (size_t i = 0; i < n_meta; i++) {
    const sp_safetensors_kv *kv = &meta[i];
    if (kv->key == NULL || kv->value == NULL) {
      return st_fail(d, SP_EINVAL, "metadata entry %zu: NULL key or value", i);
    }
    if (strnlen(kv->key, SP_SAFETENSORS_MAX_NAME + 1) >
        SP_SAFETENSORS_MAX_NAME) {
      return st_fail(d, SP_ETOOBIG,
                     "metadata key '%.*s...' exceeds the limit of %u bytes",
                     NAME_Q, kv->key, SP_SAFETENSORS_MAX_NAME);
    }
    if (!utf8_valid(kv->key) || !utf8_valid(kv->value)) {
      return st_fail(d, SP_EINVAL, "metadata '%.*s': not valid UTF-8", NAME_Q,
                     kv->key);
    }
    /* Transformers refuses any other format. */
    if (strcmp(kv->key, "format") == 0 && strcmp(kv->value, "pt") != 0) {
      return st_fail(d, SP_EINVAL,
                     "metadata \"format\" must be \"pt\", not \"%.32s\"",
                     kv->value);
    }
  }
  return 0;
}

/* Builds 8-byte prefix + padded JSON into *out (malloc'd) and the tensor
 * order into *order_out (malloc'd, n pointers into entries). */
static int build_header(const sp_safetensors_entry *entries, size_t n,
                        const sp_safetensors_kv *meta, size_t n_meta,
                        bool need_data, uint8_t **out, size_t *out_len,
                        const sp_safetensors_entry ***order_out, sp_diag *d) {
  int rc = check_write_args(entries, n, meta, n_meta, need_data, d);
  if (rc != 0) return rc;

  json_t *root = NULL;
  char *text = NULL;
  const sp_safetensors_entry **order = NULL;
  const sp_safetensors_kv **korder = NULL;
  rc = SP_ENOMEM;

  if (n > 0) {
    order = malloc(n * sizeof *order);
    if (order == NULL) goto nomem;
    for (size_t i = 0; i < n; i++) order[i] = &entries[i];
    qsort(order, n, sizeof *order, cmp_entry_name);
    for (size_t i = 1; i < n; i++) {
      if (strcmp(order[i - 1]->name, order[i]->name) == 0) {
        rc = st_fail(d, SP_EINVAL, "tensor '%.*s' given twice", NAME_Q,
                     order[i]->name);
        goto out;
      }
    }
    qsort(order, n, sizeof *order, cmp_entry_layout);
  }
  if (n_meta > 0) {
    korder = malloc(n_meta * sizeof *korder);
    if (korder == NULL) goto nomem;
    for (size_t i = 0; i < n_meta; i++) korder[i] = &meta[i];
    qsort(korder, n_meta, sizeof *korder, cmp_kv_key);
    for (size_t i = 1; i < n_meta; i++) {
      if (strcmp(korder[i - 1]->key, korder[i]->key) == 0) {
        rc = st_fail(d, SP_EINVAL, "metadata key '%.*s' given twice", NAME_Q,
                     korder[i]->key);
        goto out;
      }
    }
  }

  root = json_object();
  json_t *jm = json_object();
  if (root == NULL || jm == NULL || json_object_set_new(root, META_KEY, jm)) {
    goto nomem;
  }
  if (json_object_set_new(jm, "format", json_string("pt"))) goto nomem;
  for (size_t i = 0; i < n_meta; i++) {
    if (strcmp(meta[i].key, "format") == 0) continue;
    if (json_object_set_new(jm, meta[i].key, json_string(meta[i].value))) {
      goto nomem;
    }
  }
  uint64_t offset = 0;
  for (size_t i = 0; i < n; i++) {
    const sp_safetensors_entry *e = order[i];
    uint64_t nbytes;
    rc = entry_nbytes(e, &nbytes, d);
    if (rc != 0) goto out;
    if (nbytes > (uint64_t)INT64_MAX - offset) {
      rc = st_fail(d, SP_ETOOBIG, "total data size overflows");
      goto out;
    }
    rc = SP_ENOMEM;
    json_t *jt = json_object();
    if (jt == NULL || json_object_set_new(root, e->name, jt)) goto nomem;
    json_t *shape = json_array();
    json_t *offs = json_array();
    if (json_object_set_new(jt, "dtype",
                            json_string(sp_dtype_st_name(e->dtype))) ||
        json_object_set_new(jt, "shape", shape) ||
        json_object_set_new(jt, "data_offsets", offs)) {
      goto nomem;
    }
    for (size_t k = 0; k < e->ndim; k++) {
      if (json_array_append_new(shape, json_integer((json_int_t)e->shape[k]))) {
        goto nomem;
      }
    }
    if (json_array_append_new(offs, json_integer((json_int_t)offset)) ||
        json_array_append_new(offs,
                              json_integer((json_int_t)(offset + nbytes)))) {
      goto nomem;
    }
    offset += nbytes;
  }

  text = json_dumps(root, JSON_COMPACT);
  if (text == NULL) goto nomem;
  size_t tlen = strlen(text);
  size_t padded = (tlen + 7) & ~(size_t)7;
  if (padded > SP_SAFETENSORS_MAX_HEADER) {
    rc = st_fail(d, SP_ETOOBIG, "header of %zu bytes exceeds the limit of %u",
                 padded, SP_SAFETENSORS_MAX_HEADER);
    goto out;
  }
  uint8_t *buf = malloc(8 + padded);
  if (buf == NULL) goto nomem;
  store_le64(buf, padded);
  memcpy(buf + 8, text, tlen);
  memset(buf + 8 + tlen, ' ', padded - tlen);
  *out = buf;
  *out_len = 8 + padded;
  *order_out = order;
  order = NULL;
  rc = 0;
  goto out;

nomem:
  rc = st_fail(d, SP_ENOMEM, "out of memory building the header");
out:
  free(text);
  json_decref(root);
  free(korder);
  free(order);
  return rc;
}

static int write_full(int fd, const void *src, size_t len, const char *path,
                      sp_diag *d) {
  const uint8_t *p = src;
  while (len > 0) {
    size_t chunk = len > ((size_t)1 << 30) ? (size_t)1 << 30 : len;
    ssize_t w = write(fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      return st_fail(d, SP_EIO, "%s: write failed: %s", path, strerror(errno));
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

/* Makes the rename itself durable. */
static int sync_parent_dir(const char *path, sp_diag *d) {
  const char *slash = strrchr(path, '/');
  char *dir;
  if (slash == NULL) {
    dir = strdup(".");
  } else {
    size_t len = slash == path ? 1 : (size_t)(slash - path);
    dir = strndup(path, len);
  }
  if (dir == NULL) return st_fail(d, SP_ENOMEM, "%s: out of memory", path);
  int rc = 0;
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    rc = st_fail(d, SP_EIO, "%s: cannot open directory to sync: %s", path,
                 strerror(errno));
  } else {
    /* Some file systems cannot sync directories; the data itself is already
     * synced, so that is not worth failing the checkpoint for. */
    if (fsync(fd) != 0 && errno != EINVAL && errno != ENOTSUP) {
      rc = st_fail(d, SP_EIO, "%s: cannot sync directory: %s", path,
                   strerror(errno));
    }
    close(fd);
  }
  free(dir);
  return rc;
}

/* A file being written: the header is on disk, tensors arrive by put. */
struct sp_safetensors_writer {
  char *path;
  char *tmp;
  int fd;
  size_t n;
  uint64_t data_start; /* 8 + N */
  uint64_t *begin;     /* per entry index: offset in the data section */
  uint64_t *nbytes;
  uint64_t *written; /* bytes put so far, from the tensor's start */
  size_t *order;     /* entry indices in layout (file) order */
  char **names;      /* copies, for messages after open returns */
};

static void writer_free(sp_safetensors_writer *w) {
  if (w == NULL) return;
  if (w->fd >= 0) close(w->fd);
  if (w->tmp != NULL) unlink(w->tmp);
  for (size_t i = 0; w->names != NULL && i < w->n; i++) free(w->names[i]);
  free(w->names);
  free(w->order);
  free(w->written);
  free(w->nbytes);
  free(w->begin);
  free(w->tmp);
  free(w->path);
  free(w);
}

void sp_safetensors_writer_abort(sp_safetensors_writer *w) { writer_free(w); }

int sp_safetensors_writer_open(const char *path,
                               const sp_safetensors_entry *entries, size_t n,
                               const sp_safetensors_kv *meta, size_t n_meta,
                               sp_safetensors_writer **out, sp_diag *diag) {
  if (path == NULL || out == NULL) {
    return st_fail(diag, SP_EINVAL, "path or out is NULL");
  }
  *out = NULL;
  uint8_t *hdr = NULL;
  size_t hdr_len = 0;
  const sp_safetensors_entry **order = NULL;
  int rc = build_header(entries, n, meta, n_meta, false, &hdr, &hdr_len, &order,
                        diag);
  if (rc != 0) return sp_diag_prefix(diag, rc, "%s", path);

  sp_safetensors_writer *w = calloc(1, sizeof *w);
  size_t slots = n > 0 ? n : 1;
  if (w != NULL) {
    w->fd = -1;
    w->n = n;
    w->data_start = hdr_len;
    w->path = strdup(path);
    w->tmp = malloc(strlen(path) + 64);
    w->begin = calloc(slots, sizeof *w->begin);
    w->nbytes = calloc(slots, sizeof *w->nbytes);
    w->written = calloc(slots, sizeof *w->written);
    w->order = calloc(slots, sizeof *w->order);
    w->names = calloc(slots, sizeof *w->names);
  }
  if (w == NULL || w->path == NULL || w->tmp == NULL || w->begin == NULL ||
      w->nbytes == NULL || w->written == NULL || w->order == NULL ||
      w->names == NULL) {
    rc = st_fail(diag, SP_ENOMEM, "%s: out of memory", path);
    goto fail;
  }
  uint64_t offset = 0;
  for (size_t k = 0; k < n; k++) {
    size_t i = (size_t)(order[k] - entries);
    w->order[k] = i;
    w->begin[i] = offset;
    rc = entry_nbytes(&entries[i], &w->nbytes[i], diag);
    if (rc != 0) goto fail;
    offset += w->nbytes[i]; /* build_header checked the total */
    w->names[i] = strdup(entries[i].name);
    if (w->names[i] == NULL) {
      rc = st_fail(diag, SP_ENOMEM, "%s: out of memory", path);
      goto fail;
    }
  }

  static atomic_uint counter;
  /* O_EXCL with a name unique per process and call: concurrent writers of
   * the same path never share a temporary file. */
  for (int attempt = 0; attempt < 100 && w->fd < 0; attempt++) {
    snprintf(w->tmp, strlen(path) + 64, "%s.tmp.%ld.%u", path, (long)getpid(),
             atomic_fetch_add(&counter, 1u));
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (w->fd < 0 && errno != EEXIST) break;
  }
  if (w->fd < 0) {
    rc = st_fail(diag, SP_EIO, "%s: cannot create temporary file: %s", path,
                 strerror(errno));
    free(w->tmp); /* nothing of ours to unlink */
    w->tmp = NULL;
    goto fail;
  }
  rc = write_full(w->fd, hdr, hdr_len, w->tmp, diag);
  if (rc != 0) goto fail;
  free(order);
  free(hdr);
  *out = w;
  return 0;

fail:
  free(order);
  free(hdr);
  writer_free(w);
  return rc;
}

int sp_safetensors_writer_put(sp_safetensors_writer *w, size_t i,
                              uint64_t offset, const void *src, size_t len,
                              sp_diag *diag) {
  if (w == NULL || (src == NULL && len > 0)) {
    return st_fail(diag, SP_EINVAL, "sp_safetensors_writer_put: NULL argument");
  }
  if (i >= w->n) {
    return st_fail(diag, SP_ERANGE, "%s: tensor %zu of %zu", w->path, i, w->n);
  }
  if (offset != w->written[i] || len > w->nbytes[i] - offset) {
    return st_fail(diag, SP_ERANGE,
                   "%s: tensor '%.*s': bytes [%llu, +%zu) given, the next "
                   "expected at %llu of %llu",
                   w->path, NAME_Q, w->names[i], (unsigned long long)offset,
                   len, (unsigned long long)w->written[i],
                   (unsigned long long)w->nbytes[i]);
  }
  const uint8_t *p = src;
  uint64_t pos = w->data_start + w->begin[i] + offset;
  size_t left = len;
  while (left > 0) {
    size_t chunk = left > ((size_t)1 << 30) ? (size_t)1 << 30 : left;
    ssize_t r = pwrite(w->fd, p, chunk, (off_t)pos);
    if (r < 0) {
      if (errno == EINTR) continue;
      return st_fail(diag, SP_EIO, "%s: write failed: %s", w->tmp,
                     strerror(errno));
    }
    p += r;
    pos += (uint64_t)r;
    left -= (size_t)r;
  }
  w->written[i] += len;
  return 0;
}

int sp_safetensors_writer_commit(sp_safetensors_writer *w, sp_diag *diag) {
  if (w == NULL)
    return st_fail(diag, SP_EINVAL, "sp_safetensors_writer_commit: NULL");
  int rc = 0;
  for (size_t i = 0; i < w->n; i++) {
    if (w->written[i] != w->nbytes[i]) {
      rc = st_fail(diag, SP_EINVAL,
                   "%s: tensor '%.*s': %llu of its %llu bytes written", w->path,
                   NAME_Q, w->names[i], (unsigned long long)w->written[i],
                   (unsigned long long)w->nbytes[i]);
      break;
    }
  }
  if (rc == 0 && fsync(w->fd) != 0) {
    rc = st_fail(diag, SP_EIO, "%s: fsync failed: %s", w->tmp, strerror(errno));
  }
  /* close can report a deferred write error (NFS); only a clean close
   * counts. */
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0 && rc == 0) {
    rc = st_fail(diag, SP_EIO, "%s: close failed: %s", w->tmp, strerror(errno));
  }
  if (rc == 0 && rename(w->tmp, w->path) != 0) {
    rc = st_fail(diag, SP_EIO, "%s: cannot rename temporary file: %s", w->path,
                 strerror(errno));
  }
  if (rc == 0) {
    free(w->tmp); /* renamed: nothing left to unlink */
    w->tmp = NULL;
    rc = sync_parent_dir(w->path, diag);
  }
  writer_free(w);
  return rc;
}

int sp_safetensors_write(const char *path, const sp_safetensors_entry *entries,
                         size_t n, const sp_safetensors_kv *meta, size_t n_meta,
                         sp_diag *diag) {
  if (path == NULL) return st_fail(diag, SP_EINVAL, "path is NULL");
  /* the data must be there before anything is created */
  int rc = check_write_args(entries, n, meta, n_meta, true, diag);
  if (rc != 0) return sp_diag_prefix(diag, rc, "%s", path);
  sp_safetensors_writer *w;
  rc = sp_safetensors_writer_open(path, entries, n, meta, n_meta, &w, diag);
  if (rc != 0) return rc;
  /* in file order: one sequential write */
  for (size_t k = 0; k < n; k++) {
    size_t i = w->order[k];
    rc = sp_safetensors_writer_put(w, i, 0, entries[i].data,
                                   (size_t)w->nbytes[i], diag);
    if (rc != 0) {
      writer_free(w);
      return rc;
    }
  }
  return sp_safetensors_writer_commit(w, diag);
}
