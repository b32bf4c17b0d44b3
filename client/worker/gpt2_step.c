/* The GPT-2 step driver (gpt2_step.h): the forward and backward of gpt2.h
 * over the kernel table of the CPU or a GPU (the activations' layout:
 * gpt2_acts.c). */
#include "gpt2_step.h"

#include <stdint.h>
#include <stdlib.h>

/* every table call below: return on failure */
#define K(call)               \
  do {                        \
    int rc_ = (call);         \
    if (rc_ != 0) return rc_; \
  } while (0)

/* ------------------------------------------------------------------ */
/* views                                                               */
/* ------------------------------------------------------------------ */

static const char *fqn_of(const sp_gpt2 *g, int32_t p) {
  return g->model->params[p].fqn;
}

/* A view the float32-only layout has no scratch for. */
static int f32_only(const sp_gpt2_step *s, int32_t p, sp_dtype pd, sp_diag *d) {
  return sp_diag_set(d, SP_EINVAL,
                     "%s: a %s view or gradient where the activations were "
                     "laid out for float32 ones only",
                     fqn_of(s->g, p), sp_dtype_name(pd));
}

/* A param's view as float32: the view itself when it is float32 and
 * aligned for floats (the runtime's flat parameters are), else a float32
 * copy in scratch (none in a float32-only layout: an error); *dt its
 * dtype (dt may be NULL). Read in place, a block product's weight costs
 * no pass over it (a copy per product was two passes over every weight a
 * step). */
static int view(const sp_gpt2_step *s, const sp_gpt2_io *io, int32_t p,
                float *scratch, const float **out, sp_dtype *dt, sp_diag *d) {
  const sp_tensor_spec *t = &s->g->model->params[p];
  sp_dtype pd = io->param_dtype(io->user, p);
  if (!sp_dtype_is_floating(pd))
    return sp_diag_set(d, SP_EINVAL, "%s: param dtype %s is not floating",
                       t->fqn, sp_dtype_name(pd));
  const void *v = io->param(io->user, p);
  if (v == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no parameter view (unit sharded?)",
                       t->fqn);
  if (dt) *dt = pd;
  if (pd == SP_FLOAT32 && (uintptr_t)v % _Alignof(float) == 0) {
    *out = v;
    return 0;
  }
  if (s->a->f32_views) return f32_only(s, p, pd, d);
  *out = scratch;
  return s->ops->to_f32(s->k, scratch, v, pd, (size_t)t->numel, t->fqn, d);
}

/* The gradient view as float32 to add to in place (aligned, float32), or
 * NULL: then the gradient goes through a scratch and add_grad. */
static float *grad_f32(const sp_gpt2_io *io, int32_t p) {
  void *v = io->grad ? io->grad(io->user, p) : NULL;
  return v && io->param_dtype(io->user, p) == SP_FLOAT32 &&
                 (uintptr_t)v % _Alignof(float) == 0
             ? v
             : NULL;
}

/* Where p's gradient is computed: its float32 view, summed into in place
 * (*acc 1), or the scratch a->gw, written (*acc 0) and added by
 * add_grad; NULL when p takes no gradient. A float32-only layout has no
 * scratch for a param of another dtype (or none for wte): an error, not
 * an overflow. */
static int grad_dst(const sp_gpt2_step *s, const sp_gpt2_io *io, int32_t p,
                    float **out, int *acc, sp_diag *d) {
  float *v = grad_f32(io, p);
  *out = v;
  *acc = v != NULL;
  if (v != NULL || io->grad == NULL || io->grad(io->user, p) == NULL) return 0;
  if (s->a->f32_views) return f32_only(s, p, io->param_dtype(io->user, p), d);
  *out = s->a->gw;
  return 0;
}

/* grad view += gr, the sum in double rounded once to the view's dtype;
 * nothing when the param takes no gradient. */
