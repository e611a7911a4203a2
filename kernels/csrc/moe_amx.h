// The AMX tier of moe.cpp: bf16 experts' products as AMX tile multiplies (`tdpbf16ps`), included by moe.cpp inside
// its namespace after Grouping, kBlock and silu_mul (immintrin.h is included at its top).
//
// The weights stay as the checkpoint stores them (row-major [out, in]): 16 weight rows x 32 of their columns are an
// A tile loaded straight from them, and the step's tokens are the B tile, packed once per call in AMX's pair layout
// (16 column pairs x 16 tokens: each expert's tokens padded to whole groups of 16 with zeros). A C tile is thus 16
// weight rows x 16 tokens of fp32 sums, its token columns independent, so the padding never reaches a real token.
// Experts whose widths are not whole multiples of 32 take the vdpbf16ps tiles instead.
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

constexpr int64_t kTok = 16;  // tokens per B / C tile
constexpr int64_t kDepth = 32;  // bf16 columns of K per A tile (16 pairs)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether Linux lets this process use AMX's tile data (asked once; oneDNN asks the same for torch's matmuls).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return ok;
}

// This thread's tiles: 0-3 C (16 rows x 16 fp32), 4 and 6 A (16 rows x 32 bf16), 5 B (16 pairs x 16 tokens).
inline void configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Token j of a packed group (its rows of K in pairs: element k of token j at (k / 2) * 32 + j * 2 + k % 2).
inline void pack_row(const at::BFloat16* src, int64_t K, int64_t j, at::BFloat16* group) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(group) + j;
  for (int64_t p = 0; p < K / 2; ++p) d[p * kTok] = s[p];
}

// C tiles 0..R-1 (R weight row tiles of 16) = rows [r0, r0 + 16 R) of w ([*, K] row-major) x the 16 packed tokens.
template <int R>
inline void multiply(const at::BFloat16* const* w, int64_t K, const at::BFloat16* tokens) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t stride = K * 2;
  for (int64_t k = 0; k < K; k += kDepth) {
    _tile_loadd(5, tokens + k * kTok, 64);
    _tile_loadd(4, w[0] + k, stride);
    _tile_loadd(6, w[1] + k, stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 6, 5);
    if constexpr (R == 4) {
      _tile_loadd(4, w[2] + k, stride);
      _tile_loadd(6, w[3] + k, stride);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 6, 5);
    }
  }
}

// One layer's bf16 experts over a grouped step with AMX tiles (H and I multiples of 32).
struct Layer {
  const std::vector<const at::BFloat16*>& gate;
  const std::vector<const at::BFloat16*>& up;
  const std::vector<const at::BFloat16*>& down;
  int64_t H, I;
  const Grouping& g;
  std::vector<at::BFloat16>& xs;  // the grouped tokens, packed: expert e's group c at (base[e] + 16 c) * H
  std::vector<at::BFloat16>& hs;  // silu(gate) * up, packed the same way at (base[e] + 16 c) * I
  std::vector<int64_t>& base;     // per expert: its first padded token slot

  void gather(const at::BFloat16* x) {
    const int64_t E = static_cast<int64_t>(g.start.size()) - 1;
    base.assign(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = g.start[e + 1] - g.start[e];
      base[e + 1] = base[e] + (n + kTok - 1) / kTok * kTok;
    }
    xs.assign(base[E] * H, at::BFloat16(0.f));
    hs.assign(base[E] * I, at::BFloat16(0.f));
    for (const int64_t e : g.active) {
      for (int64_t j = 0; j < g.start[e + 1] - g.start[e]; ++j) {
        pack_row(x + g.token[g.start[e] + j] * H, H, j % kTok, xs.data() + (base[e] + j / kTok * kTok) * H);
      }
    }
  }

  void gate_up() {  // tasks: (active expert, block of 32 expert columns); gate rows in C 0-1, up rows in C 2-3
    const int64_t blocks = I / kBlock, tasks = static_cast<int64_t>(g.active.size()) * blocks;
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      configure();
      alignas(64) float c[4][16][kTok];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t e = g.active[t / blocks], o0 = (t % blocks) * kBlock, n = g.start[e + 1] - g.start[e];
        const at::BFloat16* w[4] = {gate[e] + o0 * H, gate[e] + (o0 + 16) * H, up[e] + o0 * H, up[e] + (o0 + 16) * H};
        for (int64_t j0 = 0; j0 < n; j0 += kTok) {
          multiply<4>(w, H, xs.data() + (base[e] + j0) * H);
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          at::BFloat16* group = hs.data() + (base[e] + j0) * I;
          for (int64_t j = 0; j < std::min(kTok, n - j0); ++j) {
            float a[kBlock], b[kBlock];
            at::BFloat16 h[kBlock];
            for (int64_t o = 0; o < kBlock; ++o) {
              a[o] = c[o / 16][o % 16][j];
              b[o] = c[2 + o / 16][o % 16][j];
            }
            silu_mul(a, b, kBlock, h);
            for (int64_t o = 0; o < kBlock; ++o) group[((o0 + o) / 2) * 2 * kTok + j * 2 + (o0 + o) % 2] = h[o];
          }
        }
      }
      _tile_release();
    });
  }

  void down_combine(float* acc, at::BFloat16* out, int64_t T) {  // tasks: blocks of 32 hidden columns
    at::parallel_for(0, H / kBlock, 1, [&](int64_t b0, int64_t b1) {
      configure();
      alignas(64) float c[2][16][kTok];
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t o0 = blk * kBlock;
        for (const int64_t e : g.active) {
          const int64_t p0 = g.start[e], n = g.start[e + 1] - p0;
          const at::BFloat16* w[2] = {down[e] + o0 * I, down[e] + (o0 + 16) * I};
          for (int64_t j0 = 0; j0 < n; j0 += kTok) {
            multiply<2>(w, I, hs.data() + (base[e] + j0) * I);
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            for (int64_t j = 0; j < std::min(kTok, n - j0); ++j) {
              float* dst = acc + g.token[p0 + j0 + j] * H + o0;
              const float wt = g.weight[p0 + j0 + j];
              for (int64_t o = 0; o < kBlock; ++o) dst[o] += wt * c[o / 16][o % 16][j];
            }
          }
        }
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t o = 0; o < kBlock; ++o) out[t * H + o0 + o] = at::BFloat16(acc[t * H + o0 + o]);
        }
      }
      _tile_release();
    });
  }
};

}  // namespace amx
