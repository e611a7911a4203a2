// The AVX512-VNNI tier of quant_linear.cpp (the avx512 tier on CPUs with VNNI, avx512_bf16, amx): the int8 x int8
// product by `vpdpbusd` (u8 x s8, int32 sums) on the weight codes + 128 (their sign bit flipped as they load) and
// the activation codes, less 128 x each activation row's sum, so the int32 result is exactly torch._int_mm's
// (oneDNN's, behind it, reorders the weight on each call, which costs as much as the product itself at a few
// rows); the int8 x int4 product (w4a8_avx512.h) and its requantized int8
// version for many rows; the activation quantization, bitsandbytes' row and 4-bit codes and the int8 epilogue 16
// lanes at a time, rounding exactly as the scalar versions in quant_linear.cpp; with AVX512-BF16 also the
// int4pack tile's dequantization. Included by quant_linear.cpp inside its namespace, after the shared helpers.

constexpr bool kTierVnni = true, kTierW4A8 = true, kTierBnbEpilogue = true;
constexpr int64_t kTierInt8MaxRows = kVnniMaxRows;

// fp32 -> bf16 bits; the rounding is c10::BFloat16's (nearest even; the values here are never NaN).
inline __m512i sluice_round_bf16(__m512 v) {  // the bf16 bits in the low half of each lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}

// dequant_tile's column k of a full split block of 64 rows (torch's AVX-512 int4pack layout) in bf16, 16 lanes at
// a time (fma, then the bf16 rounding of vcvtneps2bf16: nearest even); false where it does not apply.
template <typename T>
inline bool dequant_block64_tier(const Int4Layout& L, int64_t b0, int64_t rows, int64_t k, const float* scale,
                                 const float* zero, T* out) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (L.split && rows == 64 && L.block_n == 64 && b0 % 64 == 0 && b0 + 64 <= L.n_padded) {
      const uint8_t* col = L.packed + b0 * L.K / 2 + k * 32;
      const __m512i low4 = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
      for (int h = 0; h < 2; ++h) {  // bytes 16h..16h+15: rows 16h + j (low) and 32 + 16h + j (high)
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16 * h)));
        const __m512i parts[2] = {_mm512_and_si512(b, low4), _mm512_srli_epi32(b, 4)};
        for (int p = 0; p < 2; ++p) {
          const int r = 16 * h + 32 * p;
          const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(parts[p], eight));
          const __m512 w = _mm512_fmadd_ps(v, _mm512_loadu_ps(scale + r), _mm512_loadu_ps(zero + r));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r), (__m256i)_mm512_cvtneps_pbh(w));
        }
      }
      return true;
    }
  }
#endif
  return false;
}

// quantize_rows of bf16 rows, the same operations 16 lanes at a time (division, round to even); false for others.
inline bool quantize_rows_tier(const torch::Tensor& x, int8_t* q, float* s) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {  // the same operations 16 lanes at a time (division, round to even)
    const at::BFloat16* src = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / K), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const at::BFloat16* xm = src + m * K;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
          amax = _mm512_max_ps(amax, _mm512_abs_ps(sluice_load_bf16(xm + k, sluice_tail16(K - k))));
        const float sc = std::max(_mm512_reduce_max_ps(amax), 1e-12f) / 127.f;
        s[m] = sc;
        const __m512 vs = _mm512_set1_ps(sc);
        for (int64_t k = 0; k < K; k += 16) {
          const __mmask16 mask = sluice_tail16(K - k);
          const __m512i qv = _mm512_cvtps_epi32(_mm512_div_ps(sluice_load_bf16(xm + k, mask), vs));
          _mm_mask_storeu_epi8(q + m * K + k, mask, _mm512_cvtepi32_epi8(qv));
        }
      }
    });
    return true;
  }
  return false;
}