static int add_grad(const sp_gpt2_step *s, const sp_gpt2_io *io, int32_t p,
                    const float *gr, sp_diag *d) {
  void *dst = io->grad ? io->grad(io->user, p) : NULL;
  if (dst == NULL) return 0;
  sp_dtype pd = io->param_dtype(io->user, p);
  int rc = s->ops->grad_add(s->k, dst, pd, gr,
                            (size_t)s->g->model->params[p].numel, d);
  return rc ? sp_diag_prefix(d, rc, "%s", fqn_of(s->g, p)) : 0;
}

/* The block's mask from its attn.bias buffer (its last T x T corner's top
 * left, as HF slices bias[:, :, :T, :T]); false when it has none. */
static int block_mask(const sp_gpt2_step *s, const sp_gpt2_block *b,
                      const sp_gpt2_io *io, bool *have, sp_diag *d) {
  const sp_gpt2 *g = s->g;
  *have = false;
  if (b->mask < 0 || io->buffer == NULL) return 0;
  const void *v = io->buffer(io->user, b->mask);
  if (v == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no buffer storage",
                       g->model->buffers[b->mask].fqn);
  sp_dtype dt = io->buffer_dtype ? io->buffer_dtype(io->user, b->mask)
                                 : g->model->buffers[b->mask].dtype;
  K(s->ops->mask(s->k, s->a->allow, v, dt, (int)s->a->T, (int)g->ctx, d));
  *have = true;
  return 0;
}

static int check_block(const sp_gpt2_step *s, size_t l, sp_diag *d) {
  if (l >= (size_t)s->g->n_layer)
    return sp_diag_set(d, SP_ERANGE, "%s: block %zu of %lld",
                       s->ops->layout->name, l, (long long)s->g->n_layer);
  return 0;
}

int sp_gpt2_step_check_denom(double denom, sp_diag *d) {
  if (!(denom >= 1.0))
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2: loss denominator %g", denom);
  return 0;
}

/* ------------------------------------------------------------------ */
/* forward                                                             */
/* ------------------------------------------------------------------ */

int sp_gpt2_step_embed_forward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                               sp_diag *d) {
  const sp_gpt2 *g = s->g;
  sp_gpt2_acts *a = s->a;
  int C = (int)g->C, T = (int)a->T, N = (int)(a->B * a->T);
  sp_dtype pd = SP_FLOAT32;
  const float *wte = NULL, *wpe = NULL; /* -O3 cannot see view() set them */
  K(view(s, io, g->wte, a->w, &wte, &pd, d));
  K(view(s, io, g->wpe, a->wpe, &wpe, NULL, d));
  K(s->ops->embed_fwd(s->k, a->res[0], a->tok, wte, wpe, N, T, C, d));
  K(s->ops->round(s->k, a->res[0], (size_t)N * (size_t)C, pd, d));
  return 0;
}

