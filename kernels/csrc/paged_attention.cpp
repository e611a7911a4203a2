// Fused CPU paged attention of short queries (and, on AVX512-BF16, of bf16 prefills and prefill chunks too:
// kernels/cpu_attention.py, serves_prefill): walks each sequence's block table, reading every cached key and
// value once per kv head, in tiles converted to fp32 in L1 and shared by the kv head's G query rows; AVX-512
// (or AVX2) through at::vec; a flash-style online softmax; long contexts split across threads and merged by
// log-sum-exp; the next tile prefetched into L2. A bf16 cache on a CPU with avx512_bf16 takes a faster path
// (attend_unit_bf16: bf16 dot products straight from the cache and on value tiles packed in position pairs, the
// softmax on whole tiles). An int8 cache (per-token-head fp16 scales) is dequantized in registers: the key scale
// folds into the score, the value scale into the softmax weight.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include "avx512_reduce.h"
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define SLUICE_BF16_DOT 1
#endif
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <functional>
#include <map>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTile = 16;       // key/value positions converted and scored together
constexpr int64_t kMinChunk = 128;  // the fewest positions a thread's share of a split context holds

struct Cache {
  const void* k;
  const void* v;
  const at::Half* k_scale;  // null for a plain cache
  const at::Half* v_scale;
  int64_t blocks, block_size, width;  // blocks per head, positions per block, block-table row width
  const int64_t* tables;
};

struct Unit {  // one kv head of one sequence over positions [p0, p1)
  int64_t s, hk, p0, p1, part;  // part: row of the partial-result buffer, -1 when the unit writes out directly
};

struct Span {  // what a run of rows attends: kv head hk's positions [p0, p1) through one block table
  const int64_t* table;
  int64_t hk, p0, p1;
  bool fresh;  // false: m, l and acc already hold the rows' state over the positions before p0
};

static void start_rows(float* m, float* l, float* acc, int64_t R, int64_t D) {
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.f);
  std::fill(acc, acc + R * D, 0.f);
}

template <typename C>
static inline void row_to_float(const C* src, float* dst, int64_t D) {
  int64_t d = 0;
  if constexpr (at::vec::is_reduced_floating_point_v<C>) {
    for (; d + Vec::size() <= D; d += Vec::size()) {
      Vec x;
      at::vec::load_to_float<C>(src + d, x);
      x.store(dst + d);
    }
  }
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);  // int8 and double: a loop the compiler vectorizes
}

// Slot of each position in [p, p + n) within head hk's cache: one division per tile, not per position.
static void tile_slots(const Cache& c, const int64_t* table, int64_t hk, int64_t p, int64_t n, int64_t* slots) {
  int64_t blk = p / c.block_size, off = p % c.block_size;
  for (int64_t j = 0; j < n; ++j) {
    slots[j] = (hk * c.blocks + table[blk]) * c.block_size + off;
    if (++off == c.block_size) off = 0, ++blk;
  }
}

// Cache rows at `slots` as fp32: pointers into the cache itself when it is fp32, else converted into buf.
template <typename C>
static void load_tile(const C* base, const int64_t* slots, int64_t n, int64_t D, float* buf, const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const C* src = base + slots[j] * D;
    if constexpr (std::is_same_v<C, float>) {
      rows[j] = src;
    } else {
      row_to_float(src, buf + j * D, D);
      rows[j] = buf + j * D;
    }
  }
}

static inline float dot(const float* a, const float* b, int64_t D) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

// out[0..4) = the horizontal sums of a0..a3 (AVX-512: sluice_reduce4, 9 instructions for all four).
static inline void reduce4(const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_ps(out, sluice_reduce4(a0, a1, a2, a3));
#else
  auto sum = [](Vec& x, Vec& y) { return x + y; };
  out[0] = at::vec::vec_reduce_all<float>(sum, a0);
  out[1] = at::vec::vec_reduce_all<float>(sum, a1);
  out[2] = at::vec::vec_reduce_all<float>(sum, a2);
  out[3] = at::vec::vec_reduce_all<float>(sum, a3);
#endif
}