// bnb_int8_rows of a bf16 weight, 16 lanes at a time (the same fp16 roundings and factor); false for others.
inline bool bnb_int8_rows_tier(const torch::Tensor& w, int8_t* q, float* s, int64_t grain) {
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == at::kBFloat16) {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    auto as_half = [](__m512 x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, kNearest)); };
    const at::BFloat16* src = w.data_ptr<at::BFloat16>();
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const at::BFloat16* row = src + n * K;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
          amax = _mm512_max_ps(amax, _mm512_abs_ps(as_half(sluice_load_bf16(row + k, sluice_tail16(K - k)))));
        const float a = _mm512_reduce_max_ps(amax);
        s[n] = a;
        const __m512 f = _mm512_set1_ps(bnb_factor(a));
        for (int64_t k = 0; k < K; k += 16) {  // cvtps_epi32 rounds to even; a NaN lane becomes INT_MIN, byte 0
          const __mmask16 mask = sluice_tail16(K - k);
          const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(as_half(sluice_load_bf16(row + k, mask)), f));
          _mm_mask_storeu_epi8(q + n * K + k, mask, _mm512_cvtepi32_epi8(v));
        }
      }
    });
    return true;
  }
  return false;
}

// bnb_int8_act for bf16 rows, 16 values a step (the same fp16 rounding, comparisons, factor and rounding, in
// lanes): `cols` gets a bit per outlier column (16 a word), then each row's codes with its outliers zeroed, and
// its outlier columns zeroed where `zero_cols`.
inline bool bnb_int8_act_tier(const torch::Tensor& x, float thr, bool zero_cols, int8_t* q, float* s,
                              std::vector<uint16_t>& cols) {
  if (x.scalar_type() != at::kBFloat16) return false;
  const int64_t M = x.size(0), K = x.size(1);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  auto as_half = [](__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, kNearest)); };
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  const __m512 t = _mm512_set1_ps(thr);
  const bool split = thr > 0.f;
  auto outliers = [&](const at::BFloat16* p, __mmask16 mask) -> __mmask16 {
    return split ? _mm512_mask_cmp_ps_mask(mask, _mm512_abs_ps(as_half(sluice_load_bf16(p, mask))), t, _CMP_GE_OQ)
                 : static_cast<__mmask16>(0);
  };
  if (split)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; k += 16) cols[k / 16] |= outliers(src + m * K + k, sluice_tail16(K - k));
  at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const at::BFloat16* row = src + m * K;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = sluice_tail16(K - k);
        const __mmask16 keep = mask & ~outliers(row + k, mask);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_mov_ps(keep, as_half(sluice_load_bf16(row + k, mask)))));
      }
      const float a = _mm512_reduce_max_ps(amax);
      s[m] = a;
      const __m512 f = _mm512_set1_ps(bnb_factor(a));
      for (int64_t k = 0; k < K; k += 16) {  // cvtps_epi32 rounds to even; a NaN lane becomes INT_MIN, byte 0
        const __mmask16 mask = sluice_tail16(K - k);
        const __mmask16 keep = mask & ~outliers(row + k, mask) & (zero_cols ? ~cols[k / 16] : 0xFFFF);
        const __m512 h = _mm512_maskz_mov_ps(keep, as_half(sluice_load_bf16(row + k, mask)));
        const __m512i v = _mm512_maskz_mov_epi32(keep, _mm512_cvtps_epi32(_mm512_mul_ps(h, f)));
        _mm_mask_storeu_epi8(q + m * K + k, mask, _mm512_cvtepi32_epi8(v));
      }
    }
  });
  return true;
}

// bnb_4bit_blocks' codes of a full block, 16 values at a time (the same comparisons and clamp, in lanes): the
// count of bounds below each value, mapped, two codes a byte. Returns the values done (len rounded down to 16).
template <typename T>
int64_t bnb_4bit_codes16(const T* v, int64_t len, float scale, const float* bnd, const uint8_t* map, uint8_t* out) {
  __m512 bounds[15];
  for (int i = 0; i < 15; ++i) bounds[i] = _mm512_set1_ps(bnd[i]);
  alignas(64) int32_t order[16];
  for (int i = 0; i < 16; ++i) order[i] = map[i];
  const __m512i ordered = _mm512_load_si512(order), one = _mm512_set1_epi32(1);
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-1.f), hi = _mm512_set1_ps(1.f);
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) {
    __m512 x;
    if constexpr (std::is_same_v<T, float>) x = _mm512_loadu_ps(v + j);
    else x = sluice_load_bf16(v + j);
    x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, s), lo), hi);
    __m512i c = _mm512_setzero_si512();
    for (int i = 0; i < 15; ++i) c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(bounds[i], x, _CMP_LT_OQ), c, one);
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(c, ordered));  // code k in byte k
    const __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x00FF)), 4),
                                       _mm_srli_epi16(bytes, 8));  // (code 2i << 4) | code 2i + 1, 16-bit lanes
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j / 2), _mm_packus_epi16(pairs, pairs));
  }
  return j;
}

