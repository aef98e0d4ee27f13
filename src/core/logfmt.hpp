#pragma once
// LogFMT-10: combine's compressed wire format for bf16 partials (DeepEP's low-latency
// `use_logfmt`). One header for the kernels and the CPU reference (src/reference/logfmt.cpp):
// every function here is plain C++ on the host and __host__ __device__ under nvcc, and gives the
// same bits on both (see "Same bits on host and device").
//
// Block. A row of `hidden` bf16 values (hidden a multiple of 128) is cut into blocks of 128
// consecutive values. Each block carries one metadata word: the bf16 bits of amax = max |x| and
// amin = min |x| over the block (zeros included), exact since the values are bf16.
//
// Levels. From the metadata, l_max = log2(amax), l_min = max(log2(amin), l_max - 32) (so a block
// spans at most 2^32; amin 0 gives l_max - 32), step = (l_max - l_min) / 510. A magnitude is a
// 9-bit code c: c = 0 is zero, c in 1..511 is the level 2^(l_min + (c - 1) * step), so code 1 is
// 2^l_min and code 511 is amax (decoded as amax itself, exactly). The sign is a separate bit.
//
// Rounding. A magnitude takes the level nearest to it on the linear scale (not the log scale):
// c = floor((log2|x| - l_min) / step + 2 - log2((1 + 2^step) / 2) / step), clamped to 0..511;
// log2((1 + 2^step) / 2) is where the midpoint of two neighbouring levels falls, in steps.
// Values below about 2^l_min round to 0 or to code 1; 0 stays 0; |x| == amax gives 511.
//
// Error bound (per value, for amax finite). With r = 2^step and rho = (r - 1) / (r + 1):
//   2^l_min <= |x| <= amax:  |decode - x| <= (rho + kRelSlack) * |x| + kAbsSlack
//   |x| < 2^l_min:           |decode - x| <= 2^l_min   (only in blocks spanning more than 2^32
//                                                       or holding a zero)
// rho is at most 0.0217 (a block spanning 2^32); a block of 128 normal samples spans about 2^8
// to 2^15 (rho 0.0054 to 0.01). The sign is exact; a block whose |x| are all equal is exact.
// kRelSlack covers f32 arithmetic in the log domain (an argument near 2^7 carries 2^-17 of
// absolute error, 2^-17 ln 2 relative in the level) and the polynomial log2/exp2 below (each
// within a few ulps); kAbsSlack the rounding of levels that fall among f32's subnormals.
//
// Degenerate blocks. All zero: meta (0, 0), all codes 0, decodes to signed zeros. A block holding
// an inf or a NaN decodes to NaN in all its 128 values (the meta's amax is the non-finite value);
// a sum that meets it is NaN where bf16's would be inf or NaN in one column only.
//
// Row layout, bytes (row_bytes(hidden) = 41 * hidden / 32 in all):
//   [0, hidden / 32)            meta word of block b at 4 * b: bf16 amax | bf16 amin << 16
//   [hidden / 32, row_bytes)    payload: group g of 16 values (values 16g .. 16g + 15) at
//                               hidden / 32 + 20 * g, as five little-endian u32 words: code j in
//                               bits [9j, 9j + 9) of the 160 bits, sign j in bit 144 + j
// Areas that hold rows use row_stride(hidden), the row rounded up to 16 bytes (no padding for
// hidden a multiple of 512). At hidden 7168: 9184 bytes against 14336 of bf16, 0.640625.
//
// This is DeepEP's format (csrc/kernels/legacy/internode_ll.cu at dd758ca: logfmt_encode,
// logfmt_check_amaxmin, decode_and_accumulate) in its block, metadata, code, rounding, 20-byte
// group and byte counts, with two differences: every block is encoded (DeepEP sends a chunk of
// 512 or 1024 values as raw bf16 when one of its blocks has amax >= 1 or amin == amax, which
// makes rows vary in size; the relative error here does not depend on the scale, and blocks of
// equal magnitudes are exact), and code 511 decodes to amax exactly.
//
// Same bits on host and device. Only IEEE operations whose results are fixed: +, -, *, /, fmaf
// (explicit, never left to contraction: the only products that feed an addition are exact
// scalings by powers of two, which contraction cannot change), floor and bit manipulation. log2 and
// exp2 are polynomials written here, not the libraries' (whose last bits differ between glibc and
// CUDA) nor lg2.approx/ex2.approx. A kernel that encodes or decodes must go through these functions
// (block_scale, encode_magnitude, decode_magnitude, pack_group/unpack_group) so that the GPU's
// combine equals the reference bit for bit.

