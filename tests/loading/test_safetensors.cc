// The safetensors parser, reader, converter and writer, on files the tests write: valid
// files of every float dtype, and a corpus of malformed files, each rejected with an
// error that names the file and the tensor. Every prefix and every byte flip of a valid
// file is parsed too, as a small deterministic fuzz run in CI.
#include <cmath>
#include <cstring>

#include "tests/util/checkpoint_test_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using Catch::Matchers::ContainsSubstring;

namespace {

// A file of three small tensors (shapes [2, 3] F32, [4] BF16, [] F16).
std::string small_file() {
  std::vector<StWriteTensor> t = {
      {"a", StDtype::F32, {2, 3}, bytes_of(std::vector<float>{1, 2, 3, 4, 5, 6})},
      {"b", StDtype::BF16, {4}, bytes_of(std::vector<uint16_t>{0x3f80, 0x4000, 0xbf80, 0})},
      {"c", StDtype::F16, {}, bytes_of(std::vector<uint16_t>{0x3c00})},
  };
  auto s = serialize_safetensors(t, {{"format", "pt"}});
  REQUIRE(s.ok());
  return *s;
}

// A file from a raw header and `data_bytes` zero bytes of data.
std::string raw_file(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((uint64_t(header.size()) >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\0');
}

absl::Status parse(const std::string& bytes) {
  return parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "bad.safetensors")
      .status();
}

}  // namespace

TEST_CASE(
    "safetensors: BF16, F16, F32 and F64 tensors round-trip through writer, mmap reader and bf16 conversion",
    "[safetensors]") {
  TempDir dir;
  // Values exact in every dtype, plus fp32 values that must round to nearest even in bf16.
  const std::vector<float> vals = {1.0f,    -2.5f,   0.0f, 65504.0f, 1.0f + 0x1.0p-8f, 1.0f + 0x1.8p-7f,
                                   3.0e-5f, -1.5e-3f};
  const std::vector<bf16_t> want_bf16 = {0x3f80,
                                         0xc020,
                                         0x0000,
                                         f32_to_bf16(65504.0f),
                                         0x3f80,
                                         0x3f82,
                                         f32_to_bf16(3.0e-5f),
                                         f32_to_bf16(-1.5e-3f)};
  std::vector<uint16_t> f16;
  std::vector<double> f64;
  std::vector<uint16_t> bf16;
  for (float v : vals) {
    f16.push_back(f32_to_f16(v));
    f64.push_back(double(v));
    bf16.push_back(f32_to_bf16(v));
  }
  const int64_t n = int64_t(vals.size());
  const std::vector<StWriteTensor> tensors = {
      {"w.f32", StDtype::F32, {2, 4}, bytes_of(vals)},
      {"w.bf16", StDtype::BF16, {n}, bytes_of(bf16)},
      {"w.f16", StDtype::F16, {4, 2}, bytes_of(f16)},
      {"w.f64", StDtype::F64, {n}, bytes_of(f64)},
      {"scalar", StDtype::F32, {}, bytes_of(std::vector<float>{0.125f})},
      {"empty", StDtype::BF16, {0, 7}, {}},
      {"fp8", StDtype::F8_E4M3, {2}, {0x38, 0xb8}},  // 1.0, -1.0 in e4m3fn
  };
  const std::string path = dir / "model.safetensors";
  REQUIRE(write_safetensors(path, tensors, {{"format", "pt"}}).ok());
  auto f = SafetensorsFile::open(path);
  INFO(f.status().ToString());
  REQUIRE(f.ok());
  const StHeader& h = (*f)->header();
  CHECK(h.data_start % 8 == 0);  // the writer aligns the data section
  CHECK(h.metadata.at("format") == "pt");
  CHECK(h.tensors.size() == tensors.size());
  for (const StWriteTensor& t : tensors) {
    CAPTURE(t.name);
    const StTensorInfo* info = (*f)->find(t.name);
    REQUIRE(info != nullptr);
    CHECK(info->dtype == t.dtype);
    CHECK(info->shape == t.shape);
    CHECK(std::memcmp((*f)->data(*info), t.bytes.data(), t.bytes.size()) == 0);
  }
  CHECK((*f)->find("missing") == nullptr);

  for (const char* name : {"w.f32", "w.bf16", "w.f64"}) {
    CAPTURE(name);
    const StTensorInfo* info = (*f)->find(name);
    std::vector<bf16_t> got(static_cast<size_t>(info->num_elements()));
    REQUIRE(st_to_bf16(info->dtype, (*f)->data(*info), info->num_elements(), got.data(), name).ok());
    CHECK(got == want_bf16);
  }
  // F16 holds its own rounding of the values; bf16 of it must equal bf16 of the f16 value.
  const StTensorInfo* h16 = (*f)->find("w.f16");
  std::vector<bf16_t> got16(static_cast<size_t>(n));
  REQUIRE(st_to_bf16(StDtype::F16, (*f)->data(*h16), n, got16.data(), "w.f16").ok());
  for (size_t i = 0; i < vals.size(); ++i) CHECK(got16[i] == f32_to_bf16(f16_to_f32(f16[i])));

  CHECK(*st_element_f32(StDtype::F32, (*f)->data(*(*f)->find("scalar")), 0, "scalar") == 0.125f);
  CHECK(*st_element_f32(StDtype::F8_E4M3, (*f)->data(*(*f)->find("fp8")), 1, "fp8") == -1.0f);
  const absl::Status bad = st_to_bf16(StDtype::I32, nullptr, 0, nullptr, "x.safetensors: tensor 'q'");
  CHECK(contains(std::string(bad.message()), "tensor 'q'"));
  CHECK(contains(std::string(bad.message()), "I32"));
}

TEST_CASE("safetensors malformed: each corrupt file is rejected with an error naming the file and the tensor",
          "[safetensors][errors]") {
  const std::string good = small_file();
  REQUIRE(parse(good).ok());
  const std::string f32x4 = R"("dtype":"F32","shape":[4])";
  struct Case {
    const char* what;
    std::string bytes;
    std::vector<std::string> expect;  // substrings of the message
  };
  const std::vector<Case> cases = {
      {"empty file", "", {"truncated"}},
      {"7 bytes", std::string(7, '\0'), {"truncated"}},
      {"header length beyond the file", good.substr(0, 8) + "{}", {"runs past the end of the file"}},
      {"header length 2^63", std::string("\0\0\0\0\0\0\0\x80", 8) + "{}", {"runs past the end"}},
      {"truncated data", good.substr(0, good.size() - 1), {"tensor 'c'", "truncated"}},
      {"not JSON", raw_file("{\"a\": ", 0), {"not valid JSON"}},
      {"not an object", raw_file("[1, 2]", 0), {"does not start with '{'"}},
      {"garbage after the object", raw_file("{} x", 0), {"not valid JSON"}},
      {"invalid UTF-8", raw_file("{\"\xff\xfe\": 1}", 0), {"not valid JSON"}},
      {"entry not an object", raw_file(R"({"w": 3})", 0), {"tensor 'w'", "not an object"}},
      {"no data_offsets",
       raw_file(R"({"w": {"dtype":"F32","shape":[1]}})", 4),
       {"tensor 'w'", "data_offsets"}},
      {"unknown dtype",
       raw_file(R"({"w": {"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", 1),
       {"tensor 'w'", "unsupported dtype 'F7'"}},
      {"negative size",
       raw_file(R"({"w": {"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       {"tensor 'w'", "shape"}},
      {"fractional size",
       raw_file(R"({"w": {"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4),
       {"tensor 'w'", "shape"}},
      {"shape too large",
       raw_file(R"({"w": {"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,4]}})", 4),
       {"tensor 'w'", "too large"}},
      {"negative offset",
       raw_file("{\"w\": {" + f32x4 + ",\"data_offsets\":[-16,0]}}", 16),
       {"tensor 'w'", "data_offsets"}},
      {"one offset",
       raw_file("{\"w\": {" + f32x4 + ",\"data_offsets\":[0]}}", 16),
       {"tensor 'w'", "data_offsets"}},
      {"end before begin",
       raw_file("{\"w\": {" + f32x4 + ",\"data_offsets\":[16,0]}}", 16),
       {"tensor 'w'", "end before"}},
      {"wrong byte count",
       raw_file("{\"w\": {" + f32x4 + ",\"data_offsets\":[0,12]}}", 12),
       {"tensor 'w'", "need 16"}},
      {"offsets past the data",
       raw_file("{\"w\": {" + f32x4 + ",\"data_offsets\":[8,24]}}", 16),
       {"tensor 'w'", "run past the data section"}},
      {"overlap",
       raw_file(
           "{\"a\": {" + f32x4 + ",\"data_offsets\":[0,16]}, \"b\": {" + f32x4 + ",\"data_offsets\":[8,24]}}",
           24),
       {"'a'", "'b'", "overlap"}},
      {"hole",
       raw_file("{\"a\": {" + f32x4 + ",\"data_offsets\":[0,16]}, \"b\": {" + f32x4 +
                    ",\"data_offsets\":[20,36]}}",
                36),
       {"'b'", "no holes"}},
      {"trailing data",
       raw_file("{\"a\": {" + f32x4 + ",\"data_offsets\":[0,16]}}", 20),
       {"after the last tensor"}},
      {"duplicate name",
       raw_file(
           "{\"a\": {" + f32x4 + ",\"data_offsets\":[0,16]}, \"a\": {" + f32x4 + ",\"data_offsets\":[0,16]}}",
           16),
       {"'a' twice"}},
      {"metadata not strings", raw_file(R"({"__metadata__": {"x": 1}})", 0), {"__metadata__", "'x'"}},
      {"deep nesting",
       raw_file("{\"a\":" + std::string(64, '[') + std::string(64, ']') + "}", 0),
       {"nests too deeply"}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const absl::Status st = parse(c.bytes);
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    const std::string msg(st.message());
    CAPTURE(msg);
    CHECK(contains(msg, "bad.safetensors: "));
    for (const auto& e : c.expect) CHECK(contains(msg, e));
  }
}

TEST_CASE("safetensors robustness: every prefix and every byte flip of a valid file parses or fails cleanly",
          "[safetensors][errors]") {
  const std::string good = small_file();
  int parsed = 0, failed = 0;
  for (size_t n = 0; n < good.size(); ++n) {
    REQUIRE_FALSE(parse(good.substr(0, n)).ok());  // a strict prefix is never a valid file
  }
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t flip : {0x01, 0x10, 0x80, 0xff}) {
      std::string b = good;
      b[i] = char(uint8_t(b[i]) ^ flip);
      const auto h = parse_safetensors(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "flip");
      if (h.ok()) {
        ++parsed;
        // A file that parses must keep every tensor inside the buffer.
        for (const auto& t : h->tensors) REQUIRE(h->data_start + t.end <= b.size());
      } else {
        ++failed;
      }
    }
  }
  CHECK(parsed > 0);  // flips in tensor data leave the file valid
  CHECK(failed > 0);
}

