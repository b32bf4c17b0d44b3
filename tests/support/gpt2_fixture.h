/* GPT-2 runs compared with a reference run (PyTorch's, or the CPU's for a
 * GPU run): the corpus they train on and the errors of a run's loss curve
 * and FULL checkpoint. Functions fail the cmocka test on error. */
#ifndef SP_GPT2_FIXTURE_H
#define SP_GPT2_FIXTURE_H

#include <stddef.h>

#include "plan/model.h"
#include "safetensors/safetensors.h"

/* 64 KiB of words and spaces (a fixed seed): the same text for every run,
 * independent of the system's default corpus. */
void sp_tgpt2_write_corpus(const char *path);

/* The sum of a warmup-cosine schedule's learning rates over `steps` (peak
 * lr, `warmup` linear steps, cosine to min_lr, as train_flags.h): Adam
 * moves an element by at most about lr a step, so two runs' elements can
 * be no farther apart than twice this. */
double sp_tgpt2_lr_sum(int steps, double lr, int warmup, double min_lr);

/* A run's errors against the reference. The key part of each
 * attn.c_attn.bias (elements [C, 2C)) has an exactly zero gradient (a
 * constant added to every key leaves the softmax alone), so both runs
 * move it by rounding noise only, which Adam scales up to lr a step: it is
 * reported apart (key_bias) and left out of the others. */
typedef struct sp_tgpt2_errors {
  double loss;       /* max over steps of |loss - ref| / |ref| */
  size_t loss_at;    /* that step, 0-based */
  double first;      /* the first step's */
  double params;     /* max over tensors of max |a - b| / max |b| */
  const char *worst; /* that tensor's FQN (m's) */
  double abs;        /* max |a - b| */
  double rms;        /* ||a - b|| / ||b|| over every element */
  double key_bias;   /* max |a - b| over the key biases */
} sp_tgpt2_errors;

/* loss[steps] and the float32 FULL checkpoint a against ref[steps] and b,
 * every parameter of m. */
void sp_tgpt2_compare(const sp_model *m, const double *loss, const double *ref,
                      size_t steps, const sp_safetensors_file *a,
                      const sp_safetensors_file *b, sp_tgpt2_errors *e);

#endif
