// The CDNA MFMA attention kernel's block (kernels/attention/mfma/attention_mfma.h) run on the host, lane
// by lane (kernels/cpu/attention/wave_emu.h: 4 waves x 64 lanes as fibers, the MFMA instructions
// emulated from the lanes' registers by kernels/cpu/attention/mfma_emu.h), on the GPU parity
// test's problems (tests/util/attention_cases.h), against the CPU reference within the CUDA
// kernel's tolerance. Both paths (unified; split with its decode partitions, prefill
// blocks and merge), every KV format with each FP8 conversion the targets use (the
// instruction, emulated as the exact decode, and the bit manipulation), head_dim
// 64/128/256, GQA 1..8, page sizes 1..64, sliding windows, NaN in every slot no query may
// read. What this cannot show: that the hardware's operand layouts are the ones
// kernels/attention/mfma/mfma_layout.h assumes (tests/gpu/test_mfma_gpu.cu on an AMD GPU), and speed.
#include <cstring>
#include <string>
#include <vector>

#include "kernels/attention/mfma/attention_mfma.h"
#include "kernels/cpu/attention/wave_emu.h"
#include "tests/util/attention_cases.h"
#include "tests/util/catch.h"

namespace {

using namespace kvfuse;
using namespace kvfuse::attention_cases;
namespace am = kvfuse::gpu::attention_detail;

// A lane of the emulated block as kernels/attention/mfma/attention_mfma.h's executor. kHwCvt: FP8
// conversions as the targets' instructions compute them (the exact value, factor 1)
// instead of the bit manipulation (a power-of-two factor).
template <bool kHwCvt>
struct LaneExec {
  cpu::BlockEmu* emu;
  int lane_, wave_;
  int64_t block_;

  int lane() const { return lane_; }
  int wave() const { return wave_; }
  int64_t block() const { return block_; }
  void sync() const { emu->block_barrier(); }
  float shfl_xor(float v, int mask) const {
    return f32_from_bits(emu->exchange(wave_, lane_, f32_bits(v), lane_ ^ mask));
  }
  float exp2(float v) const { return std::exp2(v); }
  // CUDA's __byte_perm: byte i of the result is byte (s >> 4i) & 7 of y:x.
  uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) const {
    const uint64_t b = uint64_t(y) << 32 | x;
    uint32_t out = 0;
    for (int i = 0; i < 4; ++i) out |= uint32_t((b >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return out;
  }
  template <bool kBf16>
  void mfma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) const {
    emu->mfma_16x16x32(wave_, lane_, kBf16 ? cpu::MfmaInput::bf16 : cpu::MfmaInput::f16, d, a, b);
  }
  template <bool kBf16>
  uint32_t pack_rn(float lo, float hi) const {
    if constexpr (kBf16) return uint32_t(f32_to_bf16(lo)) | uint32_t(f32_to_bf16(hi)) << 16;
    return uint32_t(f32_to_f16(lo)) | uint32_t(f32_to_f16(hi)) << 16;
  }
  template <bool kBf16>
  float half_lo(uint32_t w) const {
    return kBf16 ? bf16_to_f32(bf16_t(w & 0xffffu)) : f16_to_f32(f16_t(w & 0xffffu));
  }
  template <bool kBf16>
  float half_hi(uint32_t w) const {
    return kBf16 ? bf16_to_f32(bf16_t(w >> 16)) : f16_to_f32(f16_t(w >> 16));
  }
  template <KvFormat F>
  float fp8_factor() const {
    return kHwCvt ? 1.0f : am::mfma_attn::fp8_bits_factor(F);
  }
  template <KvFormat F>
  void cvt_fp8x4(uint32_t w, uint32_t& lo, uint32_t& hi) const {
    if constexpr (kHwCvt && F != KvFormat::fp8_e5m2) {
      uint32_t h[4];
      for (int i = 0; i < 4; ++i) h[i] = f32_to_f16(fp8_decode(uint8_t(w >> (8 * i)), kv_fp8_format(F)));
      lo = h[0] | h[1] << 16;
      hi = h[2] | h[3] << 16;
    } else {
      am::mfma_attn::fp8x4_to_f16x2_bits<F>(w, lo, hi);
    }
  }
  template <int N>
  void load_words(const void* src, uint32_t* out) const {
    std::memcpy(out, src, 4 * N);
  }
  template <int N>
  void store_words(bf16_t* dst, const uint32_t* words) const {
    std::memcpy(dst, words, 4 * N);
  }
};

template <int D, KvFormat F, bool kHwCvt>
void run_blocks(const am::Params& p, int64_t blocks) {
  cpu::BlockEmu emu(am::mfma_attn::kWaves);
  auto sm = std::make_unique<am::mfma_attn::Smem<D>>();
  for (int64_t b = 0; b < blocks; ++b) {
    emu.run([&](int wave, int lane) {
      LaneExec<kHwCvt> x{&emu, lane, wave, b};
      if (p.page_tiles) {
        am::mfma_attn::block<D, F, true>(x, p, *sm);
      } else {
        am::mfma_attn::block<D, F, false>(x, p, *sm);
      }
    });
  }
}

template <int D, KvFormat F, bool kHwCvt>
void run_path(const Problem& pr, AttnArgs a, bool split, int64_t slots) {
  const int64_t H = a.cache.num_kv_heads;
  if (!split) {
    am::Params p = am::base_params(a);
    p.mode = am::kModeUnified;
    run_blocks<D, F, kHwCvt>(p, a.batch.num_tokens * H);
    return;
  }
  const int32_t len = am::split_partition_keys(a, pr.c.partition, pr.c.split_partition, slots);
  const int32_t parts = am::split_parts(a.batch.max_context_len, len);
  std::vector<float> scratch(size_t(a.batch.num_tokens * a.num_q_heads * int64_t(parts) * (D + 2)), NAN);
  const am::Params p = am::split_decode_params(a, pr.c.partition, parts, scratch.data());
  run_blocks<D, F, kHwCvt>(p, int64_t(parts) * a.batch.num_seqs * H);
  if (a.batch.max_query_len != 1) {
    am::Params q = p;
    q.mode = am::kModePrefill;
    run_blocks<D, F, kHwCvt>(q, a.batch.num_tokens * H);
  }
  if (parts == 1) return;
  for (int32_t s = 0; s < a.batch.num_seqs; ++s) {
    for (int32_t qh = 0; qh < a.num_q_heads; ++qh) {
      am::merge_partitions<D, D>(a, p.part_o, p.part_ml, p.part_len, parts, s, qh, 0);
    }
  }
}

// The kernel's output for problem `pr` on the host; `slots` stands for the device's
// resident blocks (CUs x blocks per CU) in the split path's partition choice.
std::vector<bf16_t> run_lanes(const Problem& pr, bool split, bool hw_cvt, int64_t slots) {
  std::vector<bf16_t> out = fresh_out(pr);
  const AttnArgs a =
      make_args(pr, pr.q.data(), out.data(), pr.query_start.data(), pr.context_len.data(),
                pr.block_table.data(), pr.k_cache.data(), pr.v_cache.data(), &pr.k_scale, &pr.v_scale);
  const auto go = [&](auto hd, auto fmt) {
    constexpr int D = decltype(hd)::value;
    constexpr KvFormat F = decltype(fmt)::value;
    if (hw_cvt) {
      run_path<D, F, true>(pr, a, split, slots);
    } else {
      run_path<D, F, false>(pr, a, split, slots);
    }
  };
  const auto by_format = [&](auto hd) {
    switch (pr.c.dtype) {
      case KvFormat::bf16:
        return go(hd, std::integral_constant<KvFormat, KvFormat::bf16>{});
      case KvFormat::fp8_e4m3fn:
        return go(hd, std::integral_constant<KvFormat, KvFormat::fp8_e4m3fn>{});
      case KvFormat::fp8_e4m3fnuz:
        return go(hd, std::integral_constant<KvFormat, KvFormat::fp8_e4m3fnuz>{});
      case KvFormat::fp8_e5m2:
        return go(hd, std::integral_constant<KvFormat, KvFormat::fp8_e5m2>{});
    }
  };
  switch (pr.c.head_dim) {
    case 64:
      by_format(std::integral_constant<int, 64>{});
      break;
    case 128:
      by_format(std::integral_constant<int, 128>{});
      break;
    case 256:
      by_format(std::integral_constant<int, 256>{});
      break;
    default:
      FAIL("head_dim " << pr.c.head_dim);
  }
  return out;
}

void check_case(const Case& c, int64_t slots) {
  const Problem p = make_problem(c);
  const std::vector<bf16_t> ref = run_cpu(p);
  const bool fp8_e4m3 = c.dtype == KvFormat::fp8_e4m3fn || c.dtype == KvFormat::fp8_e4m3fnuz;
  for (bool hw : {true, false}) {
    if (!hw && !fp8_e4m3) continue;  // one conversion only for bf16 and e5m2
    for (bool split : {false, true}) {
      const std::string what =
          std::string(split ? "split " : "unified ") + (hw ? "hw-cvt " : "bits-cvt ") + describe(c);
      INFO(what);
      const std::string err = compare_outputs(p, run_lanes(p, split, hw, slots), ref, what);
      CHECK(err == "");
    }
  }
}

}  // namespace

