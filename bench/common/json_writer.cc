#include "bench/common/json_writer.h"

#include <cstdio>

namespace kvfuse::bench {

namespace {
std::string fixed(Fixed v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", v.decimals, v.value);
  return b;
}
}  // namespace

std::string json_quote(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", unsigned(c));
      out += b;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

JsonField::JsonField(std::string_view k, Fixed v) : key(k), json(fixed(v)) {}

std::string json_object(const std::vector<JsonField>& fields) {
  std::string body;
  for (const JsonField& f : fields) body += (body.empty() ? "" : ", ") + json_quote(f.key) + ": " + f.json;
  return "{" + body + "}";
}

std::string json_object(std::initializer_list<JsonField> fields) {
  return json_object(std::vector<JsonField>(fields));
}

void JsonResultsFile::raw(std::string_view key, std::string_view json) {
  fields_.push_back("  " + json_quote(key) + ": " + std::string(json));
}

void JsonResultsFile::number(std::string_view key, Fixed value) { raw(key, fixed(value)); }

void JsonResultsFile::rows(std::string_view key, const std::vector<std::string>& rows) {
  std::string a = "[\n";
  for (size_t i = 0; i < rows.size(); ++i) a += "    " + rows[i] + (i + 1 < rows.size() ? ",\n" : "\n");
  raw(key, a + "  ]");
}

std::string JsonResultsFile::text() const {
  std::string t = "{\n";
  for (size_t i = 0; i < fields_.size(); ++i) t += fields_[i] + (i + 1 < fields_.size() ? ",\n" : "\n");
  return t + "}\n";
}

bool JsonResultsFile::write(const std::string& path, const char* program) const {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "%s: cannot write %s\n", program, path.c_str());
    return false;
  }
  const std::string t = text();
  const bool ok = std::fwrite(t.data(), 1, t.size(), f) == t.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace kvfuse::bench