// bnb_4bit_blocks' codes of a full block where this tier has them for T (bf16, fp32): the values done.
template <typename T>
inline int64_t bnb_4bit_codes_tier(const T* v, int64_t len, float scale, const float* bnd, const uint8_t* map,
                                   uint8_t* out) {
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
    return bnb_4bit_codes16(v, len, scale, bnd, map, out);
  }
  return 0;
}

// int8_rescale into bf16, the same roundings 16 lanes at a time; false for other dtypes.
inline bool int8_rescale_tier(const torch::Tensor& acc, const torch::Tensor& rs, const torch::Tensor& col_scale,
                              const torch::Tensor& b, torch::Tensor& y) {
  const int64_t M = acc.size(0), N = acc.size(1);
  if (col_scale.scalar_type() == at::kBFloat16) {  // the same roundings 16 lanes at a time
    const int32_t* a = acc.data_ptr<int32_t>();
    const float* r = rs.data_ptr<float>();
    const at::BFloat16* cs = col_scale.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* out = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / N), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const __m512 rm = _mm512_set1_ps(r[m]);
        for (int64_t n = 0; n < N; n += 16) {
          const __mmask16 mask = sluice_tail16(N - n);
          const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, a + m * N + n)),
                                                       rm), sluice_load_bf16(cs + n, mask));
          __m512i h = sluice_round_bf16(v);
          if (bp != nullptr)
            h = sluice_round_bf16(_mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)),
                                                sluice_load_bf16(bp + n, mask)));
          _mm256_mask_storeu_epi16(out + m * N + n, mask, _mm512_cvtepi32_epi16(h));
        }
      }
    });
    return true;
  }
  return false;
}

// bitsandbytes' int8_mm_dequant of acc [M, N] into bf16: acc * (row[m] * col[n]) * 6.200124e-05, + bias, each
// an fp32 rounding in torch's order (an empty asm between the steps: under this file's fast-math flags the compiler
// may otherwise reassociate or fuse them), then to bf16, nearest even; false for another output dtype.
inline bool bnb_dequant_tier(const torch::Tensor& acc, const float* r, const float* c, const at::BFloat16* bp,
                             torch::Tensor& y) {
  if (y.scalar_type() != at::kBFloat16) return false;
  const int64_t M = acc.size(0), N = acc.size(1);
  const int32_t* a = acc.data_ptr<int32_t>();
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const __m512 k = _mm512_set1_ps(6.200124e-05f);
  at::parallel_for(0, M, std::max<int64_t>(1, at::internal::GRAIN_SIZE / N), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const __m512 rm = _mm512_set1_ps(r[m]);
      for (int64_t n = 0; n < N; n += 16) {
        const __mmask16 mask = sluice_tail16(N - n);
        __m512 t = _mm512_mul_ps(rm, _mm512_maskz_loadu_ps(mask, c + n));
        asm("" : "+v"(t));
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, a + m * N + n)), t);
        asm("" : "+v"(v));
        v = _mm512_mul_ps(v, k);
        asm("" : "+v"(v));
        if (bp != nullptr) v = _mm512_add_ps(v, sluice_load_bf16(bp + n, mask));
        _mm256_mask_storeu_epi16(out + m * N + n, mask, _mm512_cvtepi32_epi16(sluice_round_bf16(v)));
      }
    }
  });
  return true;
}

