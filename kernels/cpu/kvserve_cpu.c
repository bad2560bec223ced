/* kvserve's native CPU kernels (float32, AVX2 + FMA), built at first use by kernels/cpu/native.py.

Why they exist: at batch 1 a decode step reads every weight once, so it runs at the speed the
weights stream from memory. torch's float32 matrix-vector path (MKL sgemm with M = 1 on a
row-major [N, K] weight) reads each output row as a short separate stream and reaches well under
the copy bandwidth; the small per-layer ops (norms, rotary, SiLU, the gather + SDPA of decode
attention) each cost tens of microseconds of dispatch and allocation, 30 layers a step.

Weights are repacked once into panels of TILE output rows interleaved along K,
P[t][k][j] = W[t * TILE + j][k], so a matmul reads its weight as one sequential stream and every
load feeds TILE outputs. The same micro-kernel serves every batch size, and each output is summed
over k in the same order whatever the batch size, so a sequence's result does not depend on what
else is in the batch.

Threads: OpenMP, from the same libgomp as torch (one pool), count passed in by the caller.
Compiled with -ffp-contract=off so that scalar code rounds like torch's (no silent FMA fusion);
the matmul and attention dot products use explicit FMA.
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16
#define MR_MAX 6
#define PF_STEPS 16

int kv_abi_version(void) { return 15; }

/* ---------------------------------------------------------------------------------- packing */

void kv_pack_f32(const float* w, int64_t n, int64_t k, float* out, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    float* dst = out + t * k * TILE;
    for (int64_t j = 0; j < TILE; j++) {
      int64_t row = t * TILE + j;
      if (row < n) {
        const float* src = w + row * k;
        for (int64_t kk = 0; kk < k; kk++) dst[kk * TILE + j] = src[kk];
      } else {
        for (int64_t kk = 0; kk < k; kk++) dst[kk * TILE + j] = 0.0f;
      }
    }
  }
}

/* Rows `ids` of the original [n, k] matrix, read back out of its packed form (tied embeddings
   keep only the packed copy). */
void kv_gather_packed_rows_f32(const int64_t* ids, int64_t m, const float* packed, int64_t k, float* out) {
  for (int64_t i = 0; i < m; i++) {
    int64_t row = ids[i];
    const float* src = packed + (row / TILE) * k * TILE + (row % TILE);
    float* dst = out + i * k;
    for (int64_t kk = 0; kk < k; kk++) dst[kk] = src[kk * TILE];
  }
}

/* ---------------------------------------------------------------------------------- matmul */

static inline __attribute__((always_inline)) void micro_kernel(const float* x, int64_t ldx, const float* p,
                                                               int64_t k, float* y, int64_t ldy, int64_t ncols,
                                                               const float* bias, const int mr) {
  __m256 acc[MR_MAX][2];
  for (int m = 0; m < mr; m++) {
    acc[m][0] = _mm256_setzero_ps();
    acc[m][1] = _mm256_setzero_ps();
  }
  for (int64_t kk = 0; kk < k; kk++) {
    /* Several rows make each k step longer, so fewer of the panel's cache lines are in flight
       at once and the stream falls below memory speed: ask for a line PF_STEPS ahead. (Past the
       panel it is the next panel's start, which this thread reads next; a prefetch never faults.) */
    _mm_prefetch((const char*)(p + (kk + PF_STEPS) * TILE), _MM_HINT_T0);
    __m256 w0 = _mm256_load_ps(p + kk * TILE);
    __m256 w1 = _mm256_load_ps(p + kk * TILE + 8);
    for (int m = 0; m < mr; m++) {
      __m256 xb = _mm256_broadcast_ss(x + m * ldx + kk);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  for (int m = 0; m < mr; m++) {
    if (bias) {
      acc[m][0] = _mm256_add_ps(acc[m][0], _mm256_loadu_ps(bias));
      acc[m][1] = _mm256_add_ps(acc[m][1], _mm256_loadu_ps(bias + 8));
    }
    if (ncols == TILE) {
      _mm256_storeu_ps(y + m * ldy, acc[m][0]);
      _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
    } else {
      float tmp[TILE];
      _mm256_storeu_ps(tmp, acc[m][0]);
      _mm256_storeu_ps(tmp + 8, acc[m][1]);
      memcpy(y + m * ldy, tmp, (size_t)ncols * sizeof(float));
    }
  }
}

/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]); `packed` from kv_pack_f32, 32-byte aligned. */
void kv_linear_f32(const float* x, int64_t m, int64_t k, int64_t ldx, const float* packed, int64_t n,
                   const float* bias, float* y, int64_t ldy, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE;
  float bias_tail[TILE];
#pragma omp parallel for num_threads(nthreads) schedule(static) private(bias_tail)
  for (int64_t t = 0; t < tiles; t++) {
    const float* p = packed + t * k * TILE;
    int64_t col = t * TILE;
    int64_t ncols = n - col < TILE ? n - col : TILE;
    const float* b = NULL;
    if (bias) {
      if (ncols == TILE) {
        b = bias + col;
      } else {
        memset(bias_tail, 0, sizeof bias_tail);
        memcpy(bias_tail, bias + col, (size_t)ncols * sizeof(float));
        b = bias_tail;
      }
    }
    int64_t r = 0;
    for (; r + MR_MAX <= m; r += MR_MAX) micro_kernel(x + r * ldx, ldx, p, k, y + r * ldy + col, ldy, ncols, b, MR_MAX);
    switch (m - r) {
      case 1: micro_kernel(x + r * ldx, ldx, p, k, y + r * ldy + col, ldy, ncols, b, 1); break;
      case 2: micro_kernel(x + r * ldx, ldx, p, k, y + r * ldy + col, ldy, ncols, b, 2); break;
      case 3: micro_kernel(x + r * ldx, ldx, p, k, y + r * ldy + col, ldy, ncols, b, 3); break;
      case 4: micro_kernel(x + r * ldx, ldx, p, k, y + r * ldy + col, ldy, ncols, b, 4); break;
      case 5: micro_kernel(x + r * ldx, ldx, p, k, y + r * ldy + col, ldy, ncols, b, 5); break;
      default: break;
    }
  }
}

/* ------------------------------------------------------------- weight-only integer matmuls */

/* The two integer weight forms of runtime/models/quantization/packed.py, float32 activations and
   float32 accumulation. Both are repacked once into panels of TILE output rows, like the float32
   weights, so a matmul streams its weight bytes sequentially:

   int8 (w = q * scale, one scale per (row, group of g inputs)): P[t][k][j] = q[t * TILE + j][k],
   16 bytes per k step; scales S[t][k / g][j].
   int4 (w = q * scale + offset, q in 0..15): 8 bytes per k step, byte j holding row j in its low
   nibble and row j + 8 in its high nibble; scales and offsets S[t][k / g][j], O[t][k / g][j].

   Batch 1 (decode) reads each weight once, so it must run at memory speed: the integers are
   widened to floats in registers, dot products over a group are accumulated in float32 and the
   group folded in once, acc += scale_g * dot_g (+ offset_g * sum of x over the group for int4;
   those sums are computed once per call). Larger batches dequantize each panel into a float32
   panel on the thread's stack once and run the float32 micro-kernel over it, so every weight is
   converted once per call however many rows the batch has. Rows past n in the last panel hold
   zeros (and zero scales). */

static int64_t q_panel_floats(int64_t k) { return k * TILE; }

