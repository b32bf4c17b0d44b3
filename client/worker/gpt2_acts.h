/* The GPT-2 step's activations and scratch: which arrays a micro-batch of
 * B x T tokens needs, by category (train_memory.h's sp_act_cat), laid out
 * once for both the allocation and the memory model. The trainer
 * allocates through this code and `shardplane plan --memory` and `run`'s
 * memory check count through it (with an allocator that hands out no
 * memory), so prediction and allocation cannot differ.
 *
 * What decides the layout:
 *   - the kernel table (sp_gpt2_layout): the CPU's or a GPU's;
 *   - activation checkpointing: without it every block keeps its
 *     activations from forward for backward; with it (as FSDP's
 *     checkpoint_wrapper around each block) only the blocks' inputs are
 *     kept and one set of block activations is shared, which the backward
 *     refills by running the block's forward again;
 *   - whether every parameter's view is float32 (no mixed precision): then
 *     the products read the parameters in place and write their gradients
 *     in place, and no float32 copy of a parameter (the largest is wte,
 *     V x C) or of its gradient is needed.
 *
 * Internal to the worker. Names: sp_gpt2_acts_X. */
#ifndef SP_GPT2_ACTS_H
#define SP_GPT2_ACTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "gpt2.h"
#include "train_memory.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a kernel table asks of the layout (sp_gpt2_ops.layout). */
typedef struct sp_gpt2_layout {
  const char *name;  /* names the table in messages */
  int64_t max_elems; /* per array: the kernels index with int */
  /* The attention backward's scratch holds every head's T x T (the GPU
   * does a sequence's heads at once) instead of one head's. */
  bool datt_all_heads;
  /* The table adds the lookup's share of wte's gradient row by row into a
   * float32 view (sp_gpt2_ops.wte_bwd_rows), through B*T rows of scratch
   * instead of a V x C one. */
  bool wte_rows;
  /* The loss is summed in the table's memory: B*T doubles of row sums,
   * the total and a scalar for the ranks' sum. */
  bool device_loss;
} sp_gpt2_layout;

/* The CPU's (gpt2.c) and a GPU's (gpt2_cuda.c). */
extern const sp_gpt2_layout sp_gpt2_cpu_layout;
extern const sp_gpt2_layout sp_gpt2_cuda_layout;

typedef struct sp_gpt2_shape {
  size_t B, T;        /* sequences of a micro-batch on this rank, tokens */
  bool checkpointing; /* keep only the blocks' inputs; recompute */
  bool f32_views;     /* every param's view and gradient is float32 */
} sp_gpt2_shape;

/* bytes of the table's memory (contents undefined) */
typedef int (*sp_gpt2_alloc_fn)(size_t bytes, void **out, sp_diag *d);
typedef void (*sp_gpt2_release_fn)(void *p);

/* The arrays of sp_gpt2_acts for sh (B, T >= 1, T <= ctx) into a (zeroed
 * by the caller), through alloc; their bytes by category in a->mem.
 * SP_EINVAL (a shape out of range), SP_ETOOBIG (an array over
 * lo->max_elems), else alloc's errors. On failure the caller releases
 * what was allocated (sp_gpt2_acts_release). */
int sp_gpt2_acts_alloc(const sp_gpt2_layout *lo, sp_gpt2_alloc_fn alloc,
                       const sp_gpt2 *g, const sp_gpt2_shape *sh,
                       sp_gpt2_acts *a, sp_diag *d);
/* Releases a's arrays (not a itself), each once; a from
 * sp_gpt2_acts_alloc, successful or not. */
void sp_gpt2_acts_release(sp_gpt2_release_fn release, sp_gpt2_acts *a);

/* What sp_gpt2_acts_alloc would allocate for sh on lo, by category, with
 * no memory taken but the per-layer pointer lists. Errors as it. */
int sp_gpt2_acts_count(const sp_gpt2_layout *lo, const sp_gpt2 *g,
                       const sp_gpt2_shape *sh, sp_act_bytes *out, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
