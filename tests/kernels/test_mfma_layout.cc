// The MFMA lane layouts (kernels/attention/mfma/mfma_layout.h) and the host emulator
// (kernels/cpu/attention/mfma_emu.h), on the CPU:
// - the layouts against AMD's matrix instruction calculator's tables, entry by entry
//   (tests/data/mfma/: CDNA3's 16x16x16, and CDNA3's 16x16x32 fp8 table as the
//   stand-in for gfx950's 16x16x32, which the calculator does not cover);
// - every layout a bijection: each element of A, B, D held by exactly one (lane,
//   element), and the inverse functions its inverse;
// - the emulator: matrices distributed over lanes, one instruction, D gathered gives
//   A * B + C, exactly for integer-valued inputs (every partial sum exact in any order),
//   within mfma_sum_error_bound for random bf16/f16; 16x16x32 equals two 16x16x16 on the
//   halves of the lane vectors (what kernels/attention/mfma/mfma.cuh does on gfx942).
// The hardware side, the same comparisons on an AMD GPU, is tests/gpu/test_mfma_gpu.cu.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/cpu/attention/mfma_emu.h"
#include "kernels/attention/mfma/mfma_layout.h"
#include "tests/util/catch.h"

namespace {

using namespace kvfuse;
using cpu::MfmaAccRegs;
using cpu::MfmaAMatrix;
using cpu::MfmaBMatrix;
using cpu::MfmaCMatrix;
using cpu::MfmaInput;

// --- AMD's tables -------------------------------------------------------------------

struct CalcEntry {
  int gpr = -1;   // operand / accumulator VGPR of the lane
  int lane = -1;  // lane
  int lo = 0;     // lowest bit of the value in the VGPR (0 for fp32 accumulators)
};

// tests/data/mfma/NAME: rows x cols entries "vG{L}.[HI:LO]" or "vG{L}".
std::vector<std::vector<CalcEntry>> read_calculator_table(const std::string& name, int rows, int cols) {
  const std::string path = std::string(KVFUSE_TEST_DATA_DIR) + "/mfma/" + name;
  std::ifstream in(path);
  REQUIRE(in.good());
  std::string line;
  for (int i = 0; i < 4; ++i) REQUIRE(std::getline(in, line));  // 3 header lines, the column header
  std::vector<std::vector<CalcEntry>> t(rows, std::vector<CalcEntry>(cols));
  for (int r = 0; r < rows; ++r) {
    REQUIRE(std::getline(in, line));
    std::stringstream ss(line);
    std::string cell;
    REQUIRE(std::getline(ss, cell, ','));
    REQUIRE(std::stoi(cell) == r);
    for (int c = 0; c < cols; ++c) {
      REQUIRE(std::getline(ss, cell, ','));
      CalcEntry& e = t[r][c];
      int hi = -1;
      const int n = std::sscanf(cell.c_str(), "v%d{%d}.[%d:%d]", &e.gpr, &e.lane, &hi, &e.lo);
      INFO(name << " [" << r << "][" << c << "] = " << cell);
      REQUIRE((n == 2 || n == 4));
      if (n == 2) e.lo = 0;
    }
  }
  return t;
}

TEST_CASE("mfma 16x16x16 layouts are AMD's calculator's (CDNA3 v_mfma_f32_16x16x16_bf16)", "[mfma]") {
  using L = Mfma16x16x16Layout;
  // 16-bit values, two to a VGPR: element = 2 * GPR + LO / 16.
  const auto ta = read_calculator_table("cdna3.v_mfma_f32_16x16x16_bf16_A.csv", 16, 16);
  const auto tb = read_calculator_table("cdna3.v_mfma_f32_16x16x16_bf16_B.csv", 16, 16);
  const auto td = read_calculator_table("cdna3.v_mfma_f32_16x16x16_bf16_D.csv", 16, 16);
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) {
      INFO("[" << r << "][" << c << "]");
      const MfmaSlot sa = L::a_slot(r, c);
      CHECK(sa.lane == ta[r][c].lane);
      CHECK(sa.elem == 2 * ta[r][c].gpr + ta[r][c].lo / 16);
      const MfmaSlot sb = L::b_slot(r, c);
      CHECK(sb.lane == tb[r][c].lane);
      CHECK(sb.elem == 2 * tb[r][c].gpr + tb[r][c].lo / 16);
      const MfmaSlot sd = L::d_slot(r, c);
      CHECK(sd.lane == td[r][c].lane);
      CHECK(sd.elem == td[r][c].gpr);
    }
  }
}