void kv_pack_q8(const int8_t* q, const float* scale, int64_t n, int64_t k, int64_t g, int8_t* out,
                float* out_scale, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE, groups = k / g;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    int8_t* dst = out + t * k * TILE;
    float* sd = out_scale + t * groups * TILE;
    for (int64_t j = 0; j < TILE; j++) {
      int64_t row = t * TILE + j;
      for (int64_t kk = 0; kk < k; kk++) dst[kk * TILE + j] = row < n ? q[row * k + kk] : 0;
      for (int64_t gi = 0; gi < groups; gi++) sd[gi * TILE + j] = row < n ? scale[row * groups + gi] : 0.0f;
    }
  }
}

/* q: [n, k] bytes holding 0..15 (one value per byte); scale/offset [n, k / g]. */
void kv_pack_q4(const uint8_t* q, const float* scale, const float* offset, int64_t n, int64_t k, int64_t g,
                uint8_t* out, float* out_scale, float* out_offset, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE, groups = k / g;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    uint8_t* dst = out + t * k * (TILE / 2);
    float* sd = out_scale + t * groups * TILE;
    float* od = out_offset + t * groups * TILE;
    for (int64_t kk = 0; kk < k; kk++) {
      for (int64_t j = 0; j < TILE / 2; j++) {
        int64_t lo = t * TILE + j, hi = lo + TILE / 2;
        uint8_t a = lo < n ? (q[lo * k + kk] & 0xF) : 0, b = hi < n ? (q[hi * k + kk] & 0xF) : 0;
        dst[kk * (TILE / 2) + j] = (uint8_t)(a | (b << 4));
      }
    }
    for (int64_t j = 0; j < TILE; j++) {
      int64_t row = t * TILE + j;
      for (int64_t gi = 0; gi < groups; gi++) {
        sd[gi * TILE + j] = row < n ? scale[row * groups + gi] : 0.0f;
        od[gi * TILE + j] = row < n ? offset[row * groups + gi] : 0.0f;
      }
    }
  }
}

/* Dequantized rows `ids` (float32 [m, k]) read out of the panels: embedding lookups. */
void kv_gather_rows_q8(const int64_t* ids, int64_t m, const int8_t* p, const float* s, int64_t k, int64_t g,
                       float* out) {
  int64_t groups = k / g;
  for (int64_t i = 0; i < m; i++) {
    int64_t t = ids[i] / TILE, j = ids[i] % TILE;
    const int8_t* src = p + t * k * TILE + j;
    const float* sc = s + t * groups * TILE + j;
    for (int64_t kk = 0; kk < k; kk++) out[i * k + kk] = (float)src[kk * TILE] * sc[(kk / g) * TILE];
  }
}

void kv_gather_rows_q4(const int64_t* ids, int64_t m, const uint8_t* p, const float* s, const float* o, int64_t k,
                       int64_t g, float* out) {
  int64_t groups = k / g;
  for (int64_t i = 0; i < m; i++) {
    int64_t t = ids[i] / TILE, j = ids[i] % TILE;
    const uint8_t* src = p + t * k * (TILE / 2) + (j % (TILE / 2));
    int shift = j < TILE / 2 ? 0 : 4;
    const float* sc = s + t * groups * TILE + j;
    const float* of = o + t * groups * TILE + j;
    for (int64_t kk = 0; kk < k; kk++) {
      float q = (float)((src[kk * (TILE / 2)] >> shift) & 0xF);
      out[i * k + kk] = fmaf(q, sc[(kk / g) * TILE], of[(kk / g) * TILE]);
    }
  }
}

static inline __m256 widen_i8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
static inline __m256 widen_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }

/* One row of x against one int8 panel: two k steps per iteration into separate accumulators
   (the FMA latency chain would otherwise bound a single row). */
static void q8_row(const float* x, const int8_t* p, const float* s, int64_t k, int64_t g, float* y,
                   int64_t ncols) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < k; g0 += g) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    int64_t kk = g0, end = g0 + g;
    for (; kk + 2 <= end; kk += 2) {
      __m128i v0 = _mm_loadu_si128((const __m128i*)(p + kk * TILE));
      __m128i v1 = _mm_loadu_si128((const __m128i*)(p + (kk + 1) * TILE));
      __m256 x0 = _mm256_broadcast_ss(x + kk), x1 = _mm256_broadcast_ss(x + kk + 1);
      a0 = _mm256_fmadd_ps(widen_i8(v0), x0, a0);
      a1 = _mm256_fmadd_ps(widen_i8(_mm_unpackhi_epi64(v0, v0)), x0, a1);
      b0 = _mm256_fmadd_ps(widen_i8(v1), x1, b0);
      b1 = _mm256_fmadd_ps(widen_i8(_mm_unpackhi_epi64(v1, v1)), x1, b1);
    }
    if (kk < end) {
      __m128i v0 = _mm_loadu_si128((const __m128i*)(p + kk * TILE));
      __m256 x0 = _mm256_broadcast_ss(x + kk);
      a0 = _mm256_fmadd_ps(widen_i8(v0), x0, a0);
      a1 = _mm256_fmadd_ps(widen_i8(_mm_unpackhi_epi64(v0, v0)), x0, a1);
    }
    const float* sg = s + (g0 / g) * TILE;
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(sg), _mm256_add_ps(a0, b0), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(sg + 8), _mm256_add_ps(a1, b1), acc1);
  }
  float tmp[TILE];
  _mm256_storeu_ps(tmp, acc0);
  _mm256_storeu_ps(tmp + 8, acc1);
  memcpy(y, tmp, (size_t)ncols * sizeof(float));
}

/* One row of x against one int4 panel (g even): 16 bytes hold two k steps. xsum: sums of x over
   each group. */
static void q4_row(const float* x, const float* xsum, const uint8_t* p, const float* s, const float* o, int64_t k,
                   int64_t g, float* y, int64_t ncols) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < k; g0 += g) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    for (int64_t kk = g0; kk < g0 + g; kk += 2) {
      __m128i v = _mm_loadu_si128((const __m128i*)(p + kk * (TILE / 2)));
      __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      __m256 x0 = _mm256_broadcast_ss(x + kk), x1 = _mm256_broadcast_ss(x + kk + 1);
      a0 = _mm256_fmadd_ps(widen_u8(lo), x0, a0);
      a1 = _mm256_fmadd_ps(widen_u8(hi), x0, a1);
      b0 = _mm256_fmadd_ps(widen_u8(_mm_unpackhi_epi64(lo, lo)), x1, b0);
      b1 = _mm256_fmadd_ps(widen_u8(_mm_unpackhi_epi64(hi, hi)), x1, b1);
    }
    int64_t gi = g0 / g;
    const float* sg = s + gi * TILE;
    const float* og = o + gi * TILE;
    __m256 xs = _mm256_broadcast_ss(xsum + gi);
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(sg), _mm256_add_ps(a0, b0), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(sg + 8), _mm256_add_ps(a1, b1), acc1);
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(og), xs, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(og + 8), xs, acc1);
  }
  float tmp[TILE];
  _mm256_storeu_ps(tmp, acc0);
  _mm256_storeu_ps(tmp + 8, acc1);
  memcpy(y, tmp, (size_t)ncols * sizeof(float));
}

/* The float32 panel of an int8 / int4 tile: w = q * scale (int8), q * scale + offset (int4). */
static void q8_dequant_panel(const int8_t* p, const float* s, int64_t k, int64_t g, float* w) {
  for (int64_t g0 = 0; g0 < k; g0 += g) {
    const float* sg = s + (g0 / g) * TILE;
    __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);
    for (int64_t kk = g0; kk < g0 + g; kk++) {
      __m128i v = _mm_loadu_si128((const __m128i*)(p + kk * TILE));
      _mm256_store_ps(w + kk * TILE, _mm256_mul_ps(widen_i8(v), s0));
      _mm256_store_ps(w + kk * TILE + 8, _mm256_mul_ps(widen_i8(_mm_unpackhi_epi64(v, v)), s1));
    }
  }
}

