/* Debian's OpenBLAS picks its kernels from the CPU's cpuid family and
 * model; a virtual CPU that hides them falls back to the Prescott (SSE3)
 * kernels, whatever AVX it has: on a 2-core VM reporting "Intel Xeon
 * Processor" gpt2-mini's step took 6.5 s instead of 2.7 s with the
 * SkylakeX kernels. The library reads OPENBLAS_CORETYPE once, as it is
 * loaded, so a process that wants better ones sets it and runs again
 * (shardplane-worker), or sets it for the processes it starts
 * (bench/train, for both of its peers). */
#ifndef SP_BLAS_KERNELS_H
#define SP_BLAS_KERNELS_H

/* The OPENBLAS_CORETYPE this CPU wants, or NULL when nothing is to be
 * done: the variable is set already (the user's choice), the detection
 * was not the fallback, or the CPU has no AVX. */
const char *sp_blas_coretype_wanted(void);

#endif
