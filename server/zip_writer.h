// A minimal zip archive writer: stored (uncompressed) entries with their CRC-32, the
// central directory and its end record (PKWARE APPNOTE 6.3, no zip64: at most 65535
// entries and 4 GiB). Entries carry a fixed time (1980-01-01 00:00), so the same files
// make the same bytes. Used for GetTokenizer's bundle (server/tokenizer_bundle.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvfuse::server {

// CRC-32 (IEEE 802.3, reflected 0xEDB88320), as zip and gzip use: "123456789" gives
// 0xCBF43926.
uint32_t crc32(std::string_view bytes, uint32_t crc = 0);

class ZipWriter {
 public:
  // Adds a file `name` (a relative path with '/' separators) holding `bytes`.
  absl::Status add(const std::string& name, std::string_view bytes);
  // The archive; the writer is empty again afterwards.
  absl::StatusOr<std::string> finish();

 private:
  struct Entry {
    std::string name;
    uint32_t crc = 0;
    uint32_t size = 0;
    uint32_t offset = 0;  // of its local header
  };
  std::string out_;
  std::vector<Entry> entries_;
};

}  // namespace kvfuse::server
