/* The GPT-2 step's activations and scratch: their layout and allocation
 * in a kernel table's memory (gpt2_step.h's sp_gpt2_ops).
 *
 * Internal to the worker's models. Names: sp_gpt2_step_X. */
#ifndef SP_GPT2_ACTS_H
#define SP_GPT2_ACTS_H

#include "gpt2_step.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The arrays of sp_gpt2_acts for B x T tokens (B, T >= 1) in ops' memory,
 * into a (zeroed by the caller), their bytes in a->bytes. SP_ETOOBIG when
 * an array would pass ops->max_elems, else alloc's errors. On failure the
 * caller releases what was allocated. */
int sp_gpt2_step_acts_alloc(const sp_gpt2_ops *ops, const sp_gpt2 *g, size_t B,
                            size_t T, sp_gpt2_acts *a, sp_diag *d);
/* Releases a's arrays (not a itself); a from sp_gpt2_step_acts_alloc,
 * successful or not. */
void sp_gpt2_step_acts_release(const sp_gpt2_ops *ops, sp_gpt2_acts *a);
/* n x m elements of es bytes of ops' memory (at least one element), held
 * to ops->max_elems as the activations are. */
int sp_gpt2_step_alloc(const sp_gpt2_ops *ops, int64_t n, int64_t m, size_t es,
                       void **out, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