#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(EPX_HOST_DEVICE)
#if defined(__CUDACC__)
#define EPX_HOST_DEVICE __host__ __device__
#else
#define EPX_HOST_DEVICE
#endif
#endif

namespace epx::logfmt {

inline constexpr int kBlockValues = 128;  // values per metadata word
inline constexpr int kGroupValues = 16;   // values per packed group
inline constexpr int kGroupBytes = 20;    // 16 codes of 9 bits + 16 sign bits
inline constexpr int kGroupWords = kGroupBytes / 4;
inline constexpr int kMetaBytes = 4;  // bf16 amax, bf16 amin
inline constexpr int kCodeBits = 9;
inline constexpr uint32_t kMaxCode = (1u << kCodeBits) - 1;  // 511, decodes to amax
inline constexpr int kNumSteps = int(kMaxCode) - 1;          // 510 steps from code 1 to 511
inline constexpr float kMaxSpanLog2 = 32.0f;                 // a block spans at most 2^32
inline constexpr float kRelSlack = 1.0f / (1 << 16);         // see the error bound
inline constexpr float kAbsSlack = 1.4012985e-45f;           // 2^-149, f32's smallest subnormal

// Bytes of one encoded row: the metadata words, then the packed groups.
EPX_HOST_DEVICE constexpr int64_t meta_bytes(int hidden) {
  return int64_t(hidden / kBlockValues) * kMetaBytes;
}
EPX_HOST_DEVICE constexpr int64_t row_bytes(int hidden) {
  return meta_bytes(hidden) + int64_t(hidden / kGroupValues) * kGroupBytes;
}
// What an area gives each row: row_bytes rounded up to 16 bytes.
EPX_HOST_DEVICE constexpr int64_t row_stride(int hidden) {
  return (row_bytes(hidden) + 15) / 16 * 16;
}
// Byte offset of group g's 20 bytes within a row.
EPX_HOST_DEVICE constexpr int64_t group_offset(int hidden, int g) {
  return meta_bytes(hidden) + int64_t(g) * kGroupBytes;
}

namespace detail {

EPX_HOST_DEVICE inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
EPX_HOST_DEVICE inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
EPX_HOST_DEVICE inline float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
EPX_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);  // IEEE whatever -prec-div says
#else
  return a / b;
#endif
}
EPX_HOST_DEVICE inline float floor_f(float x) {
#if defined(__CUDA_ARCH__)
  return floorf(x);
#else
  return std::floor(x);
#endif
}
EPX_HOST_DEVICE inline float bf16_bits_to_float(uint16_t b) {
  return bits_float(uint32_t(b) << 16);
}
// Words of a row, whose bytes may be any object's (4-byte aligned on the device).
EPX_HOST_DEVICE inline uint32_t load_word(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint32_t*>(p);
#else
  uint32_t u;
  std::memcpy(&u, p, sizeof u);
  return u;
#endif
}
EPX_HOST_DEVICE inline void store_word(uint8_t* p, uint32_t u) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = u;
#else
  std::memcpy(p, &u, sizeof u);
#endif
}

}  // namespace detail

// log2(x) for finite x > 0 (subnormals included), within a few ulps; the same bits everywhere.
// x = 2^e * m with m in (sqrt(1/2), sqrt(2)], ln m = 2 atanh(s) with s = (m - 1) / (m + 1),
// |s| <= 0.172: the series to s^11 leaves an error below 1e-10.
EPX_HOST_DEVICE inline float log2_fixed(float x) {
  using namespace detail;
  uint32_t b = float_bits(x);
  int e = 0;
  if (b < 0x00800000u) {  // subnormal: scale by 2^23, exactly
    b = float_bits(x * 8388608.0f);
    e = -23;
  }
  e += int(b >> 23) - 127;
  float m = bits_float((b & 0x007FFFFFu) | 0x3F800000u);  // [1, 2)
  if (m > 1.41421356f) {
    m = m * 0.5f;
    e += 1;
  }
  const float s = div_rn(m - 1.0f, m + 1.0f);
  const float s2 = s * s;
  float p = fma_rn(s2, 1.0f / 11.0f, 1.0f / 9.0f);
  p = fma_rn(s2, p, 1.0f / 7.0f);
  p = fma_rn(s2, p, 1.0f / 5.0f);
  p = fma_rn(s2, p, 1.0f / 3.0f);
  p = fma_rn(s2, p, 1.0f);
  constexpr float kTwoLog2e = 2.8853900817779268f;  // 2 / ln 2
  return fma_rn(s * p, kTwoLog2e, float(e));
}