static void q4_dequant_panel(const uint8_t* p, const float* s, const float* o, int64_t k, int64_t g, float* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g0 = 0; g0 < k; g0 += g) {
    const float* sg = s + (g0 / g) * TILE;
    const float* og = o + (g0 / g) * TILE;
    __m256 s0 = _mm256_loadu_ps(sg), s1 = _mm256_loadu_ps(sg + 8);
    __m256 o0 = _mm256_loadu_ps(og), o1 = _mm256_loadu_ps(og + 8);
    for (int64_t kk = g0; kk < g0 + g; kk++) {
      __m128i v = _mm_loadl_epi64((const __m128i*)(p + kk * (TILE / 2)));
      __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      _mm256_store_ps(w + kk * TILE, _mm256_fmadd_ps(widen_u8(lo), s0, o0));
      _mm256_store_ps(w + kk * TILE + 8, _mm256_fmadd_ps(widen_u8(hi), s1, o1));
    }
  }
}

static void f32_panel_rows(const float* x, int64_t m, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy,
                           int64_t ncols) {
  int64_t r = 0;
  for (; r + MR_MAX <= m; r += MR_MAX) micro_kernel(x + r * ldx, ldx, w, k, y + r * ldy, ldy, ncols, NULL, MR_MAX);
  switch (m - r) {
    case 1: micro_kernel(x + r * ldx, ldx, w, k, y + r * ldy, ldy, ncols, NULL, 1); break;
    case 2: micro_kernel(x + r * ldx, ldx, w, k, y + r * ldy, ldy, ncols, NULL, 2); break;
    case 3: micro_kernel(x + r * ldx, ldx, w, k, y + r * ldy, ldy, ncols, NULL, 3); break;
    case 4: micro_kernel(x + r * ldx, ldx, w, k, y + r * ldy, ldy, ncols, NULL, 4); break;
    case 5: micro_kernel(x + r * ldx, ldx, w, k, y + r * ldy, ldy, ncols, NULL, 5); break;
    default: break;
  }
}

/* y[m, n] = x[m, k] @ W.T for an int8 weight packed by kv_pack_q8. */
void kv_linear_q8(const float* x, int64_t m, int64_t k, int64_t ldx, const int8_t* p, const float* s, int64_t n,
                  int64_t g, float* y, int64_t ldy, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE, groups = k / g;
#pragma omp parallel num_threads(nthreads)
  {
    float* w = m > 1 ? (float*)aligned_alloc(32, (size_t)q_panel_floats(k) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      int64_t col = t * TILE, ncols = n - col < TILE ? n - col : TILE;
      const int8_t* pt = p + t * k * TILE;
      const float* st = s + t * groups * TILE;
      if (m == 1) {
        q8_row(x, pt, st, k, g, y + col, ncols);
      } else {
        q8_dequant_panel(pt, st, k, g, w);
        f32_panel_rows(x, m, ldx, w, k, y + col, ldy, ncols);
      }
    }
    free(w);
  }
}

/* y[m, n] = x[m, k] @ W.T for an int4 weight packed by kv_pack_q4 (g even). */
void kv_linear_q4(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* p, const float* s,
                  const float* o, int64_t n, int64_t g, float* y, int64_t ldy, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE, groups = k / g;
  float xsum[groups > 0 ? groups : 1];
  if (m == 1) {
    for (int64_t gi = 0; gi < groups; gi++) {
      float acc = 0.0f;
      for (int64_t kk = gi * g; kk < (gi + 1) * g; kk++) acc += x[kk];
      xsum[gi] = acc;
    }
  }
#pragma omp parallel num_threads(nthreads)
  {
    float* w = m > 1 ? (float*)aligned_alloc(32, (size_t)q_panel_floats(k) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      int64_t col = t * TILE, ncols = n - col < TILE ? n - col : TILE;
      const uint8_t* pt = p + t * k * (TILE / 2);
      const float* st = s + t * groups * TILE;
      const float* ot = o + t * groups * TILE;
      if (m == 1) {
        q4_row(x, xsum, pt, st, ot, k, g, y + col, ncols);
      } else {
        q4_dequant_panel(pt, st, ot, k, g, w);
        f32_panel_rows(x, m, ldx, w, k, y + col, ldy, ncols);
      }
    }
    free(w);
  }
}

/* ------------------------------------------------------ 4-bit codebook weights (bitsandbytes) */

/* NF4 / FP4: w = codebook[code] * absmax per (row, block of `blk` inputs). The codes are
   bitsandbytes' [n, k / 2] bytes, the first of a pair in the high nibble; they are repacked into
   the int4 panel layout (kv_pack_q4's: row j of a tile in the low nibble of byte j, row j + 8 in
   the high one), absmax into [tiles, k / blk, TILE]. */
void kv_pack_nf4(const uint8_t* codes, const float* absmax, int64_t n, int64_t k, int64_t blk, uint8_t* out,
                 float* out_absmax, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE, blocks = k / blk, half = k / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    uint8_t* dst = out + t * k * (TILE / 2);
    float* ad = out_absmax + t * blocks * TILE;
    for (int64_t kk = 0; kk < k; kk++) {
      int shift = kk % 2 ? 0 : 4;
      for (int64_t j = 0; j < TILE / 2; j++) {
        int64_t lo = t * TILE + j, hi = lo + TILE / 2;
        uint8_t a = lo < n ? (codes[lo * half + kk / 2] >> shift) & 0xF : 0;
        uint8_t b = hi < n ? (codes[hi * half + kk / 2] >> shift) & 0xF : 0;
        dst[kk * (TILE / 2) + j] = (uint8_t)(a | (b << 4));
      }
    }
    for (int64_t j = 0; j < TILE; j++) {
      int64_t row = t * TILE + j;
      for (int64_t bi = 0; bi < blocks; bi++) ad[bi * TILE + j] = row < n ? absmax[row * blocks + bi] : 0.0f;
    }
  }
}

/* The codebook values of 8 codes (0..15, the low 8 bytes of `idx`): two in-register 8-entry
   tables, the code's bit 3 picking between them. */
static inline __m256 codebook8(__m128i idx, __m256 table_lo, __m256 table_hi) {
  __m256i i = _mm256_cvtepu8_epi32(idx);
  __m256 a = _mm256_permutevar8x32_ps(table_lo, i), b = _mm256_permutevar8x32_ps(table_hi, i);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}

/* One row of x against one tile: codebook values times x summed per block, then times absmax
   (sum_k cb[q] x_k * absmax, the same terms as the dequantized product, in another order). */
static void nf4_row(const float* x, const uint8_t* p, const float* a, int64_t k, int64_t blk, __m256 tl, __m256 th,
                    float* y, int64_t ncols) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < k; b0 += blk) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), u0 = _mm256_setzero_ps(), u1 = _mm256_setzero_ps();
    for (int64_t kk = b0; kk < b0 + blk; kk += 2) {
      __m128i v = _mm_loadu_si128((const __m128i*)(p + kk * (TILE / 2)));
      __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      __m256 x0 = _mm256_broadcast_ss(x + kk), x1 = _mm256_broadcast_ss(x + kk + 1);
      s0 = _mm256_fmadd_ps(codebook8(lo, tl, th), x0, s0);
      s1 = _mm256_fmadd_ps(codebook8(hi, tl, th), x0, s1);
      u0 = _mm256_fmadd_ps(codebook8(_mm_unpackhi_epi64(lo, lo), tl, th), x1, u0);
      u1 = _mm256_fmadd_ps(codebook8(_mm_unpackhi_epi64(hi, hi), tl, th), x1, u1);
    }
    const float* ab = a + (b0 / blk) * TILE;
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(ab), _mm256_add_ps(s0, u0), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(ab + 8), _mm256_add_ps(s1, u1), acc1);
  }
  float tmp[TILE];
  _mm256_storeu_ps(tmp, acc0);
  _mm256_storeu_ps(tmp + 8, acc1);
  memcpy(y, tmp, (size_t)ncols * sizeof(float));
}

