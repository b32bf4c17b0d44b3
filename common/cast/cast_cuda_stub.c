/* sp_cuda_device_count in a build without CUDA (cast_cuda.h): no device is
 * usable, which is an answer rather than an error, so a program can ask in
 * any build and report "no CUDA device" the same way. */
#include "cast_cuda.h"

int sp_cuda_device_count(int *n) {
  if (n == NULL) return SP_EINVAL;
  *n = 0;
  return 0;
}

int sp_cuda_device_memory(int device, uint64_t *free_b, uint64_t *total_b,
                          sp_diag *d) {
  (void)device;
  if (free_b) *free_b = 0;
  if (total_b) *total_b = 0;
  return sp_diag_set(d, SP_EUNSUPPORTED, "this build has no CUDA");
}