// Scores of one query row against n key rows, four rows at a time so q is loaded once per four keys.
static inline void scores(const float* q, const float* const* k, int64_t n, int64_t D, float* out) {
  int64_t j = 0;
  if (D % Vec::size() == 0) {
    for (; j + 4 <= n; j += 4) {
      Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
      for (int64_t d = 0; d < D; d += Vec::size()) {
        const Vec x = Vec::loadu(q + d);
        a0 = at::vec::fmadd(x, Vec::loadu(k[j] + d), a0);
        a1 = at::vec::fmadd(x, Vec::loadu(k[j + 1] + d), a1);
        a2 = at::vec::fmadd(x, Vec::loadu(k[j + 2] + d), a2);
        a3 = at::vec::fmadd(x, Vec::loadu(k[j + 3] + d), a3);
      }
      reduce4(a0, a1, a2, a3, out + j);
    }
  }
  for (; j < n; ++j) out[j] = dot(q, k[j], D);
}

// acc row i [D] += sum_j w[i * kTile + j] * v[j] for NR rows, j < n[i]: each slice of the NR acc rows stays in a
// register across the tile's rows, and each value slice is loaded once for all of them (per row the sums run in
// the same order as one row at a time).
template <int NR>
static inline void accumulate(float* acc, const float* w, const int64_t* n, const float* const* v, int64_t D) {
  const int64_t most = *std::max_element(n, n + NR);
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) {
    Vec a[NR];
    for (int i = 0; i < NR; ++i) a[i] = Vec::loadu(acc + i * D + d);
    for (int64_t j = 0; j < most; ++j) {
      const Vec x = Vec::loadu(v[j] + d);
      for (int i = 0; i < NR; ++i)
        if (j < n[i]) a[i] = at::vec::fmadd(Vec(w[i * kTile + j]), x, a[i]);
    }
    for (int i = 0; i < NR; ++i) a[i].store(acc + i * D + d);
  }
  for (; d < D; ++d)
    for (int i = 0; i < NR; ++i)
      for (int64_t j = 0; j < n[i]; ++j) acc[i * D + d] += w[i * kTile + j] * v[j][d];
}

static inline void scale_row(float* x, float f, int64_t D) {
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) (Vec::loadu(x + d) * Vec(f)).store(x + d);
  for (; d < D; ++d) x[d] *= f;
}

// The tile from position p (up to p1)'s key and value rows (and their scales) asked for while the tile before it
// is computed; nothing past p1. A
// sequence's blocks lie anywhere in the pool, where no hardware prefetcher looks (attention at 64 sequences with
// their KV in DRAM: docs/benchmarks.md, attention_speed). Into L2: into L1 (T0) a tile's 64 lines held the
// miss buffers that the demand loads wait for (slower than L2 on both paths; two or four tiles ahead added
// nothing). Always inlined: GCC deems a function of prefetches alone free of side
// effects and drops the calls.
template <typename C>
__attribute__((always_inline)) static inline void prefetch_tile(const Cache& c, const int64_t* table, int64_t hk,
                                                                int64_t p, int64_t p1, int64_t D) {
  if (p >= p1) return;
  const int64_t n = std::min(kTile, p1 - p);
  int64_t slots[kTile];
  tile_slots(c, table, hk, p, n, slots);
  const auto* k = static_cast<const char*>(c.k);
  const auto* v = static_cast<const char*>(c.v);
  const int64_t row = D * static_cast<int64_t>(sizeof(C));
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t b = 0; b < row; b += 64) {
      __builtin_prefetch(k + slots[j] * row + b, 0, 2);  // locality 2: prefetcht1
      __builtin_prefetch(v + slots[j] * row + b, 0, 2);
    }
    if (c.k_scale != nullptr) {
      __builtin_prefetch(c.k_scale + slots[j], 0, 2);
      __builtin_prefetch(c.v_scale + slots[j], 0, 2);
    }
  }
}

