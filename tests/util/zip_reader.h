// Reads back a stored (uncompressed) zip archive, as an unzip tool would: the end record,
// the central directory, and each entry's local header and bytes, checking that the two
// headers agree and that every entry's CRC-32 is its bytes'. For the tests of
// server/zip_writer.h and GetTokenizer.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "server/zip_writer.h"
#include "tests/util/catch.h"

namespace kvfuse::testing {

inline uint32_t zip_u16(const std::string& z, size_t at) {
  REQUIRE(at + 2 <= z.size());
  return uint32_t(uint8_t(z[at])) | uint32_t(uint8_t(z[at + 1])) << 8;
}
inline uint32_t zip_u32(const std::string& z, size_t at) { return zip_u16(z, at) | zip_u16(z, at + 2) << 16; }

// name -> bytes of every entry.
inline std::map<std::string, std::string> read_stored_zip(const std::string& z) {
  REQUIRE(z.size() >= 22);
  const size_t eocd = z.size() - 22;  // no archive comment
  REQUIRE(zip_u32(z, eocd) == 0x06054b50u);
  const uint32_t entries = zip_u16(z, eocd + 10);
  const uint32_t cd_size = zip_u32(z, eocd + 12);
  size_t at = zip_u32(z, eocd + 16);
  REQUIRE(at + cd_size == eocd);
  std::map<std::string, std::string> out;
  for (uint32_t i = 0; i < entries; ++i) {
    REQUIRE(zip_u32(z, at) == 0x02014b50u);
    CHECK(zip_u16(z, at + 10) == 0);  // stored
    const uint32_t crc = zip_u32(z, at + 16), csize = zip_u32(z, at + 20), usize = zip_u32(z, at + 24);
    const uint32_t name_len = zip_u16(z, at + 28), extra = zip_u16(z, at + 30), comment = zip_u16(z, at + 32);
    const size_t local = zip_u32(z, at + 42);
    const std::string name = z.substr(at + 46, name_len);
    at += 46 + name_len + extra + comment;
    CHECK(csize == usize);
    REQUIRE(zip_u32(z, local) == 0x04034b50u);
    CHECK(zip_u32(z, local + 14) == crc);
    CHECK(zip_u32(z, local + 18) == csize);
    CHECK(z.substr(local + 30, zip_u16(z, local + 26)) == name);
    const size_t data = local + 30 + zip_u16(z, local + 26) + zip_u16(z, local + 28);
    REQUIRE(data + csize <= z.size());
    std::string bytes = z.substr(data, csize);
    CHECK(server::crc32(bytes) == crc);
    out[name] = std::move(bytes);
  }
  REQUIRE(at == eocd);
  return out;
}

}  // namespace kvfuse::testing
