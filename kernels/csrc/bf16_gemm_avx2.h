// The AVX2 tier's bf16 product past the GEMV's rows (from bf16_gemv.cpp's gemm_min_rows x rows: decode batches and
// prefill alike, any row count), in the form of a GEMM micro-kernel: the output in panels of 16 columns (weight rows), each
// panel's weight rows first packed, per call, into a scratch of [K][16] bf16 (`pack_panel`: the 16 values of one k
// side by side, columns j and 8 + j in one 32-bit lane, so that a shift widens columns 0-7 to fp32 and a mask
// columns 8-15), then tiles of kGemmM x rows (x widened to fp32 once per call, row-major) against the panel: per k
// one 32-byte load and two conversions of the weight, one broadcast of each x row, 2 kGemmM FMAs into 2 kGemmM
// accumulators (no horizontal sums: each lane is one output). Unlike a dot-product tile (an x row against a weight
// row), whose loads of x and conversions of the weight compete with its FMAs, this runs near the FMA peak; the packing
// (an in-register 16 x 16 transpose, shuffle ports) is paid once per weight element per call. Tasks take panels
// (at::parallel_for over output columns); the weight is read once per call in its own [N, K] layout, nothing kept.
// Sums are fp32 in k order (another order than the GEMV's tiles and oneDNN's), the bias added in fp32, one rounding
// to bf16. Included by bf16_gemv_avx2.h.

#include "bf16_avx2.h"  // sluice_round_bf16x8

#define SLUICE_GEMM
// The decode batches (x rows) the GEMV call's `gemm` serves, as the decode stack counts them; past them it takes
// prefill rows too (faster there than oneDNN's fp32 matmul on weights widened per call: bench/cpu_tiers.py).
constexpr int64_t kGemmMaxRows = 64;
constexpr int kGemmM = 6;             // x rows a tile: 12 accumulators, 2 weight registers, 1 broadcast

// Sixteen weight rows w[0..16) (row stride K) at columns [k, k + 16) into p[(k + i) * 16 ...]: for each k, lane j
// (32 bits) holds (w[j][k], w[8 + j][k]).
inline void pack16x16(const uint16_t* w, int64_t K, int64_t k, uint16_t* p) {
  __m256i lo[8], hi[8];
  for (int j = 0; j < 8; ++j) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (8 + j) * K + k));
    lo[j] = _mm256_unpacklo_epi16(a, b);  // pairs of k 0-3 | 8-11
    hi[j] = _mm256_unpackhi_epi16(a, b);  // pairs of k 4-7 | 12-15
  }
  auto transpose = [&](const __m256i* d, int k0) {  // d[0..8): 4 pairs a lane -> one vector of 8 pairs a k
    __m256i u[2][4];
    for (int h = 0; h < 2; ++h) {
      const __m256i* q = d + 4 * h;
      const __m256i t0 = _mm256_unpacklo_epi32(q[0], q[1]), t1 = _mm256_unpackhi_epi32(q[0], q[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(q[2], q[3]), t3 = _mm256_unpackhi_epi32(q[2], q[3]);
      u[h][0] = _mm256_unpacklo_epi64(t0, t2);
      u[h][1] = _mm256_unpackhi_epi64(t0, t2);
      u[h][2] = _mm256_unpacklo_epi64(t1, t3);
      u[h][3] = _mm256_unpackhi_epi64(t1, t3);
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + (k0 + i) * 16), _mm256_permute2x128_si256(u[0][i], u[1][i], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + (k0 + 8 + i) * 16), _mm256_permute2x128_si256(u[0][i], u[1][i], 0x31));
    }
  };
  transpose(lo, 0);
  transpose(hi, 4);
}

// Weight rows [n0, n0 + cols) (cols <= 16) at columns [k0, K) into the panel p [K][16] (missing columns zero).
inline void pack_panel(const uint16_t* w, int64_t K, int64_t n0, int64_t cols, uint16_t* p, int64_t k0) {
  int64_t k = k0;
  if (cols == 16)
    for (; k + 16 <= K; k += 16) pack16x16(w + n0 * K, K, k, p + k * 16);
  for (; k < K; ++k)
    for (int j = 0; j < 8; ++j) {
      p[k * 16 + 2 * j] = j < cols ? w[(n0 + j) * K + k] : 0;
      p[k * 16 + 2 * j + 1] = 8 + j < cols ? w[(n0 + 8 + j) * K + k] : 0;
    }
}