/* A tile's float32 panel: codebook[code] * absmax, the product bitsandbytes' dequantizer forms. */
static void nf4_dequant_panel(const uint8_t* p, const float* a, int64_t k, int64_t blk, __m256 tl, __m256 th,
                              float* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b0 = 0; b0 < k; b0 += blk) {
    const float* ab = a + (b0 / blk) * TILE;
    __m256 a0 = _mm256_loadu_ps(ab), a1 = _mm256_loadu_ps(ab + 8);
    for (int64_t kk = b0; kk < b0 + blk; kk++) {
      __m128i v = _mm_loadl_epi64((const __m128i*)(p + kk * (TILE / 2)));
      __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      _mm256_store_ps(w + kk * TILE, _mm256_mul_ps(codebook8(lo, tl, th), a0));
      _mm256_store_ps(w + kk * TILE + 8, _mm256_mul_ps(codebook8(hi, tl, th), a1));
    }
  }
}

/* y[m, n] = x[m, k] @ W.T for a codebook weight packed by kv_pack_nf4 (blk even); m == 1 reads
   the codes once per output tile, m > 1 dequantizes each tile once and runs the float kernel. */
void kv_linear_nf4(const float* x, int64_t m, int64_t k, int64_t ldx, const uint8_t* p, const float* a,
                   const float* codebook, int64_t n, int64_t blk, float* y, int64_t ldy, int nthreads) {
  int64_t tiles = (n + TILE - 1) / TILE, blocks = k / blk;
  __m256 tl = _mm256_loadu_ps(codebook), th = _mm256_loadu_ps(codebook + 8);
#pragma omp parallel num_threads(nthreads)
  {
    float* w = m > 1 ? (float*)aligned_alloc(32, (size_t)q_panel_floats(k) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
      int64_t col = t * TILE, ncols = n - col < TILE ? n - col : TILE;
      const uint8_t* pt = p + t * k * (TILE / 2);
      const float* at = a + t * blocks * TILE;
      if (m == 1) {
        nf4_row(x, pt, at, k, blk, tl, th, y + col, ncols);
      } else {
        nf4_dequant_panel(pt, at, k, blk, tl, th, w);
        f32_panel_rows(x, m, ldx, w, k, y + col, ldy, ncols);
      }
    }
    free(w);
  }
}

/* Dequantized rows `ids` (float32 [m, k]) of a kv_pack_nf4 weight: embedding lookups. */
void kv_gather_rows_nf4(const int64_t* ids, int64_t m, const uint8_t* p, const float* a, const float* codebook,
                        int64_t k, int64_t blk, float* out) {
  int64_t blocks = k / blk;
  for (int64_t i = 0; i < m; i++) {
    int64_t t = ids[i] / TILE, j = ids[i] % TILE;
    const uint8_t* src = p + t * k * (TILE / 2) + (j % (TILE / 2));
    int shift = j < TILE / 2 ? 0 : 4;
    const float* ab = a + t * blocks * TILE + j;
    for (int64_t kk = 0; kk < k; kk++)
      out[i * k + kk] = codebook[(src[kk * (TILE / 2)] >> shift) & 0xF] * ab[(kk / blk) * TILE];
  }
}

/* ----------------------------------------------------------------------------- elementwise */

/* exp(x) for 8 floats: range reduction by ln 2 and a degree-6 polynomial (Cephes' expf
   coefficients), within 2 ulp of expf over the float range; saturates to 0 / inf outside it. */
static inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(x, hi);
  x = _mm256_max_ps(x, lo);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, c1));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, c2));
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* out = silu(gate) * up for rows [gate | up] of width 2 * inter. */
void kv_silu_and_mul_f32(const float* x, int64_t m, int64_t inter, int64_t ldx, float* out, int64_t ldo,
                         int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * inter >= 65536)
  for (int64_t r = 0; r < m; r++) {
    const float* g = x + r * ldx;
    const float* u = g + inter;
    float* o = out + r * ldo;
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= inter; i += 8) {
      __m256 gv = _mm256_loadu_ps(g + i);
      __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}

/* RMSNorm over rows of width h, in Hugging Face's order: x * rsqrt(mean(x^2) + eps), then weight *
   that. With `residual`, the rows are x + residual first, and that sum goes to `sum_out`. */
void kv_rms_norm_f32(const float* x, int64_t ldx, const float* residual, int64_t ldr, float* sum_out,
                     const float* weight, float* out, int64_t m, int64_t h, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * h >= 65536)
  for (int64_t r = 0; r < m; r++) {
    const float* xr = x + r * ldx;
    const float* src = xr;
    if (residual) {
      const float* rr = residual + r * ldr;
      float* s = sum_out + r * h;
      for (int64_t i = 0; i < h; i++) s[i] = xr[i] + rr[i];
      src = s;
    }
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
      __m256 v = _mm256_loadu_ps(src + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum256(acc);
    for (; i < h; i++) ss += src[i] * src[i];
    float inv = 1.0f / sqrtf(ss / (float)h + eps);
    float* o = out + r * h;
    for (i = 0; i < h; i++) o[i] = weight[i] * (src[i] * inv);
  }
}

/* Rotate-half rotary embedding (as HF Llama) of the first `rot` dims of each head, out of place:
   q [m, hq, d] at row stride ldq -> q_out (contiguous), the same for k. */
static inline void rotate_rows(const float* x, int64_t ldx, int64_t heads, int64_t d, int64_t rot,
                               const float* cs, float* out, int64_t r) {
  int64_t half = rot / 2;
  const float* cosv = cs;
  const float* sinv = cs + half;
  for (int64_t hd = 0; hd < heads; hd++) {
    const float* src = x + r * ldx + hd * d;
    float* dst = out + (r * heads + hd) * d;
    for (int64_t i = 0; i < half; i++) {
      float x1 = src[i], x2 = src[i + half];
      dst[i] = x1 * cosv[i] - x2 * sinv[i];
      dst[i + half] = x2 * cosv[i] + x1 * sinv[i];
    }
    for (int64_t i = rot; i < d; i++) dst[i] = src[i];
  }
}

void kv_rotary_f32(const int64_t* positions, int64_t m, const float* q, int64_t ldq, int64_t hq, const float* k,
                   int64_t ldk, int64_t hk, int64_t d, int64_t rot, const float* cos_sin, float* q_out,
                   float* k_out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * (hq + hk) * d >= 65536)
  for (int64_t r = 0; r < m; r++) {
    const float* cs = cos_sin + positions[r] * rot;
    rotate_rows(q, ldq, hq, d, rot, cs, q_out, r);
    rotate_rows(k, ldk, hk, d, rot, cs, k_out, r);
  }
}

/* ------------------------------------------------------------------------------ cache write */

/* K/V rows (row = kv_heads * head_dim floats, contiguous within a row, rows ldk / ldv apart) into
   flat cache slots; slot -1 is skipped. */
void kv_write_kv_f32(const float* key, int64_t ldk, const float* value, int64_t ldv, int64_t n, int64_t row,
                     const int64_t* slots, float* k_cache, float* v_cache) {
  for (int64_t i = 0; i < n; i++) {
    int64_t slot = slots[i];
    if (slot < 0) continue;
    memcpy(k_cache + slot * row, key + i * ldk, (size_t)row * sizeof(float));
    memcpy(v_cache + slot * row, value + i * ldv, (size_t)row * sizeof(float));
  }
}