TEST_CASE("safetensors files: missing, directory and truncated files on disk fail with their path",
          "[safetensors][errors]") {
  TempDir dir;
  auto missing = SafetensorsFile::open(dir / "nope.safetensors");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(contains(std::string(missing.status().message()), "nope.safetensors"));
  CHECK_FALSE(SafetensorsFile::open(dir.path()).ok());
  const std::string good = small_file();
  write_file(dir / "cut.safetensors", good.substr(0, good.size() - 1));
  auto cut = SafetensorsFile::open(dir / "cut.safetensors");
  REQUIRE_FALSE(cut.ok());
  CHECK(contains(std::string(cut.status().message()), dir / "cut.safetensors"));
  CHECK(contains(std::string(cut.status().message()), "tensor 'c'"));
  write_file(dir / "tiny.safetensors", "abc");
  CHECK(
      contains(std::string(SafetensorsFile::open(dir / "tiny.safetensors").status().message()), "truncated"));
}

TEST_CASE("safetensors index: weight_map is parsed and shard names outside the directory are refused",
          "[safetensors][errors]") {
  auto ok = parse_safetensors_index(
      R"({"metadata": {"total_size": 8}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})",
      "index.json");
  REQUIRE(ok.ok());
  CHECK(ok->at("b") == "s2.safetensors");
  for (const char* bad :
       {R"({"weight_map": {"a": "../x.safetensors"}})", R"({"weight_map": {"a": "/etc/passwd"}})",
        R"({"weight_map": {"a": ".."}})", R"({"weight_map": {"a": 3}})", R"({"weight_map": {}})",
        R"({"metadata": {}})", "[]", "{"}) {
    CAPTURE(bad);
    auto r = parse_safetensors_index(bad, "index.json");
    REQUIRE_FALSE(r.ok());
    CHECK(contains(std::string(r.status().message()), "index.json: "));
  }
}

