/* sp_cuda_device_count in a build without CUDA (cast_cuda.h): no device is
 * usable, which is an answer rather than an error, so a program can ask in
 * any build and report "no CUDA device" the same way. */
#include "cast_cuda.h"

int sp_cuda_device_count(int *n) {
  if (n == NULL) return SP_EINVAL;
  *n = 0;
  return 0;
}