// Online softmax over one unit: m (running max), l (running sum) and acc [R, D] (unnormalized output); qf, wbuf
// and seen are the calling thread's scratch (scaled queries, a tile's softmax weights and valid positions per row).
template <typename T, typename C>
static void attend_unit(const T* const* qrow, const int64_t* limit, int64_t R, const Cache& c, const Span& u,
                        int64_t D, float scale, std::vector<float>& qf, std::vector<float>& wbuf,
                        std::vector<int64_t>& seen, float* m, float* l, float* acc) {
  const int64_t hk = u.hk;
  const int64_t* table = u.table;
  qf.resize(R * D);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qrow[r][d]) * scale;
  if (u.fresh) start_rows(m, l, acc, R, D);
  alignas(64) float kbuf[kTile * 256], vbuf[kTile * 256], s[kTile], ks[kTile], vs[kTile];
  wbuf.resize(R * kTile);
  seen.resize(R);
  int64_t slots[kTile];
  std::vector<float> big;
  float *kb = kbuf, *vb = vbuf;
  if (D > 256) {
    big.resize(2 * kTile * D);
    kb = big.data();
    vb = big.data() + kTile * D;
  }
  const float* krows[kTile];
  const float* vrows[kTile];
  const C* kc = static_cast<const C*>(c.k);
  const C* vc = static_cast<const C*>(c.v);
  for (int64_t p = u.p0; p < u.p1; p += kTile) {
    const int64_t n = std::min(kTile, u.p1 - p);
    tile_slots(c, table, hk, p, n, slots);
    load_tile(kc, slots, n, D, kb, krows);
    load_tile(vc, slots, n, D, vb, vrows);
    prefetch_tile<C>(c, table, hk, p + kTile, u.p1, D);
    for (int64_t j = 0; j < n; ++j) {
      ks[j] = c.k_scale ? static_cast<float>(c.k_scale[slots[j]]) : 1.f;
      vs[j] = c.v_scale ? static_cast<float>(c.v_scale[slots[j]]) : 1.f;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t valid = std::min(n, limit[r] - p);  // causal: the row sees positions < limit[r]
      seen[r] = std::max<int64_t>(valid, 0);
      if (valid <= 0) continue;
      float* w = wbuf.data() + r * kTile;
      scores(qf.data() + r * D, krows, valid, D, s);
      float top = m[r];
      for (int64_t j = 0; j < valid; ++j) {
        s[j] *= ks[j];
        top = std::max(top, s[j]);
      }
      float sum = 0.f;
      int64_t j = 0;
      for (; j + Vec::size() <= valid; j += Vec::size()) {
        const Vec e = (Vec::loadu(s + j) - Vec(top)).exp_u20();
        e.store(w + j);
      }
      for (; j < valid; ++j) w[j] = std::exp(s[j] - top);
      for (j = 0; j < valid; ++j) {
        sum += w[j];
        w[j] *= vs[j];
      }
      float* ar = acc + r * D;
      if (top != m[r]) {
        const float alpha = std::exp(m[r] - top);  // exp(-inf) = 0 on the first tile
        scale_row(ar, alpha, D);
        l[r] *= alpha;
        m[r] = top;
      }
      l[r] += sum;
    }
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) accumulate<4>(acc + r0 * D, wbuf.data() + r0 * kTile, &seen[r0], vrows, D);
    switch (R - r0) {
      case 1: accumulate<1>(acc + r0 * D, wbuf.data() + r0 * kTile, &seen[r0], vrows, D); break;
      case 2: accumulate<2>(acc + r0 * D, wbuf.data() + r0 * kTile, &seen[r0], vrows, D); break;
      case 3: accumulate<3>(acc + r0 * D, wbuf.data() + r0 * kTile, &seen[r0], vrows, D); break;
      default: break;
    }
  }
}

