// The int8 product from weights packed into panels (AVX512-VNNI): quant_linear.cpp includes it on that tier, after
// quant_linear_avx512.h, inside its namespace.
//
// As bf16_panels.h does for bf16: a row-major int8 weight makes each output a dot product summed across lanes at
// the end (vnni_tile's reduction trees) and re-reads x rows for every few weight rows. Packed into panels of
// kInt8Panel outputs, each K quad of the panel's outputs in one 64-byte line with the sign bits flipped (w + 128,
// the u8 operand of `vpdpbusd`), a quad of x codes broadcast to every lane is `vpdpbusd`-ed with four such lines
// into the sums of 64 outputs of one row: no reduction, the panel streamed once per four x rows, x rows from L1.
// The flip adds 128 x (the row's code sum) to each sum, taken off at the end as vnni_mm does: the same exact
// int32 sums as torch._int_mm at every row count.

constexpr int64_t kInt8Panel = kPanelWidth;    // outputs of a panel (panels.h): four vectors of 16 int32
constexpr int64_t kInt8PanelXBytes = 1 << 18;  // x codes a task keeps in L2 across the panels it runs (256 KiB)

// [ceil(N / 64), ceil(K / 4), 64, 4] int8: w[n][k] ^ 0x80 at ((n / 64) * K4 + k / 4) * 256 + (n % 64) * 4 + k % 4;
// the padding (outputs past N, K up to a multiple of 4) 0x80, a u8 0 (it meets x codes of 0 past K).
torch::Tensor pack_int8_panels(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "pack_int8_panels: a contiguous CPU int8 weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kInt8Panel - 1) / kInt8Panel, K4 = (K + 3) / 4;
  auto out = torch::full({P, K4, kInt8Panel, 4}, static_cast<int8_t>(-128), w.options());
  sluice_pack_panels<4>(w.data_ptr<int8_t>(), N, K, out.data_ptr<int8_t>(),
                        [](int8_t v) { return static_cast<int8_t>(v ^ 0x80); });
  return out;
}

// The flipped sums of M code rows against one panel: acc[m][v] holds outputs [16 v, 16 v + 16) of row m.
template <int M>
inline void int8_panel_tile(const int8_t* x, int64_t ldx, const int8_t* panel, int64_t K, __m512i (&acc)[M][4]) {
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_si512();
  auto step = [&](const int8_t* line, const int32_t* quads) {
    __m512i wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(line + 64 * v);
    for (int m = 0; m < M; ++m) {
      const __m512i xb = _mm512_set1_epi32(quads[m]);
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], wv[v], xb);
    }
  };
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    int32_t quads[M];
    for (int m = 0; m < M; ++m) std::memcpy(quads + m, x + m * ldx + k, 4);
    step(panel + k * kInt8Panel, quads);
  }
  if (k < K) {  // K % 4 codes, zeros past them
    int32_t quads[M] = {};
    for (int m = 0; m < M; ++m) std::memcpy(quads + m, x + m * ldx + k, K - k);
    step(panel + k * kInt8Panel, quads);
  }
}

// y[M, N] = x[M, K] · W[N, K]ᵀ in exact int32 from W's panels: tasks of (a block of code rows that stays in L2,
// a panel), the block's rows four at a time against the panel.
void int8_panels_product(const int8_t* x, int64_t M, const int8_t* panels, int64_t K, int64_t N, int32_t* y) {
  std::vector<int32_t> corr(M);  // 128 x each row's code sum: what the flipped weights add to its sums
  for (int64_t m = 0; m < M; ++m) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += x[m * K + k];
    corr[m] = 128 * sum;
  }
  const int64_t P = (N + kInt8Panel - 1) / kInt8Panel, K4 = (K + 3) / 4;
  const int64_t most = std::max<int64_t>(4, kInt8PanelXBytes / K / 4 * 4);
  const int64_t blocks = (M + most - 1) / most;
  const int64_t block = ((M + blocks - 1) / blocks + 3) / 4 * 4;
  at::parallel_for(0, blocks * P, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / P, p = t % P, m1 = std::min(M, (b + 1) * block);
      const int8_t* panel = panels + p * K4 * 4 * kInt8Panel;
      const int64_t n0 = p * kInt8Panel, n = std::min(kInt8Panel, N - n0);
      sluice_row_tiles<4>(b * block, m1, [&](auto tile, int64_t m) {
        constexpr int T = decltype(tile)::value;
        __m512i acc[T][4];
        int8_panel_tile<T>(x + m * K, K, panel, K, acc);
        for (int v = 0; v < 4 && 16 * v < n; ++v) {
          const __mmask16 mask = n - 16 * v >= 16 ? static_cast<__mmask16>(0xFFFF)
                                                  : static_cast<__mmask16>((1u << (n - 16 * v)) - 1);
          for (int r = 0; r < T; ++r)
            _mm512_mask_storeu_epi32(y + (m + r) * N + n0 + 16 * v, mask,
                                     _mm512_sub_epi32(acc[r][v], _mm512_set1_epi32(corr[m + r])));
        }
      });
    }
  });
}
