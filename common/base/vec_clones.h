/* SP_VEC_CLONES: an elementwise loop compiled for AVX-512 and AVX2 beside
 * the baseline x86-64 (SSE2), the copy picked at load time by the CPU.
 * ISO C mode contracts no multiply-add and no compiler reorders a float
 * sum on its own, so every clone gives the same bits; only the lanes
 * differ (SSE2's 4 float lanes made GPT-2's GELU alone 5 % of a step, and
 * AdamW's double loop 11 %). Elsewhere: nothing. */
#ifndef SP_VEC_CLONES_H
#define SP_VEC_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SP_VEC_CLONES \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SP_VEC_CLONES
#endif

#endif