/* ------------------------------------------------------------------------- decode attention */

/* One new token per sequence over its paged context: q [s, hq, d] (contiguous), caches
   [blocks, block_size, hkv, d], block tables int32 [s, max_blocks], seq_lens int32 [s] (context
   including the new token, already written). `window` > 0 keeps only the last `window` positions;
   `softcap` > 0 applies softcap * tanh(score / softcap); `alibi` (float32 [hq] slopes, NULL: none)
   then adds slope_h * (j - i) for key position j and query position i (ALiBi). out [s, hq, d]. */
/* Lane p = the sum of a[p]'s eight lanes: eight dot products finished in seven hadd/permutes
   instead of eight horizontal sums. */
static inline __m256 sum8_lanes(const __m256 a[8]) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores[t] = scale * q . K[t] for eight positions whose rows start at k + off[0..7]. */
static inline __attribute__((always_inline)) __m256 qk8(const float* qr, const float* k, const int64_t* off,
                                                         int64_t d, float scale) {
  __m256 acc[8];
  for (int p = 0; p < 8; p++) acc[p] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 qv = _mm256_loadu_ps(qr + i);
    for (int p = 0; p < 8; p++) acc[p] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + off[p] + i), acc[p]);
  }
  __m256 dots = sum8_lanes(acc);
  if (i < d) {
    float tail[8];
    _mm256_storeu_ps(tail, dots);
    for (int p = 0; p < 8; p++)
      for (int64_t r = i; r < d; r++) tail[p] += qr[r] * k[off[p] + r];
    dots = _mm256_loadu_ps(tail);
  }
  return _mm256_mul_ps(dots, _mm256_set1_ps(scale));
}

/* o[0 .. 8 * nv) = inv * sum_t p[t] * V[t], summed over t in order, in registers. */
static inline __attribute__((always_inline)) void pv_chunk(const float* p, int64_t n, const float* v,
                                                            const int64_t* off, float inv, float* o, const int nv) {
  __m256 acc[8];
  for (int c = 0; c < nv; c++) acc[c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t++) {
    __m256 pt = _mm256_set1_ps(p[t]);
    const float* vr = v + off[t];
    if (t + 4 < n)
      for (int c = 0; c < nv; c += 2) _mm_prefetch((const char*)(v + off[t + 4] + 8 * c), _MM_HINT_T0);
    for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8 * c), acc[c]);
  }
  __m256 scale = _mm256_set1_ps(inv);
  for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[c], scale));
}

/* Decode attention: one query token per sequence over its paged K/V (caches [blocks, block_size,
   hkv, d]), one task per (sequence, KV head). The row offsets of the sequence's positions are
   found once per task (one division per block, not per position) and serve both passes. Scores
   go eight positions at a time, every query head of the KV head reading the same eight K rows
   while they sit in L1; a partial last eight repeats its first row and drops the extra lanes,
   so every score is summed in the same order. P.V keeps up to 64 outputs in registers and adds
   the positions in order.
   `tree_masks` (NULL: none; else int64 [s], read as unsigned) makes a row a node of a candidate
   tree (Medusa verification as decode rows): a nonzero mask's highest set bit j is the row's own
   slot, len - 1, so the tree starts at slot b = len - 1 - j, and a slot b + i is seen only when
   bit i is set (the node and its ancestors); slots before b (the context) are all seen. A zero
   mask is a plain causal row. Slots are skipped, not reordered, so a node attends to its context
   and path in the same order, with the same sums, as the plain decode row of its path would.
   Not with a window or ALiBi (their offsets are slot distances; the caller keeps those off). */
void kv_paged_decode_f32(const float* q, int64_t s, int64_t hq, int64_t hkv, int64_t d, const float* k_cache,
                         const float* v_cache, int64_t block_size, const int32_t* block_tables,
                         int64_t max_blocks, const int32_t* seq_lens, float scale, int64_t window, float softcap,
                         const float* alibi, const int64_t* tree_masks, float* out, int nthreads) {
  int64_t group = hq / hkv;
  int64_t row = hkv * d;
  /* A task per sequence when there are enough of them: its KV heads then read each cached row
     whole, one after the other, rather than three tasks each reading a third of it. */
  int per_seq = s >= 4 * (int64_t)nthreads;
  int64_t tasks = per_seq ? s : s * hkv;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; task++) {
    int64_t seq = per_seq ? task : task / hkv;
    int64_t g0 = per_seq ? 0 : task % hkv, g1 = per_seq ? hkv : g0 + 1;
    int64_t len = seq_lens[seq];
    int64_t first = (window > 0 && len > window) ? len - window : 0;
    int64_t n = len - first;
    const int32_t* table = block_tables + seq * max_blocks;
    int64_t* off = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n + 8));
    float* scores = (float*)malloc(sizeof(float) * (size_t)(n * group + 8));
    for (int64_t pos = first, t = 0; pos < len;) {
      int64_t blk = pos / block_size, in_block = pos - blk * block_size;
      int64_t base = ((int64_t)table[blk] * block_size + in_block) * row;
      for (int64_t r = in_block; r < block_size && pos < len; r++, pos++, t++) off[t] = base + (r - in_block) * row;
    }
    uint64_t tree = tree_masks ? (uint64_t)tree_masks[seq] : 0;
    if (tree) {
      int64_t b = len - 1 - (63 - __builtin_clzll(tree)) - first; /* the tree's first slot, in off[] */
      int64_t kept = b > 0 ? b : 0;
      for (int64_t t = kept; t < n; t++)
        if (t >= b && ((tree >> (t - b)) & 1u)) off[kept++] = off[t];
      n = kept;
    }
    for (int64_t g = g0; g < g1; g++) {
      const float* kg = k_cache + g * d;
      const float* vg = v_cache + g * d;
      const float* qg = q + (seq * hq + g * group) * d;
      for (int64_t t = 0; t < n; t += 8) {
        int64_t live = n - t < 8 ? n - t : 8;
        int64_t lanes[8];
        for (int p = 0; p < 8; p++) lanes[p] = off[t + (p < live ? p : 0)];
        /* The next eight rows, from wherever the block table put them: the hardware prefetcher
           cannot guess a jump between blocks. */
        for (int64_t p = t + 8; p < t + 16 && p < n; p++)
          for (int64_t i = 0; i < d; i += 16) _mm_prefetch((const char*)(kg + off[p] + i), _MM_HINT_T0);
        for (int64_t j = 0; j < group; j++) {
          __m256 sc = qk8(qg + j * d, kg, lanes, d, scale);
          float tmp[8];
          _mm256_storeu_ps(tmp, sc);
          for (int64_t p = 0; p < live; p++)
            scores[j * n + t + p] = softcap > 0.0f ? softcap * tanhf(tmp[p] / softcap) : tmp[p];
          if (alibi) { /* slope * (key position - query position), after soft-capping, as the torch backend */
            float slope = alibi[g * group + j];
            for (int64_t p = 0; p < live; p++) scores[j * n + t + p] += slope * (float)(first + t + p - (len - 1));
          }
        }
      }
      for (int64_t j = 0; j < group; j++) {
        float* sj = scores + j * n;
        float maxv = -INFINITY;
        for (int64_t t = 0; t < n; t++) maxv = sj[t] > maxv ? sj[t] : maxv;
        __m256 mx = _mm256_set1_ps(maxv);
        __m256 acc = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
          __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mx));
          _mm256_storeu_ps(sj + t, e);
          acc = _mm256_add_ps(acc, e);
        }
        float sum = hsum256(acc);
        for (; t < n; t++) {
          sj[t] = expf(sj[t] - maxv);
          sum += sj[t];
        }
        float inv = 1.0f / sum;
        float* o = out + (seq * hq + g * group + j) * d;
        int64_t i = 0;
        for (; i + 64 <= d; i += 64) pv_chunk(sj, n, vg + i, off, inv, o + i, 8);
        switch ((d - i) / 8) {
          case 1: pv_chunk(sj, n, vg + i, off, inv, o + i, 1); break;
          case 2: pv_chunk(sj, n, vg + i, off, inv, o + i, 2); break;
          case 3: pv_chunk(sj, n, vg + i, off, inv, o + i, 3); break;
          case 4: pv_chunk(sj, n, vg + i, off, inv, o + i, 4); break;
          case 5: pv_chunk(sj, n, vg + i, off, inv, o + i, 5); break;
          case 6: pv_chunk(sj, n, vg + i, off, inv, o + i, 6); break;
          case 7: pv_chunk(sj, n, vg + i, off, inv, o + i, 7); break;
          default: break;
        }
        for (i += 8 * ((d - i) / 8); i < d; i++) {
          float acc_i = 0.0f;
          for (int64_t t2 = 0; t2 < n; t2++) acc_i += sj[t2] * vg[off[t2] + i];
          o[i] = acc_i * inv;
        }
      }
    }
    free(scores);
    free(off);
  }
}