// LLM.int8()'s outlier columns added back to out [M, N] (bf16, in place): per output n each column c_k's weight
// dequantized as bitsandbytes' int8_vectorwise_dequant and rounded to bf16, (cb[n][c_k] * scb[n]) * (1/127) in
// fp32; the products with the outlier inputs xs[m][k] (bf16 values in fp32 [M, C]: bf16 x bf16 is exact in fp32,
// so an FMA adds what a product then a sum would) summed from 0 in column order, added to out[m][n] in fp32 and
// rounded to bf16 once, nearest even (an empty asm between the steps, as in bnb_dequant_tier). R rows at a time: R
// independent sums per column block.
template <int R>
inline void bnb_outlier_rows(const float* xs, int64_t C, const __m512* sub, at::BFloat16* out, int64_t N,
                             __mmask16 mask) {
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < C; ++k) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * C + k]), sub[k], acc[r]);  // the product is exact: one add
      asm("" : "+v"(acc[r]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 v = _mm512_add_ps(sluice_load_bf16(out + r * N, mask), acc[r]);
    _mm256_mask_storeu_epi16(out + r * N, mask, _mm512_cvtepi32_epi16(sluice_round_bf16(v)));
  }
}

inline bool bnb_outliers_tier(const float* xs, int64_t M, const int64_t* cols, int64_t C, const int8_t* cb, int64_t K,
                              const float* scb, at::BFloat16* out, int64_t N) {
  const __m512 inv127 = _mm512_set1_ps(7.874015718698502e-3f);
  at::parallel_for(0, (N + 15) / 16, std::max<int64_t>(1, at::internal::GRAIN_SIZE / (16 * C * (M + 1))),
                   [&](int64_t begin, int64_t end) {
    std::vector<__m512> sub(C);
    alignas(64) int32_t codes[16];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * 16;
      const __mmask16 mask = sluice_tail16(N - n0);
      const __m512 scale = _mm512_maskz_loadu_ps(mask, scb + n0);
      for (int64_t k = 0; k < C; ++k) {
        for (int j = 0; j < 16; ++j) codes[j] = n0 + j < N ? cb[(n0 + j) * K + cols[k]] : 0;
        __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(codes)), scale);
        asm("" : "+v"(w));
        w = _mm512_mul_ps(w, inv127);
        asm("" : "+v"(w));
        sub[k] = _mm512_castsi512_ps(_mm512_slli_epi32(sluice_round_bf16(w), 16));
      }
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) bnb_outlier_rows<8>(xs + m * C, C, sub.data(), out + m * N + n0, N, mask);
      for (; m < M; ++m) bnb_outlier_rows<1>(xs + m * C, C, sub.data(), out + m * N + n0, N, mask);
    }
  });
  return true;
}

constexpr int64_t kVnniBlock = 32;  // output rows per parallel task (a multiple of every W)

// A weight vector as the u8 operand of `vpdpbusd`: its sign bit flipped, w ^ 0x80 = w + 128 as u8 (a masked-off
// lane becomes 0x80, which meets an activation lane of 0: the padding).
inline __m512i vnni_weight(__m512i w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }

// W consecutive weight rows (w, K apart; Flip: as stored, else already flipped, as w4_requant_rows' are) against R
// activation rows (s8 codes, ldx apart, readable and 0 to K rounded up to 64; corr: each row's 128 x its sum):
// out[m * ldo + j] = sum_k x[m][k] * w[j][k]. The W rows are one contiguous run of memory.
template <int W, int R, bool Flip>
inline void vnni_tile(const int8_t* x, int64_t ldx, int64_t K, const int8_t* w, const int32_t* corr, int32_t* out,
                      int64_t ldo) {
  static_assert(W * R <= 16, "one reduction tree");
  __m512i acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {  // every block but a short last one loads unmasked
    const __mmask64 mask = k + 64 <= K ? ~0ULL : _bzhi_u64(~0ULL, K - k);
    __m512i wv[W];
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) {
      wv[j] = _mm512_maskz_loadu_epi8(mask, w + j * K + k);
      if constexpr (Flip) wv[j] = vnni_weight(wv[j]);
    }
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + m * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < W; ++j) acc[j * R + m] = _mm512_dpbusd_epi32(acc[j * R + m], wv[j], xv);
    }
  }
  __m512i done[16];  // a copy: acc's address never escapes, so it stays in registers through the loop
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) done[i] = acc[i];
  int32_t sums[W * R];
  sluice_sums<W * R>(done, sums);
  for (int j = 0; j < W; ++j)
    for (int m = 0; m < R; ++m) out[m * ldo + j] = sums[j * R + m] - corr[m];
}

