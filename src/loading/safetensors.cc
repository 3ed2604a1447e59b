#include "src/loading/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/common/fp8.h"
#include "src/common/status_macros.h"

namespace kvfuse {

using nlohmann::json;

namespace {

struct DtypeRow {
  StDtype dtype;
  const char* name;
  int bytes;
};
constexpr DtypeRow kDtypes[] = {
    {StDtype::BOOL, "BOOL", 1},       {StDtype::U8, "U8", 1},           {StDtype::I8, "I8", 1},
    {StDtype::F8_E5M2, "F8_E5M2", 1}, {StDtype::F8_E4M3, "F8_E4M3", 1}, {StDtype::I16, "I16", 2},
    {StDtype::U16, "U16", 2},         {StDtype::F16, "F16", 2},         {StDtype::BF16, "BF16", 2},
    {StDtype::I32, "I32", 4},         {StDtype::U32, "U32", 4},         {StDtype::F32, "F32", 4},
    {StDtype::F64, "F64", 8},         {StDtype::I64, "I64", 8},         {StDtype::U64, "U64", 8},
};

// Tensors are at most 2^62 bytes: keeps every size computation below far from overflow.
constexpr uint64_t kMaxTensorBytes = uint64_t(1) << 62;

absl::Status bad(absl::string_view file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", what));
}

// Valid headers nest three levels deep. Refusing deep nesting up front keeps the
// recursive parts of the JSON library (copies, dumps) away from hostile input.
bool nests_deeper_than(absl::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escape = false;
  for (char c : text) {
    if (in_string) {
      if (escape) {
        escape = false;
      } else if (c == '\\') {
        escape = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

// A JSON value as a non-negative integer that fits in 63 bits.
bool as_offset(const json& v, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
  } else if (v.is_number_integer()) {
    const int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    out = uint64_t(s);
  } else {
    return false;
  }
  return out <= kMaxTensorBytes;
}

std::string offsets_str(const StTensorInfo& t) { return absl::StrCat("[", t.begin, ", ", t.end, "]"); }

absl::Status parse_tensor(absl::string_view file, const std::string& name, const json& v, StTensorInfo& t) {
  const std::string where = absl::StrCat("tensor '", name, "': ");
  if (!v.is_object()) return bad(file, where + "header entry is not an object");
  const auto dt = v.find("dtype");
  const auto sh = v.find("shape");
  const auto off = v.find("data_offsets");
  if (dt == v.end() || sh == v.end() || off == v.end()) {
    return bad(file, where + "header entry needs dtype, shape and data_offsets");
  }
  if (!dt->is_string() || !st_dtype_from_name(dt->get_ref<const std::string&>(), t.dtype)) {
    return bad(file, where + (dt->is_string() ? absl::StrCat("unsupported dtype '",
                                                             dt->get_ref<const std::string&>(), "'")
                                              : std::string("dtype is not a string")));
  }
  if (!sh->is_array() || sh->size() > 16)
    return bad(file, where + "shape is not an array of at most 16 sizes");
  uint64_t elems = 1;
  for (const json& d : *sh) {
    uint64_t n = 0;
    if (!as_offset(d, n)) return bad(file, where + "shape holds a value that is not a size >= 0");
    t.shape.push_back(int64_t(n));
    // elems * n <= kMaxTensorBytes, checked without overflowing.
    if (n != 0 && elems > kMaxTensorBytes / n)
      return bad(file, where + "shape " + shape_str(t.shape) + " is too large");
    elems *= n;
  }
  const uint64_t want = elems * uint64_t(st_dtype_bytes(t.dtype));
  if (want > kMaxTensorBytes) return bad(file, where + "shape " + shape_str(t.shape) + " is too large");
  if (!off->is_array() || off->size() != 2 || !as_offset((*off)[0], t.begin) ||
      !as_offset((*off)[1], t.end)) {
    return bad(file, where + "data_offsets is not a pair of offsets >= 0");
  }
  if (t.end < t.begin) return bad(file, where + "data_offsets " + offsets_str(t) + " end before they begin");
  if (t.end - t.begin != want) {
    return bad(file, absl::StrCat(where, "data_offsets ", offsets_str(t), " hold ", t.end - t.begin,
                                  " bytes; dtype ", st_dtype_name(t.dtype), " and shape ", shape_str(t.shape),
                                  " need ", want));
  }
  t.name = name;
  return absl::OkStatus();
}

}  // namespace

const char* st_dtype_name(StDtype d) {
  for (const auto& r : kDtypes) {
    if (r.dtype == d) return r.name;
  }
  return "?";
}

int st_dtype_bytes(StDtype d) {
  for (const auto& r : kDtypes) {
    if (r.dtype == d) return r.bytes;
  }
  return 1;
}

bool st_dtype_from_name(absl::string_view name, StDtype& out) {
  for (const auto& r : kDtypes) {
    if (name == r.name) {
      out = r.dtype;
      return true;
    }
  }
  return false;
}

int64_t StTensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

const StTensorInfo* StHeader::find(absl::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors[it->second];
}

void StHeader::reindex() {
  index_.clear();
  for (size_t i = 0; i < tensors.size(); ++i) index_[tensors[i].name] = i;
}

absl::StatusOr<StHeader> parse_safetensors(const uint8_t* data, uint64_t size, absl::string_view file) {
  if (size < 8) {
    return bad(file,
               absl::StrCat("file is ", size, " bytes, shorter than the 8-byte header length: truncated"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  if (n > size - 8) {
    return bad(file, absl::StrCat("header length ", n, " runs past the end of the file (", size,
                                  " bytes): truncated, or not a safetensors file"));
  }
  if (n > kMaxSafetensorsHeaderBytes) {
    return bad(file, absl::StrCat("header length ", n, " exceeds the limit of ", kMaxSafetensorsHeaderBytes,
                                  " bytes"));
  }
  const absl::string_view text(reinterpret_cast<const char*>(data + 8), size_t(n));
  if (text.empty() || text[0] != '{')
    return bad(file, "header does not start with '{': not a safetensors file");
  if (nests_deeper_than(text, 8)) return bad(file, "header JSON nests too deeply");

  // The JSON library keeps the last of duplicate keys; the format forbids them, and a
  // duplicate tensor name would silently hide data, so they are caught while parsing.
  std::set<std::string> keys;
  std::string duplicate;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      if (!keys.insert(parsed.get<std::string>()).second && duplicate.empty())
        duplicate = parsed.get<std::string>();
    }
    return true;
  };
  const json h = json::parse(text.begin(), text.end(), on_event, /*allow_exceptions=*/false);
  if (h.is_discarded()) return bad(file, "header is not valid JSON");
  if (!h.is_object()) return bad(file, "header is not a JSON object");
  if (!duplicate.empty()) return bad(file, absl::StrCat("header names '", duplicate, "' twice"));

  StHeader out;
  out.data_start = 8 + n;
  out.data_size = size - out.data_start;
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) return bad(file, "__metadata__ is not an object");
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string())
          return bad(file, absl::StrCat("__metadata__ value of '", mk, "' is not a string"));
        out.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    StTensorInfo t;
    KVFUSE_RETURN_IF_ERROR(parse_tensor(file, name, v, t));
    if (t.end > out.data_size) {
      return bad(file, absl::StrCat("tensor '", name, "': data_offsets ", offsets_str(t),
                                    " run past the data section (", out.data_size,
                                    " bytes): truncated file or corrupt offsets"));
    }
    out.tensors.push_back(std::move(t));
  }

  // The tensors must tile the data section: sorted by offset, each starts where the
  // previous one ends (empty tensors may share an offset), the last ends at the end.
  std::sort(out.tensors.begin(), out.tensors.end(), [](const StTensorInfo& a, const StTensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  const StTensorInfo* prev = nullptr;
  for (const StTensorInfo& t : out.tensors) {
    if (t.begin < at) {
      return bad(file, absl::StrCat("tensors '", prev->name, "' ", offsets_str(*prev), " and '", t.name, "' ",
                                    offsets_str(t), " overlap"));
    }
    if (t.begin > at) {
      return bad(file, absl::StrCat("bytes [", at, ", ", t.begin,
                                    ") of the data section belong to no tensor (before '", t.name,
                                    "'); the format allows no holes"));
    }
    at = t.end;
    prev = &t;
  }
  if (at != out.data_size) {
    return bad(file, absl::StrCat("the data section has ", out.data_size - at,
                                  " bytes after the last tensor; ", "the format allows no trailing data"));
  }
  out.reindex();
  return out;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return absl::Status(err == ENOENT ? absl::StatusCode::kNotFound : absl::StatusCode::kPermissionDenied,
                        absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  struct stat sb {};
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->size_ = uint64_t(sb.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    return bad(
        path, absl::StrCat("file is ", f->size_, " bytes, shorter than the 8-byte header length: truncated"));
  }
  void* p = mmap(nullptr, size_t(f->size_), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, ": mmap of ", f->size_, " bytes failed: ", std::strerror(map_err)));
  }
  f->base_ = static_cast<const uint8_t*>(p);
  auto h = parse_safetensors(f->base_, f->size_, path);
  if (!h.ok()) return h.status();  // the destructor unmaps
  f->header_ = std::move(*h);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) munmap(const_cast<uint8_t*>(base_), size_t(size_));
}

absl::StatusOr<std::map<std::string, std::string>> parse_safetensors_index(absl::string_view text,
                                                                           absl::string_view file) {
  if (nests_deeper_than(text, 8)) return bad(file, "JSON nests too deeply");
  const json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad(file, "not valid JSON");
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object()) {
    return bad(file, "has no \"weight_map\" object");
  }
  std::map<std::string, std::string> out;
  for (const auto& [name, v] : j.at("weight_map").items()) {
    if (!v.is_string())
      return bad(file, absl::StrCat("weight_map entry of tensor '", name, "' is not a file name"));
    const std::string& shard = v.get_ref<const std::string&>();
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
        shard.find('\\') != std::string::npos || shard.find('\0') != std::string::npos) {
      return bad(file, absl::StrCat("weight_map entry of tensor '", name, "' names '", shard,
                                    "', which is not a plain file name in the checkpoint directory"));
    }
    out[name] = shard;
  }
  if (out.empty()) return bad(file, "weight_map is empty");
  return out;
}

