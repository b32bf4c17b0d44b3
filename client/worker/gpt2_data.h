/* The byte-level data of the GPT-2 models: any file read as bytes (the
 * vocabulary is the 256 byte values), split into a training part and a
 * held-out part, and the rule that says which window each sample reads.
 * docs/gpt2.md states the rule so another implementation can follow it.
 *
 * Split: the last n / 10 bytes (rounded down) are held out for the
 * validation loss; the first n - n / 10 are for training.
 * Training sample i of step s (0-based; i counts over the global batch,
 * micro-batch j's samples being [j*m, (j+1)*m), a rank r of W taking
 * [j*m + r*m/W, j*m + (r+1)*m/W)) reads the window starting at
 *   start = sp_gpt2_window(s, i) % (n_train - T)
 * (a hash, below): tokens bytes[start .. start+T), targets bytes[start+1 ..
 * start+T+1). Validation window v: start n_train + v*T, for v in
 * [0, (n_val - 1) / T). */
#ifndef SP_GPT2_DATA_H
#define SP_GPT2_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"

/* Largest file read: the whole corpus is held in memory. */
#define SP_GPT2_DATA_MAX_BYTES (1u << 30)
/* The default corpus: the regular files (not symlinks) of this folder,
 * sorted by name (strcmp) and concatenated; the licence texts every
 * Debian system carries. */
#define SP_GPT2_DEFAULT_CORPUS "/usr/share/common-licenses"

typedef struct sp_gpt2_data {
  uint8_t *bytes;
  size_t n, n_train, n_val;
  char source[512]; /* what was read, for messages */
} sp_gpt2_data;

/* Reads `path` (NULL: the default corpus) for windows of T tokens: the
 * training part must hold T + 1 bytes and the held-out part too.
 * Errors name the file and the flag (--data): SP_EIO, SP_ENOENT (no
 * default corpus: give --data), SP_ETOOBIG, SP_EINVAL (too short),
 * SP_ENOMEM. */
int sp_gpt2_data_open(const char *path, size_t T, sp_gpt2_data **out,
                      sp_diag *d);
void sp_gpt2_data_free(sp_gpt2_data *data);

/* The hash of the training windows: splitmix64's finaliser of
 * (splitmix64's finaliser of (s XOR 0x53504750543200) XOR i). */
uint64_t sp_gpt2_window(uint64_t step, uint64_t sample);

/* n training samples [first, first + n) of step `step` into tok and tgt
 * (n x T each). */
void sp_gpt2_data_train(const sp_gpt2_data *data, uint64_t step, uint64_t first,
                        size_t n, size_t T, int32_t *tok, int32_t *tgt);
/* How many validation windows of T there are, and window v. */
size_t sp_gpt2_data_val_count(const sp_gpt2_data *data, size_t T);
void sp_gpt2_data_val(const sp_gpt2_data *data, uint64_t v, size_t T,
                      int32_t *tok, int32_t *tgt);

#endif