// Output rows [n0, n1) of y [1, N] for one activation row (corr: its 128 x sum), weight rows one after another in
// memory order (one stream the hardware prefetcher runs ahead of; interleaved rows are as many short streams, read
// at about half the bandwidth), four accumulators per row so that the `vpdpbusd`s do not wait on one another.
inline void vnni_rows_one(const int8_t* x, int32_t corr, const int8_t* w, int64_t K, int64_t n0, int64_t n1,
                          int32_t* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 256 <= K; k += 256) {
      a0 = _mm512_dpbusd_epi32(a0, vnni_weight(_mm512_loadu_si512(wn + k)), _mm512_loadu_si512(x + k));
      a1 = _mm512_dpbusd_epi32(a1, vnni_weight(_mm512_loadu_si512(wn + k + 64)), _mm512_loadu_si512(x + k + 64));
      a2 = _mm512_dpbusd_epi32(a2, vnni_weight(_mm512_loadu_si512(wn + k + 128)), _mm512_loadu_si512(x + k + 128));
      a3 = _mm512_dpbusd_epi32(a3, vnni_weight(_mm512_loadu_si512(wn + k + 192)), _mm512_loadu_si512(x + k + 192));
    }
    for (; k < K; k += 64)  // the activation codes are readable (and 0) to K rounded up to 64
      a0 = _mm512_dpbusd_epi32(
          a0, vnni_weight(_mm512_maskz_loadu_epi8(_bzhi_u64(~0ULL, std::min<int64_t>(64, K - k)), wn + k)),
          _mm512_loadu_si512(x + k));
    y[n] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3))) - corr;
  }
}

// Output rows [n0, n1) of y [M, N] (rows N apart) for activation rows [0, M): tiles of W weight rows x R
// activation rows.
template <int W, bool Flip>
void vnni_rows(const int8_t* x, int64_t ldx, const int32_t* corr, int64_t M, const int8_t* w, int64_t K, int64_t N,
               int64_t n0, int64_t n1, int32_t* y) {
  constexpr int R = 16 / W > 4 ? 4 : 16 / W;
  int64_t n = n0;
  for (; n + W <= n1; n += W) {
    sluice_row_tiles<R>(0, M, [&](auto r, int64_t m) {
      vnni_tile<W, decltype(r)::value, Flip>(x + m * ldx, ldx, K, w + n * K, corr + m, y + m * N + n, N);
    });
  }
  for (; n < n1; ++n)  // the last N % W rows one at a time
    for (int64_t m = 0; m < M; ++m) vnni_tile<1, 1, Flip>(x + m * ldx, ldx, K, w + n * K, corr + m, y + m * N + n, N);
}

// Activation codes x [M, K] as the kernel reads them: rows Kp apart (K rounded up to 64), the padding 0 (it meets
// the flipped weight lanes past K, 0x80: products of 0), and per row 128 x the sum of its codes, what the weight's
// + 128 adds to each of its dot products.
struct VnniActs {
  std::vector<int8_t> codes;
  std::vector<int32_t> corr;
};

VnniActs vnni_activations(const int8_t* x, int64_t M, int64_t K, int64_t Kp) {
  VnniActs a{std::vector<int8_t>(M * Kp), std::vector<int32_t>(M)};
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m) {
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kp; k += 64) {
      const __mmask64 mask = k + 64 <= K ? ~0ULL : (k < K ? _bzhi_u64(~0ULL, K - k) : 0ULL);
      const __m512i v = _mm512_maskz_loadu_epi8(mask, x + m * K + k);
      _mm512_storeu_si512(a.codes.data() + m * Kp + k, v);
      sum = _mm512_dpbusd_epi32(sum, ones, v);
    }
    a.corr[m] = 128 * _mm512_reduce_add_epi32(sum);
  }
  return a;
}

