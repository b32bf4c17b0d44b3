/* Text from a trained GPT-2 checkpoint (shardplane-worker --generate): the
 * FULL checkpoint's parameters and buffers in one process, the model of
 * gpt2.h run on the last context's worth of bytes, the next byte sampled
 * at a temperature. No coordinator: the checkpoint is all it needs, with
 * the spec it was trained from. */
#ifndef SP_GPT2_GENERATE_H
#define SP_GPT2_GENERATE_H

#include <stdint.h>
#include <stdio.h>

#include "base/sp_error.h"

/* What --temperature takes, in the words of its errors. */
#define SP_GPT2_TEMPERATURE_RULE "a finite number >= 0 (0: greedy)"

typedef struct sp_gpt2_gen_opts {
  const char *model_path; /* the spec the checkpoint was trained from */
  const char *ckpt_file;  /* a FULL checkpoint's model.safetensors */
  const char *prompt;     /* the bytes to continue; "" or NULL: "\n" */
  uint32_t tokens;        /* bytes to generate */
  double temperature;     /* logits divided by it; 0: greedy (the
                             likeliest byte every time) */
  uint64_t seed;          /* of the sampling */
} sp_gpt2_gen_opts;

/* Writes the prompt and its continuation to out (bytes other than printable
 * ASCII, newline and tab as '?', so a terminal stays sane). Errors name the file:
 * the spec's (SP_EUNSUPPORTED when it is no GPT-2), the checkpoint's
 * (SP_ENOENT for a parameter missing from it, SP_EFORMAT for a shape that
 * is not the spec's), SP_ENOMEM. */
int sp_gpt2_generate(const sp_gpt2_gen_opts *o, FILE *out, sp_diag *d);

#endif