TEST_CASE("mfma 16x16x32 operand layouts follow CDNA3's 16x16x32 lane and value order", "[mfma]") {
  using L = Mfma16x16x32Layout;
  // The fp8 table: 8 one-byte values per lane, four to a VGPR: value = 4 * GPR + LO / 8.
  // gfx950's bf16/f16 16x16x32 holds 8 two-byte values per lane in the same order
  // (kernels/attention/mfma/mfma_layout.h gives the sources).
  const auto ta = read_calculator_table("cdna3.v_mfma_f32_16x16x32_fp8_fp8_A.csv", 16, 32);
  const auto tb = read_calculator_table("cdna3.v_mfma_f32_16x16x32_fp8_fp8_B.csv", 32, 16);
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 32; ++k) {
      INFO("A[" << r << "][" << k << "]");
      const MfmaSlot s = L::a_slot(r, k);
      CHECK(s.lane == ta[r][k].lane);
      CHECK(s.elem == 4 * ta[r][k].gpr + ta[r][k].lo / 8);
    }
  }
  for (int k = 0; k < 32; ++k) {
    for (int c = 0; c < 16; ++c) {
      INFO("B[" << k << "][" << c << "]");
      const MfmaSlot s = L::b_slot(k, c);
      CHECK(s.lane == tb[k][c].lane);
      CHECK(s.elem == 4 * tb[k][c].gpr + tb[k][c].lo / 8);
    }
  }
}

// --- Bijections -----------------------------------------------------------------------

// fwd(lane, elem) over all lanes and `elems` elements covers a rows x cols matrix
// exactly once, and inv is its inverse.
template <class Fwd, class Inv>
void check_bijection(const char* what, int rows, int cols, int elems, Fwd fwd, Inv inv) {
  INFO(what);
  REQUIRE(kMfmaLanes * elems == rows * cols);
  std::vector<int> seen(size_t(rows * cols), 0);
  for (int lane = 0; lane < kMfmaLanes; ++lane) {
    for (int i = 0; i < elems; ++i) {
      const MfmaElem e = fwd(lane, i);
      INFO("lane " << lane << " elem " << i << " -> [" << e.row << "][" << e.col << "]");
      REQUIRE(e.row >= 0);
      REQUIRE(e.row < rows);
      REQUIRE(e.col >= 0);
      REQUIRE(e.col < cols);
      ++seen[size_t(e.row * cols + e.col)];
      const MfmaSlot s = inv(e.row, e.col);
      CHECK(s.lane == lane);
      CHECK(s.elem == i);
    }
  }
  for (int n : seen) REQUIRE(n == 1);
}

template <int K>
void check_layout_bijections() {
  using L = Mfma16x16Layout<K>;
  check_bijection("A", 16, K, L::kOperandElems, L::a, L::a_slot);
  check_bijection("B", K, 16, L::kOperandElems, L::b, L::b_slot);
  check_bijection("C/D", 16, 16, L::kAccElems, L::d, L::d_slot);
}

TEST_CASE("mfma layouts are bijections between (lane, element) and matrix elements", "[mfma]") {
  SECTION("16x16x16") { check_layout_bijections<16>(); }
  SECTION("16x16x32") { check_layout_bijections<32>(); }
}

// --- The emulator -----------------------------------------------------------------------

uint16_t to_bits(MfmaInput in, float x) { return in == MfmaInput::bf16 ? f32_to_bf16(x) : f32_to_f16(x); }

template <int K>
struct Problem {
  MfmaAMatrix<K> a{};
  MfmaBMatrix<K> b{};
  MfmaCMatrix c{};
};

// Integer-valued operands in [-8, 8] and accumulators that are multiples of 64 in
// [-512, 512] (or 0): every partial sum is an integer below 2^24 in magnitude, exact in
// fp32 whatever the order of the additions.
template <int K>
Problem<K> integer_problem(MfmaInput in, std::mt19937& rng, bool with_c) {
  std::uniform_int_distribution<int> v(-8, 8);
  Problem<K> p;
  for (auto& row : p.a)
    for (auto& x : row) x = to_bits(in, float(v(rng)));
  for (auto& row : p.b)
    for (auto& x : row) x = to_bits(in, float(v(rng)));
  for (auto& row : p.c)
    for (auto& x : row) x = with_c ? float(64 * v(rng)) : 0.0f;
  return p;
}

