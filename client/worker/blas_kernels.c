/* The OpenBLAS kernels this CPU wants (blas_kernels.h). */
#include "blas_kernels.h"

#include <cblas.h>
#include <stdlib.h>
#include <strings.h>

const char *sp_blas_coretype_wanted(void) {
  const char *core = openblas_get_corename();
  if (getenv("OPENBLAS_CORETYPE") || !core || strcasecmp(core, "prescott"))
    return NULL;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? "SkylakeX"
         : __builtin_cpu_supports("avx2")  ? "Haswell"
         : __builtin_cpu_supports("avx")   ? "Sandybridge"
                                           : NULL;
}
