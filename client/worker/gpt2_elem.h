/* The elementwise math of the GPT-2 kernels, one definition for the CPU
 * (gpt2_cpu.c) and the GPU (gpt2_gpu.cu), as cast_scalar.h is
 * for the casts: GELU and its derivative, LayerNorm's output and input
 * gradient, the softmax's backward and the cross-entropy's gradient, each
 * per element (sp_gpt2_elem_X).
 *
 * The GPU file is compiled with --fmad=false (nvcc would otherwise fuse a
 * * b + c into one rounding, which the ISO C build never does), and CUDA's
 * float division and sqrtf are IEEE-rounded unless fast math is asked for
 * (it never is), so an element computed from the same inputs gives the same
 * bits on both sides. */
#ifndef SP_GPT2_ELEM_H
#define SP_GPT2_ELEM_H

#include <math.h>
#include <stdint.h>

#include "cast/cast_scalar.h" /* SP_HD, sp_f32_from_bits */

/* sqrt(2 / pi) */
#define SP_GPT2_GELU_S 0.7978845608028654f
#define SP_GPT2_LN_EPS 1e-5f

/* exp(x) in float32 arithmetic only, so that the CPU's loops vectorize
 * (a call to expf does not): x = n ln2 + r with |r| <= ln2 / 2 (n rounded
 * by the 1.5 * 2^23 trick, ln2 split in two for an exact n ln2), e^r by its
 * Taylor series to r^6 (truncation below 1.2e-7 relative, about one ulp),
 * 2^n assembled in the exponent bits. x is clamped to [-87, 88], where
 * 2^n stays a normal float: GELU and tanh only need the limits there. */
SP_HD static inline float sp_gpt2_elem_exp(float x) {
  /* two selects, which vectorize (a nested one does not); written so that
   * a NaN becomes 88, whose integer conversion below is defined (GELU's
   * result is still NaN: it multiplies by the NaN input) */
  x = x <= 88.0f ? x : 88.0f;
  x = x >= -87.0f ? x : -87.0f;
  float t = x * 1.44269504088896341f;
  float n = (t + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  return p * sp_f32_from_bits(bits);
}

/* tanh(u) = 1 - 2 / (exp(2u) + 1): tanhf (an expm1f and branches) was a
 * quarter of gpt2-mini's step on one core. Near 0 the subtraction cancels,
 * but GELU (0.5 x (1 + tanh)) needs only the absolute error, within ~1e-7. */
SP_HD static inline float sp_gpt2_elem_tanh(float u) {
  return 1.0f - 2.0f / (sp_gpt2_elem_exp(2.0f * u) + 1.0f);
}

/* GELU, tanh approximation (Hugging Face gelu_new). */
SP_HD static inline float sp_gpt2_elem_gelu(float x) {
  return 0.5f * x *
         (1.0f +
          sp_gpt2_elem_tanh(SP_GPT2_GELU_S * (x + 0.044715f * x * x * x)));
}

/* dout * gelu'(x) */
SP_HD static inline float sp_gpt2_elem_gelu_bwd(float x, float dout) {
  float th = sp_gpt2_elem_tanh(SP_GPT2_GELU_S * (x + 0.044715f * x * x * x));
  float sech2 = 1.0f - th * th;
  float g = 0.5f * (1.0f + th) + 0.5f * x * sech2 * SP_GPT2_GELU_S *
                                     (1.0f + 3.0f * 0.044715f * x * x);
  return g * dout;
}

/* LayerNorm's output of x given the row's mean m and 1/std s. */
SP_HD static inline float sp_gpt2_elem_ln_out(float x, float m, float s,
                                              float w, float b) {
  return (x - m) * s * w + b;
}

/* 1 / sqrt(var + eps) from the row's biased variance. */
SP_HD static inline float sp_gpt2_elem_ln_rstd(float var) {
  return 1.0f / sqrtf(var + SP_GPT2_LN_EPS);
}

/* LayerNorm's input gradient of one element: g the output gradient, gm and
 * gnm the row's means of g*w and g*w*xhat. */
SP_HD static inline float sp_gpt2_elem_ln_dx(float g, float w, float x, float m,
                                             float s, float gm, float gnm) {
  float xh = (x - m) * s, gw = g * w;
  return (gw - gm - xh * gnm) * s;
}

/* The softmax's backward: p (g - sum(p g)) where t2 <= t, else 0. */
SP_HD static inline float sp_gpt2_elem_softmax_bwd(float p, float g, float dot,
                                                   int on) {
  return on ? p * (g - dot) : 0.0f;
}

/* dlogits of one element: (p - [j is the target]) * scale, as the CPU's
 * in-place `r[tgt] -= 1; r[j] *= scale`. */
SP_HD static inline float sp_gpt2_elem_xent_bwd(float p, int is_tgt,
                                                float scale) {
  return (is_tgt ? p - 1.0f : p) * scale;
}

#endif