#ifdef SLUICE_BF16_DOT
// Index vectors of `pack_value_pairs`: lane t of the result holds (a[t], b[t]), from the low or high half of 32.
alignas(64) static const uint16_t kPairLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) static const uint16_t kPairHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// A tile's kTile bf16 value rows as kTile / 2 rows of position pairs: vp[jp * D + d] holds (v[2jp][d],
// v[2jp + 1][d]) in one 32-bit lane, the pair `vdpbf16ps` multiplies by a pair of softmax weights.
static inline void pack_value_pairs(const uint16_t* const* rows, int64_t D, uint32_t* vp) {
  const __m512i lo = _mm512_load_si512(kPairLo), hi = _mm512_load_si512(kPairHi);
  for (int64_t jp = 0; jp < kTile / 2; ++jp) {
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = _mm512_loadu_si512(rows[2 * jp] + d), b = _mm512_loadu_si512(rows[2 * jp + 1] + d);
      _mm512_storeu_si512(vp + jp * D + d, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(vp + jp * D + d + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// acc rows [NR][D] at columns [d, d + 16 NC) += the tile's values weighed by each row's bf16 weight pairs (wp:
// row i's kTile / 2 pairs at wp[i * kTile]), np position pairs: the rows' sums stay in registers across the tile,
// each value slice loaded once for all of them.
template <int NR, int NC>
static inline void add_value_pairs(float* acc, int64_t D, int64_t d, const uint32_t* wp, const uint32_t* vp,
                                   int64_t np) {
  __m512 a[NR][NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) a[i][c] = _mm512_loadu_ps(acc + i * D + d + 16 * c);
  for (int64_t jp = 0; jp < np; ++jp) {
    __m512bh v[NC];
    for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + d + 16 * c);
    for (int i = 0; i < NR; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(wp[i * kTile + jp]));
      for (int c = 0; c < NC; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], w, v[c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + i * D + d + 16 * c, a[i][c]);
}

template <int NC>
static inline void add_value_pairs_rows(float* acc, int64_t nr, int64_t D, int64_t d, const uint32_t* wp,
                                        const uint32_t* vp, int64_t np) {
  switch (nr) {
    case 1: return add_value_pairs<1, NC>(acc, D, d, wp, vp, np);
    case 2: return add_value_pairs<2, NC>(acc, D, d, wp, vp, np);
    case 3: return add_value_pairs<3, NC>(acc, D, d, wp, vp, np);
    default: return add_value_pairs<4, NC>(acc, D, d, wp, vp, np);
  }
}

// dots[i] = the 16 lane sums of a query row against key sluice_lane_of(i) of a tile (sluice_reduce16 then puts
// key j's dot product in lane j), the keys anywhere (rows) or, with D known, at fixed offsets from one pointer.
static inline void tile_dots(const uint16_t* q, const uint16_t* const* rows, int64_t D, __m512* dots) {
  for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
    for (int i = 0; i < 16; ++i)
      dots[i] = _mm512_dpbf16_ps(dots[i], qv, (__m512bh)_mm512_loadu_si512(rows[sluice_lane_of(i)] + d));
  }
}

template <int D>
static inline void tile_dots(const uint16_t* q, const uint16_t* keys, __m512* dots) {
  for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
    for (int i = 0; i < 16; ++i)
      dots[i] = _mm512_dpbf16_ps(dots[i], qv, (__m512bh)_mm512_loadu_si512(keys + sluice_lane_of(i) * D + d));
  }
}

// The bf16 cache without scales: scores straight from the bf16 keys with `vdpbf16ps` (no fp32 copy of the key
// tile; sixteen keys' dot products reduced into one vector at once), the softmax on that vector, its weights
// rounded to bf16 (the running sum adds the rounded ones), then the value tile, packed in position pairs, added
// into up to four query rows per pass by `vdpbf16ps` too (each value slice loaded once for all of them; rows past
// their causal limit weigh the tail positions 0). D % 32 == 0, D <= 256.
static void attend_unit_bf16(const at::BFloat16* const* qrow, const int64_t* limit, int64_t R, const Cache& c,
                             const Span& u, int64_t D, float scale, std::vector<float>& wbuf, float* m, float* l,
                             float* acc) {
  const int64_t hk = u.hk;
  const int64_t* table = u.table;
  if (u.fresh) start_rows(m, l, acc, R, D);
  wbuf.resize(2 * R * kTile);
  float *w = wbuf.data(), *sbuf = w + R * kTile;  // weights (bf16), scores
  alignas(64) uint32_t vp[kTile / 2 * 256];
  alignas(64) static const uint16_t zero_row[256] = {};
  int64_t slots[kTile];
  const uint16_t* krows[kTile];
  const uint16_t* vrows[kTile];
  const auto* kc = reinterpret_cast<const uint16_t*>(c.k);
  const auto* vc = reinterpret_cast<const uint16_t*>(c.v);
  const __m512 vscale = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p = u.p0; p < u.p1; p += kTile) {
    const int64_t n = std::min(kTile, u.p1 - p);
    tile_slots(c, table, hk, p, n, slots);
    for (int64_t j = 0; j < kTile; ++j) {
      krows[j] = j < n ? kc + slots[j] * D : zero_row;
      vrows[j] = j < n ? vc + slots[j] * D : zero_row;
    }
    pack_value_pairs(vrows, D, vp);
    bool contiguous = n == kTile;  // the tile's keys one after another (within one block, or adjacent ones)
    for (int64_t j = 1; j < n && contiguous; ++j) contiguous = slots[j] == slots[0] + j;
    prefetch_tile<uint16_t>(c, table, hk, p + kTile, u.p1, D);
    int64_t first = R, rows = 0;  // the rows from the first to the last that see this tile (others weigh it 0)
    for (int64_t r = 0; r < R; ++r) {  // the scores first: the rows' softmax chains then overlap
      const int64_t valid = std::min(n, limit[r] - p);  // causal: the row sees positions < limit[r]
      if (valid <= 0) continue;
      first = std::min(first, r), rows = r + 1;
      const auto* qr = reinterpret_cast<const uint16_t*>(qrow[r]);
      __m512 dots[16];
      if (contiguous && D == 64) tile_dots<64>(qr, krows[0], dots);
      else if (contiguous && D == 128) tile_dots<128>(qr, krows[0], dots);
      else tile_dots(qr, krows, D, dots);
      const __mmask16 seen = static_cast<__mmask16>((1u << valid) - 1);
      const __m512 sc = _mm512_mul_ps(sluice_reduce16(dots), vscale);
      _mm512_storeu_ps(sbuf + r * kTile, _mm512_mask_mov_ps(minus_inf, seen, sc));
    }
    for (int64_t r = first; r < rows; ++r) {
      const int64_t valid = std::min(n, limit[r] - p);
      if (valid <= 0) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + r * kTile), _mm256_setzero_si256());
        continue;
      }
      const __mmask16 seen = static_cast<__mmask16>((1u << valid) - 1);
      const __m512 sc = _mm512_loadu_ps(sbuf + r * kTile);
      const float top = std::max(m[r], _mm512_reduce_max_ps(sc));
      const __m256bh wb = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(seen, (Vec(sc) - Vec(top)).exp_u20()));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + r * kTile), (__m256i)wb);
      const __m512 wv = _mm512_cvtpbh_ps(wb);  // the weights as the values will be weighed
      if (top != m[r]) {
        const float alpha = std::exp(m[r] - top);  // exp(-inf) = 0 on the first tile
        scale_row(acc + r * D, alpha, D);
        l[r] *= alpha;
        m[r] = top;
      }
      l[r] += _mm512_reduce_add_ps(wv);
    }
    const int64_t np = (n + 1) / 2;  // an odd tile's last pair: a zero row at weight 0
    const auto* wp = reinterpret_cast<const uint32_t*>(w);
    for (int64_t r0 = first; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      for (int64_t d = 0; d < D; d += 64) {
        if (D - d >= 64) add_value_pairs_rows<4>(acc + r0 * D, nr, D, d, wp + r0 * kTile, vp, np);
        else add_value_pairs_rows<2>(acc + r0 * D, nr, D, d, wp + r0 * kTile, vp, np);
      }
    }
  }
}
#endif