int sp_gpt2_step_block_forward(const sp_gpt2_step *s, size_t l,
                               const sp_gpt2_io *io, sp_diag *d) {
  K(check_block(s, l, d));
  const sp_gpt2 *g = s->g;
  const sp_gpt2_ops *o = s->ops;
  sp_gpt2_dev *k = s->k;
  sp_gpt2_acts *a = s->a;
  const sp_gpt2_block *b = &g->blocks[l];
  int N = (int)(a->B * a->T), C = (int)g->C, NH = (int)g->n_head;
  size_t NC = (size_t)N * (size_t)C;
  sp_dtype pd = SP_FLOAT32;
  bool have_mask = false;
  K(block_mask(s, b, io, &have_mask, d));
  float *x = a->res[l], *tmp = a->dbuf;
  const float *w = NULL, *bias = NULL, *lw = NULL, *lb = NULL;
  /* the unit's input cast (FSDP casts a unit's inputs to param_dtype) */
  K(view(s, io, b->ln1_w, a->lnw, &lw, &pd, d));
  K(view(s, io, b->ln1_b, a->lnb, &lb, NULL, d));
  K(o->round(k, x, NC, pd, d));
  K(o->layernorm_fwd(k, a->ln1[l], a->ln1_mean[l], a->ln1_rstd[l], x, lw, lb, N,
                     C, d));
  K(o->round(k, a->ln1[l], NC, pd, d));
  /* attention */
  K(view(s, io, b->attn_w, a->w, &w, NULL, d));
  K(view(s, io, b->attn_b, a->gb, &bias, NULL, d));
  K(o->matmul_fwd(k, a->qkv[l], a->ln1[l], w, bias, N, C, 3 * C, d));
  K(o->round(k, a->qkv[l], 3 * NC, pd, d));
  K(o->attention_fwd(k, a->atty[l], a->att[l], a->qkv[l],
                     have_mask ? a->allow : NULL, (int)a->B, (int)a->T, C, NH,
                     d));
  K(o->round(k, a->atty[l], NC, pd, d));
  K(view(s, io, b->proj_w, a->w, &w, NULL, d));
  K(view(s, io, b->proj_b, a->gb, &bias, NULL, d));
  K(o->matmul_fwd(k, tmp, a->atty[l], w, bias, N, C, C, d));
  K(o->round(k, tmp, NC, pd, d));
  K(o->add(k, a->res2[l], x, tmp, NC, d));
  K(o->round(k, a->res2[l], NC, pd, d));
  /* MLP */
  K(view(s, io, b->ln2_w, a->lnw, &lw, NULL, d));
  K(view(s, io, b->ln2_b, a->lnb, &lb, NULL, d));
  K(o->layernorm_fwd(k, a->ln2[l], a->ln2_mean[l], a->ln2_rstd[l], a->res2[l],
                     lw, lb, N, C, d));
  K(o->round(k, a->ln2[l], NC, pd, d));
  K(view(s, io, b->fc_w, a->w, &w, NULL, d));
  K(view(s, io, b->fc_b, a->gb, &bias, NULL, d));
  K(o->matmul_fwd(k, a->fch[l], a->ln2[l], w, bias, N, C, 4 * C, d));
  K(o->round(k, a->fch[l], 4 * NC, pd, d));
  K(o->gelu_fwd(k, a->fch_gelu[l], a->fch[l], 4 * NC, d));
  K(o->round(k, a->fch_gelu[l], 4 * NC, pd, d));
  K(view(s, io, b->fcproj_w, a->w, &w, NULL, d));
  K(view(s, io, b->fcproj_b, a->gb, &bias, NULL, d));
  K(o->matmul_fwd(k, tmp, a->fch_gelu[l], w, bias, N, 4 * C, C, d));
  K(o->round(k, tmp, NC, pd, d));
  float *y = a->res[l + 1];
  K(o->add(k, y, a->res2[l], tmp, NC, d));
  K(o->round(k, y, NC, pd, d));
  return 0;
}

int sp_gpt2_step_head_forward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d) {
  const sp_gpt2 *g = s->g;
  const sp_gpt2_ops *o = s->ops;
  sp_gpt2_dev *k = s->k;
  sp_gpt2_acts *a = s->a;
  int N = (int)(a->B * a->T), C = (int)g->C, V = (int)g->V;
  sp_dtype pd = SP_FLOAT32;
  const float *lw = NULL, *lb = NULL, *wte = NULL;
  K(view(s, io, g->lnf_w, a->lnw, &lw, &pd, d));
  K(view(s, io, g->lnf_b, a->lnb, &lb, NULL, d));
  K(view(s, io, g->wte, a->w, &wte, NULL, d));
  float *x = a->res[g->n_layer];
  size_t NC = (size_t)N * (size_t)C;
  K(o->round(k, x, NC, pd, d));
  K(o->layernorm_fwd(k, a->lnf, a->lnf_mean, a->lnf_rstd, x, lw, lb, N, C, d));
  K(o->round(k, a->lnf, NC, pd, d));
  K(o->logits_fwd(k, a->probs, a->lnf, wte, N, C, V, d));
  K(o->round(k, a->probs, (size_t)N * (size_t)V, pd, d));
  double sum = 0;
  K(o->softmax_xent_fwd(k, a->probs, a->tgt, N, V, a->rows, a->total, &sum, d));
  if (loss) *loss = sum / denom;
  return 0;
}

/* ------------------------------------------------------------------ */
/* backward                                                            */
/* ------------------------------------------------------------------ */

