/* The GPT-2 model of gpt2.h on a GPU: the same step pieces, in the same
 * order and with the same numerics, on device activations, for
 * shardplane-worker --device cuda:N (gpt2_train.c).
 *
 * The pieces are the CPU's, gpt2_step.c's, over the GPU's kernel table
 * (gpt2_cuda.c), the kernels of gpt2_gpu.h in place of gpt2_cpu.h's: a
 * 16-bit param dtype rounds the same activations at the same places, a
 * float32 view is read in place, any other is cast to float32 first
 * (sp_cuda_cast, exact), gradients are added to the views as on the CPU
 * (the products of a float32 view accumulate into it in float32; any other
 * gets the sum in double, rounded once). Products are cuBLAS
 * float32 GEMMs and the row reductions of LayerNorm, softmax and the loss
 * are trees, so a run matches the CPU's within a bound, not bit for bit
 * (tests/test_gpt2_cuda.c, docs/gpt2.md).
 *
 * The io callbacks are gpt2.h's and return device pointers (the FSDP
 * runtime's views on a GPU). Everything is enqueued on the stream given at
 * creation, which must be the one that orders the views
 * (sp_fsdp_cuda_stream); the calls return once their work is enqueued,
 * except where they say they wait. Errors as gpt2.h's, plus SP_ECUDA
 * (naming the call, file and line) and SP_ENOMEM for device memory. In a
 * build without CUDA every function fails with SP_EUNSUPPORTED
 * (gpt2_cuda_stub.c). One thread uses an object at a time. */
#ifndef SP_GPT2_CUDA_H
#define SP_GPT2_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "gpt2.h"
#include "gpt2_acts.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sp_gpt2_cuda sp_gpt2_cuda;

/* Device activations for B sequences of T tokens (sp_gpt2_acts' arrays,
 * the attention's backward scratch n_head times larger), a cuBLAS handle
 * on `stream` (a cudaStream_t), on the calling thread's current device.
 * g is borrowed. Errors: SP_EINVAL (B or T 0, T over the context),
 * SP_ETOOBIG (a tensor over 2^31 elements), SP_ENOMEM, SP_ECUDA. */
int sp_gpt2_cuda_new(const sp_gpt2 *g, size_t B, size_t T, void *stream,
                     sp_gpt2_cuda **out, sp_diag *d);
/* The same for a shape with checkpointing or the float32-only layout
 * (gpt2_acts.h); its activations' bytes by category in
 * sp_gpt2_cuda_act_bytes. */
int sp_gpt2_cuda_new_with(const sp_gpt2 *g, const sp_gpt2_shape *sh,
                          void *stream, sp_gpt2_cuda **out, sp_diag *d);
sp_act_bytes sp_gpt2_cuda_act_bytes(const sp_gpt2_cuda *c);
/* Waits for the stream, then frees. NULL is fine. */
void sp_gpt2_cuda_free(sp_gpt2_cuda *c);

/* The host arrays (B*T each) the caller writes a micro-batch's tokens
 * and targets into (sp_gpt2_data_train), then sp_gpt2_cuda_upload copies
 * to the device, after checking every value is below the vocabulary
 * (SP_ERANGE, naming the position); it waits for the copy. */
int32_t *sp_gpt2_cuda_tokens(sp_gpt2_cuda *c);
int32_t *sp_gpt2_cuda_targets(sp_gpt2_cuda *c);
int sp_gpt2_cuda_upload(sp_gpt2_cuda *c, sp_diag *d);

/* gpt2.h's step pieces on the uploaded micro-batch. head_forward waits
 * for the stream to return the loss in *loss. */
int sp_gpt2_cuda_embed_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               sp_diag *d);
int sp_gpt2_cuda_block_forward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                               sp_diag *d);
int sp_gpt2_cuda_head_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d);
int sp_gpt2_cuda_head_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               double denom, sp_diag *d);
int sp_gpt2_cuda_block_backward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                                sp_diag *d);
int sp_gpt2_cuda_embed_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                                sp_diag *d);

/* A device double for a collective of the caller's (the runtime's
 * sp_fsdp_all_reduce takes device memory on a GPU): set writes v into it
 * (stream-ordered), get waits for the stream and reads it. */
double *sp_gpt2_cuda_scalar(sp_gpt2_cuda *c);
int sp_gpt2_cuda_set_scalar(sp_gpt2_cuda *c, double v, sp_diag *d);
int sp_gpt2_cuda_get_scalar(sp_gpt2_cuda *c, double *v, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
