/* Statistics the benchmarks report over repeated runs. */
#ifndef SP_TEST_STATS_H
#define SP_TEST_STATS_H

#include <stddef.h>

/* The median of v[0..n): the middle value, or the mean of the two middle
 * ones when n is even; 0 when n is 0. Sorts v in place (ascending). */
double sp_test_median(double *v, size_t n);

#endif