// A block of weight rows read once in memory order, loads only: one stream the prefetcher runs ahead of, which
// leaves the block in cache for the tiles (interleaved rows read from memory are as many short streams).
inline void vnni_touch(const int8_t* p, int64_t bytes) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i + 64 <= bytes; i += 64) acc = _mm512_or_si512(acc, _mm512_loadu_si512(p + i));
  asm volatile("" : : "v"(acc));  // kept: the loads are what the pass is for
}

constexpr int64_t kVnniTouchRows = 8;  // activation rows from which each block is touched before its tiles

// One activation row: the weight rows one by one in memory order (vnni_rows_one). More: tiles of 8 weight rows x
// 1-2 activation rows (M <= 2: more weight rows in flight) or 4 x 4 over each thread's run of 32-row blocks, from
// kVnniTouchRows rows block by block after a pass of loads over the block (vnni_touch): there the tiles' work per
// weight byte is large enough that reading the block twice (once from memory in order, once from cache) beats
// reading it once as interleaved streams; below, not (docs/benchmarks.md). Nothing is computed per weight row:
// the weight's + 128 is corrected by the activation rows' sums.
void vnni_mm(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int64_t N, int32_t* y) {
  const int64_t Kp = (K + 63) / 64 * 64;
  const VnniActs a = vnni_activations(x, M, K, Kp);
  const int8_t* xp = a.codes.data();
  const int32_t* corr = a.corr.data();
  at::parallel_for(0, (N + kVnniBlock - 1) / kVnniBlock, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kVnniBlock, n1 = std::min(N, b1 * kVnniBlock);
    if (M == 1) {
      vnni_rows_one(xp, corr[0], w, K, n0, n1, y);
    } else if (M == 2) {
      vnni_rows<8, true>(xp, Kp, corr, M, w, K, N, n0, n1, y);
    } else if (M < kVnniTouchRows) {
      vnni_rows<4, true>(xp, Kp, corr, M, w, K, N, n0, n1, y);
    } else {
      for (int64_t s = n0; s < n1; s += kVnniBlock) {
        const int64_t e = std::min(n1, s + kVnniBlock);
        vnni_touch(w + s * K, (e - s) * K);
        vnni_rows<4, true>(xp, Kp, corr, M, w, K, N, s, e, y);
      }
    }
  });
}

// int8_mm's product for rows the tier serves (at most kTierInt8MaxRows).
inline void tier_int8_mm(const int8_t* x, int64_t M, const int8_t* w, int64_t K, int64_t N, int32_t* y) {
  vnni_mm(x, M, w, K, N, y);
}

#include "w4a8_avx512.h"

