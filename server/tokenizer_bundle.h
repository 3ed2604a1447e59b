// GetTokenizer's bundle: the tokenizer files of the checkpoint directory in one stored
// zip (server/zip_writer.h), each at the archive's root as smg extracts it into one
// directory and loads the tokenizer from there, with the archive's SHA-256 (lowercase
// hex, as smg checks it).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvfuse::server {

// The files a bundle takes from the directory, those that exist, in this order.
const std::vector<std::string>& tokenizer_bundle_files();

struct TokenizerBundle {
  std::string zip;
  std::string sha256;               // of `zip`, lowercase hex
  std::vector<std::string> files;  // what it holds
};

// NOT_FOUND naming what is missing: no checkpoint directory (a synthetic preset), or
// none of the tokenizer files proper (tokenizer.json, tokenizer.model, vocab.json,
// vocab.txt) in it.
absl::StatusOr<TokenizerBundle> make_tokenizer_bundle(const std::string& model_path, const std::string& model_name);

// SHA-256 in lowercase hex (OpenSSL's libcrypto).
std::string sha256_hex(std::string_view bytes);

}  // namespace kvfuse::server
