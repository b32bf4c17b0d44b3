/* Jittered exponential backoff (backoff.h). */
#include "backoff.h"

uint64_t sp_backoff_next(uint64_t *base, uint64_t min_ms, uint64_t max_ms,
                         uint64_t *state) {
  uint64_t b = *base == 0 ? min_ms : 2 * *base;
  if (b > max_ms) b = max_ms;
  *base = b;
  /* xorshift64: good enough for jitter */
  uint64_t x = *state ? *state : 0x9E3779B97F4A7C15ull;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  *state = x;
  return b / 2 + x % (b + 1);
}