/* ------------------------------------------------------------------ a whole decoder stack */

/* A linear layer's weight in one of the packed forms: float32 panels (kv_pack_f32), int8 panels
   with scales (kv_pack_q8), int4 panels with scales and offsets (kv_pack_q4), or 4-bit codebook
   panels (kv_pack_nf4: scale holds the absmax panels, offset the 16 codebook values). */
enum { KV_WEIGHT_F32 = 0, KV_WEIGHT_Q8 = 1, KV_WEIGHT_Q4 = 2, KV_WEIGHT_NF4 = 3 };
typedef struct {
  const void* data;
  const float* scale;  /* Q8, Q4; NF4: absmax */
  const float* offset; /* Q4; NF4: codebook */
  int64_t kind;
  int64_t group; /* Q8, Q4, NF4: input features per scale */
} kv_weight;

static void linear_any(const float* x, int64_t m, int64_t k, int64_t ldx, const kv_weight* w, int64_t n,
                       const float* bias, float* y, int64_t ldy, int nthreads) {
  if (w->kind == KV_WEIGHT_F32) {
    kv_linear_f32(x, m, k, ldx, (const float*)w->data, n, bias, y, ldy, nthreads);
    return;
  }
  if (w->kind == KV_WEIGHT_NF4) /* scale: absmax panels, offset: the 16-value codebook */
    kv_linear_nf4(x, m, k, ldx, (const uint8_t*)w->data, w->scale, w->offset, n, w->group, y, ldy, nthreads);
  else if (w->kind == KV_WEIGHT_Q8)
    kv_linear_q8(x, m, k, ldx, (const int8_t*)w->data, w->scale, n, w->group, y, ldy, nthreads);
  else
    kv_linear_q4(x, m, k, ldx, (const uint8_t*)w->data, w->scale, w->offset, n, w->group, y, ldy, nthreads);
  if (bias) /* after the matmul, as the per-op path's `out + bias` */
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < n; c++) y[r * ldy + c] += bias[c];
}

/* One Llama-family decoder layer's weights (packed), norms and cache (see kv_decoder_stack_f32). */
typedef struct {
  const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm/k_norm: NULL unless Qwen3 */
  kv_weight qkv, o, gate_up, down;
  const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* may be NULL */
  const float* cos_sin;
  int64_t rotary_dim;
  float* k_cache;
  float* v_cache;
  int64_t window; /* 0: full attention */
  float softcap;  /* 0: none */
  float scale;
  /* ALiBi families (MPT, BLOOM, Falcon-RW): slopes per query head (NULL: none; rotary_dim is then
     0), LayerNorms with optional biases instead of RMSNorms, an ungated GELU MLP, q/k/v clipping. */
  const float* alibi;
  const float *input_norm_bias, *post_norm_bias; /* KV_NORM_LAYER only; may be NULL */
  int64_t norm_kind;                             /* KV_NORM_RMS or KV_NORM_LAYER */
  int64_t mlp_kind;                              /* KV_MLP_SILU_GATED, KV_MLP_GELU or KV_MLP_GELU_TANH */
  float clip_qkv;                                /* > 0: qkv clamped to [-clip, clip] */
  /* Rotary Falcon (7B/40B/180B): attention and MLP side by side, x + attn(ln_a(x)) + mlp(ln_m(x)).
     KV_SEQUENTIAL: the usual layer; KV_PARALLEL_SHARED_NORM: the MLP reads ln_a(x) too (Falcon-7B);
     KV_PARALLEL_TWO_NORMS: post_norm is ln_m, applied to x itself (the new decoder architecture). */
  int64_t parallel;
} kv_layer;

enum { KV_SEQUENTIAL = 0, KV_PARALLEL_SHARED_NORM = 1, KV_PARALLEL_TWO_NORMS = 2 };

enum { KV_NORM_RMS = 0, KV_NORM_LAYER = 1 };
enum { KV_MLP_SILU_GATED = 0, KV_MLP_GELU = 1, KV_MLP_GELU_TANH = 2 };

/* LayerNorm over rows of width h (biased variance, torch's definition); with `residual` the rows
   are x + residual first, and that sum goes to `sum_out` (kv_rms_norm_f32's contract). */
static void layer_norm_rows(const float* x, int64_t ldx, const float* residual, int64_t ldr, float* sum_out,
                            const float* weight, const float* bias, float* out, int64_t m, int64_t h, float eps,
                            int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * h >= 65536)
  for (int64_t r = 0; r < m; r++) {
    const float* src = x + r * ldx;
    if (residual) {
      const float* rr = residual + r * ldr;
      float* s = sum_out + r * h;
      for (int64_t i = 0; i < h; i++) s[i] = src[i] + rr[i];
      src = s;
    }
    /* double accumulation: the two-pass statistics stay within float rounding of torch's */
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < h; i++) mean += src[i];
    mean /= (double)h;
    for (int64_t i = 0; i < h; i++) {
      double c = src[i] - mean;
      var += c * c;
    }
    float inv = (float)(1.0 / sqrt(var / (double)h + (double)eps));
    float mu = (float)mean;
    float* o = out + r * h;
    for (int64_t i = 0; i < h; i++) o[i] = (src[i] - mu) * inv * weight[i] + (bias ? bias[i] : 0.0f);
  }
}

static void norm_any(const kv_layer* L, int post, float eps, const float* x, int64_t ldx, const float* residual,
                     int64_t ldr, float* sum_out, float* out, int64_t m, int64_t h, int nthreads) {
  const float* w = post ? L->post_norm : L->input_norm;
  if (L->norm_kind == KV_NORM_LAYER)
    layer_norm_rows(x, ldx, residual, ldr, sum_out, w, post ? L->post_norm_bias : L->input_norm_bias, out, m, h,
                    eps, nthreads);
  else
    kv_rms_norm_f32(x, ldx, residual, ldr, sum_out, w, out, m, h, eps, nthreads);
}

/* out = gelu(x) for rows of width n: exact (erf) or the tanh approximation. */
static void gelu_rows(const float* x, int64_t m, int64_t n, float* out, int tanh_approx, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (m * n >= 65536)
  for (int64_t r = 0; r < m; r++)
    for (int64_t i = 0; i < n; i++) {
      float v = x[r * n + i];
      out[r * n + i] = tanh_approx ? 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)))
                                   : 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    }
}

typedef struct {
  int64_t hidden, heads, kv_heads, head_dim, inter, block_size;
  float eps;
} kv_dims;