template <typename T>
static void write_rows(T* out, const float* acc, const float* l, int64_t t0, int64_t R, int64_t H, int64_t G,
                       int64_t hk, int64_t D) {
  for (int64_t r = 0; r < R; ++r) {
    T* dst = out + ((t0 + r / G) * H + hk * G + r % G) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv);
  }
}

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Units in order of sequence, chunk, kv head, with each split sequence's partial rows numbered.
static std::vector<Unit> plan(const int64_t* qlen, const int64_t* ctx, int64_t S, int64_t Hk, int64_t G,
                              int64_t chunk, std::vector<int64_t>& part_rows) {
  if (chunk <= 0) {  // automatic: split contexts only when sequences x kv heads leave threads idle
    const int64_t want = 4 * at::get_num_threads(), units = S * Hk;
    int64_t longest = 1;
    for (int64_t s = 0; s < S; ++s) longest = std::max(longest, ctx[s]);
    chunk = units >= want ? longest : std::max(kMinChunk, ceil_div(longest, ceil_div(want, units)));
  }
  std::vector<Unit> units;
  int64_t parts = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = std::max<int64_t>(1, ceil_div(ctx[s], chunk));
    for (int64_t c = 0; c < n; ++c)
      for (int64_t hk = 0; hk < Hk; ++hk) {
        units.push_back({s, hk, c * chunk, std::min(ctx[s], (c + 1) * chunk), n > 1 ? parts : -1});
        if (n > 1) parts += qlen[s] * G;
      }
  }
  part_rows.assign(1, parts);
  return units;
}