namespace {
template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
}  // namespace

absl::Status st_to_bf16(StDtype dtype, const uint8_t* src, int64_t count, bf16_t* out,
                        absl::string_view what) {
  switch (dtype) {
    case StDtype::BF16:
      if (count > 0) std::memcpy(out, src, size_t(count) * 2);
      return absl::OkStatus();
    case StDtype::F16:
      for (int64_t i = 0; i < count; ++i) out[i] = f32_to_bf16(f16_to_f32(load<uint16_t>(src + 2 * i)));
      return absl::OkStatus();
    case StDtype::F32:
      for (int64_t i = 0; i < count; ++i) out[i] = f32_to_bf16(load<float>(src + 4 * i));
      return absl::OkStatus();
    case StDtype::F64:
      // Double rounding through fp32 can differ from one rounding in the last bf16 bit
      // only for values within 2^-29 relative of a tie: irrelevant for weights.
      for (int64_t i = 0; i < count; ++i) out[i] = f32_to_bf16(float(load<double>(src + 8 * i)));
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dtype ", st_dtype_name(dtype),
                       " cannot be converted to bf16 (expected BF16, F16, F32 or F64)"));
  }
}

absl::StatusOr<float> st_element_f32(StDtype dtype, const uint8_t* src, int64_t i, absl::string_view what) {
  switch (dtype) {
    case StDtype::BF16:
      return bf16_to_f32(load<uint16_t>(src + 2 * i));
    case StDtype::F16:
      return f16_to_f32(load<uint16_t>(src + 2 * i));
    case StDtype::F32:
      return load<float>(src + 4 * i);
    case StDtype::F64:
      return float(load<double>(src + 8 * i));
    case StDtype::F8_E4M3:
      return fp8_decode(src[i], Fp8Format::e4m3fn);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dtype ", st_dtype_name(dtype), " is not a floating-point type"));
  }
}

