#include "server/tokenizer_bundle.h"

#include <openssl/evp.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/zip_writer.h"

namespace kvfuse::server {

namespace {

// The files that make a tokenizer (the others only configure one).
const std::vector<std::string>& tokenizer_proper() {
  static const std::vector<std::string> files = {"tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"};
  return files;
}

}  // namespace

const std::vector<std::string>& tokenizer_bundle_files() {
  // config.json and chat_template.jinja too: smg reads the first for the model's
  // multimodal settings and the second for chat templating, from the same directory.
  static const std::vector<std::string> files = {
      "tokenizer.json",    "tokenizer_config.json",  "special_tokens_map.json", "tokenizer.model",
      "vocab.json",        "merges.txt",             "vocab.txt",               "added_tokens.json",
      "generation_config.json", "chat_template.jinja", "config.json"};
  return files;
}

std::string sha256_hex(std::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 15]);
  }
  return out;
}

absl::StatusOr<TokenizerBundle> make_tokenizer_bundle(const std::string& model_path, const std::string& model_name) {
  namespace fs = std::filesystem;
  if (model_path.empty()) {
    return absl::NotFoundError(absl::StrCat("GetTokenizer: model '", model_name,
                                            "' is a synthetic preset without tokenizer files (no model_path)"));
  }
  bool has_tokenizer = false;
  for (const std::string& f : tokenizer_proper()) has_tokenizer = has_tokenizer || fs::is_regular_file(fs::path(model_path) / f);
  if (!has_tokenizer) {
    return absl::NotFoundError(absl::StrCat("GetTokenizer: ", model_path, " has no tokenizer file (none of ",
                                            absl::StrJoin(tokenizer_proper(), ", "), ")"));
  }
  ZipWriter zip;
  TokenizerBundle b;
  for (const std::string& f : tokenizer_bundle_files()) {
    const fs::path p = fs::path(model_path) / f;
    if (!fs::is_regular_file(p)) continue;
    std::ifstream in(p, std::ios::binary);
    if (!in.is_open()) return absl::UnavailableError(absl::StrCat("GetTokenizer: cannot read ", p.string()));
    std::ostringstream bytes;
    if (fs::file_size(p) > 0) bytes << in.rdbuf();
    if (auto st = zip.add(f, bytes.view()); !st.ok()) return st;
    b.files.push_back(f);
  }
  auto archive = zip.finish();
  if (!archive.ok()) return archive.status();
  b.zip = std::move(*archive);
  b.sha256 = sha256_hex(b.zip);
  return b;
}

}  // namespace kvfuse::server
