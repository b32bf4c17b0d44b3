/* A stand-in for the worker's GPU models module (worker_cuda.h), for
 * tests/test_worker_cuda.c: worker_cuda_fake.c defines every function of
 * gpt2_cuda.h and mlp_cuda.h with the headers' prototypes, each recording
 * its name and its arguments in order, so the test can check that each of
 * the loader's forwarders passes what it was given, in place, to its own
 * namesake, with no GPU. Built as a module twice: complete, and (with
 * SP_FAKE_INCOMPLETE) lacking sp_mlp_cuda_write_dy, a module of another
 * build. */
#ifndef SP_WORKER_CUDA_FAKE_H
#define SP_WORKER_CUDA_FAKE_H

#include <stdint.h>

/* The last call: the function's name and its arguments, each as 64 bits
 * (a pointer's address, an integer's value, a double's bits, a bool as 0
 * or 1, an enum's value). */
typedef struct sp_fake_call {
  const char *fn;
  int n;
  uint64_t a[8];
} sp_fake_call;

/* The module's record of the last call; the test finds it by dlsym. */
const sp_fake_call *sp_fake_last(void);
typedef const sp_fake_call *(*sp_fake_last_fn)(void);

/* What the fake's int functions return, and its pointer functions' result
 * for an object c: (char *)c + SP_FAKE_PTR_OFFSET. */
#define SP_FAKE_RC 42
#define SP_FAKE_PTR_OFFSET 8

#endif