/* LoRA adapters on a decode step (runtime/lora/layers.py's slots, read in place): one adapted
   linear layer's slot stacks, A^T [slots, in, C] and scaled B [slots, C, out] with C = parts x
   max_rank. With an adapter of rank r in the slot, part p of a fused layer (q|k|v, gate|up) owns
   A's columns p*r .. (p+1)*r and only the outputs part_off[p] .. part_off[p+1]: the columns past
   parts x r and B's off-diagonal blocks are zero and never read. */
typedef struct {
  const void* a; /* NULL: the layer has no adapter slots */
  const void* b;
  int64_t parts;
  int64_t part_off[4];
  int64_t bf16; /* 1: A and B are bfloat16 (lora_dtype), widened to float32 as they are read */
} kv_lora_linear;

typedef struct {
  const kv_lora_linear* linears; /* [num_layers * 4]: qkv, o, gate_up, down */
  const int32_t* slot_rank;      /* [slots]: the rank of the adapter in each slot */
  const int32_t* group_rows;     /* the adapter rows of the step, grouped by slot */
  const int32_t* group_start;    /* [num_groups + 1] into group_rows */
  const int32_t* group_slot;     /* [num_groups] */
  int64_t num_groups, max_rank;
} kv_lora;

/* Eight slot values from float32 or bfloat16 storage (bfloat16 is float32's upper half). */
static inline __attribute__((always_inline)) __m256 lora_load8(const void* p, int64_t i, int bf16) {
  if (bf16)
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))), 16));
  return _mm256_loadu_ps((const float*)p + i);
}

static inline __attribute__((always_inline)) float lora_load1(const void* p, int64_t i, int bf16) {
  if (bf16) {
    uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  return ((const float*)p)[i];
}

/* Up to four rows of one adapter (row pointers; a short tail repeats its last row, computed but
   not stored): sh = x @ A over the parts x r columns in use, then y += sh @ B per part over that
   part's outputs only. Four rows share every load of A and B. `bf16` is a constant at each call
   site, so the compiler builds one loop per storage type. */
static inline __attribute__((always_inline)) void lora_rows4_t(const float* const xr[4], float* const yr[4], int mr,
                                                               int64_t k, const void* a, const void* b, int64_t C,
                                                               const kv_lora_linear* L, int32_t r, int64_t n,
                                                               float* sh, int bf16) {
  const int64_t used = L->parts * r;
  int64_t c0 = 0;
  for (; c0 + 8 <= used; c0 += 8) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t kk = 0; kk < k; kk++) {
      const __m256 av = lora_load8(a, kk * C + c0, bf16);
      s0 = _mm256_fmadd_ps(_mm256_broadcast_ss(xr[0] + kk), av, s0);
      s1 = _mm256_fmadd_ps(_mm256_broadcast_ss(xr[1] + kk), av, s1);
      s2 = _mm256_fmadd_ps(_mm256_broadcast_ss(xr[2] + kk), av, s2);
      s3 = _mm256_fmadd_ps(_mm256_broadcast_ss(xr[3] + kk), av, s3);
    }
    _mm256_storeu_ps(sh + c0, s0);
    _mm256_storeu_ps(sh + C + c0, s1);
    _mm256_storeu_ps(sh + 2 * C + c0, s2);
    _mm256_storeu_ps(sh + 3 * C + c0, s3);
  }
  for (; c0 < used; c0++)
    for (int ii = 0; ii < 4; ii++) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; kk++) acc += xr[ii][kk] * lora_load1(a, kk * C + c0, bf16);
      sh[ii * C + c0] = acc;
    }
  for (int64_t p = 0; p < L->parts; p++) {
    const int64_t hi = L->part_off[p + 1];
    const float* sp = sh + p * r;
    const int64_t bp = p * r * n; /* part p's block of B starts at this element */
    int64_t o = L->part_off[p];
    for (; o + 8 <= hi; o += 8) {
      __m256 y0 = _mm256_loadu_ps(yr[0] + o), y1 = _mm256_loadu_ps(yr[1] + o);
      __m256 y2 = _mm256_loadu_ps(yr[2] + o), y3 = _mm256_loadu_ps(yr[3] + o);
      for (int32_t j = 0; j < r; j++) {
        const __m256 bv = lora_load8(b, bp + j * n + o, bf16);
        y0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sp + j), bv, y0);
        y1 = _mm256_fmadd_ps(_mm256_broadcast_ss(sp + C + j), bv, y1);
        y2 = _mm256_fmadd_ps(_mm256_broadcast_ss(sp + 2 * C + j), bv, y2);
        y3 = _mm256_fmadd_ps(_mm256_broadcast_ss(sp + 3 * C + j), bv, y3);
      }
      /* a tail's repeated rows point at the last real row: only real rows are stored */
      _mm256_storeu_ps(yr[0] + o, y0);
      if (mr > 1) _mm256_storeu_ps(yr[1] + o, y1);
      if (mr > 2) _mm256_storeu_ps(yr[2] + o, y2);
      if (mr > 3) _mm256_storeu_ps(yr[3] + o, y3);
    }
    for (; o < hi; o++)
      for (int ii = 0; ii < mr; ii++) {
        float acc = yr[ii][o];
        for (int32_t j = 0; j < r; j++) acc += sp[ii * C + j] * lora_load1(b, bp + j * n + o, bf16);
        yr[ii][o] = acc;
      }
  }
}

static void lora_rows4(const float* const xr[4], float* const yr[4], int mr, int64_t k, const void* a,
                       const void* b, int64_t C, const kv_lora_linear* L, int32_t r, int64_t n, float* sh) {
  if (L->bf16)
    lora_rows4_t(xr, yr, mr, k, a, b, C, L, r, n, sh, 1);
  else
    lora_rows4_t(xr, yr, mr, k, a, b, C, L, r, n, sh, 0);
}

/* y[t] += (x[t] @ A_s) @ B_s for every adapter row t (slot s), after the base matmul wrote y (as
   the per-op path's wrapper adds after its base layer). One adapter's rows are done together, so
   its A and B are read once per four rows; adapters run in parallel. */
static void lora_add(const float* x, int64_t k, int64_t ldx, const kv_lora* lo, const kv_lora_linear* L,
                     int64_t n, float* y, int64_t ldy, int nthreads) {
  if (!lo || !L->a) return;
  const int64_t C = L->parts * lo->max_rank;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
  for (int64_t g = 0; g < lo->num_groups; g++) {
    const int32_t slot = lo->group_slot[g], r = lo->slot_rank[slot];
    const int32_t first = lo->group_start[g], rows = lo->group_start[g + 1] - first;
    const int64_t esize = L->bf16 ? 2 : 4;
    const void* a = (const char*)L->a + (int64_t)slot * k * C * esize;
    const void* b = (const char*)L->b + (int64_t)slot * C * n * esize;
    float sh[4 * C];
    for (int32_t i0 = 0; i0 < rows && r > 0; i0 += 4) {
      const int mr = rows - i0 < 4 ? rows - i0 : 4;
      const float* xr[4];
      float* yr[4];
      for (int ii = 0; ii < 4; ii++) {
        const int64_t row = lo->group_rows[first + i0 + (ii < mr ? ii : mr - 1)];
        xr[ii] = x + row * ldx;
        yr[ii] = y + row * ldy;
      }
      lora_rows4(xr, yr, mr, k, a, b, C, L, r, n, sh);
    }
  }
}