int sp_gpt2_step_head_backward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                               double denom, sp_diag *d) {
  const sp_gpt2 *g = s->g;
  const sp_gpt2_ops *o = s->ops;
  sp_gpt2_dev *k = s->k;
  sp_gpt2_acts *a = s->a;
  int N = (int)(a->B * a->T), C = (int)g->C, V = (int)g->V;
  sp_dtype pd = SP_FLOAT32;
  const float *wte = NULL, *lw = NULL;
  K(view(s, io, g->wte, a->w, &wte, &pd, d));
  K(view(s, io, g->lnf_w, a->lnw, &lw, NULL, d));
  size_t NC = (size_t)N * (size_t)C;
  K(o->softmax_xent_bwd(k, a->probs, a->tgt, N, V, (float)(1.0 / denom), d));
  K(o->round(k, a->probs, (size_t)N * (size_t)V, pd, d));
  /* dlnf = dlogits wte; dwte = dlogits^T lnf, into the view when it is
   * float32 (no V x C scratch; the first micro-batch's view is zero, so
   * the sums are those of the scratch) */
  float *dwte = NULL;
  int acc = 0;
  K(grad_dst(s, io, g->wte, &dwte, &acc, d));
  K(o->logits_bwd(k, a->dbuf, dwte, a->probs, a->lnf, wte, N, C, V, acc, d));
  K(o->round(k, a->dbuf, NC, pd, d));
  if (!acc) K(add_grad(s, io, g->wte, a->gw, d));
  K(o->zero(k, a->dres, NC * sizeof *a->dres, d));
  K(o->layernorm_bwd(k, a->dres, a->gb, a->gb2, a->dbuf, a->res[g->n_layer], lw,
                     a->lnf_mean, a->lnf_rstd, N, C, d));
  K(o->round(k, a->dres, NC, pd, d));
  K(add_grad(s, io, g->lnf_w, a->gb, d));
  return add_grad(s, io, g->lnf_b, a->gb2, d);
}

/* A Conv1D's backward: dinp (may be NULL) = dout W^T, and W's and b's
 * gradients added to their views. */
static int conv_bwd(const sp_gpt2_step *s, const sp_gpt2_io *io, int32_t w,
                    int32_t b, float *dinp, const float *dout, const float *inp,
                    int N, int IC, int OC, sp_diag *d) {
  sp_gpt2_acts *a = s->a;
  const float *wv = NULL; /* -O3 cannot see view() set it */
  K(view(s, io, w, a->w, &wv, NULL, d));
  /* float32 views take the products' sums in place (the products add to
   * them); others through the scratch, rounded once by add_grad */
  float *gw = grad_f32(io, w), *gbv = grad_f32(io, b);
  if (gw && gbv)
    return s->ops->matmul_bwd(s->k, dinp, gw, gbv, dout, inp, wv, N, IC, OC, 1,
                              d);
  if (s->a->f32_views)
    return f32_only(s, gw ? b : w, io->param_dtype(io->user, gw ? b : w), d);
  K(s->ops->matmul_bwd(s->k, dinp, a->gw, a->gb, dout, inp, wv, N, IC, OC, 0,
                       d));
  K(add_grad(s, io, w, a->gw, d));
  return add_grad(s, io, b, a->gb, d);
}

static int ln_bwd(const sp_gpt2_step *s, const sp_gpt2_io *io, int32_t w,
                  int32_t b, float *dinp, const float *dout, const float *inp,
                  const float *mean, const float *rstd, int N, int C,
                  sp_diag *d) {
  sp_gpt2_acts *a = s->a;
  const float *lw = NULL; /* -O3 cannot see view() set it */
  K(view(s, io, w, a->lnw, &lw, NULL, d));
  K(s->ops->layernorm_bwd(s->k, dinp, a->gb, a->gb2, dout, inp, lw, mean, rstd,
                          N, C, d));
  K(add_grad(s, io, w, a->gb, d));
  return add_grad(s, io, b, a->gb2, d);
}