// 2^y for finite y in [-200, 128] (what decoding asks), within a few ulps; subnormal results
// are rounded once, results past the f32 range are inf. The same bits everywhere.
EPX_HOST_DEVICE inline float exp2_fixed(float y) {
  using namespace detail;
  const float n = floor_f(y + 0.5f);
  const float f = y - n;  // exact, |f| <= 0.5
  // 2^f = sum (f ln 2)^k / k!, to k = 7: error below 6e-9
  float p = fma_rn(f, 1.5252733804059841e-05f, 1.5403530393381606e-04f);
  p = fma_rn(f, p, 1.3333558146428443e-03f);
  p = fma_rn(f, p, 9.6181291076284772e-03f);
  p = fma_rn(f, p, 5.5504108664821580e-02f);
  p = fma_rn(f, p, 2.4022650695910071e-01f);
  p = fma_rn(f, p, 6.9314718055994531e-01f);
  p = fma_rn(f, p, 1.0f);
  // Two exact power-of-two factors, each a normal f32, so that only the last product rounds.
  const int ni = int(n);
  const int n1 = ni / 2;
  const int n2 = ni - n1;
  const float s1 = bits_float(uint32_t(n1 + 127) << 23);
  const float s2 = bits_float(uint32_t(n2 + 127) << 23);
  return (p * s1) * s2;
}

// What encoder and decoder derive from a block's metadata word (the same function on both
// sides, so both see the same levels).
struct BlockScale {
  float log_min = 0.0f;    // l_min
  float step = 0.0f;       // (l_max - l_min) / 510; 0 when all |x| are equal
  float inv_step = 0.0f;   // 1 / step; 0 when step is 0
  float round = 0.0f;      // 2 - log2((1 + 2^step) / 2) / step: linear-scale rounding, in steps
  float amax = 0.0f;       // what code 511 decodes to
  uint16_t amax_bits = 0;  // |x| bits at and above which the code is 511
  bool finite = true;      // false: the block held inf or NaN and decodes to NaN
};

EPX_HOST_DEVICE inline uint32_t pack_meta(uint16_t amax_bits, uint16_t amin_bits) {
  return uint32_t(amax_bits) | (uint32_t(amin_bits) << 16);
}

// The metadata word of a block of bf16 values (raw bits; any count, 128 in a row).
EPX_HOST_DEVICE inline uint32_t block_meta(const uint16_t* x, int count) {
  uint16_t hi = 0, lo = 0x7FFF;
  for (int i = 0; i < count; ++i) {
    const uint16_t a = uint16_t(x[i] & 0x7FFFu);  // |x|: bit order = magnitude order
    hi = a > hi ? a : hi;
    lo = a < lo ? a : lo;
  }
  return pack_meta(hi, lo);
}

EPX_HOST_DEVICE inline BlockScale block_scale(uint32_t meta) {
  using namespace detail;
  BlockScale s;
  s.amax_bits = uint16_t(meta & 0xFFFFu);
  const uint16_t amin_bits = uint16_t(meta >> 16);
  s.amax = bf16_bits_to_float(s.amax_bits);
  s.finite = s.amax_bits < 0x7F80u;
  if (!s.finite || s.amax_bits == 0) return s;  // NaN everywhere, or all zeros
  const float log_max = log2_fixed(s.amax);
  const float floor_log = log_max - kMaxSpanLog2;
  const float log_amin = amin_bits == 0 ? floor_log : log2_fixed(bf16_bits_to_float(amin_bits));
  s.log_min = log_amin > floor_log ? log_amin : floor_log;
  if (amin_bits == s.amax_bits) return s;  // all |x| equal: every value is code 511
  s.step = div_rn(log_max - s.log_min, float(kNumSteps));
  s.inv_step = div_rn(1.0f, s.step);
  const float mid = log2_fixed((1.0f + exp2_fixed(s.step)) * 0.5f);
  s.round = fma_rn(-mid, s.inv_step, 2.0f);
  return s;
}

// Code of a magnitude given as bf16 bits without the sign (0 .. 0x7F7F).
EPX_HOST_DEVICE inline uint32_t encode_magnitude(uint16_t abs_bits, const BlockScale& s) {
  using namespace detail;
  if (!s.finite || abs_bits == 0) return 0;
  if (abs_bits >= s.amax_bits) return kMaxCode;
  const float t = fma_rn(log2_fixed(bf16_bits_to_float(abs_bits)) - s.log_min, s.inv_step, s.round);
  if (!(t >= 1.0f)) return 0;
  if (t >= float(kMaxCode)) return kMaxCode;
  return uint32_t(floor_f(t));
}

