// The int8 x int4 (W4A8) product's weight layout and quantized activations, shared by its tiers
// (w4a8_avx512.h: AVX512-VNNI, w4a8_avx2.h: AVX2), and the scalar logic of both: the scratch the quantized
// activation rows live in (each tier quantizes them, the same codes) and the dequantization to fp32.
// Included by quant_linear.cpp inside its namespace.
//
// Our int4 layout (kernels/int4_weights.py `pack`, layout "vnni"): K padded to Kp, a multiple of 128, with
// code 0 and scale/zero 0 (adds nothing). Row n's codes are Kp / 2 bytes, 64 per chunk of 128 columns; in chunk
// c byte 16 g + j (g < 4) holds column 128 c + 32 g + j in its low nibble and 128 c + 32 g + 16 + j in its high,
// so after a byte dot product (`vpdpbusd`, `vpmaddubsw`) on the low and the high nibbles int32 lanes 4 g .. 4 g + 3 sum group 4 c + g only. Scales
// and zeros are bf16 [N, 2, Kp / 32] (w = (q - 8) * s + z per group of 32), in the kernel's order (`w4_pos`):
// per block of four chunks (16 groups) position 4 g + c holds group 4 c + g of the block, the order in which a
// four-way transpose-add of the block's four int32 dot products leaves the 16 group sums; chunks past the last
// whole block keep group order. Activations are quantized per group of 32 (x ~ d a, absmax / 127, as llama.cpp's
// q8_0): sum_k w x = sum_g s_g d_g (sum q a - 8 sum a) + z_g sum x. (The - 8 sum a keeps the error that of the
// centred codes q - 8: summing q a alone would weigh the activations' rounding by q, a larger error.)
constexpr int64_t kW4Chunk = 128, kW4Group = 32;
constexpr int64_t kW4Block = 32;  // output rows per parallel task (a multiple of every tile's rows)

// Position of group g among a row's scales when the first `block_chunks` chunks form whole blocks of four.
inline int64_t w4_pos(int64_t g, int64_t block_chunks) {
  const int64_t c = g / 4;
  return c < block_chunks ? (c / 4) * 16 + (g % 4) * 4 + c % 4 : g;
}

struct W4Acts {  // one activation row, quantized and laid out for the kernel (in a per-thread scratch)
  int8_t* a;   // [Kp]: per chunk 64 bytes of low halves, then 64 of high halves
  float* d;    // [Kp / 128 * 16]: block b: d in the scales' order at 64 b; a chunk c after the blocks: 16 c + l
               // holds d of group 4 c + l / 4
  float* sum;  // [Kp / 32 + 8]: sum of the group's x (exact fp32, not the quantized values), the scales' order
  float* off;  // [Kp / 32 + 8]: - 8 d sum a, the codes' offset against the quantized values, the scales' order
};  // (a tier may keep d, sum and off in its own order: w4a8_avx2.h; the arrays past the groups hold zeros)

// bf16 bits -> fp32 (exact).
inline float sluice_bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The quantized row's arrays cleared: groups past K keep a = 0, d = 0, sum = 0, off = 0.
inline void w4_clear_row(const W4Acts& r, int64_t Kp) {
  std::memset(r.a, 0, Kp);
  std::memset(r.d, 0, Kp / 8 * sizeof(float));
  std::memset(r.sum, 0, (Kp / 32 + 8) * sizeof(float));
  std::memset(r.off, 0, (Kp / 32 + 8) * sizeof(float));
}

// Group g's d in the row's d array (the layout W4Acts describes).
inline void w4_store_d(float* d, int64_t g, int64_t pos, int64_t block_chunks, float dg) {
  const int64_t c = g / 4;
  if (c < block_chunks) d[(c / 4) * 64 + pos % 16] = dg;
  else for (int t = 0; t < 4; ++t) d[c * 16 + 4 * (g % 4) + t] = dg;
}

// Weight row j of our layout (codes qj, scales/zeros sj) dequantized to fp32 out [K]: w = (q - 8) s + z per group,
// one rounding (fma). Plain loops over each group's 16 bytes, which the compiler vectorizes with the tier's flags.
inline void w4_dequant_row(const uint8_t* qj, const uint16_t* sj, int64_t K, int64_t Kp, float* out) {
  const int64_t Gp = Kp / kW4Group, block_chunks = Kp / kW4Chunk / 4 * 4;
  for (int64_t g = 0; g < K / kW4Group; ++g) {
    const int64_t pos = w4_pos(g, block_chunks);
    const float s = sluice_bf16_to_float(sj[pos]), z = sluice_bf16_to_float(sj[Gp + pos]);
    const uint8_t* b = qj + (g / 4) * (kW4Chunk / 2) + 16 * (g % 4);
    float* o = out + kW4Group * g;
    for (int j = 0; j < 16; ++j) o[j] = std::fma(static_cast<float>((b[j] & 15) - 8), s, z);
    for (int j = 0; j < 16; ++j) o[16 + j] = std::fma(static_cast<float>((b[j] >> 4) - 8), s, z);
  }
}

// M rows' W4Acts in a per-thread scratch kept between calls (a decode step makes ~50 products).
inline W4Acts* w4_scratch(int64_t M, int64_t Kp) {
  const int64_t Gp = Kp / kW4Group + 8, per_row = Kp + (Kp / 8 + 2 * Gp) * static_cast<int64_t>(sizeof(float));
  static thread_local std::vector<float> scratch;  // floats: 4-byte aligned for every part
  static thread_local std::vector<W4Acts> acts;
  if (scratch.size() * sizeof(float) < static_cast<size_t>(M * per_row)) scratch.resize(M * per_row / sizeof(float) + 1);
  acts.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    char* base = reinterpret_cast<char*>(scratch.data()) + m * per_row;
    float* f = reinterpret_cast<float*>(base + Kp);
    acts[m] = W4Acts{reinterpret_cast<int8_t*>(base), f, f + Kp / 8, f + Kp / 8 + Gp};
  }
  return acts.data();
}