namespace {

absl::StatusOr<std::string> header_bytes(const std::vector<StWriteTensor>& tensors,
                                         const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t at = 0;
  std::set<std::string> names;
  for (const StWriteTensor& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors writer: tensor name '", t.name, "' is reserved or repeated"));
    }
    int64_t elems = 1;
    for (int64_t d : t.shape) elems *= d;
    if (uint64_t(elems) * uint64_t(st_dtype_bytes(t.dtype)) != t.bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors writer: tensor '", t.name, "' has ",
                                                     t.bytes.size(), " bytes for shape ",
                                                     shape_str(t.shape)));
    }
    h[t.name] = {
        {"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(text.size()) >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace

absl::StatusOr<std::string> serialize_safetensors(const std::vector<StWriteTensor>& tensors,
                                                  const std::map<std::string, std::string>& metadata) {
  auto out = header_bytes(tensors, metadata);
  if (!out.ok()) return out.status();
  for (const StWriteTensor& t : tensors)
    out->append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  return out;
}

absl::Status write_safetensors(const std::string& path, const std::vector<StWriteTensor>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  auto head = header_bytes(tensors, metadata);
  if (!head.ok()) return head.status();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create"));
  f.write(head->data(), std::streamsize(head->size()));
  for (const StWriteTensor& t : tensors)
    f.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
  f.close();
  if (!f) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

std::vector<uint8_t> bf16_to_st_bytes(const std::vector<bf16_t>& v, StDtype dtype) {
  std::vector<uint8_t> out;
  if (dtype == StDtype::F32) {
    out.resize(v.size() * 4);
    for (size_t i = 0; i < v.size(); ++i) {
      const float f = bf16_to_f32(v[i]);
      std::memcpy(out.data() + 4 * i, &f, 4);
    }
  } else if (dtype == StDtype::F16) {
    out.resize(v.size() * 2);
    for (size_t i = 0; i < v.size(); ++i) {
      const f16_t h = f32_to_f16(bf16_to_f32(v[i]));
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  } else {
    out.resize(v.size() * 2);
    if (!v.empty()) std::memcpy(out.data(), v.data(), v.size() * 2);
  }
  return out;
}

}  // namespace kvfuse
