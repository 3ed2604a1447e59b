// The JSON results files of the kernel benchmarks (bench/results/*.json), written by
// hand in one layout: a top-level object with a key per line, arrays with an object per
// line. json_object() builds one such object, fields in the order given, numbers with
// the decimals asked for (so files stay comparable from run to run).
#pragma once

#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvfuse::bench {

// `text` as a JSON string literal, quotes included.
std::string json_quote(std::string_view text);

// A number printed with `decimals` decimals ("%.*f").
struct Fixed {
  double value;
  int decimals;
};
// A value that is JSON already.
struct RawJson {
  std::string json;
};

// "key": value, the value an integer, a bool, a string, a Fixed or RawJson.
struct JsonField {
  template <std::integral T>
  JsonField(std::string_view k, T v)
      : key(k), json(std::is_same_v<T, bool> ? (v ? "true" : "false") : std::to_string(v)) {}
  JsonField(std::string_view k, std::string_view text) : key(k), json(json_quote(text)) {}
  JsonField(std::string_view k, Fixed v);
  JsonField(std::string_view k, RawJson v) : key(k), json(std::move(v.json)) {}
  std::string key, json;
};

// {"key": value, ...} on one line.
std::string json_object(std::initializer_list<JsonField> fields);
std::string json_object(const std::vector<JsonField>& fields);

// The file: "{\n  \"key\": value,\n ...}\n", arrays as "[\n    row,\n    row\n  ]".
class JsonResultsFile {
 public:
  void raw(std::string_view key, std::string_view json);
  void str(std::string_view key, std::string_view value) { raw(key, json_quote(value)); }
  void number(std::string_view key, Fixed value);
  void rows(std::string_view key, const std::vector<std::string>& rows);
  std::string text() const;
  // Writes the file; on failure prints "<program>: cannot write <path>" and returns false.
  bool write(const std::string& path, const char* program) const;

 private:
  std::vector<std::string> fields_;
};

}  // namespace kvfuse::bench