// Sequences whose block tables begin with the same blocks (a prefix-cache hit shares them): their first P
// positions, seen by every query row of theirs, are attended once for all of them, each key and value tile read
// once for every row (cascade attention); each row then goes on over its own positions from that state. Every
// row's arithmetic is the same as alone (tiles from position 0, in order), so its bits are too.
struct Shared {
  std::vector<int64_t> seqs;
  int64_t P;
};
constexpr int64_t kMinShared = 64;  // the fewest shared positions worth a group

static std::vector<Shared> shared_prefixes(const Cache& c, const int64_t* qlen, const int64_t* ctx, int64_t S) {
  std::map<int64_t, std::vector<int64_t>> by_first;  // first block -> sequences
  for (int64_t s = 0; s < S; ++s)
    if (ctx[s] - qlen[s] >= kMinShared) by_first[c.tables[s * c.width]].push_back(s);
  std::vector<Shared> out;
  for (const auto& [first, seqs] : by_first) {
    if (seqs.size() < 2) continue;
    const int64_t lead = seqs[0], *head = c.tables + lead * c.width;
    std::vector<std::pair<int64_t, int64_t>> common;  // (positions shared with the first, sequence)
    for (int64_t s : seqs) {
      const int64_t* t = c.tables + s * c.width;
      const int64_t most = std::min(ctx[s] - qlen[s], ctx[lead] - qlen[lead]) / c.block_size;
      int64_t b = 0;
      while (b < most && t[b] == head[b]) ++b;
      common.push_back({b * c.block_size / kTile * kTile, s});
    }
    std::sort(common.begin(), common.end(), std::greater<>());
    size_t best = 0;  // the group of the first best + 1 saving the most reads: best x their shortest share
    for (size_t k = 1; k < common.size(); ++k)
      if (k * common[k].first > best * (best ? common[best].first : 0)) best = k;
    if (best == 0 || common[best].first < kMinShared) continue;
    Shared g{{}, common[best].first};
    for (size_t k = 0; k <= best; ++k) g.seqs.push_back(common[k].second);
    out.push_back(std::move(g));
  }
  return out;
}

template <typename T>
struct Scratch {
  std::vector<float> qf, wbuf, m, l, acc;
  std::vector<int64_t> seen, limit;
  std::vector<const T*> qrow;
  void add_rows(const T* q, int64_t t0, int64_t nq, int64_t L, int64_t H, int64_t G, int64_t hk, int64_t D) {
    for (int64_t r = 0; r < nq * G; ++r) {  // row r: query token r / G, head r % G of kv head hk's group
      qrow.push_back(q + ((t0 + r / G) * H + hk * G + r % G) * D);
      limit.push_back(L - nq + r / G + 1);  // causal: query i of nq sees positions < L - nq + i + 1
    }
  }
};

// fn(i, scratch) for every item i, the threads taking equal shares of the summed costs, each with its own
// scratch S.
template <typename S, typename F>
static void balanced(const std::vector<double>& cost, F fn) {
  if (cost.empty()) return;
  std::vector<double> sum(cost.size() + 1, 0.0);
  for (size_t i = 0; i < cost.size(); ++i) sum[i + 1] = sum[i] + cost[i];
  const int64_t T_ = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), cost.size()));
  at::parallel_for(0, T_, 1, [&](int64_t begin, int64_t end) {
    S scratch;
    for (int64_t t = begin; t < end; ++t) {
      const double lo = sum.back() * t / T_, hi = sum.back() * (t + 1) / T_;
      for (size_t i = 0; i < cost.size(); ++i) {
        const double mid = 0.5 * (sum[i] + sum[i + 1]);
        if (mid >= lo && mid < hi) {
          fn(i, scratch);
        }
      }
    }
  });
}

