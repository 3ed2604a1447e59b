// Token sampling on the GPU (CUDA and HIP from one source): the rule of
// kernels/ops/sampling.h, the same tokens as the CPU reference (kernels/cpu/ops/sampling.cc)
// for the same logits and draws. One block per row; rows with temperature 0 are left
// unwritten (their token is the greedy one of launch_argmax_rows). Safe to capture in a
// graph (parameters and draws are read from device memory).
#pragma once

#include "kernels/common/gpu.h"
#include "kernels/ops/sampling.h"

namespace kvfuse::gpu {

// tokens[r] = the token row r of logits[rows, vocab] samples under params[r], for every
// row with params[r].temperature > 0.
cudaError_t launch_sample_rows(const float* logits, int64_t rows, int64_t vocab, const RowSampling* params,
                               int32_t* tokens, cudaStream_t stream);

// The logit processors of rows [0, rows) (kernels/ops/sampling.h has the rule): row r's
// entries are entries[start[r] .. start[r + 1]), start on the device. `restore` false
// applies them, keeping each raw logit in its entry; true writes the raw logits back.
// The same bits as the CPU reference (cpu::adjust_rows).
cudaError_t launch_adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start,
                               LogitAdjust* entries, bool restore, cudaStream_t stream);

// Per row r with req[r].top_n >= 0: out[r] = the logprob of its target and its top_n
// most likely tokens (kernels/ops/sampling.h has the rule). A target < 0 resolves to
// sampled[r] when params[r].temperature > 0 (params may be null: all greedy), else
// greedy[r]. Sums are fp32: within 1e-4 of the CPU reference (cpu::logprobs_row); the
// top-n ids are exactly the reference's.
cudaError_t launch_logprobs_rows(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                                 const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                                 LogprobOut* out, cudaStream_t stream);

}  // namespace kvfuse::gpu
