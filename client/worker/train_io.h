/* The FSDP runtime's views as a model's io (sp_mlp_io, sp_gpt2_io): the
 * unsharded parameter and buffer views of the unit being computed, their
 * gradients and dtypes, user being the sp_fsdp. The trainers hand these
 * to their models, which reach parameters and buffers only through them. */
#ifndef SP_TRAIN_IO_H
#define SP_TRAIN_IO_H

#include <stdint.h>

#include "cast/dtype.h"

void *sp_train_io_param(void *fsdp, int32_t param);
void *sp_train_io_grad(void *fsdp, int32_t param);
sp_dtype sp_train_io_param_dtype(void *fsdp, int32_t param);
void *sp_train_io_buffer(void *fsdp, int32_t buffer);
sp_dtype sp_train_io_buffer_dtype(void *fsdp, int32_t buffer);

#endif