// out[m * 16 + c] = sum over k of xf[k * M + m] * panel column c, for M x rows (xf: the tile's x, k-major). kPack: the panel is packed here,
// 16 k at a time from the 16 weight rows at w just before they are used (its shuffles then overlap this tile's FMAs).
// next: the 16 weight rows of the task's next panel (or null), fetched into L2 as this tile goes, a line of each row
// per 32 k, so that the next panel's packing reads them from cache rather than memory.
template <int M, bool kPack>
inline void panel_tile(const float* xf, uint16_t* p, const uint16_t* w, int64_t K, float* out,
                       const uint16_t* next = nullptr) {
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t k1 = std::min(k0 + 16, K);
    if (next != nullptr && k0 % 32 == 0)
      for (int j = 0; j < 16; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k0), _MM_HINT_T1);
    if constexpr (kPack) {
      if (k1 - k0 == 16) pack16x16(w, K, k0, p + k0 * 16);
      else pack_panel(w, K, 0, 16, p, k0);
    }
    for (int64_t k = k0; k < k1; ++k) {
      const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + k * 16));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int m = 0; m < M; ++m) {
        const __m256 a = _mm256_broadcast_ss(xf + k * M + m);
        acc[m][0] = _mm256_fmadd_ps(a, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(a, w1, acc[m][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(out + m * 16, acc[m][0]);
    _mm256_storeu_ps(out + m * 16 + 8, acc[m][1]);
  }
}

// Rows [m, m + M) of the panel's outputs, plus bias, rounded into y (kPack: this tile packs the panel first; next:
// as panel_tile's).
template <int M, bool kPack = false>
inline void panel_rows(const float* xf, int64_t m, uint16_t* p, const uint16_t* w, int64_t K, int64_t N, int64_t n0,
                       int64_t cols, const uint16_t* bias, uint16_t* y, const uint16_t* next = nullptr) {
  alignas(32) float out[M * 16];
  panel_tile<M, kPack>(xf + m * K, p, w + n0 * K, K, out, next);  // tile m's x starts at m * K
  if (cols == 16) {  // the whole panel: 16 outputs a row at once
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0));
      b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(b)), 16));
      b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(b, 1)), 16));
    }
    for (int i = 0; i < M; ++i) {
      const __m256i lo = sluice_round_bf16x8(_mm256_add_ps(_mm256_load_ps(out + i * 16), b0));
      const __m256i hi = sluice_round_bf16x8(_mm256_add_ps(_mm256_load_ps(out + i * 16 + 8), b1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m + i) * N + n0),
                          _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
    }
    return;
  }
  for (int i = 0; i < M; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      float v = out[i * 16 + c];
      if (bias) v += bf16_to_float(bias[n0 + c]);
      y[(m + i) * N + n0 + c] = c10::BFloat16(v).x;  // round to nearest even
    }
}

// Weight rows [n0, n0 + cols) packed into the panel p and multiplied by x rows [0, M): kGemmM at a time (the first
// tile packing the panel as it goes, when the panel is whole; the second fetching `next`, the task's next whole
// panel or null), then the 1 to kGemmM - 1 rows left.
inline void panel_all_rows(const float* xf, int64_t M, uint16_t* p, const uint16_t* w, int64_t K, int64_t N,
                           int64_t n0, int64_t cols, const uint16_t* bias, uint16_t* y, const uint16_t* next) {
  int64_t m = 0;
  if (cols == 16 && M >= kGemmM) {
    panel_rows<kGemmM, true>(xf, 0, p, w, K, N, n0, cols, bias, y);
    m = kGemmM;
  } else {
    pack_panel(w + n0 * K, K, 0, cols, p, 0);
  }
  for (; m + kGemmM <= M; m += kGemmM)
    panel_rows<kGemmM>(xf, m, p, w, K, N, n0, cols, bias, y, m == kGemmM ? next : nullptr);
  switch (M - m) {
    case 5: panel_rows<5>(xf, m, p, w, K, N, n0, cols, bias, y); break;
    case 4: panel_rows<4>(xf, m, p, w, K, N, n0, cols, bias, y); break;
    case 3: panel_rows<3>(xf, m, p, w, K, N, n0, cols, bias, y); break;
    case 2: panel_rows<2>(xf, m, p, w, K, N, n0, cols, bias, y); break;
    case 1: panel_rows<1>(xf, m, p, w, K, N, n0, cols, bias, y); break;
    default: break;
  }
}

// y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias), any M, rounded to bf16.
inline void gemm(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t K, int64_t N,
                 const uint16_t* bias, uint16_t* y) {
  // x in fp32, k-major within each tile of kGemmM rows (the tile at m starts at m * K: xf[m * K + k * T + i] is
  // row m + i of a T-row tile), so that a tile's broadcasts read one stream
  const at::Tensor xf_t = at::empty({M, K}, at::kFloat);
  float* xf = xf_t.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kGemmM) {
    const int64_t T = std::min<int64_t>(kGemmM, M - m0);
    for (int64_t i = 0; i < T; ++i)
      for (int64_t k = 0; k < K; ++k) xf[m0 * K + k * T + i] = bf16_to_float(x[(m0 + i) * ldx + k]);
  }
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> buffer(K * 16 + 32);
    uint16_t* panel = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) / 2 & 31);  // 64-byte aligned
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 16, cols = std::min<int64_t>(16, N - n0);
      const uint16_t* next = b + 1 < b1 && n0 + 32 <= N ? w + (n0 + 16) * K : nullptr;
      panel_all_rows(xf, M, panel, w, K, N, n0, cols, bias, y, next);
    }
  });
}