// Magnitude of a code (the sign is the caller's).
EPX_HOST_DEVICE inline float decode_magnitude(uint32_t code, const BlockScale& s) {
  using namespace detail;
  if (!s.finite) return bits_float(0x7FC00000u);
  if (code == 0) return 0.0f;
  if (code >= kMaxCode) return s.amax;
  return exp2_fixed(fma_rn(float(code - 1), s.step, s.log_min));
}

// 16 codes (9 bits each) and 16 sign bits (bit j = value j) -> five words, and back.
EPX_HOST_DEVICE inline void pack_group(const uint32_t (&codes)[kGroupValues], uint32_t signs,
                                       uint32_t (&w)[kGroupWords]) {
  for (int k = 0; k < kGroupWords; ++k) w[k] = 0;
  for (int j = 0; j < kGroupValues; ++j) {
    const int bit = j * kCodeBits;
    const uint32_t c = codes[j] & kMaxCode;
    w[bit / 32] |= c << (bit % 32);
    if (bit % 32 > 32 - kCodeBits) w[bit / 32 + 1] |= c >> (32 - bit % 32);
  }
  w[kGroupWords - 1] |= (signs & 0xFFFFu) << 16;
}
EPX_HOST_DEVICE inline void unpack_group(const uint32_t (&w)[kGroupWords],
                                         uint32_t (&codes)[kGroupValues], uint32_t& signs) {
  for (int j = 0; j < kGroupValues; ++j) {
    const int bit = j * kCodeBits;
    uint32_t c = w[bit / 32] >> (bit % 32);
    if (bit % 32 > 32 - kCodeBits) c |= w[bit / 32 + 1] << (32 - bit % 32);
    codes[j] = c & kMaxCode;
  }
  signs = w[kGroupWords - 1] >> 16;
}

// One row: `x` [hidden] bf16 bits -> `row` [row_bytes(hidden)] (4-byte aligned).
EPX_HOST_DEVICE inline void encode_row(const uint16_t* x, int hidden, uint8_t* row) {
  for (int b = 0; b < hidden / kBlockValues; ++b) {
    const uint16_t* xb = x + b * kBlockValues;
    const uint32_t meta = block_meta(xb, kBlockValues);
    detail::store_word(row + b * kMetaBytes, meta);
    const BlockScale s = block_scale(meta);
    for (int g = 0; g < kBlockValues / kGroupValues; ++g) {
      const uint16_t* xg = xb + g * kGroupValues;
      uint32_t codes[kGroupValues];
      uint32_t signs = 0;
      for (int j = 0; j < kGroupValues; ++j) {
        codes[j] = encode_magnitude(uint16_t(xg[j] & 0x7FFFu), s);
        signs |= uint32_t(xg[j] >> 15) << j;
      }
      uint32_t w[kGroupWords];
      pack_group(codes, signs, w);
      const int group = b * (kBlockValues / kGroupValues) + g;
      uint8_t* dst = row + group_offset(hidden, group);
      for (int k = 0; k < kGroupWords; ++k) detail::store_word(dst + 4 * k, w[k]);
    }
  }
}

// One row back: `row` -> `out` [hidden] f32 (what combine adds; not rounded to bf16).
EPX_HOST_DEVICE inline void decode_row(const uint8_t* row, int hidden, float* out) {
  for (int b = 0; b < hidden / kBlockValues; ++b) {
    const BlockScale s = block_scale(detail::load_word(row + b * kMetaBytes));
    for (int g = 0; g < kBlockValues / kGroupValues; ++g) {
      const int group = b * (kBlockValues / kGroupValues) + g;
      const uint8_t* src = row + group_offset(hidden, group);
      uint32_t w[kGroupWords];
      for (int k = 0; k < kGroupWords; ++k) w[k] = detail::load_word(src + 4 * k);
      uint32_t codes[kGroupValues];
      uint32_t signs = 0;
      unpack_group(w, codes, signs);
      float* o = out + group * kGroupValues;
      for (int j = 0; j < kGroupValues; ++j) {
        const float m = decode_magnitude(codes[j], s);
        o[j] = ((signs >> j) & 1u) != 0 ? -m : m;
      }
    }
  }
}

// rho of a block: the largest relative error of linear-scale rounding between its levels.
EPX_HOST_DEVICE inline float relative_bound(const BlockScale& s) {
  const float r = exp2_fixed(s.step);
  return detail::div_rn(r - 1.0f, r + 1.0f);
}

}  // namespace epx::logfmt
