#include "suggest.h"

#include <string.h>

#define MAX_LEN 64

/* Damerau-Levenshtein distance without repeated edits of one substring
 * (the "optimal string alignment" one): a swap of two neighbours, the most
 * common typo, counts 1 instead of 2. Rows of MAX_LEN + 1 on the stack. */
static size_t distance(const char *a, size_t la, const char *b, size_t lb) {
  size_t rows[3][MAX_LEN + 1];
  size_t *pp = rows[0], *prev = rows[1], *cur = rows[2];
  for (size_t j = 0; j <= lb; j++) prev[j] = j;
  for (size_t i = 1; i <= la; i++) {
    cur[0] = i;
    for (size_t j = 1; j <= lb; j++) {
      size_t cost = a[i - 1] != b[j - 1];
      size_t best = prev[j - 1] + cost;
      if (prev[j] + 1 < best) best = prev[j] + 1;
      if (cur[j - 1] + 1 < best) best = cur[j - 1] + 1;
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
          pp[j - 2] + 1 < best)
        best = pp[j - 2] + 1;
      cur[j] = best;
    }
    size_t *t = pp;
    pp = prev;
    prev = cur;
    cur = t;
  }
  return prev[lb];
}

const char *sp_suggest(const char *s, const char *const *names, size_t n) {
  size_t ls = strlen(s);
  if (ls > MAX_LEN) return NULL;
  const char *best = NULL;
  size_t best_d = 0;
  for (size_t i = 0; i < n; i++) {
    if (names[i] == NULL) continue;
    size_t ln = strlen(names[i]);
    if (ln > MAX_LEN) continue;
    size_t d = distance(s, ls, names[i], ln);
    size_t longer = ls > ln ? ls : ln;
    size_t limit = longer / 3 > 2 ? longer / 3 : 2;
    if (d <= limit && (best == NULL || d < best_d)) {
      best = names[i];
      best_d = d;
    }
  }
  return best;
}
