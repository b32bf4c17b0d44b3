/* Launch geometry of every shardplane kernel (the casts of common/cast/,
 * the FSDP runtime's and the worker's models' in client/): grid-stride
 * loops of SP_GRID_THREADS threads a block over a grid capped at a few
 * blocks, so one launch covers any n and a memory-bound kernel keeps every
 * SM busy without paying for a block per 256 elements. Only meaningful to
 * nvcc: a C file that includes it sees nothing. */
#ifndef SP_CUDA_GRID_H
#define SP_CUDA_GRID_H

#ifdef __CUDACC__
#include <stddef.h>

#define SP_GRID_THREADS 256
/* The cap where the caller knows no better (the casts size it from the
 * device's SM count instead). */
#define SP_GRID_MAX_BLOCKS 4096u
#define SP_GRID_TID() ((size_t)blockIdx.x * blockDim.x + threadIdx.x)
#define SP_GRID_STRIDE() ((size_t)gridDim.x * blockDim.x)

/* Blocks for n items of one thread each, at most cap, at least 1 (a launch
 * with an empty grid is an error, and n == 0 still launches). */
static inline unsigned sp_grid_blocks_cap(size_t n, unsigned cap) {
  size_t b = (n + SP_GRID_THREADS - 1) / SP_GRID_THREADS;
  unsigned blocks = b < cap ? (unsigned)b : cap;
  return blocks ? blocks : 1;
}

static inline unsigned sp_grid_blocks(size_t n) {
  return sp_grid_blocks_cap(n, SP_GRID_MAX_BLOCKS);
}
#endif

#endif