template <typename T, typename C>
static void attend(const Cache& c, const Span& sp, int64_t D, float scale, Scratch<T>& s, float* m, float* l,
                   float* acc) {
  const int64_t R = s.limit.size();
#ifdef SLUICE_BF16_DOT
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<C, at::BFloat16>) {
    if (D % 32 == 0 && D <= 256)
      return attend_unit_bf16(s.qrow.data(), s.limit.data(), R, c, sp, D, scale, s.wbuf, m, l, acc);
  }
#endif
  attend_unit<T, C>(s.qrow.data(), s.limit.data(), R, c, sp, D, scale, s.qf, s.wbuf, s.seen, m, l, acc);
}

// A unit's work: the positions its rows see within [p0, p1) (a causal prefill's rows see ever more), and a tile
// of overhead a row.
static double unit_cost(const Unit& u, int64_t nq, int64_t L, int64_t G) {
  double sum = 0;
  for (int64_t i = 0; i < nq; ++i)
    sum += double(std::max<int64_t>(0, std::min(u.p1, L - nq + i + 1) - u.p0) + kTile);
  return sum * G;
}

template <typename T, typename C>
static void run(const T* q, const Cache& c, T* out, const int64_t* qstart, const int64_t* qlen, const int64_t* ctx,
                int64_t S, int64_t H, int64_t Hk, int64_t D, float scale, int64_t chunk) {
  const int64_t G = H / Hk;
  std::vector<int64_t> part_rows;
  std::vector<Unit> units = plan(qlen, ctx, S, Hk, G, chunk, part_rows);
  std::vector<float> part_m(part_rows[0]), part_l(part_rows[0]), part_acc(part_rows[0] * D);
  // Shared prefixes (only where no context is split): group g's rows of kv head hk hold state rows
  // [base[g] + hk * rows[g], + rows[g]), sequence s's from state[s] + hk * rows[g]
  const std::vector<Shared> groups = part_rows[0] == 0 ? shared_prefixes(c, qlen, ctx, S) : std::vector<Shared>{};
  std::vector<int64_t> state(S, -1), stride(S, 0), shared(S, 0), base;
  int64_t state_rows = 0;
  for (const Shared& g : groups) {
    base.push_back(state_rows);
    int64_t rows = 0;
    for (int64_t s : g.seqs) state[s] = state_rows + rows, rows += qlen[s] * G;
    for (int64_t s : g.seqs) stride[s] = rows, shared[s] = g.P;
    state_rows += rows * Hk;
  }
  std::vector<float> state_m(state_rows), state_l(state_rows), state_acc(state_rows * D);
  std::vector<double> cost;
  for (const Shared& g : groups)
    for (int64_t hk = 0; hk < Hk; ++hk) cost.push_back(double(stride[g.seqs[0]]) * double(g.P + kTile));
  balanced<Scratch<T>>(cost, [&](size_t i, Scratch<T>& s) {
    s.qrow.clear(), s.limit.clear();
    const Shared& g = groups[i / Hk];
    const int64_t hk = i % Hk, row = base[i / Hk] + hk * stride[g.seqs[0]];
    for (int64_t x : g.seqs) s.add_rows(q, qstart[x], qlen[x], ctx[x], H, G, hk, D);
    attend<T, C>(c, {c.tables + g.seqs[0] * c.width, hk, 0, g.P, true}, D, scale, s, state_m.data() + row,
                 state_l.data() + row, state_acc.data() + row * D);
  });
  for (Unit& u : units) u.p0 = std::max(u.p0, shared[u.s]);  // a member goes on from its group's state
  cost.clear();
  for (const Unit& u : units) cost.push_back(unit_cost(u, qlen[u.s], ctx[u.s], G));
  balanced<Scratch<T>>(cost, [&](size_t i, Scratch<T>& s) {
    s.qrow.clear(), s.limit.clear();
    const Unit& u = units[i];
    const int64_t R = qlen[u.s] * G;
    s.add_rows(q, qstart[u.s], qlen[u.s], ctx[u.s], H, G, u.hk, D);
    float *pm, *pl, *pa;
    if (u.part >= 0) {
      pm = part_m.data() + u.part, pl = part_l.data() + u.part, pa = part_acc.data() + u.part * D;
    } else if (state[u.s] >= 0) {
      const int64_t row = state[u.s] + u.hk * stride[u.s];
      pm = state_m.data() + row, pl = state_l.data() + row, pa = state_acc.data() + row * D;
    } else {
      s.m.resize(R), s.l.resize(R), s.acc.resize(R * D);
      pm = s.m.data(), pl = s.l.data(), pa = s.acc.data();
    }
    attend<T, C>(c, {c.tables + u.s * c.width, u.hk, u.p0, u.p1, state[u.s] < 0}, D, scale, s, pm, pl, pa);
    if (u.part < 0) write_rows(out, pa, pl, qstart[u.s], R, H, G, u.hk, D);
  });
  if (part_rows[0] == 0) return;
  std::vector<std::vector<const Unit*>> chunks_of(S * Hk);  // the partial units of each split (sequence, kv head)
  for (const Unit& u : units)
    if (u.part >= 0) chunks_of[u.s * Hk + u.hk].push_back(&u);
  at::parallel_for(0, S * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, l;
    for (int64_t w = begin; w < end; ++w) {
      const auto& parts = chunks_of[w];
      if (parts.empty()) continue;
      const int64_t s = parts[0]->s, R = qlen[s] * G;
      acc.assign(R * D, 0.f), l.assign(R, 0.f);
      for (int64_t r = 0; r < R; ++r) {
        float top = -std::numeric_limits<float>::infinity();
        for (const Unit* u : parts) top = std::max(top, part_m[u->part + r]);
        for (const Unit* u : parts) {
          const float mu = part_m[u->part + r];
          if (mu == -std::numeric_limits<float>::infinity()) continue;  // no visible position in this chunk
          const float f = std::exp(mu - top);
          l[r] += part_l[u->part + r] * f;
          const float* src = part_acc.data() + (u->part + r) * D;
          for (int64_t d = 0; d < D; ++d) acc[r * D + d] += src[d] * f;
        }
      }
      write_rows(out, acc.data(), l.data(), qstart[s], R, H, G, parts[0]->hk, D);
    }
  });
}