template <int K>
Problem<K> random_problem(MfmaInput in, std::mt19937& rng) {
  std::uniform_real_distribution<float> v(-4.0f, 4.0f);
  Problem<K> p;
  for (auto& row : p.a)
    for (auto& x : row) x = to_bits(in, v(rng));
  for (auto& row : p.b)
    for (auto& x : row) x = to_bits(in, v(rng));
  for (auto& row : p.c)
    for (auto& x : row) x = v(rng);
  return p;
}

template <int K>
MfmaCMatrix emulate(MfmaInput in, const Problem<K>& p) {
  const MfmaAccRegs d = cpu::mfma_16x16_emulate<K>(
      in, cpu::mfma_distribute_a<K>(p.a), cpu::mfma_distribute_b<K>(p.b), cpu::mfma_distribute_acc(p.c));
  return cpu::mfma_gather_acc(d);
}

// C + A * B in double, and |C| + sum |A * B|, element by element (every product of two
// 16-bit floats is exact in double; the sums carry 29 more bits than fp32's).
template <int K>
void reference(MfmaInput in, const Problem<K>& p, double (&d)[16][16], double (&abs_terms)[16][16]) {
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) {
      double s = p.c[r][c], t = std::fabs(p.c[r][c]);
      for (int k = 0; k < K; ++k) {
        const double prod =
            double(cpu::mfma_operand_to_f32(in, p.a[r][k])) * double(cpu::mfma_operand_to_f32(in, p.b[k][c]));
        s += prod;
        t += std::fabs(prod);
      }
      d[r][c] = s;
      abs_terms[r][c] = t;
    }
  }
}

template <int K>
void check_integer_products(MfmaInput in, bool with_c) {
  std::mt19937 rng(with_c ? 7u + K : 3u + K);
  for (int trial = 0; trial < 20; ++trial) {
    const Problem<K> p = integer_problem<K>(in, rng, with_c);
    const MfmaCMatrix d = emulate<K>(in, p);
    double want[16][16], abs_terms[16][16];
    reference<K>(in, p, want, abs_terms);
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < 16; ++c) {
        INFO("trial " << trial << " D[" << r << "][" << c << "]");
        REQUIRE(double(d[r][c]) == want[r][c]);
      }
    }
  }
}

template <int K>
void check_random_products(MfmaInput in) {
  std::mt19937 rng(11u + K + (in == MfmaInput::f16 ? 100u : 0u));
  double worst = 0;  // largest error as a fraction of the bound
  for (int trial = 0; trial < 50; ++trial) {
    const Problem<K> p = random_problem<K>(in, rng);
    const MfmaCMatrix d = emulate<K>(in, p);
    double want[16][16], abs_terms[16][16];
    reference<K>(in, p, want, abs_terms);
    for (int r = 0; r < 16; ++r) {
      for (int c = 0; c < 16; ++c) {
        const double err = std::fabs(double(d[r][c]) - want[r][c]);
        const double bound = cpu::mfma_sum_error_bound(K, abs_terms[r][c]);
        INFO("trial " << trial << " D[" << r << "][" << c << "]: " << d[r][c] << " vs " << want[r][c]);
        REQUIRE(err <= bound);
        worst = std::max(worst, err / bound);
      }
    }
  }
  // Not vacuous: the fp32 accumulation does round (random values are not exact).
  CHECK(worst > 0);
}

TEST_CASE("mfma emulator: integer A * B is exact, 16x16x16", "[mfma]") {
  check_integer_products<16>(MfmaInput::bf16, false);
  check_integer_products<16>(MfmaInput::f16, false);
}

TEST_CASE("mfma emulator: C is accumulated, 16x16x16", "[mfma]") {
  check_integer_products<16>(MfmaInput::bf16, true);
  check_integer_products<16>(MfmaInput::f16, true);
}