// Weight rows [n0, n0 + rows) of our int4 layout requantized to int8 rows [rows, K] with one absmax scale per
// row (as the int8 weight-only linears store theirs), their sign bits flipped as the VNNI tiles read them
// (vnni_weight: the flip is folded into the table). A row's
// absmax comes from its groups' ends, z - 8 s and z + 7 s (the codes 0 and 15, which `quantize` gives each
// group's minimum and maximum), so every weight is dequantized and requantized in one fused step.
void w4_requant_rows(const uint8_t* q, const uint16_t* sz, int64_t K, int64_t Kp, int64_t n0, int64_t rows,
                     int8_t* out, float* scales) {
  const int64_t Gp = Kp / kW4Group, G = K / kW4Group, block_chunks = Kp / kW4Chunk / 4 * 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* qr = q + (n0 + r) * (Kp / 2);
    const uint16_t* sr = sz + (n0 + r) * 2 * Gp;
    float amax = 0.f;
    for (int64_t p = 0; p < Gp; ++p) {  // padded groups have s = z = 0
      const float sv = sluice_bf16_to_float(sr[p]), base = sluice_bf16_to_float(sr[Gp + p]) - 8.f * sv;
      amax = std::max({amax, std::abs(base), std::abs(std::fma(15.f, sv, base))});
    }
    const float scale = std::max(amax, 1e-30f) / 127.f, inv = 1.f / scale;
    int8_t* o = out + r * K;
    const __m512 qv = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t c = 0; c * 4 < G; ++c) {
      // each group's 16 possible weights, round((q s + z - 8 s) / scale) for q = 0..15, in its 128-bit lane:
      // one byte shuffle per half chunk then requantizes 64 codes
      __m128i tables[4];
      for (int l = 0; l < 4; ++l) {
        const int64_t g = std::min(4 * c + l, G - 1), pos = w4_pos(g, block_chunks);
        const float sv = sluice_bf16_to_float(sr[pos]), base = sluice_bf16_to_float(sr[Gp + pos]) - 8.f * sv;
        tables[l] = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(
            _mm512_fmadd_ps(qv, _mm512_set1_ps(sv * inv), _mm512_set1_ps(base * inv))));
      }
      const __m512i lut = vnni_weight(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(
          _mm512_castsi128_si512(tables[0]), tables[1], 1), tables[2], 2), tables[3], 3));
      const __m512i v = _mm512_loadu_si512(qr + c * 64);
      const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));
      const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      // group l's 32 columns are its low half's lane l, then its high half's
      const __m512i a = _mm512_permutex2var_epi64(lo, first, hi), b = _mm512_permutex2var_epi64(lo, second, hi);
      const int64_t left = K - 128 * c;  // a multiple of 32
      const __mmask64 ma = left >= 64 ? ~0ULL : _bzhi_u64(~0ULL, left);
      const __mmask64 mb = left >= 128 ? ~0ULL : (left > 64 ? _bzhi_u64(~0ULL, left - 64) : 0ULL);
      _mm512_mask_storeu_epi8(o + 128 * c, ma, a);
      _mm512_mask_storeu_epi8(o + 128 * c + 64, mb, b);
    }
    scales[r] = scale;
  }
}

// int4_vnni_int8_mm's product into y [M, N] (arguments checked).
void w4_int8_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_zeros,
                const c10::optional<torch::Tensor>& bias, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), Kp = packed.size(1) * 2;
  const auto xq = quantize_rows(x);
  const int8_t* xc = xq[0].data_ptr<int8_t>();
  const float* xs = xq[1].data_ptr<float>();
  const int64_t K64 = (K + 63) / 64 * 64;
  const VnniActs a = vnni_activations(xc, M, K, K64);
  torch::Tensor b = bias.has_value() ? bias->contiguous().to(torch::kFloat32) : torch::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "int4_vnni_int8_mm: bias must have N values");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const uint8_t* q = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  const int8_t* xa = a.codes.data();
  const int32_t* corr = a.corr.data();
  at::parallel_for(0, (N + kVnniBlock - 1) / kVnniBlock, 1, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<int8_t> w8;
    static thread_local std::vector<float> wscale;
    static thread_local std::vector<int32_t> y32;
    w8.resize(kVnniBlock * K);
    wscale.resize(kVnniBlock);
    y32.resize(M * kVnniBlock);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kVnniBlock, rows = std::min(kVnniBlock, N - n0);
      w4_requant_rows(q, sz, K, Kp, n0, rows, w8.data(), wscale.data());
      vnni_rows<4, false>(xa, K64, corr, M, w8.data(), K, rows, 0, rows, y32.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < rows; j += 16) {  // y32 x row scale x weight scale (+ bias), one rounding
          const __mmask16 mask = sluice_tail16(rows - j);
          __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, &y32[m * rows + j])),
                                                 _mm512_set1_ps(xs[m])), _mm512_maskz_loadu_ps(mask, &wscale[j]));
          if (bp != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + n0 + j));
          _mm256_mask_storeu_epi16(yp + m * N + n0 + j, mask, _mm512_cvtepi32_epi16(sluice_round_bf16(v)));
        }
    }
  });
}