int sp_gpt2_step_block_backward(const sp_gpt2_step *s, size_t l,
                                const sp_gpt2_io *io, sp_diag *d) {
  K(check_block(s, l, d));
  const sp_gpt2 *g = s->g;
  const sp_gpt2_ops *o = s->ops;
  sp_gpt2_dev *k = s->k;
  sp_gpt2_acts *a = s->a;
  const sp_gpt2_block *b = &g->blocks[l];
  int N = (int)(a->B * a->T), C = (int)g->C, NH = (int)g->n_head;
  size_t NC = (size_t)N * (size_t)C;
  sp_dtype pd = io->param_dtype(io->user, b->attn_w);
  /* checkpointing: the block's activations again, from its kept input;
   * its output res[l + 1] is rewritten with the values it holds */
  if (a->checkpointing) K(sp_gpt2_step_block_forward(s, l, io, d));
  /* a->dres: the gradient of the block's output, which the residual
   * passes on unchanged; each branch adds its input gradient to it */
  K(conv_bwd(s, io, b->fcproj_w, b->fcproj_b, a->dbig, a->dres, a->fch_gelu[l],
             N, 4 * C, C, d));
  K(o->round(k, a->dbig, 4 * NC, pd, d));
  K(o->gelu_bwd(k, a->dbig, a->fch[l], a->dbig, 4 * NC, d));
  K(o->round(k, a->dbig, 4 * NC, pd, d));
  K(conv_bwd(s, io, b->fc_w, b->fc_b, a->dbuf, a->dbig, a->ln2[l], N, C, 4 * C,
             d));
  K(o->round(k, a->dbuf, NC, pd, d));
  K(ln_bwd(s, io, b->ln2_w, b->ln2_b, a->dres, a->dbuf, a->res2[l],
           a->ln2_mean[l], a->ln2_rstd[l], N, C, d));
  K(o->round(k, a->dres, NC, pd, d));
  /* attention branch */
  K(conv_bwd(s, io, b->proj_w, b->proj_b, a->dbuf, a->dres, a->atty[l], N, C, C,
             d));
  K(o->round(k, a->dbuf, NC, pd, d));
  K(o->attention_bwd(k, a->dqkv, a->datt, a->dbuf, a->qkv[l], a->att[l],
                     (int)a->B, (int)a->T, C, NH, d));
  K(o->round(k, a->dqkv, 3 * NC, pd, d));
  K(conv_bwd(s, io, b->attn_w, b->attn_b, a->dbuf, a->dqkv, a->ln1[l], N, C,
             3 * C, d));
  K(o->round(k, a->dbuf, NC, pd, d));
  K(ln_bwd(s, io, b->ln1_w, b->ln1_b, a->dres, a->dbuf, a->res[l],
           a->ln1_mean[l], a->ln1_rstd[l], N, C, d));
  K(o->round(k, a->dres, NC, pd, d));
  return 0;
}

int sp_gpt2_step_embed_backward(const sp_gpt2_step *s, const sp_gpt2_io *io,
                                sp_diag *d) {
  const sp_gpt2 *g = s->g;
  sp_gpt2_acts *a = s->a;
  int C = (int)g->C, T = (int)a->T, N = (int)(a->B * a->T);
  /* wte: rows by token, tokens in order; into a float32 view through
   * B*T rows (dbig is free after the blocks) where the table can */
  float *dwte = grad_f32(io, g->wte);
  if (dwte && s->ops->layout->wte_rows) {
    K(s->ops->wte_bwd_rows(s->k, dwte, a->dbig, a->wte_row, a->dres, a->tok, N,
                           C, (int)g->V, d));
  } else if (io->grad && io->grad(io->user, g->wte)) {
    if (s->ops->layout->wte_rows && a->f32_views)
      return f32_only(s, g->wte, io->param_dtype(io->user, g->wte), d);
    K(s->ops->wte_bwd(s->k, a->gw, a->dres, a->tok, N, C, (int)g->V, d));
    K(add_grad(s, io, g->wte, a->gw, d));
  }
  /* wpe's ctx x C always fits the scratch */
  K(s->ops->wpe_bwd(s->k, a->gw, a->dres, N, T, C, (int)g->ctx, d));
  return add_grad(s, io, g->wpe, a->gw, d);
}
