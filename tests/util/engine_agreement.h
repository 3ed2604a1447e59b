// How closely one engine follows another on a prompt: the GPU engine tests
// (tests/gpu/test_gpu_engine.cc, test_gpu_fp8.cc) hold the GPU to the CPU reference with it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/cpu/ops/sampling.h"
#include "tests/util/engine_test_util.h"

namespace kvfuse::testing {

struct EngineAgreement {
  float max_dlogit = 0;  // the largest |logit difference| along the reference's greedy tokens
  int top1 = 0;          // teacher-forced positions whose argmax agrees
  size_t positions = 0;  // of these
  int prefix = 0;        // free-running greedy tokens equal before the first difference
};

// `ref`'s greedy continuation of `prompt` (steps tokens), then both engines' logits along it
// (teacher forcing: prefill, then a decode step per token).
inline EngineAgreement engine_agreement(Engine& ref, Engine& test, const std::vector<int32_t>& prompt, int steps) {
  EngineAgreement a;
  const auto want = greedy(ref, 1, prompt, steps);
  const auto got = greedy(test, 1, prompt, steps);
  while (a.prefix < steps && want[size_t(a.prefix)] == got[size_t(a.prefix)]) ++a.prefix;
  const auto lr = teacher_forced_logits(ref, 2, prompt, want);
  const auto lt = teacher_forced_logits(test, 2, prompt, want);
  a.positions = lr.size();
  for (size_t i = 0; i < lr.size(); ++i) {
    for (size_t v = 0; v < lr[i].size(); ++v) a.max_dlogit = std::max(a.max_dlogit, std::fabs(lr[i][v] - lt[i][v]));
    a.top1 += argmax(lr[i].data(), int32_t(lr[i].size())) == argmax(lt[i].data(), int32_t(lt[i].size()));
  }
  return a;
}

}  // namespace kvfuse::testing
