/* "Did you mean": the known name nearest to a misspelt one, for the
 * messages of the loaders and parsers that refuse unknown names. One
 * distance for all of them, so that every message suggests alike. */
#ifndef SP_SUGGEST_H
#define SP_SUGGEST_H

#include <stddef.h>

/* The name of names[0..n) (NULL entries skipped) nearest to s, when it is
 * within a typo: at most max(2, a third of the longer one's length)
 * insertions, deletions, substitutions or swaps of two neighbours. The
 * first of equally near ones; NULL when none is that near, or s is over
 * 64 bytes. */
const char *sp_suggest(const char *s, const char *const *names, size_t n);

#endif