TEST_CASE("mfma attention lanes: every format, head_dim and GQA ratio on the mixed batch") {
  int n = 0;
  for (const Case& c : matrix_cases(true)) {
    if (c.page_size != 16 || c.window != 0 || c.seqs.size() != mixed_batch().size()) continue;
    if (c.fp8_decode == 1) continue;  // the CUDA kernel's knob; both conversions run here
    check_case(c, 304 * 2);
    ++n;
  }
  CHECK(n >= 12);
}

TEST_CASE("mfma attention lanes: page sizes, windows and padded rows") {
  int n = 0;
  for (const Case& c : matrix_cases(true)) {
    if (c.page_size == 16 && c.window == 0) continue;
    if (c.seqs.size() != mixed_batch().size()) continue;
    check_case(c, 256 * 2);
    ++n;
  }
  CHECK(n >= 3);
}

TEST_CASE("mfma attention lanes: GQA 1, 2, 7, 8 and D 64..256 with windows") {
  uint64_t seed = 900;
  for (int32_t gqa : {1, 2, 7, 8}) {
    for (int32_t d : {64, 256}) {
      Case c;
      c.dtype = gqa % 2 ? KvFormat::fp8_e4m3fnuz : KvFormat::fp8_e5m2;
      c.gqa = gqa;
      c.head_dim = d;
      c.num_kv_heads = gqa == 1 ? 3 : 2;
      c.window = gqa == 7 ? 20 : 0;
      c.page_size = gqa == 2 ? 48 : 16;
      c.partition = 32;
      c.seqs = {{37, 37}, {70, 19}, {1, 1}, {129, 1}, {17, 2}, {300, 1}};
      c.seed = ++seed;
      check_case(c, 304 * 2);
    }
  }
}

TEST_CASE("mfma attention lanes: long contexts over many partitions, windows dropping pages") {
  for (const Case& c : matrix_cases(true)) {
    if (c.seqs.size() == mixed_batch().size()) continue;
    check_case(c, 304 * 2);
  }
}
