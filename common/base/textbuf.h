/* A growable text buffer for documents built piece by piece (the
 * coordinator's /metrics exposition, its HTTP answers), with a bound on
 * its size and a sticky error, so a writer appends without checking each
 * call and looks at the result once.
 *
 * Ownership: the buffer owns p; sp_textbuf_take hands it to the caller.
 * Threads: one buffer is used by one thread at a time.
 * Errors: the first failure is kept in err (SP_ENOMEM, or SP_ETOOBIG past
 * max) and every later append is a no-op; the text stays NUL-terminated. */
#ifndef SP_TEXTBUF_H
#define SP_TEXTBUF_H

#include <stddef.h>

typedef struct sp_textbuf {
  char *p;
  size_t len, cap;
  size_t max; /* most bytes the text may hold; 0: no bound */
  int err;    /* 0 or the first error */
} sp_textbuf;

/* An empty buffer of at most max bytes (0: unbounded); allocates nothing
 * until the first append. */
void sp_textbuf_init(sp_textbuf *b, size_t max);
void sp_textbuf_free(sp_textbuf *b);
/* Makes room for n more bytes (fewer reallocations for a known size). */
void sp_textbuf_reserve(sp_textbuf *b, size_t n);
void sp_textbuf_put(sp_textbuf *b, const char *s, size_t n);
void sp_textbuf_puts(sp_textbuf *b, const char *s);
void sp_textbuf_printf(sp_textbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The text (malloc'd, NUL-terminated, *len its length) handed to the
 * caller, who frees it; the buffer is empty again. Returns the buffer's
 * error instead (and frees the text) when one occurred; with nothing
 * appended, a malloc'd empty string. */
int sp_textbuf_take(sp_textbuf *b, char **out, size_t *len);

#endif