TEST_CASE("mfma emulator: integer A * B + C is exact, 16x16x32", "[mfma]") {
  check_integer_products<32>(MfmaInput::bf16, false);
  check_integer_products<32>(MfmaInput::bf16, true);
  check_integer_products<32>(MfmaInput::f16, false);
  check_integer_products<32>(MfmaInput::f16, true);
}

TEST_CASE("mfma emulator: random bf16/f16 within the fp32 summation bound", "[mfma]") {
  check_random_products<16>(MfmaInput::bf16);
  check_random_products<16>(MfmaInput::f16);
  check_random_products<32>(MfmaInput::bf16);
  check_random_products<32>(MfmaInput::f16);
}

TEST_CASE("mfma emulator: the accumulator's lanes and elements are D's (one-hot A)", "[mfma]") {
  // A = the single 1 at A[r][k], B[k'][c] = 16 * k' + c + 1 (f16: integers to 2048 are
  // exact): D is row k of B in row r, zero elsewhere; checked lane by lane against the D
  // layout written out by hand.
  for (int r : {0, 5, 15}) {
    for (int k : {0, 7, 31}) {
      Problem<32> p;
      p.a[r][k] = f32_to_f16(1.0f);
      for (int kk = 0; kk < 32; ++kk)
        for (int c = 0; c < 16; ++c) p.b[kk][c] = f32_to_f16(float(16 * kk + c + 1));
      const MfmaAccRegs d =
          cpu::mfma_16x16_emulate<32>(MfmaInput::f16, cpu::mfma_distribute_a<32>(p.a),
                                      cpu::mfma_distribute_b<32>(p.b), cpu::mfma_distribute_acc(p.c));
      for (int lane = 0; lane < 64; ++lane) {
        for (int i = 0; i < 4; ++i) {
          const int row = 4 * (lane / 16) + i, col = lane % 16;  // AMD's D layout
          INFO("A[" << r << "][" << k << "] = 1, lane " << lane << " acc " << i);
          CHECK(d[lane][i] == (row == r ? float(16 * k + col + 1) : 0.0f));
        }
      }
    }
  }
}

TEST_CASE("mfma 16x16x32 equals two 16x16x16 on the lane vectors' halves (the gfx942 path)", "[mfma]") {
  std::mt19937 rng(5);
  for (MfmaInput in : {MfmaInput::bf16, MfmaInput::f16}) {
    for (int trial = 0; trial < 20; ++trial) {
      const Problem<32> p = integer_problem<32>(in, rng, true);
      const auto a = cpu::mfma_distribute_a<32>(p.a);
      const auto b = cpu::mfma_distribute_b<32>(p.b);
      const MfmaAccRegs c = cpu::mfma_distribute_acc(p.c);
      cpu::MfmaOperandRegs<16> a_lo{}, a_hi{}, b_lo{}, b_hi{};
      for (int lane = 0; lane < kMfmaLanes; ++lane) {
        for (int i = 0; i < 4; ++i) {
          a_lo[lane][i] = a[lane][i];
          a_hi[lane][i] = a[lane][4 + i];
          b_lo[lane][i] = b[lane][i];
          b_hi[lane][i] = b[lane][4 + i];
        }
      }
      const MfmaAccRegs one = cpu::mfma_16x16_emulate<32>(in, a, b, c);
      const MfmaAccRegs two =
          cpu::mfma_16x16_emulate<16>(in, a_hi, b_hi, cpu::mfma_16x16_emulate<16>(in, a_lo, b_lo, c));
      for (int lane = 0; lane < kMfmaLanes; ++lane)
        for (int i = 0; i < 4; ++i) REQUIRE(one[lane][i] == two[lane][i]);
    }
  }
}

TEST_CASE("mfma summation bound", "[mfma]") {
  // gamma(n) = n u / (1 - n u) with u = 2^-23.
  const double u = 1.0 / 8388608.0;
  CHECK(cpu::mfma_sum_error_bound(16, 1.0) == Approx(16 * u / (1 - 16 * u)).epsilon(1e-12));
  CHECK(cpu::mfma_sum_error_bound(32, 2.0) == Approx(2 * 32 * u / (1 - 32 * u)).epsilon(1e-12));
  CHECK(cpu::mfma_sum_error_bound(32, 2.0) > 2 * 32 * u);
  CHECK(cpu::mfma_sum_error_bound(16, 0.0) == 0.0);
}

}  // namespace
