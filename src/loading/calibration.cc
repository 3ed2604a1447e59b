#include "src/loading/calibration.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace kvfuse {

namespace {

// Largest |x| of a bf16 buffer, from the bit patterns: for non-NaN values the order of
// (bits & 0x7fff) is the order of |x|. Returns false on NaN or inf.
bool bf16_amax(const std::vector<uint16_t>& v, float& amax) {
  uint16_t m = 0;
  for (uint16_t b : v) m = std::max<uint16_t>(m, uint16_t(b & 0x7fffu));
  if (m >= 0x7f80u) return false;
  amax = std::max(amax, bf16_to_f32(m));
  return true;
}

}  // namespace

absl::StatusOr<KvAmax> measure_kv_amax(Engine& engine, const std::vector<std::vector<int32_t>>& prompts) {
  if (engine.kv_format() != KvFormat::bf16) {
    return absl::FailedPreconditionError(
        absl::StrCat("calibration reads exact K/V from a bf16 cache; the engine's is ",
                     kv_format_name(engine.kv_format()), " (set kv_cache_dtype bf16)"));
  }
  if (engine.num_sequences() != 0)
    return absl::FailedPreconditionError("calibration needs an engine without sequences");
  if (prompts.empty()) return absl::InvalidArgumentError("calibration needs at least one prompt");
  const int32_t L = engine.spec().num_layers;
  // Every rank's storage holds some of the heads (one storage at tensor_parallel 1).
  const int32_t ranks = engine.num_ranks();
  if (engine.num_local_ranks() != ranks) {
    return absl::FailedPreconditionError(
        absl::StrCat("calibration reads the KV pages of every rank, and ", ranks - engine.num_local_ranks(),
                     " of the ", ranks,
                     " ranks are in other processes: calibrate with every rank in one process "
                     "(tp_rendezvous empty)"));
  }
  // Stale data from earlier use would count as calibration data: clear the cache.
  for (int32_t r = 0; r < ranks; ++r) {
    Backend& be = engine.rank_backend(r);
    for (int32_t l = 0; l < L; ++l) {
      const PagedKvView v = engine.pool().layer_view(l, r);
      const size_t bytes = size_t(v.num_slots() * v.row_elems()) * 2;
      KVFUSE_RETURN_IF_ERROR(be.memset(v.k, 0, bytes));
      KVFUSE_RETURN_IF_ERROR(be.memset(v.v, 0, bytes));
    }
  }

  KvAmax out;
  out.k.assign(size_t(L), 0.0f);
  out.v.assign(size_t(L), 0.0f);
  std::vector<uint16_t> host;
  // Scans every layer's whole cache: cheaper to get right than following slots through
  // SWA tables whose out-of-window pages are freed (and may be reused) after each step.
  auto scan = [&]() -> absl::Status {
    for (int32_t i = 0; i < ranks * L; ++i) {
      const int32_t r = i / L, l = i % L;
      Backend& be = engine.rank_backend(r);
      const PagedKvView v = engine.pool().layer_view(l, r);
      host.resize(size_t(v.num_slots() * v.row_elems()));
      for (const auto& [ptr, amax, kind] :
           {std::tuple{v.k, &out.k[size_t(l)], "K"}, std::tuple{v.v, &out.v[size_t(l)], "V"}}) {
        KVFUSE_RETURN_IF_ERROR(be.copy_to_host(host.data(), ptr, host.size() * 2));
        if (!bf16_amax(host, *amax)) {
          return absl::DataLossError(absl::StrCat("calibration: layer ", l, " ", kind, " holds NaN or inf"));
        }
      }
    }
    return absl::OkStatus();
  };

  const int32_t chunk = engine.config().max_batch_tokens;
  const SeqId id = SeqId(1) << 62;  // any id: the engine has no other sequence
  for (const auto& prompt : prompts) {
    if (absl::Status st = engine.add_sequence(id, prompt, SamplingParams{}); !st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat("calibration prompt ", out.num_prompts, ": ", st.message()));
    }
    for (int32_t done = 0; done < int32_t(prompt.size());) {
      const int32_t n = std::min<int32_t>(chunk, int32_t(prompt.size()) - done);
      auto r = engine.step({StepItem{id, n, /*sample=*/false, /*logits=*/false}});
      absl::Status st = r.ok() ? (*r)[0].status : r.status();
      if (st.ok()) st = scan();
      if (!st.ok()) {
        (void)engine.release(id);
        return st;
      }
      done += n;
    }
    KVFUSE_RETURN_IF_ERROR(engine.release(id));
    out.num_tokens += int64_t(prompt.size());
    ++out.num_prompts;
  }
  return out;
}

KvScales scales_from_amax(const KvAmax& a) {
  KvScales s;
  for (float x : a.k) s.k.push_back(x > 0.0f ? x / kKvScaleReferenceMax : 1.0f);
  for (float x : a.v) s.v.push_back(x > 0.0f ? x / kKvScaleReferenceMax : 1.0f);
  s.k_source = s.v_source = "calibration";
  return s;
}

nlohmann::json kv_scales_file_json(const KvAmax& a, const KvScales& s, const std::string& model) {
  return {{"format", "kvfuse-kv-scales-v1"},
          {"fp8_reference", "e4m3fn"},
          {"fp8_max", kKvScaleReferenceMax},
          {"model", model},
          {"num_layers", s.k.size()},
          {"num_prompts", a.num_prompts},
          {"num_tokens", a.num_tokens},
          {"k_scale", s.k},
          {"v_scale", s.v},
          {"k_amax", a.k},
          {"v_amax", a.v}};
}

}  // namespace kvfuse
