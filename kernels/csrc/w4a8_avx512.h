// The AVX512-VNNI tier of quant_linear.cpp's int8 x int4 product (`int4_vnni_mm`) on the layout and activations
// of w4a8.h: per chunk one 64-byte load of a weight row's codes, low and high nibbles times the activations by
// `vpdpbusd` (int32 lanes 4 g .. 4 g + 3 sum group g of the chunk), a block of four chunks' sums transposed and
// added to the 16 group sums (the scales' order) and scaled at once. Included by quant_linear_avx512.h.

// x row [K] (bf16 bits) -> the quantized activations (groups past K: a = 0, d = 0, sum = 0).
inline void w4_quantize_row(const uint16_t* x, int64_t K, int64_t Kp, const W4Acts& r) {
  w4_clear_row(r, Kp);
  int8_t* a = r.a;
  float *d = r.d, *sum = r.sum, *off = r.off;
  const int64_t block_chunks = Kp / kW4Chunk / 4 * 4;
  for (int64_t g = 0; g < K / kW4Group; ++g) {
    const int64_t pos = w4_pos(g, block_chunks);
    const __m512 lo = sluice_load_bf16(x + 32 * g), hi = sluice_load_bf16(x + 32 * g + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float dg = amax / 127.f;
    const int64_t c = g / 4, j = g % 4;
    int8_t* at = a + c * kW4Chunk + 16 * j;
    if (amax > 0.f) {
      const __m512 dv = _mm512_set1_ps(dg);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, dv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 64), _mm512_cvtepi32_epi8(qhi));
      off[pos] = -8.f * dg * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    }
    w4_store_d(d, g, pos, block_chunks, dg);
    sum[pos] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}

// bf16 scales of chunk c (four groups) to fp32 lanes: lane l holds the scale of group 4 c + l / 4.
inline __m512 w4_lane_scales(const uint16_t* s, int64_t c) {
  const __m512i ctl = _mm512_set_epi8(7, 6, -1, -1, 7, 6, -1, -1, 7, 6, -1, -1, 7, 6, -1, -1,
                                      5, 4, -1, -1, 5, 4, -1, -1, 5, 4, -1, -1, 5, 4, -1, -1,
                                      3, 2, -1, -1, 3, 2, -1, -1, 3, 2, -1, -1, 3, 2, -1, -1,
                                      1, 0, -1, -1, 1, 0, -1, -1, 1, 0, -1, -1, 1, 0, -1, -1);
  int64_t four;
  std::memcpy(&four, s + 4 * c, 8);
  return _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi64(four), ctl));
}

// Four int32 vectors of a block's chunks (lane 4 g + p: part p of group g of the chunk) to the 16 group sums,
// lane 4 g + c holding chunk c's group g.
inline __m512i w4_transpose_add(const __m512i* d) {
  const __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
  const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
}

// W weight rows (codes `q`, row stride Kp / 2; scales/zeros `sz`, row stride 2 Gp) against R activation rows:
// out[m * ldo + j] = the fp32 dot product. Rows one after another (memory order: one stream for the prefetcher),
// each into its own R accumulators; the W x R sums are reduced at once at the end.
template <int W, int R>
inline void w4_tile(const W4Acts* acts, int64_t Kp, const uint8_t* q, const uint16_t* sz, const at::BFloat16* bias,
                    at::BFloat16* out, int64_t ldo) {
  static_assert(W * R <= 16, "one reduction tree");
  const int64_t Gp = Kp / kW4Group, row = Kp / 2, chunks = Kp / kW4Chunk, blocks = chunks / 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int j = 0; j < W; ++j) {
    const uint8_t* qj = q + j * row;
    const uint16_t* sj = sz + j * 2 * Gp;
    __m512 a[R];
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) a[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {  // whole blocks: one conversion and scaling per 16 groups
      __m512i dots[R][4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(qj + (4 * b + c) * 64);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 16
        for (int m = 0; m < R; ++m) {
          const int8_t* am = acts[m].a + (4 * b + c) * kW4Chunk;
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(am));
          dots[m][c] = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(am + 64));
        }
      }
      const __m512 s = sluice_load_bf16(sj + 16 * b);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const __m512 ds = _mm512_mul_ps(s, _mm512_loadu_ps(acts[m].d + 64 * b));
        a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(w4_transpose_add(dots[m])), ds, a[m]);
      }
    }
    for (int64_t c = 4 * blocks; c < chunks; ++c) {  // the chunks after them, one at a time
      const __m512i v = _mm512_loadu_si512(qj + c * 64);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const __m512 s = w4_lane_scales(sj, c);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const int8_t* am = acts[m].a + c * kW4Chunk;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(am));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(am + 64));
        const __m512 ds = _mm512_mul_ps(s, _mm512_loadu_ps(acts[m].d + c * 16));
        a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ds, a[m]);
      }
    }
    for (int64_t g = 0; g < Gp; g += 16) {  // per group: s * (- 8 d sum a) + z * sum x
      const __mmask16 mask = static_cast<__mmask16>(_bzhi_u32(0xFFFF, static_cast<uint32_t>(std::min<int64_t>(16, Gp - g))));
      const __m512 s = sluice_load_bf16(sj + g, mask), z = sluice_load_bf16(sj + Gp + g, mask);
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const __m512 zx = _mm512_fmadd_ps(z, _mm512_maskz_loadu_ps(mask, acts[m].sum + g), a[m]);
        a[m] = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mask, acts[m].off + g), zx);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) acc[j * R + m] = a[m];
  }
  float sums[W * R];
  sluice_sums<W * R>(acc, sums);
  for (int j = 0; j < W; ++j) {  // the bias in fp32, one rounding to bf16
    const float b = bias != nullptr ? static_cast<float>(bias[j]) : 0.f;
    for (int m = 0; m < R; ++m) out[m * ldo + j] = static_cast<at::BFloat16>(sums[j * R + m] + b);
  }
}

// Output rows [n0, n1) of y [M, N]: tiles of 4 weight rows x 4 activation rows (8 or 16 weight rows at one or two
// activation rows measured no faster), the last N % 4 rows one at a time.
void w4_rows(const W4Acts* acts, int64_t M, int64_t Kp, const uint8_t* q, const uint16_t* sz,
             const at::BFloat16* bias, int64_t n0, int64_t n1, at::BFloat16* y, int64_t N) {
  const int64_t row = Kp / 2, Gp = Kp / kW4Group;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const uint8_t* qn = q + n * row;
    const uint16_t* sn = sz + n * 2 * Gp;
    const at::BFloat16* bn = bias != nullptr ? bias + n : nullptr;
    sluice_row_tiles<4>(0, M, [&](auto r, int64_t m) {
      w4_tile<4, decltype(r)::value>(acts + m, Kp, qn, sn, bn, y + m * N + n, N);
    });
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      w4_tile<1, 1>(acts + m, Kp, q + n * row, sz + n * 2 * Gp, bias != nullptr ? bias + n : nullptr, y + m * N + n, N);
}