TEST_CASE("safetensors header length: at most the file's size - 8 bytes, else it runs past the end",
          "[safetensors][errors]") {
  // The buffers handed to the parser go on past `size` with spaces (a header's own
  // padding): a parser that reads past the end of the file finds more header there,
  // neither crashing nor saying that the length runs past the end.
  const auto parse_padded = [](const std::string& file) {
    const std::string buf = file + std::string(64, ' ');
    return parse_safetensors(reinterpret_cast<const uint8_t*>(buf.data()), file.size(), "bad.safetensors")
        .status();
  };
  const auto with_length = [](std::string file, uint64_t n) {
    for (int i = 0; i < 8; ++i) file[size_t(i)] = char((n >> (8 * i)) & 0xff);
    return file;
  };

  // 10 bytes: a length of 3, then "{}". The header would end one byte past the file.
  const std::string ten = with_length(std::string(8, '\0'), 3) + "{}";
  REQUIRE(ten.size() == 10);
  absl::Status st = parse_padded(ten);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(st.message()),
             ContainsSubstring("header length 3 runs past the end of the file (10 bytes)"));
  // The same file on disk (mapped: the rest of its page reads as zeros).
  TempDir dir;
  write_file(dir / "ten.safetensors", ten);
  auto f = SafetensorsFile::open(dir / "ten.safetensors");
  REQUIRE_FALSE(f.ok());
  CHECK_THAT(std::string(f.status().message()), ContainsSubstring(dir / "ten.safetensors"));
  CHECK_THAT(std::string(f.status().message()), ContainsSubstring("runs past the end of the file"));
  // A length of 2 makes it a valid file of no tensors.
  REQUIRE(parse_padded(with_length(ten, 2)).ok());

  // "{}" and 14 spaces: any length from 2 to 16 (size - 8) reads a JSON object; 16 leaves
  // no data (a valid file), a shorter one leaves data no tensor holds, a longer one runs
  // past the end.
  const std::string body = with_length(std::string(8, '\0'), 0) + "{}" + std::string(14, ' ');
  const uint64_t fits = body.size() - 8;
  for (uint64_t n = 0; n <= fits + 16; ++n) {
    CAPTURE(n);
    st = parse_padded(with_length(body, n));
    if (n == fits) {
      CHECK(st.ok());
      continue;
    }
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    const std::string msg(st.message());
    const std::string past =
        "header length " + std::to_string(n) + " runs past the end of the file (24 bytes)";
    const char* short_header = n == 0 ? "does not start with '{'" : "not valid JSON";
    CHECK_THAT(msg, ContainsSubstring(n > fits ? past : n < 2 ? short_header : "after the last tensor"));
  }

  // small_file() with its length field swept over the boundary: its own length parses;
  // one that takes data bytes into the header leaves too few for tensor 'a' (the JSON
  // parser ends the header at the data's first byte, a 0); one past size - 8 runs past
  // the end.
  const std::string good = small_file();
  uint64_t own = 0;
  for (int i = 7; i >= 0; --i) own = (own << 8) | uint8_t(good[size_t(i)]);
  REQUIRE(parse_padded(good).ok());
  const uint64_t last = good.size() - 8;
  REQUIRE(own < last - 1);
  for (uint64_t n = last - 1; n <= good.size() + 8; ++n) {
    CAPTURE(n);
    st = parse_padded(with_length(good, n));
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    const std::string msg(st.message());
    if (n > last) {
      CHECK_THAT(msg,
                 ContainsSubstring("header length " + std::to_string(n) + " runs past the end of the file"));
    } else {
      CHECK_THAT(msg, ContainsSubstring("tensor 'a': data_offsets [0, 24] run past the data section"));
    }
  }
}
