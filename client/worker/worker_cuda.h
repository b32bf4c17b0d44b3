/* The worker's GPU models as a module loaded on demand: in a CUDA build,
 * shardplane-worker holds no cuBLAS. The real gpt2_cuda.h and mlp_cuda.h
 * (gpt2_cuda.c, gpt2_gpu.cu, mlp_cuda.cu, cublas_check.cu) are built into
 * libshardplane-worker-cuda.so, and the worker links worker_cuda.c, which
 * defines every function of those two headers by forwarding to the
 * module's function of the same name, dlopen'ed and resolved (dlsym) the
 * first time any is called, or by sp_worker_cuda_load when the worker is
 * asked for --device cuda:N. Loading cuBLAS costs a process some 150 MiB
 * resident before it computes anything (libcublasLt's text and the .bss
 * its static initialisers touch; 210 MiB as the process exits), 10 times
 * a gpt2-tiny worker's own peak, so a rank on the CPU must not pay it.
 *
 * The module is found at $SHARDPLANE_WORKER_CUDA_MODULE when that is set
 * (a path to the file), else in the folder the build and the install give
 * it relative to the worker's own (SP_WORKER_CUDA_REL, from CMake: the
 * build's lib/shardplane/ beside its bin/, an install's
 * <libdir>/shardplane/ beside <bindir>).
 *
 * Only in a CUDA build; without CUDA gpt2_cuda_stub.c and mlp_cuda_stub.c
 * answer SP_EUNSUPPORTED instead and nothing is loaded. */
#ifndef SP_WORKER_CUDA_H
#define SP_WORKER_CUDA_H

#include <stddef.h>

#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The environment variable that names the module's file. */
#define SP_WORKER_CUDA_ENV "SHARDPLANE_WORKER_CUDA_MODULE"
/* The module's file name. */
#define SP_WORKER_CUDA_FILE "libshardplane-worker-cuda.so"

/* Loads the module and resolves every function the forwarding uses, once;
 * later calls return 0 at once. Thread-safe. A failure loads nothing, so a
 * later call tries again: SP_EUNSUPPORTED naming the file and dlerror()'s
 * text when the module cannot be opened (missing, or a library it needs
 * is), SP_EIO naming the file, the symbol and dlerror()'s text when a
 * function is missing from it (a module of another build). */
int sp_worker_cuda_load(sp_diag *d);

/* Where sp_worker_cuda_load looks, as it would now (the environment
 * variable, else beside this executable), into out (cap bytes). Errors:
 * SP_EIO (this executable's path unreadable), SP_ETOOBIG (over cap). */
int sp_worker_cuda_module_path(char *out, size_t cap, sp_diag *d);

/* The names the forwarding resolves in the module, i < the count; NULL
 * past the end. For the test that every one resolves in the built module
 * (tests/test_worker_cuda.c). */
size_t sp_worker_cuda_symbol_count(void);
const char *sp_worker_cuda_symbol(size_t i);

#ifdef __cplusplus
}
#endif
#endif
