/* The launch geometry's old place, for GPT-2's kernels
 * (client/worker/gpt2_layers_cuda.cu), which still include it: to be
 * removed once GPT-2 is converted to common/cuda/. */
#include "cuda/cuda_launch.h"