void paged_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                         torch::Tensor qstart, torch::Tensor qlen, torch::Tensor ctx, torch::Tensor block_tables,
                         double scale, std::optional<torch::Tensor> k_scale, std::optional<torch::Tensor> v_scale,
                         int64_t chunk) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block tables: int64");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "key and value caches differ in dtype");
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()), "an int8 cache needs both scales");
  Cache c{k_cache.data_ptr(), v_cache.data_ptr(), nullptr, nullptr, k_cache.size(1), k_cache.size(2),
          block_tables.size(1), block_tables.data_ptr<int64_t>()};
  if (int8) {
    TORCH_CHECK(k_scale->scalar_type() == at::kHalf && v_scale->scalar_type() == at::kHalf, "scales: fp16");
    TORCH_CHECK(k_scale->is_contiguous() && v_scale->is_contiguous());
    c.k_scale = k_scale->data_ptr<at::Half>();
    c.v_scale = v_scale->data_ptr<at::Half>();
  }
  const int64_t S = qstart.size(0), H = q.size(1), D = q.size(2), Hk = k_cache.size(0);
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t* ql = qlen.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    if (int8)
      run<scalar_t, int8_t>(qp, c, op, qs, ql, cl, S, H, Hk, D, static_cast<float>(scale), chunk);
    else
      run<scalar_t, scalar_t>(qp, c, op, qs, ql, cl, S, H, Hk, D, static_cast<float>(scale), chunk);
  });
}

// This file's Python functions, on the module `m` (its own library's, or cpu_kernels.cpp's submodule "paged_attention").
inline void bind_paged_attention(py::module_& m) {
  m.def("paged_attention_cpu", &paged_attention_cpu,
        "Paged attention of short queries over their blocks (CPU; plain or int8 cache with per-token-head scales)");
#ifdef SLUICE_BF16_DOT
  m.attr("BF16_DOT") = true;  // bf16 queries over a bf16 cache: attend_unit_bf16, faster than torch's SDPA at any length
#else
  m.attr("BF16_DOT") = false;
#endif
}

#ifndef SLUICE_NO_MODULE  // built alone (decode_stack.cpp and cpu_kernels.cpp include it without its module)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bind_paged_attention(m); }
#endif
