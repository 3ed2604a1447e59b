// Safetensors files (https://github.com/huggingface/safetensors): the header parser,
// a memory-mapped reader, dtype conversion to bf16, and a writer for tests and exports.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON (an object mapping
// tensor names to {dtype, shape, data_offsets} plus an optional "__metadata__" object of
// strings), then the data section. Offsets are relative to the data section. The format
// requires the tensors to tile the data section exactly: no overlap, no hole, nothing
// past the end. The parser enforces all of it, so a file that parses can be read
// anywhere inside its tensors without further bounds checks.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/bf16.h"

namespace kvfuse {

enum class StDtype : uint8_t {
  BOOL,
  U8,
  I8,
  F8_E5M2,
  F8_E4M3,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64
};

const char* st_dtype_name(StDtype d);
int st_dtype_bytes(StDtype d);
bool st_dtype_from_name(absl::string_view name, StDtype& out);

struct StTensorInfo {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;

  int64_t num_elements() const;  // 1 for a scalar (shape [])
};

std::string shape_str(const std::vector<int64_t>& shape);  // "[4096, 128]"

struct StHeader {
  uint64_t data_start = 0;  // 8 + header length: file offset of the data section
  uint64_t data_size = 0;
  std::vector<StTensorInfo> tensors;  // in data-offset order
  std::map<std::string, std::string> metadata;

  const StTensorInfo* find(absl::string_view name) const;
  void reindex();  // rebuilds the name index after `tensors` changes

 private:
  std::unordered_map<std::string, size_t> index_;
};

// Largest header accepted: the reference implementation's limit.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Parses and validates a whole safetensors file held in memory. `file` names it in
// errors. Never reads outside [data, data + size).
absl::StatusOr<StHeader> parse_safetensors(const uint8_t* data, uint64_t size, absl::string_view file);

// A read-only memory map of one safetensors file, validated on open.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const StHeader& header() const { return header_; }
  const StTensorInfo* find(absl::string_view name) const { return header_.find(name); }
  // The tensor's bytes (end - begin of them), in the map.
  const uint8_t* data(const StTensorInfo& t) const { return base_ + header_.data_start + t.begin; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  StHeader header_;
};

// The index of a sharded checkpoint (model.safetensors.index.json):
// {"metadata": {...}, "weight_map": {"tensor name": "shard file name", ...}}. Shard names
// must be plain file names (no directories), so an index cannot point outside its
// directory. Returns tensor name -> shard file name.
absl::StatusOr<std::map<std::string, std::string>> parse_safetensors_index(absl::string_view text,
                                                                           absl::string_view file);

// Converts `count` elements of a floating-point tensor to bf16, rounding to nearest
// even (BF16 is copied; F16, F32 and F64 are rounded once). Other dtypes are an error
// naming `what`. Source bytes may be unaligned.
absl::Status st_to_bf16(StDtype dtype, const uint8_t* src, int64_t count, bf16_t* out,
                        absl::string_view what);
// Element i of a floating-point tensor as fp32 (F8_E4M3 decodes as OCP e4m3fn).
absl::StatusOr<float> st_element_f32(StDtype dtype, const uint8_t* src, int64_t i, absl::string_view what);

// Writing. Tensors are laid out in the order given; the header is padded with spaces
// to a multiple of 8 bytes so that the data section is aligned.
struct StWriteTensor {
  std::string name;
  StDtype dtype = StDtype::BF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
// The complete file bytes (for tests that then corrupt them).
absl::StatusOr<std::string> serialize_safetensors(const std::vector<StWriteTensor>& tensors,
                                                  const std::map<std::string, std::string>& metadata = {});
absl::Status write_safetensors(const std::string& path, const std::vector<StWriteTensor>& tensors,
                               const std::map<std::string, std::string>& metadata = {});

// Converts host bf16 values to the bytes of `dtype` (BF16, F16 or F32) for a writer.
std::vector<uint8_t> bf16_to_st_bytes(const std::vector<bf16_t>& v, StDtype dtype);

}  // namespace kvfuse
