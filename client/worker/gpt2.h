/* GPT-2-family transformers for shardplane-worker: the spec reader, the
 * initialisation, and the CPU forward and backward, unit by unit, so that
 * the FSDP runtime unshards a block right before it is computed.
 *
 * The spec (examples/models/gpt2-tiny.json, gpt2-mini.json, gpt2.json):
 * Hugging Face GPT2LMHeadModel names and Conv1D layouts ([in, out], y =
 * x W + b): transformer.wte.weight [V, C], transformer.wpe.weight [ctx,
 * C], per block transformer.h.L.{ln_1, attn.c_attn [C, 3C], attn.c_proj
 * [C, C], ln_2, mlp.c_fc [C, 4C], mlp.c_proj [4C, C]} (weights and
 * biases), transformer.ln_f, and lm_head.weight tied to wte (listed under
 * "tied", not as a parameter). Heads: the spec's config "n_head", else
 * C / 64 (every published GPT-2 has heads of 64). Buffers, optional per
 * block: attn.bias [1, 1, ctx, ctx] (the causal mask, any dtype: nonzero
 * is "may attend"; without it the plain causal mask) and attn.masked_bias
 * (unused: masked scores are left out of the softmax, not set to it), and
 * any other buffer, which the model carries but never reads.
 *
 * The network (dropout 0): x = wte[tok] + wpe[pos]; per block
 *   x += c_proj(attention(ln_1(x))); x += mlp.c_proj(gelu(c_fc(ln_2(x))));
 * logits = ln_f(x) wte^T; loss = cross-entropy against the next byte.
 * LayerNorm eps 1e-5 (biased variance); GELU tanh approximation; causal
 * attention scaled by 1/sqrt(C / heads).
 *
 * Numerics: activations and gradients are float32 arrays. Matrix products
 * are cblas_sgemm; every other sum runs in a fixed order (rows in index
 * order), so a run is reproducible on a fixed BLAS thread count. With a
 * 16-bit param_dtype (mixed precision) every block's input, every
 * product's output and every activation gradient is rounded (RNE) to that
 * dtype, as a bfloat16 GEMM with float32 accumulation would give; the
 * LayerNorm statistics, softmax and loss stay float32.
 *
 * Parameters and buffers are reached only through sp_gpt2_io (the
 * runtime's unsharded views, or a plain array in a single process). */
#ifndef SP_GPT2_H
#define SP_GPT2_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "cast/dtype.h"
#include "plan/model.h"
#include "train_memory.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cblas takes int sizes: every tensor and every activation stays below
 * (sp_gpt2_new refuses a spec whose sizes could reach it). */
#define SP_GPT2_MAX_ELEMS (INT64_C(1) << 31)

/* Model indices of one block's tensors (-1: absent buffer). */
typedef struct sp_gpt2_block {
  int32_t module; /* transformer.h.L */
  int32_t ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b;
  int32_t ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
  int32_t mask; /* attn.bias buffer */
} sp_gpt2_block;

typedef struct sp_gpt2 {
  const sp_model *model; /* borrowed */
  int64_t n_layer, C, n_head, ctx, V;
  int32_t wte, wpe, lnf_w, lnf_b; /* model param indices */
  int32_t lm_head_module;         /* -1 when the spec has none */
  sp_gpt2_block *blocks;
} sp_gpt2;

/* Reads the architecture from the spec. SP_EUNSUPPORTED (naming the
 * tensor or field) when it is no GPT-2 of the layout above; then the
 * worker tries the other models. Every shape is checked against C, ctx
 * and V before anything is sized from them. */
int sp_gpt2_new(const sp_model *m, sp_gpt2 **out, sp_diag *d);
void sp_gpt2_free(sp_gpt2 *g);

/* Deterministic initialisation as Hugging Face _init_weights: matrices
 * and embeddings normal(0, 0.02), the residual projections (attn.c_proj,
 * mlp.c_proj weights) normal(0, 0.02 / sqrt(2 n_layer)), biases 0,
 * LayerNorm weights 1. Normals come from a hash of (FQN, element), so
 * every rank writes the same values for any slice. Signatures match
 * sp_fsdp_opts.init_param / init_buffer (user unused; m must be a GPT-2
 * spec, else the MLP rule of sp_mlp_init_param applies). Buffers:
 * attn.bias the lower-triangular causal mask (1 / true on and below the
 * diagonal) in its dtype, attn.masked_bias -1e4, everything else zero. */
void sp_gpt2_init_param(void *user, const sp_model *m, int32_t param,
                        int64_t start, int64_t n, void *dst);
void sp_gpt2_init_buffer(void *user, const sp_model *m, int32_t buffer,
                         void *dst);

/* Where the tensors are; as sp_mlp_io (mlp.h): param views and gradients
 * in the param's unit's param_dtype, buffers in their current dtype. A
 * NULL gradient means the param takes none. */
typedef struct sp_gpt2_io {
  void *(*param)(void *user, int32_t param);
  void *(*grad)(void *user, int32_t param);
  sp_dtype (*param_dtype)(void *user, int32_t param);
  void *(*buffer)(void *user, int32_t buffer);
  sp_dtype (*buffer_dtype)(void *user, int32_t buffer);
  void *user;
} sp_gpt2_io;

