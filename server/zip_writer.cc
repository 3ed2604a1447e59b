#include "server/zip_writer.h"

#include <array>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvfuse::server {

namespace {

constexpr uint16_t kVersion = 10;     // 1.0: stored entries need nothing newer
constexpr uint16_t kFlagUtf8 = 0x0800;  // names are UTF-8
constexpr uint16_t kDosTime = 0;        // 00:00:00
constexpr uint16_t kDosDate = (0 << 9) | (1 << 5) | 1;  // 1980-01-01
constexpr uint64_t kMax32 = std::numeric_limits<uint32_t>::max();

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void put16(std::string& out, uint16_t v) {
  out.push_back(char(v & 0xff));
  out.push_back(char(v >> 8));
}
void put32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t crc32(std::string_view bytes, uint32_t crc) {
  const auto& t = crc_table();
  crc = ~crc;
  for (unsigned char b : bytes) crc = t[(crc ^ b) & 0xff] ^ (crc >> 8);
  return ~crc;
}

absl::Status ZipWriter::add(const std::string& name, std::string_view bytes) {
  if (name.empty() || name.front() == '/' || name.find("..") != std::string::npos || name.size() > 0xffff) {
    return absl::InvalidArgumentError(absl::StrCat("zip: entry name \"", name, "\" is not a relative path"));
  }
  if (entries_.size() >= 0xffff || bytes.size() > kMax32 || out_.size() + bytes.size() + 64 + name.size() > kMax32) {
    return absl::ResourceExhaustedError("zip: the archive would need zip64 (over 65535 entries or 4 GiB)");
  }
  Entry e{name, crc32(bytes), uint32_t(bytes.size()), uint32_t(out_.size())};
  put32(out_, 0x04034b50);  // local file header
  put16(out_, kVersion);
  put16(out_, kFlagUtf8);
  put16(out_, 0);  // stored
  put16(out_, kDosTime);
  put16(out_, kDosDate);
  put32(out_, e.crc);
  put32(out_, e.size);  // compressed
  put32(out_, e.size);  // uncompressed
  put16(out_, uint16_t(name.size()));
  put16(out_, 0);  // extra field
  out_ += name;
  out_.append(bytes.data(), bytes.size());
  entries_.push_back(std::move(e));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ZipWriter::finish() {
  const uint64_t cd_offset = out_.size();
  for (const Entry& e : entries_) {
    put32(out_, 0x02014b50);  // central directory header
    put16(out_, uint16_t((3 << 8) | kVersion));  // made by: Unix, so the attributes below count
    put16(out_, kVersion);
    put16(out_, kFlagUtf8);
    put16(out_, 0);  // stored
    put16(out_, kDosTime);
    put16(out_, kDosDate);
    put32(out_, e.crc);
    put32(out_, e.size);
    put32(out_, e.size);
    put16(out_, uint16_t(e.name.size()));
    put16(out_, 0);  // extra field
    put16(out_, 0);  // comment
    put16(out_, 0);  // disk number
    put16(out_, 0);  // internal attributes
    put32(out_, uint32_t(0100644) << 16);  // a regular file, rw-r--r--
    put32(out_, e.offset);
    out_ += e.name;
  }
  const uint64_t cd_size = out_.size() - cd_offset;
  if (out_.size() + 22 > kMax32) return absl::ResourceExhaustedError("zip: the archive would need zip64 (over 4 GiB)");
  put32(out_, 0x06054b50);  // end of central directory
  put16(out_, 0);           // this disk
  put16(out_, 0);           // the disk with the central directory
  put16(out_, uint16_t(entries_.size()));
  put16(out_, uint16_t(entries_.size()));
  put32(out_, uint32_t(cd_size));
  put32(out_, uint32_t(cd_offset));
  put16(out_, 0);  // comment
  std::string archive = std::move(out_);
  out_.clear();
  entries_.clear();
  return archive;
}

}  // namespace kvfuse::server
