#include "textbuf.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sp_error.h"

void sp_textbuf_init(sp_textbuf *b, size_t max) {
  memset(b, 0, sizeof *b);
  b->max = max;
}

void sp_textbuf_free(sp_textbuf *b) {
  free(b->p);
  b->p = NULL;
  b->len = b->cap = 0;
}

/* Room for n more bytes and the NUL; false (err set) when there is none. */
static int grow(sp_textbuf *b, size_t n) {
  if (b->err) return 0;
  if (n > SIZE_MAX / 2 - b->len || (b->max && b->len + n > b->max)) {
    b->err = SP_ETOOBIG;
    return 0;
  }
  size_t need = b->len + n + 1;
  if (need <= b->cap) return 1;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < need) cap *= 2;
  char *p = realloc(b->p, cap);
  if (p == NULL) {
    b->err = SP_ENOMEM;
    return 0;
  }
  b->p = p;
  b->cap = cap;
  return 1;
}

void sp_textbuf_reserve(sp_textbuf *b, size_t n) { (void)grow(b, n); }

void sp_textbuf_put(sp_textbuf *b, const char *s, size_t n) {
  if (!grow(b, n)) return;
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

void sp_textbuf_puts(sp_textbuf *b, const char *s) {
  sp_textbuf_put(b, s, strlen(s));
}

void sp_textbuf_printf(sp_textbuf *b, const char *fmt, ...) {
  if (b->err) return;
  char small[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) {
    b->err = SP_EINVAL;
    return;
  }
  if ((size_t)n < sizeof small) {
    sp_textbuf_put(b, small, (size_t)n);
    return;
  }
  if (!grow(b, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

int sp_textbuf_take(sp_textbuf *b, char **out, size_t *len) {
  int err = b->err;
  if (err == 0 && b->p == NULL) {
    b->p = calloc(1, 1);
    if (b->p == NULL) err = SP_ENOMEM;
  }
  if (err != 0) {
    sp_textbuf_free(b);
    b->err = 0;
    return err;
  }
  *out = b->p;
  if (len != NULL) *len = b->len;
  b->p = NULL;
  b->len = b->cap = 0;
  return 0;
}
