/* The reference MLP (mlp.h) on a GPU: the same forward, loss and backward,
 * with every layer's tensors in device memory, Linear layers on cuBLAS and
 * the rest in small kernels, so that shardplane-worker --device cuda:N
 * trains the same model as on the CPU.
 *
 * Semantics are mlp.h's, step for step:
 *   - activations and gradients are float32 device arrays holding values
 *     rounded (RNE, cast_scalar.h) to the layer's compute dtype, the
 *     unit's param_dtype; a Linear or RunningNorm first rounds its input in
 *     place to it;
 *   - Linear: cublasGemmEx with inputs in the param dtype (CUDA_R_16BF,
 *     CUDA_R_16F or CUDA_R_32F; a float64 param computes in float32, as the
 *     CPU reads it), CUBLAS_COMPUTE_32F (never TF32), float32 output; the
 *     bias is added in float32 and the sum rounded once to the param dtype.
 *     Backward: dW = dy^T x and dx = dy W by GEMM, db by an ordered column
 *     sum. An operand whose values the param dtype cannot hold exactly (a
 *     gradient rounded to another 16-bit dtype) makes that GEMM run in
 *     float32, so no rounding is added that the CPU does not do;
 *   - RunningNorm: column sums of the batch in sample order, summed over
 *     ranks by io->all_reduce_sum (a device buffer), running_mean updated
 *     in float32 and stored in the buffer's dtype, num_batches_tracked and
 *     seen updated, y = (x - running_mean) * weight + bias rounded;
 *   - ReLU as torch.relu (NaN passes); loss 0.5 * mean over the batch of
 *     sum_j (y_j - t_j)^2 in double, dy = (y - t) / n rounded to the
 *     output dtype.
 * Elementwise kernels and column sums use the explicitly rounded float
 * intrinsics in the CPU's order, so they give the CPU's bits on the same
 * inputs; only GEMM results (summation order inside cuBLAS) and the loss's
 * double sum (grouped by sample) may differ in the last bits. A run is
 * therefore compared with the CPU reference within a bound, not bit for
 * bit (tests/test_gpu_parity.c).
 *
 * The io callbacks are mlp.h's, returning device pointers (the FSDP
 * runtime's views on a GPU); all_reduce_sum receives a device buffer.
 * Everything is enqueued on the stream given at creation, which must be
 * the stream that orders the views (sp_fsdp_cuda_stream). Functions return
 * 0 or a negative SP_E* code with d filled (CUDA and cuBLAS failures as
 * SP_ECUDA naming file, line and call). In a build without CUDA every
 * function fails with SP_EUNSUPPORTED.
 */
#ifndef SP_MLP_CUDA_H
#define SP_MLP_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mlp.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sp_mlp_cuda sp_mlp_cuda;

/* Device activations and scratch for a local batch of n samples, a cuBLAS
 * handle bound to `stream` (a cudaStream_t; NULL: the legacy default
 * stream), all allocated here once. The calling thread's current device is
 * used. Errors: SP_EINVAL, SP_ETOOBIG (sizes beyond cuBLAS's int or
 * size_t), SP_ENOMEM (device memory), SP_ECUDA. */
int sp_mlp_cuda_new(const sp_mlp *mlp, size_t n, void *stream,
                    sp_mlp_cuda **out, sp_diag *d);
/* Waits for the stream, then frees. NULL is fine. */
void sp_mlp_cuda_free(sp_mlp_cuda *g);

/* Uploads the local batch: x (n x in_dim) and t (n x out_dim), host
 * float32 (sp_mlp_batch's output); either may be NULL to keep the old. */
int sp_mlp_cuda_set_batch(sp_mlp_cuda *g, const float *x, const float *t,
                          sp_diag *d);

/* sp_mlp_forward / sp_mlp_loss / sp_mlp_backward / sp_mlp_count_step on
 * the device. forward reads x[l], writes x[l+1], updates the layer's
 * buffers; RunningNorm calls io->all_reduce_sum (also for n = 0) after
 * its column sums were enqueued. loss writes dy and the local batch's mean
 * loss into a device double (sp_mlp_cuda_loss_ptr). backward reads dy,
 * adds the param gradients to io->grad's views (NULL: none; the sum
 * rounded once to the view's dtype, as mlp.c) and, for l > 0, writes the
 * input gradient as the new dy. */
int sp_mlp_cuda_forward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                        uint64_t global_n, sp_diag *d);
int sp_mlp_cuda_loss(sp_mlp_cuda *g, sp_dtype out_dtype, sp_diag *d);
/* sp_mlp_loss_over: dy = (y - t) / denom, and the loss sum / denom set
 * into the device double (add false) or added to it (true: the
 * micro-batches of one step summing their scaled losses). */
int sp_mlp_cuda_loss_over(sp_mlp_cuda *g, sp_dtype out_dtype, uint64_t denom,
                          bool add, sp_diag *d);
int sp_mlp_cuda_backward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                         sp_diag *d);
int sp_mlp_cuda_count_step(sp_mlp_cuda *g, const sp_mlp_io *io, sp_diag *d);

/* The device double sp_mlp_cuda_loss writes (e.g. for an all-reduce of
 * the loss over ranks), and a synchronous read of it. */
double *sp_mlp_cuda_loss_ptr(sp_mlp_cuda *g);
int sp_mlp_cuda_read_loss(sp_mlp_cuda *g, double *loss, sp_diag *d);

/* Synchronous reads for tests: x[l] (n x features of layer l's input;
 * l == n_layers is the output), and the current dy (count floats). */
int sp_mlp_cuda_read_act(sp_mlp_cuda *g, size_t l, float *host, sp_diag *d);
int sp_mlp_cuda_read_dy(sp_mlp_cuda *g, float *host, size_t count, sp_diag *d);
/* Synchronous writes for tests, so one layer can be checked on the CPU's
 * exact inputs: x[l], and dy (count floats whose values are rounded to
 * dt, as the layer after it left them). */
int sp_mlp_cuda_write_act(sp_mlp_cuda *g, size_t l, const float *host,
                          sp_diag *d);
int sp_mlp_cuda_write_dy(sp_mlp_cuda *g, const float *host, size_t count,
                         sp_dtype dt, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