/* The activations of B sequences of T tokens (T <= ctx), kept from
 * forward for backward, and the backward's scratch (their layout:
 * gpt2_acts.h). Owned by the caller. T may be lowered afterwards
 * (generation's shorter windows): the arrays stay large enough. */
typedef struct sp_gpt2_acts {
  size_t B, T;
  /* Only the blocks' inputs are kept; the per-layer arrays below but res
   * are one set every layer shares, which block_backward refills by
   * running the block's forward again (same kernels, same inputs: the
   * same values, so the gradients equal those without checkpointing). */
  bool checkpointing;
  /* Laid out for float32 views only (no float32 copies of params or their
   * gradients): a piece given another view fails instead of overflowing
   * the scratch. */
  bool f32_views;
  /* per layer l: res[l] the block's input (res[n_layer] the last output) */
  float **res;
  float **ln1, **ln1_mean, **ln1_rstd, **qkv, **att, **atty, **res2;
  float **ln2, **ln2_mean, **ln2_rstd, **fch, **fch_gelu;
  float *lnf, *lnf_mean, *lnf_rstd;
  float *probs;       /* B*T x V: softmax of the logits, then dlogits */
  int32_t *tok, *tgt; /* B*T each: the caller writes them */
  /* scratch: residual gradient, a B*T x 4C activation (gradient), dqkv,
   * the attention's T x T gradient and mask, params as float32 and their
   * gradients (the largest param; LayerNorm's and biases' apart; wpe's
   * copy of its own, read beside wte's), the lookup's rows of wte */
  float *dres, *dbuf, *dbig, *dqkv, *datt;
  uint8_t *allow;
  float *w, *gw, *wpe, *lnw, *lnb, *gb, *gb2;
  int32_t *wte_row; /* V: a token's row in the lookup's gradient rows */
  /* the loss's sums in the table's memory (sp_gpt2_layout.device_loss) */
  double *rows, *total, *scalar;
  sp_act_bytes mem; /* all of the above by category, as allocated */
} sp_gpt2_acts;

/* 0, SP_EINVAL (T 0 or over ctx, B 0), SP_ETOOBIG (sizes overflow or over
 * 2^31 elements a tensor: cblas takes int), SP_ENOMEM. Laid out for any
 * param dtype, without checkpointing. */
int sp_gpt2_acts_new(const sp_gpt2 *g, size_t B, size_t T, sp_gpt2_acts **out);
/* The same with checkpointing and the float32-only layout as asked (a
 * trainer's), d filled on failure. */
int sp_gpt2_acts_new_with(const sp_gpt2 *g, size_t B, size_t T,
                          bool checkpointing, bool f32_views,
                          sp_gpt2_acts **out, sp_diag *d);
void sp_gpt2_acts_free(sp_gpt2_acts *a);

/* One step's pieces, in this order (the worker puts the runtime's
 * schedule around them: the root unit holds wte, wpe and ln_f):
 *   embed_forward           tokens a->tok (B*T, values < V) -> res[0]
 *   block_forward(l)        for l = 0 .. n_layer-1
 *   head_forward            ln_f, logits, softmax; returns the loss
 *   head_backward           gradients of ln_f and the head's share of wte
 *   block_backward(l)       for l = n_layer-1 .. 0
 *   embed_backward          wpe and the lookup's share of wte
 * Gradients are ADDED to the views (as autograd accumulates into .grad;
 * sum in double, rounded once to the view's dtype), so wte's two shares
 * add up, and micro-batches too when the caller keeps the views.
 *
 * head_forward: the mean over the B*T tokens of -log softmax(logits)[tgt]
 * times B*T / denom (denom: the number of tokens the loss is averaged
 * over, e.g. B*T times the micro-batches of a step), returned in *loss
 * (the sum in double); head_backward then starts from d loss = 1, i.e.
 * dlogits = (softmax - onehot) / denom. denom >= 1.
 * Errors: SP_EINVAL (a view missing: its unit is not unsharded, or a
 * param dtype not floating), SP_ERANGE (l, a token >= V), SP_ENOMEM. */
int sp_gpt2_embed_forward(const sp_gpt2 *g, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, sp_diag *d);
int sp_gpt2_block_forward(const sp_gpt2 *g, size_t l, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, sp_diag *d);
int sp_gpt2_head_forward(const sp_gpt2 *g, const sp_gpt2_io *io,
                         sp_gpt2_acts *a, double denom, double *loss,
                         sp_diag *d);
int sp_gpt2_head_backward(const sp_gpt2 *g, const sp_gpt2_io *io,
                          sp_gpt2_acts *a, double denom, sp_diag *d);
int sp_gpt2_block_backward(const sp_gpt2 *g, size_t l, const sp_gpt2_io *io,
                           sp_gpt2_acts *a, sp_diag *d);
int sp_gpt2_embed_backward(const sp_gpt2 *g, const sp_gpt2_io *io,
                           sp_gpt2_acts *a, sp_diag *d);

/* The logits of the last position of sequence b (V floats) after
 * head_forward, as log-probabilities; for generation. */
void sp_gpt2_last_logprobs(const sp_gpt2 *g, const sp_gpt2_acts *a, size_t b,
                           float *out);

#ifdef __cplusplus
}
#endif
#endif