/* Floats of workspace kv_decoder_stack_f32 needs for m tokens. */
int64_t kv_decoder_stack_workspace(const kv_dims* d, int64_t m) {
  int64_t q = d->heads * d->head_dim, kv = d->kv_heads * d->head_dim;
  return m * (d->hidden /* normed */ + (q + 2 * kv) /* qkv */ + (q + kv) /* q/k normed */ + q /* q rotated */
              + kv /* k rotated */ + q /* attention out */ + d->hidden /* o_proj out */ + 2 * d->inter /* gate|up */
              + d->inter /* act */);
}

/* Every layer of a Llama/Mistral/Qwen2/Qwen3 (or MPT/BLOOM/Falcon-RW: ALiBi; rotary Falcon: parallel) decoder for a decode-only step of m sequences, in one
   call (no Python between the ops): the same kernels, in the same order, as the per-op path
   (kernels/ops.py + the torch backend's native decode), so the results are bit-identical to it.
   hidden [m, h] holds the embeddings on entry and the last layer's MLP output on return;
   residual [m, h] receives the residual stream (the model's final add + norm follows).
   tree_masks (NULL: none): each row's candidate-tree mask, as kv_paged_decode_f32 reads it. */
void kv_decoder_stack_f32(const kv_layer* layers, int64_t num_layers, const kv_dims* d, int64_t m,
                          const int64_t* positions, const int64_t* slots, const int32_t* block_tables,
                          int64_t max_blocks, const int32_t* seq_lens, const int64_t* tree_masks, float* hidden,
                          float* residual, float* work,
                          const kv_lora* lora, int nthreads) {
  const int64_t h = d->hidden, hd = d->head_dim, hq = d->heads, hk = d->kv_heads, inter = d->inter;
  const int64_t q = hq * hd, kv = hk * hd, w = q + 2 * kv;
  float* normed = work;
  float* qkv = normed + m * h;
  float* qk_normed = qkv + m * w;
  float* q_rot = qk_normed + m * (q + kv);
  float* k_rot = q_rot + m * q;
  float* attn = k_rot + m * kv;
  float* o_out = attn + m * q;
  float* gate_up = o_out + m * h;
  float* act = gate_up + m * 2 * inter;
  for (int64_t l = 0; l < num_layers; l++) {
    const kv_layer* L = &layers[l];
    if (l == 0) {
      memcpy(residual, hidden, (size_t)(m * h) * sizeof(float));
      norm_any(L, 0, d->eps, hidden, h, NULL, 0, NULL, normed, m, h, nthreads);
    } else {
      norm_any(L, 0, d->eps, hidden, h, residual, h, residual, normed, m, h, nthreads);
    }
    const kv_lora_linear* LL = lora ? lora->linears + 4 * l : NULL;
    linear_any(normed, m, h, h, &L->qkv, w, L->qkv_bias, qkv, w, nthreads);
    if (LL) lora_add(normed, h, h, lora, &LL[0], w, qkv, w, nthreads);
    if (L->clip_qkv > 0.0f)
      for (int64_t i = 0; i < m * w; i++) qkv[i] = fminf(fmaxf(qkv[i], -L->clip_qkv), L->clip_qkv);
    const float* qsrc = qkv;
    const float* ksrc = qkv + q;
    int64_t ld_qk = w;
    if (L->q_norm) {
      for (int64_t t = 0; t < m; t++) {
        kv_rms_norm_f32(qkv + t * w, hd, NULL, 0, NULL, L->q_norm, qk_normed + t * (q + kv), hq, hd, d->eps, 1);
        kv_rms_norm_f32(qkv + t * w + q, hd, NULL, 0, NULL, L->k_norm, qk_normed + t * (q + kv) + q, hk, hd,
                        d->eps, 1);
      }
      qsrc = qk_normed;
      ksrc = qk_normed + q;
      ld_qk = q + kv;
    }
    kv_rotary_f32(positions, m, qsrc, ld_qk, hq, ksrc, ld_qk, hk, hd, L->rotary_dim, L->cos_sin, q_rot, k_rot,
                  nthreads);
    kv_write_kv_f32(k_rot, kv, qkv + q + kv, w, m, kv, slots, L->k_cache, L->v_cache);
    kv_paged_decode_f32(q_rot, m, hq, hk, hd, L->k_cache, L->v_cache, d->block_size, block_tables, max_blocks,
                        seq_lens, L->scale, L->window, L->softcap, L->alibi, tree_masks, attn, nthreads);
    linear_any(attn, m, q, q, &L->o, h, L->o_bias, o_out, h, nthreads);
    if (LL) lora_add(attn, q, q, lora, &LL[1], h, o_out, h, nthreads);
    if (L->parallel == KV_PARALLEL_TWO_NORMS) /* residual holds x: attention has read `normed` */
      norm_any(L, 1, d->eps, residual, h, NULL, 0, NULL, normed, m, h, nthreads);
    else if (L->parallel == KV_SEQUENTIAL)
      norm_any(L, 1, d->eps, o_out, h, residual, h, residual, normed, m, h, nthreads);
    if (L->mlp_kind == KV_MLP_SILU_GATED) {
      linear_any(normed, m, h, h, &L->gate_up, 2 * inter, L->gate_up_bias, gate_up, 2 * inter, nthreads);
      if (LL) lora_add(normed, h, h, lora, &LL[2], 2 * inter, gate_up, 2 * inter, nthreads);
      kv_silu_and_mul_f32(gate_up, m, inter, 2 * inter, act, inter, nthreads);
    } else { /* gate_up holds the up projection alone: inter outputs */
      linear_any(normed, m, h, h, &L->gate_up, inter, L->gate_up_bias, gate_up, inter, nthreads);
      if (LL) lora_add(normed, h, h, lora, &LL[2], inter, gate_up, inter, nthreads);
      gelu_rows(gate_up, m, inter, act, L->mlp_kind == KV_MLP_GELU_TANH, nthreads);
    }
    linear_any(act, m, inter, inter, &L->down, h, L->down_bias, hidden, h, nthreads);
    if (LL) lora_add(act, inter, inter, lora, &LL[3], h, hidden, h, nthreads);
    if (L->parallel != KV_SEQUENTIAL) /* the layer's output is attn + mlp (the per-op path's order) */
      for (int64_t i = 0; i < m * h; i++) hidden[i] = o_out[i] + hidden[i];
  }
}

/* ------------------------------------------------------------------------- grammar bitmask */

/* Structured outputs: logits[rows[r], j] = -inf wherever bit j of that row's bitmask (xgrammar's
   layout: 32 tokens per int32 word, bit j % 32 of word j / 32, 1 = allowed) is 0, for j < vocab.
   Eight logits per AVX2 step; a word whose 32 tokens are all allowed is skipped. */
void kv_apply_bitmask_f32(float* logits, int64_t ld, const int32_t* bitmask, int64_t words_ld,
                          const int64_t* rows, int64_t nrows, int64_t vocab, int nthreads) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const int64_t whole = vocab / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t r = 0; r < nrows; r++) {
    float* row = logits + rows[r] * ld;
    const uint32_t* mask = (const uint32_t*)(bitmask + rows[r] * words_ld);
    for (int64_t w = 0; w < whole; w++) {
      const uint32_t word = mask[w];
      if (word == 0xFFFFFFFFu) continue;
      float* x = row + w * 32;
      for (int b = 0; b < 4; b++) {
        __m256i byte = _mm256_set1_epi32((int)((word >> (8 * b)) & 0xFFu));
        __m256i allowed = _mm256_cmpeq_epi32(_mm256_and_si256(byte, bit), bit);
        __m256 v = _mm256_loadu_ps(x + 8 * b);
        _mm256_storeu_ps(x + 8 * b, _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(allowed)));
      }
    }
    for (int64_t j = whole * 32; j < vocab; j++)
      if (!((mask[j >> 5] >> (j & 31)) & 1u)) row[j] = -INFINITY;
  }
}
